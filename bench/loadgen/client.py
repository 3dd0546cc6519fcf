"""Sending: :func:`replay` sends every request of a workload at its offset with
aiohttp (streamed or not), timestamps the tokens as they are read, and watches
the client's own event loop for stalls; :func:`fetch_model` asks the server for
its model."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Sequence

from proserve.scheduler.request import ConfigError, Request

from .body import ClientConfig, api_url, request_body
from .scoring import STALL_S, Result
from .sse import Chunk, SSEParser, parse_chunk, parse_response
from .workload import prompt_tokens, request_index, send_offsets, stream_flags

# --- sending -----------------------------------------------------------------------------

async def _error_message(resp) -> str:
    text = await resp.text(errors="replace")
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", text) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        msg = text
    msg = " ".join(str(msg).split())
    return msg[:300]


async def _one(session, url: str, headers: dict, payload: bytes, res: Result, clock, token_ids: bool,
               timeout: float) -> Result:
    import aiohttp
    res.sent = clock()
    try:
        async with session.post(url, data=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            res.status, res.responded = resp.status, clock()
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {await _error_message(resp)}"
                return res
            if not res.stream:
                raw = await resp.read()
                now = clock()   # every token arrives with the whole response
                ch = parse_response(raw, token_ids)
                if ch.malformed:
                    res.malformed += 1
                    res.error = f"unreadable response: {ch.malformed}"
                elif ch.error is not None:
                    res.error = f"error response: {ch.error}"
                else:
                    res.token_times.extend([now] * ch.tokens)
                    res.finish_reason, res.usage_tokens, res.done = ch.finish_reason, ch.usage_tokens, ch.done
                return res.finish()
            parser = SSEParser()
            async for data in resp.content.iter_any():
                now = clock()
                for ev in parser.feed(data):
                    _apply(res, parse_chunk(ev, token_ids), now)
            now = clock()
            for ev in parser.close():
                _apply(res, parse_chunk(ev, token_ids), now)
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout:g} s ({len(res.token_times)} tokens received)"
    except Exception as e:   # transport errors end this request, never the run
        res.error = f"{type(e).__name__}: {e}"
    return res.finish()


def _apply(res: Result, ch: Chunk, now: float) -> None:
    if ch.malformed:
        res.malformed += 1
        return
    if ch.done:
        res.done = True
        return
    if ch.error is not None and res.error is None:
        res.error = f"error event: {ch.error}"
    res.token_times.extend([now] * ch.tokens)
    if ch.finish_reason:
        res.finish_reason = ch.finish_reason
    if ch.usage_tokens is not None:
        res.usage_tokens = ch.usage_tokens


async def fetch_model(base_url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The first model id of ``GET /v1/models``."""
    import aiohttp
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(api_url(base_url, "models"), headers=headers) as r:
            if r.status != 200:
                raise ConfigError(f"GET {api_url(base_url, 'models')}: HTTP {r.status}: {await _error_message(r)}")
            data = (await r.json()).get("data") or []
    if not data:
        raise ConfigError(f"{base_url} lists no models; pass --model")
    return str(data[0]["id"])


@dataclass
class Run:
    results: list[Result]
    t0_unix: float      # Unix time of the run clock's 0
    wall_s: float       # first send → last result
    stalls: list[float] = field(default_factory=list)   # event-loop stalls > STALL_S (s), see _watch_loop


async def _watch_loop(stop: asyncio.Event, stalls: list[float], period: float = 0.01) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        late = time.perf_counter() - t - period
        if late > STALL_S:
            stalls.append(late)


async def replay(reqs: Sequence[Request], cfg: ClientConfig, progress=None) -> Run:
    """Send every request at its offset; return one :class:`Result` per request, in workload order.

    ``progress(done, total, result)`` is called as each request ends."""
    import aiohttp
    cfg.check(q.priority for q in reqs)
    model = cfg.model or await fetch_model(cfg.base_url, cfg.key_for(reqs[0].priority) if reqs else cfg.api_key)
    offsets = send_offsets(reqs)
    # everything heavy happens before the clock starts
    prompts = [prompt_tokens(cfg.seed, request_index(q, i), q.prompt_len, cfg.vocab, cfg.token_low)
               for i, q in enumerate(reqs)]
    perf0 = time.perf_counter() + cfg.start_delay
    t0_unix = time.time() + cfg.start_delay
    streams = stream_flags(len(reqs), cfg.stream_fraction, cfg.seed)
    payloads = [json.dumps(request_body(q, p, model, cfg, t0_unix + off, st)).encode()
                for q, p, off, st in zip(reqs, prompts, offsets, streams)]
    headers = {c: cfg.headers_for(c) for c in {q.priority for q in reqs}}
    url = cfg.completions_url()

    def clock() -> float:
        return time.perf_counter() - perf0

    done = 0

    async def send(i: int) -> Result:
        nonlocal done
        q = reqs[i]
        res = Result(id=q.id, priority=q.priority, arrival=offsets[i], expected_tokens=q.output_len,
                     stream=streams[i])
        delay = offsets[i] - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            await _one(session, url, headers[q.priority], payloads[i], res, clock, cfg.return_token_ids,
                       cfg.request_timeout)
        except BaseException as e:   # cancelled: still a result
            if res.error is None:
                res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            done += 1
            if progress is not None:
                progress(done, len(reqs), res)
        return res

    # a fresh connection per request. With keep-alive reuse, 1 of 456 requests at 7.6 req/s
    # got "Connection reset by peer" right at its send, with nothing in the server log: most
    # likely a pooled connection the server (uvicorn: 5 s keep-alive) was closing meanwhile.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    stop, stalls = asyncio.Event(), []
    watcher = asyncio.create_task(_watch_loop(stop, stalls))
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            results = await asyncio.gather(*(send(i) for i in range(len(reqs))))
    finally:
        stop.set()
        await watcher
    wall = clock() - (offsets[0] if offsets else 0.0)
    return Run(list(results), t0_unix, wall, stalls)
