"""The dispatcher's defences, against fake workers (bench.fake_worker) and raw
sockets: what clients may send (key before body, body size and time limits,
header timeout, concurrency limits, every error in the OpenAI format), what a
slow client does to the dispatcher (bounded stream queues, back-pressure), and
how it tells a slow worker from a dead one (per-request timeouts, health
probes that a busy worker passes, rejoining), KV transfer ids per attempt, the
KV fallback, cancelling upstream work of clients that went away, and the key
the dispatcher sends the workers.

Timeouts in these tests are small (0.3-2 s) to keep them short; the asserts
are on what the dispatcher decided and counted, never on how fast this host is
(every wait is bounded, and "before X happened" is checked by ordering).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re

import aiohttp
import pytest
from dispatcher_helpers import RawConn, harness, metric, post_head, run, until

from proserve.dispatcher import errors as errors_mod
from proserve.dispatcher import server as server_mod
from proserve.dispatcher.config import (
    ConfigError,
    DecodeSpec,
    DispatcherConfig,
    PrefillSpec,
    config_from_dict,
)
from proserve.dispatcher.errors import ApiError
from proserve.dispatcher.limits import ConcurrencyLimiter

PROMPT = list(range(1, 41))
KEY = "sk-high-000001"
LOW_KEY = "sk-low-0000001"
XFER_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")   # what the workers accept


def body(**kw):
    return {"prompt": PROMPT, "max_tokens": 5, **kw}


def now_metric(h, name: str, **labels) -> float:
    """A metric's current value, read synchronously (for until())."""
    return metric(h.d.metrics.render(h.d.registry).decode(), name, **labels)


def sse_events(raw: bytes) -> list:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def is_openai_error(payload: dict, status: int) -> bool:
    err = payload.get("error")
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] and err["code"] in (status, err["code"]))


# -- what clients may send -------------------------------------------------------------------------
def test_key_is_checked_before_the_body_is_read():
    """A client without a valid key announcing a 40 MB body gets its 401 although it sent
    none of the body: the dispatcher did not wait for (or read) it."""
    async def go():
        async with harness() as h:
            for key, code in ((None, "missing_api_key"), ("sk-wrong-0000", "invalid_api_key")):
                c = await RawConn.open(h.url)
                await c.send(post_head("/v1/completions", key, length=40 * 1024 * 1024))
                await c.send(b'{"prompt": [' + b"1, " * 1000)          # a little of it, never the rest
                status, headers, raw = await c.response()
                c.close()
                assert status == 401 and json.loads(raw)["error"]["code"] == code
                assert headers.get("connection") == "close"   # the rest of the body is not read
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_rejected_total", reason="auth") == 2
            assert h.prefills[0].received == []
    run(go())


def test_model_list_needs_a_client_key():
    """/v1/models is behind the client keys, as vLLM's own (only /health and /metrics are open)."""
    async def go():
        async with harness() as h:
            for key, code in ((None, "missing_api_key"), ("sk-wrong-0000", "invalid_api_key")):
                headers = {"authorization": f"Bearer {key}"} if key else {}
                r = await h.http.get("/v1/models", headers=headers)
                assert r.status_code == 401 and is_openai_error(r.json(), 401)
                assert r.json()["error"]["code"] == code
            r = await h.http.get("/v1/models", headers={"authorization": "Bearer sk-low-0000001"})
            assert r.status_code == 200 and r.json()["object"] == "list"
            assert (await h.http.get("/health")).status_code == 200
    run(go())


def test_body_over_the_limit_by_content_length_is_refused_unread():
    async def go():
        async with harness(max_body_mb=0.1) as h:
            c = await RawConn.open(h.url)
            await c.send(post_head("/v1/completions", KEY, length=10 * 1024 * 1024))   # no body at all
            status, _, raw = await c.response()
            c.close()
            err = json.loads(raw)["error"]
            assert status == 413 and err["code"] == "body_too_large" and "0.1 MB" in err["message"]
            assert metric(await h.metrics(), "proserve:dispatcher_rejected_total", reason="body_too_large") == 1
            # a body under the limit is served
            r = await h.post("/v1/completions", body())
            assert r.status_code == 200, r.text
    run(go())


def test_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    """A chunked upload that never ends gets its 413 once it passed the limit."""
    async def go():
        async with harness(max_body_mb=0.1) as h:   # ~105 kB
            c = await RawConn.open(h.url)
            await c.send(post_head("/v1/completions", KEY, chunked=True))
            piece = b"x" * 16384
            for _ in range(20):                      # 320 kB, and never the final 0-size chunk
                await c.send(b"%x\r\n%s\r\n" % (len(piece), piece))
            status, _, raw = await c.response()
            c.close()
            assert status == 413 and json.loads(raw)["error"]["code"] == "body_too_large"
    run(go())


def test_a_body_that_stops_arriving_gets_408():
    async def go():
        async with harness(body_timeout_s=0.5) as h:
            c = await RawConn.open(h.url)
            await c.send(post_head("/v1/completions", KEY, length=1000) + b'{"prompt": [1, 2')
            status, headers, raw = await c.response()
            c.close()
            err = json.loads(raw)["error"]
            assert status == 408 and err["code"] == "body_timeout" and is_openai_error(json.loads(raw), 408)
            assert headers.get("connection") == "close"
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_rejected_total", reason="body_timeout") == 1
            assert metric(m, "proserve:dispatcher_timeouts_total", kind="body") == 1
            assert h.d.limiter.total == 0        # its slot was given back
    run(go())


@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_a_connection_that_does_not_finish_its_headers_is_closed(impl):
    async def go():
        async with harness(header_timeout_s=0.5, uvicorn_kw={"http_impl": impl}) as h:
            slow = await RawConn.open(h.url)
            await slow.send(b"POST /v1/compl")          # half a request line, then nothing
            idle = await RawConn.open(h.url)            # nothing at all
            assert await slow.closed_by_peer(10) and await idle.closed_by_peer(10)
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_rejected_total", reason="header_timeout") == 2
            assert metric(m, "proserve:dispatcher_timeouts_total", kind="header") == 2
            # a keep-alive connection that completed a request is not cut by the header timer
            ok = await RawConn.open(h.url)
            payload = json.dumps(body()).encode()
            for _ in range(2):
                await ok.send(post_head("/v1/completions", KEY, length=len(payload)) + payload)
                status, _, raw = await ok.response()
                assert status == 200, raw
                await asyncio.sleep(1.0)                # idle longer than the header timeout
            ok.close()
            # uvicorn's own 400 for a malformed request is JSON too
            bad = await RawConn.open(h.url)
            await bad.send(b"NOT HTTP AT ALL\r\n\r\n")
            status, _, raw = await bad.response()
            bad.close()
            assert status == 400 and is_openai_error(json.loads(raw), 400)
    run(go())


def test_concurrency_limits_per_key_and_overall_answer_429_and_free_slots_at_the_end():
    async def go():
        async with harness(max_concurrent=3, max_concurrent_per_key=2, worker_kw={"decode_s": 0.05}) as h:
            lim = h.d.limiter
            # two long streams of client "acme" (streams hold their slot until they end)
            streams = []
            for _ in range(2):
                cm = h.http.stream("POST", "/v1/completions", json=body(max_tokens=400, stream=True),
                                   headers={"authorization": f"Bearer {KEY}"})
                r = await cm.__aenter__()
                assert r.status_code == 200
                streams.append((cm, r))
            assert lim.per_client == {"acme": 2} and lim.total == 2
            r = await h.post("/v1/completions", body())
            err = r.json()["error"]
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert err["type"] == "rate_limit_error" and err["code"] == "too_many_concurrent_requests_for_key"
            assert err["param"] is None
            # another client still gets in, up to the overall limit
            cm3 = h.http.stream("POST", "/v1/completions", json=body(max_tokens=400, stream=True),
                                headers={"authorization": f"Bearer {LOW_KEY}"})
            r3 = await cm3.__aenter__()
            assert r3.status_code == 200 and lim.total == 3
            r = await h.post("/v1/completions", body(), key=LOW_KEY)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_concurrent_requests"
            assert r.headers["retry-after"] == "1"
            # clients going away mid-stream give their slots back
            for cm, _ in [*streams, (cm3, r3)]:
                await cm.__aexit__(None, None, None)
            await until(lambda: lim.total == 0, what="the slots to be released")
            assert lim.per_client == {}
            r = await h.post("/v1/completions", body())
            assert r.status_code == 200
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_rejected_total", reason="client_overloaded") == 1
            assert metric(m, "proserve:dispatcher_rejected_total", reason="overloaded") == 1
            await until(lambda: now_metric(h, "proserve:dispatcher_requests_in_flight") == 0,
                        what="in_flight to drop")
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="cancelled") == 3
    run(go())


def test_limiter_counts_are_exact():
    lim = ConcurrencyLimiter(max_total=3, max_per_client=2)
    a, b = lim.acquire("a"), lim.acquire("a")
    with pytest.raises(ApiError) as e:
        lim.acquire("a")
    assert e.value.status == 429 and e.value.code == "too_many_concurrent_requests_for_key"
    c = lim.acquire(None)       # open access: only the overall limit
    with pytest.raises(ApiError) as e:
        lim.acquire("b")
    assert e.value.code == "too_many_concurrent_requests"
    a.release()
    a.release()                 # idempotent
    assert lim.total == 2 and lim.per_client == {"a": 1}
    b.release()
    c.release()
    assert lim.total == 0 and lim.per_client == {}


def test_every_error_is_openai_json():
    async def go():
        async with harness() as h:
            cases = [
                (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
                (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400, "nested too deeply"),
                (b"[1, 2]", 400, "must be a JSON object"),
                (b'"text"', 400, "must be a JSON object"),
                (b"\xff\xfe garbage", 400, "not valid JSON"),
            ]
            for raw, status, msg in cases:
                r = await h.post("/v1/completions", None, raw=raw)
                assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
                assert is_openai_error(r.json(), status) and msg in r.json()["error"]["message"]
            r = await h.http.get("/v1/nope")
            assert r.status_code == 404 and is_openai_error(r.json(), 404)
            r = await h.post("/v1/completions/extra", body())
            assert r.status_code == 404 and is_openai_error(r.json(), 404)
            r = await h.http.get("/v1/completions")
            assert r.status_code == 405 and is_openai_error(r.json(), 405)
            # a body that parsed but is too deep for the checks after (RecursionError there): 400 too
            real_admit = h.d.admit

            async def too_deep(*a):
                raise RecursionError("maximum recursion depth exceeded")
            h.d.admit = too_deep
            r = await h.post("/v1/completions", body())
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
            h.d.admit = real_admit
            # the dispatcher still serves
            assert (await h.post("/v1/completions", body())).status_code == 200
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_rejected_total", reason="bad_json") == 3   # unparsable ones
    run(go())


def test_an_unexpected_exception_is_a_500_json_and_the_request_is_accounted_for():
    async def go():
        async with harness() as h:
            real = h.d.count_tokens
            calls = {"n": 0}

            def boom(job, t, chunk):
                calls["n"] += 1
                if calls["n"] == fail_at:
                    raise RuntimeError("bug")
                real(job, t, chunk)
            h.d.count_tokens = boom
            fail_at = 1                                  # unstreamed: before the response
            r = await h.post("/v1/completions", body())
            assert r.status_code == 500 and is_openai_error(r.json(), 500)
            assert "RuntimeError" in r.json()["error"]["message"]
            calls["n"], fail_at = 0, 3                   # streamed: after two chunks went out
            status, ev = await h.stream("/v1/completions", body())
            assert status == 200 and ev[-2]["error"]["code"] == 500 and ev[-1] == "[DONE]"
            h.d.count_tokens = real
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="internal_error") == 2
            assert h.d.limiter.total == 0 and now_metric(h, "proserve:dispatcher_requests_in_flight") == 0
            assert (await h.post("/v1/completions", body())).status_code == 200
    run(go())


# -- slow clients ----------------------------------------------------------------------------------
def test_a_client_that_reads_nothing_does_not_grow_the_stream_queue():
    """The worker streams ~48 MB; the client reads nothing for a while. The dispatcher's
    queue for that stream stays within stream_queue_events (the read from the worker
    waits: back-pressure), and the client still gets the whole stream afterwards."""
    n_tokens, pad = 3000, 16000

    async def go():
        async with harness(stream_queue_events=8, worker_kw={"pad_bytes": pad, "max_model_len": 100_000}) as h:
            dw = h.decodes[0]
            c = await RawConn.open(h.url, rcvbuf=16384)
            payload = json.dumps(body(max_tokens=n_tokens, stream=True)).encode()
            await c.send(post_head("/v1/completions", KEY, length=len(payload)) + payload)
            M = h.d.metrics
            await until(lambda: now_metric(h, "proserve:dispatcher_stream_backpressure_total") > 0,
                        what="the stream queue to fill up")
            # the worker is held back too (TCP back-pressure, once the socket buffers are full):
            # it stops writing long before the end of its stream
            samples = [dw.tokens_written]
            for _ in range(60):
                await asyncio.sleep(0.3)
                samples.append(dw.tokens_written)
                if len(samples) >= 3 and samples[-1] == samples[-2] == samples[-3]:
                    break
            assert samples[-1] == samples[-2] == samples[-3] < n_tokens, samples
            assert M.stream_queue_peak <= 8
            status, _, raw = await c.response(timeout=60)
            c.close()
            ev = sse_events(raw)
            assert status == 200 and ev[-1] == "[DONE]" and len(ev) == n_tokens + 1
            assert "".join(e["choices"][0]["text"] for e in ev[:-1]).split() == [f"t{i}" for i in range(1, n_tokens + 1)]
            assert M.stream_queue_peak <= 8
            assert metric(await h.metrics(), "proserve:dispatcher_stream_queue_peak_events") <= 8
    run(go())


def test_an_unstreamed_answer_holds_its_slot_until_the_client_has_it():
    """A ~16 MB unstreamed answer to a client that reads nothing for a while: the request
    is done upstream, but its slot (and the answer's memory) stays counted until the
    client has read it."""
    async def go():
        async with harness(worker_kw={"pad_bytes": 16000, "max_model_len": 100_000}) as h:
            c = await RawConn.open(h.url, rcvbuf=16384)
            try:
                payload = json.dumps(body(max_tokens=1000)).encode()
                await c.send(post_head("/v1/completions", KEY, length=len(payload)) + payload)
                await until(lambda: now_metric(h, "proserve:dispatcher_requests_total", outcome="ok") == 1,
                            timeout=30, what="the request to end upstream")
                await asyncio.sleep(0.5)
                assert h.d.limiter.total == 1, "the slot was given back before the answer was written"
                status, _, raw = await c.response(timeout=60)
                assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 1000
                await until(lambda: h.d.limiter.total == 0, what="the slot to be given back")
            finally:
                c.close()
    run(go())


def test_an_unstreamed_answer_nobody_reads_gives_its_slot_back_at_the_deadline(monkeypatch):
    from proserve.dispatcher import server
    monkeypatch.setattr(server, "ANSWER_WRITE_GRACE_S", 0.5)

    async def go():
        async with harness(request_timeout_s=3.0, worker_kw={"pad_bytes": 16000, "max_model_len": 100_000}) as h:
            c = await RawConn.open(h.url, rcvbuf=16384)
            try:
                payload = json.dumps(body(max_tokens=1000)).encode()
                await c.send(post_head("/v1/completions", KEY, length=len(payload)) + payload)
                await until(lambda: h.d.limiter.total == 1, what="the request to be admitted")
                await until(lambda: h.d.limiter.total == 0, timeout=20, what="the slot back at the deadline")
                with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                    await c.response(timeout=20)          # the connection was closed mid-answer
            finally:
                c.close()
    run(go())


def test_shutdown_does_not_wait_forever_for_a_stalled_client():
    """uvicorn waits for open responses on shutdown: a client that reads nothing must not
    keep the dispatcher from stopping (shutdown_timeout_s)."""
    async def go():
        cm = harness(shutdown_timeout_s=1.0, worker_kw={"pad_bytes": 16000, "max_model_len": 100_000})
        h = await cm.__aenter__()
        c = await RawConn.open(h.url, rcvbuf=16384)
        try:
            payload = json.dumps(body(max_tokens=3000, stream=True)).encode()
            await c.send(post_head("/v1/completions", KEY, length=len(payload)) + payload)
            await until(lambda: now_metric(h, "proserve:dispatcher_stream_backpressure_total") > 0,
                        what="the stream to stall")
            await asyncio.wait_for(cm.__aexit__(None, None, None), 20)   # returns: shutdown ended
        finally:
            c.close()
    run(go())


# -- a slow worker is not a dead one ---------------------------------------------------------------
def test_a_long_unstreamed_request_neither_fails_nor_takes_its_worker_down():
    """An unstreamed answer that takes longer than the stream idle timeout is fine (only the
    request's total timeout applies to it), and a stream on the same worker is not cut."""
    async def go():
        async with harness(stream_idle_timeout_s=0.5, worker_kw={"decode_s": 0.05}) as h:
            unstreamed = asyncio.create_task(h.post("/v1/completions", body(max_tokens=30)))   # ~1.5 s silent
            streamed = asyncio.create_task(h.stream("/v1/completions", body(max_tokens=40)))
            r = await asyncio.wait_for(unstreamed, 30)
            status, ev = await asyncio.wait_for(streamed, 30)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 30
            assert status == 200 and ev[-1] == "[DONE]" and len(ev) == 41 and "error" not in ev[-2]
            assert h.d.registry.decode[0].healthy
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_retries_total") == 0
            assert metric(m, "proserve:dispatcher_timeouts_total") == 0
    run(go())


def test_a_stream_that_goes_silent_ends_with_504_and_its_worker_stays():
    async def go():
        async with harness(stream_idle_timeout_s=0.5) as h:
            dw = h.decodes[0]
            dw.fail, dw.fail_after_tokens = "stall", 3            # silent after 3 tokens, /health fine
            status, ev = await h.stream("/v1/completions", body(max_tokens=10))
            assert status == 200 and [e["choices"][0]["text"] for e in ev[:3]] == [" t1", " t2", " t3"]
            assert ev[3]["error"]["code"] == 504 and ev[-1] == "[DONE]"
            assert h.d.registry.decode[0].healthy                 # slow is not dead
            dw.fail = None
            assert (await h.post("/v1/completions", body())).status_code == 200
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_timeouts_total", kind="stream_idle") == 1
            assert metric(m, "proserve:dispatcher_requests_total", outcome="timeout") == 1
    run(go())


def test_a_stream_silent_before_its_first_token_is_retried_elsewhere():
    async def go():
        async with harness(n_decode=2, global_policy="round_robin", stream_idle_timeout_s=0.5) as h:
            h.decodes[0].fail = "stall"                           # answers nothing at all
            h.decodes[1].fail = "stall"
            status, ev = await h.stream("/v1/completions", body())
            # both attempts timed out: a 504 (not 502), and both workers stay in service
            assert status == 504 and "failed on two instances" in ev[0]["error"]["message"]
            assert all(w.healthy for w in h.d.registry.decode)
            h.decodes[1].fail = None
            for _ in range(2):      # whichever it starts on, the request ends on the working one
                status, ev = await h.stream("/v1/completions", body())
                assert status == 200 and ev[-1] == "[DONE]" and "error" not in ev[-2]
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_retries_total", role="decode") >= 2
            assert all(w.healthy for w in h.d.registry.decode)
    run(go())


def test_slow_metrics_and_health_do_not_take_a_progressing_worker_down():
    async def go():
        async with harness(health_timeout_s=0.3, health_failures=2, worker_kw={"decode_s": 0.05}) as h:
            dw, d0 = h.decodes[0], h.d.registry.decode[0]
            down = []
            real_mark_down = d0.mark_down
            d0.mark_down = lambda why: (down.append(why), real_mark_down(why))
            # a busy worker: /metrics answers after 2 s (every scrape times out)...
            dw.metrics_delay_s = 2.0
            status, ev = await h.stream("/v1/completions", body(max_tokens=40))
            assert status == 200 and len(ev) == 41 and "error" not in ev[-2]
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_scrape_failures_total", instance="d0", reason="timeout") >= 1
            assert d0.healthy and down == []
            # ...and /health as well, while a stream delivers tokens
            dw.health_delay_s = 2.0
            status, ev = await h.stream("/v1/completions", body(max_tokens=60))
            assert status == 200 and len(ev) == 61 and "error" not in ev[-2]
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_health_checks_total", instance="d0",
                          result="timeout_progressing") >= 1
            assert down == []
            # idle (nothing progressing), a /health that times out is a failure: out after 2
            await until(lambda: not d0.healthy, what="the idle, unresponsive worker to leave")
            assert metric(await h.metrics(), "proserve:dispatcher_health_checks_total", instance="d0",
                          result="timeout") >= 2
            # and it rejoins once /health answers again
            dw.health_delay_s = dw.metrics_delay_s = 0.0
            await until(lambda: d0.healthy, what="the worker to rejoin")
            assert (await h.post("/v1/completions", body())).status_code == 200
    run(go())


def test_one_broken_connection_does_not_take_a_healthy_worker_down():
    """A connection that breaks under one request (a keep-alive race does this to a healthy
    worker) fails that request, not the worker: its other streams go on, it stays in the
    set, and it is checked at once (the soak benchmark found a healthy decode worker taken
    down, every stream on it cut, by one reset connection)."""
    async def go():
        async with harness(colocated=True, worker_kw={"decode_s": 0.02}) as h:
            w, p0 = h.prefills[0], h.d.registry.prefill[0]
            long = asyncio.ensure_future(h.stream("/v1/completions", body(max_tokens=100)))
            await until(lambda: w.tokens_written >= 5, what="the stream to be under way")
            w.drop_next = 1
            r = await h.post("/v1/completions", body(max_tokens=4))
            assert r.status_code in (502, 503) and r.json()["error"]["message"]
            status, ev = await long
            assert status == 200 and len(ev) == 101 and "error" not in ev[-2], ev[-2:]
            assert p0.healthy
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_broken_connections_total", instance="p0") == 1
            assert (await h.post("/v1/completions", body())).status_code == 200
    run(go())


def test_only_a_connect_the_worker_failed_takes_it_out():
    """Refused, unreachable or timed-out connects take a worker out; a broken established
    connection or this host's own shortage (EMFILE: out of file descriptors, which would
    hit every worker at once) only fails the request."""
    from types import SimpleNamespace

    from proserve.dispatcher.server import _unreachable
    key = SimpleNamespace(host="127.0.0.1", port=1, ssl=None)

    def connect_error(code):
        return aiohttp.ClientConnectorError(key, OSError(code, os.strerror(code)))

    assert _unreachable(connect_error(errno.ECONNREFUSED))
    assert _unreachable(connect_error(errno.EHOSTUNREACH))
    assert _unreachable(aiohttp.ConnectionTimeoutError("connect timed out"))
    assert not _unreachable(connect_error(errno.EMFILE))
    assert not _unreachable(connect_error(errno.EADDRNOTAVAIL))
    assert not _unreachable(aiohttp.ServerDisconnectedError())
    assert not _unreachable(aiohttp.ClientOSError(errno.ECONNRESET, "reset"))


def test_a_worker_that_restarts_rejoins_and_serves():
    async def go():
        async with harness() as h:
            dw, d0 = h.decodes[0], h.d.registry.decode[0]
            await dw.stop()
            await until(lambda: not d0.healthy, what="the stopped worker to leave")
            assert (await h.post("/v1/completions", body())).status_code == 503
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_health_checks_total", instance="d0", result="refused") >= 1
            await dw.start()                                     # same port
            await until(lambda: d0.healthy, what="the restarted worker to rejoin")
            r = await h.post("/v1/completions", body())
            assert r.status_code == 200 and len(dw.received) == 1
    run(go())


# -- KV transfers -----------------------------------------------------------------------------------
def test_each_attempt_gets_its_own_kv_transfer_id():
    async def go():
        async with harness(n_decode=2, global_policy="round_robin") as h:
            h.decodes[0].fail = "500"
            h.decodes[1].fail = "500"
            r = await h.post("/v1/completions", body())
            assert r.status_code == 502
            ids = [b["kv_transfer_params"]["xfer_id"] for b in h.prefills[0].received]
            got = [b["kv_transfer_params"]["xfer_id"] for w in h.decodes for b in w.received]
            rid = r.headers.get("x-request-id")
            assert len(ids) == 2 and ids[0] != ids[1] and sorted(got) == sorted(ids)
            assert all(XFER_ID.match(x) for x in ids)
            assert rid is None or all(x.startswith(rid) for x in ids)
    run(go())


def test_a_failed_kv_push_sends_the_decode_leg_without_kv():
    async def go():
        # d0 has far more free blocks: the router picks it
        async with harness(n_decode=2, worker_kw={"num_blocks": 1000}) as h:
            h.decodes[1].num_blocks = 10
            await h.d.registry.check_all()
            pw = h.prefills[0]
            d0, d1 = h.decodes
            # the destination itself failed: the decode leg goes to the other decode worker
            pw.kv_error, pw.kv_failed_dest = "push to tcp://127.0.0.1:16000 timed out", "tcp://127.0.0.1:16000"
            status, ev = await h.stream("/v1/completions", body())
            assert status == 200 and ev[-1] == "[DONE]" and "error" not in ev[-2]
            assert d0.received == [] and len(d1.received) == 1 and "kv_transfer_params" not in d1.received[0]
            # the push failed for another reason: same decode worker, without KV
            pw.kv_failed_dest = None
            r = await h.post("/v1/completions", body())
            assert r.status_code == 200 and len(d0.received) == 1 and "kv_transfer_params" not in d0.received[0]
            # success again: the decode leg loads the pushed KV
            pw.kv_error = None
            r = await h.post("/v1/completions", body())
            assert r.status_code == 200 and d0.received[-1]["kv_transfer_params"]["do_remote_prefill"] is True
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_kv_fallbacks_total", decode="d0", reason="dest_failed") == 1
            assert metric(m, "proserve:dispatcher_kv_fallbacks_total", decode="d0", reason="push_failed") == 1
    run(go())


def test_a_failed_kv_push_with_no_other_decode_worker_stays_on_the_chosen_one():
    async def go():
        async with harness() as h:
            h.prefills[0].kv_error, h.prefills[0].kv_failed_dest = "refused", "tcp://127.0.0.1:16000"
            r = await h.post("/v1/completions", body())
            assert r.status_code == 200 and "kv_transfer_params" not in h.decodes[0].received[0]
            assert metric(await h.metrics(), "proserve:dispatcher_kv_fallbacks_total", reason="dest_failed") == 1
    run(go())


# -- clients that go away ---------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_its_request_upstream(stream):
    """Unstreamed (the whole answer pending), or streamed before its first token."""
    async def go():
        kw = {"decode_s": 0.1} if not stream else {"prefill_s": 30.0}
        async with harness(colocated=True, worker_kw=kw) as h:
            w = h.prefills[0]
            c = await RawConn.open(h.url)
            payload = json.dumps(body(max_tokens=100, stream=stream)).encode()    # 10 s / 30 s upstream
            await c.send(post_head("/v1/completions", KEY, length=len(payload)) + payload)
            await until(lambda: len(w.received) == 1, what="the worker to get the request")
            c.close()
            await until(lambda: w.cancelled == 1, what="the upstream call to be closed")
            await until(lambda: h.d.limiter.total == 0, what="the slot to be released")
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="cancelled") == 1
            assert now_metric(h, "proserve:dispatcher_requests_in_flight") == 0
            assert h.d.registry.prefill[0].healthy
    run(go())


# -- the dispatcher's key towards the workers ------------------------------------------------------
def test_the_worker_key_goes_with_every_upstream_call(tmp_path):
    key_file = tmp_path / "worker.key"
    key_file.write_text("  sk-worker-0001\n")

    async def go():
        async with harness(worker_kw={"require_key": "sk-worker-0001"}, worker_api_key_file=str(key_file)) as h:
            assert (await h.post("/v1/completions", body())).status_code == 200
            assert (await h.post("/v1/completions", {"prompt": "a b c", "max_tokens": 2})).status_code == 200
            assert (await h.stream("/v1/completions", body()))[0] == 200
            await asyncio.sleep(0.3)                                   # a few health checks
            for w in h.prefills + h.decodes:
                paths = {p for p, _ in w.auth_seen}
                assert {"/health", "/metrics", "/v1/models", "/v1/completions"} <= paths
                assert all(hdr == "Bearer sk-worker-0001" for _, hdr in w.auth_seen), w.auth_seen
            assert "/tokenize" in {p for p, _ in h.prefills[0].auth_seen}
    run(go())


def test_tokenize_errors_blame_the_client_only_for_its_prompt():
    """A worker's /tokenize answering 404 (no such endpoint there) or 429 (busy) is the
    worker's problem: the next worker is asked, and if none can count, 502. Only 400 / 413 /
    422 (the worker judged the prompt) are answered as the client's 400. Was: every 4xx a 400."""
    text = {"prompt": "a b c", "max_tokens": 2}

    async def go():
        async with harness(n_prefill=2, colocated=True) as h:
            h.prefills[0].tokenize_status = 404
            h.prefills[1].tokenize_status = 429
            r = await h.post("/v1/completions", text)
            assert r.status_code == 502, r.text
            msg = r.json()["error"]["message"]
            assert "count the prompt's tokens" in msg and "HTTP 404" in msg and "HTTP 429" in msg
            assert not any(w.received for w in h.prefills)             # nothing was generated
            h.prefills[0].tokenize_status = 503                        # every worker busy: 503 + Retry-After
            r = await h.post("/v1/completions", text)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "too busy" in r.json()["error"]["message"]
            h.prefills[1].tokenize_status = None                       # one worker can count: served
            for _ in range(2):                                         # whichever is asked first
                assert (await h.post("/v1/completions", text)).status_code == 200
            for bad in (400, 422):
                h.prefills[0].tokenize_status = h.prefills[1].tokenize_status = bad
                r = await h.post("/v1/completions", text)
                assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert all(w.healthy for w in h.d.registry.prefill)        # none of this is a dead worker
    run(go())


def test_a_workers_error_message_is_clipped_before_it_reaches_the_client():
    """A worker's 500 with a 5 MB message: the client's 502 names it in at most
    MAX_WORKER_MESSAGE characters per worker (was: the whole message, once per worker)."""
    async def go():
        async with harness(n_prefill=2, colocated=True) as h:
            huge = "x" * 5_000_000
            for w in h.prefills:
                w.tokenize_status, w.tokenize_message = 500, huge
            _error, limit = errors_mod.worker_error_message, errors_mod.MAX_WORKER_MESSAGE
            assert len(_error(json.dumps({"error": {"message": huge}}).encode())) == limit
            assert len(_error(json.dumps({"detail": huge}).encode())) == limit
            assert len(_error(huge.encode())) == limit
            assert _error(b'{"error": {"message": "short"}}') == "short"
            r = await h.post("/v1/completions", {"prompt": "a b c", "max_tokens": 2})
            assert r.status_code == 502 and len(r.content) < 4 * limit, r.text
    run(go())


def test_tokenize_goes_on_past_a_stopped_worker():
    """The first worker asked to count a prompt is gone (connection refused): it leaves
    the set at once and the next worker counts; the client gets its answer."""
    async def go():
        async with harness(n_prefill=2, colocated=True, health_interval_s=30) as h:   # no health check
            await h.prefills[0].stop()
            assert h.d._tokenize_rr == 0                    # so p0 is asked first
            r = await h.post("/v1/completions", {"prompt": "a b c", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert [w.healthy for w in h.d.registry.prefill] == [False, True]
            assert len(h.prefills[1].received) == 1         # and it served the request too
    run(go())


def test_a_slow_tokenize_is_bounded_and_the_next_worker_counts(monkeypatch):
    """A worker whose /tokenize does not answer within the bound: the next one counts, and
    the slow one stays in the set (slow is not dead). When every worker is that slow, the
    client gets a 502 naming both timeouts, not a wait without end."""
    monkeypatch.setattr(server_mod, "_TOKENIZE_TIMEOUT", aiohttp.ClientTimeout(total=1.0))
    text = {"prompt": "a b c", "max_tokens": 2}

    async def go():
        async with harness(n_prefill=2, colocated=True, health_interval_s=30) as h:
            h.prefills[0].tokenize_delay_s = 60
            r = await h.post("/v1/completions", text)       # p0 asked first, then p1
            assert r.status_code == 200, r.text
            assert all(w.healthy for w in h.d.registry.prefill)
            h.prefills[1].tokenize_delay_s = 60
            r = await h.post("/v1/completions", text)
            assert r.status_code == 502, r.text
            msg = r.json()["error"]["message"]
            assert msg.count("TimeoutError") == 2 and "p0" in msg and "p1" in msg, msg
            assert all(w.healthy for w in h.d.registry.prefill)
            assert len(h.prefills[0].received) + len(h.prefills[1].received) == 1   # nothing more generated
    run(go())


def test_a_worker_rejecting_the_key_is_a_configuration_error_not_the_clients(caplog):
    async def go():
        async with harness(health_interval_s=30, n_decode=1) as h:   # no health check during the test
            h.decodes[0].require_key = "sk-not-what-the-dispatcher-has"
            r = await h.post("/v1/completions", body())
            err = r.json()["error"]
            assert r.status_code == 503 and "worker key" in err["message"]        # never a 401
            assert not h.d.registry.decode[0].healthy
            # the health check says so too (and the worker rejoins once the keys agree)
            h.prefills[0].require_key = "sk-not-what-the-dispatcher-has"
            await h.d.registry.check(h.d.registry.prefill[0])
            assert not h.d.registry.prefill[0].healthy
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_health_checks_total", instance="p0", result="unauthorized") == 1
            h.prefills[0].require_key = h.decodes[0].require_key = None
            await h.d.registry.check_all()
            assert (await h.post("/v1/completions", body())).status_code == 200
    with caplog.at_level(logging.ERROR, logger="proserve.dispatcher"):
        run(go())
    assert sum("rejects the dispatcher's worker key" in r.message for r in caplog.records) == 2


def test_worker_key_sources_and_their_errors(tmp_path, monkeypatch):
    cfg = DispatcherConfig(prefill=[PrefillSpec("http://a:1")], decode=[DecodeSpec("http://b:2", "tcp://c:3")])
    monkeypatch.delenv("PROSERVE_WORKER_API_KEY", raising=False)
    assert cfg.worker_api_key() is None
    monkeypatch.setenv("PROSERVE_WORKER_API_KEY", " sk-from-env \n")
    assert cfg.worker_api_key() == "sk-from-env"
    f = tmp_path / "k"
    f.write_text("sk-from-file\n")
    cfg.worker_api_key_file = str(f)
    assert cfg.worker_api_key() == "sk-from-file"          # the file wins
    f.write_text("  \n")
    with pytest.raises(ConfigError, match=f"worker key file {f}: is empty"):
        cfg.worker_api_key()
    f.write_text("two words\n")
    with pytest.raises(ConfigError, match="one word"):
        cfg.worker_api_key()
    cfg.worker_api_key_file = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="missing: cannot read"):
        cfg.worker_api_key()


# -- configuration ---------------------------------------------------------------------------------
def test_new_config_keys_are_validated_and_named_in_errors(tmp_path):
    base = {"prefill": [{"url": "http://a:1"}], "decode": [{"url": "http://b:2", "kv_addr": "tcp://c:3"}]}
    for d, msg in [({"max_concurrent": 0}, "dispatcher.max_concurrent must be an integer >= 1"),
                   ({"max_concurrent_per_key": 1.5}, "dispatcher.max_concurrent_per_key must be an integer"),
                   ({"max_body_mb": -1}, "dispatcher.max_body_mb must be a number > 0"),
                   ({"stream_idle_timeout_s": "60"}, "dispatcher.stream_idle_timeout_s must be a number > 0"),
                   ({"header_timeout_s": 0}, "dispatcher.header_timeout_s"),
                   ({"body_timeout_s": float("inf")}, "dispatcher.body_timeout_s"),
                   ({"health_timeout_s": True}, "dispatcher.health_timeout_s"),
                   ({"stream_queue_events": 0}, "dispatcher.stream_queue_events"),
                   ({"shutdown_timeout_s": -1}, "dispatcher.shutdown_timeout_s"),
                   ({"worker_api_key_file": 3}, "dispatcher.worker_api_key_file must be a file path"),
                   ({"idle_timeout_s": 60}, "dispatcher.idle_timeout_s is now called stream_idle_timeout_s")]:
        with pytest.raises(ConfigError) as e:
            config_from_dict({**base, "dispatcher": d}, "c.toml").validate("c.toml")
        assert msg in str(e.value) and "c.toml" in str(e.value), (d, str(e.value))
    (tmp_path / "c.toml").write_text('[dispatcher]\nworker_api_key_file = "keys/w.key"\n')
    from proserve.dispatcher.config import load_config
    assert load_config(tmp_path / "c.toml").worker_api_key_file == str(tmp_path / "keys" / "w.key")


def test_cli_flags_set_the_new_knobs(tmp_path):
    from proserve.dispatcher.cli import build_parser, config_from_args
    args = build_parser().parse_args([
        "--prefill", "http://a:1", "--decode", "http://b:2=tcp://c:3", "--max-body-mb", "2",
        "--max-concurrent", "10", "--max-concurrent-per-key", "3", "--stream-idle-timeout", "7",
        "--request-timeout", "70", "--header-timeout", "4", "--body-timeout", "5", "--health-timeout", "6",
        "--worker-key-file", str(tmp_path / "w.key"), "--shutdown-timeout", "8"])
    cfg = config_from_args(args)
    assert (cfg.max_body_mb, cfg.max_concurrent, cfg.max_concurrent_per_key, cfg.stream_idle_timeout_s,
            cfg.request_timeout_s, cfg.header_timeout_s, cfg.body_timeout_s, cfg.health_timeout_s,
            cfg.worker_api_key_file, cfg.shutdown_timeout_s) == (2, 10, 3, 7, 70, 4, 5, 6, str(tmp_path / "w.key"), 8)
    d = DispatcherConfig()
    assert (d.max_concurrent, d.max_concurrent_per_key, d.stream_idle_timeout_s, d.request_timeout_s,
            d.max_body_mb, d.shutdown_timeout_s) == (1024, 256, 60.0, 600.0, 16.0, 30.0)


def test_cli_names_a_missing_worker_key_file(tmp_path):
    import subprocess
    import sys
    missing = tmp_path / "nope.key"
    p = subprocess.run([sys.executable, "-m", "proserve.dispatcher", "--prefill", "http://a:1", "--decode",
                        "http://b:2=tcp://c:3", "--worker-key-file", str(missing)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2 and f"worker key file {missing}: cannot read" in p.stderr, p.stderr
