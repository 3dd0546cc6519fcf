"""bench.loadgen: workload → arrival schedule, SSE parsing, results → Requests,
error accounting, the HTTP client against a small fake server (and, for
``--api proserve``, against the real dispatcher in front of bench.fake_worker),
the report (records → summary, plots), progress and argument errors.

The fake server (aiohttp.web) is a test double of the HTTP/SSE protocol only:
it streams canned chunks, fails on purpose, or cuts the stream. Nothing here
stands in for an engine's scheduling; the real-engine test is
tests/test_loadgen_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import numpy as np
import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from proserve.bench import loadgen as lg  # noqa: E402
from proserve.bench.traces import TraceRecord  # noqa: E402
from proserve.scheduler.config import default_classes  # noqa: E402
from proserve.scheduler.request import ConfigError, Phase, Request  # noqa: E402
from proserve.scheduler.tdg import GainConfig, summarize  # noqa: E402


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
            return web.json_response({"error": {"message": "vllm_xargs.ttft_slo must be a number > 0, got -1",
                                                "code": 400}}, status=400)
        if mode == "hang":
            await asyncio.sleep(5)
        if mode == "block":
            time.sleep(0.2)   # blocks the event loop the client shares with this server
        if body.get("stream") is False:
            await asyncio.sleep(0.01 * n)
            choice = {"index": 0, "text": "", "finish_reason": "length"}
            if mode != "usage_only":
                choice["token_ids"] = list(range(n))
            usage = {"completion_tokens": n + (1 if mode == "bad_usage" else 0)}
            return web.json_response({"choices": [choice], "usage": usage})
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
        # when the refusal's status line came, on the run clock (its latency: responded - sent)
        assert by[rid].sent <= by[rid].responded
    assert by["r0"].sent <= by["r0"].responded <= by["r0"].token_times[0]
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
    # the server's 0.2 s block is recorded (a busy host may add stalls of its own: not counted on)
    assert any(x >= 0.15 for x in run.stalls), run.stalls
    s = lg.summarize_run(reqs, run.results, GainConfig(), run.stalls)
    assert s["client_stalls"]["count"] == len(run.stalls) and s["client_stalls"]["max_s"] == max(run.stalls)
    assert f"event-loop stalls > 50.0 ms: {len(run.stalls)}" in lg.format_summary(s)
    assert lg.summarize_run(reqs, run.results, GainConfig())["client_stalls"]["count"] == 0


# --- the proserve API, arrivals, unstreamed requests, reports ---------------------------

def test_request_body_proserve_fields_and_unstreamed():
    cfg = lg.ClientConfig("http://x", api="proserve", class_keys={"high": "sk-high-000001"},
                          api_key="sk-any-00000001", class_body={"low": {"top_k": 3}})
    hi = lg.request_body(req(0, "high", ttft=0.5, tpot=0.05), [5, 6], "m", cfg, arrival_unix=1.0)
    assert hi["priority"] == "high" and hi["slo"] == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert "vllm_xargs" not in hi and hi["return_token_ids"] is True
    assert hi["stream"] is True and hi["stream_options"] == {"include_usage": True}
    lo = lg.request_body(req(1, "low"), [5], "m", cfg, stream=False)
    assert lo["stream"] is False and "stream_options" not in lo and lo["top_k"] == 3
    assert lo["priority"] == "low" and lo["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 100.0}
    # vLLM API, unstreamed: still the xargs, no stream_options (vLLM rejects them unstreamed)
    v = lg.request_body(req(1, "low"), [5], "m", lg.ClientConfig("http://x"), stream=False)
    assert v["stream"] is False and "stream_options" not in v and v["vllm_xargs"]["priority_class"] == "low"
    assert "priority" not in v and "slo" not in v
    # keys: the class's own, else --api-key; vllm sends --api-key only
    assert cfg.headers_for("high")["Authorization"] == "Bearer sk-high-000001"
    assert cfg.headers_for("low")["Authorization"] == "Bearer sk-any-00000001"
    assert "Authorization" not in lg.ClientConfig("http://x").headers_for("high")


def test_keys_file_and_missing_class_key(tmp_path):
    toml = tmp_path / "keys.toml"
    toml.write_text('[[keys]]\nkey = "sk-high-000001"\nclient = "acme"\nclass = "high"\nttft_ms = [100, 10000]\n'
                    '[[keys]]\nkey = "sk-high-000002"\nclient = "other"\nclass = "high"\n'
                    '[[keys]]\nkey = "sk-low-0000001"\nclient = "batchco"\nclass = "low"\n')
    assert lg.read_keys_file(toml) == {"high": "sk-high-000001", "low": "sk-low-0000001"}
    js = tmp_path / "keys.json"
    js.write_text(json.dumps({"keys": [{"key": "sk-low-0000009", "client": "b", "class": "low"}]}))
    assert lg.read_keys_file(js) == {"low": "sk-low-0000009"}
    # --class-key wins over the file
    assert lg.parse_class_keys(["low=sk-mine"], str(toml)) == {"high": "sk-high-000001", "low": "sk-mine"}
    for text, msg in (("[[keys]]\nkey = 'x'\n", "keys[0] needs a string 'key' and a string 'class'"),
                      ("keys = [", "not valid TOML"), ("a = 1\n", "needs a non-empty list 'keys'")):
        toml.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(msg)) as e:
            lg.read_keys_file(toml)
        assert str(e.value).startswith(f"--keys {toml}")
    with pytest.raises(ConfigError, match="cannot read"):
        lg.read_keys_file(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="--class-key expects CLASS=KEY"):
        lg.parse_class_keys(["high"])
    # every class of the workload needs a key, named in the message
    cfg = lg.ClientConfig("http://x", api="proserve", class_keys={"high": "sk-high-000001"})
    cfg.check(["high"])
    with pytest.raises(ConfigError, match=r"no API key for class\(es\) 'low'.*--class-key"):
        cfg.check(["high", "low"])
    lg.ClientConfig("http://x", api="proserve", api_key="anything").check(["high", "low"])
    with pytest.raises(ConfigError, match="--class-key/--keys apply only to --api proserve"):
        lg.ClientConfig("http://x", class_keys={"high": "k"}).check(["high"])
    with pytest.raises(ConfigError, match="--no-xargs applies only to --api vllm"):
        lg.ClientConfig("http://x", api="proserve", api_key="k", send_xargs=False).check(["high"])


def test_poisson_arrivals_seeded_with_trace_lengths():
    a = lg.make_workload("azure", rate=5.0, num_requests=600, seed=1, arrivals="poisson")
    trace = lg.make_workload("azure", rate=5.0, num_requests=600, seed=1)
    gaps = np.diff(lg.send_offsets(a))
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.12)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.15)   # exponential: CV 1
    assert (gaps >= 0).all() and len(set(np.round(gaps, 9))) > 500
    # lengths and classes from the trace rows, in order; the times are not the trace's
    assert [(r.prompt_len, r.output_len, r.priority) for r in a] == \
           [(r.prompt_len, r.output_len, r.priority) for r in trace]
    assert not np.allclose(lg.send_offsets(a), lg.send_offsets(trace))
    # seeded
    again = lg.make_workload("azure", rate=5.0, num_requests=600, seed=1, arrivals="poisson")
    assert lg.send_offsets(again) == lg.send_offsets(a)
    other = lg.make_workload("azure", rate=5.0, num_requests=600, seed=2, arrivals="poisson")
    assert lg.send_offsets(other) != lg.send_offsets(a)
    with pytest.raises(ConfigError, match="--arrivals poisson needs --rate"):
        lg.make_workload("azure", num_requests=10, arrivals="poisson")
    with pytest.raises(ConfigError, match="arrivals must be one of"):
        lg.make_workload("azure", rate=1.0, num_requests=10, arrivals="gamma")


def test_stream_flags_exact_seeded_fraction():
    f = lg.stream_flags(100, 0.3, seed=4)
    assert sum(f) == 30 and f == lg.stream_flags(100, 0.3, seed=4) and f != lg.stream_flags(100, 0.3, seed=5)
    assert lg.stream_flags(7, 1.0) == [True] * 7 and lg.stream_flags(7, 0.0) == [False] * 7
    assert sum(lg.stream_flags(3, 0.5)) == 2
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ConfigError, match="stream_fraction must be a number in"):
            lg.stream_flags(10, bad)


def test_parse_response_unstreamed():
    ok = lg.parse_response(b'{"choices":[{"index":0,"text":"","token_ids":[1,2,3],"finish_reason":"length"}],'
                           b'"usage":{"completion_tokens":3}}')
    assert (ok.tokens, ok.usage_tokens, ok.finish_reason, ok.done, ok.malformed) == (3, 3, "length", True, None)
    usage_only = lg.parse_response('{"choices":[{"index":0,"text":"a b"}],"usage":{"completion_tokens":2}}')
    assert usage_only.tokens == 2
    # --no-token-ids: the usage count, not the token ids
    assert lg.parse_response('{"choices":[{"index":0,"token_ids":[1]}],"usage":{"completion_tokens":4}}',
                             token_ids=False).tokens == 4
    assert "neither" in lg.parse_response('{"choices":[{"index":0,"text":"abc"}]}').malformed
    assert lg.parse_response("nope").malformed and lg.parse_response("[]").malformed
    assert lg.parse_response('{"error":{"message":"bad","code":400}}').error == "(400) bad"


def test_replay_unstreamed_tokens_stamped_at_response():
    from proserve.bench.fake_worker import FakeWorker
    reqs = [req(i, "high" if i % 2 else "low", arrival=0.05 * i, output=6) for i in range(8)]

    async def go():
        w = await FakeWorker(decode_s=0.02).start()
        try:
            return w, await lg.replay(reqs, lg.ClientConfig(w.url, stream_fraction=0.5, seed=3))
        finally:
            await w.stop()

    w, run = asyncio.run(go())
    flags = lg.stream_flags(8, 0.5, 3)
    assert [r.stream for r in run.results] == flags and sum(flags) == 4
    assert sorted(b["stream"] for b in w.received) == sorted(flags)
    for r in run.results:
        assert r.ok, r.error
        assert len(r.token_times) == 6 and r.usage_tokens == 6 and r.done
        if r.stream:   # one chunk per token, decode_s apart
            assert r.token_times[-1] - r.token_times[0] > 4 * 0.02
        else:          # everything at the response's time, after the whole generation
            assert len(set(r.token_times)) == 1
            assert r.token_times[0] - r.sent >= 5 * 0.02
    conv = [lg.to_request(q, r) for q, r in zip(reqs, run.results)]
    assert all(c.tpot == 0.0 for c, f in zip(conv, flags) if not f)
    s = lg.summarize_run(reqs, run.results, GainConfig())
    assert s["metrics"]["all"]["unstreamed"] == 4
    assert s["metrics"]["high"]["unstreamed"] + s["metrics"]["low"]["unstreamed"] == 4


@pytest.mark.parametrize("mode,expect", [
    ("usage_only", None),
    ("bad_usage", "usage reports 5 tokens, the stream carried 4"),
    ("reject", "HTTP 400: vllm_xargs.ttft_slo"),
])
def test_replay_unstreamed_counts_and_errors(mode, expect):
    reqs = [req(0, "high", 0.0, output=4)]

    async def go(url):
        cfg = lg.ClientConfig(url, model="m", stream_fraction=0.0, class_body=_modes({"high": mode}))
        return await lg.replay(reqs, cfg)

    fake, run = asyncio.run(_with_fake(go))
    r = run.results[0]
    assert fake.bodies[0]["stream"] is False and not r.stream
    if expect is None:
        assert r.ok and len(r.token_times) == 4
    else:
        assert not r.ok and expect in r.error


def test_replay_proserve_sends_priority_slo_and_class_keys():
    reqs = [req(i, "high" if i % 2 else "low", arrival=0.02 * i, output=3, ttft=0.8, tpot=0.04) for i in range(6)]

    async def go(url):
        cfg = lg.ClientConfig(url, api="proserve", class_keys={"high": "sk-h", "low": "sk-l"})
        return await lg.replay(reqs, cfg)

    fake, run = asyncio.run(_with_fake(go))
    assert all(r.ok for r in run.results)
    for b, h in zip(fake.bodies, fake.headers):
        assert "vllm_xargs" not in b and b["return_token_ids"] is True
        assert b["slo"] == {"ttft_ms": 800.0, "tpot_ms": 40.0}
        assert h["Authorization"] == {"high": "Bearer sk-h", "low": "Bearer sk-l"}[b["priority"]]
    assert sorted(b["priority"] for b in fake.bodies) == ["high"] * 3 + ["low"] * 3
    with pytest.raises(ConfigError, match="no API key"):
        asyncio.run(lg.replay(reqs, lg.ClientConfig("http://127.0.0.1:1", api="proserve")))


def _run_cli_against_fake_worker(argv, decode_s=0.001):
    from proserve.bench.fake_worker import FakeWorker

    async def go():
        w = await FakeWorker(decode_s=decode_s, keep_bodies=False).start()
        try:
            return await asyncio.to_thread(lg.main, ["--url", w.url, *argv])
        finally:
            await w.stop()

    return asyncio.run(go())


def test_cli_100_mixed_requests_report_equals_records(tmp_path, capsys):
    out = tmp_path / "run"
    plots = ["--plots"] if lg.have_matplotlib() else ["--no-plots"]
    rc = _run_cli_against_fake_worker(["--num-requests", "100", "--rate", "50", "--arrivals", "poisson",
                                       "--stream-fraction", "0.5", "--prompt-div", "20", "--output-div", "20",
                                       "--out", str(out), "--quiet", *plots])
    assert rc == 0
    text = capsys.readouterr().out
    assert "TDG_Ratio" in text and "SLO_att" in text and "out_tok/s" in text
    assert "unstreamed: 50 of 100 requests" in text
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(recs) == 100 and sum(not r["stream"] for r in recs) == 50
    assert {r["priority"] for r in recs} == {"high", "low"}
    assert all(len(set(r["token_times"])) == 1 for r in recs if not r["stream"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["api"] == "vllm" and summary["arrivals"] == "poisson" and summary["stream_fraction"] == 0.5
    rep = lg.report_from_records(out / "requests.jsonl")
    assert set(rep) == {"metrics", "errors", "gain", "send_lag_s", "malformed_chunks"}
    assert rep == {k: summary[k] for k in rep}
    assert rep["metrics"]["all"]["requests"] == 100 and rep["metrics"]["all"]["unstreamed"] == 50
    # the per-class numbers are the records' own: recount two by hand
    for c in ("high", "low"):
        mine = [r for r in recs if r["priority"] == c]
        assert summary["metrics"][c]["slo_attainment"] == pytest.approx(
            sum(r["slo_met"] for r in mine) / len(mine))
        assert summary["metrics"][c]["tdg_ratio"] == pytest.approx(
            sum(r["tdg"] for r in mine) / sum(r["ideal_gain"] for r in mine))
        assert summary["metrics"][c]["ttft_p90"] == pytest.approx(np.percentile([r["ttft"] for r in mine], 90))
    # a changed record changes the report
    recs[0]["token_times"] = [t + 100.0 for t in recs[0]["token_times"]]
    (tmp_path / "tampered.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert lg.report_from_records(tmp_path / "tampered.jsonl")["metrics"] != rep["metrics"]
    if lg.have_matplotlib():
        for name in lg.PLOT_FILES:
            data = (out / name).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    # --from-records prints the same table without sending anything
    assert lg.main(["--from-records", str(out), "--no-plots"]) == 0
    again = capsys.readouterr().out
    assert again.splitlines()[:4] == text.splitlines()[:4]


def test_plots_written_for_errors_and_classes(tmp_path):
    pytest.importorskip("matplotlib")
    reqs = [req(0, "high", 0.0, output=3), req(1, "low", 0.0, output=3)]
    res = [lg.Result("r0", "high", 0.0, 3, status=200, token_times=[0.5, 0.55, 0.6], done=True).finish(),
           lg.Result("r1", "low", 0.0, 3, error="ClientConnectorError: refused")]
    gain = GainConfig()
    summary = lg.clean_json(lg.summarize_run(reqs, res, gain))
    recs = lg.clean_json(lg.result_records(reqs, res, gain))
    paths = lg.write_plots(tmp_path / "p", recs, summary)
    assert [p.name for p in paths] == list(lg.PLOT_FILES) and all(p.stat().st_size > 5000 for p in paths)


def test_cli_proserve_against_dispatcher(tmp_path):
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from dispatcher_helpers import KEYS, harness

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    out = tmp_path / "run"

    async def go(argv):
        async with harness(worker_kw={"decode_s": 0.001}) as h:
            rc = await asyncio.to_thread(lg.main, ["--url", h.url, "--api", "proserve", *argv])
            return rc, [b for w in h.decodes for b in w.received]

    rc, decoded = asyncio.run(go(["--keys", str(keys), "--num-requests", "16", "--rate", "40",
                                  "--stream-fraction", "0.5", "--prompt-div", "50", "--output-div", "50",
                                  "--out", str(out), "--quiet", "--no-plots"]))
    assert rc == 0
    recs = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert all(r["error"] is None and r["tokens"] == r["output_len"] for r in recs)
    assert sum(not r["stream"] for r in recs) == 8
    # the dispatcher turned each request's class and SLOs into the workers' xargs
    from collections import Counter
    assert Counter(b["vllm_xargs"]["priority_class"] for b in decoded) == Counter(r["priority"] for r in recs)
    assert {b["vllm_xargs"]["ttft_slo"] for b in decoded} == {1.0}
    assert lg.report_from_records(out) == {k: v for k, v in json.loads((out / "summary.json").read_text()).items()
                                           if k in ("metrics", "errors", "gain", "send_lag_s", "malformed_chunks")}
    # the high class sent with the low class's key: the dispatcher refuses it (403), counted per class
    rc, _ = asyncio.run(go(["--class-key", "high=sk-low-0000001", "--class-key", "low=sk-low-0000001",
                            "--num-requests", "6", "--rate", "40", "--prompt-div", "50", "--output-div", "50",
                            "--out", str(out), "--quiet", "--no-plots"]))
    s = json.loads((out / "summary.json").read_text())
    assert rc == 1 and s["errors"]["low"]["errors"] == 0 and s["errors"]["high"]["errors"] == s["errors"]["high"]["requests"] > 0
    assert all(k.startswith("HTTP 403") for k in s["errors"]["high"]["by_error"])


@pytest.mark.parametrize("argv,msg", [
    (["--api", "proserve", "--class-key", "high=sk-high-000001"], "no API key for class(es) 'low'"),
    (["--api", "proserve", "--keys", "/nonexistent/keys.toml"], "--keys /nonexistent/keys.toml: cannot read"),
    (["--class-key", "high=k"], "--class-key/--keys apply only to --api proserve"),
    (["--api", "proserve", "--api-key", "k", "--class-key", "gold=k"], "--class-key: unknown class(es) gold"),
    (["--api", "proserve", "--api-key", "k", "--no-xargs"], "--no-xargs applies only to --api vllm"),
    (["--stream-fraction", "1.5"], "--stream-fraction must be a number in [0, 1], got 1.5"),
    (["--stream-fraction", "nan"], "--stream-fraction must be a number in [0, 1]"),
    (["--arrivals", "poisson"], "--arrivals poisson needs --rate"),
    (["--rate", "0"], "--rate must be a number > 0"),
    (["--plots"], "--plots writes PNG files into --out"),
])
def test_cli_bad_arguments_rejected_naming_the_flag(argv, msg, capsys):
    assert lg.main(["--url", "http://127.0.0.1:1", "--num-requests", "10", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err, err


def test_cli_needs_url_or_records(capsys, tmp_path):
    assert lg.main(["--num-requests", "5"]) == 2
    assert "--url is required" in capsys.readouterr().err
    (tmp_path / "requests.jsonl").write_text('{"id": "r0"}\n')
    assert lg.main(["--from-records", str(tmp_path)]) == 2
    assert "not a load generator record" in capsys.readouterr().err


def test_progress_plain_line_and_tqdm():
    import io
    ok = lg.Result("r0", "high", 0.0, 1)
    bad = lg.Result("r1", "high", 0.0, 1, error="boom")
    f = io.StringIO()
    p = lg.Progress(3, use_tqdm=False, file=f, interval=0.0)
    for i, r in enumerate((ok, bad, ok), 1):
        p(i, 3, r)
    p.close()
    lines = f.getvalue().split("\r")
    assert "1/3 requests done, 0 errors" in lines[1] and "3/3 requests done, 1 errors" in lines[-1]
    assert f.getvalue().endswith("\n") and p.bar is None
    pytest.importorskip("tqdm")
    f = io.StringIO()
    p = lg.Progress(2, file=f)
    p(1, 2, bad)
    p(2, 2, ok)
    p.close()
    assert p.bar is not None and "2/2" in f.getvalue() and "errors=1" in f.getvalue()
