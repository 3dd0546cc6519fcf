"""The producer's worker side, off the forward pass: :class:`KVPusher`.

vLLM calls the connector's ``save_kv_layer`` on the forward thread right after
each attention layer has written its KV. Sending there would make the forward
pass wait for the network twice over: the device-to-host copy of the layer
(a synchronous copy stalls the CPU until the GPU reaches that layer, so it can
no longer run ahead queueing kernels), and ZeroMQ's flow control once the
credit window is full. The pusher splits the work:

* **forward thread** (:meth:`KVPusher.save_layer`): gathers the blocks this
  step wrote for every request being sent, in one ``index_select`` of the
  layer, into host memory. On an accelerator the gather and the copy to
  pinned host memory run on a side stream that first waits on an event
  recorded on the forward stream after the layer, so the copy sees the
  layer's writes and the forward stream does not wait for it; an event
  recorded after the copy tells the sending thread when the bytes are on the
  host. On the CPU the gather is a plain copy.
* **a lane per destination** (a thread, its queue, its sender): everything
  that touches the network, in the order the forward thread asked for it:
  each layer (after its copy event), the end of step pack flush, ``done``,
  aborts, and collecting the receiver's acks. Only a lane blocks on
  flow-control credit, and a destination that stalls holds up only its own
  lane: transfers to the other decode workers go on.

What the forward pass can still wait for, by design:

* the staging bound: layers gathered for a destination but not yet handed to
  ZeroMQ may hold at most ``max_staged_bytes``; beyond it :meth:`save_layer`
  waits for that destination's lane (at most the transfer timeout, then that
  transfer fails), so a slow network slows the prefill instead of exhausting
  host memory;
* the previous step's copies, on the device only (not the host): before each
  forward pass, :meth:`order_forward_after_copies` makes the forward stream
  wait for the side stream, so a block freed after a failed or finished
  transfer is never overwritten while a copy may still read it.

Transfers are keyed by the caller's transfer id; failures are remembered
(later layers of a failed transfer are dropped unsent) and reported once by
:meth:`failures`; finished transfers (acked, or failed) once by :meth:`outcomes`.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from .common import DestinationUnavailable, TransferError, TransferTimeout, device_api, new_stream, unpinned
from .sender import KVSender, SendResult

log = logging.getLogger("proserve.kvtransfer")

#: failed transfer ids remembered (their later layers and their 'done' are dropped)
FAILED_KEPT = 4096
#: KV destinations with a lane (a thread, sockets, a breaker) at once
MAX_DESTINATIONS = 64
#: how often a lane collects acks while transfers wait for theirs (s)
ACK_POLL_S = 0.002
IDLE_WAIT_S = 0.1
#: how often, at most, the breaker states are copied for the forward thread while busy (s)
DEST_LOOK_S = 0.05


_unpinned_warned = False


def host_tensor(shape, dtype):
    """Pinned host memory (copies from and to the device then run asynchronously), or
    pageable memory where no accelerator runtime can pin (the copies then block: said
    once in the log when an accelerator is present)."""
    import torch
    global _unpinned_warned
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError as e:
        if not _unpinned_warned and getattr(torch, "accelerator", None) is not None \
                and torch.accelerator.is_available():
            _unpinned_warned = True
            log.warning("kvtransfer: pinned host memory unavailable (%s): KV copies to and from the device "
                        "will block the thread that makes them", e)
        return torch.empty(shape, dtype=dtype)


class Save:
    """One request's blocks written this step: ``block_ids`` (physical) are its logical
    positions ``first_block ..``; they go to ``addr`` as part of transfer ``xfer``."""
    __slots__ = ("xfer", "addr", "block_ids", "first_block")

    def __init__(self, xfer: str, addr: str, block_ids: list[int], first_block: int):
        self.xfer, self.addr, self.block_ids, self.first_block = xfer, addr, block_ids, first_block


class _Lane:
    """One destination: its sender, the commands for it in order, the thread that runs
    them, and the bytes staged for it. A destination that stalls holds up only its own
    lane: the others keep sending."""

    def __init__(self, addr: str, sender: KVSender, lock: threading.Lock):
        self.addr = addr
        self.sender = sender
        self.cond = threading.Condition(lock)
        self.cmds: collections.deque = collections.deque()   # guarded by the pusher's lock
        self.staged = 0            # bytes queued here, not yet with ZeroMQ (the pusher's lock)
        self.stop = False          # set under the lock: the thread ends once its commands ran
        self.finishing: dict[str, None] = {}   # lane thread only: 'done' sent, ack awaited
        self.state: dict | None = None         # breaker state, as the lane thread last saw it
        self.looked = 0.0
        self.thread: threading.Thread | None = None

    def idle(self) -> bool:
        """Nothing queued, nothing in flight (under the pusher's lock)."""
        return not self.cmds and not self.finishing and not self.staged and not self.sender.pending()


class KVPusher:
    def __init__(self, new_sender: Callable[[str], KVSender], *, timeout_s: float = 30.0,
                 max_staged_bytes: int = 512 << 20, on_sent: Callable[[int], None] | None = None,
                 on_failed: Callable[[str, BaseException], None] | None = None,
                 dump: Callable[[str, str, Any], None] | None = None, name: str = "kvpusher"):
        """``max_staged_bytes``: per destination."""
        self._new_sender = new_sender
        self.timeout_s = float(timeout_s)
        self.max_staged_bytes = int(max_staged_bytes)
        self._on_sent = on_sent
        self._on_failed = on_failed
        self._dump = dump
        self.name = name
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)          # any lane did something
        self._lanes: collections.OrderedDict[str, _Lane] = collections.OrderedDict()   # least recent first
        self._failed: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._new_failed: dict[str, tuple[str, str]] = {}
        self._outcomes: dict[str, str | None] = {}              # xfer -> error or None (acked)
        self._closing = False
        # forward thread only (accelerator caches)
        self._device = None
        self._api = None
        self._stream = None
        self._last_copy = None
        self._index: tuple[int, Any] | None = None              # (step, device index tensor)
        self.stats = collections.Counter()

    # ------------------------------------------------------------------ forward thread
    def is_failed(self, xfer: str) -> bool:
        with self._lock:
            return xfer in self._failed

    def save_layer(self, layer: int, kv_layer, block_dim: int, saves: list[Save], step: int) -> None:
        """Queue this step's blocks of ``layer`` for every transfer in ``saves`` (each layer
        of a step once; ``step`` names the piece on the wire). Returns without waiting
        for the network; see the module doc for the two bounded waits."""
        live = [s for s in saves if not self.is_failed(s.xfer)]
        if not live:
            return
        ids = [b for s in live for b in s.block_ids]
        if kv_layer.device.type == "cpu":
            import torch
            data = kv_layer.index_select(block_dim, torch.tensor(ids, dtype=torch.long))
            if block_dim != 0:
                data = data.movedim(block_dim, 0)
            data, event = data.contiguous(), None
        else:
            data, event = self._copy_to_host(kv_layer, block_dim, ids, step)
        row = 0
        for s in live:
            n = len(s.block_ids)
            piece = data[row:row + n]
            row += n
            nbytes = piece.numel() * piece.element_size()
            lane = self._reserve(nbytes, s)
            if lane is not None:
                self._put(lane, ("layer", s.xfer, layer, s.first_block, piece, event, step, nbytes))

    def _copy_to_host(self, kv_layer, block_dim: int, ids: list[int], step: int):
        """Gather ``ids`` along ``block_dim`` and copy them to pinned host memory on the side
        stream, after the forward stream's writes so far; -> (host tensor, copy event)."""
        import torch
        dev = kv_layer.device
        if self._stream is None or self._device != dev:
            self._device, self._api = dev, device_api(dev)
            self._stream = new_stream(self._api, dev)
        api, side = self._api, self._stream
        written = api.Event()
        written.record(api.current_stream(dev))         # after this layer's KV writes
        side.wait_event(written)
        src = kv_layer
        if src.element_size() == 1 and src.dtype not in (torch.uint8, torch.int8):
            src = src.view(torch.uint8)                 # fp8: gather the bytes
        with api.stream(side):
            if self._index is None or self._index[0] != step or self._index[1].numel() != len(ids):
                # one index per step, shared by its layers (pinned: the copy does not block)
                idx = host_tensor((len(ids),), torch.long)
                idx.copy_(torch.tensor(ids, dtype=torch.long))
                self._index = (step, idx.to(dev, non_blocking=True))
            g = src.index_select(block_dim, self._index[1])
            if block_dim != 0:
                g = g.movedim(block_dim, 0)
            host = host_tensor(g.shape, g.dtype)
            host.copy_(g, non_blocking=True)
            done = api.Event()
            done.record(side)
        self._last_copy = done
        if host.dtype != kv_layer.dtype:
            host = host.view(kv_layer.dtype)
        return host, done

    def order_forward_after_copies(self) -> None:
        """Before a forward pass (accelerators): its stream waits for the copies queued so
        far, on the device, so that blocks vLLM frees after a transfer are not
        overwritten while a copy may still read them. The host does not wait."""
        if self._last_copy is not None:
            self._api.current_stream(self._device).wait_event(self._last_copy)
            self._last_copy = None

    def _reserve(self, nbytes: int, s: Save) -> _Lane | None:
        """Room for ``nbytes`` more staged bytes on ``s``'s destination (waits for its lane,
        at most the transfer timeout): the lane, or None when the transfer failed instead."""
        deadline = None
        why: BaseException | None = None
        with self._lock:
            lane = self._lane(s.addr)
            if isinstance(lane, BaseException):
                why, lane = lane, None
            while lane is not None and lane.staged and lane.staged + nbytes > self.max_staged_bytes:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout_s
                    self.stats["staging_waits"] += 1
                if now >= deadline or s.xfer in self._failed or self._closing or lane.stop:
                    why = TransferTimeout(
                        f"{lane.staged} bytes of KV staged for {s.addr}, limit {self.max_staged_bytes}: the "
                        f"network to it does not keep up (waited {now - deadline + self.timeout_s:.1f} s)")
                    lane = None
                    break
                lane.cond.wait(deadline - now)
            if lane is not None:
                lane.staged += nbytes
                return lane
        if s.xfer not in self._failed:
            self._fail(s.xfer, s.addr, why or TransferError("the KV pusher is closed"))
        return None

    def flush(self, xfer: str, addr: str) -> None:
        """Send what is packed for ``xfer`` (small layers travel together) at the end of a step."""
        self._put_addr(addr, ("flush", xfer))

    def finish(self, xfer: str, addr: str, digest: str) -> None:
        """Close ``xfer`` after its layers (``done``); its outcome comes from :meth:`outcomes`."""
        if not self._put_addr(addr, ("finish", xfer, digest)):
            with self._lock:
                failed = self._failed.get(xfer)
                self._outcomes[xfer] = failed[1] if failed else "the KV pusher is closed"
                self._progress.notify_all()

    def abort(self, xfer: str, addr: str, reason: str) -> None:
        self._put_addr(addr, ("abort", xfer, reason), create=False)

    def busy(self) -> bool:
        """Commands queued, or transfers waiting for their ack."""
        with self._lock:
            return any(lane.cmds or lane.finishing for lane in self._lanes.values())

    def wait_progress(self, timeout: float) -> None:
        """Block (the interpreter released) until a lane has done something or ``timeout``
        s passed: how an engine step with nothing to compute lets the lanes run instead
        of spinning for the interpreter."""
        with self._lock:
            if any(lane.cmds or lane.finishing for lane in self._lanes.values()):
                self._progress.wait(timeout)

    def failures(self) -> dict[str, tuple[str, str]]:
        """Transfers that failed since the last call: xfer -> (destination, error)."""
        with self._lock:
            out, self._new_failed = self._new_failed, {}
        return out

    def outcomes(self) -> dict[str, str | None]:
        """Transfers closed with :meth:`finish` that are final since the last call:
        xfer -> None (acked: every byte is on the receiver) or the error."""
        with self._lock:
            out, self._outcomes = self._outcomes, {}
        return out

    def destinations(self) -> dict[str, dict]:
        """Breaker state per destination (``KVSender.destinations``), as each lane last saw it."""
        with self._lock:
            return {a: dict(lane.state) for a, lane in self._lanes.items() if lane.state is not None}

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closing = True
            lanes = list(self._lanes.values())
            for lane in lanes:
                lane.stop = True
                lane.cond.notify_all()
        deadline = time.monotonic() + timeout
        for lane in lanes:
            if lane.thread is not None:
                lane.thread.join(max(0.0, deadline - time.monotonic()))
        for lane in lanes:
            lane.sender.close()

    # -- lanes (under the lock)
    def _lane(self, addr: str, create: bool = True) -> _Lane | BaseException | None:
        """``addr``'s lane, made (with its sender and thread) when new; at most
        MAX_DESTINATIONS, closing the least recently used idle one to make room. A
        TransferError when there is no room (or the pusher is closed)."""
        lane = self._lanes.get(addr)
        if lane is not None and not lane.stop:
            self._lanes.move_to_end(addr)
            return lane
        if not create:
            return None
        if self._closing:
            return TransferError("the KV pusher is closed")
        live = [a for a, x in self._lanes.items() if not x.stop]
        if len(live) >= MAX_DESTINATIONS:
            # a request names its destination: bound the sockets, breakers and threads kept by
            # retiring the least recently used lane with nothing in flight
            idle = next((a for a in live if self._lanes[a].idle()), None)
            if idle is None:
                return TransferError(f"KV transfers to {MAX_DESTINATIONS} destinations are in flight; "
                                     f"no room for another destination ({addr})")
            old = self._lanes.pop(idle)
            old.stop = True
            old.cond.notify_all()
        try:
            sender = self._new_sender(addr)
        except Exception as e:  # a bad address, no sockets left...
            return e
        lane = self._lanes[addr] = _Lane(addr, sender, self._lock)
        lane.thread = threading.Thread(target=self._run, args=(lane,), name=f"{self.name}-{len(self._lanes)}",
                                       daemon=True)
        # started from the forward thread, which vLLM's CPU worker pins to its cores: with every
        # core allowed (the thread, and ZeroMQ's I/O thread it brings up, would starve there)
        unpinned(lane.thread.start)
        return lane

    def _put(self, lane: _Lane, cmd: tuple) -> None:
        with self._lock:
            lane.cmds.append(cmd)
            lane.cond.notify_all()

    def _put_addr(self, addr: str, cmd: tuple, create: bool = True) -> bool:
        """Queue ``cmd`` on ``addr``'s lane; False when there is none (closed, no room)."""
        with self._lock:
            lane = self._lane(addr, create)
            if not isinstance(lane, _Lane):
                return False
            lane.cmds.append(cmd)
            lane.cond.notify_all()
            return True

    def _fail(self, xfer: str, addr: str, e: BaseException) -> None:
        err = f"{type(e).__name__}: {e}"
        with self._lock:
            if xfer in self._failed:
                return
            self._failed[xfer] = (addr, err)
            while len(self._failed) > FAILED_KEPT:
                self._failed.popitem(last=False)
            self._new_failed[xfer] = (addr, err)
            self._progress.notify_all()
        self.stats["failed"] += 1
        self._put_addr(addr, ("abort", xfer, "sender failed"), create=False)
        log.error("KV transfer %s to %s failed: %s", xfer, addr, err)
        if self._on_failed is not None:
            try:
                self._on_failed(addr, e)
            except Exception:   # a callback (metrics) takes down neither the transfer nor the forward pass
                log.exception("kvtransfer pusher: on_failed callback raised")

    def _outcome(self, xfer: str, error: str | None) -> None:
        with self._lock:
            self._outcomes[xfer] = error
            self._progress.notify_all()

    # ------------------------------------------------------------------ lane threads
    def _run(self, lane: _Lane) -> None:
        while True:
            with self._lock:
                if not lane.cmds and not lane.stop:
                    lane.cond.wait(ACK_POLL_S if lane.finishing else IDLE_WAIT_S)
                if lane.stop and not lane.cmds:
                    break
                cmd = lane.cmds.popleft() if lane.cmds else None
            if cmd is not None:
                try:
                    self._do(lane, cmd)
                except Exception:   # never let the thread die: the transfers would hang
                    log.exception("kvtransfer pusher: internal error on %s for %s", cmd[0], lane.addr)
                    if cmd[0] in ("layer", "flush", "finish"):
                        self._fail(cmd[1], lane.addr, TransferError("internal error in the KV pusher"))
                        if cmd[0] == "finish":
                            lane.finishing.pop(cmd[1], None)
                            self._outcome(cmd[1], "internal error in the KV pusher")
            try:
                if lane.finishing:
                    self._collect_acks(lane)
                now = time.monotonic()
                if cmd is None or now - lane.looked >= DEST_LOOK_S:
                    lane.looked = now
                    st = lane.sender.destinations().get(lane.sender.address)
                    with self._lock:
                        lane.state = st
            except Exception:   # (never blamed on the command above: it did not raise)
                log.exception("kvtransfer pusher: internal error while collecting acks from %s", lane.addr)
        # retired or closed: what still waits for an ack will never hear of it from here
        for xfer in list(lane.finishing):
            self._outcome(xfer, f"the KV pusher stopped sending to {lane.addr}")
        lane.finishing.clear()
        if not self._closing:
            lane.sender.close()

    def _do(self, lane: _Lane, cmd: tuple) -> None:
        kind, xfer = cmd[0], cmd[1]
        addr = lane.addr
        if kind == "layer":
            _, _, layer, first, data, event, step, nbytes = cmd
            try:
                if self.is_failed(xfer):
                    return
                if event is not None:
                    event.synchronize()                 # the bytes are on the host now
                if self._dump is not None:
                    self._dump(xfer, f"sent_l{layer}_b{first}_n{data.shape[0]}", data)
                lane.sender.send_layer(xfer, layer, list(range(first, first + data.shape[0])), data, step=step)
                if self._on_sent is not None:
                    self._on_sent(nbytes)
            except Exception as e:  # a dead peer must not take the engine down
                self._fail(xfer, addr, e)
            finally:
                with self._lock:
                    lane.staged -= nbytes
                    lane.cond.notify_all()
                    self._progress.notify_all()
        elif kind == "flush":
            if not self.is_failed(xfer):
                try:
                    lane.sender.flush(xfer)
                except Exception as e:  # noqa: BLE001
                    self._fail(xfer, addr, e)
        elif kind == "finish":
            with self._lock:
                failed = self._failed.get(xfer)
            if failed is not None:
                self._outcome(xfer, failed[1])
                return
            try:
                lane.sender.finish_async(xfer, timeout=self.timeout_s, digest=cmd[2])
                lane.finishing[xfer] = None
            except Exception as e:
                self._fail(xfer, addr, e)
                self._outcome(xfer, f"{type(e).__name__}: {e}")
        else:  # abort
            if lane.finishing.pop(xfer, "absent") is None:
                self._outcome(xfer, f"aborted: {cmd[2]}")   # whoever called finish() is told
            lane.sender.abort(xfer, cmd[2])

    def _collect_acks(self, lane: _Lane) -> None:
        try:
            done = lane.sender.poll_finished()
        except Exception as e:
            log.exception("kvtransfer pusher: collecting acks from %s failed", lane.addr)
            done = {x: TransferError(f"collecting the ack failed: {type(e).__name__}: {e}") for x in lane.finishing}
        for xfer, outcome in done.items():
            if xfer not in lane.finishing:
                continue
            del lane.finishing[xfer]
            if isinstance(outcome, SendResult):
                self._outcome(xfer, None)
            else:
                self._fail(xfer, lane.addr, outcome)
                self._outcome(xfer, f"{type(outcome).__name__}: {outcome}")


__all__ = ["DestinationUnavailable", "KVPusher", "MAX_DESTINATIONS", "Save", "device_api"]
