"""Engine-agnostic ZeroMQ KV-cache transport: :class:`KVSender` and :class:`KVReceiver`.

Wire format: see :mod:`kvtransfer.wire` (msgpack header + raw tensor frames; no
pickle anywhere).

Sockets
-------
The receiver binds one ``ROUTER`` socket; every sender connects a ``DEALER``
(one per destination address, with a unique routing id per socket). ROUTER/DEALER
was chosen over PUSH/PULL + a separate ack socket because the control traffic
(flow-control credit, ``ack``/``nack``) flows back on the *same* connection: no
second port to allocate, advertise and firewall, no race between "data arrived"
and "ack socket connected", and the ROUTER's routing id tells the receiver which
sender a chunk came from, so one receiver serves any number of senders and a
sender only ever sees answers about its own transfers. Messages on one
connection are ordered, so when ``done`` arrives every earlier chunk of that
transfer has either been received or was lost/rejected -- counting is enough to
detect truncation.

Flow control
------------
Credit-based, in bytes, per connection; chosen over ZeroMQ high-water marks
because HWMs count messages, not bytes, apply per pipe on *both* ends (so the
real bound is their sum, plus kernel buffers), and a blocked HWM send cannot be
told apart from a dead peer. Here the HWMs are unlimited and credit is the one
bound. A new DEALER sends ``hello``; the receiver answers with
``credit(init=True, bytes=credit_bytes, max_message=...)``, the window
(default 64 MiB). Every payload-carrying message costs ``len(payload) +
MESSAGE_OVERHEAD`` bytes of credit; the sender blocks (each wait bounded by a
timeout, raising :class:`TransferTimeout`) when a chunk would exceed its
remaining credit. The receiver returns credit after a chunk has been
*consumed* (handed to the ``on_chunk`` callback, which has returned, or
stored) -- whatever became of it, malformed messages included -- in batches
of at least a quarter window (one small control message per ~16 MiB, not per
chunk). Chunks are clamped to half the window (and to the receiver's
``max_message``), so credit held back in a batch (< 1/4) can never starve the
sender. So at most ``credit_bytes`` of unconsumed data per sender sits in
ZeroMQ queues on either side, whatever the network or the receiver do; a
stalled receiver stalls the sender instead of growing memory. The receiver's
*accumulated* results (default mode) are bounded separately by
``max_held_bytes``, stale partial transfers are dropped after
``stale_after_s`` and uncollected results after ``result_ttl_s``.

Liveness: when a wait times out and the channel has not heard anything from the
receiver since the wait began, the sender closes that DEALER (dropping what is
queued), fails the other transfers that were in flight on it, and opens a fresh
one (new routing id, new ``hello``), so a restarted receiver on the same address
is picked up and a new transfer can proceed.

Acks
----
The receiver thread sends ``ack`` as soon as a transfer is complete (``done``
arrived, every announced chunk received and consumed), without waiting for the
consumer to call ``wait``: the data is then safely on the receiver (in the
result, or written by ``on_chunk``), and the prefill side can free its blocks
without depending on when the decode scheduler gets round to the request.

Performance (``scripts/bench_kv_transport.py``, 2-core VM, both ends in
separate processes): >= 80 % of raw ZeroMQ PUSH/PULL in the same message sizes
for 16 MB and 256 MB requests (32 layers each) over tcp and ipc; per-message
Python costs (~10 us sender, ~20 us receiver) dominate with small messages
(1 MB requests = 32 KB layers: ~50 %).

Threads and copies
------------------
:class:`KVReceiver` runs one background thread that owns its ROUTER socket;
``wait``/``discard``/``stats`` are thread-safe. :class:`KVSender` has no thread
of its own: the calling thread sends straight into ZeroMQ (whose own I/O thread
then writes to the network) under one lock, applies incoming credit/acks
whenever it runs, and sleeps on the socket's fd with the lock released while
it waits, so the methods are thread-safe. CPU payloads are sent zero-copy
(``copy=False``; ZeroMQ holds a reference until the bytes are written) and
received zero-copy (the received frames are the result's buffers); tensors on
an accelerator are staged through reusable pinned host buffers, tracked so a
buffer is reused only after ZeroMQ released it.

Public API (re-exported here)
-----------------------------
``KVSender(address=None, *, chunk_bytes, timeout, staging_slots, ctx, name)``
    ``send_layer(xfer_id, layer, blocks, data, dtype=None, shape=None, *, dest=None, timeout=None) -> int``,
    ``finish(xfer_id, timeout=None) -> SendResult``, ``finish_async(xfer_id, timeout=None)``,
    ``poll_finished() -> {xfer_id: SendResult | TransferError}``, ``abort(xfer_id, reason)``,
    ``begin(xfer_id, dest=None)``, ``connect(dest=None)``, ``pending()``, ``close()``, ``stats``.
``KVReceiver(address=None, *, port=0, on_chunk=None, credit_bytes, max_message_bytes, max_held_bytes,
stale_after_s, result_ttl_s, ctx, name)``
    ``address``, ``wait(xfer_id, timeout=None, *, drop_on_timeout=False) -> TransferResult``,
    ``ready(xfer_id)``, ``completed()``, ``discard(xfer_id)``, ``close()``, ``stats``.
``TransferResult(xfer_id, ok, error, chunks, nbytes, layers, elapsed_s)`` with
``layers[layer]: LayerData`` (``array()``, ``tensor()``, ``tobytes()``, ``blocks``, ``chunks``).
Errors: ``TransferError``, ``TransferTimeout`` (also a ``TimeoutError``), ``WireError``.
"""
from __future__ import annotations

from .auth import ClientKeys, KeysError, ServerKeys, generate_keys, is_loopback
from .common import (DEFAULT_CHUNK_BYTES, DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_CREDIT_BYTES, DEFAULT_HOST,
                     DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT_S, MESSAGE_OVERHEAD, DestinationUnavailable, Stats,
                     TransferError, TransferTimeout, free_port, normalize_dtype)
from .receiver import (DEFAULT_MAX_HELD_BYTES, DEFAULT_MAX_OPEN_TRANSFERS, DEFAULT_MAX_PEER_BYTES,
                       DEFAULT_RESULT_TTL_S, DEFAULT_STALE_AFTER_S, ChunkData, KVReceiver, LayerData, TransferResult)
from .sender import KVSender, SendResult, plan_chunks
from .wire import DTYPES, WireError

__all__ = [
    "KVSender", "KVReceiver", "SendResult", "TransferResult", "LayerData", "ChunkData",
    "TransferError", "TransferTimeout", "DestinationUnavailable", "WireError", "Stats", "DTYPES", "plan_chunks",
    "normalize_dtype", "free_port", "ServerKeys", "ClientKeys", "KeysError", "generate_keys", "is_loopback",
    "DEFAULT_CHUNK_BYTES", "DEFAULT_CREDIT_BYTES", "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_HOST", "MESSAGE_OVERHEAD", "DEFAULT_MAX_HELD_BYTES",
    "DEFAULT_MAX_PEER_BYTES", "DEFAULT_MAX_OPEN_TRANSFERS", "DEFAULT_STALE_AFTER_S", "DEFAULT_RESULT_TTL_S",
]
