"""The dispatcher: an OpenAI-compatible HTTP front end that routes each
priority-tagged request to a prefill/decode pair and drives the hand-off.

One request, disaggregated (§4.3):

1. check the body, the API key and the asked priority/SLOs (4xx on failure);
2. count the prompt's tokens (the body's token ids, or the workers' ``/tokenize``)
   and check it fits the model's context;
3. admission control, when configured (:mod:`proserve.scheduler.admission`): a request
   no instance can serve within its TTFT SLO is queued, refused (429 with
   ``Retry-After``, before any prefill work) or served in a lower class, as its class's
   ``on_overload`` says; instances over the queue caps are left out;
4. route with the global policy (GoRouting by default) over the live instances:
   ``PrefillQueueMap[p].add(r)``, decode pick by free KV blocks;
5. **prefill leg**: the body capped at one token, with ``kv_transfer_params``
   naming a transfer id the dispatcher issues and the decode worker's KV
   address; its response is the asynchronous completion signal:
   ``PrefillQueueMap[p].remove(r)``;
6. **decode leg**: the same body with ``do_remote_prefill`` and the same id;
   the decode worker loads the pushed KV and generates; its tokens are
   streamed to the client as they come (or returned at once, unstreamed).

Co-located deployment: one leg, the whole request on the chosen instance; the
first streamed token is its completion signal.

A request for several completions (``n`` > 1, a list of prompts) is split into
one request per completion, each admitted, routed and run as above, and the
answers merged as vLLM merges them (:mod:`proserve.dispatcher.fanout`).

Failures: a 4xx from a worker is the client's error and is passed on as is
(but a 401 means the workers reject the dispatcher's own worker key: a
configuration error, logged loudly; the worker leaves the candidate set and
the client gets a 502/503 saying so). A worker that refuses connections (or
cannot be reached) leaves the candidate set at once and every request in
flight on it is cancelled. A connection that breaks once established (reset,
closed mid-answer) or a 5xx fails only that request (retried elsewhere), and a
broken connection has the worker checked at once: the check decides. A *slow*
worker is not a dead one: a
stream silent for ``stream_idle_timeout_s`` (default 60 s) ends that request
only (504), an unstreamed request has only the total ``request_timeout_s``
(default 600 s), and the worker stays in the set. A failed request is retried
once on other instances (with a fresh KV transfer id) when nothing has been
sent to the client yet, else it ends with an error (an SSE ``error`` event for
streams). When the prefill worker reports that its KV push failed
(``kv_transfer_params.error``), the decode leg is sent without the KV (the
decode worker recomputes the prompt), to another decode worker when the chosen
one was at fault. A client that goes away cancels its request upstream. Every
request that enters ends with a response or an error, and every error is an
OpenAI-style JSON object.

Limits on clients (all in :class:`~proserve.dispatcher.config.DispatcherConfig`): the
API key is checked from the headers before the body is read; the body is read
up to ``max_body_mb`` (413 at once when Content-Length says more, or as soon as
a chunked body passes it) within ``body_timeout_s`` (408); the request headers
must arrive within ``header_timeout_s`` (else the connection is closed:
:mod:`proserve.dispatcher.http_protocol`); at most ``max_concurrent`` requests overall and
``max_concurrent_per_key`` per client are admitted at once (429 with
``Retry-After``: :mod:`proserve.dispatcher.limits`). Each stream buffers at most
``stream_queue_events`` events: a slow client slows the read from the worker
(TCP back-pressure) instead of growing the dispatcher's memory.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from proserve.scheduler.admission import Admission, AdmissionDecision, serve_in
from proserve.scheduler.host import RouterHost
from proserve.scheduler.registry import make_global
from proserve.scheduler.routing.base import COLOCATED, decode_blocks
from proserve.scheduler.tdg import slo_attained

from . import fanout
from .auth import Authorizer, Grant
from .config import ConfigError, DispatcherConfig, KeyEntry
from .errors import ApiError, UpstreamError, error_body, worker_error_message
from .http_protocol import http_protocol
from .instances import (
    MAX_SHORT_ANSWER_BYTES,
    AnswerTooLarge,
    DecodeWorker,
    PrefillWorker,
    Registry,
    Worker,
    read_capped,
)
from .kv_events import KVEventHub
from .limits import RETRY_AFTER_S, ConcurrencyLimiter
from .membership import Membership, add_admin_routes
from .metrics import Metrics
from .publication import Publications
from .requests import (
    CHAT,
    COMPLETIONS,
    Job,
    check_context,
    make_job,
    prefill_body,
    scheduler_request,
    serve_body,
)

logger = logging.getLogger("proserve.dispatcher")

#: the connection to a worker failed (see Dispatcher._connection_failed). (aiohttp's read
#: timeouts are ClientConnectionErrors too: _guarded catches them first.)
_CONN_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
#: errnos of a failed connect that are this host's own shortage (file descriptors, ports,
#: buffers, memory), not the worker's fault: they fail the request but take no worker out
_LOCAL_ERRNOS = frozenset(getattr(errno, n) for n in ("EMFILE", "ENFILE", "ENOBUFS", "ENOMEM", "EADDRNOTAVAIL")
                          if hasattr(errno, n))


def _unreachable(e: BaseException) -> bool:
    """A connect to the worker failed for the worker's sake (refused, unreachable, timed
    out, name unknown): it leaves the candidate set. False for a broken established
    connection and for this host's own shortage of resources."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return True
    if isinstance(e, aiohttp.ClientConnectorError):
        return getattr(e.os_error, "errno", None) not in _LOCAL_ERRNOS
    return False
#: an error answered before the rest of a body this large was read closes the connection
#: (smaller remainders are read and dropped by uvicorn, and the connection is kept)
_DRAIN_LIMIT = 64 * 1024
#: seconds an idle upstream connection is kept: below WORKER_KEEP_ALIVE_S (prefill.worker)
UPSTREAM_KEEP_ALIVE_S = 30
#: seconds the dispatcher keeps a client's idle connection
CLIENT_KEEP_ALIVE_S = 75
_WORKER_KEY_REJECTED = "the worker rejected the dispatcher's worker key (HTTP 401)"
#: /tokenize answers that mean the prompt or messages are at fault, not the worker
_CLIENT_TOKENIZE_ERRORS = frozenset({400, 413, 422})
#: an unstreamed answer (or /tokenize's) larger than this is the worker's error: the
#: dispatcher holds at most this much of one in memory
MAX_ANSWER_BYTES = 256 * 1024 * 1024
#: tokens counted for one response when the request set no max_tokens (more than any
#: context): a worker's usage figures are not trusted to size the dispatcher's records
MAX_COUNTED_TOKENS = 1 << 20


class _Sent(Exception):
    """Internal: the failure happened after tokens reached the client (no retry)."""

    def __init__(self, error: UpstreamError):
        super().__init__(str(error))
        self.timeout = error.timeout


class Dispatcher:
    def __init__(self, cfg: DispatcherConfig, keys: dict[str, KeyEntry] | None = None):
        cfg.validate()
        self.cfg = cfg
        self.colocated = cfg.deployment == COLOCATED
        self.http: aiohttp.ClientSession | None = None    # made in start(), inside the event loop
        self.registry = Registry(cfg, self)
        self.auth = Authorizer(cfg.classes, cfg.resolved_default_class, keys)
        self.policy = make_global(cfg.global_policy, gain=cfg.gain, classes=cfg.classes,
                                  deployment=cfg.deployment, seed=cfg.seed, **cfg.global_params)
        # PrefillQueueMap and n_d (§4.3), moved only by the events below (scheduler.host); qmap is
        # there to read (and for benchmarks that seed queues)
        self.router_host = RouterHost(self.policy, [w.state for w in self.registry.prefill])
        self.qmap = self.router_host.qmap
        # admission control: the simulator's rule, on the router's estimate (None: off)
        adm = cfg.admission
        self.admission = Admission(adm, cfg.classes, cfg.gain, cfg.deployment, getattr(self.policy, "eta", None),
                                   getattr(self.policy, "order", "deadline")) \
            if adm.active else None
        self.metrics = Metrics()
        self.worker_key = cfg.worker_api_key()   # ConfigError naming the file when unreadable/empty
        self.admin_key = cfg.admin_key()         # None: the admin API is off (ConfigError when unreadable)
        if self.admin_key is not None and keys and self.admin_key in keys:
            raise ConfigError("the admin key must not be a client API key")
        if self.admin_key is not None and self.admin_key == self.worker_key:
            raise ConfigError("the admin key must not be the worker key")
        self.membership = Membership(self)
        self.kv_events = KVEventHub(self)        # prefill workers' KV-cache event subscriptions (issue 14)
        self.publications = Publications(self)   # prefill workers' queue publications (issue 15)
        self.limiter = ConcurrencyLimiter(cfg.max_concurrent, cfg.max_concurrent_per_key)
        self._record = open(cfg.record_requests, "a", buffering=1) if cfg.record_requests else None
        self._tokenize_rr = 0
        # per-call timeouts: a stream may go silent for stream_idle_timeout_s between events;
        # an unstreamed answer (a whole generation) has no read limit of its own, only the
        # request's deadline (request_timeout_s), which the app enforces around the whole request
        self._stream_timeout = aiohttp.ClientTimeout(total=None, connect=cfg.connect_timeout_s,
                                                     sock_read=cfg.stream_idle_timeout_s)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, wait_s: float = 0.0) -> None:
        # aiohttp rather than httpx upstream: measured 2-3x less CPU per proxied stream here
        # the worker key goes with every upstream call (legs, /tokenize, /health, /metrics, /v1/models)
        self.http = aiohttp.ClientSession(
            # idle connections are dropped before the workers drop them (python -m proserve.prefill|decode
            # keep them WORKER_KEEP_ALIVE_S), or a request sent on one as it closes is reset
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=UPSTREAM_KEEP_ALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s),
            headers={"Authorization": f"Bearer {self.worker_key}"} if self.worker_key else None)
        if self.auth.open_access:
            logger.warning("no API keys configured (--keys): open access, every client may ask for any "
                           "priority class")
        if self.admin_key is not None:
            logger.info("admin API on (/admin/workers)")
        await self.membership.discover_all()     # DNS discovery's first round (each bounded by its timeout_s)
        ok = await self.registry.wait_ready(wait_s) if wait_s > 0 else (await self.registry.check_all()) or False
        if not ok:
            down = [f"{w.name} ({w.url}): {w.last_error}" for w in self.registry.workers if not w.healthy]
            if down:
                logger.warning("not healthy yet: %s", "; ".join(down))
        self.registry.start()
        self.membership.start()
        self.publications.start()

    async def close(self) -> None:
        await self.membership.stop()
        await self.registry.stop()
        await self.kv_events.close()
        await self.publications.close()
        if self.http is not None:
            await self.http.close()
        if self._record:
            self._record.close()
            self._record = None

    def header_timed_out(self) -> None:
        """A client connection did not send its request headers within header_timeout_s
        (the HTTP protocol closed it)."""
        self.metrics.rejected.labels("header_timeout").inc()
        self.metrics.timeouts.labels("header").inc()

    # -- admission -----------------------------------------------------------------------------
    async def admit(self, path: str, body: Any, entry: KeyEntry | None, arrival: float) -> Job:
        """The checked request (``entry``: its authenticated key, from the headers)."""
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        grant = self.auth.grant(entry, body)
        job = make_job(path, body, grant, arrival, self.cfg.model or self.registry.model_name)
        if job.prompt_ids is None:
            await self._count_prompt(job)
        check_context(job, self.registry.max_model_len)
        job.sreq = scheduler_request(job, self.registry.prefix_block_tokens())
        job.tokens = None   # only its prefix blocks are kept (the body keeps a token-id prompt)
        job.record = {"id": job.id, "client": grant.client, "priority": grant.cls.name,
                      "weight": grant.cls.weight, "ttft_slo": grant.ttft_slo, "tpot_slo": grant.tpot_slo,
                      "arrival": arrival, "prompt_tokens": job.prompt_len, "stream": job.stream,
                      "endpoint": path}
        return job

    async def _count_prompt(self, job: Job) -> None:
        """Prompt tokens of a text or chat request, from a worker's /tokenize (the same
        tokenizer and chat template the engines apply)."""
        body: dict = {"model": job.body.get("model")}
        if job.is_chat:
            body["messages"] = job.body["messages"]
            for k in ("add_generation_prompt", "continue_final_message", "chat_template",
                      "chat_template_kwargs", "tools"):
                if k in job.body:
                    body[k] = job.body[k]
        else:
            p = job.body["prompt"]
            body["prompt"] = p[0] if isinstance(p, list) else p
            if "add_special_tokens" in job.body:
                body["add_special_tokens"] = job.body["add_special_tokens"]
        live = self.registry.live_prefill()
        if not live:
            raise ApiError(503, "no healthy prefill instance to count the prompt's tokens")
        # round robin over the live workers; a failed answer is retried once on the next one
        start = self._tokenize_rr
        self._tokenize_rr += 1
        failures: list[str] = []
        n_busy = 0                           # failures that were a 429 or 503
        for k in range(min(2, len(live))):
            w = live[(start + k) % len(live)]
            try:
                async with self.http.post(w.url + "/tokenize", json=body, timeout=_TOKENIZE_TIMEOUT) as r:
                    status, content = r.status, await read_capped(r, MAX_ANSWER_BYTES)
            except AnswerTooLarge as e:
                failures.append(f"{w.name}: {e}")
                continue
            except asyncio.TimeoutError as e:   # slow, not dead (aiohttp's read timeouts included)
                failures.append(f"{w.name}: {type(e).__name__}: {e}")
                continue
            except _CONN_ERRORS as e:
                self._connection_failed(w, e)
                failures.append(f"{w.name}: {type(e).__name__}")
                continue
            except aiohttp.ClientError as e:
                failures.append(f"{w.name}: {type(e).__name__}: {e}")
                continue
            if status == 200:
                try:
                    answer = json.loads(content)
                    count = answer["count"]
                    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                        raise ValueError(f"count {count!r}")
                except (ValueError, KeyError, TypeError, RecursionError) as e:
                    failures.append(f"{w.name}: bad /tokenize answer: {type(e).__name__}: {e}")
                    continue
                job.prompt_len = count
                # vLLM's answer carries the ids too (TokenizeResponse.tokens): the prompt's prefix
                # blocks for the router's cache index. Kept only when they match the count
                # (block_ids checks each is an integer id); otherwise the request has no prefix blocks
                tokens = answer.get("tokens") if isinstance(answer, dict) else None
                if isinstance(tokens, list) and len(tokens) == count:
                    job.tokens = tokens
                return
            if status == 401:
                self.registry.key_rejected(w, "/tokenize answered 401")
                failures.append(f"{w.name}: {_WORKER_KEY_REJECTED}")
                continue
            msg = worker_error_message(content)
            # the worker judged the body (400, 413, 422): the client's error. Any other status,
            # 4xx included (404: no /tokenize there, 429: busy), is the worker's: the next one
            # is tried, then 502 (make_job checked the model name whenever the dispatcher knows it)
            if status in _CLIENT_TOKENIZE_ERRORS:
                raise ApiError(400, f"cannot tokenize the {'messages' if job.is_chat else 'prompt'}: {msg}"
                                    + (" (does the model have a tokenizer? without one, send token ids)"
                                       if "tokenizer" in msg.lower() else ""),
                               param="messages" if job.is_chat else "prompt")
            failures.append(f"{w.name}: HTTP {status}: {msg}")
            n_busy += status in (429, 503)
        why = "; ".join(failures)
        if n_busy == len(failures):                              # every worker asked said "busy"
            raise ApiError(503, f"the workers are too busy to count the prompt's tokens: {why}",
                           headers={"retry-after": str(RETRY_AFTER_S)})
        raise ApiError(502, f"could not count the prompt's tokens: {why}")

    # -- routing ---------------------------------------------------------------------------------
    def _no_instance(self, role: str, bad: set[str]) -> ApiError:
        msg = f"no healthy {role} instance"
        if bad:
            msg += f" (failed for this request: {', '.join(sorted(bad))})"
        pool = self.registry.prefill if role == "prefill" else self.registry.decode
        if any(w.key_rejected for w in pool):
            msg += "; the workers reject the dispatcher's worker key (a configuration error)"
        return ApiError(503, msg)

    def _admit(self, job: Job, now: float) -> set[int] | None:
        """Admission control before the first routing (no prefill work spent yet): 429 when
        the request is refused, its class changed when downgraded. The ids of the
        instances it may go to (under the queue caps), or None for any. The simulator
        applies the same rule at the same point (``proserve.sim.cluster.Simulator._admit``).
        Taken once: a fan-out takes it for all its parts first (``FanOut.events``)."""
        if self.admission is None or job.admitted:
            return job.allowed
        ps = self.registry.live_prefill()
        if not ps or not (self.colocated or self.registry.live_decode()):
            return None                      # _route answers 503 (not 429: no retry can help soon)
        dec = self.admission.decide(job.sreq, [w.state for w in ps], now)
        asked = job.grant.cls.name
        self.metrics.admission.labels(asked, dec.decision, dec.reason or "-").inc()
        job.record["admission"] = dec.decision
        if dec.reason:
            job.record["admission_reason"] = dec.reason
        if dec.refused:
            self.metrics.rejected.labels(dec.reason).inc()
            raise _refusal(job, dec)
        if dec.served is not None and dec.served.name != asked:
            self._downgrade(job, dec.served)
        job.admitted, job.allowed = True, {st.id for st in dec.instances}
        return job.allowed

    def _downgrade(self, job: Job, cls) -> None:
        """Serve ``job`` in class ``cls``: its weight and SLOs, on the workers and in the metrics."""
        g = job.grant
        job.grant = Grant(g.client, cls, cls.ttft_slo, cls.tpot_slo)
        serve_in(job.sreq, cls)
        job.record.update(priority=cls.name, weight=cls.weight, ttft_slo=cls.ttft_slo, tpot_slo=cls.tpot_slo,
                          downgraded_from=g.cls.name)
        logger.info("request %s: no instance can meet its TTFT SLO in class %s; served in class %s",
                    job.id, g.cls.name, cls.name)

    def _route(self, job: Job, bad: set[str], allowed: set[int] | None = None
               ) -> tuple[PrefillWorker, DecodeWorker | None]:
        ps = self.registry.live_prefill(bad)
        if allowed is not None:
            ps = [w for w in ps if w.state.id in allowed]   # admission control's queue caps
        if not ps:
            raise self._no_instance("prefill", bad)
        ds: list[DecodeWorker] = []
        if not self.colocated:
            ds = self.registry.live_decode(bad)
            if not ds:
                raise self._no_instance("decode", bad)
        now = time.time()
        t0 = time.perf_counter()
        p_state, d_state = self.router_host.route(job.sreq, [w.state for w in ps], [w.state for w in ds], now)
        self.metrics.route_time.observe(time.perf_counter() - t0)
        decision = getattr(self.policy, "last_decision", None)
        if decision is not None:
            self.metrics.branch.labels(decision.branch).inc()
        p = next(w for w in ps if w.state is p_state)
        d = None
        if d_state is not None:
            d = next(w for w in ds if w.state is d_state)
            self.metrics.routed.labels("decode", d.name).inc()
        # last: from here on the caller's finally takes the request out of the queue map (and
        # releases the decode blocks promised to it until its prefill ends: RouterHost)
        self.router_host.dispatched(job.sreq, p_state.id, now, d_state,
                                    decode_blocks(job.prompt_len, job.max_tokens, d.block_size) if d else 0)
        self.publications.dispatched(job.sreq.id)   # ours, whatever a later publication says (issue 15)
        self.metrics.routed.labels("prefill", p.name).inc()
        return p, d

    def _prefill_done(self, job: Job) -> None:
        # PrefillQueueMap[p].remove(r); co-located, the request now decodes on p (n_d).
        # A no-op once it is out
        self.router_host.prefill_finished(job.sreq, time.time())

    # -- upstream calls, cancellable when the worker goes down -------------------------------------
    async def _guarded(self, w: Worker, coro, what: str):
        """Run an upstream call of ``w`` as a task registered with it (so that ``w`` going
        down cancels it) and turn its failures into :class:`UpstreamError`: a broken
        connection takes ``w`` out; a timeout (``what`` says which) does not."""
        task = asyncio.ensure_future(coro)
        w.inflight.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            cur = asyncio.current_task()
            if cur is not None and cur.cancelling():
                task.cancel()
                raise
            raise UpstreamError(w.name, f"worker went down ({w.last_error})") from None
        except aiohttp.ConnectionTimeoutError as e:   # (an asyncio.TimeoutError too: first)
            self._connection_failed(w, e)
            raise UpstreamError(w.name, f"connection failed: {type(e).__name__}: {e}") from None
        except asyncio.TimeoutError:                   # slow, not dead: w stays in the set
            self.metrics.timeouts.labels(what).inc()
            limit = self.cfg.stream_idle_timeout_s if what == "stream_idle" else self.cfg.request_timeout_s
            raise UpstreamError(w.name, f"no answer within {limit:g} s ({what.replace('_', ' ')} timeout)",
                                timeout=True) from None
        except _CONN_ERRORS as e:
            self._connection_failed(w, e)
            raise UpstreamError(w.name, f"connection failed: {type(e).__name__}: {e}") from None
        finally:
            w.inflight.discard(task)

    def _connection_failed(self, w: Worker, e: BaseException) -> None:
        """A call to ``w`` failed at the connection level. Cannot connect (refused,
        unreachable): ``w`` is gone, out of the set now. Otherwise -- an established
        connection broke (reset, closed mid-answer: a keep-alive race does it to a healthy
        worker), or this host ran short of sockets -- only this request fails and ``w`` is
        checked now; the check decides."""
        why = f"{type(e).__name__}: {e}"
        if _unreachable(e):
            self.registry.failed(w, why)
        else:
            self.registry.suspect(w, why)

    async def _post_json(self, w: Worker, path: str, body: dict) -> dict:
        """An unstreamed leg (the session's timeouts: connect only; the caller's deadline bounds it)."""
        async def call():
            async with self.http.post(w.url + path, json=body) as r:
                try:
                    return r.status, await (read_capped(r, MAX_ANSWER_BYTES) if r.status == 200 else
                                            read_capped(r, MAX_SHORT_ANSWER_BYTES, truncate=True))
                except AnswerTooLarge as e:
                    raise UpstreamError(w.name, f"bad answer: {e}") from None
        status, content = await self._guarded(w, call(), "request")
        w.last_progress = time.monotonic()
        if status != 200:
            raise _http_error(w, status, content)
        try:
            out = json.loads(content)
        except (ValueError, RecursionError) as e:
            raise UpstreamError(w.name, f"bad answer: not JSON ({type(e).__name__})") from None
        if not isinstance(out, dict):
            raise UpstreamError(w.name, f"bad answer: a JSON {type(out).__name__}, not an object")
        if "error" in out and not out.get("choices"):
            raise _error_answer(w, out["error"])     # an error answered with a 200
        problem = _answer_problem(out)
        if problem is not None:
            raise UpstreamError(w.name, f"bad answer: {problem}")
        return out

    async def _stream(self, w: Worker, path: str, body: dict) -> AsyncIterator[dict]:
        """Parsed SSE events of a streamed upstream response. The read runs in a task of
        its own, registered with the worker, so that the worker going down ends the
        stream at once with an :class:`UpstreamError`. The task hands events over in a
        queue of at most ``stream_queue_events``: when the client reads slower than the
        worker writes, the task waits, stops reading the socket, and TCP slows the worker."""
        queue: asyncio.Queue = asyncio.Queue(self.cfg.stream_queue_events)
        END = object()
        metrics = self.metrics
        monotonic = time.monotonic

        async def pump():
            async with self.http.post(w.url + path, json=body, timeout=self._stream_timeout) as r:
                if r.status != 200:
                    raise _http_error(w, r.status, await read_capped(r, MAX_SHORT_ANSWER_BYTES, truncate=True))
                async for line in r.content:
                    if line.startswith(b"data:"):
                        w.last_progress = monotonic()
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        item = json.loads(data)
                        if not isinstance(item, dict):
                            raise ValueError(f"an event is a JSON {type(item).__name__}, not an object")
                        problem = _answer_problem(item)
                        if problem is not None:
                            raise ValueError(problem)
                        if queue.full():             # the client is behind: wait for it
                            metrics.backpressure.inc()
                            await queue.put(item)
                        else:
                            queue.put_nowait(item)
                        n = queue.qsize()
                        if n > metrics.stream_queue_peak:
                            metrics.stream_queue_peak = n
            await queue.put(END)

        async def runner():
            try:
                await self._guarded(w, pump(), "stream_idle")
            except asyncio.CancelledError:
                raise
            except Exception as e:   # UpstreamError, or a malformed event
                await queue.put(e if isinstance(e, (UpstreamError, ApiError))
                                else UpstreamError(w.name, f"bad stream: {type(e).__name__}: {e}"))

        task = asyncio.ensure_future(runner())
        try:
            while True:
                item = await queue.get()
                if item is END:
                    return
                if isinstance(item, Exception):
                    raise item
                if "error" in item and not item.get("choices"):
                    raise _error_answer(w, item["error"])   # vLLM reports errors after the 200 as an error event
                yield item
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

    # -- one request, end to end -------------------------------------------------------------------
    async def _prefill_leg(self, job: Job, p: PrefillWorker, d: DecodeWorker, xfer_id: str) -> dict | None:
        """Run the prefill leg; None when the KV push went well, else what the prefill worker
        reported: ``{"error": message, "failed_dest": kv_addr or None}``."""
        xfer = {"do_remote_decode": True, "xfer_id": xfer_id, "remote_addr": d.kv_addr}
        try:
            out = await self._post_json(p, job.path, prefill_body(job, xfer))
        finally:
            self._prefill_done(job)   # the asynchronous completion signal (§4.3)
        kv = out.get("kv_transfer_params")
        if not isinstance(kv, dict) or not kv.get("error"):
            return None
        dest = kv.get("kv_failed_dest")
        return {"error": str(kv["error"])[:500], "failed_dest": dest if isinstance(dest, str) else None}

    def _kv_fallback(self, job: Job, d: DecodeWorker, failure: dict, bad: set[str]) -> DecodeWorker:
        """The prefill worker could not push the KV to ``d``: the decode leg goes without it
        (the decode worker computes the prompt itself); to another live decode worker when
        ``d`` itself was at fault and there is one, else to ``d``."""
        target, reason = d, "push_failed"
        if failure["failed_dest"] is not None and failure["failed_dest"] == d.kv_addr:
            reason = "dest_failed"
            others = self.registry.live_decode(bad | {d.name})
            if others:
                # its prefill is over: nothing is promised; the next scrape shows the blocks
                target = max(others, key=lambda w: w.state.room(time.time()))
                self.metrics.routed.labels("decode", target.name).inc()
        self.metrics.kv_fallbacks.labels(d.name, reason).inc()
        logger.warning("request %s: the KV push to decode worker %s failed (%s: %s); decode leg without KV "
                       "on %s, which computes the prompt itself", job.id, d.name, reason, failure["error"],
                       target.name)
        job.record.update(decode=target.name, kv_fallback=reason)
        return target

    async def events(self, job: Job) -> AsyncIterator[tuple[float, dict]]:
        """(time, chunk) of what the client gets, with one retry on other instances while
        nothing has been sent. Raises ApiError for the client, _Sent after tokens went out."""
        bad: set[str] = set()
        errors: list[str] = []
        timed_out = False
        allowed = self._admit(job, time.time())   # admission control, once (a retry goes to any live instance)
        for attempt in range(2):
            p, d = self._route(job, bad, allowed if attempt == 0 else None)
            held = [p] if d is None else [p, d]      # the workers this attempt occupies (Worker.active)
            for w in held:
                w.active += 1
            # a fresh KV transfer id per attempt: the workers key their transfer state by it,
            # and a late outcome of the first attempt must not touch the second's
            xfer_id = f"{job.id}-{attempt}"
            # routed_at: when this attempt was routed (no await since the decision); a drain or
            # resume answered before it applies to it, one answered after does not
            job.record.update(prefill=p.name, decode=d.name if d else None, attempts=attempt + 1, xfer_id=xfer_id,
                              routed_at=time.time())
            sent = False
            leg: Worker = p
            try:
                xfer = None
                if d is not None:
                    failure = await self._prefill_leg(job, p, d, xfer_id)
                    if failure is None:
                        leg, xfer = d, {"do_remote_prefill": True, "xfer_id": xfer_id}
                    else:
                        leg = self._kv_fallback(job, d, failure, bad)
                        if leg is not d:
                            held.append(leg)
                            leg.active += 1
                if job.stream:
                    async for chunk in self._stream(leg, job.path, serve_body(job, xfer, True)):
                        if d is None and not sent:
                            # co-located: the first token is the prefill's completion signal, and
                            # the request now adds to the instance's decode load n_d (§4.3)
                            self._prefill_done(job)
                        sent = True
                        yield time.time(), chunk
                else:
                    out = await self._post_json(leg, job.path, serve_body(job, xfer, False))
                    sent = True
                    yield time.time(), out
                return
            except UpstreamError as e:
                if e.status == 401:
                    self.registry.key_rejected(leg, str(e))
                bad.add(leg.name)
                errors.append(str(e))
                timed_out = e.timeout
                if sent:
                    raise _Sent(e) from None
                if attempt == 0:
                    self.metrics.retries.labels(leg.role).inc()
                    logger.warning("request %s: %s; retrying on other instances", job.id, e)
            finally:
                # this attempt is over: out of PrefillQueueMap[p], or out of p's n_d
                self.router_host.released(job.sreq, time.time())
                for w in held:
                    w.active -= 1
                    if not w.active and w.removed:
                        self.membership.retired(w)
                    elif not w.active and w.draining:
                        self.membership.idle(w)
        raise ApiError(504 if timed_out else 502, "the request failed on two instances: " + " | ".join(errors))

    # -- accounting ------------------------------------------------------------------------------
    def finish(self, job: Job, outcome: str, error: str | None = None) -> None:
        r = job.sreq
        name = job.grant.cls.name
        self.metrics.requests.labels(name, outcome).inc()
        rec = job.record
        rec["outcome"] = outcome
        rec["end"] = time.time()
        if error:
            rec["error"] = error
        if r is not None:
            r.end(error or (None if outcome == "ok" else outcome))   # its output length is what it emitted
            if rec.get("admission") != "reject":   # refused by admission control: no router heard of it
                self.router_host.finished(r, time.time())   # routers that learn from completions
        if r is not None and r.token_times:
            n = len(r.token_times)
            gain = self.cfg.gain
            got, ideal = gain.tdg(r), gain.ideal_gain(r)
            self.metrics.tdg_gained.labels(name).inc(got)
            self.metrics.tdg_missed.labels(name).inc(max(0.0, ideal - got))
            self.metrics.tokens.labels(name).inc(n)
            self.metrics.ttft.labels(name).observe(r.ttft)
            if n > 1:
                self.metrics.tpot.labels(name).observe(r.tpot)
            if outcome == "ok" and slo_attained(r):
                self.metrics.slo_met.labels(name).inc()
            rec.update(output_tokens=n, ttft=r.ttft, tpot=r.tpot, tdg=got, ideal_tdg=ideal,
                       token_times=[round(t - job.arrival, 6) for t in r.token_times])
        if self._record is not None:
            self._record.write(json.dumps(rec) + "\n")

    @staticmethod
    def count_tokens(job: Job, t: float, chunk: dict) -> None:
        """One timestamp per token: the token ids of a streamed chunk (the dispatcher asks
        for them), or all of an unstreamed response's tokens at the time it is delivered
        (its ``usage``), never more in all than the request's ``max_tokens`` (or
        :data:`MAX_COUNTED_TOKENS`): a worker's figures do not size the records."""
        if job.stream:
            n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices") or ())
        else:
            n = int((chunk.get("usage") or {}).get("completion_tokens") or 0)
        n = min(n, (job.max_tokens or MAX_COUNTED_TOKENS) - len(job.sreq.token_times))
        job.sreq.record_tokens(n, t)


_TOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=30)


def _refusal(job: Job, dec: AdmissionDecision) -> ApiError:
    """Admission control's 429: OpenAI's rate-limit error, with a Retry-After hint."""
    if dec.reason == "queue_full":
        why = "every instance's queue is at its cap"
    else:
        why = (f"no instance can serve it within its TTFT SLO of {job.grant.ttft_slo:g} s now, and class "
               f"{job.grant.cls.name!r} rejects requests on overload")
    return ApiError(429, f"the cluster is overloaded: {why}; retry after {dec.retry_after_s} s",
                    code=dec.reason, headers={"retry-after": str(dec.retry_after_s)})


def _headers(job: Job | fanout.FanOut) -> dict[str, str]:
    """Response headers: the request id, and the class it was served in when admission
    control downgraded it. A fanned-out request: the class of each choice, in index
    order, when any of its sub-requests was downgraded (each is admitted on its own)."""
    h = {"x-request-id": job.id}
    subs = job.jobs if isinstance(job, fanout.FanOut) else [job]
    down = [j.record.get("downgraded_from") for j in subs if j.record.get("downgraded_from") is not None]
    if down:
        h["x-proserve-priority"] = ", ".join(j.grant.cls.name for j in subs)
        h["x-proserve-downgraded-from"] = down[0]
    return h


def _answer_problem(item: dict) -> str | None:
    """What is wrong with the shape of a worker's answer (or streamed event) in the
    fields the dispatcher reads, or None: ``choices`` a list of objects (their
    ``token_ids`` lists), ``usage`` an object with an int ``completion_tokens`` >= 0."""
    choices = item.get("choices")
    if choices is not None:
        if not isinstance(choices, list):
            return f"'choices' is a JSON {type(choices).__name__}, not a list"
        for c in choices:
            if not isinstance(c, dict):
                return f"a choice is a JSON {type(c).__name__}, not an object"
            ids = c.get("token_ids")
            if ids is not None and not isinstance(ids, list):
                return f"'token_ids' is a JSON {type(ids).__name__}, not a list"
    usage = item.get("usage")
    if usage is not None:
        if not isinstance(usage, dict):
            return f"'usage' is a JSON {type(usage).__name__}, not an object"
        n = usage.get("completion_tokens")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            return f"'usage.completion_tokens' is {n!r:.40}, not an int >= 0"
    return None


def _error_answer(w: Worker, error: Any) -> Exception:
    """An error a worker answered after (or with) a 200: an error event in a stream,
    or an unstreamed 200 whose body is ``{"error": ...}``. A 4xx code (but 401) is the
    client's error, passed on; anything else is the worker's."""
    err = error if isinstance(error, dict) else {"message": str(error)}
    code = err.get("code")
    if isinstance(code, int) and 400 <= code < 500 and code != 401:
        return ApiError(code, str(err.get("message")))
    return UpstreamError(w.name, f"error event: {err.get('message')}", code)


def _http_error(w: Worker, status: int, content: bytes) -> Exception:
    """A worker's 4xx is the client's error, passed on; anything else is the worker's. A 401
    is the worker refusing the dispatcher's own key: the worker's (configuration) error."""
    if status == 401:
        return UpstreamError(w.name, _WORKER_KEY_REJECTED, status)
    msg = worker_error_message(content)
    if 400 <= status < 500:
        return ApiError(status, msg)
    return UpstreamError(w.name, f"HTTP {status}: {msg}", status)


# -- the HTTP app ------------------------------------------------------------------------------------
def uvicorn_config(dispatcher: Dispatcher, app, http_impl: str = "auto", **kw) -> uvicorn.Config:
    """uvicorn's config for ``app`` (from :func:`create_app`): the dispatcher's host and port
    and the HTTP protocol with its header timeout (``http_impl``: auto, httptools or h11);
    ``kw`` adds to or overrides uvicorn's options (``python -m proserve.dispatcher`` and the tests
    both start the server through this)."""
    d = dispatcher
    opts = dict(host=d.cfg.host, port=d.cfg.port, access_log=False, lifespan="on",
                # clients keep idle connections for a while (aiohttp 15 s, browsers more): a server
                # that closes them first races the client's next request on them (a reset, with
                # no answer); uvicorn's default is 5 s
                timeout_keep_alive=CLIENT_KEEP_ALIVE_S,
                http=http_protocol(d.cfg.header_timeout_s, d.header_timed_out, http_impl),
                # uvicorn would otherwise wait without bound for open streams (a stalled client)
                timeout_graceful_shutdown=d.cfg.shutdown_timeout_s)
    opts.update(kw)
    return uvicorn.Config(app, **opts)


def _body_left(headers) -> bool:
    """Whether an answer sent now, before reading the body, should close the connection:
    the body still to come may be large (uvicorn reads and drops small remainders)."""
    cl = headers.get("content-length")
    if cl is None:
        return headers.get("transfer-encoding") is not None   # chunked: of unknown size
    try:
        return int(cl) > _DRAIN_LIMIT
    except ValueError:
        return True


class _DisconnectWatch:
    """While armed, cancels the task that made it when the client disconnects (``gone``
    is then True). Used while a request waits for its first chunk (an unstreamed request:
    its whole answer), so that a client that went away cancels the upstream call; once
    streaming, Starlette's StreamingResponse watches for the disconnect itself.

    The watching task starts only after ``grace_s``: requests that finish sooner never
    need one (a disconnect before that is seen as soon as it starts); cancelling upstream
    work matters for the long ones (generations of seconds), where it costs nothing. :meth:`disarm`
    must be called right after the awaited call returns (no await in between), so that a
    disconnect after that point cancels nothing."""

    __slots__ = ("task", "gone", "armed", "_receive", "_timer", "_watcher")

    def __init__(self, receive, grace_s: float = 0.25):
        self.task = asyncio.current_task()
        self.gone = False
        self.armed = True
        self._receive = receive
        self._watcher: asyncio.Task | None = None
        self._timer = asyncio.get_running_loop().call_later(grace_s, self._start)

    def _start(self) -> None:
        self._timer = None
        if self.armed:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        # the body was read: the next message is the disconnect (or the end of the response)
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if self.armed:
            self.gone = True
            self.task.cancel()

    def disarm(self) -> None:
        if self.armed:
            self.armed = False
            if self._timer is not None:
                self._timer.cancel()
            if self._watcher is not None:
                self._watcher.cancel()


class _EventStream(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however it ends (Starlette may stop
    iterating the body without closing it when the client goes away, or never start)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


class _Answer(JSONResponse):
    """An unstreamed answer that keeps its request's concurrency slot until it is written,
    so that answers a client does not read count against the limits. Writing it is bounded
    too: by the request's deadline, and at least ``ANSWER_WRITE_GRACE_S`` (the server then
    closes a connection whose response it could not complete)."""

    def __init__(self, content, release, deadline: float, **kw):
        super().__init__(content, **kw)
        self._release = release
        self._deadline = max(deadline, asyncio.get_running_loop().time() + ANSWER_WRITE_GRACE_S)

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with asyncio.timeout_at(self._deadline):
                # in pieces: the server waits for the client between them (a single send of
                # the whole body would sit in the transport's buffer, whatever the client reads)
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                body, step = self.body, ANSWER_PIECE_BYTES
                for i in range(0, max(len(body), 1), step):
                    await send({"type": "http.response.body", "body": body[i:i + step],
                                "more_body": i + step < len(body)})
        except TimeoutError:
            logger.info("an answer was not read by its client in time; its connection is closed")
        finally:
            self._release()


#: least time a client is given to read an unstreamed answer (see _Answer)
ANSWER_WRITE_GRACE_S = 30.0
#: an unstreamed answer is written in pieces of this size
ANSWER_PIECE_BYTES = 64 << 10


def create_app(dispatcher: Dispatcher, wait_s: float = 0.0):
    """The FastAPI app serving ``dispatcher``; its lifespan starts and stops the health checks."""

    @asynccontextmanager
    async def lifespan(app):
        await dispatcher.start(wait_s)
        try:
            yield
        finally:
            await dispatcher.close()

    app = FastAPI(title="ProServe dispatcher", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    D = dispatcher
    M = D.metrics
    max_body = D.cfg.max_body_bytes

    def error(e: ApiError, close: bool = False) -> JSONResponse:
        headers = dict(e.headers) if e.headers else {}
        if close:
            headers["connection"] = "close"
        return JSONResponse(e.body(), status_code=e.status, headers=headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException):
        # unknown route (404), wrong method (405): the OpenAI error format too
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(exc.status_code, msg), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, f"internal error ({type(exc).__name__})"), status_code=500)

    async def read_body(request: Request) -> bytes:
        """The request body: 413 over ``max_body_mb`` (before reading a byte when the
        Content-Length says so), 408 when it has not all arrived within ``body_timeout_s``."""
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise ApiError(400, f"bad Content-Length {cl[:40]!r}") from None
            if n > max_body:
                M.rejected.labels("body_too_large").inc()
                raise _too_large()
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(D.cfg.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body:
                        M.rejected.labels("body_too_large").inc()
                        raise _too_large()
                    parts.append(chunk)
        except TimeoutError:
            M.rejected.labels("body_timeout").inc()
            M.timeouts.labels("body").inc()
            raise ApiError(408, f"the request body did not arrive within {D.cfg.body_timeout_s:g} s "
                                f"({size} bytes came)", code="body_timeout") from None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _too_large() -> ApiError:
        return ApiError(413, f"the request body is larger than the limit of {D.cfg.max_body_mb:g} MB",
                        code="body_too_large")

    def parse_json(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        except ValueError as e:   # UnicodeDecodeError included
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    async def serve(request: Request, path: str):
        arrival = time.time()
        headers = request.headers
        # 1. the key, from the headers alone; 2. a slot (429 over the limits)
        try:
            entry = D.auth.authenticate(headers)
            slot = D.limiter.acquire(entry.client if entry else None)
        except ApiError as e:
            if e.status == 401:
                M.rejected.labels("auth").inc()
                M.requests.labels("-", "auth_error").inc()
            else:
                M.rejected.labels("client_overloaded" if e.code == "too_many_concurrent_requests_for_key"
                                  else "overloaded").inc()
                M.requests.labels("-", "rejected").inc()
            return error(e, close=_body_left(headers))
        handed_over = slot_kept = False
        try:
            # 3. the body (size and time limits), then the request itself
            body_read = False
            try:
                raw = await read_body(request)
                body_read = True
                try:
                    body = parse_json(raw)
                except ApiError:
                    M.rejected.labels("bad_json").inc()
                    raise
                # n > 1 or several prompts: one request per completion, run and merged as one
                # (dispatcher.fanout); the FanOut is then the job, its runner and its slots
                run = D
                fan = fanout.split(path, body)
                if fan is None:
                    job = await D.admit(path, body, entry, arrival)
                else:
                    slot = run = job = await fanout.FanOut.admit(D, path, fan, entry, arrival, slot)
            except ApiError as e:
                M.requests.labels("-", "auth_error" if e.status in (401, 403) else
                                  "rejected" if e.status == 429 else "client_error").inc()
                return error(e, close=not body_read)
            except ClientDisconnect:
                M.requests.labels("-", "cancelled").inc()
                return Response(status_code=499)   # nobody reads it (nginx's "client closed request")
            except RecursionError:                 # a deeply nested body that json.loads took
                M.requests.labels("-", "client_error").inc()
                return error(ApiError(400, "the request body is nested too deeply"))
            except Exception:
                logger.exception("unexpected error admitting a request to %s", path)
                M.requests.labels("-", "internal_error").inc()
                return error(ApiError(500, "internal error while checking the request"), close=not body_read)
            # 4. run it: every exit below goes through end() exactly once
            M.in_flight.inc()
            ended = False

            def end(outcome: str, err: str | None = None, release: bool = True) -> None:
                nonlocal ended
                if not ended:
                    ended = True
                    run.finish(job, outcome, err)
                    M.in_flight.dec()
                    if release:
                        slot.release()

            deadline = asyncio.get_running_loop().time() + D.cfg.request_timeout_s
            agen = run.events(job)
            watch = _DisconnectWatch(request.receive)
            try:
                # until the first chunk (or the whole unstreamed response), so that errors
                # found before anything is sent get a proper HTTP status
                async with asyncio.timeout_at(deadline):
                    t, first = await agen.__anext__()
                watch.disarm()
                run.count_tokens(job, t, first)
                if not job.stream:
                    _strip(job, first)
                    end("ok", release=False)
                    answer = _Answer(first, slot.release, deadline, headers=_headers(job))
                    slot_kept = True              # by the answer, until it is written
                    return answer
                gen = _sse(run, job, agen, first, deadline, end)

                async def on_close():
                    await gen.aclose()      # runs _sse's cleanup if Starlette left it suspended
                    await agen.aclose()
                    end("cancelled", "client went away")   # a no-op unless _sse never ran
                handed_over = True
                return _EventStream(gen, on_close, media_type="text/event-stream", headers=_headers(job))
            except StopAsyncIteration:
                end("upstream_error", "empty response")
                return error(ApiError(502, "the worker sent no response"))
            except ApiError as e:
                end("rejected" if e.status == 429 else "client_error" if e.status < 500
                    else ("timeout" if e.status == 504 else "upstream_error"), e.message)
                return error(e)
            except (_Sent, UpstreamError) as e:
                end("upstream_error", str(e))
                return error(ApiError(502, str(e)))
            except TimeoutError:
                M.timeouts.labels("request").inc()
                msg = f"no response within {D.cfg.request_timeout_s:g} s"
                end("timeout", msg)
                return error(ApiError(504, msg))
            except RecursionError:   # e.g. forwarding a deeply nested body
                end("client_error", "nested too deeply")
                return error(ApiError(400, "the request body is nested too deeply"))
            except asyncio.CancelledError:
                end("cancelled", "client went away")
                if not watch.gone:
                    raise
                asyncio.current_task().uncancel()   # our own doing: the upstream call is closed
                return Response(status_code=499)   # nobody reads it (nginx's "client closed request")
            except Exception as e:
                logger.exception("request %s: unexpected error", job.id)
                end("internal_error", f"{type(e).__name__}: {e}")
                return error(ApiError(500, f"internal error ({type(e).__name__})"))
            finally:
                watch.disarm()
                if not handed_over:
                    await agen.aclose()
        finally:
            if not (handed_over or slot_kept):
                slot.release()

    async def _sse(run, job: Job, agen, first: dict, deadline: float, end):
        outcome, err = "ok", None
        try:
            yield _event(job, first)
            async with asyncio.timeout_at(deadline):
                async for t, chunk in agen:
                    run.count_tokens(job, t, chunk)
                    if not job.want_usage and not chunk.get("choices") and "usage" in chunk:
                        continue
                    yield _event(job, chunk)
        except ApiError as e:
            outcome, err = ("client_error" if e.status < 500 else "upstream_error"), e.message
            yield f"data: {json.dumps(e.body())}\n\n"
        except (_Sent, UpstreamError) as e:
            timeout = getattr(e, "timeout", False)
            outcome, err = ("timeout" if timeout else "upstream_error"), str(e)
            yield f"data: {json.dumps(ApiError(504 if timeout else 502, str(e)).body())}\n\n"
        except TimeoutError:
            M.timeouts.labels("request").inc()
            outcome, err = "timeout", f"no response within {D.cfg.request_timeout_s:g} s"
            yield f"data: {json.dumps(ApiError(504, err).body())}\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            if asyncio.get_running_loop().time() >= deadline:
                # the deadline fired while the response waited on a client that reads nothing
                # (the cancellation reaches the send, outside this generator's timeout block)
                M.timeouts.labels("request").inc()
                outcome = "timeout"
                err = f"no response within {D.cfg.request_timeout_s:g} s (the client stopped reading)"
            else:
                outcome, err = "cancelled", "client went away"
            raise
        except Exception as e:
            logger.exception("request %s: unexpected error while streaming", job.id)
            outcome, err = "internal_error", f"{type(e).__name__}: {e}"
            yield f"data: {json.dumps(ApiError(500, f'internal error ({type(e).__name__})').body())}\n\n"
        finally:
            await agen.aclose()
            end(outcome, err)
        yield "data: [DONE]\n\n"

    def _event(job: Job, chunk: dict) -> str:
        _strip(job, chunk)
        return f"data: {json.dumps(chunk)}\n\n"

    def _strip(job: Job, chunk: dict | None) -> None:
        if not chunk:
            return
        chunk.pop("kv_transfer_params", None)
        if not job.want_token_ids:
            chunk.pop("prompt_token_ids", None)
            for c in chunk.get("choices") or ():
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await serve(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat(request: Request):
        return await serve(request, CHAT)

    @app.get("/v1/models")
    async def models(request: Request):
        # behind the client keys like vLLM's own /v1/models (only /health and /metrics are open)
        try:
            D.auth.authenticate(request.headers)
        except ApiError as e:
            M.rejected.labels("auth").inc()
            return error(e)
        name = D.cfg.model or D.registry.model_name
        data = []
        if name:
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "proserve",
                         "max_model_len": D.registry.max_model_len})
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        ok = bool(D.registry.live_prefill()) and (D.colocated or bool(D.registry.live_decode()))
        return JSONResponse({"status": "ok" if ok else "unavailable", "instances": D.registry.status()},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(M.render(D.registry), media_type="text/plain; version=0.0.4")

    add_admin_routes(app, D, read_body, parse_json, error)

    return app
