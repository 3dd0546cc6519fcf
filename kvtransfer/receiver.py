"""Consumer side of the KV transport: :class:`KVReceiver` and the transfer results
(see ``kvtransfer.transport`` for the socket and flow-control design)."""
from __future__ import annotations

import collections
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import zmq

from . import wire
from .common import (DEFAULT_CREDIT_BYTES, DEFAULT_HOST, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TIMEOUT_S,
                     MESSAGE_OVERHEAD, Stats, TransferError, TransferTimeout, accepts_kwargs, log, log_reject,
                     numpy_dtype)
from .wire import DTYPES, SENDER_KINDS, WireError

_POLL_MS = 100



@dataclass
class ChunkData:
    seq: int
    offset: int
    shape: tuple
    blocks: list
    data: memoryview


@dataclass
class LayerData:
    layer: int
    dtype: str
    shape: tuple            # whole layer
    chunks: list            # [ChunkData] by seq
    nbytes: int = 0

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
    layers: dict = field(default_factory=dict)   # layer -> LayerData (empty with on_chunk or on error)
    elapsed_s: float = 0.0                       # first message -> done

    def raise_for_error(self) -> "TransferResult":
        if not self.ok:
            raise TransferError(f"transfer {self.xfer_id!r} failed: {self.error}")
        return self

    def layer_array(self, layer: int) -> np.ndarray:
        return self.layers[layer].array()

    def layer_bytes(self, layer: int) -> bytes:
        return self.layers[layer].tobytes()


class _RxTransfer:
    def __init__(self, xfer_id: str, peer: bytes, now: float):
        self.xfer_id = xfer_id
        self.peer = peer
        self.layers: dict[int, LayerData] = {}
        self.chunks = 0
        self.nbytes = 0
        self.t0 = now
        self.last = now


_RECEIVER_STATS = ("bytes_received", "chunks_received", "messages_received", "transfers_completed",
                   "transfers_failed", "transfers_aborted", "transfers_abandoned", "transfers_stale",
                   "results_expired", "acks_sent", "nacks_sent", "credit_messages", "send_failures",
                   "wait_timeouts", "held_bytes_max", "late_done")


class KVReceiver:
    """Consumer side: binds a ROUTER socket and serves any number of senders from a
    background thread.

    ``address`` defaults to ``tcp://127.0.0.1:<port>`` (``port=0``: an ephemeral
    port; see :attr:`address` for the bound endpoint); ``ipc://`` paths work too.
    A non-loopback address is only ever bound when passed explicitly.

    With ``on_chunk=None`` the chunks of each transfer are kept (zero-copy
    ZeroMQ frames) and handed over by :meth:`wait` as a :class:`TransferResult`.
    Otherwise ``on_chunk(xfer_id, layer, seq, blocks, buf, dtype, shape)`` is
    called on the receiver thread for every chunk (``buf`` is a memoryview valid
    during the call: copy it into the destination KV blocks); if the callable
    also accepts ``offset`` and ``layer_shape`` keywords (or ``**kwargs``), they
    are passed too (byte offset of the chunk in the layer, whole-layer shape). An
    exception from the callback fails that transfer. The ``ack`` that lets the
    sender free its blocks goes out as soon as the transfer is complete (all
    chunks received and consumed), from the receiver thread.
    """

    def __init__(self, address: str | None = None, *, port: int = 0,
                 on_chunk: Callable[..., Any] | None = None,
                 credit_bytes: int = DEFAULT_CREDIT_BYTES,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_held_bytes: int = 8 << 30,
                 stale_after_s: float = 120.0, result_ttl_s: float = 600.0,
                 ctx: zmq.Context | None = None, name: str | None = None):
        if credit_bytes <= MESSAGE_OVERHEAD:
            raise ValueError(f"credit_bytes must be > {MESSAGE_OVERHEAD}")
        self.credit_bytes = int(credit_bytes)
        self._credit_batch = max(1, self.credit_bytes // 4)
        self.max_message_bytes = int(max_message_bytes)
        self.max_held_bytes = int(max_held_bytes)
        self.stale_after_s = float(stale_after_s)
        self.result_ttl_s = float(result_ttl_s)
        self.name = name or f"kvreceiver-{uuid.uuid4().hex[:8]}"
        self._on_chunk = on_chunk
        self._chunk_kwargs = on_chunk is not None and accepts_kwargs(on_chunk, ("offset", "layer_shape"))
        self._ctx = ctx or zmq.Context.instance()
        self.stats = Stats(*_RECEIVER_STATS)
        self._cond = threading.Condition()
        self._results: dict[str, tuple[float, TransferResult]] = {}
        self._open: dict[str, _RxTransfer] = {}          # receiver thread only
        self._closed_ids: collections.OrderedDict = collections.OrderedDict()  # receiver thread only
        self._held = 0
        self._cmds: collections.deque = collections.deque()
        self._closing = False
        self._closed = False

        if address is None:
            address = f"tcp://{DEFAULT_HOST}:{port if port else '*'}"
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # unroutable replies raise instead of vanishing
        sock.setsockopt(zmq.SNDHWM, 0)             # replies are small control messages
        sock.setsockopt(zmq.RCVHWM, 0)             # data volume is bounded by credit
        # hard backstop against absurd frames (libzmq drops such a peer); the
        # configurable limit is enforced per message in Python, with counting
        sock.setsockopt(zmq.MAXMSGSIZE, max(4 * self.max_message_bytes, 1 << 30))
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close(0)
            raise OSError(f"KVReceiver: cannot bind {address}: {e}") from None
        self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
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
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    # ---- public API

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

    def _pop_result(self, xfer_id: str) -> TransferResult | None:
        # caller holds self._cond
        item = self._results.pop(xfer_id, None)
        if item is None:
            return None
        res = item[1]
        if res.layers:
            self._held -= res.nbytes
        return res

    def ready(self, xfer_id: str) -> bool:
        """True when :meth:`wait` would return at once."""
        with self._cond:
            return xfer_id in self._results

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
        with self._wake_lock:
            self._wake_w.close(0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- receiver thread

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w.closed:
                return
            try:
                self._wake_w.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def _run(self) -> None:
        sock = self._sock
        sock.setsockopt(zmq.RCVTIMEO, _POLL_MS)
        next_gc = time.monotonic() + 1.0
        credit: dict[bytes, int] = {}
        batch = self._credit_batch
        try:
            while not self._closing:
                try:
                    frames = sock.recv_multipart(copy=False)
                except zmq.Again:  # idle
                    frames = None
                if self._cmds:  # before the next message: e.g. an abandon precedes a late 'done'
                    self._run_commands()
                if frames is not None:
                    peer = frames[0].bytes
                    if peer != self._wake_id:
                        n = self._handle(peer, frames[1:])
                        if n:
                            # return consumed credit in batches of >= a quarter window (the
                            # sender's chunks are at most half a window, so holding back
                            # less than a quarter can never starve it)
                            n += credit.get(peer, 0)
                            if n >= batch:
                                credit.pop(peer, None)
                                self._send(peer, wire.encode("credit", bytes=n, init=False,
                                                             max_message=self.max_message_bytes))
                                self.stats.add("credit_messages")
                            else:
                                credit[peer] = n
                now = time.monotonic()
                if now >= next_gc:
                    self._gc(now)
                    next_gc = now + 1.0
        except Exception:  # pragma: no cover
            log.exception("kvtransfer receiver thread crashed")
        finally:
            sock.close(0)
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _run_commands(self) -> None:
        with self._cond:
            cmds, self._cmds = self._cmds, collections.deque()
        for op, x in cmds:
            if op == "abandon":
                self._abandon(x)

    def _send(self, peer: bytes, header: bytes) -> None:
        try:
            self._sock.send_multipart([peer, header], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH (peer gone) or EAGAIN
            self.stats.add("send_failures")
            log.debug("kvtransfer receiver: reply to %r dropped: %s", peer, e)

    def _handle(self, peer: bytes, body: list) -> int:
        """Process one message; returns the credit it consumed (payload-carrying
        messages are charged whatever becomes of them)."""
        self.stats.c["messages_received"] += 1
        cost = sum(map(len, body[1:])) + MESSAGE_OVERHEAD if len(body) > 1 else 0
        try:
            msg = wire.decode(body, SENDER_KINDS, self.max_message_bytes)
        except WireError as e:
            self._reject(peer, e.reason, str(e), e.xfer, fail=True)
            return cost
        h = msg.header
        kind = msg.kind
        if kind == "kv":
            self._on_kv(peer, h, msg.payload[0])
        elif kind == "done":
            self._on_done(peer, h)
        elif kind == "abort":
            self._on_abort(peer, h)
        else:  # hello
            self._send(peer, wire.encode("credit", bytes=self.credit_bytes, init=True,
                                         max_message=self.max_message_bytes))
        return cost

    def _reject(self, peer: bytes, reason: str, detail: str, xfer: str | None, fail: bool) -> None:
        log_reject("receiver", self.stats.reject(reason), detail, repr(peer))
        if xfer is None:
            return
        t = self._open.get(xfer)
        if fail and (t is None or t.peer == peer) and xfer not in self._closed_ids:
            self._finish(xfer, t, False, f"chunk rejected ({detail})", "failed")
        if t is None or t.peer == peer:
            self._send(peer, wire.encode("nack", xfer=xfer, reason=f"rejected: {detail}"[:1000]))
            self.stats.add("nacks_sent")

    def _on_kv(self, peer: bytes, h: dict, buf: memoryview) -> None:
        x = h["xfer"]
        closed = self._closed_ids.get(x)
        if closed is not None:
            reason = "aborted_xfer" if closed in ("aborted", "abandoned") else "closed_xfer"
            self._reject(peer, reason, f"chunk for transfer {x!r} which is already {closed}", x, fail=False)
            return
        now = time.monotonic()
        t = self._open.get(x)
        if t is None:
            t = self._open[x] = _RxTransfer(x, peer, now)
        elif t.peer != peer:
            self._reject(peer, "peer_mismatch", f"transfer {x!r} belongs to another sender", None, fail=False)
            return
        layer, seq = h["layer"], h["seq"]
        lshape = tuple(h["lshape"])
        L = t.layers.get(layer)
        if L is None:
            L = t.layers[layer] = LayerData(layer, h["dtype"], lshape, [])
        elif L.dtype != h["dtype"] or L.shape != lshape:
            self._reject(peer, "layer_mismatch", f"transfer {x!r} layer {layer}: dtype/shape differ between chunks",
                         x, fail=True)
            return
        if L.chunks and seq <= L.chunks[-1].seq:
            self._reject(peer, "bad_seq", f"transfer {x!r} layer {layer}: chunk seq {seq} out of order/duplicate",
                         x, fail=True)
            return
        nbytes = h["nbytes"]
        shape = tuple(h["shape"])
        if self._on_chunk is not None:
            try:
                if self._chunk_kwargs:
                    self._on_chunk(x, layer, seq, h["blocks"], buf, h["dtype"], shape,
                                   offset=h["offset"], layer_shape=lshape)
                else:
                    self._on_chunk(x, layer, seq, h["blocks"], buf, h["dtype"], shape)
            except Exception as e:
                log.exception("kvtransfer receiver: on_chunk failed for %r layer %d seq %d", x, layer, seq)
                self._finish(x, t, False, f"on_chunk raised {type(e).__name__}: {e}", "failed")
                self._send(peer, wire.encode("nack", xfer=x, reason=f"destination write failed: {e}"[:1000]))
                self.stats.add("nacks_sent")
                return
            L.chunks.append(ChunkData(seq, h["offset"], shape, h["blocks"], memoryview(b"")))
        else:
            with self._cond:
                full = self._held + nbytes > self.max_held_bytes
                if not full:
                    self._held += nbytes
                    self.stats.max("held_bytes_max", self._held)
            if full:
                self._reject(peer, "receiver_full", f"holding {self._held} bytes, limit {self.max_held_bytes}",
                             x, fail=True)
                return
            L.chunks.append(ChunkData(seq, h["offset"], shape, h["blocks"], buf))
        L.nbytes += nbytes
        t.chunks += 1
        t.nbytes += nbytes
        t.last = now
        c = self.stats.c
        c["chunks_received"] += 1
        c["bytes_received"] += nbytes

    def _on_done(self, peer: bytes, h: dict) -> None:
        x = h["xfer"]
        closed = self._closed_ids.get(x)
        if closed is not None:
            if closed == "completed":  # a second 'done': not something our sender does
                self._reject(peer, "closed_xfer", f"'done' for transfer {x!r} which is already complete", x,
                             fail=False)
            else:  # the sender had not yet heard that its transfer failed: the usual race
                self.stats.add("late_done")
                self._send(peer, wire.encode("nack", xfer=x, reason=f"transfer already {closed}"))
                self.stats.add("nacks_sent")
            return
        t = self._open.get(x)
        if t is None:
            t = _RxTransfer(x, peer, time.monotonic())
        elif t.peer != peer:
            self._reject(peer, "peer_mismatch", f"transfer {x!r} belongs to another sender", None, fail=False)
            return
        problem = None
        if (t.chunks, len(t.layers), t.nbytes) != (h["chunks"], h["layers"], h["nbytes"]):
            problem = (f"truncated: sender announced {h['chunks']} chunks / {h['layers']} layers / "
                       f"{h['nbytes']} bytes, received {t.chunks} / {len(t.layers)} / {t.nbytes}")
        else:
            for L in t.layers.values():
                want = wire.prod(L.shape) * DTYPES[L.dtype]
                pos = 0
                for i, c in enumerate(L.chunks):
                    n = wire.prod(c.shape) * DTYPES[L.dtype]
                    if c.seq != i or c.offset != pos:
                        problem = f"layer {L.layer}: chunk {c.seq} missing or misplaced"
                        break
                    pos += n
                if problem is None and pos != want:
                    problem = f"truncated: layer {L.layer} has {pos} of {want} bytes"
                if problem:
                    break
        if problem is None:
            self._finish(x, t, True, None, "completed")
            self._send(peer, wire.encode("ack", xfer=x, chunks=t.chunks, nbytes=t.nbytes))
            self.stats.add("acks_sent")
        else:
            log.warning("kvtransfer receiver: transfer %r failed: %s", x, problem)
            self._finish(x, t, False, problem, "failed")
            self._send(peer, wire.encode("nack", xfer=x, reason=problem))
            self.stats.add("nacks_sent")

    def _on_abort(self, peer: bytes, h: dict) -> None:
        x = h["xfer"]
        t = self._open.get(x)
        if t is not None and t.peer != peer:
            self._reject(peer, "peer_mismatch", f"abort for transfer {x!r} from another sender", None, fail=False)
            return
        if self._closed_ids.get(x) in ("aborted", "abandoned"):
            return
        with self._cond:  # an uncollected complete result is withdrawn too: the sender's word wins
            self._pop_result(x)
        self._closed_ids.pop(x, None)
        self._finish(x, t, False, f"aborted by sender: {h['reason']}", "aborted")

    def _abandon(self, x: str) -> None:
        t = self._open.get(x)
        if self._closed_ids.get(x) is None or t is not None:
            self._finish(x, t, False, "abandoned by the receiver", "abandoned", store=False)
            if t is not None:
                self._send(t.peer, wire.encode("nack", xfer=x, reason="receiver gave up waiting"))
                self.stats.add("nacks_sent")
        with self._cond:
            self._pop_result(x)

    def _finish(self, x: str, t: _RxTransfer | None, ok: bool, error: str | None, how: str,
                store: bool = True) -> None:
        """Close transfer ``x``: publish its result, drop partial data on failure."""
        self._open.pop(x, None)
        self._closed_ids[x] = how
        self._closed_ids.move_to_end(x)
        while len(self._closed_ids) > 65536:
            self._closed_ids.popitem(last=False)
        now = time.monotonic()
        chunks = t.chunks if t else 0
        nbytes = t.nbytes if t else 0
        keep = ok and t is not None and self._on_chunk is None
        if t is not None and self._on_chunk is None and not ok:
            with self._cond:
                self._held -= t.nbytes  # partial data dropped
        # a kept result stays counted in _held until collected (see _pop_result)
        res = TransferResult(x, ok, error, chunks, nbytes, t.layers if keep else {}, (now - t.t0) if t else 0.0)
        self.stats.add({"completed": "transfers_completed", "failed": "transfers_failed",
                        "aborted": "transfers_aborted", "abandoned": "transfers_abandoned",
                        "stale": "transfers_stale"}[how])
        if store:
            with self._cond:
                self._results[x] = (now, res)
                self._cond.notify_all()

    def _gc(self, now: float) -> None:
        for x, t in list(self._open.items()):
            if now - t.last > self.stale_after_s:
                log.warning("kvtransfer receiver: transfer %r stale (no data for %.0f s); dropped",
                            x, now - t.last)
                self._finish(x, t, False, f"stale: no data for {now - t.last:.0f} s", "stale")
        with self._cond:
            for x, (t0, _) in list(self._results.items()):
                if now - t0 > self.result_ttl_s:
                    self._pop_result(x)
                    self.stats.add("results_expired")
