"""The instance registry: which workers exist, which are alive, and what the
router knows of each.

Every ``health_interval_s`` a check of each worker starts (unless its previous
one is still running: a slow worker delays no one else's checks); it reads the
worker's:

* ``/health``, the liveness probe (``health_timeout_s``). A check fails on a
  refused or reset connection, a non-200 answer, or a timeout -- but a timeout
  while the worker delivered bytes on some request within the last
  ``health_timeout_s`` before the check is not a failure (a busy worker is slow,
  not dead: result ``timeout_progressing``). A 401 means the workers demand a
  key the dispatcher does not have right (``worker_api_key_file``): logged as
  an error, the worker is out at once;
* ``/metrics``, a stats scrape only: a prefill worker's ``proserve:beta`` and
  ``proserve:step_offset_seconds`` (its online correction, §4.1: a step takes
  β·T_pd + δ; :func:`correction_of`) correct the dispatcher's copy of its
  latency model, so GoRouting's estimates (Alg. 2) follow the engine's
  measured speed; its KV cache (``vllm:cache_config_info``'s ``num_gpu_blocks``,
  ``block_size`` and ``enable_prefix_caching``, and ``vllm:kv_cache_usage_perc``:
  :func:`cache_info`) sizes the router's index of its prefix cache
  (``PrefillInstance.cache_tokens``, issue 14; none until read, none with
  ``prefix_index = false`` or a worker that caches no prefixes); a
  decode worker's free KV blocks (``proserve.decode.status``) feed the decode pick
  (Alg. 2 line 20; between scrapes the dispatcher subtracts the blocks of each
  request it sends there, so a burst does not all land on one worker). A slow
  or failed scrape keeps the previous stats; it is counted
  (``proserve:dispatcher_scrape_failures``), logged at debug level, and never
  counts against the worker's health.

A worker that fails ``health_failures`` checks in a row, or refuses a
request's connection (or cannot be reached: not a slow answer), leaves the
candidate set, and every request in flight on it is told at once
(:meth:`Worker.mark_down` cancels their upstream calls), so none waits for a
timeout. An established connection that breaks (reset, closed mid-answer) has
it checked at once (:meth:`Registry.suspect`). It rejoins by itself after its
next good check. A prefill worker marked down loses its prefix index (a restarted
engine's cache is empty): the index starts over from the requests routed there next.
A prefill worker with a KV-event address (``kv_events``, issue 14) is subscribed to
its engine's KV-cache events once a check passes (after the scrape that sizes its
index), and unsubscribed when it is marked down or removed
(:mod:`proserve.dispatcher.kv_events`).

Membership changes at run time (issue 15; :mod:`proserve.dispatcher.membership` drives
them): :meth:`Registry.add` a worker (its checks start at once; it takes traffic once
healthy), :meth:`Registry.drain` one (it stays checked, but no policy sees it: not
routable, like an unhealthy one, while the requests it holds -- ``Worker.active`` --
finish), :meth:`Registry.remove` one. Router ids (``PrefillInstance.id``,
``DecodeInstance.id``) are never reused: a worker added later gets a new one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from proserve.decode.status import StatusError, free_kv_blocks
from proserve.profiler import modelfile
from proserve.scheduler.estimator import Estimator, OnlineCorrector
from proserve.scheduler.registry import router_order
from proserve.scheduler.routing.base import DecodeInstance, PrefillInstance

from .config import WORKER_KEY_ENV, DispatcherConfig, PrefillSpec
from .errors import worker_error_message

logger = logging.getLogger("proserve.dispatcher")

_BETA = re.compile(r'^proserve:beta(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$', re.M)
_DELTA = re.compile(r'^proserve:step_offset_seconds(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$', re.MULTILINE)
# the whole label set of the line (values may hold braces), then each name="value" in it
# (Prometheus escapes \\, \" and \n inside values)
_CACHE_CONFIG = re.compile(r'^vllm:cache_config_info\{(.*)\}[ \t]+\S+[ \t]*$', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\\n]|\\.)*)"')
_USAGE = re.compile(r'^vllm:kv_cache_usage_perc(?:\{[^}\n]*\})?[ \t]+(\S+)[ \t]*$', re.MULTILINE)
#: a block count or block size above this is a bad answer (ignored), not a cache to index
_MAX_CACHE_INT = 1 << 40
#: a /metrics page larger than this is refused (vLLM's is a few hundred kB)
_MAX_METRICS_BYTES = 16 * 1024 * 1024
#: of a /health answer or an error answer only this much is read (a message at most)
MAX_SHORT_ANSWER_BYTES = 64 * 1024
#: a /v1/models answer larger than this is a bad answer
_MAX_MODELS_BYTES = 1024 * 1024


class AnswerTooLarge(ValueError):
    """A worker's answer was larger than the dispatcher reads (see :func:`read_capped`)."""


async def read_capped(r: aiohttp.ClientResponse, limit: int, truncate: bool = False) -> bytes:
    """The body of ``r``, never more than ``limit`` bytes of it in memory: beyond that,
    :class:`AnswerTooLarge` (a ValueError), or with ``truncate`` the first ``limit``
    bytes (the rest is not read; the connection is closed instead of reused)."""
    parts, size = [], 0
    async for chunk in r.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            if not truncate:
                raise AnswerTooLarge(f"{r.url.path} answered more than {limit} bytes")
            parts.append(chunk[:len(chunk) - (size - limit)])
            break
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _ScrapeError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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
    last_progress: float = 0.0     # time.monotonic() when bytes of an answer last arrived from it
    key_rejected: bool = False     # it answered 401 to the dispatcher's worker key
    draining: bool = False         # no new requests go there; the ones it holds finish
    removed: bool = False          # out of the registry (its last requests may still run there)
    active: int = 0                # requests with an attempt on it now (routed there, not yet over)
    source: str = "config"         # config | admin | discover:<host>

    @property
    def routable(self) -> bool:
        """Whether new requests may go there: healthy, not draining, not removed."""
        return self.healthy and not self.draining and not self.removed

    @property
    def state_name(self) -> str:
        """removed | draining | healthy | down, as the admin API lists it."""
        return ("removed" if self.removed else "draining" if self.draining
                else "healthy" if self.healthy else "down")

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
    #: where it publishes its KV-cache events (its --kv-events-port), "" for none: then its prefix
    #: index is driven by them (proserve.dispatcher.kv_events, issue 14)
    kv_events: str = ""
    events: Any = field(default=None, repr=False)   # its kv_events.Subscriber while one runs
    #: where it publishes its queued prefill work (its --publish-queue-port), "" for none: the
    #: dispatcher then reads it (proserve.dispatcher.publication, issue 15)
    publish: str = ""

    @property
    def beta(self) -> float:
        return self.state.estimator.beta

    @property
    def delta(self) -> float:
        return self.state.estimator.delta

    def mark_down(self, why: str) -> None:
        super().mark_down(why)
        if self.state is not None:
            self.state.prefix = None   # its cache may not outlive this (a restart): the index starts over
        if self.events is not None:    # and its event subscription with it (resubscribed once healthy)
            from .kv_events import KVEventHub
            KVEventHub.drop(self)


@dataclass
class DecodeWorker(Worker):
    kv_addr: str = ""
    state: DecodeInstance | None = None
    block_size: int = 16


def correction_of(text: str) -> tuple[float, float] | None:
    """The online correction (β, δ) a prefill worker's /metrics page reports, or None if it
    reports none (a worker without the scheduler plugin). A worker that reports β alone
    (the paper's scale-only correction, or an older worker) has δ = 0. A value that is
    not a finite number, or a β that is not > 0, is a bad answer (ValueError); the caller
    clamps the rest to its estimator's bounds (:meth:`Estimator.adopt`)."""
    m = _BETA.search(text)
    if m is None:
        return None
    beta = float(m.group(1))          # the pattern admits only digits, '.', 'e', signs
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"proserve:beta {m.group(1)!r} is not a number > 0")
    m = _DELTA.search(text)
    delta = float(m.group(1)) if m else 0.0
    if not math.isfinite(delta):
        raise ValueError(f"proserve:step_offset_seconds {m.group(1)!r} is not a finite number")
    return beta, delta


@dataclass(frozen=True)
class CacheInfo:
    """What a vLLM worker's /metrics says of its KV cache; None where it says nothing usable."""

    num_blocks: int | None = None         # vllm:cache_config_info{num_gpu_blocks="N"} (the pool, CPU too)
    block_size: int | None = None         # ... {block_size="B"}, tokens per block
    prefix_caching: bool | None = None    # ... {enable_prefix_caching="True"|"False"}
    usage: float | None = None            # vllm:kv_cache_usage_perc, the fraction in use, in [0, 1]

    @property
    def capacity_tokens(self) -> int:
        """KV tokens the worker can cache (num_gpu_blocks x block_size); 0 when unknown or
        when the worker reports prefix caching off."""
        if self.num_blocks is None or self.block_size is None or self.prefix_caching is False:
            return 0
        return self.num_blocks * self.block_size


def _label_int(labels: dict, key: str) -> int | None:
    v = labels.get(key, "")
    if not v.isascii() or not v.isdigit() or len(v) > 15:
        return None
    n = int(v)
    return n if 0 < n <= _MAX_CACHE_INT else None


def cache_info(text: str) -> CacheInfo:
    """The KV cache a vLLM /metrics page describes (vLLM's ``CacheConfig.metrics_info`` labels
    on ``vllm:cache_config_info``, and ``vllm:kv_cache_usage_perc``; the first sample of each,
    as :mod:`proserve.decode.status` reads them). Never raises: a missing or malformed value
    is None (a block count or size that is not a positive integer, a usage that is not a
    finite number; a usage outside [0, 1] is clamped)."""
    num_blocks = block_size = prefix_caching = usage = None
    m = _CACHE_CONFIG.search(text)
    if m is not None:
        labels = dict(_LABEL.findall(m.group(1)))
        num_blocks = _label_int(labels, "num_gpu_blocks")
        block_size = _label_int(labels, "block_size")
        pc = labels.get("enable_prefix_caching")
        prefix_caching = {"true": True, "false": False}.get(pc.lower()) if pc is not None else None
    m = _USAGE.search(text)
    if m is not None:
        try:
            u = float(m.group(1))
        except ValueError:
            u = math.nan
        if math.isfinite(u):
            usage = min(max(u, 0.0), 1.0)
    return CacheInfo(num_blocks, block_size, prefix_caching, usage)


def _estimator(spec: PrefillSpec) -> Estimator:
    path = Path(spec.latency_model) if spec.latency_model else modelfile.CPU_TINY
    return Estimator(modelfile.load(path), OnlineCorrector())


class Registry:
    def __init__(self, cfg: DispatcherConfig, owner):
        self.cfg = cfg
        self._owner = owner          # has .http, the dispatcher's aiohttp session
        self.prefill: list[PrefillWorker] = []
        for i, s in enumerate(cfg.prefill):
            w = PrefillWorker("prefill", s.name, s.url.rstrip("/"), kv_events=s.kv_events, publish=s.publish)
            w.state = PrefillInstance(i, _estimator(s), order=router_order(s.local_policy))
            w.state.healthy = False
            self.prefill.append(w)
        self.decode: list[DecodeWorker] = []
        for j, s in enumerate(cfg.decode):
            w = DecodeWorker("decode", s.name, s.url.rstrip("/"), kv_addr=s.kv_addr)
            w.state = DecodeInstance(j, 0, healthy=False)
            self.decode.append(w)
        # router ids of workers added later: never one a worker had before (removed ones included)
        self._next_id = {"prefill": len(self.prefill), "decode": len(self.decode)}
        # the latency models of workers added later: read now, so that a bad file stops the start
        for path in {cfg.latency_model, *(s.latency_model for s in cfg.discover if s.role == "prefill")} - {None}:
            modelfile.load(Path(path))      # ConfigError naming the file
        self._task: asyncio.Task | None = None          # the health loop
        self._checks: dict[str, asyncio.Task] = {}      # its checks in progress, per worker

    @property
    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    # -- health ----------------------------------------------------------------------------
    async def check(self, w: Worker) -> bool:
        """One liveness probe of ``w`` (and, when it passes, a stats scrape); True if it passed."""
        started = time.monotonic()
        result, why = await self._probe(w, started)
        self._owner.metrics.health_checks.labels(w.name, result).inc()
        if result == "ok":
            if not w.healthy:
                logger.info("%s worker %s (%s) is healthy", w.role, w.name, w.url)
            w.healthy, w.fails, w.last_error, w.key_rejected = True, 0, "", False
            self._sync(w)
            await self.scrape(w)
            hub = getattr(self._owner, "kv_events", None)
            if hub is not None and isinstance(w, PrefillWorker) and w.healthy:
                hub.ensure(w)      # its KV-event subscription (issue 14), after the scrape sized its index
            return True
        if result == "timeout_progressing":
            # slow, not dead: it is delivering tokens; neither a failure nor a pass
            logger.debug("%s worker %s: %s", w.role, w.name, why)
            return w.healthy
        if result == "unauthorized":
            self.key_rejected(w, why)
            return False
        w.fails += 1
        if w.fails >= self.cfg.health_failures or not w.healthy:
            w.mark_down(why)
        w.last_error = why
        self._sync(w)
        return False

    async def _probe(self, w: Worker, started: float) -> tuple[str, str]:
        """(result, why): ok, timeout_progressing, timeout, refused, bad_status, unauthorized, bad_answer."""
        http = self._owner.http
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        path = "/health"
        try:
            async with http.get(w.url + path, timeout=timeout) as r:
                status = r.status
                body = await read_capped(r, MAX_SHORT_ANSWER_BYTES, truncate=True)
            if status == 200 and w.model is None:
                path = "/v1/models"
                async with http.get(w.url + path, timeout=timeout) as r:
                    status = r.status
                    data = json.loads(await read_capped(r, _MAX_MODELS_BYTES)) if status == 200 else None
                if status == 200:
                    model = data["data"][0]
                    name, max_len = model["id"], model.get("max_model_len")
                    if not isinstance(name, str) or not name:
                        raise ValueError(f"model id {name!r}")
                    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)
                                                or max_len < 1):
                        raise ValueError(f"max_model_len {max_len!r}")
                    w.model, w.max_model_len = name, max_len
        except asyncio.TimeoutError:   # aiohttp's connect and read timeouts are TimeoutErrors too
            if w.last_progress >= started - self.cfg.health_timeout_s:
                return "timeout_progressing", (f"{path} did not answer within {self.cfg.health_timeout_s:g} s, "
                                               f"but its requests are progressing")
            return "timeout", f"health check failed: {path} did not answer within {self.cfg.health_timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as e:
            return "refused", f"health check failed: {path}: {type(e).__name__}: {e}"
        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as e:
            return "bad_answer", f"health check failed: {path}: bad answer: {type(e).__name__}: {e}"
        if status == 401:
            return "unauthorized", f"{path} answered 401: the worker rejected the dispatcher's worker key"
        if status != 200:   # with the worker's reason (e.g. its KV receiver's), if it gave one
            why = worker_error_message(body) if path == "/health" and body else ""
            why = "".join(c if c.isprintable() else "?" for c in why)     # one log line, whatever it sent
            return "bad_status", f"health check failed: {path} answered {status}" + (f": {why}" if why else "")
        return "ok", ""

    async def scrape(self, w: Worker) -> bool:
        """Read ``w``'s /metrics into the router's view; on any failure keep the previous
        stats (counted and logged at debug level, never a health failure)."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        try:
            async with self._owner.http.get(w.url + "/metrics", timeout=timeout) as r:
                if r.status != 200:
                    raise _ScrapeError("bad_status", f"HTTP {r.status}")
                text = (await read_capped(r, _MAX_METRICS_BYTES)).decode("utf-8", "replace")
            if isinstance(w, PrefillWorker):
                self._adopt_cache(w.state, cache_info(text))   # first: a bad β below keeps it
                corr = correction_of(text)
                if corr is not None:
                    w.state.estimator.adopt(*corr)
            elif isinstance(w, DecodeWorker):
                free = free_kv_blocks(text)
                block_size = cache_info(text).block_size
                w.state.free_blocks = free
                if block_size:
                    w.block_size = block_size
            return True
        except _ScrapeError as e:
            reason, why = e.reason, str(e)
        except asyncio.TimeoutError:
            reason, why = "timeout", f"no answer within {self.cfg.health_timeout_s:g} s"
        except (aiohttp.ClientError, OSError) as e:
            reason, why = "error", f"{type(e).__name__}: {e}"
        except (ValueError, StatusError) as e:
            reason, why = "bad_answer", f"{type(e).__name__}: {e}"
        self._owner.metrics.scrape_failures.labels(w.name, reason).inc()
        logger.debug("%s worker %s: /metrics scrape failed (%s), keeping the previous stats", w.role, w.name, why)
        return False

    def _adopt_cache(self, p: PrefillInstance, info: CacheInfo) -> None:
        """The router's view of a prefill worker's KV cache: its block size, its usage, and
        the capacity of its prefix index (``cache_tokens``; 0, no index, with
        ``prefix_index = false``). A capacity or block size that changed (a restarted
        worker, caching turned off) drops the index: it starts over. What the page does not
        report (or reports malformed) keeps its previous value, as a failed scrape does."""
        if info.usage is not None:
            p.kv_usage = info.usage
        if info.num_blocks is None or info.block_size is None:
            return
        p.kv_tokens = info.num_blocks * info.block_size   # its KV memory, index or not (GoRouting's kv_fit)
        cap = info.capacity_tokens if self.cfg.prefix_index else 0
        block_size = info.block_size
        if cap != p.cache_tokens or block_size != p.block_size:
            p.cache_tokens, p.block_size, p.prefix = cap, block_size, None

    def prefix_block_tokens(self) -> int:
        """Tokens per prefix block the dispatcher hashes prompts in (``Request.prefix_block_tokens``):
        the KV block size of the prefill workers that keep an index (the gcd of theirs if they
        differ, so a run of blocks is whole blocks on each); 0 while none does (no index yet,
        or ``prefix_index = false``): requests then carry no prefix blocks."""
        size = 0
        for w in self.prefill:
            if w.state.cache_tokens:
                size = math.gcd(size, w.state.block_size)
        return size

    @staticmethod
    def _sync(w: Worker) -> None:
        w.state.healthy = w.routable    # a draining worker is out of every policy's candidates

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def _loop(self) -> None:
        """Every health_interval_s, start a check of each worker whose previous check has
        ended: one timer for all, and a slow worker delays no one else's checks."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for w in self.workers:
                t = self._checks.get(w.name)
                if t is None or t.done():
                    self._checks[w.name] = loop.create_task(self._check_logged(w))

    async def _check_logged(self, w: Worker) -> None:
        try:
            await self.check(w)
        except Exception:  # never let a health check error escape unseen
            logger.exception("health check of %s", w.name)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._checks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._task, self._checks = None, {}

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

    def suspect(self, w: Worker, why: str) -> None:
        """A request's established connection to ``w`` broke (reset, closed mid-answer).
        That request fails, but it does not take ``w`` out nor cancel its other requests:
        a healthy worker does this too (an idle keep-alive connection closed as a request
        went out on it). ``w`` is checked now instead, and the check decides; a worker
        that really died also refuses the next connection (:meth:`failed`)."""
        logger.info("%s worker %s: a connection broke (%s); checking it now", w.role, w.name, why)
        self._owner.metrics.broken_connections.labels(w.name).inc()
        if w.removed:
            return                 # no longer checked: its last requests fail over as usual
        t = self._checks.get(w.name)
        if t is None or t.done():
            self._checks[w.name] = asyncio.get_running_loop().create_task(self._check_logged(w))

    # -- membership ------------------------------------------------------------------------
    def find(self, name: str) -> Worker | None:
        return next((w for w in self.workers if w.name == name), None)

    def add(self, role: str, name: str, url: str, *, kv_addr: str = "", local_policy: str = "slide_batching",
            latency_model: str | None = None, source: str = "admin", kv_events: str = "",
            publish: str = "") -> Worker:
        """A new worker (the caller checked its fields and that its name and URL are
        free): out of the candidate set until its first check passes; that check starts
        now when the event loop runs (the health loop's timer would start it too)."""
        rid = self._next_id[role]
        self._next_id[role] += 1
        if role == "prefill":
            w = PrefillWorker("prefill", name, url.rstrip("/"), source=source, kv_events=kv_events,
                              publish=publish)
            spec = PrefillSpec(url, latency_model or self.cfg.latency_model, name, local_policy)
            w.state = PrefillInstance(rid, _estimator(spec), order=router_order(local_policy))
            w.state.healthy = False
            self.prefill.append(w)
        else:
            w = DecodeWorker("decode", name, url.rstrip("/"), kv_addr=kv_addr, source=source)
            w.state = DecodeInstance(rid, 0, healthy=False)
            self.decode.append(w)
        logger.info("%s worker %s (%s) added (%s)", role, name, w.url, source)
        if self._task is not None:
            self._checks[name] = asyncio.get_running_loop().create_task(self._check_logged(w))
        return w

    def drain(self, w: Worker, on: bool = True) -> None:
        """``w`` takes no new requests (``on``), or takes them again; its own stay."""
        if w.draining != on:
            logger.info("%s worker %s (%s) %s", w.role, w.name, w.url,
                        f"draining ({w.active} requests on it)" if on else "takes requests again")
        w.draining = on
        self._sync(w)

    def remove(self, w: Worker) -> None:
        """``w`` leaves the registry: no checks, no new requests. Requests still on it are
        left to run (as on a draining worker); a connection failure fails them over as usual."""
        if isinstance(w, PrefillWorker):
            self.prefill.remove(w)
        else:
            self.decode.remove(w)
        w.removed = True
        self._sync(w)
        if isinstance(w, PrefillWorker):
            from .kv_events import KVEventHub
            KVEventHub.drop(w)       # its event subscription ends (issue 14)
        t = self._checks.pop(w.name, None)
        if t is not None:
            t.cancel()
        logger.info("%s worker %s (%s) removed (%d requests still on it)", w.role, w.name, w.url, w.active)

    def key_rejected(self, w: Worker, why: str) -> None:
        """``w`` answered 401 to the dispatcher: a configuration error (the worker key),
        not the client's. Logged loudly; the worker is out until a check passes."""
        if not w.key_rejected:
            logger.error("%s worker %s (%s) rejects the dispatcher's worker key (%s): give the dispatcher the "
                         "workers' key (--worker-key-file, dispatcher.worker_api_key_file or $%s)",
                         w.role, w.name, w.url, why, WORKER_KEY_ENV)
        w.key_rejected = True
        self.failed(w, "the worker rejected the dispatcher's worker key (HTTP 401)")

    # -- views -----------------------------------------------------------------------------
    def live_prefill(self, exclude: set[str] = frozenset()) -> list[PrefillWorker]:
        """The prefill workers new requests may go to (healthy, not draining)."""
        return [w for w in self.prefill if w.routable and w.name not in exclude]

    def live_decode(self, exclude: set[str] = frozenset()) -> list[DecodeWorker]:
        return [w for w in self.decode if w.routable and w.name not in exclude]

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

    def status(self, workers: list[Worker] | None = None) -> list[dict]:
        out = []
        for w in self.workers if workers is None else workers:
            d = {"name": w.name, "role": w.role, "url": w.url, "healthy": w.healthy, "last_error": w.last_error,
                 "state": w.state_name, "requests": w.active, "source": w.source}
            if isinstance(w, PrefillWorker):
                d["queued"] = len(w.state.queue)
                d["beta"] = round(w.beta, 4)
                d["step_offset_s"] = round(w.delta, 6)
                d["cache_tokens"] = w.state.cache_tokens
                d["prefix_index_blocks"] = len(w.state.prefix) if w.state.prefix is not None else 0
                if w.kv_events:
                    d["kv_events"] = {"address": w.kv_events, "subscribed": bool(w.events and w.events.connected)}
                if w.state.kv_usage is not None:
                    d["kv_usage"] = round(w.state.kv_usage, 4)
            elif isinstance(w, DecodeWorker):
                d["kv_addr"] = w.kv_addr
                d["free_kv_blocks"] = w.state.free_blocks
            d["inflight"] = len(w.inflight)
            out.append(d)
        return out
