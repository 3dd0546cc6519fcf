"""Engine-agnostic ZeroMQ KV-cache transport: :class:`KVSender` and :class:`KVReceiver`.

Wire format: see :mod:`proserve.kvtransfer.wire` (version 3: msgpack header + one raw
payload frame; no pickle anywhere). Keys and addresses: see :mod:`proserve.kvtransfer.auth`.

Pieces, chunks and packs
------------------------
A transfer is a set of *pieces*, each the KV one engine step computed for one
layer, named ``(step, layer)`` (``send_layer(..., step=)``; a prompt prefilled
in several chunks sends each layer once per step). A piece larger than
``pack_layer_bytes`` (64 KiB) goes out at once as one ``kv`` message per
chunk of at most ``chunk_bytes`` (4 MiB). Smaller pieces are copied into the
transfer's *pack* and travel together, one ``kv`` message of up to
``pack_bytes`` (1 MiB; at most ``chunk_bytes``), so that per-message costs
(a Python call, a header, a ZeroMQ message on each side) do not dominate
small transfers: a 1 MB request of 32 layers is one message instead of 32.
Below 64 KiB pyzmq copies a frame anyway, so packing adds no copy there;
larger layers go zero-copy (copying 128-256 KiB layers into packs measured
slower than sending them alone). A pack is sent when the next piece would not fit, by ``KVSender.flush``
(the vLLM connector calls it after every engine step) and before ``done``.
Pack buffers are reused once ZeroMQ has released them (fresh memory costs a
page fault per 4 KiB). ``pack_bytes=0`` turns packing off.

Sockets
-------
The receiver binds one ``ROUTER`` socket; every sender connects a ``DEALER``
(one per destination address, with an unguessable routing id per socket).
ROUTER/DEALER was chosen over PUSH/PULL + a separate ack socket because the
control traffic (flow-control credit, ``ack``/``nack``) flows back on the
*same* connection: no second port to allocate, advertise and firewall, no race
between "data arrived" and "ack socket connected", and the ROUTER's routing id
tells the receiver which sender a chunk came from, so one receiver serves any
number of senders and a sender only ever sees answers about its own transfers.
Messages on one connection are ordered, so when ``done`` arrives every earlier
chunk of that transfer has either been received or was lost/rejected --
counting is enough to detect truncation.

Ownership: the connection (routing id) that sends the first message naming a
transfer id owns it; a ``kv``, ``done`` or ``abort`` for it from any other
connection is rejected (``rejected["peer_mismatch"]``, ``nack`` to that
connection) and never touches the transfer or its stored result, also after it
completed. With CURVE only authenticated senders can connect at all.

Security
--------
``KVReceiver(curve=ServerKeys.load(dir))`` makes the ROUTER a CURVE server
(encryption + authentication) with a ZAP handler (a thread, on the receiver's
own ``zmq.Context``) that admits only the client public keys in
``dir/clients/``; the ZAP domain is enforced, so without a working handler
connections are refused (libzmq would otherwise admit any client that knows
the server key);
``KVSender(curve=ClientKeys.load(dir))`` makes every DEALER a CURVE client that
also checks the receiver's server key. A failed handshake is counted on both
sides (receiver ``auth_failures`` / ``handshake_failures``; the sender fails the
transfer at once with a message naming the likely key problem). Without keys
the receiver refuses to bind, and the sender to send to, anything that is not
loopback/ipc (:func:`proserve.kvtransfer.auth.is_loopback`) unless ``allow_insecure`` /
``allow_insecure_remote`` is passed. Keys: ``python -m proserve.kvtransfer.keys DIR``.

Flow control
------------
Credit-based, in bytes, per connection; chosen over ZeroMQ high-water marks
because HWMs count messages, not bytes, apply per pipe on *both* ends (so the
real bound is their sum, plus kernel buffers), and a blocked HWM send cannot be
told apart from a dead peer. A new DEALER sends ``hello`` (with the sender's
``layout``, which a receiver built with ``check_layout`` may ``refuse``); the
receiver answers with ``credit(init=True, bytes=credit_bytes, max_message=...)``,
the window (default 64 MiB). Every payload-carrying message costs ``len(payload) +
MESSAGE_OVERHEAD`` bytes of credit; the sender blocks (bounded by the
transfer's wait budget, raising :class:`TransferTimeout`) when a chunk would
exceed its remaining credit. The receiver returns credit after a chunk has been
*consumed* (handed to the ``on_chunk`` callback, which has returned, or
stored) -- whatever became of it, malformed messages included -- in batches
of at least a quarter window (one small control message per ~16 MiB, not per
chunk). Chunks are clamped to half the window (and to the receiver's
``max_message``), so credit held back in a batch (< 1/4) can never starve the
sender. So a well-behaved sender has at most ``credit_bytes`` of unconsumed
data in ZeroMQ queues on either side, whatever the network or the receiver
do; a stalled receiver stalls the sender instead of growing memory. The
HWMs below are only a backstop against senders that ignore credit.

Bounds (receiver)
-----------------
Each a ``KVReceiver`` argument; the ZeroMQ options are derived from them:

* ``max_open_transfers`` (1024): open transfers + stored uncollected results
  (a ``done`` for an unseen id, i.e. a transfer with no layers, counts too);
  beyond it a message starting a new one is refused (``nack``,
  ``rejected["too_many_transfers"]``). The ids of closed transfers (to refuse
  late chunks) are remembered in an LRU of ``max(4096, 8 *
  max_open_transfers)`` entries.
* ``max_held_bytes`` (2 GiB) total and ``max_peer_bytes`` (1 GiB) per
  connection of received, uncollected payload, each kept chunk counted with
  its bookkeeping (``receiver.chunk_held_bytes``: +2 KiB, +40 bytes per block
  id, so that chunks with no payload cannot grow memory either): a chunk over
  either fails its transfer (``receiver_full`` / ``peer_full``), others are
  unaffected.
* ``stale_after_s`` (30): an open transfer with no data that long fails;
  ``result_ttl_s`` (120): an uncollected result is dropped. Records of
  connections idle that long are forgotten (after returning any credit held
  back for them).
* ``max_message_bytes`` (64 MiB): header + payload of one message, checked in
  Python; ``ZMQ_MAXMSGSIZE = max_message_bytes + wire.MAX_HEADER_BYTES`` (a
  per-frame limit: libzmq drops a connection that sends a bigger frame before
  it is ever buffered whole). Frames beyond the third of a message are
  dropped as they are read.
* ``ZMQ_RCVHWM`` per connection ``= credit_bytes // MESSAGE_OVERHEAD + 2 *
  max_open_transfers + 64``: a well-behaved sender never has more than
  ``credit_bytes / MESSAGE_OVERHEAD`` payload messages in flight, plus about
  two control messages (``done``/``abort``) per transfer and a ``hello``; a
  peer flooding control messages (which cost no credit) is pushed back by
  ZeroMQ/TCP (inbound messages are never dropped at the HWM; libzmq stops
  reading that connection) instead of growing memory.
* ``ZMQ_SNDHWM`` per connection ``= 4 * max_open_transfers + 64``: replies
  (credit, ack, nack) to a peer that stops reading are dropped beyond that
  (``send_failures``) instead of queueing without bound.

What remains unbounded by these options is libzmq's own: a connection can
hold up to ``RCVHWM`` messages of up to ``MAXMSGSIZE`` each in its queue if it
ignores credit and the receiver thread cannot keep up (in practice the thread
discards such messages as fast as they arrive), and a single multipart message
is buffered whole by libzmq before delivery whatever its frame count. CURVE
(only admitted keys can connect) is the answer to both.

Liveness (receiver)
-------------------
One background thread owns the ROUTER; no message can end it: each message,
command and periodic task runs guarded (an unexpected exception is counted as
``internal_errors``, logged rate-limited, and the message dropped), every
transfer id a reply names is a validated one. ``KVReceiver.alive`` and
``KVReceiver.heartbeat`` (monotonic time of the thread's last loop; it goes
round at least every 100 ms) tell whether it runs; with ``heartbeat_path`` it
writes ``{"time", "pid", "address", "name", "closed", "stats"}`` as JSON to
that file about once a second (tmp + rename), for a health check in another
process. Gauges in ``stats`` (refreshed with it): ``held_bytes``,
``open_transfers``, ``stored_results``, ``peers``.

Wait budgets and the circuit breaker (sender)
---------------------------------------------
A transfer gets one budget of ``timeout`` seconds for all its waits together
(connection set-up, credit, the ack): each call for it blocks at most what is
left (a per-call ``timeout`` can only shorten it). Time between calls -- the
engine computing the next chunk of a long prompt -- is not counted, so a slow
chunked prefill does not expire, while a stalled receiver costs the caller
``timeout`` once per transfer. Once it failed (timeout,
``nack``, reset, refused), every later call for that id raises the stored
error at once -- a dead receiver costs one wait per transfer, not one per
layer -- until the caller finishes or aborts it (``MAX_FAILED_KEPT`` = 4096
failed ids are remembered). A new connection must get its credit grant within
``connect_timeout`` (2 s). Per destination address a circuit breaker opens
after a connect timeout, a transfer timeout with nothing heard from the
receiver for at least ``connect_timeout``, a connection reset, or a failed
handshake (the last two seen through a ZeroMQ socket monitor on the DEALER):
the DEALER is dropped (with what it queued), its transfers fail, and for
``breaker_cooldown_s`` (2 s, doubling per consecutive failure up to
``breaker_max_cooldown_s`` = 30 s) a new transfer to it raises
:class:`DestinationUnavailable` at once. Then one transfer is let through on a
fresh DEALER (half-open; others are refused meanwhile); its credit grant closes
the breaker, a failure reopens it. ``KVSender.destinations()`` /
``destination_ok(addr)`` report the state.

Acks
----
The receiver thread sends ``ack`` as soon as a transfer is complete (``done``
arrived, every announced chunk received and consumed), without waiting for the
consumer to call ``wait``: the data is then safely on the receiver (in the
result, or written by ``on_chunk``), and the prefill side can free its blocks
without depending on when the decode scheduler gets round to the request.

Performance: ``scripts/bench_kv_transport.py`` compares the transport with
raw ZeroMQ PUSH/PULL sending the same layers, both ends in separate
processes; figures and the command in ``docs/results.md`` (section 8.3). On
the 2-core VM, per-message Python costs (tens of microseconds a side) are
what packing amortises at 1 MB. ``--curve`` adds kvtransfer with CURVE
encryption to the same run: libzmq encrypts and decrypts on its I/O thread,
one pass per message on each side, which made CURVE transfers several times
slower than plain ones on the 2-core VM -- plan for it where KV crosses hosts.

Threads and copies
------------------
:class:`KVReceiver` runs one background thread that owns its ROUTER socket;
``wait``/``discard``/``stats`` are thread-safe. :class:`KVSender` has no thread
of its own: the calling thread sends straight into ZeroMQ (whose own I/O thread
then writes to the network) under one lock, applies incoming credit/acks
whenever it runs, and sleeps on the socket's fd with the lock released while
it waits, so the methods are thread-safe. CPU payloads are sent zero-copy
(``copy=False``; ZeroMQ holds a reference until the bytes are written) and
received zero-copy (the received frames are the result's buffers: the vLLM
connector copies them once, straight into the paged cache, see
:mod:`proserve.kvtransfer.kvcache`); small layers are copied once into a pack;
tensors on an accelerator are staged through reusable pinned host buffers,
tracked so a buffer is reused only after ZeroMQ released it.

Public API (re-exported here)
-----------------------------
``KVSender(address=None, *, chunk_bytes=4 MiB, pack_bytes=1 MiB, pack_layer_bytes=64 KiB, timeout=30.0,
connect_timeout=2.0, breaker_cooldown_s=2.0, breaker_max_cooldown_s=30.0, staging_slots=2,
curve: ClientKeys | None = None, allow_insecure_remote=False, ctx=None, name=None)``
    ``begin(xfer_id, dest=None)``,
    ``send_layer(xfer_id, layer, blocks, data, dtype=None, shape=None, *, step=0, dest=None, timeout=None) -> int``,
    ``flush(xfer_id, timeout=None)``,
    ``finish(xfer_id, timeout=None, *, digest="") -> SendResult``,
    ``finish_async(xfer_id, timeout=None, *, digest="")``,
    ``poll_finished() -> {xfer_id: SendResult | TransferError}``, ``abort(xfer_id, reason)``,
    ``destinations() -> {addr: {state, failures, last_error, open_until, connected, inflight_bytes}}``,
    ``destination_ok(addr=None) -> bool``, ``connect(dest=None)``, ``pending()``, ``close()``, ``stats``.
``KVReceiver(address=None, *, port=0, on_chunk=None, credit_bytes, max_message_bytes=64 MiB,
max_held_bytes=2 GiB, max_peer_bytes=1 GiB, max_open_transfers=1024, stale_after_s=30.0, result_ttl_s=120.0,
curve: ServerKeys | None = None, allow_insecure=False, heartbeat_path=None, ctx=None, name=None)``
    ``address``, ``wait(xfer_id, timeout=None, *, drop_on_timeout=False) -> TransferResult``,
    ``ready(xfer_id)``, ``completed()``, ``discard(xfer_id)``, ``alive``, ``heartbeat``, ``close()``,
    ``stats`` (:class:`Stats`; ``snapshot()`` -> dict).
``TransferResult(xfer_id, ok, error, chunks, nbytes, pieces, elapsed_s, digest)`` with
``pieces[step, layer]: LayerData`` (``array()``, ``tensor()``, ``tobytes()``, ``blocks``, ``chunks``,
``step``, ``layer``), ``layer_array(layer, step=0)``, ``layer_bytes(layer, step=0)``.
Errors: ``TransferError``, ``TransferTimeout`` (also a ``TimeoutError``), ``DestinationUnavailable``,
``WireError``. Keys: ``ServerKeys``, ``ClientKeys``, ``KeysError``, ``generate_keys``, ``is_loopback``.
"""
from __future__ import annotations

from .auth import ClientKeys, KeysError, ServerKeys, generate_keys, is_loopback
from .common import (
                     DEFAULT_CHUNK_BYTES,
                     DEFAULT_CONNECT_TIMEOUT_S,
                     DEFAULT_CREDIT_BYTES,
                     DEFAULT_HOST,
                     DEFAULT_MAX_MESSAGE_BYTES,
                     DEFAULT_PACK_BYTES,
                     DEFAULT_PACK_LAYER_BYTES,
                     DEFAULT_TIMEOUT_S,
                     MESSAGE_OVERHEAD,
                     DestinationUnavailable,
                     Stats,
                     TransferError,
                     TransferTimeout,
                     free_port,
                     normalize_dtype,
)
from .receiver import (
                     DEFAULT_MAX_HELD_BYTES,
                     DEFAULT_MAX_OPEN_TRANSFERS,
                     DEFAULT_MAX_PEER_BYTES,
                     DEFAULT_RESULT_TTL_S,
                     DEFAULT_STALE_AFTER_S,
                     ChunkData,
                     KVReceiver,
                     LayerData,
                     TransferResult,
)
from .sender import KVSender, SendResult, plan_chunks
from .wire import DTYPES, WireError

__all__ = [
    "KVSender", "KVReceiver", "SendResult", "TransferResult", "LayerData", "ChunkData",
    "TransferError", "TransferTimeout", "DestinationUnavailable", "WireError", "Stats", "DTYPES", "plan_chunks",
    "normalize_dtype", "free_port", "ServerKeys", "ClientKeys", "KeysError", "generate_keys", "is_loopback",
    "DEFAULT_CHUNK_BYTES", "DEFAULT_PACK_BYTES", "DEFAULT_PACK_LAYER_BYTES", "DEFAULT_CREDIT_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TIMEOUT_S",
    "DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_HOST", "MESSAGE_OVERHEAD", "DEFAULT_MAX_HELD_BYTES",
    "DEFAULT_MAX_PEER_BYTES", "DEFAULT_MAX_OPEN_TRANSFERS", "DEFAULT_STALE_AFTER_S", "DEFAULT_RESULT_TTL_S",
]
