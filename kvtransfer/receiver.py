"""Consumer side of the KV transport: :class:`KVReceiver` and the transfer results
(see ``proserve.kvtransfer.transport`` for the socket and flow-control design)."""
from __future__ import annotations

import collections
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from proserve.scheduler import validate

from . import wire
from .auth import ServerKeys, is_loopback
from .common import (
    DEFAULT_CREDIT_BYTES,
    DEFAULT_HOST,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    MESSAGE_OVERHEAD,
    MIN_CREDIT_BYTES,
    MIN_MAX_MESSAGE_BYTES,
    Stats,
    TransferError,
    TransferTimeout,
    accepts_kwargs,
    log,
    log_reject,
    numpy_dtype,
    worth_logging,
)
from .wire import DTYPES, SENDER_KINDS, WireError

_POLL_MS = 100  # the receiver thread goes round its loop at least this often (heartbeat)
_EMPTY = memoryview(b"")


@dataclass
class ChunkData:
    """One received part: chunk ``seq`` of a piece, at byte ``offset`` in it."""
    seq: int
    offset: int
    shape: tuple
    blocks: list
    data: memoryview        # its bytes (a zero-copy view of the received frame; empty with on_chunk)


@dataclass
class LayerData:
    """One piece of a transfer: the KV engine step ``step`` computed for layer ``layer``."""
    layer: int
    dtype: str
    shape: tuple            # the whole piece
    chunks: list            # [ChunkData] by seq
    nbytes: int = 0
    step: int = 0

    @property
    def blocks(self) -> list[int]:
        """Block ids of the layer (sender's numbering), reassembled from the chunks:
        concatenated when the layer was split along a leading block axis (each
        chunk carries its rows' ids), else the list every chunk carries."""
        if not self.chunks:
            return []
        cs = self.chunks
        if len(cs) > 1 and self.shape and all(
                len(c.blocks) == c.shape[0] and tuple(c.shape[1:]) == self.shape[1:] for c in cs) \
                and sum(len(c.blocks) for c in cs) == self.shape[0]:
            return [b for c in cs for b in c.blocks]
        return list(cs[0].blocks)

    def tobytes(self) -> bytes:
        return b"".join(bytes(c.data) for c in self.chunks)

    def _host_bytes(self) -> np.ndarray:
        out = np.empty(self.nbytes, dtype=np.uint8)
        for c in self.chunks:
            out[c.offset:c.offset + c.data.nbytes] = np.frombuffer(c.data, dtype=np.uint8)
        return out

    def array(self) -> np.ndarray:
        """numpy array of the layer (a zero-copy view when it came in one chunk)."""
        dt = numpy_dtype(self.dtype)
        if len(self.chunks) == 1:
            return np.frombuffer(self.chunks[0].data, dtype=dt).reshape(self.shape)
        return self._host_bytes().view(dt).reshape(self.shape)

    def tensor(self):
        """CPU torch tensor of the layer (a copy)."""
        import torch
        raw = torch.from_numpy(self._host_bytes())
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape)


@dataclass
class TransferResult:
    xfer_id: str
    ok: bool
    error: str | None
    chunks: int
    nbytes: int
    #: (step, layer) -> LayerData; empty with on_chunk or on error
    pieces: dict = field(default_factory=dict)
    elapsed_s: float = 0.0                       # first message -> done
    digest: str = ""                             # the sender's opaque 'done' digest (see kvtransfer.wire)

    def raise_for_error(self) -> "TransferResult":
        if not self.ok:
            raise TransferError(f"transfer {self.xfer_id!r} failed: {self.error}")
        return self

    def layer_array(self, layer: int, step: int = 0) -> np.ndarray:
        return self.pieces[step, layer].array()

    def layer_bytes(self, layer: int, step: int = 0) -> bytes:
        return self.pieces[step, layer].tobytes()


@dataclass(slots=True, eq=False)
class _RxTransfer:
    """An open (partial) transfer, owned by the peer that sent its first message."""
    xfer_id: str
    peer: bytes             # routing id of the owning connection
    t0: float               # first message (monotonic)
    last: float             # last data (monotonic; stale_after_s counts from it)
    pieces: dict = field(default_factory=dict)   # (step, layer) -> LayerData
    chunks: int = 0         # parts received
    nbytes: int = 0         # payload bytes received
    held: int = 0           # what its kept chunks count in _held / _peer_held (see chunk_held_bytes)


class _Peer:
    """Receiver-thread bookkeeping of one connection (routing id)."""
    __slots__ = ("credit", "last_seen")

    def __init__(self, now: float):
        self.credit = 0          # consumed credit not yet returned (less than a batch)
        self.last_seen = now


class _Stored(NamedTuple):
    """An uncollected final result."""
    at: float                   # when it was stored (for result_ttl_s)
    result: TransferResult
    peer: bytes | None          # the owner (None: closed by the receiver itself)
    held: int                   # what it keeps (counted in _held and _peer_held; chunk_held_bytes)


class _ZapHandler:
    """A minimal ZAP handler (ZeroMQ RFC 27) for one receiver's context: admits
    CURVE clients whose public key is allowed, refuses everything else.

    A plain thread with a bounded poll (pyzmq's ThreadAuthenticator runs an
    asyncio loop whose ``stop()`` joins it without a timeout; under load that
    join could hang ``close()``)."""
    ENDPOINT = "inproc://zeromq.zap.01"

    def __init__(self, ctx: zmq.Context, allowed_z85: frozenset, stats: Stats, name: str):
        self.allowed = frozenset(z85.decode(k) for k in allowed_z85)  # binary, as ZAP passes them
        self.stats = stats
        self.name = name
        self.denied = 0
        self._stop = threading.Event()
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.ENDPOINT)  # before the ROUTER exists: no handshake goes unchecked
        self.thread = threading.Thread(target=self._run, name=f"{name}-zap", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock = self.sock
        try:
            while not self._stop.is_set():
                if sock.poll(_POLL_MS):
                    sock.send_multipart(self._answer(sock.recv_multipart()))
        except Exception:
            log.exception("kvtransfer receiver %s: ZAP handler failed; new connections will be refused",
                          self.name)
        finally:
            sock.close(0)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        request_id = msg[1] if len(msg) > 1 else b""
        # version, request id, domain, address, routing id, mechanism, client public key
        if len(msg) == 7 and msg[0] == b"1.0" and msg[5] == b"CURVE" and msg[6] in self.allowed:
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        self.denied += 1
        self.stats.add("auth_failures")
        if worth_logging(self.denied):
            log.warning("kvtransfer receiver %s: refused a connection whose CURVE client key is not among the "
                        "allowed clients (%d refused so far)", self.name, self.denied)
        return [b"1.0", request_id, b"400", b"client key not allowed", b"", b""]

    def stop(self) -> bool:
        """Stop the thread; True when it ended (its socket is closed)."""
        self._stop.set()
        self.thread.join(timeout=5)
        return not self.thread.is_alive()


DEFAULT_MAX_HELD_BYTES = 2 << 30
DEFAULT_MAX_PEER_BYTES = 1 << 30
DEFAULT_MAX_OPEN_TRANSFERS = 1024
DEFAULT_STALE_AFTER_S = 30.0
DEFAULT_RESULT_TTL_S = 120.0
CONTROL_ALLOWANCE = 64          # control messages (hello, ...) budgeted per connection beyond the data
HEARTBEAT_INTERVAL_S = 1.0

#: What a kept chunk costs beyond its payload (its header's Python objects, the ZeroMQ
#: frame, its LayerData), and per block id it carries (a list slot and an int object).
#: Counted in the held bytes, so that chunks with little or no payload (or a header of
#: a million block ids) cannot grow memory past max_held_bytes / max_peer_bytes.
CHUNK_OVERHEAD_BYTES = 2048
BLOCK_ID_BYTES = 40


def chunk_held_bytes(payload_bytes: int, n_blocks: int) -> int:
    """What one kept chunk counts against the receiver's memory caps."""
    return payload_bytes + CHUNK_OVERHEAD_BYTES + BLOCK_ID_BYTES * n_blocks


_RECEIVER_STATS = ("bytes_received", "chunks_received", "messages_received", "transfers_completed",
                   "transfers_failed", "transfers_aborted", "transfers_abandoned", "transfers_stale",
                   "results_expired", "acks_sent", "nacks_sent", "credit_messages", "send_failures",
                   "wait_timeouts", "held_bytes_max", "late_done", "internal_errors", "auth_failures",
                   "handshake_failures", "heartbeat_write_errors", "senders_refused",
                   # gauges, refreshed about once a second by the receiver thread
                   "held_bytes", "open_transfers", "stored_results", "peers")
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class KVReceiver:
    """Consumer side: binds a ROUTER socket and serves any number of senders from a
    background thread.

    ``address`` defaults to ``tcp://127.0.0.1:<port>`` (``port=0``: an ephemeral
    port; see :attr:`address` for the bound endpoint); ``ipc://`` paths work too.
    Binding a non-loopback address (see :func:`proserve.kvtransfer.auth.is_loopback`)
    needs CURVE keys (``curve=ServerKeys.load(dir)``: encrypted, and only the
    allowed client keys can connect), or ``allow_insecure=True``.

    With ``on_chunk=None`` the chunks of each transfer are kept (zero-copy
    ZeroMQ frames) and handed over by :meth:`wait` as a :class:`TransferResult`.
    Otherwise ``on_chunk(xfer_id, layer, seq, blocks, buf, dtype, shape)`` is
    called on the receiver thread for every chunk (every part of a message;
    ``buf`` is a memoryview valid during the call: copy it into the destination
    KV blocks); each of the keywords ``offset`` (byte offset of the chunk in its
    piece), ``layer_shape`` (the whole piece's shape) and ``step`` (the engine
    step of the piece) is passed too if the callable accepts it (or
    ``**kwargs``). An exception from the callback fails that transfer. The
    ``ack`` that lets the sender free its blocks goes out as soon as the
    transfer is complete (all chunks received and consumed), from the receiver
    thread.

    Bounds (each a constructor argument; see ``proserve.kvtransfer.transport`` for how
    the ZeroMQ options derive from them):

    ``max_open_transfers`` (1024)
        open (partial) transfers plus stored uncollected results; a message
        that would start another one is rejected (``nack``, counted as
        ``rejected["too_many_transfers"]``), the existing ones keep working.
    ``max_held_bytes`` (2 GiB) / ``max_peer_bytes`` (1 GiB)
        received but uncollected payload, in total / per connection, each
        chunk counted with its bookkeeping (:func:`chunk_held_bytes`: +2 KiB,
        +40 bytes per block id; with ``on_chunk`` only the bookkeeping, as the
        payload is not kept); a chunk over either fails its transfer
        (``receiver_full`` / ``peer_full``).
    ``max_message_bytes`` (64 MiB)
        header + payload of one message.
    ``stale_after_s`` (30) / ``result_ttl_s`` (120)
        open transfers with no data for that long fail (``stale``); results
        nobody collected are dropped after that long.

    Layout check: with ``check_layout``, every new connection's ``hello``
    carries the sender's layout string (:mod:`proserve.kvtransfer.wire`), and
    ``check_layout(layout)`` returns why this receiver cannot take that
    sender's KV, or None; a reason is answered with ``refuse`` (the sender
    fails its transfers with it) and counted as ``senders_refused``. It
    catches a misconfigured peer at the first contact; it does not
    authenticate (CURVE does).

    Liveness: the thread survives any message (an unexpected error while
    handling one is counted as ``internal_errors``, logged, and the message
    dropped). :attr:`alive` tells whether it runs, :attr:`heartbeat` when it
    last went round its loop (``time.monotonic()``; at least every 100 ms);
    with ``heartbeat_path`` it also writes ``{"time", "pid", "address",
    "name", "closed", "stopped", "stats"}`` (and the entries of ``info``) as JSON to that file about once a
    second (atomically), for a health check in another process. A receiver
    that can no longer receive says so in the file at once rather than by
    falling silent: ``closed`` after :meth:`close`, ``stopped`` (the reason)
    when its thread ended on an error or, with CURVE, its ZAP handler died.
    Only a thread that hangs is left to the file's age.
    """

    def __init__(self, address: str | None = None, *, port: int = 0,
                 on_chunk: Callable[..., Any] | None = None,
                 credit_bytes: int = DEFAULT_CREDIT_BYTES,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
                 max_peer_bytes: int = DEFAULT_MAX_PEER_BYTES,
                 max_open_transfers: int = DEFAULT_MAX_OPEN_TRANSFERS,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S, result_ttl_s: float = DEFAULT_RESULT_TTL_S,
                 curve: ServerKeys | None = None, allow_insecure: bool = False,
                 heartbeat_path: str | os.PathLike | None = None,
                 check_layout: Callable[[str], str | None] | None = None, info: dict | None = None,
                 ctx: zmq.Context | None = None, name: str | None = None):
        W = "KVReceiver"
        validate.integer(W, "credit_bytes", credit_bytes, MIN_CREDIT_BYTES)   # senders refuse smaller grants
        validate.integer(W, "max_message_bytes", max_message_bytes, MIN_MAX_MESSAGE_BYTES)
        for arg, v in (("max_held_bytes", max_held_bytes), ("max_peer_bytes", max_peer_bytes),
                       ("max_open_transfers", max_open_transfers)):
            validate.integer(W, arg, v)
        validate.positive(W, "stale_after_s", stale_after_s)
        validate.positive(W, "result_ttl_s", result_ttl_s)
        if address is None:
            address = f"tcp://{DEFAULT_HOST}:{port if port else '*'}"
        if curve is None and not allow_insecure and not is_loopback(address):
            raise ValueError(f"KVReceiver: refusing to bind {address} without CURVE keys: anyone who can reach "
                             "it could read and inject KV data. Pass curve=ServerKeys.load(dir) (keys from "
                             "`python -m proserve.kvtransfer.keys DIR`), or allow_insecure=True on a trusted network")
        if curve is not None and ctx is not None:
            raise ValueError("KVReceiver: curve= needs the receiver's own zmq.Context (ZAP authentication is "
                             "per context); do not pass ctx= with it")
        self.credit_bytes = int(credit_bytes)
        self._credit_batch = max(1, self.credit_bytes // 4)
        self.max_message_bytes = int(max_message_bytes)
        self.max_held_bytes = int(max_held_bytes)
        self.max_peer_bytes = int(max_peer_bytes)
        self.max_open_transfers = int(max_open_transfers)
        self.stale_after_s = float(stale_after_s)
        self.result_ttl_s = float(result_ttl_s)
        # ZeroMQ limits derived from the caps (see kvtransfer.transport, "Bounds")
        self.rcvhwm = self.credit_bytes // MESSAGE_OVERHEAD + 2 * self.max_open_transfers + CONTROL_ALLOWANCE
        self.sndhwm = 4 * self.max_open_transfers + CONTROL_ALLOWANCE
        self.max_frame_bytes = self.max_message_bytes + wire.MAX_HEADER_BYTES
        self._closed_keep = max(4096, 8 * self.max_open_transfers)
        self.name = name or f"kvreceiver-{uuid.uuid4().hex[:8]}"
        self.heartbeat_path = os.fspath(heartbeat_path) if heartbeat_path is not None else None
        self.curve = curve is not None
        self._on_chunk = on_chunk
        self._check_layout = check_layout
        self._info = dict(info or {})   # shown in the heartbeat file (e.g. the layout senders must match)
        self._refused = 0
        # the optional keywords on_chunk takes (offset, layer_shape, step)
        self._chunk_kwargs = tuple(k for k in ("offset", "layer_shape", "step")
                                   if on_chunk is not None and accepts_kwargs(on_chunk, (k,)))
        self.stats = Stats(*_RECEIVER_STATS)
        self._cond = threading.Condition()
        self._results: dict[str, _Stored] = {}           # guarded by _cond
        self._held = 0                                    # guarded by _cond
        self._peer_held: dict[bytes, int] = {}            # guarded by _cond
        self._open: dict[str, _RxTransfer] = {}          # receiver thread only
        self._closed_ids: collections.OrderedDict = collections.OrderedDict()  # xfer -> (how, owner); thread only
        self._peers: dict[bytes, _Peer] = {}             # receiver thread only
        self._cmds: collections.deque = collections.deque()
        self._closing = False
        self._closed = False
        self._internal_errors = 0
        self._handshake_failures = 0
        self.heartbeat = time.monotonic()

        self._own_ctx = curve is not None
        self._ctx = zmq.Context() if self._own_ctx else (ctx or zmq.Context.instance())
        self._auth = None
        self._sock = self._monitor = self._wake_w = None
        self._wake_lock = threading.Lock()
        try:
            self._setup_sockets(address, curve)
        except BaseException:
            self._teardown(thread_ended=True)
            raise
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _setup_sockets(self, address: str, curve: ServerKeys | None) -> None:
        if curve is not None:
            self._auth = _ZapHandler(self._ctx, curve.allowed_clients, self.stats, self.name)
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # unroutable replies raise instead of vanishing
        sock.setsockopt(zmq.SNDHWM, self.sndhwm)   # a peer that stops reading loses replies, not our memory
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)   # beyond it ZeroMQ/TCP push back on that peer
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # libzmq drops a peer sending a bigger frame
        if curve is not None:
            sock.curve_server = True
            sock.curve_publickey = curve.public
            sock.curve_secretkey = curve.secret
            # fail closed: without a ZAP handler libzmq would admit any client that
            # knows the server key; with these it refuses instead
            sock.setsockopt(zmq.ZAP_DOMAIN, b"kvtransfer")
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        mon = f"inproc://{self.name}-monitor-{uuid.uuid4().hex}"
        sock.monitor(mon, _HANDSHAKE_FAILED)
        self._monitor = self._ctx.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(mon)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            raise OSError(f"KVReceiver: cannot bind {address}: {e}") from None
        self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # other threads wake the receiver thread through the same ROUTER, over an
        # in-process endpoint, so that thread can simply block in recv
        wake = f"inproc://{self.name}-{uuid.uuid4().hex}"
        sock.bind(wake)
        self._wake_id = b"\x00wake-" + uuid.uuid4().bytes  # routing ids from the network never start with 0
        self._wake_w = self._ctx.socket(zmq.DEALER)
        self._wake_w.setsockopt(zmq.IDENTITY, self._wake_id)
        self._wake_w.setsockopt(zmq.LINGER, 0)
        self._wake_w.setsockopt(zmq.SNDHWM, 64)
        self._wake_w.connect(wake)

    # ---- public API

    @property
    def alive(self) -> bool:
        """The receiver thread (and, with CURVE, its ZAP handler, without which every
        connection is refused) is running and :meth:`close` was not called."""
        return (self._thread.is_alive() and not self._closing
                and (self._auth is None or self._auth.thread.is_alive()))

    def wait(self, xfer_id: str, timeout: float | None = None, *, drop_on_timeout: bool = False) -> TransferResult:
        """Block until ``xfer_id`` is final: complete (``ok``), or failed (aborted,
        truncated, rejected: ``ok=False`` with ``error``; partial data dropped).
        Raises :class:`TransferTimeout` after ``timeout`` s (default 30) without a
        final outcome; the receiver keeps serving, and with
        ``drop_on_timeout=True`` the transfer is abandoned (partial data dropped,
        later chunks rejected, the sender nacked)."""
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while xfer_id not in self._results:
                if self._closed:
                    raise TransferError(f"receiver {self.address} is closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.stats.add("wait_timeouts")
                    t = self._open.get(xfer_id)
                    got = (f"{t.chunks} chunks / {t.nbytes} bytes received so far, no 'done'"
                           if t is not None else "nothing received for it")
                    if drop_on_timeout:
                        self._cmds.append(("abandon", xfer_id))
                        self._wake()
                    raise TransferTimeout(f"KV transfer {xfer_id!r} did not complete within {timeout:.3g} s "
                                          f"on {self.address} ({got})")
                self._cond.wait(remaining)
            return self._pop_result(xfer_id)

    def ready(self, xfer_id: str) -> bool:
        """True when :meth:`wait` would return at once."""
        with self._cond:
            return xfer_id in self._results

    def take(self, xfer_id: str) -> TransferResult | None:
        """The final outcome of ``xfer_id`` if there is one now (collected, as by
        :meth:`wait`), else None. Never raises or blocks: for a caller polling on
        the engine's thread, where a result could expire or be withdrawn between
        :meth:`ready` and :meth:`wait`."""
        with self._cond:
            return self._pop_result(xfer_id) if xfer_id in self._results else None

    def wait_any(self, xfer_ids, timeout: float) -> bool:
        """Block (the interpreter released: the receiver thread runs meanwhile) until one
        of ``xfer_ids`` has a final outcome, at most ``timeout`` s; True if one has."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(x in self._results for x in xfer_ids):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)
            return True

    def completed(self) -> list[str]:
        """Transfer ids with a final outcome not yet collected by :meth:`wait`."""
        with self._cond:
            return list(self._results)

    def discard(self, xfer_id: str) -> None:
        """Give up on ``xfer_id``: drop its data (partial or complete), reject and nack
        anything that still arrives for it."""
        with self._cond:
            self._pop_result(xfer_id)
            self._cmds.append(("abandon", xfer_id))
        self._wake()

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
        self._wake()
        self._thread.join(timeout=5)
        ended = not self._thread.is_alive()
        if not ended:
            log.error("kvtransfer receiver %s: thread did not stop within 5 s (stuck in on_chunk?); "
                      "leaving its sockets open", self.name)
        self._teardown(thread_ended=ended)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._write_heartbeat(closed=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _teardown(self, thread_ended: bool) -> None:
        if self._wake_w is not None:
            with self._wake_lock:
                self._wake_w.close(0)
        if not thread_ended:
            return
        for s in (self._sock, self._monitor):
            if s is not None and not s.closed:
                s.close(0)
        auth_ended = True
        if self._auth is not None:
            auth_ended = self._auth.stop()
            self._auth = None
        if self._own_ctx:
            if not auth_ended:  # term() would wait for the ZAP socket forever
                log.error("kvtransfer receiver %s: ZAP thread did not stop; leaving its context open", self.name)
                return
            # every socket of this context is closed, so term() returns at once; bounded all the same
            term = threading.Thread(target=self._ctx.term, name=f"{self.name}-term", daemon=True)
            term.start()
            term.join(timeout=5)
            if term.is_alive():
                log.error("kvtransfer receiver %s: zmq context did not terminate within 5 s", self.name)

    def _pop_result(self, xfer_id: str) -> TransferResult | None:
        # caller holds self._cond
        item = self._results.pop(xfer_id, None)
        if item is None:
            return None
        if item.held:
            self._release(item.peer, item.held)
        return item.result

    def _release(self, peer: bytes | None, n: int) -> None:
        # caller holds self._cond: n payload bytes of peer's are no longer held
        self._held -= n
        left = self._peer_held.get(peer, 0) - n
        if left > 0:
            self._peer_held[peer] = left
        else:
            self._peer_held.pop(peer, None)

    # ---- receiver thread

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w is None or self._wake_w.closed:
                return
            try:
                self._wake_w.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _run(self) -> None:
        sock = self._sock
        sock.setsockopt(zmq.RCVTIMEO, _POLL_MS)
        next_tick = 0.0  # at once: the first heartbeat file
        try:
            while not self._closing:
                now = self.heartbeat = time.monotonic()
                if now >= next_tick:
                    self._guarded(self._tick, now)
                    next_tick = now + HEARTBEAT_INTERVAL_S
                try:
                    msg = self._recv(sock)
                except zmq.Again:  # idle
                    msg = None
                if self._cmds:  # before the next message: e.g. an abandon precedes a late 'done'
                    self._guarded(self._run_commands)
                if msg is not None and msg[0] != self._wake_id:
                    self._guarded(self._on_message, *msg)
        except Exception as e:
            log.exception("kvtransfer receiver %s: thread ended by a socket error", self.name)
            self._write_heartbeat(stopped=f"receiver thread ended: {type(e).__name__}: {e}")
        finally:
            sock.close(0)
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _guarded(self, fn: Callable, *args) -> None:
        """Run one unit of the thread's work; an unexpected exception is counted,
        logged (rate-limited) and dropped, never the end of the thread."""
        try:
            fn(*args)
        except Exception:
            self._internal_errors += 1
            self.stats.add("internal_errors")
            if worth_logging(self._internal_errors):
                log.exception("kvtransfer receiver %s: internal error in %s (message dropped; %d so far)",
                              self.name, getattr(fn, "__name__", fn), self._internal_errors)

    @staticmethod
    def _recv(sock: zmq.Socket) -> tuple[bytes, list, int]:
        """One message: (routing id, up to 3 body frames, bytes of any further
        frames, which are dropped as they are read). Raises zmq.Again when idle."""
        first = sock.recv(copy=False)
        body: list = []
        extra = 0
        more = first.more
        while more:
            f = sock.recv(copy=False)
            more = f.more
            if len(body) < 3:  # header + payload, and one more to tell "too many"
                body.append(f)
            else:
                extra += len(f)
        return first.bytes, body, extra

    def _run_commands(self) -> None:
        with self._cond:
            cmds, self._cmds = self._cmds, collections.deque()
        for op, x in cmds:
            if op == "abandon":
                self._guarded(self._abandon, x)

    def _send(self, peer: bytes, header: bytes) -> None:
        try:
            self._sock.send_multipart([peer, header], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone) or EAGAIN (its pipe is full: it stopped reading)
            self.stats.add("send_failures")
            log.debug("kvtransfer receiver: reply to %r dropped: %s", peer, e)

    def _nack(self, peer: bytes, xfer: str, reason: str) -> None:
        """Tell ``peer`` (only ever the sender of the message at hand) that ``xfer`` failed."""
        try:
            header = wire.encode("nack", xfer=xfer, reason=reason[:wire.MAX_REASON_LEN])
        except WireError:  # not a valid id: nothing the peer could match it to
            return
        self._send(peer, header)
        self.stats.add("nacks_sent")

    def _on_message(self, peer: bytes, body: list, extra_bytes: int) -> None:
        rec = self._peers.get(peer)
        if rec is None:
            rec = self._peers[peer] = _Peer(self.heartbeat)
        rec.last_seen = self.heartbeat
        # payload-carrying messages are charged whatever becomes of them
        cost = sum(map(len, body[1:])) + extra_bytes + MESSAGE_OVERHEAD if len(body) > 1 else 0
        try:
            self._handle(peer, body)
        finally:
            if cost:
                self._charge(peer, rec, cost)

    def _charge(self, peer: bytes, rec: _Peer, n: int) -> None:
        # return consumed credit in batches of >= a quarter window (the sender's
        # chunks are at most half a window, so holding back less than a quarter
        # can never starve it)
        n += rec.credit
        if n >= self._credit_batch:
            rec.credit = 0
            self._send(peer, wire.encode("credit", bytes=n, init=False, max_message=self.max_message_bytes))
            self.stats.add("credit_messages")
        else:
            rec.credit = n

    def _handle(self, peer: bytes, body: list) -> None:
        self.stats.c["messages_received"] += 1
        try:
            msg = wire.decode(body, SENDER_KINDS, self.max_message_bytes)
        except WireError as e:
            self._reject(peer, e.reason, e.detail, e.xfer, fail=True)
            return
        kind = msg.kind
        if kind == "kv":
            self._on_kv(peer, msg)
        elif kind == "done":
            self._on_done(peer, msg.header)
        elif kind == "abort":
            self._on_abort(peer, msg.header)
        else:  # hello
            why = self._layout_problem(msg.header["layout"])
            if why is not None:
                self._refuse(peer, why)
                return
            self._send(peer, wire.encode("credit", bytes=self.credit_bytes, init=True,
                                         max_message=self.max_message_bytes))

    def _layout_problem(self, layout: str) -> str | None:
        """Why this receiver takes no KV from a sender of ``layout`` (None: it does)."""
        if self._check_layout is None:
            return None
        try:
            why = self._check_layout(layout)
        except Exception as e:   # a check that fails refuses, and says so
            why = f"its layout could not be checked ({type(e).__name__}: {e})"
        return None if why is None else str(why)

    def _refuse(self, peer: bytes, why: str) -> None:
        self._refused += 1
        self.stats.add("senders_refused")
        if worth_logging(self._refused):
            log.error("kvtransfer receiver %s: refused a sender: %s (%d refused so far)", self.name, why,
                      self._refused)
        self._send(peer, wire.encode("refuse", reason=why[:wire.MAX_REASON_LEN]))

    def _reject(self, peer: bytes, reason: str, detail: str, xfer: str | None, fail: bool = False) -> None:
        """Count and log a rejected message; ``nack`` its sender about ``xfer``; with
        ``fail``, also fail ``xfer`` -- only if ``peer`` owns it (or it is new and
        there is room to record the failure)."""
        log_reject("receiver", self.stats.reject(reason), f"{reason}: {detail}", repr(peer))
        if xfer is None:
            return
        if fail:
            self._fail(peer, xfer, f"chunk rejected ({reason}: {detail})")
        self._nack(peer, xfer, f"rejected: {reason}: {detail}")

    def _fail(self, peer: bytes, x: str, error: str) -> None:
        t = self._open.get(x)
        if t is not None:
            if t.peer == peer:
                self._finish(x, t, False, error, "failed")
            return
        if self._closed_state(x) is not None:
            return
        # with room, a result makes wait() fail fast; without, the id is remembered only
        self._finish(x, None, False, error, "failed", owner=peer, store=self._room())

    def _room(self) -> bool:
        return len(self._open) + len(self._results) < self.max_open_transfers

    def _closed_state(self, x: str) -> tuple[str, bytes | None] | None:
        """(how, owner) of a closed transfer id, or None."""
        state = self._closed_ids.get(x)
        if state is None:
            stored = self._results.get(x)  # (its id may have aged out of _closed_ids)
            if stored is not None:
                state = ("completed" if stored.result.ok else "failed", stored.peer)
        return state

    def _close_id(self, x: str, how: str, owner: bytes | None) -> None:
        ids = self._closed_ids
        ids[x] = (how, owner)
        ids.move_to_end(x)
        while len(ids) > self._closed_keep:
            ids.popitem(last=False)

    def _start(self, peer: bytes, x: str, now: float, what: str) -> _RxTransfer | None:
        """A new transfer ``x`` owned by ``peer`` (not yet in ``_open``), or None after
        rejecting the message (id closed, owned by another peer, or no room)."""
        closed = self._closed_state(x)
        if closed is not None:
            how, owner = closed
            if owner is not None and owner != peer:
                self._reject(peer, "peer_mismatch", f"{what} for transfer {x!r}, which belongs to another sender", x)
            elif what == "done" and how != "completed":
                # the sender had not yet heard that its transfer failed: the usual race
                self.stats.add("late_done")
                self._nack(peer, x, f"transfer already {how}")
            else:
                reason = "aborted_xfer" if how in ("aborted", "abandoned") else "closed_xfer"
                self._reject(peer, reason, f"{what} for transfer {x!r} which is already {how}", x)
            return None
        if not self._room():
            self._reject(peer, "too_many_transfers",
                         f"{len(self._open)} open + {len(self._results)} uncollected transfers, limit "
                         f"{self.max_open_transfers}", x)
            return None
        return _RxTransfer(x, peer, now, now)

    def _on_kv(self, peer: bytes, msg: wire.Message) -> None:
        h = msg.header
        x = h["xfer"]
        now = self.heartbeat
        t = self._open.get(x)
        if t is None:
            t = self._start(peer, x, now, "chunk")
            if t is None:
                return
            self._open[x] = t
        elif t.peer != peer:
            self._reject(peer, "peer_mismatch", f"chunk for transfer {x!r}, which belongs to another sender", x)
            return
        parts, sizes = h["parts"], msg.sizes
        on_chunk = self._on_chunk
        # every kept part counts against the caps: its payload (unless on_chunk takes it)
        # and its bookkeeping, so that empty parts cannot grow memory without bound either
        held = sum(chunk_held_bytes(0 if on_chunk is not None else n, len(p["blocks"]))
                   for p, n in zip(parts, sizes))
        with self._cond:
            if self._held + held > self.max_held_bytes:
                full = ("receiver_full", f"holding {self._held} bytes, limit {self.max_held_bytes}")
            elif self._peer_held.get(peer, 0) + held > self.max_peer_bytes:
                full = ("peer_full", f"holding {self._peer_held.get(peer, 0)} bytes from this sender, "
                                     f"limit {self.max_peer_bytes}")
            else:
                full = None
                self._held += held
                self._peer_held[peer] = self._peer_held.get(peer, 0) + held
                self.stats.max("held_bytes_max", self._held)
        if full:
            self._reject(peer, full[0], full[1], x, fail=True)
            return
        t.held += held   # released with the transfer if any part below fails it
        buf = msg.payload[0]
        pos = 0
        for p, n in zip(parts, sizes):
            step, layer, seq, dtype = p["step"], p["layer"], p["seq"], p["dtype"]
            lshape = tuple(p["lshape"])
            L = t.pieces.get((step, layer))
            if L is None:
                L = t.pieces[step, layer] = LayerData(layer, dtype, lshape, [], step=step)
            elif L.dtype != dtype or L.shape != lshape:
                self._reject(peer, "layer_mismatch", f"transfer {x!r} layer {layer} of step {step}: dtype/shape "
                                                     f"differ between chunks", x, fail=True)
                return
            if L.chunks and seq <= L.chunks[-1].seq:
                self._reject(peer, "bad_seq", f"transfer {x!r} layer {layer} of step {step}: chunk seq {seq} out "
                                              f"of order/duplicate", x, fail=True)
                return
            data = buf[pos:pos + n]
            pos += n
            shape = tuple(p["shape"])
            if on_chunk is not None:
                try:
                    kw = {k: v for k, v in (("offset", p["offset"]), ("layer_shape", lshape), ("step", step))
                          if k in self._chunk_kwargs} if self._chunk_kwargs else {}
                    on_chunk(x, layer, seq, p["blocks"], data, dtype, shape, **kw)
                except Exception as e:
                    log.exception("kvtransfer receiver: on_chunk failed for %r layer %d step %d seq %d",
                                  x, layer, step, seq)
                    self._finish(x, t, False, f"on_chunk raised {type(e).__name__}: {e}", "failed")
                    self._nack(peer, x, f"destination write failed: {e}")
                    return
                data = _EMPTY
            L.chunks.append(ChunkData(seq, p["offset"], shape, p["blocks"], data))
            L.nbytes += n
        t.chunks += len(parts)
        t.nbytes += pos
        t.last = now
        c = self.stats.c
        c["chunks_received"] += len(parts)
        c["bytes_received"] += pos

    def _on_done(self, peer: bytes, h: dict) -> None:
        x = h["xfer"]
        t = self._open.get(x)
        if t is None:
            # nothing received for it: a transfer with no layers (everything was
            # cached), or every chunk was lost -- it counts against the cap too
            t = self._start(peer, x, self.heartbeat, "done")
            if t is None:
                return
        elif t.peer != peer:
            self._reject(peer, "peer_mismatch", f"'done' for transfer {x!r}, which belongs to another sender", x)
            return
        problem = None
        if (t.chunks, len(t.pieces), t.nbytes) != (h["chunks"], h["layers"], h["nbytes"]):
            problem = (f"truncated: sender announced {h['chunks']} chunks / {h['layers']} layers / "
                       f"{h['nbytes']} bytes, received {t.chunks} / {len(t.pieces)} / {t.nbytes}")
        else:
            for L in t.pieces.values():
                want = wire.prod(L.shape) * DTYPES[L.dtype]
                pos = 0
                for i, c in enumerate(L.chunks):
                    n = wire.prod(c.shape) * DTYPES[L.dtype]
                    if c.seq != i or c.offset != pos:
                        problem = f"layer {L.layer} of step {L.step}: chunk {c.seq} missing or misplaced"
                        break
                    pos += n
                if problem is None and pos != want:
                    problem = f"truncated: layer {L.layer} of step {L.step} has {pos} of {want} bytes"
                if problem:
                    break
        if problem is None:
            self._finish(x, t, True, None, "completed", digest=h["digest"])
            self._send(peer, wire.encode("ack", xfer=x, chunks=t.chunks, nbytes=t.nbytes))
            self.stats.add("acks_sent")
        else:
            log.warning("kvtransfer receiver: transfer %r failed: %s", x, problem)
            self._finish(x, t, False, problem, "failed", digest=h["digest"])
            self._nack(peer, x, problem)

    def _on_abort(self, peer: bytes, h: dict) -> None:
        x = h["xfer"]
        error = f"aborted by sender: {h['reason']}"
        t = self._open.get(x)
        if t is not None:
            if t.peer != peer:
                self._reject(peer, "peer_mismatch", f"abort for transfer {x!r}, which belongs to another sender", x)
            else:
                self._finish(x, t, False, error, "aborted")
            return
        closed = self._closed_state(x)
        if closed is None:  # nothing arrived for it (yet): remember, so late chunks are refused
            self._finish(x, None, False, error, "aborted", owner=peer, store=self._room())
            return
        how, owner = closed
        if owner is not None and owner != peer:
            self._reject(peer, "peer_mismatch", f"abort for transfer {x!r}, which belongs to another sender", x)
            return
        if how in ("aborted", "abandoned"):
            return
        # an uncollected result (complete or not) is withdrawn: the sender's word wins
        with self._cond:
            had = self._pop_result(x) is not None
        self._finish(x, None, False, error, "aborted", owner=peer, store=had)

    def _abandon(self, x: str) -> None:
        t = self._open.get(x)
        if t is not None or self._closed_state(x) is None:
            self._finish(x, t, False, "abandoned by the receiver", "abandoned", store=False)
            if t is not None:
                self._nack(t.peer, x, "receiver gave up waiting")
        with self._cond:
            self._pop_result(x)

    def _finish(self, x: str, t: _RxTransfer | None, ok: bool, error: str | None, how: str,
                store: bool = True, digest: str = "", owner: bytes | None = None) -> None:
        """Close transfer ``x``: publish its result, drop partial data on failure."""
        self._open.pop(x, None)
        owner = t.peer if t is not None else owner
        self._close_id(x, how, owner)
        now = time.monotonic()
        keep = ok and store and t is not None and self._on_chunk is None
        if t is not None and not keep and t.held:
            with self._cond:
                self._release(t.peer, t.held)  # partial data (or on_chunk bookkeeping) dropped
        # a kept result stays counted in _held until collected (see _pop_result)
        res = TransferResult(x, ok, error, t.chunks if t else 0, t.nbytes if t else 0,
                             t.pieces if keep else {}, (now - t.t0) if t else 0.0, digest)
        self.stats.add({"completed": "transfers_completed", "failed": "transfers_failed",
                        "aborted": "transfers_aborted", "abandoned": "transfers_abandoned",
                        "stale": "transfers_stale"}[how])
        if store:
            with self._cond:
                self._pop_result(x)  # never overwrite a stored result without releasing its bytes
                self._results[x] = _Stored(now, res, owner, t.held if keep else 0)
                self._cond.notify_all()

    def _tick(self, now: float) -> None:
        """About once a second: expire what is stale, refresh gauges, count failed
        handshakes, write the heartbeat file."""
        self._guarded(self._gc, now)
        self._guarded(self._drain_monitor)
        with self._cond:
            held, stored = self._held, len(self._results)
        st = self.stats
        st.set("held_bytes", held)
        st.set("stored_results", stored)
        st.set("open_transfers", len(self._open))
        st.set("peers", len(self._peers))
        if self.alive:
            self._write_heartbeat()
        elif not self._closing:       # it refuses every connection (see alive): say so, once a second
            self._write_heartbeat(stopped="the CURVE authentication (ZAP) handler stopped: "
                                          "every connection is refused")

    def _gc(self, now: float) -> None:
        for x, t in list(self._open.items()):
            if now - t.last > self.stale_after_s:
                log.warning("kvtransfer receiver: transfer %r stale (no data for %.0f s); dropped",
                            x, now - t.last)
                self._finish(x, t, False, f"stale: no data for {now - t.last:.0f} s", "stale")
        with self._cond:
            for x, stored in list(self._results.items()):
                if now - stored.at > self.result_ttl_s:
                    self._pop_result(x)
                    self.stats.add("results_expired")
            holding = set(self._peer_held)
        # forget idle connections (returning any credit held back for them first)
        owners = {t.peer for t in self._open.values()}
        for peer, rec in list(self._peers.items()):
            if now - rec.last_seen > self.stale_after_s and peer not in owners and peer not in holding:
                if rec.credit:
                    self._send(peer, wire.encode("credit", bytes=rec.credit, init=False,
                                                 max_message=self.max_message_bytes))
                del self._peers[peer]

    def _drain_monitor(self, limit: int = 10000) -> None:
        for _ in range(limit):
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            if event["event"] & _HANDSHAKE_FAILED:
                self._handshake_failures += 1
                self.stats.add("handshake_failures")
                if worth_logging(self._handshake_failures):
                    log.warning("kvtransfer receiver %s: a connection failed its %s handshake (%s; %d so far): "
                                "a sender without/with wrong CURVE keys?", self.name,
                                "CURVE" if self.curve else "ZMTP", zmq.Event(event["event"]).name,
                                self._handshake_failures)

    def _write_heartbeat(self, closed: bool = False, stopped: str | None = None) -> None:
        path = self.heartbeat_path
        if path is None:
            return
        data = {"time": time.time(), "pid": os.getpid(), "address": self.address, "name": self.name,
                "closed": closed, "stopped": stopped, "stats": self.stats.snapshot(), **self._info}
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as e:
            self.stats.add("heartbeat_write_errors")
            if worth_logging(int(self.stats.c["heartbeat_write_errors"])):
                log.warning("kvtransfer receiver %s: cannot write heartbeat file %s: %s", self.name, path, e)
