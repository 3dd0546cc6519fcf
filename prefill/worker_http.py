"""ASGI middleware of the prefill and decode workers' HTTP servers (loaded into
vLLM's OpenAI server with ``--middleware prefill.worker_http.WorkerGuard``;
``python -m proserve.prefill|decode`` adds it).

Two jobs vLLM's server does not do by itself:

* **The KV receiver's liveness is part of ``/health``.** A decode worker's
  receiver thread runs in the engine process and writes a heartbeat file
  about once a second (``KVReceiver(heartbeat_path=...)``). ``GET /health``
  answers 503 with the reason, so the dispatcher takes the worker out
  instead of sending it requests whose KV can never arrive, when the file
  is missing, when it says the receiver is closed or stopped (its thread
  ended on an error, its ZAP handler died: said at once), or when it is
  older than ``PROSERVE_KV_HEARTBEAT_MAX_AGE`` seconds (default 20: a
  thread that hangs without a word; a busy engine process on a loaded host
  can leave a live thread unscheduled for seconds, and a worker that
  serves must not be taken out for that). Otherwise vLLM's own
  ``/health`` answers.
* **``GET /kv/status``** answers the receiver's heartbeat file as JSON (its
  counters: transfers, rejections by reason, bytes held...), 404 on a worker
  without a receiver.
* **Every route but ``/health`` and ``/metrics`` needs the API key.** vLLM's
  ``--api-key`` (``VLLM_API_KEY``) guards only ``/v1/*``; ``/tokenize``,
  ``/detokenize`` and the other routes stay open. With a key set, this
  middleware answers 401 (OpenAI-style JSON) to any request on them without
  ``Authorization: Bearer <key>``. ``/health`` and ``/metrics`` stay open for
  probes and Prometheus: keep the workers' ports on a private network.

With tensor parallelism every rank runs a receiver with a heartbeat file of its
own (rank r > 0 at ``path.r<r>``, :func:`proserve.kvtransfer.layout.rank_path`):
``/health`` checks them all (a transfer needs every rank's shard) and names the
rank at fault; ``/kv/status`` answers ``{"ranks": [file of rank 0, ...]}``.

Configured from the environment the worker launcher sets:
``PROSERVE_KV_HEARTBEAT`` (rank 0's path), ``PROSERVE_KV_RANKS`` (default 1),
``PROSERVE_KV_HEARTBEAT_MAX_AGE`` and ``VLLM_API_KEY``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import stat
import time

from proserve.kvtransfer.layout import rank_path

HEARTBEAT_ENV = "PROSERVE_KV_HEARTBEAT"
RANKS_ENV = "PROSERVE_KV_RANKS"
#: most tensor-parallel ranks a worker's /health looks after
MAX_RANKS = 1024
HEARTBEAT_MAX_AGE_ENV = "PROSERVE_KV_HEARTBEAT_MAX_AGE"
OPEN_PATHS = ("/health", "/metrics")
#: what vLLM's own AuthenticationMiddleware already guards
VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")


#: default of PROSERVE_KV_HEARTBEAT_MAX_AGE (s): see the module doc
DEFAULT_HEARTBEAT_MAX_AGE_S = 20.0
#: a heartbeat file is a few KiB of counters; anything larger is not read (its age decides)
MAX_HEARTBEAT_BYTES = 1 << 20


def receiver_problem(path: str | None, max_age: float, now: float | None = None) -> str | None:
    """Why the KV receiver counts as dead (None when it is alive or there is none)."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return f"KV receiver heartbeat {path} is missing (receiver not running)"
    if not stat.S_ISREG(st.st_mode):     # (a FIFO would block the server's event loop on open)
        return f"KV receiver heartbeat {path} is not a regular file"
    age = (time.time() if now is None else now) - st.st_mtime
    data = _read_heartbeat(path) if st.st_size <= MAX_HEARTBEAT_BYTES else None
    if isinstance(data, dict):
        closed, stopped = data.get("closed") is True, data.get("stopped")
    else:   # unreadable, being replaced right now (written atomically, but it may vanish), or too big
        closed, stopped = False, None
    if closed:
        return "KV receiver is closed (the engine is shutting down)"
    if stopped:
        return f"KV receiver stopped: {str(stopped)[:300]}"
    if age > max_age:
        return f"KV receiver heartbeat is {age:.1f} s old (receiver thread hung or stopped)"
    return None


def _read_heartbeat(path: str):
    """The heartbeat file's JSON (any type), or None when it cannot be read or parsed."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(MAX_HEARTBEAT_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None


async def _json(send, status: int, message: str, type_: str, code) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class WorkerGuard:
    """Pure ASGI middleware (no body buffering, streaming untouched)."""

    def __init__(self, app) -> None:
        self.app = app
        self.heartbeat = os.environ.get(HEARTBEAT_ENV) or None
        raw = (os.environ.get(RANKS_ENV) or "1").strip()
        # the launcher sets it; anything else is a misconfiguration /health reports (fail closed)
        self.misconfigured = None
        ranks = int(raw) if raw.isascii() and raw.isdigit() else 0
        if not 1 <= ranks <= MAX_RANKS:
            self.misconfigured = f"{RANKS_ENV}={raw[:40]!r} is not a rank count in 1..{MAX_RANKS}"
            ranks = 1
        self.heartbeats = [rank_path(self.heartbeat, r) for r in range(ranks)] if self.heartbeat else []
        try:
            self.max_age = float(os.environ.get(HEARTBEAT_MAX_AGE_ENV) or DEFAULT_HEARTBEAT_MAX_AGE_S)
        except ValueError:
            self.max_age = float("nan")
        if not (math.isfinite(self.max_age) and self.max_age > 0):
            self.misconfigured = f"{HEARTBEAT_MAX_AGE_ENV} is not a positive number of seconds"
            self.max_age = DEFAULT_HEARTBEAT_MAX_AGE_S
        key = os.environ.get("VLLM_API_KEY") or ""
        self._key = hashlib.sha256(key.encode()).digest() if key else None

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(token.strip().encode()).digest(), self._key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # the route's own path, as the router matches it (uvicorn --root-path puts the
        # prefix in front of scope["path"]; vLLM's key check strips it the same way)
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if path == "/health":
            why = self._receivers_problem()
            if why is not None:
                return await _json(send, 503, why, "service_unavailable", 503)
            return await self.app(scope, receive, send)
        if (self._key is not None and scope.get("method") != "OPTIONS" and path not in OPEN_PATHS
                and not path.startswith(VLLM_GUARDED) and not self._authorized(scope)):
            return await _json(send, 401, "missing or invalid API key for this worker", "authentication_error",
                               "invalid_api_key")
        if path == "/kv/status":
            return await self._kv_status(send)
        return await self.app(scope, receive, send)

    def _receivers_problem(self) -> str | None:
        """The first rank whose receiver counts as dead, and why (None: all alive)."""
        if self.misconfigured and self.heartbeats:
            return f"worker misconfigured: {self.misconfigured}"
        for r, hb in enumerate(self.heartbeats):
            why = receiver_problem(hb, self.max_age)
            if why is not None:
                return why if len(self.heartbeats) == 1 else f"tensor-parallel rank {r}: {why}"
        return None

    async def _kv_status(self, send) -> None:
        if not self.heartbeats:
            return await _json(send, 404, "this worker has no KV receiver", "not_found_error", 404)
        bodies = []
        for hb in self.heartbeats:
            try:
                if not stat.S_ISREG(os.stat(hb).st_mode):
                    raise OSError("not a regular file")
                with open(hb, "rb") as f:
                    body = f.read(MAX_HEARTBEAT_BYTES + 1)
                if len(body) > MAX_HEARTBEAT_BYTES:
                    raise ValueError(f"over {MAX_HEARTBEAT_BYTES} bytes")
                json.loads(body)
            except (OSError, ValueError, RecursionError) as e:
                return await _json(send, 503, f"KV receiver status unavailable: {str(e)[:200]}",
                                   "service_unavailable", 503)
            bodies.append(body)
        body = bodies[0] if len(bodies) == 1 else b'{"ranks": [' + b", ".join(bodies) + b"]}"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
