"""The dispatcher: an OpenAI-compatible HTTP front end that routes each
priority-tagged request to a prefill/decode pair and drives the hand-off.

One request, disaggregated (§4.3):

1. check the body, the API key and the asked priority/SLOs (4xx on failure);
2. count the prompt's tokens (the body's token ids, or the workers' ``/tokenize``)
   and check it fits the model's context;
3. route with the global policy (GoRouting by default) over the live instances:
   ``PrefillQueueMap[p].add(r)``, decode pick by free KV blocks;
4. **prefill leg**: the body capped at one token, with ``kv_transfer_params``
   naming a transfer id the dispatcher issues and the decode worker's KV
   address; its response is the asynchronous completion signal:
   ``PrefillQueueMap[p].remove(r)``;
5. **decode leg**: the same body with ``do_remote_prefill`` and the same id;
   the decode worker loads the pushed KV and generates; its tokens are
   streamed to the client as they come (or returned at once, unstreamed).

Co-located deployment: one leg, the whole request on the chosen instance; the
first streamed token is its completion signal.

Failures: a 4xx from a worker is the client's error and is passed on as is.
A worker that refuses or drops the connection, answers 5xx, or goes silent
leaves the candidate set; the request is retried once on other instances when
nothing has been sent to the client yet, else it ends with an error (an SSE
``error`` event for streams). Every request that enters ends with a response
or an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from scheduler.registry import make_global
from scheduler.routing.base import COLOCATED, PrefillQueueMap
from scheduler.tdg import slo_attained

from .auth import Authorizer
from .config import DispatcherConfig, KeyEntry
from .errors import ApiError, UpstreamError
from .instances import DecodeWorker, PrefillWorker, Registry, Worker
from .metrics import Metrics
from .requests import (CHAT, COMPLETIONS, Job, check_context, make_job, prefill_body, scheduler_request,
                       serve_body)

logger = logging.getLogger("proserve.dispatcher")

#: the worker refused, dropped or broke the connection: it leaves the candidate set at once
_CONN_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


class _Sent(Exception):
    """Internal: the failure happened after tokens reached the client (no retry)."""


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
        self.qmap = PrefillQueueMap([w.state for w in self.registry.prefill])
        self.metrics = Metrics()
        self._record = open(cfg.record_requests, "a", buffering=1) if cfg.record_requests else None
        self._tokenize_rr = 0

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, wait_s: float = 0.0) -> None:
        # aiohttp rather than httpx upstream: measured 2-3x less CPU per proxied stream here
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s,
                                          sock_read=self.cfg.idle_timeout_s))
        if self.auth.open_access:
            logger.warning("no API keys configured (--keys): open access, every client may ask for any "
                           "priority class")
        ok = await self.registry.wait_ready(wait_s) if wait_s > 0 else (await self.registry.check_all()) or False
        if not ok:
            down = [f"{w.name} ({w.url}): {w.last_error}" for w in self.registry.workers if not w.healthy]
            if down:
                logger.warning("not healthy yet: %s", "; ".join(down))
        self.registry.start()

    async def close(self) -> None:
        await self.registry.stop()
        if self.http is not None:
            await self.http.close()
        if self._record:
            self._record.close()
            self._record = None

    # -- admission -----------------------------------------------------------------------------
    async def admit(self, path: str, body: Any, headers) -> Job:
        arrival = time.time()
        entry = self.auth.authenticate(headers)
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        grant = self.auth.grant(entry, body)
        job = make_job(path, body, grant, arrival, self.cfg.model or self.registry.model_name)
        if job.prompt_ids is None:
            await self._count_prompt(job)
        check_context(job, self.registry.max_model_len)
        job.sreq = scheduler_request(job)
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
        last = ""
        for k in range(min(2, len(live))):
            w = live[(self._tokenize_rr + k) % len(live)]
            try:
                async with self.http.post(w.url + "/tokenize", json=body,
                                          timeout=aiohttp.ClientTimeout(total=30)) as r:
                    status, content = r.status, await r.read()
            except _CONN_ERRORS as e:
                self.registry.failed(w, f"{type(e).__name__}: {e}")
                last = f"{w.name}: {type(e).__name__}"
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{w.name}: {type(e).__name__}: {e}"
                continue
            self._tokenize_rr += 1
            if status == 200:
                job.prompt_len = int(json.loads(content)["count"])
                return
            msg = _error_message_bytes(content)
            if 400 <= status < 500:
                raise ApiError(400, f"cannot tokenize the {'messages' if job.is_chat else 'prompt'}: {msg}"
                                    + (" (does the model have a tokenizer? without one, send token ids)"
                                       if "tokenizer" in msg.lower() else ""),
                               param="messages" if job.is_chat else "prompt")
            last = f"{w.name}: HTTP {status}: {msg}"
        raise ApiError(502, f"could not count the prompt's tokens: {last}")

    # -- routing ---------------------------------------------------------------------------------
    def _route(self, job: Job, bad: set[str]) -> tuple[PrefillWorker, DecodeWorker | None]:
        ps = self.registry.live_prefill(bad)
        if not ps:
            raise ApiError(503, "no healthy prefill instance" + (f" (failed for this request: "
                                                                  f"{', '.join(sorted(bad))})" if bad else ""))
        ds: list[DecodeWorker] = []
        if not self.colocated:
            ds = self.registry.live_decode(bad)
            if not ds:
                raise ApiError(503, "no healthy decode instance" + (f" (failed for this request: "
                                                                     f"{', '.join(sorted(bad))})" if bad else ""))
        now = time.time()
        t0 = time.perf_counter()
        p_state, d_state = self.policy.route(job.sreq, [w.state for w in ps], [w.state for w in ds], now)
        self.metrics.route_time.observe(time.perf_counter() - t0)
        decision = getattr(self.policy, "last_decision", None)
        if decision is not None:
            self.metrics.branch.labels(decision.branch).inc()
        p = next(w for w in ps if w.state is p_state)
        self.qmap.add(p_state.id, job.sreq, now)
        self.metrics.routed.labels("prefill", p.name).inc()
        d = None
        if d_state is not None:
            d = next(w for w in ds if w.state is d_state)
            # blocks this request will hold there, until the next poll says otherwise
            need = math.ceil((job.prompt_len + (job.max_tokens or 16)) / max(1, d.block_size))
            d_state.free_blocks = max(0, d_state.free_blocks - need)
            self.metrics.routed.labels("decode", d.name).inc()
        return p, d

    def _prefill_done(self, job: Job, p: PrefillWorker) -> None:
        self.qmap.remove(p.state.id, job.sreq, time.time())   # a no-op once it is out

    # -- upstream calls, cancellable when the worker goes down -------------------------------------
    async def _guarded(self, w: Worker, coro):
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
        except _CONN_ERRORS as e:
            self.registry.failed(w, f"{type(e).__name__}: {e}")
            raise UpstreamError(w.name, f"connection failed: {type(e).__name__}: {e}") from None
        except asyncio.TimeoutError as e:
            raise UpstreamError(w.name, f"no answer within {self.cfg.idle_timeout_s:g} s "
                                        f"({type(e).__name__})") from None
        finally:
            w.inflight.discard(task)

    async def _post_json(self, w: Worker, path: str, body: dict) -> dict:
        async def call():
            async with self.http.post(w.url + path, json=body) as r:
                return r.status, await r.read()
        status, content = await self._guarded(w, call())
        if status == 200:
            return json.loads(content)
        raise _http_error(w, status, content)

    async def _stream(self, w: Worker, path: str, body: dict) -> AsyncIterator[dict]:
        """Parsed SSE events of a streamed upstream response. The read runs in a task of
        its own, registered with the worker, so that the worker going down ends the
        stream at once with an :class:`UpstreamError`."""
        queue: asyncio.Queue = asyncio.Queue()
        END = object()

        async def pump():
            async with self.http.post(w.url + path, json=body) as r:
                if r.status != 200:
                    queue.put_nowait(_http_error(w, r.status, await r.read()))
                    return
                async for line in r.content:
                    if line.startswith(b"data:"):
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        queue.put_nowait(json.loads(data))
            queue.put_nowait(END)

        async def runner():
            try:
                await self._guarded(w, pump())
            except asyncio.CancelledError:
                raise
            except Exception as e:   # UpstreamError, or a malformed event
                queue.put_nowait(e if isinstance(e, (UpstreamError, ApiError))
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
                    # vLLM reports errors after the 200 as an error event
                    err = item["error"] if isinstance(item["error"], dict) else {"message": str(item["error"])}
                    code = err.get("code")
                    if isinstance(code, int) and 400 <= code < 500:
                        raise ApiError(code, str(err.get("message")))
                    raise UpstreamError(w.name, f"error event: {err.get('message')}")
                yield item
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass

    # -- one request, end to end -------------------------------------------------------------------
    async def _prefill_leg(self, job: Job, p: PrefillWorker, d: DecodeWorker) -> None:
        xfer = {"do_remote_decode": True, "xfer_id": job.id, "remote_addr": d.kv_addr}
        try:
            await self._post_json(p, job.path, prefill_body(job, xfer))
        finally:
            self._prefill_done(job, p)   # the asynchronous completion signal (§4.3)

    async def events(self, job: Job) -> AsyncIterator[tuple[float, dict]]:
        """(time, chunk) of what the client gets, with one retry on other instances while
        nothing has been sent. Raises ApiError for the client, _Sent after tokens went out."""
        bad: set[str] = set()
        errors: list[str] = []
        for attempt in range(2):
            p, d = self._route(job, bad)
            job.record.update(prefill=p.name, decode=d.name if d else None, attempts=attempt + 1)
            sent = decoding = False
            leg: Worker = p
            try:
                if d is not None:
                    await self._prefill_leg(job, p, d)
                    leg, xfer = d, {"do_remote_prefill": True, "xfer_id": job.id}
                else:
                    xfer = None
                if job.stream:
                    async for chunk in self._stream(leg, job.path, serve_body(job, xfer, True)):
                        if d is None and not sent:
                            # co-located: the first token is the prefill's completion signal, and
                            # the request now adds to the instance's decode load n_d (§4.3)
                            self._prefill_done(job, p)
                            self.qmap.decode_started(p.state.id)
                            decoding = True
                        sent = True
                        yield time.time(), chunk
                else:
                    out = await self._post_json(leg, job.path, serve_body(job, xfer, False))
                    sent = True
                    yield time.time(), out
                return
            except UpstreamError as e:
                bad.add(leg.name)
                errors.append(str(e))
                if sent:
                    raise _Sent(str(e)) from None
                if attempt == 0:
                    self.metrics.retries.labels(leg.role).inc()
                    logger.warning("request %s: %s; retrying on other instances", job.id, e)
            finally:
                self._prefill_done(job, p)
                if decoding:
                    self.qmap.decode_finished(p.state.id)
        raise ApiError(502, "the request failed on two instances: " + " | ".join(errors))

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
        if r is not None and r.token_times:
            n = len(r.token_times)
            r.output_len = n
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
        for them), or all of an unstreamed response's tokens at the time it is delivered."""
        if job.stream:
            n = sum(len(c.get("token_ids") or ()) for c in chunk.get("choices") or ())
        else:
            n = int((chunk.get("usage") or {}).get("completion_tokens") or 0)
        job.sreq.token_times.extend([t] * n)


def _error_message_bytes(content: bytes) -> str:
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return content[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)
        return str(err)
    return str(data)[:500]


def _http_error(w: Worker, status: int, content: bytes) -> Exception:
    """A worker's 4xx is the client's error, passed on; anything else is the worker's."""
    msg = _error_message_bytes(content)
    if 400 <= status < 500:
        return ApiError(status, msg)
    return UpstreamError(w.name, f"HTTP {status}: {msg}", status)


# -- the HTTP app ------------------------------------------------------------------------------------
def create_app(dispatcher: Dispatcher, wait_s: float = 0.0):
    """The FastAPI app serving ``dispatcher``; its lifespan starts and stops the health checks."""

    @asynccontextmanager
    async def lifespan(app):
        await dispatcher.start(wait_s)
        try:
            yield
        finally:
            await dispatcher.close()

    app = FastAPI(title="ProServe dispatcher", lifespan=lifespan, docs_url=None, redoc_url=None)
    D = dispatcher

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def serve(request: Request, path: str):
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            job = await D.admit(path, body, request.headers)
        except ApiError as e:
            outcome = "auth_error" if e.status in (401, 403) else "client_error"
            D.metrics.requests.labels("-", outcome).inc()
            return error(e)
        D.metrics.in_flight.inc()
        deadline = asyncio.get_running_loop().time() + D.cfg.request_timeout_s
        agen = D.events(job)
        handed_over = False
        try:
            # run until the first chunk (or the whole unstreamed response), so that errors
            # found before anything is sent get a proper HTTP status
            async with asyncio.timeout_at(deadline):
                t, first = await agen.__anext__()
            D.count_tokens(job, t, first)
            if not job.stream:
                _strip(job, first)
                D.finish(job, "ok")
                return JSONResponse(first, headers={"x-request-id": job.id})
            handed_over = True
            return StreamingResponse(_sse(job, agen, first, deadline), media_type="text/event-stream",
                                     headers={"x-request-id": job.id})
        except StopAsyncIteration:
            D.finish(job, "upstream_error", "empty response")
            return error(ApiError(502, "the worker sent no response"))
        except ApiError as e:
            D.finish(job, "client_error" if e.status < 500 else "upstream_error", e.message)
            return error(e)
        except (_Sent, UpstreamError) as e:
            D.finish(job, "upstream_error", str(e))
            return error(ApiError(502, str(e)))
        except TimeoutError:
            msg = f"no response within {D.cfg.request_timeout_s:g} s"
            D.finish(job, "timeout", msg)
            return error(ApiError(504, msg))
        except asyncio.CancelledError:
            D.finish(job, "cancelled", "client went away")
            raise
        finally:
            if not handed_over:
                await agen.aclose()
                D.metrics.in_flight.dec()

    async def _sse(job: Job, agen, first: dict, deadline: float):
        outcome, err = "ok", None
        try:
            yield _event(job, first)
            async with asyncio.timeout_at(deadline):
                async for t, chunk in agen:
                    D.count_tokens(job, t, chunk)
                    if not job.want_usage and not chunk.get("choices") and "usage" in chunk:
                        continue
                    yield _event(job, chunk)
        except ApiError as e:
            outcome, err = ("client_error" if e.status < 500 else "upstream_error"), e.message
            yield f"data: {json.dumps(e.body())}\n\n"
        except (_Sent, UpstreamError) as e:
            outcome, err = "upstream_error", str(e)
            yield f"data: {json.dumps(ApiError(502, str(e)).body())}\n\n"
        except TimeoutError:
            outcome, err = "timeout", f"no response within {D.cfg.request_timeout_s:g} s"
            yield f"data: {json.dumps(ApiError(504, err).body())}\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            outcome, err = "cancelled", "client went away"
            raise
        finally:
            await agen.aclose()
            D.finish(job, outcome, err)
            D.metrics.in_flight.dec()
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
    async def models():
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
        return Response(D.metrics.render(D.registry), media_type="text/plain; version=0.0.4")

    return app
