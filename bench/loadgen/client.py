"""Sending: :func:`replay` sends every request of a workload at its offset with
aiohttp (streamed or not) — a later turn of a multi-turn conversation when the
previous turn's answer has arrived, plus its think time — timestamps the tokens
as they are read, and watches the client's own event loop for stalls;
:func:`fetch_model` asks the server for its model."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Sequence

from proserve.scheduler.request import ConfigError, Request

from ..workloads import TurnLink
from .body import ClientConfig, api_url, request_body
from .scoring import STALL_S, Result
from .sse import Chunk, SSEParser, parse_chunk, parse_response
from .workload import request_prompts, send_offsets, stream_flags

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


def _check_links(links: Sequence[TurnLink | None], n: int) -> None:
    if len(links) != n:
        raise ConfigError(f"{len(links)} turn links for {n} requests")
    for i, link in enumerate(links):
        if link is not None and link.prev is not None and not 0 <= link.prev < i:
            raise ConfigError(f"turn link {i}: previous turn {link.prev} must be an earlier request")


async def replay(reqs: Sequence[Request], cfg: ClientConfig, progress=None,
                 links: Sequence[TurnLink | None] | None = None) -> Run:
    """Send every request at its offset; return one :class:`Result` per request, in workload order.

    With ``links`` (a multi-turn workload, :func:`~proserve.bench.loadgen.workload.make_conversation_workload`),
    a request whose link names a previous turn is not sent at its offset but ``think_s``
    after that turn's request has ended (its last token, or its error: the conversation
    goes on); its ``Result.arrival`` (the time TTFT counts from) is that moment.
    ``progress(done, total, result)`` is called as each request ends."""
    import aiohttp
    cfg.check(q.priority for q in reqs)
    links = list(links) if links is not None else [None] * len(reqs)
    _check_links(links, len(reqs))
    model = cfg.model or await fetch_model(cfg.base_url, cfg.key_for(reqs[0].priority) if reqs else cfg.api_key)
    offsets = send_offsets(reqs)
    # everything heavy happens before the clock starts
    prompts = request_prompts(reqs, cfg.seed, cfg.vocab, cfg.token_low, links)
    perf0 = time.perf_counter() + cfg.start_delay
    t0_unix = time.time() + cfg.start_delay
    streams = stream_flags(len(reqs), cfg.stream_fraction, cfg.seed)
    follows = [link is not None and link.prev is not None for link in links]
    # a later turn's body is made when it is due (its arrival_time is known only then)
    payloads = [None if f else json.dumps(request_body(q, p, model, cfg, t0_unix + off, st)).encode()
                for q, p, off, st, f in zip(reqs, prompts, offsets, streams, follows)]
    ended = [asyncio.get_running_loop().create_future() for _ in reqs]   # run-clock end of each request
    headers = {c: cfg.headers_for(c) for c in {q.priority for q in reqs}}
    url = cfg.completions_url()

    def clock() -> float:
        return time.perf_counter() - perf0

    done = 0

    async def send(i: int) -> Result:
        nonlocal done
        q = reqs[i]
        due = offsets[i]
        if follows[i]:   # the previous turn's answer first, then the think time
            due = await ended[links[i].prev] + links[i].think_s
        res = Result(id=q.id, priority=q.priority, arrival=due, expected_tokens=q.output_len,
                     stream=streams[i])
        delay = due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            payload = payloads[i]
            if payload is None:
                payload = json.dumps(request_body(q, prompts[i], model, cfg, t0_unix + due, streams[i])).encode()
            await _one(session, url, headers[q.priority], payload, res, clock, cfg.return_token_ids,
                       cfg.request_timeout)
        except BaseException as e:   # cancelled: still a result
            if res.error is None:
                res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            if not ended[i].done():
                ended[i].set_result(clock())
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
