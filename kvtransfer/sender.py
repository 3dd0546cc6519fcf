"""Producer side of the KV transport: :class:`KVSender` (see ``proserve.kvtransfer.transport``
for the socket and flow-control design)."""
from __future__ import annotations

import collections
import os
import select
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from proserve.scheduler import validate

from . import wire
from .auth import ClientKeys, is_loopback
from .common import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_PACK_BYTES,
    DEFAULT_PACK_LAYER_BYTES,
    DEFAULT_TIMEOUT_S,
    MESSAGE_OVERHEAD,
    MIN_CREDIT_BYTES,
    MIN_MAX_MESSAGE_BYTES,
    DestinationUnavailable,
    Stats,
    TransferError,
    TransferTimeout,
    is_torch_tensor,
    log,
    log_reject,
    normalize_dtype,
)
from .wire import DTYPES, RECEIVER_KINDS, WireError

_INT_ONLY = {int}
# plain ints: the enum flags cost a few microseconds per use, on a path taken per layer
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

# ---------------------------------------------------------------- chunk planning


@dataclass(slots=True)
class ChunkSpec:
    seq: int
    offset: int   # bytes into the layer
    nbytes: int
    shape: tuple
    rows: tuple | None  # (a, b) along the flattened leading axes; None = the whole layer
    blocks: list


def plan_chunks(lshape: Sequence[int], isz: int, chunk_bytes: int, blocks: list[int]) -> list[ChunkSpec]:
    """Split a C-contiguous layer tensor into chunks of at most ``chunk_bytes``.

    Pick the outermost axis ``k`` one index of which (``prod(lshape[k+1:])``
    items) fits, view the tensor as ``(prod(lshape[:k+1]), *lshape[k+1:])`` and
    cut along that first axis: every chunk is a whole sub-tensor of shape
    ``(n, *lshape[k+1:])`` at a known byte offset. When ``k == 0`` and
    ``len(blocks) == lshape[0]`` (the leading axis is the block axis), each chunk
    carries only its own rows' block ids; otherwise each carries the full list."""
    lshape = tuple(int(d) for d in lshape)
    total = wire.prod(lshape) * isz
    if total <= chunk_bytes or len(lshape) == 0:
        return [ChunkSpec(0, 0, total, lshape, None, list(blocks))]
    k = 0
    while wire.prod(lshape[k + 1:]) * isz > chunk_bytes:
        k += 1
    inner = lshape[k + 1:]
    row_bytes = wire.prod(inner) * isz
    n_rows = wire.prod(lshape[:k + 1])
    per = max(1, chunk_bytes // row_bytes)
    slice_blocks = k == 0 and len(blocks) == lshape[0]
    out = []
    for seq, a in enumerate(range(0, n_rows, per)):
        b = min(n_rows, a + per)
        out.append(ChunkSpec(seq, a * row_bytes, (b - a) * row_bytes, (b - a, *inner), (a, b),
                             list(blocks[a:b]) if slice_blocks else blocks))
    return out


# ----------------------------------------------------------------- payload sources


class _HostSource:
    """CPU bytes (numpy, bytes-like, CPU torch tensor): chunks are memoryview
    slices, sent zero-copy (ZeroMQ keeps a reference until the bytes are out)."""

    def __init__(self, flat: memoryview, keepalive: Any):
        self.flat = flat
        self.keepalive = keepalive

    def chunk(self, spec: ChunkSpec, deadline: float) -> Any:
        if spec.rows is None:
            return self.flat
        return self.flat[spec.offset:spec.offset + spec.nbytes]

    def copy_into(self, dst: np.ndarray) -> None:
        """Copy the whole layer into ``dst`` (uint8, the layer's size): packing."""
        if dst.nbytes:
            dst[:] = np.frombuffer(self.flat, dtype=np.uint8)


class _DeviceSource:
    """A tensor on an accelerator (cuda, npu, xpu, ...), staged chunk by chunk
    through reusable host buffers (see :class:`_Stager`)."""

    def __init__(self, tensor, stager: "_Stager"):
        self.t = tensor
        self.stager = stager

    def chunk(self, spec: ChunkSpec, deadline: float) -> Any:
        src = self.t if spec.rows is None else self.t.reshape(-1, *spec.shape[1:])[spec.rows[0]:spec.rows[1]]
        return self.stager.stage(src, spec.nbytes, deadline)

    def copy_into(self, dst: np.ndarray) -> None:
        """Copy the whole layer into ``dst`` (uint8 host memory, the layer's size):
        a synchronous device->host copy (packing)."""
        if dst.nbytes:
            import torch
            torch.from_numpy(dst).view(self.t.dtype).view(self.t.shape).copy_(self.t)


class _Stager:
    """A ring of (pinned when possible) host buffers. The device->host copy of
    chunk i+1 overlaps the socket send of chunk i (ZeroMQ's I/O thread sends in
    the background); a slot is reused only once ZeroMQ has released the message
    that points into it (``MessageTracker``), waiting at most until the deadline."""

    def __init__(self, slots: int):
        self.n = max(1, slots)
        self.slots: list[Any] = [None] * self.n   # torch uint8 host tensors
        self.trackers: list[Any] = [None] * self.n
        self.i = 0
        self.pinned: bool | None = None

    def stage(self, src, nbytes: int, deadline: float) -> zmq.Frame:
        import torch
        i = self.i
        self.i = (i + 1) % self.n
        tr = self.trackers[i]
        if tr is not None and not tr.done:
            try:
                tr.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                raise TransferTimeout("staging buffer still held by an unsent message; "
                                      "receiver stalled or unreachable") from None
        slot = self.slots[i]
        if slot is None or slot.numel() < nbytes:
            self.slots[i] = slot = None  # free the old one before allocating
            slot = self.slots[i] = self._alloc(torch, max(nbytes, 1))
        if nbytes:
            dst = slot[:nbytes].view(src.dtype).view(src.shape)
            # a synchronous copy into host memory: device-agnostic (no
            # torch.<device>.synchronize()), and the bytes are final before the
            # socket reads them; overlap comes from ZeroMQ sending the previous slot
            dst.copy_(src)
        frame = zmq.Frame(slot.numpy()[:nbytes], copy=False, track=True)
        self.trackers[i] = frame.tracker
        return frame

    def _alloc(self, torch, n: int):
        if self.pinned is not False:
            try:
                buf = torch.empty(n, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
                return buf
            except Exception as e:  # no accelerator runtime to pin with
                log.debug("kvtransfer: pinned staging unavailable (%s); using pageable memory", e)
                self.pinned = False
        return torch.empty(n, dtype=torch.uint8)


class _PackPool:
    """Reusable pack buffers: fresh memory costs a page fault per 4 KiB touched
    (about as much as sending the bytes, on the 2-core VM). A buffer is sent
    zero-copy through a view of it; when ZeroMQ releases the message, the view
    is freed and its ``weakref.finalize`` hands the buffer back here (on
    pyzmq's garbage-collection thread: list operations only)."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.free: list[np.ndarray] = []

    def get(self, nbytes: int) -> np.ndarray:
        while self.free:
            buf = self.free.pop()
            if buf.nbytes >= nbytes:
                return buf
        return np.empty(nbytes, dtype=np.uint8)

    def send_view(self, buf: np.ndarray, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of ``buf``, to be sent; ``buf`` returns to the pool
        once the view is gone."""
        view = buf[:nbytes]
        weakref.finalize(view, self.put, buf)
        return view

    def put(self, buf: np.ndarray) -> None:
        if len(self.free) < self.keep:
            self.free.append(buf)


def make_source(data: Any, dtype: Any, shape: Any, stager: _Stager, stats: Stats):
    """-> (source, dtype name, layer shape). Non-contiguous input is made
    contiguous (one copy, counted in ``contiguous_copies``)."""
    want_dtype = normalize_dtype(dtype) if dtype is not None else None
    want_shape = tuple(int(d) for d in shape) if shape is not None else None
    if isinstance(data, np.ndarray):
        arr = data
        name = normalize_dtype(arr.dtype)
        lshape = arr.shape
        _check_match(name, lshape, want_dtype, want_shape)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
            stats.add("contiguous_copies")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
            stats.add("contiguous_copies")
        flat = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
        return _HostSource(flat, arr), name, lshape
    if is_torch_tensor(data):
        t = data.detach()
        name = normalize_dtype(t.dtype)
        lshape = tuple(t.shape)
        _check_match(name, lshape, want_dtype, want_shape)
        if not t.is_contiguous():
            t = t.contiguous()
            stats.add("contiguous_copies")
        if t.device.type == "cpu":
            if t.numel() == 0:
                return _HostSource(memoryview(b""), t), name, lshape
            import torch
            flat = t.reshape(-1).view(torch.uint8).numpy()  # shares memory with t
            return _HostSource(memoryview(flat), (t, flat)), name, lshape
        return _DeviceSource(t, stager), name, lshape
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(f"send_layer: unsupported payload type {type(data).__name__}; "
                        "pass a numpy array, a bytes-like object or a torch tensor") from None
    if want_dtype is None or want_shape is None:
        raise ValueError("send_layer: dtype and shape are required for a bytes-like payload")
    if not mv.c_contiguous:
        mv = memoryview(mv.tobytes())
        stats.add("contiguous_copies")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    want = wire.prod(want_shape) * DTYPES[want_dtype]
    if mv.nbytes != want:
        raise ValueError(f"send_layer: buffer has {mv.nbytes} bytes but shape {list(want_shape)} of "
                         f"{want_dtype} needs {want}")
    return _HostSource(mv, data), want_dtype, want_shape


def _check_match(name, lshape, want_dtype, want_shape) -> None:
    if want_dtype is not None and want_dtype != name:
        raise ValueError(f"send_layer: dtype={want_dtype!r} given for a tensor of dtype {name!r}")
    if want_shape is not None and want_shape != tuple(lshape):
        raise ValueError(f"send_layer: shape={list(want_shape)} given for a tensor of shape {list(lshape)}")


# ------------------------------------------------------------------------- sender


@dataclass
class SendResult:
    xfer_id: str
    chunks: int
    layers: int
    nbytes: int
    elapsed_s: float



#: The least payload a chunk may carry (or the whole layer, when smaller) once the
#: header is accounted for, under the receiver's announced max_message.
MIN_CHUNK_PAYLOAD = 1024
#: An upper bound of a 'kv' header's bytes beyond its parts (the transfer id is at most 512 chars).
MESSAGE_HEADER_BOUND = 1024


def _part_header_bound(n_blocks: int, ndim: int) -> int:
    """An upper bound of what one part adds to a 'kv' header, in bytes."""
    return 128 + 10 * n_blocks + 20 * ndim


#: Failed transfers remembered (so later calls for them fail at once) until the
#: caller finishes or aborts them; beyond this many the oldest are forgotten.
MAX_FAILED_KEPT = 4096
#: a call for an open transfer reads the receiver's replies (a nack?) at most this often
#: unless it waits for credit anyway (reading them costs microseconds per layer)
PUMP_INTERVAL_S = 0.001
#: replies read per _pump call at most (a flooding receiver cannot hold the caller there)
PUMP_MAX_MESSAGES = 1024
#: A DEALER's receive queue limit, in messages: only small control messages come
#: back (credit, ack, nack), far fewer than this from a well-behaved receiver.
SENDER_RCVHWM = 1 << 17
_MONITORED = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class _Channel:
    """The connection to one receiver address (one DEALER at a time, with its
    credit state) and that destination's circuit breaker."""

    def __init__(self, address: str):
        self.address = address
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None   # connection events of sock (PAIR)
        self.fd = -1
        self.mon_fd = -1
        self.generation = 0          # bumped whenever the DEALER is dropped
        self.ready = False           # the initial credit grant arrived
        self.connect_deadline = 0.0  # ... must arrive by then (monotonic)
        self.window = 0
        self.max_message = 0
        self.credit = 0
        self.inflight = 0
        self.last_rx = 0.0
        self.pumped = 0.0            # when replies were last read (monotonic)
        # circuit breaker
        self.state = CLOSED
        self.failures = 0            # consecutive
        self.last_error: str | None = None
        self.open_until = 0.0        # monotonic


@dataclass(eq=False)
class _TxTransfer:
    """A transfer on the sender side, from its first call to finish/abort."""
    xfer_id: str
    channel: _Channel
    budget: float                  # seconds it may still spend waiting in our calls, all together
    generation: int = 0            # the channel's generation it was started on (a reset fails it)
    chunks: int = 0                # parts sent (a chunk of a large layer, or one packed small layer)
    pieces: set = field(default_factory=set)   # (step, layer) sent
    nbytes: int = 0                # payload bytes sent
    state: str = "open"            # open -> done_sent -> acked | failed
    error: str | None = None
    error_cls: type = TransferError
    t0: float = field(default_factory=time.monotonic)
    ack_deadline: float | None = None   # set by finish_async: now + what is left of the budget
    done_at: float = 0.0
    # the pack being filled: small layers copied back to back into pack_buf, one part each;
    # sent as one 'kv' message when full, by flush() and before 'done'
    pack_buf: np.ndarray | None = None
    pack_pos: int = 0              # bytes used in pack_buf
    pack_parts: list = field(default_factory=list)
    pack_header: int = 0           # bound of the header bytes its parts take (for max_message)


class KVSender:
    """Producer side of the KV transport.

    ``address`` is the default destination (a :class:`KVReceiver`'s ``tcp://`` or
    ``ipc://`` endpoint); a transfer may name another with ``dest=`` on its first
    call. Buffers handed to :meth:`send_layer` are sent zero-copy: they must not
    be modified until :meth:`finish` returns (the ack means every byte is on the
    receiver), or the transfer is aborted.

    Deadlines: a transfer gets one budget of ``timeout`` seconds for all its
    waits together (connection set-up, flow-control credit, the ack): every
    call for it may block at most what is left of that budget (a per-call
    ``timeout`` can only shorten a wait), and time spent outside the sender's
    calls -- e.g. the engine computing the next prefill chunk -- does not
    count, so a long chunked prefill does not expire while a receiver that
    stops answering costs the caller ``timeout`` once per transfer, never once
    per layer. Once a
    transfer has failed (timeout, ``nack``, connection reset, destination
    unavailable), every later call for that id raises the same error at once,
    until :meth:`finish`/:meth:`finish_async` (which raise it) or :meth:`abort`
    (the last :data:`MAX_FAILED_KEPT` failed ids are remembered).

    Connections and the circuit breaker, per destination address: a new
    connection must get its credit grant (the answer to ``hello``) within
    ``connect_timeout`` s. A connect timeout, a transfer timeout with nothing
    heard from the receiver for at least ``connect_timeout`` s, a connection
    reset (the receiver went away) or a failed CURVE handshake drops the
    connection, fails every transfer on it, and opens the breaker for
    ``breaker_cooldown_s`` (doubling per consecutive failure, at most
    ``breaker_max_cooldown_s``): starting a transfer then raises
    :class:`DestinationUnavailable` at once. After the cooldown one transfer is
    let through on a fresh connection (half-open); its credit grant closes the
    breaker, a failure reopens it. :meth:`destinations` and
    :meth:`destination_ok` report the state.

    ``layout`` goes to the receiver in every connection's ``hello``
    (:mod:`proserve.kvtransfer.wire`); a receiver that cannot take this
    sender's KV answers ``refuse``, which fails the connection like a reset,
    with the receiver's reason.

    Security: with ``curve=ClientKeys.load(dir)`` every connection is CURVE
    encrypted and authenticated (the receiver must hold the matching server
    key and admit this client key). Without keys a destination that is not on
    this host (:func:`proserve.kvtransfer.auth.is_loopback`) is refused with
    :class:`TransferError`, unless ``allow_insecure_remote=True``.

    No background thread: the sockets are driven by the calling thread(s) under
    one lock (ZeroMQ sockets are not thread-safe), so a chunk reaches ZeroMQ's
    own I/O thread the moment it is sent. Incoming credit and acks are read
    whenever a method runs; blocking waits release the lock while they sleep on
    the socket's file descriptor, so several threads may share one sender.
    """

    def __init__(self, address: str | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 pack_bytes: int = DEFAULT_PACK_BYTES, pack_layer_bytes: int = DEFAULT_PACK_LAYER_BYTES,
                 timeout: float = DEFAULT_TIMEOUT_S, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 breaker_cooldown_s: float = 2.0, breaker_max_cooldown_s: float = 30.0,
                 staging_slots: int = 2, curve: ClientKeys | None = None, allow_insecure_remote: bool = False,
                 layout: str = "", ctx: zmq.Context | None = None, name: str | None = None):
        W = "KVSender"
        if not isinstance(layout, str) or len(layout) > wire.MAX_REASON_LEN:
            raise ValueError(f"{W}: layout must be a str of at most {wire.MAX_REASON_LEN} characters")
        validate.integer(W, "chunk_bytes", chunk_bytes)
        validate.integer(W, "pack_bytes", pack_bytes, 0)              # 0: no packing
        validate.integer(W, "pack_layer_bytes", pack_layer_bytes, 0)
        for arg, v in (("timeout", timeout), ("connect_timeout", connect_timeout),
                       ("breaker_cooldown_s", breaker_cooldown_s), ("breaker_max_cooldown_s", breaker_max_cooldown_s)):
            validate.positive(W, arg, v)
        self.address = address
        self.chunk_bytes = int(chunk_bytes)
        # a pack is one message: at most chunk_bytes of payload too; a layer is packed
        # only if at least two fit in a pack (pack_bytes=0: no packing)
        self.pack_bytes = min(int(pack_bytes), self.chunk_bytes)
        self.pack_layer_bytes = min(int(pack_layer_bytes), self.pack_bytes // 2)
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.breaker_cooldown_s = float(breaker_cooldown_s)
        self.breaker_max_cooldown_s = max(float(breaker_max_cooldown_s), self.breaker_cooldown_s)
        self.curve = curve
        self.allow_insecure_remote = bool(allow_insecure_remote)
        self.layout = layout
        self.name = name or f"kvsender-{uuid.uuid4().hex[:8]}"
        self._ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()
        self._waiters = 0  # threads sleeping in _wait (lock released)
        # self-pipe: a thread that applies incoming messages wakes the sleepers, since
        # it may have consumed the ZeroMQ fd signal they are sleeping on
        self._pipe_r, self._pipe_w = os.pipe()
        os.set_blocking(self._pipe_r, False)
        os.set_blocking(self._pipe_w, False)
        self._channels: dict[str, _Channel] = {}
        self._tx: dict[str, _TxTransfer] = {}
        self._failed: collections.OrderedDict[str, _TxTransfer] = collections.OrderedDict()
        self._stager = _Stager(staging_slots)
        self._packs = _PackPool()
        self._closed = False
        self.stats = Stats("bytes_sent", "chunks_sent", "messages_sent", "layers_sent", "layers_packed",
                           "transfers_started", "transfers_acked", "transfers_failed", "transfers_aborted",
                           "transfers_refused", "timeouts", "credit_waits", "credit_wait_s", "max_inflight_bytes",
                           "contiguous_copies", "channel_resets", "connect_timeouts", "connection_resets",
                           "handshake_failures", "breaker_opens", "refusals")

    # ------------------------------------------------------------------ public

    def connect(self, dest: str | None = None) -> None:
        """Open the connection to ``dest`` (default: the sender's address) ahead of
        the first transfer (optional; it saves the credit handshake later).
        Raises :class:`DestinationUnavailable` while its breaker is open."""
        with self._lock:
            self._admit(self._channel(dest or self.address), time.monotonic())

    def begin(self, xfer_id: str, dest: str | None = None) -> None:
        """Open a transfer explicitly (optional: the first ``send_layer`` does it);
        its wait budget (``timeout``) starts now. A transfer with no layers (e.g. everything was
        a prefix-cache hit) still needs :meth:`finish`. Raises
        :class:`DestinationUnavailable` at once while the destination's breaker
        is open (later calls for this id then raise it too)."""
        _check_xfer_id(xfer_id)
        with self._lock:
            self._open_transfer(xfer_id, dest)

    def send_layer(self, xfer_id: str, layer: int, blocks: Sequence[int], data: Any, dtype: Any = None,
                   shape: Sequence[int] | None = None, *, step: int = 0, dest: str | None = None,
                   timeout: float | None = None) -> int:
        """Send one layer's KV for transfer ``xfer_id``; returns the number of parts
        it went out as (1 for a packed layer).

        ``step``: the engine step that computed this KV (a prompt prefilled in
        several chunks sends each layer once per step); each ``(step, layer)``
        may be sent once per transfer. A layer of at most ``pack_layer_bytes``
        is copied into the transfer's pack (small layers travel together, one
        message of up to ``pack_bytes``; sent when full, by :meth:`flush` and
        before ``done``); a larger one is sent at once, split into chunks of at
        most ``chunk_bytes``.

        ``data``: numpy array, bytes-like (``dtype`` and ``shape`` then required),
        or torch tensor on any device (CPU: zero-copy; others: staged through
        pinned host buffers). ``blocks``: the layer's block ids in the sender's
        numbering (see :mod:`proserve.kvtransfer.wire`). Blocks while out of flow-control
        credit or while the connection is being set up, at most until the
        transfer's wait budget is spent (``timeout`` shortens the wait of this call); then
        raises :class:`TransferTimeout` and the transfer is failed and aborted.
        Raises the transfer's error at once if it already failed (e.g. the
        receiver rejected it), and :class:`DestinationUnavailable` for a new
        transfer while the destination's breaker is open."""
        _check_xfer_id(xfer_id)
        for name, v in (("layer", layer), ("step", step)):
            if type(v) is not int or not 0 <= v <= wire.MAX_INDEX:
                raise ValueError(f"{name} must be an int in 0..{wire.MAX_INDEX}, got {v!r}")
        blocks = list(blocks)
        if blocks and not (set(map(type, blocks)) == _INT_ONLY and min(blocks) >= 0):
            blocks = [int(b) for b in blocks]  # numpy / torch integers
            if min(blocks) < 0:
                raise ValueError("block ids must be >= 0")
        call_start = time.monotonic()
        with self._lock:
            src, dtype_name, lshape = make_source(data, dtype, shape, self._stager, self.stats)
            tx = self._open_transfer(xfer_id, dest)
            key = (step, layer)
            if key in tx.pieces:
                raise ValueError(f"transfer {xfer_id!r}: layer {layer} of step {step} was already sent")
            return self._guarded(tx, call_start, timeout, lambda deadline: self._send_layer(
                tx, key, blocks, src, dtype_name, lshape, deadline))

    def flush(self, xfer_id: str, timeout: float | None = None) -> None:
        """Send the small layers packed so far for ``xfer_id`` now (the vLLM
        connector calls it at the end of every engine step, so that a step's KV
        is on its way before the next step runs; :meth:`finish` does it too).
        Waits for credit like :meth:`send_layer`; raises the transfer's error if
        it failed. Nothing to do for a transfer this sender does not know."""
        call_start = time.monotonic()
        with self._lock:
            tx = self._tx.get(xfer_id)
            if tx is None:
                return
            self._check_usable(tx)
            if tx.pack_parts and tx.state == "open":
                self._guarded(tx, call_start, timeout, lambda deadline: self._flush(tx, deadline))

    def finish_async(self, xfer_id: str, timeout: float | None = None, *, digest: str = "") -> None:
        """Send ``done`` (with ``digest``, opaque to the transport: at most 128
        lower-case hex digits, handed to the receiver's ``TransferResult.digest``)
        without waiting for the ack; collect the outcome with
        :meth:`poll_finished` (no ack within what is left of the transfer's wait budget, or within
        ``timeout`` s if that is sooner: reported as a :class:`TransferTimeout`,
        and the transfer aborted). Raises the transfer's error at once if it
        already failed (and forgets it)."""
        _check_digest(digest)
        with self._lock:
            self._finish_async(xfer_id, timeout, digest)

    def finish(self, xfer_id: str, timeout: float | None = None, *, digest: str = "") -> SendResult:
        """Close the transfer (``done`` announcing what was sent, and ``digest``) and
        wait for the receiver's ``ack`` confirming full receipt -- only then may
        the caller free the KV blocks. Raises :class:`TransferTimeout` when no
        ack arrives within what is left of the transfer's wait budget (or within ``timeout`` s, if
        sooner; the transfer is then aborted) and :class:`TransferError` when
        the receiver reports a failure (truncated, rejected, gave up)."""
        _check_digest(digest)
        with self._lock:
            tx = self._finish_async(xfer_id, timeout, digest)
            deadline = tx.ack_deadline if timeout is None else min(tx.ack_deadline, time.monotonic() + timeout)
            try:
                self._wait(tx.channel, lambda: tx.state in ("acked", "failed"), deadline, tx,
                           f"no ack from the receiver at {tx.channel.address} in time")
                self._check_usable(tx)
            finally:
                self._forget(tx)
            return SendResult(xfer_id, tx.chunks, len(tx.pieces), tx.nbytes, time.monotonic() - tx.t0)

    def poll_finished(self) -> dict[str, SendResult | TransferError]:
        """Outcomes of transfers closed with :meth:`finish_async` that are final now
        (acked, failed, or past their deadline); each is reported once."""
        out: dict[str, SendResult | TransferError] = {}
        with self._lock:
            now = time.monotonic()
            for ch in list(self._channels.values()):
                self._pump(ch)
                self._check_connect(ch, now)
            for x, tx in list(self._tx.items()):
                if tx.ack_deadline is None:
                    continue
                if tx.state == "acked":
                    out[x] = SendResult(x, tx.chunks, len(tx.pieces), tx.nbytes, now - tx.t0)
                elif tx.state == "failed":
                    out[x] = self._error(tx)
                elif now > tx.ack_deadline:
                    self._on_timeout(tx, f"no ack from the receiver at {tx.channel.address} in time", tx.done_at)
                    out[x] = self._error(tx)
                else:
                    continue
                self._forget(tx)
        return out

    def abort(self, xfer_id: str, reason: str = "aborted by sender") -> None:
        """Tell the receiver to drop whatever it holds for ``xfer_id`` and forget
        the transfer (also a failed one); never blocks."""
        with self._lock:
            tx = self._tx.get(xfer_id)
            if tx is None:
                return
            self._forget(tx)
            if tx.state not in ("acked", "failed"):
                self._send_abort(tx, reason)
            self.stats.add("transfers_aborted")

    def pending(self) -> list[str]:
        """Transfers started and not yet finished/aborted/collected (failed ones
        included, until the caller finishes or aborts them)."""
        with self._lock:
            return list(self._tx)

    def destinations(self) -> dict[str, dict]:
        """Per destination address: ``state`` (``"closed"``: usable, ``"open"``:
        refused until ``open_until`` (``time.monotonic()``), ``"half_open"``: one
        probe connection under way), ``failures`` (consecutive), ``last_error``,
        ``open_until``, ``connected`` (credit grant received) and
        ``inflight_bytes``."""
        with self._lock:
            return {a: {"state": ch.state, "failures": ch.failures, "last_error": ch.last_error,
                        "open_until": ch.open_until, "connected": ch.ready, "inflight_bytes": ch.inflight}
                    for a, ch in self._channels.items()}

    def destination_ok(self, addr: str | None = None) -> bool:
        """Whether a new transfer to ``addr`` (default: the sender's address) would
        be let through now: False while its breaker is open (or a half-open
        probe is still under way), and for a non-loopback address without CURVE
        keys (unless ``allow_insecure_remote``)."""
        addr = addr or self.address
        with self._lock:
            if not addr or self._closed or self._insecure(addr):
                return False
            ch = self._channels.get(addr)
            if ch is None:
                return True
            now = time.monotonic()
            self._pump(ch)
            self._check_connect(ch, now)
            if ch.state == OPEN:
                return now >= ch.open_until
            return ch.state == CLOSED

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tx in self._tx.values():
                self._fail(tx, "sender closed")
            for ch in self._channels.values():
                self._drop_socket(ch)
            os.close(self._pipe_r)
            os.close(self._pipe_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -------------------------------------------------- internals (hold _lock)

    def _insecure(self, address: str) -> bool:
        return self.curve is None and not self.allow_insecure_remote and not is_loopback(address)

    def _channel(self, address: str | None) -> _Channel:
        if self._closed:
            raise TransferError("sender is closed")
        if not address:
            raise ValueError("no destination: pass dest= or construct KVSender(address)")
        ch = self._channels.get(address)
        if ch is None:
            if self._insecure(address):
                raise TransferError(f"{address}: refusing to send KV unencrypted to a non-loopback address; "
                                    "configure CURVE keys (KVSender(curve=ClientKeys.load(dir))) or pass "
                                    "allow_insecure_remote=True on a trusted network")
            ch = self._channels[address] = _Channel(address)
        return ch

    def _admit(self, ch: _Channel, now: float) -> None:
        """Let a new transfer (or connect()) use ``ch``, making sure it has a
        connection; raises :class:`DestinationUnavailable` while the breaker
        refuses."""
        self._pump(ch)
        self._check_connect(ch, now)
        if ch.state == OPEN:
            if now < ch.open_until:
                raise DestinationUnavailable(
                    f"KV destination {ch.address} is unavailable for another {ch.open_until - now:.1f} s "
                    f"(circuit breaker open after {ch.failures} consecutive failure(s); last: {ch.last_error})")
            ch.state = HALF_OPEN  # this one is the probe, on a fresh connection
            try:
                self._connect(ch, now)
            except BaseException:
                # no probe is under way after all (e.g. EMFILE making the socket): back to
                # open, so that the next transfer probes again instead of every transfer
                # being refused as 'being probed' forever
                ch.state = OPEN
                raise
            return
        if ch.state == HALF_OPEN:
            raise DestinationUnavailable(f"KV destination {ch.address} is being probed after a failure "
                                         f"({ch.last_error}); try again shortly")
        if ch.sock is None:
            self._connect(ch, now)
        elif not ch.ready and not self._has_active(ch):
            ch.connect_deadline = now + self.connect_timeout  # nobody was waiting: the bound starts now

    def _has_active(self, ch: _Channel) -> bool:
        return any(tx.channel is ch and tx.state in ("open", "done_sent") for tx in self._tx.values())

    def _open_transfer(self, xfer_id: str, dest: str | None) -> _TxTransfer:
        tx = self._tx.get(xfer_id)
        if tx is not None:
            if dest is not None and dest != tx.channel.address:
                raise ValueError(f"transfer {xfer_id!r} already goes to {tx.channel.address}, not {dest}")
            if time.monotonic() - tx.channel.pumped >= PUMP_INTERVAL_S:
                self._pump(tx.channel)  # a nack may be waiting: then fail now, sending nothing more
            self._check_usable(tx)
            if tx.state != "open":
                raise TransferError(f"transfer {xfer_id!r} is already finishing")
            return tx
        ch = self._channel(dest or self.address)
        now = time.monotonic()
        tx = _TxTransfer(xfer_id, ch, self.timeout, ch.generation)
        try:
            self._admit(ch, now)
        except DestinationUnavailable as e:
            self._tx[xfer_id] = tx  # remembered: later calls for it fail at once too
            self._fail(tx, str(e), DestinationUnavailable, refused=True)
            raise
        tx.generation = ch.generation
        self._tx[xfer_id] = tx
        self.stats.add("transfers_started")
        return tx

    def _guarded(self, tx: _TxTransfer, call_start: float, timeout: float | None,
                 fn: Callable[[float], Any]) -> Any:
        """Run ``fn(deadline)``, the part of a public call that may wait on the
        receiver: the deadline is what is left of the transfer's wait budget (or
        ``timeout``, if sooner), the time the call took comes off the budget, and
        an error fails the transfer (telling the receiver) before it is raised."""
        deadline = call_start + (tx.budget if timeout is None else min(tx.budget, timeout))
        try:
            return fn(deadline)
        except TransferError as e:
            if tx.state != "failed":  # e.g. the staging buffer wait timed out
                if isinstance(e, TransferTimeout):
                    self._on_timeout(tx, str(e), call_start)
                else:
                    self._fail(tx, str(e))
                    self._send_abort(tx, "sender failed mid-layer")
            raise
        except BaseException as e:  # a message half built or sent: the transfer cannot complete
            if tx.state != "failed":
                self._fail(tx, f"sending failed: {type(e).__name__}: {e}")
                self._send_abort(tx, "sender failed mid-layer")
            raise
        finally:
            tx.budget -= time.monotonic() - call_start   # what this call spent of the wait budget

    def _send_layer(self, tx: _TxTransfer, key: tuple[int, int], blocks: list, src, dtype_name: str,
                    lshape: tuple, deadline: float) -> int:
        ch = tx.channel
        if not ch.ready:
            self._wait(ch, lambda: ch.ready, deadline, tx,
                       f"no credit grant from the receiver at {ch.address} (not running?)")
        self._check_usable(tx)
        isz = DTYPES[dtype_name]
        layer_bytes = wire.prod(lshape) * isz
        part_room = _part_header_bound(len(blocks), len(lshape))
        limit = self._message_limit(ch)
        step, layer = key
        lshape_l = list(lshape)
        if layer_bytes <= self.pack_layer_bytes and layer_bytes + part_room + MESSAGE_HEADER_BOUND <= limit:
            # a small layer: copied into the pack, which goes out as one message
            room = min(self.pack_bytes, limit - tx.pack_header - part_room)
            if tx.pack_parts and (tx.pack_pos + layer_bytes > room or len(tx.pack_parts) >= wire.MAX_PARTS):
                self._flush(tx, deadline)
            if tx.pack_buf is None:
                tx.pack_buf = self._packs.get(max(self.pack_bytes, layer_bytes))
                tx.pack_header = MESSAGE_HEADER_BOUND
            src.copy_into(tx.pack_buf[tx.pack_pos:tx.pack_pos + layer_bytes])
            tx.pack_pos += layer_bytes
            tx.pack_header += part_room
            tx.pack_parts.append(wire.part(step, layer, 0, blocks, dtype_name, lshape_l, 0, lshape_l))
            tx.pieces.add(key)
            c = self.stats.c
            c["layers_packed"] += 1
            c["layers_sent"] += 1
            return 1
        if tx.pack_parts:
            self._flush(tx, deadline)   # parts go out in the order they were given
        header_room = MESSAGE_HEADER_BOUND + part_room
        if limit - header_room < min(layer_bytes, MIN_CHUNK_PAYLOAD):
            # else the layer would go out in chunks of a few bytes each: millions of
            # messages, CPU time no wait budget bounds, the forward pass stalled
            raise TransferError(
                f"the receiver at {ch.address} accepts messages of at most {ch.max_message} bytes, "
                f"too small for chunks of this layer ({len(blocks)} block ids in each header): "
                f"raise its max_message_bytes")
        chunk = max(isz, min(self.chunk_bytes, limit - header_room))
        tx.pieces.add(key)
        if layer_bytes <= chunk and isinstance(src, _HostSource):   # the common case: one message
            self._send_kv(tx, [wire.part(step, layer, 0, blocks, dtype_name, lshape_l, 0, lshape_l)],
                          layer_bytes, deadline, data=src.flat)
            self.stats.c["layers_sent"] += 1
            return 1
        specs = plan_chunks(lshape, isz, chunk, blocks)
        for spec in specs:
            self._send_kv(tx, [wire.part(step, layer, spec.seq, spec.blocks, dtype_name, list(spec.shape),
                                         spec.offset, lshape_l)],
                          spec.nbytes, deadline, make_data=lambda spec=spec: src.chunk(spec, deadline))
        self.stats.c["layers_sent"] += 1
        return len(specs)

    @staticmethod
    def _message_limit(ch: _Channel) -> int:
        """Largest message (header + payload) for ``ch``: the receiver's max_message,
        and at most half the credit window (the receiver returns credit in batches
        of a quarter window, so a message always fits once the pipe has drained)."""
        return min(ch.window // 2 - MESSAGE_OVERHEAD, ch.max_message)

    def _flush(self, tx: _TxTransfer, deadline: float) -> None:
        """Send the pack of ``tx`` (its small layers so far) as one 'kv' message."""
        parts, n, buf = tx.pack_parts, tx.pack_pos, tx.pack_buf
        tx.pack_parts, tx.pack_pos, tx.pack_buf, tx.pack_header = [], 0, None, 0
        if parts:
            self._send_kv(tx, parts, n, deadline, make_data=lambda: self._packs.send_view(buf, n))

    def _send_kv(self, tx: _TxTransfer, parts: list[dict], nbytes: int, deadline: float, data: Any = None,
                 make_data: Callable[[], Any] | None = None) -> None:
        """One 'kv' message: wait for its credit, then send header and payload: ``data``,
        or what ``make_data()`` returns (called once there is credit: a device chunk is
        staged then, a pack buffer handed over)."""
        ch = tx.channel
        cost = nbytes + MESSAGE_OVERHEAD
        if ch.credit < cost:
            self._pump(ch)
        if ch.credit < cost:
            self.stats.add("credit_waits")
            t0 = time.monotonic()
            self._wait(ch, lambda: ch.credit >= cost, deadline, tx,
                       f"out of flow-control credit for {ch.address} ({ch.inflight} bytes in "
                       f"flight, window {ch.window}): receiver stalled or gone")
            self.stats.add("credit_wait_s", time.monotonic() - t0)
        self._check_usable(tx)
        sock = ch.sock
        if make_data is not None:
            data = make_data()
        if ch.sock is not sock:  # dropped meanwhile (by another thread, or while staging)
            self._fail(tx, f"connection to {ch.address} was reset")
            self._check_usable(tx)
        sock.send(wire.encode_kv(tx.xfer_id, parts, nbytes), zmq.SNDMORE)
        sock.send(data, copy=False)
        ch.credit -= cost
        ch.inflight += cost
        tx.chunks += len(parts)
        tx.nbytes += nbytes
        c = self.stats.c
        c["messages_sent"] += 1
        c["chunks_sent"] += len(parts)
        c["bytes_sent"] += nbytes
        if ch.inflight > c["max_inflight_bytes"]:
            c["max_inflight_bytes"] = ch.inflight
        if self._waiters:
            self._pump(ch)  # sending may have eaten the fd signal a sleeper waits for

    def _finish_async(self, xfer_id: str, timeout: float | None, digest: str) -> _TxTransfer:
        tx = self._tx.get(xfer_id)
        if tx is None:
            raise TransferError(f"unknown transfer {xfer_id!r} (never started, already finished or aborted)")
        try:
            self._check_usable(tx)
        except TransferError:
            self._forget(tx)
            raise
        if tx.state == "open" and tx.pack_parts:   # the last small layers go before 'done'
            try:
                self._guarded(tx, time.monotonic(), timeout, lambda deadline: self._flush(tx, deadline))
            except TransferError:
                self._forget(tx)
                raise
        if tx.state == "open":
            now = time.monotonic()
            tx.state = "done_sent"
            tx.done_at = now
            tx.ack_deadline = now + (tx.budget if timeout is None else min(tx.budget, timeout))
            try:
                self._send(tx.channel, [wire.encode("done", xfer=xfer_id, chunks=tx.chunks, layers=len(tx.pieces),
                                                    nbytes=tx.nbytes, digest=digest)])
            except zmq.ZMQError as e:
                self._fail(tx, f"sending 'done' failed: {e}")
                self._forget(tx)
                raise self._error(tx) from None
        return tx

    def _check_usable(self, tx: _TxTransfer) -> None:
        """Raise the transfer's error if it failed (the record stays); an open
        transfer that spent its wait budget fails now (it could only fail at finish)."""
        if tx.state != "failed" and tx.generation != tx.channel.generation:
            self._fail(tx, f"connection to {tx.channel.address} was reset")
        if tx.state == "open" and tx.budget <= 0:
            now = time.monotonic()
            self._on_timeout(tx, f"it spent its whole wait budget ({self.timeout:g} s) waiting on the receiver",
                             now)
        if tx.state == "failed":
            raise self._error(tx)

    @staticmethod
    def _error(tx: _TxTransfer) -> TransferError:
        if tx.error_cls is TransferError:
            return TransferError(f"transfer {tx.xfer_id!r} failed: {tx.error}")
        return tx.error_cls(f"transfer {tx.xfer_id!r}: {tx.error}")

    def _fail(self, tx: _TxTransfer, error: str, cls: type[TransferError] = TransferError,
              refused: bool = False) -> None:
        if tx.state in ("failed", "acked"):
            return
        tx.state = "failed"
        tx.error = error
        tx.error_cls = cls
        if tx.pack_buf is not None:   # never sent now
            self._packs.put(tx.pack_buf)
        tx.pack_parts, tx.pack_buf, tx.pack_pos = [], None, 0
        self.stats.add("transfers_refused" if refused else "transfers_failed")
        failed = self._failed
        failed[tx.xfer_id] = tx
        failed.move_to_end(tx.xfer_id)
        while len(failed) > MAX_FAILED_KEPT:  # the caller never finished/aborted these
            x, old = failed.popitem(last=False)
            if self._tx.get(x) is old:
                del self._tx[x]

    def _forget(self, tx: _TxTransfer) -> None:
        x = tx.xfer_id
        if self._tx.get(x) is tx:
            del self._tx[x]
        if self._failed.get(x) is tx:
            del self._failed[x]

    def _send_abort(self, tx: _TxTransfer, reason: str) -> None:
        if tx.generation == tx.channel.generation and tx.channel.sock is not None:
            try:
                tx.channel.sock.send(wire.encode("abort", xfer=tx.xfer_id, reason=reason[:1000]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # best effort

    def _send(self, ch: _Channel, frames: list) -> None:
        # SNDHWM is unlimited (credit bounds the data), so this does not block
        ch.sock.send_multipart(frames, copy=False)
        if self._waiters:
            self._pump(ch)  # sending may have eaten the fd signal a sleeper waits for

    def _wait(self, ch: _Channel, pred: Callable[[], bool], deadline: float, tx: _TxTransfer, what: str) -> None:
        """Wait (lock released while sleeping) until ``pred()`` or until ``tx`` failed
        (callers then ``_check_usable``); TransferTimeout at ``deadline``. While the
        connection waits for its credit grant, its connect bound applies too.
        Sleeps on the DEALER's and its monitor's file descriptors, which ZeroMQ
        signals when messages/events may be ready, and on the self-pipe that
        other threads poke after applying incoming messages themselves."""
        start = time.monotonic()
        while True:
            more = self._pump(ch)
            if tx.state == "failed" or tx.generation != ch.generation or pred():
                return
            now = time.monotonic()
            if self._check_connect(ch, now):
                return  # the connection failed (tx with it)
            if now >= deadline:
                self._on_timeout(tx, what, start)
                raise TransferTimeout(f"transfer {tx.xfer_id!r}: timeout: {what}")
            wake = deadline if ch.ready else min(deadline, ch.connect_deadline)
            fds = [fd for fd in (ch.fd, ch.mon_fd) if fd >= 0] + [self._pipe_r]
            self._waiters += 1
            self._lock.release()
            try:
                nap = 0.0 if more else max(0.0, min(wake - now, 0.05 if self._waiters <= 1 else 0.005))
                r, _, _ = select.select(fds, [], [], nap)   # (ZeroMQ's fd is edge-triggered)
                if self._pipe_r in r:
                    try:
                        os.read(self._pipe_r, 4096)
                    except BlockingIOError:
                        pass
            except (OSError, ValueError):
                pass  # a socket was closed by another thread meanwhile: re-check under the lock
            finally:
                self._lock.acquire()
                self._waiters -= 1

    def _check_connect(self, ch: _Channel, now: float) -> bool:
        """Apply the connect bound: a connection without its credit grant by
        ``connect_deadline`` fails, if anyone waits on it (or it is the
        half-open probe). True when it just failed."""
        if ch.sock is None or ch.ready or now < ch.connect_deadline:
            return False
        if ch.state != HALF_OPEN and not self._has_active(ch):
            return False
        self.stats.add("connect_timeouts")
        self._channel_failed(ch, f"no credit grant from the receiver at {ch.address} within connect_timeout "
                                 f"{self.connect_timeout:g} s (not running, unreachable, or CURVE keys that do not "
                                 f"match?)", TransferTimeout)
        return True

    def _on_timeout(self, tx: _TxTransfer, what: str, since: float) -> None:
        self.stats.add("timeouts")
        if tx.state not in ("failed", "acked"):
            self._fail(tx, f"timeout: {what}", TransferTimeout)
            self._send_abort(tx, f"sender gave up: {what}")
        ch = tx.channel
        silent = time.monotonic() - since
        if ch.sock is not None and tx.generation == ch.generation and ch.last_rx < since \
                and silent >= self.connect_timeout:
            # nothing heard from the receiver while we waited: treat it as gone
            self._channel_failed(ch, f"nothing heard from the receiver for {silent:.1f} s (transfer "
                                     f"{tx.xfer_id!r} timed out: {what})", TransferError)

    def _channel_failed(self, ch: _Channel, error: str, cls: type[TransferError]) -> None:
        """Drop the connection, fail every transfer on it, open the breaker."""
        now = time.monotonic()
        ch.failures += 1
        cooldown = min(self.breaker_cooldown_s * 2 ** min(ch.failures - 1, 30), self.breaker_max_cooldown_s)
        ch.state = OPEN
        ch.open_until = now + cooldown
        ch.last_error = error
        log.warning("kvtransfer sender: %s: %s; refusing new transfers to it for %.1f s", ch.address, error, cooldown)
        for tx in self._tx.values():
            if tx.channel is ch and tx.state in ("open", "done_sent"):
                self._fail(tx, f"connection to {ch.address} dropped: {error}", cls)
        self._drop_socket(ch)
        self.stats.add("breaker_opens")
        self.stats.add("channel_resets")

    def _connect(self, ch: _Channel, now: float) -> None:
        """A fresh DEALER (new routing id) for ``ch``, greeting the receiver."""
        self._drop_socket(ch)
        s = self._ctx.socket(zmq.DEALER)
        mon = None
        try:
            # an unguessable routing id: the receiver ties transfer ownership to it
            s.setsockopt(zmq.IDENTITY, f"{self.name[:64]}-{uuid.uuid4().hex}".encode())
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)   # the credit window bounds the data in flight
            s.setsockopt(zmq.RCVHWM, SENDER_RCVHWM)  # only small control messages come back
            if self.curve is not None:
                s.curve_publickey = self.curve.public
                s.curve_secretkey = self.curve.secret
                s.curve_serverkey = self.curve.server_public
            endpoint = f"inproc://{self.name}-monitor-{uuid.uuid4().hex}"
            s.monitor(endpoint, _MONITORED)
            mon = self._ctx.socket(zmq.PAIR)
            mon.setsockopt(zmq.LINGER, 0)
            mon.connect(endpoint)
            s.connect(ch.address)
        except zmq.ZMQError as e:
            s.close(0)
            if mon is not None:
                mon.close(0)
            raise ValueError(f"cannot connect to KV destination {ch.address!r}: {e}") from None
        ch.sock, ch.monitor = s, mon
        ch.fd = s.getsockopt(zmq.FD)
        ch.mon_fd = mon.getsockopt(zmq.FD)
        ch.ready = False
        ch.credit = ch.inflight = 0
        ch.connect_deadline = now + self.connect_timeout
        s.send(wire.encode("hello", layout=self.layout))

    def _drop_socket(self, ch: _Channel) -> None:
        if ch.sock is not None:
            try:
                ch.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            ch.sock.close(0)  # drops what is queued (and releases staging buffers)
            ch.sock = None
            ch.generation += 1
        if ch.monitor is not None:
            ch.monitor.close(0)
            ch.monitor = None
        ch.fd = ch.mon_fd = -1
        ch.ready = False

    def _pump(self, ch: _Channel) -> bool:
        """Read and apply what the receiver sent (up to PUMP_MAX_MESSAGES), then the
        connection's events (non-blocking). True when messages were left unread."""
        sock = ch.sock
        if sock is None:
            return False
        ch.pumped = time.monotonic()
        n = 0
        # ZMQ_EVENTS first: cheaper than a recv raising zmq.Again (this runs once per layer).
        # At most PUMP_MAX_MESSAGES per call: a receiver that sends replies as fast as they are
        # read must not hold the engine's thread (and this lock) here; the rest waits for the
        # next call
        while n < PUMP_MAX_MESSAGES and sock.getsockopt(_EVENTS) & _POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                msg = wire.decode(frames, RECEIVER_KINDS, wire.MAX_HEADER_BYTES)
            except WireError as e:
                log_reject("sender", self.stats.reject(e.reason), e, ch.address)
                continue
            ch.last_rx = time.monotonic()
            h = msg.header
            if msg.kind == "credit":
                self._apply_credit(ch, h)
                continue
            if msg.kind == "refuse":
                # the receiver will take nothing from this sender (e.g. its KV layout does not fit)
                self.stats.add("refusals")
                self._channel_failed(ch, f"the receiver at {ch.address} refuses this sender: {h['reason']}",
                                     TransferError)
                break   # the socket is closed now
            tx = self._tx.get(h["xfer"])
            if tx is None or tx.channel is not ch or tx.generation != ch.generation:
                continue  # a late answer about a transfer we already gave up on
            if msg.kind == "ack":
                if tx.state == "done_sent":
                    tx.state = "acked"
                    self.stats.add("transfers_acked")
            else:  # nack
                self._fail(tx, f"receiver: {h['reason']}")
        if n and self._waiters:
            try:
                os.write(self._pipe_w, b"x")
            except BlockingIOError:
                pass
        self._pump_events(ch)
        return n >= PUMP_MAX_MESSAGES

    def _apply_credit(self, ch: _Channel, h: dict) -> None:
        if h["init"]:
            if h["bytes"] < MIN_CREDIT_BYTES or h["max_message"] < MIN_MAX_MESSAGE_BYTES:
                log_reject("sender", self.stats.reject("bad_credit"),
                           f"credit grant of {h['bytes']} bytes / max_message {h['max_message']} is below "
                           f"{MIN_CREDIT_BYTES} / {MIN_MAX_MESSAGE_BYTES}", ch.address)
                return
            ch.window = h["bytes"]
            ch.max_message = h["max_message"]
            ch.credit = max(0, ch.window - ch.inflight)
            ch.ready = True
            if ch.state != CLOSED:
                log.info("kvtransfer sender: %s answers again; accepting transfers to it", ch.address)
            ch.state = CLOSED
            ch.failures = 0
        elif ch.ready:
            ch.inflight = max(0, ch.inflight - h["bytes"])
            ch.credit = min(ch.credit + h["bytes"], ch.window - ch.inflight)  # never beyond the window

    def _pump_events(self, ch: _Channel) -> None:
        mon = ch.monitor
        while mon is not None and mon.getsockopt(_EVENTS) & _POLLIN:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)["event"]
            except Exception:  # a local socket: never malformed, but never fatal either
                continue
            if event & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.stats.add("handshake_failures")
                why = ("the receiver refused this sender's CURVE client key (it is not in the receiver's "
                       "clients/ directory)")
            elif event & (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                self.stats.add("handshake_failures")
                why = ("the connection handshake failed (CURVE key mismatch: wrong server key, or only one side "
                       "uses CURVE)")
            elif event & zmq.EVENT_DISCONNECTED:
                self.stats.add("connection_resets")
                why = "the connection was reset (receiver stopped or restarted?)"
            else:
                continue
            self._channel_failed(ch, why, TransferError)
            return


def _check_xfer_id(xfer_id: Any) -> None:
    if not wire.valid_xfer(xfer_id):
        raise ValueError(f"xfer_id must be a non-empty str of at most {wire.MAX_XFER_LEN} chars")


def _check_digest(digest: Any) -> None:
    if not wire.valid_digest(digest):
        raise ValueError(f"digest must be a str of at most {wire.MAX_DIGEST_LEN} lower-case hex digits, "
                         f"got {digest!r:.80}")
