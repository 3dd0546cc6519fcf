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
  recorded after the copy tells the sender thread when the bytes are on the
  host. On the CPU the gather is a plain copy.
* **sender thread**: everything that touches the network, in the order the
  forward thread asked for it: each layer (after its copy event), the end of
  step pack flush, ``done``, aborts, and collecting the receivers' acks. It
  alone blocks on flow-control credit.

What the forward pass can still wait for, by design:

* the staging bound: layers gathered but not yet handed to ZeroMQ may hold at
  most ``max_staged_bytes``; beyond it :meth:`save_layer` waits for the sender
  thread (at most the transfer timeout, then that transfer fails), so a slow
  network slows the prefill instead of exhausting host memory;
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

from .common import DestinationUnavailable, TransferError, TransferTimeout, device_api, new_stream
from .sender import KVSender, SendResult

log = logging.getLogger("proserve.kvtransfer")

#: failed transfer ids remembered (their later layers and their 'done' are dropped)
FAILED_KEPT = 4096
#: KV destinations with a sender (sockets, breaker) at once
MAX_DESTINATIONS = 64
#: how often the sender thread collects acks while transfers wait for theirs (s)
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


class KVPusher:
    def __init__(self, new_sender: Callable[[str], KVSender], *, timeout_s: float = 30.0,
                 max_staged_bytes: int = 512 << 20, on_sent: Callable[[int], None] | None = None,
                 on_failed: Callable[[str, BaseException], None] | None = None,
                 dump: Callable[[str, str, Any], None] | None = None, name: str = "kvpusher"):
        self._new_sender = new_sender
        self.timeout_s = float(timeout_s)
        self.max_staged_bytes = int(max_staged_bytes)
        self._on_sent = on_sent
        self._on_failed = on_failed
        self._dump = dump
        self._cv = threading.Condition()
        self._cmds: collections.deque = collections.deque()     # guarded by _cv
        self._staged = 0                                        # bytes queued, not yet with ZeroMQ; _cv
        self._failed: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()   # _cv
        self._new_failed: dict[str, tuple[str, str]] = {}       # _cv
        self._outcomes: dict[str, str | None] = {}              # xfer -> error or None (acked); _cv
        self._dests: dict[str, dict] = {}                       # addr -> breaker state snapshot; _cv
        self._closing = False
        # sender thread only
        self._senders: collections.OrderedDict[str, KVSender] = collections.OrderedDict()
        self._finishing: dict[str, str] = {}                    # xfer -> addr, 'done' sent, ack awaited
        self._looked = 0.0                                      # when _dests was last refreshed
        # forward thread only (accelerator caches)
        self._device = None
        self._api = None
        self._stream = None
        self._last_copy = None
        self._index: tuple[int, Any] | None = None              # (step, device index tensor)
        self.stats = collections.Counter()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ forward thread
    def is_failed(self, xfer: str) -> bool:
        with self._cv:
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
            if not self._reserve(nbytes, s):
                continue
            self._put(("layer", s.xfer, s.addr, layer, s.first_block, piece, event, step, nbytes))

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

    def _reserve(self, nbytes: int, s: Save) -> bool:
        """Room for ``nbytes`` more staged bytes (waits for the sender thread, at most the
        transfer timeout); False when the transfer failed instead."""
        deadline = None
        with self._cv:
            while self._staged and self._staged + nbytes > self.max_staged_bytes:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout_s
                    self.stats["staging_waits"] += 1
                if now >= deadline or s.xfer in self._failed or self._closing:
                    break
                self._cv.wait(deadline - now)
            else:
                self._staged += nbytes
                return True
        self._fail(s.xfer, s.addr, TransferTimeout(
            f"{self._staged} bytes of KV staged for sending, limit {self.max_staged_bytes}: the network "
            f"does not keep up (waited {self.timeout_s:g} s)"))
        return False

    def flush(self, xfer: str, addr: str) -> None:
        """Send what is packed for ``xfer`` (small layers travel together) at the end of a step."""
        self._put(("flush", xfer, addr))

    def finish(self, xfer: str, addr: str, digest: str) -> None:
        """Close ``xfer`` after its layers (``done``); its outcome comes from :meth:`outcomes`."""
        self._put(("finish", xfer, addr, digest))

    def abort(self, xfer: str, addr: str, reason: str) -> None:
        self._put(("abort", xfer, addr, reason))

    def busy(self) -> bool:
        """Commands queued, or transfers waiting for their ack."""
        with self._cv:
            return bool(self._cmds or self._finishing)

    def wait_progress(self, timeout: float) -> None:
        """Block (the interpreter released) until the sender thread has done something
        or ``timeout`` s passed: how an engine step with nothing to compute lets the
        thread run instead of spinning for the interpreter."""
        with self._cv:
            if self._cmds or self._finishing:
                self._cv.wait(timeout)

    def failures(self) -> dict[str, tuple[str, str]]:
        """Transfers that failed since the last call: xfer -> (destination, error)."""
        with self._cv:
            out, self._new_failed = self._new_failed, {}
        return out

    def outcomes(self) -> dict[str, str | None]:
        """Transfers closed with :meth:`finish` that are final since the last call:
        xfer -> None (acked: every byte is on the receiver) or the error."""
        with self._cv:
            out, self._outcomes = self._outcomes, {}
        return out

    def destinations(self) -> dict[str, dict]:
        """Breaker state per destination (``KVSender.destinations``), as of the sender
        thread's last look."""
        with self._cv:
            return dict(self._dests)

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)
        for s in list(self._senders.values()):
            s.close()

    def _put(self, cmd: tuple) -> None:
        with self._cv:
            self._cmds.append(cmd)
            self._cv.notify_all()

    def _fail(self, xfer: str, addr: str, e: BaseException) -> None:
        err = f"{type(e).__name__}: {e}"
        with self._cv:
            if xfer in self._failed:
                return
            self._failed[xfer] = (addr, err)
            while len(self._failed) > FAILED_KEPT:
                self._failed.popitem(last=False)
            self._new_failed[xfer] = (addr, err)
        self.stats["failed"] += 1
        if self._on_failed is not None:
            self._on_failed(addr, e)
        log.error("KV transfer %s to %s failed: %s", xfer, addr, err)
        self._put(("abort", xfer, addr, "sender failed"))

    # ------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._cmds and not self._closing:
                    self._cv.wait(ACK_POLL_S if self._finishing else IDLE_WAIT_S)
                if self._closing and not self._cmds:
                    return
                cmd = self._cmds.popleft() if self._cmds else None
            try:
                if cmd is not None:
                    self._do(cmd)
                if self._finishing:
                    self._collect_acks()
                now = time.monotonic()
                if cmd is None or now - self._looked >= DEST_LOOK_S:
                    self._looked = now
                    self._snapshot_destinations()
            except Exception:   # never let the thread die: the transfers would hang
                log.exception("kvtransfer pusher: internal error on %s", cmd[0] if cmd else "poll")
                if cmd is not None and cmd[0] in ("layer", "flush", "finish"):
                    self._fail(cmd[1], cmd[2], TransferError("internal error in the KV pusher"))
                    if cmd[0] == "finish":
                        self._outcome(cmd[1], "internal error in the KV pusher")

    def _do(self, cmd: tuple) -> None:
        kind, xfer, addr = cmd[0], cmd[1], cmd[2]
        if kind == "layer":
            _, _, _, layer, first, data, event, step, nbytes = cmd
            try:
                if self.is_failed(xfer):
                    return
                if event is not None:
                    event.synchronize()                 # the bytes are on the host now
                if self._dump is not None:
                    self._dump(xfer, f"sent_l{layer}_b{first}_n{data.shape[0]}", data)
                self._sender(addr).send_layer(xfer, layer, list(range(first, first + data.shape[0])), data,
                                              step=step)
                if self._on_sent is not None:
                    self._on_sent(nbytes)
            except Exception as e:  # a dead peer must not take the engine down
                self._fail(xfer, addr, e)
            finally:
                with self._cv:
                    self._staged -= nbytes
                    self._cv.notify_all()
        elif kind == "flush":
            if not self.is_failed(xfer) and addr in self._senders:
                try:
                    self._senders[addr].flush(xfer)
                except Exception as e:  # noqa: BLE001
                    self._fail(xfer, addr, e)
        elif kind == "finish":
            digest = cmd[3]
            with self._cv:
                failed = self._failed.get(xfer)
            if failed is not None:
                self._outcome(xfer, failed[1])
                return
            try:
                self._sender(addr).finish_async(xfer, timeout=self.timeout_s, digest=digest)
                self._finishing[xfer] = addr
            except Exception as e:
                self._fail(xfer, addr, e)
                self._outcome(xfer, f"{type(e).__name__}: {e}")
        else:  # abort
            self._finishing.pop(xfer, None)
            s = self._senders.get(addr)
            if s is not None:
                s.abort(xfer, cmd[3])

    def _outcome(self, xfer: str, error: str | None) -> None:
        with self._cv:
            self._outcomes[xfer] = error
            self._cv.notify_all()

    def _collect_acks(self) -> None:
        for addr in {a for a in self._finishing.values()}:
            s = self._senders.get(addr)
            if s is None:
                continue
            for xfer, outcome in s.poll_finished().items():
                if self._finishing.pop(xfer, None) is None:
                    continue
                if isinstance(outcome, SendResult):
                    self._outcome(xfer, None)
                else:
                    self._fail(xfer, addr, outcome)
                    self._outcome(xfer, f"{type(outcome).__name__}: {outcome}")

    def _snapshot_destinations(self) -> None:
        states = {}
        for addr, s in self._senders.items():
            st = s.destinations().get(addr)
            if st is not None:
                states[addr] = st
        with self._cv:
            self._dests = states

    def _sender(self, addr: str) -> KVSender:
        s = self._senders.get(addr)
        if s is not None:
            self._senders.move_to_end(addr)
            return s
        if len(self._senders) >= MAX_DESTINATIONS:
            # a request names its destination: bound the sockets (and breakers) kept open by
            # closing the least recently used one with nothing in flight
            idle = next((a for a, x in self._senders.items() if not x.pending()), None)
            if idle is None:
                raise TransferError(f"KV transfers to {MAX_DESTINATIONS} destinations are in flight; "
                                    f"no room for another destination ({addr})")
            self._senders.pop(idle).close()
        s = self._senders[addr] = self._new_sender(addr)
        return s


__all__ = ["DestinationUnavailable", "KVPusher", "MAX_DESTINATIONS", "Save", "device_api"]
