"""bench.loadgen: workload → arrival schedule, SSE parsing, results → Requests,
error accounting, and the HTTP client against a small fake server.

The fake server (aiohttp.web) is a test double of the HTTP/SSE protocol only:
it streams canned chunks, fails on purpose, or cuts the stream. Nothing here
stands in for an engine's scheduling; the real-engine test is
tests/test_loadgen_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from bench import loadgen as lg  # noqa: E402
from bench.traces import TraceRecord  # noqa: E402
from scheduler.config import default_classes  # noqa: E402
from scheduler.request import ConfigError, Phase, Request  # noqa: E402
from scheduler.tdg import GainConfig, summarize  # noqa: E402


def req(i=0, priority="high", arrival=0.0, prompt=10, output=4, ttft=1.0, tpot=0.1):
    return Request(f"r{i}", priority, 2.0 if priority == "high" else 1.0, ttft, tpot, arrival, prompt, output)


# --- workload and schedule ---------------------------------------------------------

def test_send_offsets_start_at_zero_and_keep_gaps():
    reqs = [req(0, arrival=5.0), req(1, arrival=5.5), req(2, arrival=7.25)]
    assert lg.send_offsets(reqs) == [0.0, 0.5, 2.25]
    assert lg.send_offsets([]) == []


def test_workload_rate_and_identical_requests_across_rates():
    a = lg.make_workload("azure", rate=2.0, num_requests=200, seed=3)
    b = lg.make_workload("azure", rate=5.0, num_requests=200, seed=3)
    off = lg.send_offsets(a)
    assert off[0] == 0.0 and all(x <= y for x, y in zip(off, off[1:]))
    assert (len(a) - 1) / off[-1] == pytest.approx(2.0)
    assert (len(b) - 1) / lg.send_offsets(b)[-1] == pytest.approx(5.0)
    # same requests (class, lengths) whatever the rate; arrivals scale by 5/2
    assert [(r.id, r.priority, r.prompt_len, r.output_len) for r in a] == \
           [(r.id, r.priority, r.prompt_len, r.output_len) for r in b]
    np.testing.assert_allclose([r.arrival * 2 for r in a], [r.arrival * 5 for r in b], rtol=1e-9, atol=1e-9)
    prios = [r.priority for r in a]
    assert 0.35 < prios.count("high") / len(prios) < 0.65
    c = lg.make_workload("azure", rate=2.0, num_requests=200, seed=4)
    assert [r.priority for r in c] != prios


def test_shape_lengths_and_context_fit():
    recs = [TraceRecord(0.0, 1000, 200), TraceRecord(1.0, 3, 1), TraceRecord(2.0, 9000, 30)]
    out = lg.shape_lengths(recs, prompt_div=4, output_div=4, max_prompt=1500)
    assert [(r.prompt_len, r.output_len) for r in out] == [(250, 50), (1, 1), (1500, 8)]
    assert [r.arrival for r in out] == [0.0, 1.0, 2.0]
    assert lg.shape_lengths(recs) == recs
    for bad in (0, -1, float("nan")):
        with pytest.raises(ConfigError):
            lg.shape_lengths(recs, prompt_div=bad)
    reqs = lg.make_workload("azure", rate=1.0, num_requests=300, prompt_div=1, output_div=1, max_model_len=2048)
    assert max(r.prompt_len + r.output_len for r in reqs) <= 2048


def test_prompt_tokens_seeded_per_request():
    a = lg.prompt_tokens(0, 7, 500, vocab=1024, low=3)
    assert a == lg.prompt_tokens(0, 7, 500, vocab=1024, low=3)
    assert len(a) == 500 and min(a) >= 3 and max(a) < 1024
    assert a != lg.prompt_tokens(0, 8, 500) and a != lg.prompt_tokens(1, 7, 500)
    assert lg.prompt_tokens(0, 7, 100) == a[:100]
    with pytest.raises(ConfigError):
        lg.prompt_tokens(0, 0, 5, vocab=3, low=3)


def test_request_body_xargs_and_class_fields():
    cfg = lg.ClientConfig("http://x", body={"temperature": 0.5, "vllm_xargs": {"extra": 1}},
                          class_body={"high": {"priority": 0, "vllm_xargs": {"ttft_slo": 0.25}}})
    b = lg.request_body(req(0, "high", output=7), [5, 6], "m", cfg, arrival_unix=123.5)
    assert b["prompt"] == [5, 6] and b["max_tokens"] == 7 and b["ignore_eos"] and b["stream"]
    assert b["return_token_ids"] is True and b["temperature"] == 0.5 and b["priority"] == 0
    assert b["vllm_xargs"] == {"priority_class": "high", "weight": 2.0, "ttft_slo": 0.25, "tpot_slo": 0.1,
                               "arrival_time": 123.5, "extra": 1}
    low = lg.request_body(req(1, "low"), [5], "m", cfg)
    assert "priority" not in low and low["vllm_xargs"]["ttft_slo"] == 1.0
    bare = lg.request_body(req(1, "low"), [5], "m", lg.ClientConfig("http://x", send_xargs=False,
                                                                   return_token_ids=False))
    assert "vllm_xargs" not in bare and "return_token_ids" not in bare
    assert lg.api_url("http://h:1/", "completions") == "http://h:1/v1/completions"
    assert lg.api_url("http://h:1/v1", "models") == "http://h:1/v1/models"


# --- SSE ------------------------------------------------------------------------------------

STREAM = (b": keep-alive comment\r\n\r\n"
          b'data: {"choices":[{"index":0,"text":"","token_ids":[1,2]}]}\r\n\r\n'
          b"event: message\n"
          b'data: {"choices":[{"index":0,\n'
          b'data: "text":"","token_ids":[3],"finish_reason":"length"}]}\n\n'
          b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n'
          b"data: [DONE]\n\n")


@pytest.mark.parametrize("piece", [1, 3, 7, len(STREAM)])
def test_sse_parser_any_split(piece):
    p = lg.SSEParser()
    events = []
    for i in range(0, len(STREAM), piece):
        events += p.feed(STREAM[i:i + piece])
    events += p.close()
    assert len(events) == 4
    assert json.loads(events[1]) == {"choices": [{"index": 0, "text": "", "token_ids": [3],
                                                  "finish_reason": "length"}]}
    assert events[-1] == "[DONE]"
    chunks = [lg.parse_chunk(e) for e in events]
    assert [c.tokens for c in chunks] == [2, 1, 0, 0]
    assert chunks[1].finish_reason == "length" and chunks[2].usage_tokens == 3 and chunks[3].done


def test_sse_parser_flushes_unterminated_event_at_close():
    p = lg.SSEParser()
    assert p.feed(b'data: {"choices":[{"index":0,"token_ids":[9]}]}') == []
    assert [lg.parse_chunk(e).tokens for e in p.close()] == [1]
    assert p.close() == []


def test_parse_chunk_cases():
    assert lg.parse_chunk("not json").malformed
    assert lg.parse_chunk("[1, 2]").malformed
    assert lg.parse_chunk('{"id": "x"}').malformed
    assert lg.parse_chunk('{"choices": 5}').malformed
    e = lg.parse_chunk('{"error": {"message": "boom", "code": 500}}')
    assert e.error == "(500) boom" and e.tokens == 0
    assert lg.parse_chunk('{"error": "plain"}').error == "plain"
    # text-only streams: one token per non-empty text chunk
    assert lg.parse_chunk('{"choices":[{"index":0,"text":"ab"}]}').tokens == 1
    assert lg.parse_chunk('{"choices":[{"index":0,"text":""}]}').tokens == 0
    assert lg.parse_chunk('{"choices":[{"index":0,"text":"ab","token_ids":null}]}').tokens == 1
    # with token ids the count is theirs, even if text is non-empty; other choices ignored
    c = lg.parse_chunk('{"choices":[{"index":0,"text":"abc","token_ids":[4,5,6]},{"index":1,"token_ids":[1]}]}')
    assert c.tokens == 3
    assert lg.parse_chunk('{"choices":[{"index":0,"text":"x","token_ids":[4,5]}]}', token_ids=False).tokens == 1


# --- results -------------------------------------------------------------------------------

def test_result_finish_rules():
    def r(**kw):
        base = dict(id="r0", priority="high", arrival=0.0, expected_tokens=3, status=200, done=True,
                    token_times=[0.1, 0.2, 0.3], usage_tokens=3)
        base.update(kw)
        return lg.Result(**base).finish()

    assert r().ok
    assert r(usage_tokens=None).ok
    assert "2 of 3" in r(token_times=[0.1, 0.2], usage_tokens=None).error
    assert "usage reports 4" in r(usage_tokens=4).error
    assert "without [DONE]" in r(done=False).error
    assert r(status=500).error == "HTTP 500"
    assert r(error="HTTP 400: bad").error == "HTTP 400: bad"


def test_to_request_and_summary_use_tdg():
    gain = GainConfig(w_p=2.0, w_d=1.0)
    q_ok, q_late, q_err, q_lost = req(0, "high", 0.0, output=3), req(1, "low", 0.0, output=3), \
        req(2, "low", 1.0, output=3), req(3, "high", 2.0, output=2)
    res = [lg.Result("r0", "high", 0.0, 3, status=200, token_times=[0.5, 0.55, 0.6], done=True).finish(),
           # TTFT 1.5 > 1.0: first token misses, later deadlines 1.1, 1.2 missed too
           lg.Result("r1", "low", 0.0, 3, status=200, token_times=[1.5, 1.6, 1.7], done=True).finish(),
           # stream cut after one on-time token
           lg.Result("r2", "low", 1.0, 3, status=200, token_times=[1.2]).finish(),
           lg.Result("r3", "high", 2.0, 2, error="ClientConnectorError: refused")]
    reqs = [q_ok, q_late, q_err, q_lost]
    conv = [lg.to_request(q, r) for q, r in zip(reqs, res)]
    assert conv[0].finished and conv[0].phase is Phase.DONE and conv[0].ttft == pytest.approx(0.5)
    assert not conv[2].finished and conv[2].error and conv[2].num_emitted == 1
    assert conv[3].phase is Phase.WAITING and conv[3].ttft is None
    s = lg.summarize_run(reqs, res, gain)
    m = s["metrics"]
    # TDG: r0 all met (2+1+1)*2 = 8; r1 0; r2 first token met 2*1 = 2; r3 0
    ideal = (2 + 2) * 2 + (2 + 2) * 1 + (2 + 2) * 1 + (2 + 1) * 2
    assert m["all"]["tdg_ratio"] == pytest.approx((8 + 2) / ideal)
    assert m["all"]["slo_attainment"] == pytest.approx(0.25)
    assert m["high"]["errors"] == 1 and m["low"]["errors"] == 1 and m["all"]["errors"] == 2
    # the same numbers summarize() gives for the converted requests
    ref = summarize(conv, gain)
    assert m["low"]["tdg_ratio"] == pytest.approx(ref["low"].tdg_ratio)
    assert s["errors"]["low"]["by_error"] == {"got 1 of 3 tokens (finish_reason=None)": 1}
    assert s["errors"]["high"]["requests"] == 2
    with pytest.raises(ValueError):
        lg.summarize_run(reqs, res[:3], gain)
    recs = lg.result_records(reqs, res, gain)
    assert [r["slo_met"] for r in recs] == [True, False, False, False]
    assert recs[3]["error"].startswith("ClientConnectorError")


def test_workload_gain_matches_simulator_choice():
    reqs = [req(0, prompt=300, output=10), req(1, prompt=100, output=30)]
    g = lg.workload_gain(reqs)
    assert g.w_p == pytest.approx(200 / 20) and g.w_d == 1.0
    assert lg.workload_gain(reqs, w_p=3.0).w_p == 3.0


def test_load_classes_overrides(tmp_path):
    c = lg.load_classes(None, ttft=0.5)
    assert c["high"].ttft_slo == 0.5 and c["high"].tpot_slo == default_classes()["high"].tpot_slo
    f = tmp_path / "c.json"
    f.write_text(json.dumps([{"name": "gold", "weight": 3, "ttft_slo": 1, "tpot_slo": 0.2}]))
    assert lg.load_classes(str(f), tpot=0.05)["gold"].tpot_slo == 0.05
    f.write_text("{")
    with pytest.raises(ConfigError):
        lg.load_classes(str(f))


# --- the HTTP client against a fake server ----------------------------------------------

class Fake:
    """An OpenAI-style /v1/completions server with scripted misbehaviour, chosen per
    request by ``vllm_xargs.mode`` (sent through --class-body in these tests)."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.received: list[float] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)

    async def models(self, request):
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def completions(self, request):
        self.received.append(time.time())
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        mode = body.get("vllm_xargs", {}).get("mode", "ok")
        n = body["max_tokens"]
        if mode == "reject":
            return web.json_response({"error": {"message": "vllm_xargs.ttft_slo must be positive",
                                                "code": 400}}, status=400)
        if mode == "hang":
            await asyncio.sleep(5)
        if mode == "block":
            time.sleep(0.2)   # blocks the event loop the client shares with this server
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(ids, finish=None):
            return ("data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": ids,
                                                        "finish_reason": finish}]}) + "\n\n").encode()

        sent = 0
        while sent < n:
            k = 2 if (mode == "multi" and n - sent >= 2) else 1
            await asyncio.sleep(0.01)
            await resp.write(chunk(list(range(sent, sent + k)), "length" if sent + k == n else None))
            sent += k
            if mode == "cut" and sent >= 2:
                return resp   # ends the stream early, no [DONE]
            if mode == "garbage" and sent == 1:
                await resp.write(b"data: {not json\n\n")
            if mode == "error_event" and sent == 1:
                await resp.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
        await resp.write(("data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}})
                          + "\n\n").encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _with_fake(coro_fn):
    fake = Fake()
    runner = web.AppRunner(fake.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return fake, await coro_fn(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def _modes(mode_by_class: dict) -> dict:
    return {c: {"vllm_xargs": {"mode": m}} for c, m in mode_by_class.items()}


def test_replay_streams_tokens_at_scheduled_times():
    reqs = [req(i, "high" if i % 2 else "low", arrival=10 + 0.15 * i, output=5) for i in range(6)]
    holder = {}

    async def go(url):
        cfg = lg.ClientConfig(url, api_key="k123", class_body=_modes({"high": "multi"}))
        holder["t_call"] = time.time()
        return await lg.replay(reqs, cfg)

    fake, run = asyncio.run(_with_fake(go))
    assert [r.id for r in run.results] == [q.id for q in reqs]
    for q, r in zip(reqs, run.results):
        assert r.ok, r.error
        assert len(r.token_times) == 5 and r.usage_tokens == 5 and r.finish_reason == "length"
        assert all(a <= b for a, b in zip(r.token_times, r.token_times[1:]))
        assert r.token_times[0] > r.sent >= r.arrival - 1e-3
        assert r.sent - r.arrival < 0.1
    # multi-token chunks: pairs of equal timestamps
    hi = run.results[1].token_times
    assert hi[0] == hi[1] and hi[2] == hi[3] and hi[3] < hi[4]
    assert run.results[0].token_times[0] < run.results[0].token_times[1]
    # bodies: model from /v1/models, arrival_time = t0 + offset, auth header
    assert {b["model"] for b in fake.bodies} == {"fake-model"}
    by_prompt_len = sorted(fake.bodies, key=lambda b: b["vllm_xargs"]["arrival_time"])
    arr = [b["vllm_xargs"]["arrival_time"] - run.t0_unix for b in by_prompt_len]
    np.testing.assert_allclose(arr, [0.15 * i for i in range(6)], atol=1e-6)
    assert all(h.get("Authorization") == "Bearer k123" for h in fake.headers)
    # sends spaced as scheduled (server clock): ~0.75 s from first to last
    span = max(fake.received) - min(fake.received)
    assert 0.6 < span < 1.2
    assert all(len(b["prompt"]) == 10 for b in fake.bodies)


def test_replay_accounts_every_failure_per_class():
    reqs = [req(0, "high", 0.0), req(1, "low", 0.0), req(2, "high", 0.05), req(3, "low", 0.05)]

    async def go(url):
        return await lg.replay(reqs, lg.ClientConfig(url, model="m", class_body=_modes({"low": "reject"})))

    _, run = asyncio.run(_with_fake(go))
    by = {r.id: r for r in run.results}
    assert by["r0"].ok and by["r2"].ok
    for rid in ("r1", "r3"):
        assert by[rid].status == 400 and by[rid].error.startswith("HTTP 400: vllm_xargs.ttft_slo")
        assert by[rid].token_times == []
    s = lg.summarize_run(reqs, run.results, GainConfig())
    assert s["errors"]["low"]["errors"] == 2 and s["errors"]["high"]["errors"] == 0
    assert s["metrics"]["low"]["slo_attainment"] == 0.0 and s["metrics"]["low"]["tdg_ratio"] == 0.0
    text = lg.format_summary(s)
    assert "errors[low]: 2× HTTP 400" in text


@pytest.mark.parametrize("mode,expect", [
    ("cut", "got 2 of 5 tokens"),
    ("error_event", "error event: (500) engine died"),
])
def test_replay_broken_streams_are_errors(mode, expect):
    reqs = [req(0, "high", 0.0, output=5)]

    async def go(url):
        return await lg.replay(reqs, lg.ClientConfig(url, model="m", class_body=_modes({"high": mode})))

    _, run = asyncio.run(_with_fake(go))
    r = run.results[0]
    assert not r.ok and expect in r.error and r.status == 200


def test_replay_malformed_line_counted_not_fatal():
    reqs = [req(0, "high", 0.0, output=3)]

    async def go(url):
        return await lg.replay(reqs, lg.ClientConfig(url, model="m", class_body=_modes({"high": "garbage"})))

    _, run = asyncio.run(_with_fake(go))
    r = run.results[0]
    assert r.ok and r.malformed == 1 and len(r.token_times) == 3
    assert lg.summarize_run(reqs, run.results, GainConfig())["malformed_chunks"] == 1


def test_replay_timeout_and_refused_connection_still_give_results():
    reqs = [req(0, "high", 0.0), req(1, "low", 0.0)]

    async def go(url):
        cfg = lg.ClientConfig(url, model="m", class_body=_modes({"high": "hang"}), request_timeout=0.5)
        return await lg.replay(reqs, cfg)

    _, run = asyncio.run(_with_fake(go))
    assert run.results[0].error.startswith("timeout after 0.5 s") and run.results[1].ok

    from pd_helpers import free_port
    dead = f"http://127.0.0.1:{free_port()}"
    run = asyncio.run(lg.replay(reqs, lg.ClientConfig(dead, model="m", start_delay=0.0)))
    assert len(run.results) == 2 and all(not r.ok and r.status is None for r in run.results)
    assert lg.error_counts(run.results)["all"]["errors"] == 2


def test_cli_writes_outputs(tmp_path):
    out = tmp_path / "run"

    async def go(url):
        # the CLI runs its own event loop: run it in a thread beside the fake server's
        return await asyncio.to_thread(lg.main, ["--url", url, "--num-requests", "6", "--rate", "20",
                                                 "--prompt-div", "50", "--output-div", "50",
                                                 "--out", str(out), "--quiet"])

    _, rc = asyncio.run(_with_fake(go))
    assert rc == 0
    lines = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(x["error"] is None and x["tokens"] == x["output_len"] for x in lines)
    s = json.loads((out / "summary.json").read_text())
    assert s["metrics"]["all"]["requests"] == 6 and s["errors"]["all"]["errors"] == 0
    assert not math.isnan(s["metrics"]["all"]["tdg_ratio"])
    assert lg.main(["--url", "http://127.0.0.1:1", "--class-body", "gold"]) == 2


def test_replay_records_client_event_loop_stalls():
    reqs = [req(0, "high", 0.0), req(1, "low", 0.3)]

    async def go(url):
        return await lg.replay(reqs, lg.ClientConfig(url, model="m", class_body=_modes({"low": "block"})))

    _, run = asyncio.run(_with_fake(go))
    assert all(r.ok for r in run.results)
    assert len(run.stalls) == 1 and 0.15 < run.stalls[0] < 0.5
    s = lg.summarize_run(reqs, run.results, GainConfig(), run.stalls)
    assert s["client_stalls"]["count"] == 1 and s["client_stalls"]["max_s"] == run.stalls[0]
    assert "event-loop stalls > 50.0 ms: 1" in lg.format_summary(s)
    assert lg.summarize_run(reqs, run.results, GainConfig())["client_stalls"]["count"] == 0
