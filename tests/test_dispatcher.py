"""The dispatcher over HTTP, in front of fake workers (bench.fake_worker): what
it sends each leg, auth and input errors, streaming, retries and failures,
metrics. The same dispatcher in front of real vLLM workers is tests/test_e2e_cluster.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from dispatcher_helpers import KEYS, harness, metric, run

from proserve.dispatcher.config import ConfigError, config_from_dict, keys_from_dict, load_config
from proserve.scheduler.config import default_classes

PROMPT = list(range(1, 41))


def body(**kw):
    return {"prompt": PROMPT, "max_tokens": 5, **kw}


# -- the hand-off ------------------------------------------------------------------------------
def test_disaggregated_legs_carry_kv_transfer_and_scheduling_params():
    async def go():
        async with harness() as h:
            r = await h.post("/v1/completions", body(vllm_xargs={"priority_class": "high", "foo": 1},
                                                      priority="high", slo={"ttft_ms": 800, "tpot_ms": 40}))
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["choices"][0]["text"] == " ".join(f"t{i}" for i in range(1, 6))
            assert "kv_transfer_params" not in out
            (pb,), (db,) = h.prefills[0].received, h.decodes[0].received
            assert pb["max_tokens"] == 1 and pb["stream"] is False
            kv = pb["kv_transfer_params"]
            assert kv["do_remote_decode"] is True and kv["remote_addr"] == "tcp://127.0.0.1:16000"
            assert db["kv_transfer_params"] == {"do_remote_prefill": True, "xfer_id": kv["xfer_id"]}
            assert db["max_tokens"] == 5 and db["prompt"] == PROMPT
            for b in (pb, db):
                xa = b["vllm_xargs"]
                assert xa["priority_class"] == "high" and xa["weight"] == 2.0
                assert xa["ttft_slo"] == pytest.approx(0.8) and xa["tpot_slo"] == pytest.approx(0.04)
                assert xa["foo"] == 1 and "priority" not in b and "slo" not in b
            # one KV transfer id per attempt: the request id and the attempt number
            assert kv["xfer_id"] == r.headers["x-request-id"] + "-0"
            # the queue map saw the request and let it go
            assert h.d.registry.prefill[0].state.queue == []
    run(go())


def test_a_burst_spreads_over_decode_workers_and_promises_end_with_the_prefill():
    """Requests in prefill have their decode blocks promised (RouterHost), so a burst does
    not all go to the decode worker whose last scrape showed the most free blocks, and the
    promises do not outlive the prefill (nor does a scrape end them: they are kept apart)."""
    async def go():
        hold = asyncio.Event()
        async with harness(n_decode=2, worker_kw={"hold": hold, "num_blocks": 1000}) as h:
            h.d.router_host.promise_s = 600.0      # no lapse however slow this host is today
            await asyncio.sleep(0.3)                              # a scrape or two
            tasks = [asyncio.create_task(h.post("/v1/completions", body())) for _ in range(8)]
            ds = [w.state for w in h.d.registry.decode]

            async def promised():
                while sum(len(d.reserved) for d in ds) < 8:
                    await asyncio.sleep(0.01)
            await asyncio.wait_for(promised(), 30)
            await asyncio.sleep(0.3)                              # scrapes while the prefills are held
            now = time.time()
            assert sorted(len(d.reserved) for d in ds) == [4, 4]
            assert all(d.room(now) == d.free_blocks - 4 * 3 for d in ds)   # 40 + 5 tokens: 3 blocks each
            hold.set()
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))
            assert [len(w.received) for w in h.decodes] == [4, 4]
            assert all(d.reserved == {} and d.room(time.time()) == d.free_blocks for d in ds)
    run(go())


def test_slo_attained_counts_the_requests_whose_records_met_their_slos(tmp_path):
    """Problem: the dispatcher scored a finished request without marking it finished,
    so proserve:dispatcher_slo_attained stayed 0 however fast the cluster was. The
    counter must agree with the per-request records (whatever this host's speed);
    the SLOs are the key's loosest, so requests here meet them."""
    rec = tmp_path / "requests.jsonl"

    async def go():
        async with harness(record_requests=str(rec)) as h:
            for _ in range(3):
                r = await h.post("/v1/completions", body(slo={"ttft_ms": 10000, "tpot_ms": 1000}))
                assert r.status_code == 200, r.text
            return metric(await h.metrics(), "proserve:dispatcher_slo_attained_total")
    counted = run(go())
    recs = [json.loads(line) for line in rec.read_text().splitlines()]
    met = sum(1 for x in recs if x["outcome"] == "ok" and x["ttft"] < 10.0 and x["tpot"] < 1.0)
    assert len(recs) == 3 and met >= 1
    assert counted == met


def test_the_router_hears_of_every_finished_request():
    """Problem: the dispatcher never called the router's on_request_finished, so routers
    that keep per-request state (SLOs-Serve's admitted set and memory model) or learn
    output lengths (power-of-K) grew without bound or never learned."""
    seen = []

    async def go():
        async with harness() as h:
            h.d.policy.on_request_finished = lambda r, now: seen.append((r.id, r.finished, r.error))
            ids = []
            for _ in range(2):
                r = await h.post("/v1/completions", body())
                assert r.status_code == 200, r.text
                ids.append(r.headers["x-request-id"])
            return ids
    ids = run(go())
    assert seen == [(i, True, None) for i in ids]


def test_client_cannot_raise_its_class_through_vllm_xargs():
    async def go():
        async with harness() as h:
            r = await h.post("/v1/completions", body(vllm_xargs={"priority_class": "high", "weight": 100}),
                             key="sk-low-0000001")
            assert r.status_code == 200
            xa = h.prefills[0].received[0]["vllm_xargs"]
            assert xa["priority_class"] == "low" and xa["weight"] == 1.0
    run(go())


def test_streaming_passes_tokens_and_drops_what_was_not_asked_for():
    async def go():
        async with harness() as h:
            status, ev = await h.stream("/v1/completions", body())
            assert status == 200
            assert ev[-1] == "[DONE]"
            chunks = ev[:-1]
            assert "".join(c["choices"][0]["text"] for c in chunks) == " t1 t2 t3 t4 t5"
            assert all("token_ids" not in c["choices"][0] for c in chunks)      # not asked for
            # asked for: token ids and the usage chunk come through
            status, ev = await h.stream("/v1/completions", body(return_token_ids=True,
                                                                stream_options={"include_usage": True}))
            chunks = ev[:-1]
            assert [c["choices"][0]["token_ids"] for c in chunks[:-1]] == [[1], [2], [3], [4], [5]]
            assert chunks[-1]["usage"]["completion_tokens"] == 5
            db = h.decodes[0].received[-1]
            assert db["stream"] is True and db["return_token_ids"] is True
    run(go())


def test_chat_streamed_and_not_and_text_prompt_counted_by_tokenize():
    async def go():
        async with harness() as h:
            msgs = [{"role": "user", "content": "hello there world"}]
            r = await h.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "t1 t2 t3"
            status, ev = await h.stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 3})
            assert status == 200 and ev[-1] == "[DONE]"
            assert "".join(c["choices"][0]["delta"]["content"] for c in ev[:-1]) == " t1 t2 t3"
            r = await h.post("/v1/completions", {"prompt": "a b c d", "max_tokens": 2})
            assert r.status_code == 200
    run(go())


def test_colocated_sends_the_whole_request_to_one_instance():
    async def go():
        async with harness(n_prefill=2, colocated=True, global_policy="round_robin") as h:
            for _ in range(4):
                status, ev = await h.stream("/v1/completions", body())
                assert status == 200 and ev[-1] == "[DONE]"
            got = [len(w.received) for w in h.prefills]
            assert got == [2, 2]
            # n_d (decodes running there) rises while a stream is out and falls after
            h.prefills[0].decode_s = h.prefills[1].decode_s = 0.05
            task = asyncio.create_task(h.stream("/v1/completions", body(max_tokens=20)))
            for _ in range(100):
                if sum(w.state.n_decode for w in h.d.registry.prefill) == 1:
                    break
                await asyncio.sleep(0.02)
            assert sum(w.state.n_decode for w in h.d.registry.prefill) == 1
            await task
            assert all(w.state.n_decode == 0 and w.state.queue == [] for w in h.d.registry.prefill)
            b = h.prefills[0].received[0]
            assert "kv_transfer_params" not in b and b["max_tokens"] == 5
    run(go())


# -- bad input and auth -------------------------------------------------------------------------
BAD = [
    (dict(raw=b'{"prompt": [1,2'), 400, "not valid JSON"),
    (dict(raw=b'[1, 2]'), 400, "must be a JSON object"),
    (dict(body={"max_tokens": 3}), 400, "missing field 'prompt'"),
    (dict(body=body(prompt=[])), 400, "prompt is empty"),
    (dict(body=body(prompt=[1, -2])), 400, "prompt[1] must be a non-negative token id"),
    (dict(body=body(prompt=[[1, 2], "x"])), 400, "not a mix"),
    (dict(body=body(max_tokens=0)), 400, "max_tokens must be >= 1"),
    (dict(body=body(n=0)), 400, "n must be at least 1"),
    (dict(body=body(stream="yes")), 400, "stream must be true or false"),
    (dict(body=body(priority="platinum")), 400, "unknown class 'platinum'"),
    (dict(body=body(slo={"ttft_ms": -5})), 400, "slo.ttft_ms must be a positive number"),
    (dict(body=body(slo={"tpot_ms": 1e12})), 400, "over the limit"),
    (dict(body=body(slo={"ttft_ms": "fast"})), 400, "slo.ttft_ms must be a number"),
    (dict(body=body(slo={"deadline": 5})), 400, "unknown field(s) deadline"),
    (dict(body=body(max_tokens=2009)), 400, "maximum context length is 2048 tokens"),
    (dict(body=body(model="gpt-5")), 404, "The model `gpt-5` does not exist"),
    (dict(body=body(temperature=-1)), 400, "temperature must be non-negative"),   # the worker's own 400
    (dict(body={"messages": []}, path="/v1/chat/completions"), 400, "messages must be a non-empty list"),
    (dict(body=body(), key=None), 401, "missing API key"),
    (dict(body=body(), key="sk-nope-123456"), 401, "invalid API key"),
    (dict(body=body(priority="high"), key="sk-low-0000001"), 403, "above what this key allows"),
    (dict(body=body(slo={"ttft_ms": 50}),), 403, "outside what this key allows [100, 10000]"),
]


def test_bad_requests_get_the_right_4xx_and_the_dispatcher_keeps_serving():
    async def go():
        async with harness() as h:
            for case, status, msg in BAD:
                path = case.get("path", "/v1/completions")
                key = case.get("key", "sk-high-000001")
                r = await h.post(path, case.get("body"), key=key, raw=case.get("raw"))
                assert r.status_code == status, (case, r.text)
                err = r.json()["error"]
                assert msg in err["message"], (case, err)
                # streamed requests get the same status, not a 200 with an error event
                if "body" in case and isinstance(case["body"], dict) and status != 400 or "temperature" in str(case):
                    st, ev = await h.stream(path, case["body"], key=key)
                    assert st == status, (case, ev)
            r = await h.post("/v1/completions", body())
            assert r.status_code == 200
            m = await h.metrics()
            assert 'proserve:dispatcher_requests_total{outcome="auth_error",priority="-"}' in m
            assert h.d.registry.prefill[0].state.queue == []
    run(go())


def test_open_access_without_keys_file_takes_any_class(caplog):
    async def go():
        async with harness(keys=None) as h:
            r = await h.post("/v1/completions", body(), key=None)
            assert r.status_code == 200
            assert h.prefills[0].received[-1]["vllm_xargs"]["priority_class"] == "low"   # default class
            r = await h.post("/v1/completions", body(priority="high"), key=None)
            assert h.prefills[0].received[-1]["vllm_xargs"]["priority_class"] == "high"
    with caplog.at_level("WARNING", logger="proserve.dispatcher"):
        run(go())
    assert any("open access" in r.message for r in caplog.records)


# -- failures ---------------------------------------------------------------------------------------
def test_prefill_failure_is_retried_on_another_instance():
    async def go():
        async with harness(n_prefill=2, global_policy="round_robin") as h:
            h.prefills[0].fail = "500"
            for _ in range(4):
                r = await h.post("/v1/completions", body())
                assert r.status_code == 200, r.text
            assert 'proserve:dispatcher_retries_total{role="prefill"}' in await h.metrics()
    run(go())


def test_decode_dropping_before_any_token_is_retried_after_it_tokens_end_in_an_error_event():
    async def go():
        async with harness(n_decode=2, global_policy="round_robin") as h:
            h.decodes[0].fail = "drop"          # refuses at once: retried on the other decode worker
            h.decodes[0].fail_after_tokens = 0
            status, ev = await h.stream("/v1/completions", body())
            assert status == 200 and ev[-1] == "[DONE]" and "error" not in ev[-2]
            # the dropped worker left the candidate set; bring it back, failing mid-stream now
            h.decodes[0].fail, h.decodes[0].fail_after_tokens = "drop", 2
            h.decodes[1].fail, h.decodes[1].fail_after_tokens = "drop", 2
            for _ in range(50):
                if all(w.healthy for w in h.d.registry.decode):
                    break
                await asyncio.sleep(0.05)
            status, ev = await h.stream("/v1/completions", body())
            assert status == 200
            assert [c["choices"][0]["text"] for c in ev[:2]] == [" t1", " t2"]
            assert ev[2]["error"]["code"] == 502 and ev[-1] == "[DONE]"
    run(go())


def test_a_worker_that_stops_answering_fails_its_requests_fast_and_leaves_the_set():
    async def go():
        async with harness(n_decode=2, global_policy="round_robin", health_failures=2) as h:
            dw = h.decodes[0]
            dw.decode_s = 0.05
            task = asyncio.create_task(h.stream("/v1/completions", body(max_tokens=400)))
            while not dw.received:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            dw.health_message = "receiver gone\nforged log line"
            dw.fail, dw.fail_after_tokens = "hang", 1        # health answers 503 from now on
            t0 = asyncio.get_running_loop().time()
            status, ev = await asyncio.wait_for(task, 10)
            assert asyncio.get_running_loop().time() - t0 < 2.0   # not the 60 s idle timeout
            assert status == 200 and ev[-2]["error"]["code"] == 502 and ev[-1] == "[DONE]"
            assert not h.d.registry.decode[0].healthy
            for _ in range(100):     # the health check's failure names the worker's own reason
                if "answered 503: receiver gone" in h.d.registry.decode[0].last_error:
                    break
                await asyncio.sleep(0.05)
            # (its newline replaced: a worker's text cannot forge a line of the dispatcher's log)
            assert "/health answered 503: receiver gone?forged log line" in h.d.registry.decode[0].last_error
            for _ in range(6):                                  # new requests go to the survivor
                r = await h.post("/v1/completions", body())
                assert r.status_code == 200
            assert len(h.decodes[1].received) == 6
            m = await h.metrics()
            assert 'proserve:dispatcher_instance_healthy{instance="d0",role="decode"} 0.0' in m
    run(go())


def test_no_live_instance_is_a_503_not_a_hang():
    async def go():
        async with harness() as h:
            await h.decodes[0].stop()
            for _ in range(100):
                if not h.d.registry.decode[0].healthy:
                    break
                await asyncio.sleep(0.05)
            r = await h.post("/v1/completions", body())
            assert r.status_code == 503 and "no healthy decode instance" in r.json()["error"]["message"]
            assert (await h.http.get("/health")).status_code == 503
    run(go())


# -- accounting ---------------------------------------------------------------------------------------
def test_every_request_is_accounted_for_in_metrics_and_records(tmp_path):
    rec = tmp_path / "req.jsonl"

    async def go():
        async with harness(n_prefill=2, n_decode=2, record_requests=str(rec)) as h:
            async def one(i):
                key = "sk-high-000001" if i % 2 else "sk-low-0000001"
                if i % 3:
                    return (await h.stream("/v1/completions", body(max_tokens=3 + i % 4), key=key))[0]
                return (await h.post("/v1/completions", body(max_tokens=3 + i % 4), key=key)).status_code
            statuses = await asyncio.gather(*(one(i) for i in range(40)))
            assert statuses == [200] * 40
            m = await h.metrics()
            assert 'proserve:dispatcher_requests_total{outcome="ok",priority="high"} 20.0' in m
            assert 'proserve:dispatcher_requests_total{outcome="ok",priority="low"} 20.0' in m
            assert all(w.state.queue == [] for w in h.d.registry.prefill)
            text = m
        return text

    m = run(go())
    recs = [json.loads(line) for line in rec.read_text().splitlines()]
    assert len(recs) == 40 and all(r["outcome"] == "ok" for r in recs)
    assert sum(r["output_tokens"] for r in recs) == sum(3 + i % 4 for i in range(40))
    gained = sum(r["tdg"] for r in recs if r["priority"] == "high")
    line = next(x for x in m.splitlines() if x.startswith('proserve:dispatcher_tdg_gained_total{priority="high"}'))
    assert float(line.split()[-1]) == pytest.approx(gained)
    for r in recs:
        assert len(r["token_times"]) == r["output_tokens"]
        assert r["arrival"] <= r["routed_at"] <= r["end"]   # when its instances were chosen
        if not r["stream"]:   # delivered at once
            assert len(set(r["token_times"])) == 1


# -- config files -----------------------------------------------------------------------------------
def test_config_file_errors_name_the_entry(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[dispatcher]\nport = 8000\n[[prefill]]\nurl = "http://127.0.0.1:8100"\n'
                 '[[decode]]\nurl = "http://127.0.0.1:8200"\nkv_addr = "tcp://127.0.0.1:15600"\n')
    cfg = load_config(p)
    cfg.validate()
    assert cfg.prefill[0].name == "p0" and cfg.decode[0].kv_addr == "tcp://127.0.0.1:15600"
    cases = [
        ({"dispatcher": {"deployment": "colocated"}, "prefill": [{"url": "localhost:8100"}]},
         "prefill[0].url: must be a base URL"),
        ({"prefill": [{"url": "http://a:1"}], "decode": [{"url": "http://b:2"}]}, "decode[0] needs url and kv_addr"),
        ({"prefill": [{"url": "http://a:1", "gpu": 1}]}, "prefill[0]: unknown key(s) gpu"),
        ({"prefill": [{"url": "http://a:1"}]}, "needs decode instances"),
        ({"dispatcher": {"deployment": "mesh"}, "prefill": [{"url": "http://a:1"}]}, "deployment must be one of"),
        ({"dispatcher": {"prot": 1}}, "unknown key(s) prot"),
        ({"gain": {"w_p": -1}}, "w_p must be a number >= 0, got -1"),
        ({"classes": [{"name": "gold", "weight": 0, "ttft_slo": 1, "tpot_slo": 0.1}]},
         "weight must be a number > 0, got 0"),
    ]
    for data, msg in cases:
        with pytest.raises(ConfigError, match=None) as e:
            config_from_dict(data, "c.toml").validate("c.toml")
        assert msg in str(e.value) and "c.toml" in str(e.value), (data, str(e.value))
    bad = tmp_path / "bad.toml"
    bad.write_text("[dispatcher\n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        load_config(bad)


def test_keys_file_errors():
    classes = default_classes()
    assert keys_from_dict(KEYS, classes)["sk-high-000001"].ttft_ms == (100.0, 10000.0)
    for data, msg in [({"keys": []}, "non-empty list"),
                      ({"keys": [{"key": "short", "client": "a", "class": "high"}]}, "at least 8"),
                      ({"keys": [{"key": "sk-12345678", "client": "a", "class": "gold"}]},
                       "keys[0].class must be one of high, low, got 'gold'"),
                      ({"keys": [{"key": "sk-12345678", "client": "a", "class": "low", "ttft_ms": [5, 1]}]},
                       "keys[0].ttft_ms[1] (max) must be a number in [5, 3600000], got 1"),
                      ({"keys": [{"key": "sk-12345678", "client": "a", "class": "low"},
                                 {"key": "sk-12345678", "client": "b", "class": "low"}]}, "duplicate key")]:
        with pytest.raises(ConfigError) as e:
            keys_from_dict(data, classes, "k.toml")
        assert msg in str(e.value) and "k.toml" in str(e.value)


def test_cli_rejects_bad_flags_with_a_message():
    import subprocess
    import sys
    for argv, msg in [(["--prefill", "http://127.0.0.1:8100"], "no decode workers"),
                      (["--prefill", "http://a:1", "--decode", "http://b:2"], "--decode expects URL=KV_ADDR"),
                      (["--prefill", "http://a:1", "--decode", "http://b:2=tcp://c:3", "--global-policy", "magic"],
                       "unknown global policy 'magic'"),
                      (["--prefill", "http://a:1", "--decode", "http://b:2=tcp://c:3", "--global-param", "alpha=3"],
                       "alpha must be a number in (0, 1]")]:
        p = subprocess.run([sys.executable, "-m", "proserve.dispatcher", *argv], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and msg in p.stderr, (argv, p.stderr)
