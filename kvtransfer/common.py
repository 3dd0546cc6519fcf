"""Shared pieces of the KV transport: errors, defaults, counters, dtype names."""
from __future__ import annotations

import collections
import inspect
import logging
import os
import socket
import sys
import threading
from typing import Any, Callable, Iterable

import numpy as np

from .wire import DTYPES, WireError

log = logging.getLogger("proserve.kvtransfer.transport")

DEFAULT_CHUNK_BYTES = 4 << 20          # payload bytes per kv message (a chunk of a large layer)
DEFAULT_PACK_BYTES = 1 << 20           # payload bytes of a pack (small layers sent as one kv message)
# layers up to this size are packed: pyzmq copies a smaller frame anyway (zmq.COPY_THRESHOLD),
# so packing costs no extra copy; larger layers go zero-copy, and copying them cost more
# than the per-message overhead it saved (scripts/bench_kv_transport.py, 128-256 KiB layers)
DEFAULT_PACK_LAYER_BYTES = 64 << 10
DEFAULT_CREDIT_BYTES = 64 << 20        # flow-control window per sender connection
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20   # header + payload, checked on receive
MESSAGE_OVERHEAD = 1024                # credit charged per payload message on top of its bytes
MIN_CREDIT_BYTES = 4 * MESSAGE_OVERHEAD   # smallest window a receiver may grant (senders refuse less)
MIN_MAX_MESSAGE_BYTES = 4096           # smallest max_message a receiver may announce
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CONNECT_TIMEOUT_S = 2.0        # a new connection's 'hello' must be answered within this
DEFAULT_HOST = "127.0.0.1"


class TransferError(RuntimeError):
    """A transfer failed (rejected, aborted, truncated, connection reset...)."""


class TransferTimeout(TransferError, TimeoutError):
    """A bounded wait (credit, ack, receipt) ran out of time."""


class DestinationUnavailable(TransferError):
    """The sender's circuit breaker for this destination is open (it failed
    recently: no answer to ``hello``, a transfer timed out with nothing heard,
    or the connection was reset); the transfer was refused without waiting."""


class Stats:
    """Counters for logs/metrics. Updated by one thread at a time (the receiver
    thread, or a sender caller holding the sender's lock); :meth:`snapshot` is
    safe from any thread and returns a plain dict (``rejected``: reason -> count)."""

    def __init__(self, *names: str):
        self.c: dict[str, float] = {n: 0 for n in names}
        self.c["rejected_total"] = 0
        self.rejected: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def add(self, name: str, n: float = 1) -> None:
        self.c[name] = self.c.get(name, 0) + n

    def max(self, name: str, v: float) -> None:
        if v > self.c.get(name, 0):
            self.c[name] = v

    def set(self, name: str, v: float) -> None:
        """A gauge (a current value, not a count)."""
        self.c[name] = v

    def reject(self, reason: str) -> int:
        with self._lock:
            self.rejected[reason] += 1
            self.c["rejected_total"] += 1
            return self.rejected[reason]

    def snapshot(self) -> dict:
        with self._lock:
            d = dict(self.c)
            d["rejected"] = dict(self.rejected)
        return d


def worth_logging(count: int) -> bool:
    """The first few of a kind, then every 1000th: a flood must not flood the log."""
    return count <= 10 or count % 1000 == 0


def log_reject(side: str, count: int, err: Any, peer: str = "") -> None:
    if worth_logging(count):
        log.warning("kvtransfer %s: rejected message%s (%s; %d so far for this reason)",
                    side, f" from {peer}" if peer else "", err, count)


_DTYPE_CACHE: dict[Any, str] = {}


def normalize_dtype(dtype: Any) -> str:
    """``'float16'``, ``'torch.float16'``, ``np.float16``/``np.dtype``, ``torch.float16``
    -> ``'float16'``; raises ``ValueError`` for anything not in the allow-list."""
    try:
        return _DTYPE_CACHE[dtype]
    except (KeyError, TypeError):
        pass
    if dtype is None:
        raise ValueError("dtype is required")
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype)
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    try:
        _DTYPE_CACHE[dtype] = name
    except TypeError:
        pass
    return name


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # never import torch just to ask
    return torch is not None and isinstance(x, torch.Tensor)


def numpy_dtype(name: str):
    try:
        return np.dtype(name)
    except TypeError:
        pass
    try:
        import ml_dtypes  # optional: bfloat16 / float8 for numpy
        return np.dtype(getattr(ml_dtypes, name))
    except (ImportError, AttributeError, TypeError):
        raise TypeError(f"dtype {name!r} has no numpy equivalent here; use .tensor() or .tobytes()") from None


def free_port(host: str = DEFAULT_HOST) -> int:
    """A currently free TCP port on ``host`` (for tests and scripts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def device_api(device) -> Any:
    """The torch module of an accelerator (``torch.cuda``, ``torch.npu``, ``torch.xpu``...):
    each has ``Stream``, ``Event``, ``current_stream`` and ``stream``."""
    import torch
    mod = getattr(torch, device.type, None)
    if mod is None or not hasattr(mod, "Stream") or not hasattr(mod, "Event"):
        raise RuntimeError(f"no stream API for device type {device.type!r} (torch.{device.type})")
    return mod


def new_stream(api, device):
    """A new stream on ``device`` (torch.cpu's stand-in takes no device)."""
    try:
        return api.Stream(device=device)
    except TypeError:
        return api.Stream()


def unpinned(make):
    """Build a thread-owning object with every core allowed. vLLM's CPU worker pins its
    main thread to its cores and busy-polls there; a thread started from it would
    inherit that pin and starve. The pin is restored afterwards."""
    pinned = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        if pinned is not None:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        return make()
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)


def accepts_kwargs(fn: Callable, names: Iterable[str]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return True
    have = {p.name for p in params}
    return all(n in have for n in names)


__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_PACK_BYTES", "DEFAULT_PACK_LAYER_BYTES", "DEFAULT_CREDIT_BYTES",
           "DEFAULT_MAX_MESSAGE_BYTES", "MESSAGE_OVERHEAD",
           "DEFAULT_TIMEOUT_S", "DEFAULT_HOST", "TransferError", "TransferTimeout", "DestinationUnavailable",
           "Stats", "WireError", "normalize_dtype", "free_port"]
