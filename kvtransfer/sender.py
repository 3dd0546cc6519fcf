"""Producer side of the KV transport: :class:`KVSender` (see ``kvtransfer.transport``
for the socket and flow-control design)."""
from __future__ import annotations

import itertools
import os
import select
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from . import wire
from .common import (DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT_S, MESSAGE_OVERHEAD, Stats, TransferError,
                     TransferTimeout, is_torch_tensor, log, log_reject, normalize_dtype)
from .wire import DTYPES, RECEIVER_KINDS, WireError

_INT_ONLY = {int}

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


class _DeviceSource:
    """A tensor on an accelerator (cuda, npu, xpu, ...), staged chunk by chunk
    through reusable host buffers (see :class:`_Stager`)."""

    def __init__(self, tensor, stager: "_Stager"):
        self.t = tensor
        self.stager = stager

    def chunk(self, spec: ChunkSpec, deadline: float) -> Any:
        src = self.t if spec.rows is None else self.t.reshape(-1, *spec.shape[1:])[spec.rows[0]:spec.rows[1]]
        return self.stager.stage(src, spec.nbytes, deadline)


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


class _Channel:
    """One DEALER connection to one receiver address, with its credit state."""
    _ids = itertools.count()

    def __init__(self, address: str):
        self.address = address
        self.sock: zmq.Socket | None = None
        self.fd = -1
        self.generation = 0
        self.ready = False
        self.window = 0
        self.max_message = 0
        self.credit = 0
        self.inflight = 0
        self.last_rx = 0.0


class _TxTransfer:
    def __init__(self, xfer_id: str, ch: _Channel):
        self.xfer_id = xfer_id
        self.channel = ch
        self.generation = ch.generation
        self.chunks = 0
        self.layers: set[int] = set()
        self.nbytes = 0
        self.state = "open"  # open -> done_sent -> acked | failed
        self.error: str | None = None
        self.t0 = time.monotonic()
        self.deadline: float | None = None  # set by finish_async


class KVSender:
    """Producer side of the KV transport.

    ``address`` is the default destination (a :class:`KVReceiver`'s ``tcp://`` or
    ``ipc://`` endpoint); a transfer may name another with ``dest=`` on its first
    call. Buffers handed to :meth:`send_layer` are sent zero-copy: they must not
    be modified until :meth:`finish` returns (the ack means every byte is on the
    receiver), or the transfer is aborted.

    No background thread: the sockets are driven by the calling thread(s) under
    one lock (ZeroMQ sockets are not thread-safe), so a chunk reaches ZeroMQ's
    own I/O thread the moment it is sent. Incoming credit and acks are read
    whenever a method runs; blocking waits release the lock while they sleep on
    the socket's file descriptor, so several threads may share one sender.
    """

    def __init__(self, address: str | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout: float = DEFAULT_TIMEOUT_S, staging_slots: int = 2,
                 ctx: zmq.Context | None = None, name: str | None = None):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        self.address = address
        self.chunk_bytes = int(chunk_bytes)
        self.timeout = float(timeout)
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
        self._stager = _Stager(staging_slots)
        self._closed = False
        self.stats = Stats("bytes_sent", "chunks_sent", "layers_sent", "transfers_started", "transfers_acked",
                           "transfers_failed", "transfers_aborted", "timeouts", "credit_waits", "credit_wait_s",
                           "max_inflight_bytes", "contiguous_copies", "channel_resets")

    # ------------------------------------------------------------------ public

    def connect(self, dest: str | None = None) -> None:
        """Open the connection to ``dest`` (default: the sender's address) ahead of
        the first transfer (optional; it saves the credit handshake later)."""
        with self._lock:
            self._channel(dest or self.address)

    def begin(self, xfer_id: str, dest: str | None = None) -> None:
        """Open a transfer explicitly (optional: the first ``send_layer`` does it). A
        transfer with no layers (e.g. everything was a prefix-cache hit) still
        needs :meth:`finish`."""
        with self._lock:
            self._open_transfer(xfer_id, dest)

    def send_layer(self, xfer_id: str, layer: int, blocks: Sequence[int], data: Any, dtype: Any = None,
                   shape: Sequence[int] | None = None, *, dest: str | None = None,
                   timeout: float | None = None) -> int:
        """Send one layer's KV for transfer ``xfer_id``, split into chunks of at most
        ``chunk_bytes``; returns the number of chunks.

        ``data``: numpy array, bytes-like (``dtype`` and ``shape`` then required),
        or torch tensor on any device (CPU: zero-copy; others: staged through
        pinned host buffers). ``blocks``: the layer's block ids in the sender's
        numbering (see :mod:`kvtransfer.wire`). Blocks while out of flow-control
        credit, ``timeout`` s at most for the whole call (default: the sender's);
        then raises :class:`TransferTimeout` and the transfer is failed and
        aborted. Raises :class:`TransferError` if the receiver already rejected
        the transfer."""
        if not isinstance(xfer_id, str) or not 0 < len(xfer_id) <= wire.MAX_XFER_LEN:
            raise ValueError(f"xfer_id must be a non-empty str of at most {wire.MAX_XFER_LEN} chars")
        if type(layer) is not int or layer < 0:
            raise ValueError(f"layer must be an int >= 0, got {layer!r}")
        blocks = list(blocks)
        if blocks and not (set(map(type, blocks)) == _INT_ONLY and min(blocks) >= 0):
            blocks = [int(b) for b in blocks]  # numpy / torch integers
            if min(blocks) < 0:
                raise ValueError("block ids must be >= 0")
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            src, dtype_name, lshape = make_source(data, dtype, shape, self._stager, self.stats)
            isz = DTYPES[dtype_name]
            tx = self._open_transfer(xfer_id, dest)
            if layer in tx.layers:
                raise ValueError(f"transfer {xfer_id!r}: layer {layer} was already sent")
            ch = tx.channel
            try:
                if not ch.ready:
                    self._wait(ch, lambda: ch.ready or tx.state == "failed", deadline, tx,
                               f"no credit grant from the receiver at {ch.address} (not running?)")
                self._check_usable(tx)
                header_room = 1024 + 10 * len(blocks) + 20 * len(lshape)
                # at most half the window: the receiver returns credit in batches of
                # a quarter window, so a chunk always fits once the pipe has drained
                chunk = max(isz, min(self.chunk_bytes, ch.window // 2 - MESSAGE_OVERHEAD,
                                     ch.max_message - header_room))
                specs = plan_chunks(lshape, isz, chunk, blocks)
                tx.layers.add(layer)
                lshape_l = list(lshape)
                sock = ch.sock
                c = self.stats.c
                for spec in specs:
                    cost = spec.nbytes + MESSAGE_OVERHEAD
                    if ch.credit < cost:
                        self._pump(ch)
                    if ch.credit < cost:
                        self.stats.add("credit_waits")
                        t0 = time.monotonic()
                        self._wait(ch, lambda: ch.credit >= cost or tx.state == "failed"
                                   or tx.generation != ch.generation, deadline, tx,
                                   f"out of flow-control credit for {ch.address} ({ch.inflight} bytes in "
                                   f"flight, window {ch.window}): receiver stalled or gone")
                        self.stats.add("credit_wait_s", time.monotonic() - t0)
                    self._check_usable(tx)
                    payload = src.chunk(spec, deadline)
                    header = wire.encode_kv(xfer_id, layer, spec.seq, spec.blocks, dtype_name, spec.shape,
                                            spec.nbytes, spec.offset, lshape_l)
                    if ch.sock is not sock:  # reset by another thread meanwhile
                        self._fail(tx, f"connection to {ch.address} was reset")
                        self._check_usable(tx)
                    sock.send(header, zmq.SNDMORE)
                    sock.send(payload, copy=False)
                    ch.credit -= cost
                    ch.inflight += cost
                    tx.chunks += 1
                    tx.nbytes += spec.nbytes
                    c["chunks_sent"] += 1
                    c["bytes_sent"] += spec.nbytes
                    if ch.inflight > c["max_inflight_bytes"]:
                        c["max_inflight_bytes"] = ch.inflight
                if self._waiters:
                    self._pump(ch)  # sending may have eaten the fd signal a sleeper waits for
            except TransferTimeout as e:
                if tx.state != "failed":
                    self._on_timeout(tx, str(e), time.monotonic())
                raise
            except BaseException as e:  # a layer half sent: the transfer cannot complete
                if tx.state != "failed":
                    self._fail(tx, f"send_layer failed: {type(e).__name__}: {e}")
                    self._send_abort(tx, "sender failed mid-layer")
                self._tx.pop(xfer_id, None)
                raise
            c["layers_sent"] += 1
            return len(specs)

    def finish_async(self, xfer_id: str, timeout: float | None = None) -> None:
        """Send ``done`` without waiting for the ack; collect the outcome with
        :meth:`poll_finished` (no ack within ``timeout`` s: reported as a
        :class:`TransferTimeout`, and the transfer aborted)."""
        with self._lock:
            self._finish_async(xfer_id, timeout)

    def finish(self, xfer_id: str, timeout: float | None = None) -> SendResult:
        """Close the transfer (``done`` announcing what was sent) and wait for the
        receiver's ``ack`` confirming full receipt -- only then may the caller
        free the KV blocks. Raises :class:`TransferTimeout` when no ack arrives
        within ``timeout`` s (the transfer is then aborted) and
        :class:`TransferError` when the receiver reports a failure (truncated,
        rejected, gave up)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            tx = self._finish_async(xfer_id, timeout)
            self._wait(tx.channel, lambda: tx.state in ("acked", "failed"), deadline, tx,
                       f"no ack from the receiver at {tx.channel.address} within {timeout:.3g} s")
            self._tx.pop(xfer_id, None)
            self._check_usable(tx, final=True)
            return SendResult(xfer_id, tx.chunks, len(tx.layers), tx.nbytes, time.monotonic() - tx.t0)

    def poll_finished(self) -> dict[str, SendResult | TransferError]:
        """Outcomes of transfers closed with :meth:`finish_async` that are final now
        (acked, failed, or past their deadline); each is reported once."""
        out: dict[str, SendResult | TransferError] = {}
        with self._lock:
            for ch in self._channels.values():
                self._pump(ch)
            now = time.monotonic()
            for x, tx in list(self._tx.items()):
                if tx.deadline is None:
                    continue
                if tx.state == "acked":
                    out[x] = SendResult(x, tx.chunks, len(tx.layers), tx.nbytes, now - tx.t0)
                elif tx.state == "failed":
                    out[x] = TransferError(f"transfer {x!r} failed: {tx.error}")
                elif now > tx.deadline:
                    self._on_timeout(tx, f"no ack from the receiver at {tx.channel.address} in time", tx.deadline)
                    out[x] = TransferTimeout(f"transfer {x!r}: {tx.error}")
                else:
                    continue
                self._tx.pop(x, None)
        return out

    def abort(self, xfer_id: str, reason: str = "aborted by sender") -> None:
        """Tell the receiver to drop whatever it holds for ``xfer_id``; never blocks."""
        with self._lock:
            tx = self._tx.pop(xfer_id, None)
            if tx is None:
                return
            if tx.state != "acked":
                self._send_abort(tx, reason)
            self.stats.add("transfers_aborted")

    def pending(self) -> list[str]:
        """Transfers started and not yet finished/aborted/collected."""
        with self._lock:
            return list(self._tx)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for tx in self._tx.values():
                self._fail(tx, "sender closed")
            for ch in self._channels.values():
                if ch.sock is not None:
                    ch.sock.close(0)
                    ch.sock = None
            os.close(self._pipe_r)
            os.close(self._pipe_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -------------------------------------------------- internals (hold _lock)

    def _channel(self, address: str | None) -> _Channel:
        if self._closed:
            raise TransferError("sender is closed")
        if not address:
            raise ValueError("no destination: pass dest= or construct KVSender(address)")
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = _Channel(address)
            self._connect(ch)
        return ch

    def _open_transfer(self, xfer_id: str, dest: str | None) -> _TxTransfer:
        tx = self._tx.get(xfer_id)
        if tx is not None:
            if dest is not None and dest != tx.channel.address:
                raise ValueError(f"transfer {xfer_id!r} already goes to {tx.channel.address}, not {dest}")
            if tx.state != "open":
                self._check_usable(tx)
                raise TransferError(f"transfer {xfer_id!r} is already finishing")
            return tx
        ch = self._channel(dest or self.address)
        tx = self._tx[xfer_id] = _TxTransfer(xfer_id, ch)
        self.stats.add("transfers_started")
        return tx

    def _finish_async(self, xfer_id: str, timeout: float | None) -> _TxTransfer:
        tx = self._tx.get(xfer_id)
        if tx is None:
            raise TransferError(f"unknown transfer {xfer_id!r} (never started, already finished or aborted)")
        self._check_usable(tx)
        if tx.state == "open":
            tx.state = "done_sent"
            tx.deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            self._send(tx.channel, [wire.encode("done", xfer=xfer_id, chunks=tx.chunks, layers=len(tx.layers),
                                                nbytes=tx.nbytes)])
        return tx

    def _check_usable(self, tx: _TxTransfer, final: bool = False) -> None:
        if tx.state != "failed" and tx.generation != tx.channel.generation:
            self._fail(tx, f"connection to {tx.channel.address} was reset")
        if tx.state == "failed":
            self._tx.pop(tx.xfer_id, None)
            if tx.error and tx.error.startswith("timeout"):
                raise TransferTimeout(f"transfer {tx.xfer_id!r}: {tx.error}")
            raise TransferError(f"transfer {tx.xfer_id!r} failed: {tx.error}")

    def _fail(self, tx: _TxTransfer, error: str) -> None:
        if tx.state not in ("failed", "acked"):
            tx.state = "failed"
            tx.error = error
            self.stats.add("transfers_failed")

    def _send_abort(self, tx: _TxTransfer, reason: str) -> None:
        if tx.generation == tx.channel.generation and tx.channel.sock is not None:
            try:
                tx.channel.sock.send(wire.encode("abort", xfer=tx.xfer_id, reason=reason[:1000]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # best effort

    def _send(self, ch: _Channel, frames: list) -> None:
        # SNDHWM is unlimited (credit bounds the data), so this does not block;
        # EAGAIN would mean "no peer pipe", which connect() never leaves us in.
        ch.sock.send_multipart(frames, copy=False)
        if self._waiters:
            self._pump(ch)  # sending may have eaten the fd signal a sleeper waits for

    def _wait(self, ch: _Channel, pred: Callable[[], bool], deadline: float, tx: _TxTransfer, what: str) -> None:
        """Wait (lock released while sleeping) until ``pred()``; TransferTimeout at
        ``deadline``. Sleeps on the DEALER's file descriptor, which ZeroMQ signals
        when incoming messages may be ready, and on the self-pipe that other threads
        poke after applying incoming messages themselves."""
        start = time.monotonic()
        while True:
            self._pump(ch)
            if pred():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._on_timeout(tx, what, start)
                raise TransferTimeout(f"transfer {tx.xfer_id!r}: timeout: {what}")
            fd = ch.fd
            self._waiters += 1
            self._lock.release()
            try:
                r, _, _ = select.select([fd, self._pipe_r], [], [], min(remaining, 0.05 if self._waiters <= 1 else 0.005))
                if self._pipe_r in r:
                    try:
                        os.read(self._pipe_r, 4096)
                    except BlockingIOError:
                        pass
            finally:
                self._lock.acquire()
                self._waiters -= 1

    def _on_timeout(self, tx: _TxTransfer, what: str, since: float) -> None:
        self.stats.add("timeouts")
        if tx.state not in ("failed", "acked"):
            self._fail(tx, f"timeout: {what}")
            self._send_abort(tx, f"sender gave up: {what}")
        self._tx.pop(tx.xfer_id, None)
        ch = tx.channel
        if ch.last_rx < since and ch.sock is not None:
            # nothing heard from the receiver while we waited: treat the connection as
            # dead; a fresh DEALER (new routing id, new hello) picks up a restarted one
            self._reset(ch)

    def _connect(self, ch: _Channel) -> None:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, f"{self.name}-{next(_Channel._ids)}-{uuid.uuid4().hex[:8]}".encode())
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)   # the credit window bounds the data in flight
        s.setsockopt(zmq.RCVHWM, 0)   # only small control messages come back
        s.connect(ch.address)
        ch.sock = s
        ch.fd = s.getsockopt(zmq.FD)
        ch.ready = False
        ch.credit = ch.inflight = 0
        s.send(wire.encode("hello"))

    def _reset(self, ch: _Channel) -> None:
        log.warning("kvtransfer sender: no reply from %s; reconnecting", ch.address)
        ch.sock.close(0)  # drops what is queued (and releases staging buffers)
        ch.sock = None
        ch.generation += 1
        for tx in self._tx.values():
            if tx.channel is ch:
                self._fail(tx, f"connection to {ch.address} reset after a timeout")
        self.stats.add("channel_resets")
        self._connect(ch)

    def _pump(self, ch: _Channel) -> None:
        """Read and apply everything the receiver sent (non-blocking)."""
        sock = ch.sock
        if sock is None:
            return
        n = 0
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if n and self._waiters:
                    try:
                        os.write(self._pipe_w, b"x")
                    except BlockingIOError:
                        pass
                return
            n += 1
            try:
                msg = wire.decode(frames, RECEIVER_KINDS, wire.MAX_HEADER_BYTES)
            except WireError as e:
                log_reject("sender", self.stats.reject(e.reason), e, ch.address)
                continue
            ch.last_rx = time.monotonic()
            h = msg.header
            if msg.kind == "credit":
                if h["init"]:
                    ch.window = h["bytes"]
                    ch.max_message = h["max_message"]
                    ch.credit = h["bytes"] - ch.inflight
                    ch.ready = True
                else:
                    ch.credit += h["bytes"]
                    ch.inflight = max(0, ch.inflight - h["bytes"])
                continue
            tx = self._tx.get(h["xfer"])
            if tx is None or tx.channel is not ch:
                continue  # a late answer about a transfer we already gave up on
            if msg.kind == "ack":
                if tx.state == "done_sent":
                    tx.state = "acked"
                    self.stats.add("transfers_acked")
            else:  # nack
                self._fail(tx, f"receiver: {h['reason']}")
