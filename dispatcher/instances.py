"""The instance registry: which workers exist, which are alive, and what the
router knows of each.

Every ``health_interval_s`` each worker's ``/health`` and ``/metrics`` are read:

* a prefill worker's ``proserve:beta`` (its online correction, §4.1) scales the
  dispatcher's copy of its latency model, so GoRouting's estimates (Alg. 2)
  follow the engine's measured speed;
* a decode worker's free KV blocks (``decode.status``) feed the decode pick
  (Alg. 2 line 20); between polls the dispatcher subtracts the blocks of each
  request it sends there, so a burst does not all land on one worker.

A worker that fails ``health_failures`` checks in a row, or whose connection
fails during a request, leaves the candidate set, and every request in flight
on it is told at once (:meth:`Worker.mark_down` cancels their upstream calls),
so none waits for a timeout. It rejoins after its next good check.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from decode.status import StatusError, free_kv_blocks
from profiler import modelfile
from scheduler.estimator import Estimator, OnlineCorrector
from scheduler.routing.base import DecodeInstance, PrefillInstance

from .config import DispatcherConfig, PrefillSpec

logger = logging.getLogger("proserve.dispatcher")

_BETA = re.compile(r'^proserve:beta(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$', re.M)
_BLOCK_SIZE = re.compile(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.M)


@dataclass
class Worker:
    role: str                      # "prefill" (or co-located) | "decode"
    name: str
    url: str
    healthy: bool = False
    fails: int = 0
    last_error: str = ""
    model: str | None = None       # served model name, from /v1/models
    max_model_len: int | None = None
    inflight: set = field(default_factory=set, repr=False)   # asyncio tasks of upstream calls

    def mark_down(self, why: str) -> None:
        if self.healthy:
            logger.warning("%s worker %s (%s) is down: %s", self.role, self.name, self.url, why)
        self.healthy = False
        self.last_error = why
        for t in list(self.inflight):
            t.cancel(f"{self.role} worker {self.name} went down: {why}")


@dataclass
class PrefillWorker(Worker):
    state: PrefillInstance | None = None   # the router's view: PrefillQueueMap[p], ts_p, β

    @property
    def beta(self) -> float:
        return self.state.estimator.beta


@dataclass
class DecodeWorker(Worker):
    kv_addr: str = ""
    state: DecodeInstance | None = None
    block_size: int = 16


def _estimator(spec: PrefillSpec) -> Estimator:
    path = Path(spec.latency_model) if spec.latency_model else modelfile.CPU_TINY
    return Estimator(modelfile.load(path), OnlineCorrector())


class Registry:
    def __init__(self, cfg: DispatcherConfig, owner):
        self.cfg = cfg
        self._owner = owner          # has .http, the dispatcher's aiohttp session
        self.prefill: list[PrefillWorker] = []
        for i, s in enumerate(cfg.prefill):
            w = PrefillWorker("prefill", s.name, s.url.rstrip("/"))
            w.state = PrefillInstance(i, _estimator(s))
            w.state.healthy = False
            self.prefill.append(w)
        self.decode: list[DecodeWorker] = []
        for j, s in enumerate(cfg.decode):
            w = DecodeWorker("decode", s.name, s.url.rstrip("/"), kv_addr=s.kv_addr)
            w.state = DecodeInstance(j, 0, healthy=False)
            self.decode.append(w)
        self._task: asyncio.Task | None = None

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    # -- health ----------------------------------------------------------------------------
    async def check(self, w: Worker) -> bool:
        http = self._owner.http
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.cfg.health_interval_s))
        try:
            async with http.get(w.url + "/health", timeout=timeout) as r:
                if r.status != 200:
                    raise OSError(f"/health answered {r.status}")
            if w.model is None:
                async with http.get(w.url + "/v1/models", timeout=timeout) as r:
                    data = (await r.json(content_type=None))["data"][0]
                w.model = data["id"]
                w.max_model_len = data.get("max_model_len")
            async with http.get(w.url + "/metrics", timeout=timeout) as r:
                text = await r.text()
            if isinstance(w, PrefillWorker):
                m = _BETA.search(text)
                if m:
                    beta = float(m.group(1))
                    if math.isfinite(beta) and beta > 0:
                        w.state.estimator.corrector.beta = beta
            elif isinstance(w, DecodeWorker):
                w.state.free_blocks = free_kv_blocks(text)
                m = _BLOCK_SIZE.search(text)
                if m:
                    w.block_size = int(m.group(1))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError,
                TypeError, StatusError) as e:
            w.fails += 1
            why = f"health check failed: {type(e).__name__}: {e}"
            if w.fails >= self.cfg.health_failures or not w.healthy:
                w.mark_down(why)
            w.last_error = why
            self._sync(w)
            return False
        if not w.healthy:
            logger.info("%s worker %s (%s) is healthy", w.role, w.name, w.url)
        w.healthy, w.fails, w.last_error = True, 0, ""
        self._sync(w)
        return True

    @staticmethod
    def _sync(w: Worker) -> None:
        w.state.healthy = w.healthy

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # never let the health loop die
                logger.exception("health check loop")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def wait_ready(self, timeout: float) -> bool:
        """Until every worker answered once (or ``timeout``); True if all are healthy."""
        deadline = time.monotonic() + timeout
        while True:
            await self.check_all()
            if all(w.healthy for w in self.workers) or time.monotonic() > deadline:
                return all(w.healthy for w in self.workers)
            await asyncio.sleep(min(1.0, self.cfg.health_interval_s))

    def failed(self, w: Worker, why: str) -> None:
        """A request saw ``w`` fail at the connection level: take it out now."""
        w.fails = max(w.fails, self.cfg.health_failures)
        w.mark_down(why)
        self._sync(w)

    # -- views -----------------------------------------------------------------------------
    def live_prefill(self, exclude: set[str] = frozenset()) -> list[PrefillWorker]:
        return [w for w in self.prefill if w.healthy and w.name not in exclude]

    def live_decode(self, exclude: set[str] = frozenset()) -> list[DecodeWorker]:
        return [w for w in self.decode if w.healthy and w.name not in exclude]

    @property
    def model_name(self) -> str | None:
        for w in self.workers:
            if w.model:
                return w.model
        return None

    @property
    def max_model_len(self) -> int | None:
        lens = [w.max_model_len for w in self.workers if w.max_model_len]
        return min(lens) if lens else None

    def status(self) -> list[dict]:
        out = []
        for w in self.workers:
            d = {"name": w.name, "role": w.role, "url": w.url, "healthy": w.healthy, "last_error": w.last_error}
            if isinstance(w, PrefillWorker):
                d["queued"] = len(w.state.queue)
                d["beta"] = round(w.beta, 4)
            elif isinstance(w, DecodeWorker):
                d["free_kv_blocks"] = w.state.free_blocks
            d["inflight"] = len(w.inflight)
            out.append(d)
        return out
