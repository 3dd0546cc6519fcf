"""Adversarial tests of the dispatcher: broken or hostile workers (answers of the
wrong shape, a 200 carrying an error, gigantic answers, absurd usage figures)
and clients that disconnect at every stage. Each test names the problem it
found (or the property that held); every request must end with an answer in
the OpenAI error format, its concurrency slot released and its outcome counted.

Asserts are on what the dispatcher answered and counted, never on timing."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from dispatcher_helpers import RawConn, harness, metric, post_head, run, until

from proserve.dispatcher import server

PROMPT = list(range(1, 41))


def is_openai_error(payload, status: int) -> bool:
    err = payload.get("error") if isinstance(payload, dict) else None
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and bool(err["message"]))


def answering(answer):
    """A worker handler: the prefill leg succeeds; the serving leg gets ``answer(body)``,
    a dict (sent as JSON), a web.Response, or bytes (sent as one SSE stream)."""
    async def generate(request, chat):
        body = await request.json()
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            return web.json_response({"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "xfer_id": kv.get("xfer_id")}})
        out = answer(body)
        if isinstance(out, bytes):
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(out)
            return resp
        return out if isinstance(out, web.StreamResponse) else web.json_response(out)
    return generate


def use(h, answer) -> None:
    for w in h.prefills + h.decodes:
        w._generate_inner = answering(answer)


async def counted(h, outcome: str | None = None) -> float:
    text = await h.metrics()
    return metric(text, "proserve:dispatcher_requests_total", **({"outcome": outcome} if outcome else {}))


def test_a_workers_usage_figure_does_not_size_the_dispatchers_records():
    """Problem: an unstreamed answer's usage.completion_tokens was trusted to size a
    list of token timestamps: 3e8 froze the dispatcher's event loop (every request)
    for ~2 minutes building and scoring it. Now at most max_tokens are counted."""
    async def main():
        async with harness() as h:
            use(h, lambda body: {"choices": [{"index": 0, "text": "x"}],
                                 "usage": {"completion_tokens": 30_000_000}})
            r = await h.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
            assert r.status_code == 200
            assert metric(await h.metrics(), "proserve:dispatcher_output_tokens_total") == 5
            # without max_tokens: bounded by MAX_COUNTED_TOKENS
            old = server.MAX_COUNTED_TOKENS
            server.MAX_COUNTED_TOKENS = 100
            try:
                r = await h.post("/v1/completions", {"prompt": PROMPT})
            finally:
                server.MAX_COUNTED_TOKENS = old
            assert r.status_code == 200
            assert metric(await h.metrics(), "proserve:dispatcher_output_tokens_total") == 105
    run(main())


def test_an_answer_larger_than_the_cap_is_the_workers_error(monkeypatch):
    """Problem: unstreamed answers (and /tokenize's, /health's, error bodies) were read
    whole: a worker answering 300 MB grew the dispatcher by ~600 MB and the client
    got it all. Now an answer over MAX_ANSWER_BYTES is a bad answer of that worker
    (retried elsewhere, then 502/503), and it stays in the candidate set."""
    monkeypatch.setattr(server, "MAX_ANSWER_BYTES", 1 << 20)

    async def big(request):
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        await resp.write(b'{"choices": [], "pad": "')
        for _ in range(3):
            await resp.write(b"x" * (1 << 20))
        await resp.write(b'"}')
        return resp

    async def main():
        async with harness(n_decode=2) as h:
            for w in h.prefills + h.decodes:
                w._generate_inner = answering(lambda body: None)
            for w in h.decodes:   # the serving leg streams 3 MB
                async def gen(request, chat):
                    await request.read()
                    return await big(request)
                w._generate_inner = gen
            r = await h.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
            assert r.status_code in (502, 503) and is_openai_error(r.json(), r.status_code), r.text[:300]
            assert "1048576 bytes" in r.json()["error"]["message"]
            assert all(w.healthy for w in h.d.registry.decode)
            assert h.d.limiter.total == 0
    run(main())


@pytest.mark.parametrize("code,status", [(500, (502, 503)), (400, (400,))])
def test_a_200_carrying_an_error_is_not_passed_on_as_a_success(code, status):
    """Problem: an unstreamed 200 whose body was {"error": ...} (a worker that reports
    a failure with the wrong status) reached the client as a 200. Now it is handled
    like the same error in a stream: a 4xx code is the client's error, anything else
    the worker's."""
    async def main():
        async with harness() as h:
            use(h, lambda body: {"error": {"message": "engine said no", "code": code}})
            r = await h.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
            assert r.status_code in status and is_openai_error(r.json(), r.status_code), r.text[:300]
            assert await counted(h, "ok") == 0
            assert h.d.limiter.total == 0
    run(main())


BAD_SHAPES = [
    {"choices": "abc"},
    {"choices": [1, 2]},
    {"choices": [{"index": 0, "text": "x", "token_ids": 7}]},
    {"choices": [], "usage": "x"},
    {"choices": [], "usage": {"completion_tokens": -3}},
    {"choices": [], "usage": {"completion_tokens": "12"}},
]


@pytest.mark.parametrize("stream", [False, True])
def test_answers_of_the_wrong_shape_are_the_workers_error_not_an_internal_one(stream):
    """Problem: an answer whose choices were not a list of objects (or whose usage was
    not an object) crashed the dispatcher's token counting: 500 internal error, no
    retry on another instance, logged as a dispatcher bug. Now it is a bad answer of
    that worker (502/503 after the retry), in the OpenAI format, slot released."""
    async def main():
        async with harness(n_decode=2) as h:
            for i, bad in enumerate(BAD_SHAPES):
                if stream:
                    use(h, lambda body, bad=bad: f"data: {json.dumps(bad)}\n\ndata: [DONE]\n\n".encode())
                    status, events = await h.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
                    payload = events[0] if status != 200 else next(e for e in events if isinstance(e, dict))
                else:
                    use(h, lambda body, bad=bad: bad)
                    r = await h.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 5})
                    status, payload = r.status_code, r.json()
                assert status != 500 and is_openai_error(payload, status), (bad, status, payload)
                assert "internal" not in payload["error"]["type"], (bad, payload)
                assert h.d.limiter.total == 0
                await until(lambda: all(w.healthy for w in h.d.registry.workers), what="workers healthy")
            assert await counted(h) == len(BAD_SHAPES)
            assert await counted(h, "internal_error") == 0
    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_disconnecting_at_any_stage_releases_its_slot_and_is_counted(stream):
    """Held up: a client that goes away with its headers sent, half its body, during
    the prefill leg or while tokens come: each request is counted once (cancelled),
    its slot is released and nothing stays in flight."""
    async def main():
        async with harness(request_timeout_s=10, body_timeout_s=2,
                           worker_kw={"prefill_s": 0.4, "decode_s": 0.05}) as h:
            raw = json.dumps({"prompt": PROMPT, "max_tokens": 30, "stream": stream}).encode()
            head = post_head("/v1/completions", "sk-high-000001", len(raw))
            for n, (sent, delay) in enumerate(((head, 0), (head + raw[:10], 0), (head + raw, 0.2),
                                               (head + raw, 0.8))):
                c = await RawConn.open(h.url)
                await c.send(sent)
                await asyncio.sleep(delay + 0.05)
                c.writer.transport.abort()
                await until(lambda: h.d.limiter.total == 0, what="slot released")
                await until(lambda n=n: h.d.metrics.requests.labels("high", "cancelled")._value.get()
                            + h.d.metrics.requests.labels("-", "cancelled")._value.get() == n + 1,
                            what="request counted as cancelled")
            text = await h.metrics()
            assert metric(text, "proserve:dispatcher_in_flight") == 0
            assert metric(text, "proserve:dispatcher_requests_total") == 4
            assert all(len(p.state.queue) == 0 for p in h.d.registry.prefill)
    run(main())


def test_an_absurd_max_tokens_leaves_no_phantom_request_in_the_prefill_queue_map():
    """Problem: with the workers' max_model_len unknown (a /v1/models without it), a
    request asking max_tokens = 10**400 passed the checks, was added to the
    PrefillQueueMap, and then reserving its decode blocks overflowed (float
    division): a 500, and the request stayed in that prefill instance's queue
    model forever (each such request one more phantom, skewing every later route)."""
    async def main():
        async with harness() as h:
            for w in h.d.registry.workers:
                w.max_model_len = None
            assert h.d.registry.max_model_len is None
            r = await h.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 10 ** 400})
            assert r.status_code != 500 and is_openai_error(r.json(), r.status_code), r.text[:300]
            assert [len(p.state.queue) for p in h.d.registry.prefill] == [0]
            assert h.d.limiter.total == 0
    run(main())


def test_a_client_that_stops_reading_a_stream_ends_at_the_deadline_as_a_timeout():
    """Held up: a streaming client that reads nothing holds its slot only until the
    request's deadline. Problem found: it was then counted as 'cancelled' (client
    went away) with no request timeout counted; now it is a timeout."""
    async def main():
        async with harness(request_timeout_s=1.0, stream_queue_events=8,
                           worker_kw={"pad_bytes": 16000, "max_model_len": 100_000}) as h:
            c = await RawConn.open(h.url, rcvbuf=16384)
            try:
                raw = json.dumps({"prompt": PROMPT, "max_tokens": 3000, "stream": True}).encode()
                await c.send(post_head("/v1/completions", "sk-high-000001", len(raw)) + raw)
                await until(lambda: h.d.limiter.total == 1, what="request admitted")
                await until(lambda: h.d.limiter.total == 0, timeout=20, what="slot released at the deadline")
                text = await h.metrics()
                assert metric(text, "proserve:dispatcher_requests_total", outcome="timeout") == 1
                assert metric(text, "proserve:dispatcher_requests_total", outcome="cancelled") == 0
                assert metric(text, "proserve:dispatcher_timeouts_total", kind="request") == 1
                assert h.decodes[0].tokens_written < 3000   # the worker was held back, then cancelled
            finally:
                c.close()
    run(main())
