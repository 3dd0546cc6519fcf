"""The consumer's loads, off the engine step: :class:`KVLoader`.

Once a request's transfer has arrived whole, its KV must be checked against
the request and written into the blocks vLLM allocated for it
(:func:`inject`: the digest of the prompt, then :func:`kvcache.plan_load`'s
checks, then :func:`kvcache.write`). Doing that in the connector's
``get_finished`` would hold up the engine's step for the whole copy (on an
accelerator, a host-to-device copy of the whole prompt's KV). The loader does
it on a thread of its own (on an accelerator, on a stream of its own) and the
step only collects what is done: vLLM schedules the request once its load is
reported, so nothing reads those blocks before the copy has finished, and
nothing else writes them (they belong to the request).
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

import torch

from .common import device_api, new_stream
from .kvcache import LoadRejected, corrupt_first_block, plan_load, write

log = logging.getLogger("proserve.kvtransfer")


def inject(xfer: str, digest: str, block_ids, skip: int, result, caches, block_dim: int, stream=None,
           corrupt: str | None = None, dump: Callable[[str, str, Any], None] | None = None, after=None) -> None:
    """Write a received transfer into the blocks vLLM allocated for the request:
    checked first (it belongs to this request -- ``digest`` of its prompt --, fits
    this engine's cache and covers the request's blocks; :class:`LoadRejected`
    otherwise, with nothing written), then each received chunk is copied once,
    from the received frame into views of the cache. ``corrupt`` and ``dump``
    are test hooks (``debug_corrupt``, ``debug_dump_dir``)."""
    if not result.digest or result.digest != digest:
        raise LoadRejected(f"transfer {xfer!r} was made for another prompt (digest "
                           f"{result.digest[:12] or 'missing'} != {digest[:12]})")
    copies = plan_load(result.pieces, caches, block_dim, block_ids, skip)
    write(copies, caches, block_dim, block_ids, skip, stream, after)
    if corrupt:
        corrupt_first_block(copies, caches, block_dim, block_ids, skip, corrupt)
    if dump is not None:
        for layer, dst in enumerate(caches):
            idx = torch.tensor(list(block_ids[skip:]), dtype=torch.long, device=dst.device)
            got = dst.index_select(block_dim, idx)
            if block_dim != 0:
                got = got.movedim(block_dim, 0)
            dump(xfer, f"recv_l{layer}_b{skip}_n{len(idx)}", got.contiguous())


class KVLoader:
    """A thread that injects received transfers; :meth:`submit` a job, collect
    :meth:`done`. ``caches``: the layers' cache tensors in layer order."""

    def __init__(self, caches: list, block_dim: int, corrupt: str | None = None,
                 dump: Callable[[str, str, Any], None] | None = None, name: str = "kvloader"):
        self.caches, self.block_dim = caches, block_dim
        self.corrupt, self.dump = corrupt, dump
        self._cv = threading.Condition()
        self._jobs: collections.deque = collections.deque()     # guarded by _cv
        self._done: dict[str, tuple[str | None, str | None, int]] = {}   # req_id -> (error, reason, nbytes)
        self._closing = False
        self._stream = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, req_id: str, xfer: str, digest: str, block_ids, skip: int, result) -> None:
        """Queue a load; on an accelerator it runs after the work the forward stream has
        queued so far (an event recorded now)."""
        after = None
        dev = self.caches[0].device if self.caches else None
        if dev is not None and dev.type != "cpu":
            api = device_api(dev)
            after = api.Event()
            after.record(api.current_stream(dev))
        with self._cv:
            self._jobs.append((req_id, xfer, digest, list(block_ids), skip, result, after))
            self._cv.notify()

    def done(self) -> dict[str, tuple[str | None, str | None, int]]:
        """Loads finished since the last call: req_id -> (error or None, failure reason or
        None, payload bytes)."""
        with self._cv:
            out, self._done = self._done, {}
        return out

    def wait_any(self, timeout: float) -> None:
        """Block (the interpreter released) until a load is done or ``timeout`` s passed."""
        with self._cv:
            if self._jobs or not self._done:
                self._cv.wait(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        dev = self.caches[0].device if self.caches else torch.device("cpu")
        if dev.type != "cpu":
            api = device_api(dev)
            if hasattr(api, "set_device"):
                api.set_device(dev)        # a new thread starts on device 0
            self._stream = new_stream(api, dev)
        while True:
            with self._cv:
                while not self._jobs and not self._closing:
                    self._cv.wait()
                if self._closing:
                    # what was still queued is reported (the requests recompute), never dropped
                    for job in self._jobs:
                        self._done[job[0]] = ("the KV loader is closed", "inject_error", 0)
                    self._jobs.clear()
                    self._cv.notify_all()
                    return
                req_id, xfer, digest, block_ids, skip, result, after = self._jobs.popleft()
            error = reason = None
            try:
                inject(xfer, digest, block_ids, skip, result, self.caches, self.block_dim, self._stream,
                       self.corrupt, self.dump, after)
            except LoadRejected as e:
                error, reason = str(e), "rejected"
            except Exception as e:  # never an engine crash: the request recomputes instead
                log.exception("KV transfer %s: injecting it failed", xfer)
                error, reason = f"inject failed: {type(e).__name__}: {e}", "inject_error"
            with self._cv:
                self._done[req_id] = (error, reason, result.nbytes)
                self._cv.notify_all()


__all__ = ["KVLoader", "inject"]
