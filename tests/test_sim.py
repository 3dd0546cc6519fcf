"""The discrete-event simulator: correctness of its bookkeeping, fast-forward
equivalence, both deployments, and start-up validation."""

import json
import subprocess
import sys

import pytest

from proserve.bench.workloads import build_workload
from proserve.profiler.modelfile import BUNDLED, load
from proserve.scheduler import (
    ConfigError,
    GainConfig,
    LatencyModel,
    Request,
    local_names,
    summarize,
)
from proserve.scheduler.request import Phase
from proserve.sim.cluster import SimConfig, simulate

MODEL = load(BUNDLED)
TRACE = "bench/data/azure_conv_2023.csv"


def workload(n=300, rate=3.0, seed=0):
    return build_workload(TRACE, rate=rate, num_requests=n, seed=seed, fmt="azure")


def gain_for(reqs):
    return GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs])


def test_single_request_timing_matches_the_latency_model(make_req):
    m = LatencyModel(a_p=0, b_p=0, c_p=1e-3, a_d=0, b_d=1e-3, t_c=0.01)
    r = make_req(prompt=100, output=3, arrival=0.0, ttft=10.0, tpot=1.0)
    simulate([r], m, SimConfig(local_policy="slide_batching", global_policy="round_robin"))
    # latency budget = remain = 10 s: the whole prompt (0.1 s) + t_c in one step, then 2 decode steps of 0.011 s
    assert r.token_times == pytest.approx([0.11, 0.121, 0.132])
    assert r.phase is Phase.DONE and r.kv_len == 102


@pytest.mark.parametrize("policy", local_names())
def test_every_request_finishes_and_fast_forward_is_exact(policy):
    reqs_a, reqs_b = workload(250, 4.0), workload(250, 4.0)
    g = gain_for(reqs_a)
    cfg = dict(local_policy=policy, global_policy="round_robin")
    ra = simulate(reqs_a, MODEL, SimConfig(fast_forward=True, **cfg), g)
    rb = simulate(reqs_b, MODEL, SimConfig(fast_forward=False, **cfg), g)
    assert all(r.finished and r.error is None and r.num_emitted == r.output_len for r in ra.requests)
    for a, b in zip(ra.requests, rb.requests):
        assert a.token_times == pytest.approx(b.token_times, abs=1e-9)
    assert ra.steps == rb.steps


def test_overload_orders_policies_as_the_paper_finds():
    """At overload SlideBatching beats deadline-first Sarathi-FCFS; at light load they tie."""
    res = {}
    for rate in (1.5, 6.0):
        for pol in ("slide_batching", "sarathi_fcfs"):
            reqs = workload(600, rate)
            g = gain_for(reqs)
            out = simulate(reqs, MODEL, SimConfig(local_policy=pol, global_policy="round_robin"), g)
            res[pol, rate] = summarize(out.requests, g)["all"].tdg_ratio
    assert res["slide_batching", 1.5] == pytest.approx(res["sarathi_fcfs", 1.5], abs=0.01)
    assert res["slide_batching", 6.0] > res["sarathi_fcfs", 6.0] + 0.1


def test_disaggregated_runs_transfer_time_and_decode_memory():
    reqs = workload(200, 6.0)
    g = gain_for(reqs)
    cfg = SimConfig(deployment="disaggregated", prefill_instances=2, decode_instances=2,
                    global_policy="go_routing", kv_bandwidth=1e9)
    out = simulate(reqs, MODEL, cfg, g)
    assert all(r.finished and r.num_emitted == r.output_len for r in out.requests)
    # second token needs the KV moved: at least kv bytes / bandwidth after the first
    for r in out.requests:
        if r.output_len > 1:
            assert r.token_times[1] - r.token_times[0] >= r.prompt_len * 524288 / 1e9 - 1e-9
    slow = simulate(workload(200, 6.0), MODEL, SimConfig(deployment="disaggregated", prefill_instances=2,
                                                         decode_instances=2, kv_bandwidth=1e8), g)
    tpot = lambda rs: sum(r.tpot for r in rs) / len(rs)  # noqa: E731
    assert tpot(slow.requests) > tpot(out.requests)


@pytest.mark.parametrize("dispatchers, sync", [(1, None), (2, "publish"), (2, "shared")])
def test_a_burst_spreads_over_the_decode_instances(dispatchers, sync):
    """Requests routed before the first one's KV reaches its decode instance see that
    instance's blocks promised (RouterHost reserves them), so a burst does not all go to the
    one with the most free blocks. Each dispatcher knows its own promises (its own decode
    view), except "shared"."""
    reqs = [Request(f"r{i}", "high", 2.0, 5.0, 0.1, 0.001 * i, 512, 16) for i in range(16)]
    cfg = SimConfig(deployment="disaggregated", prefill_instances=1, decode_instances=4,
                    global_policy="round_robin", dispatchers=dispatchers, dispatcher_sync=sync)
    from proserve.sim.cluster import Simulator
    sim = Simulator(MODEL, cfg, gain_for(reqs))
    out = sim.run(reqs)
    assert all(r.finished for r in out.requests)
    per = [list(sim._decode_target.values()).count(j) for j in range(4)]
    # one dispatcher (or one shared view): 4 each; two own views: at most 2 x 4 on one
    assert max(per) <= (4 if dispatchers == 1 or sync == "shared" else 8), per
    assert min(per) >= (4 if dispatchers == 1 or sync == "shared" else 1), per


def test_memory_pressure_preempts_and_still_finishes():
    reqs = workload(150, 6.0)
    out = simulate(reqs, MODEL, SimConfig(global_policy="round_robin", num_kv_blocks=600), gain_for(reqs))
    assert all(r.finished and r.num_emitted == r.output_len for r in out.requests)


@pytest.mark.parametrize("policy", local_names())
def test_long_prompts_under_memory_pressure_do_not_thrash(policy):
    """40 prompts of 3,000 tokens, memory for about four: a prompt is admitted only when
    its whole prefill fits (vLLM's rule), so none is admitted into memory it cannot finish
    in and pushed out again. Before that rule vllm_fcfs took 590 simulated seconds here
    (6,471 steps of recompute thrash), EDF 110; the work itself takes about 19."""
    reqs = [Request(f"r{i}", "low", 1.0, 1.0, 0.1, i * 0.2, 3000, 60) for i in range(40)]
    out = simulate(reqs, MODEL, SimConfig(local_policy=policy, global_policy="round_robin", num_kv_blocks=800))
    assert all(r.num_emitted == 60 and r.error is None for r in reqs)
    assert out.preemptions <= 2, out.preemptions
    assert out.duration < 25.0, out.duration


def test_preemption_takes_the_most_recently_admitted_running_request():
    """vLLM preempts ``running[-1]``: when decodes cannot grow, the newest admission goes,
    a partial prefill included, not the decode that has run longest."""
    m = LatencyModel(a_p=0, b_p=0, c_p=1e-3, a_d=0, b_d=1e-3, t_c=0.01)
    # 10 blocks of 16 tokens: 'old' holds 4 and keeps growing; 'new' (80 tokens = 5 blocks)
    # fits whole when it arrives, but its prefill crawls (3 tokens a step beside the decode)
    # while 'old' grows into the blocks it was counting on: when 'old' needs a block and
    # none is free, 'new' (admitted last, half prefilled) is the one to go
    old = Request("old", "low", 1.0, 10.0, 0.05, 0.0, 63, 40)
    new = Request("new", "low", 1.0, 10.0, 0.05, 0.05, 80, 5)
    out = simulate([old, new], m, SimConfig(local_policy="sarathi_fcfs", global_policy="round_robin",
                                            local_params={"token_budget": 4}, num_kv_blocks=10,
                                            block_size=16))
    assert old.num_emitted == 40 and new.num_emitted == 5
    assert out.preemptions >= 1
    # 'old' never went back to the queue: its tokens are one decode step apart throughout
    gaps = [b - a for a, b in zip(old.token_times, old.token_times[1:])]
    assert max(gaps) < 0.05, gaps


TINY = LatencyModel(a_p=0, b_p=0, c_p=1e-4, a_d=0, b_d=1e-3, t_c=0.01)


@pytest.mark.parametrize("policy", local_names())
def test_a_request_that_fits_the_whole_cache_runs_on_an_idle_instance(policy):
    """1,586 tokens of KV in a cache of 1,600: no reserve holds it back when nothing else
    runs (the reserve protects running requests' growth; vLLM's watermark is likewise off
    while nothing is scheduled). It was failed as not fitting."""
    r = Request("r", "high", 1.0, 100.0, 10.0, 0.0, 1585, 2)
    simulate([r], TINY, SimConfig(local_policy=policy, global_policy="round_robin", num_kv_blocks=100))
    assert r.error is None and r.num_emitted == 2


def test_nothing_fits_fails_only_what_can_never_fit():
    """A low-class prompt half prefilled, a high-class one that needs the whole cache
    behind it: both finish (neither is failed for the other's sake)."""
    for pol in ("sarathi_priority", "sarathi_fcfs"):
        P = Request("P", "low", 1.0, 10.0, 0.1, 0.0, 1000, 5)
        H = Request("H", "high", 2.0, 10.0, 0.1, 0.015, 1585, 5)
        simulate([P, H], TINY, SimConfig(local_policy=pol, global_policy="round_robin", num_kv_blocks=100,
                                         local_params={"token_budget": 128}))
        assert (P.error, P.num_emitted, H.error, H.num_emitted) == (None, 5, None, 5), pol


def test_a_long_queue_of_requests_that_wait_for_memory_does_not_overflow_the_stack():
    """800 prompts that each need the whole cache, queued behind a long decode: the
    simulator retried the plan recursively (RecursionError); it loops now."""
    A = Request("A", "low", 1.0, 10.0, 0.1, 0.0, 10, 400)
    band = [Request(f"b{i}", "low", 1.0, 10.0, 0.1, 0.01 + i * 1e-4, 1585, 2) for i in range(800)]
    simulate([A] + band, TINY, SimConfig(local_policy="slide_batching", global_policy="round_robin",
                                         num_kv_blocks=100))
    assert A.num_emitted == 400 and all(r.error is None and r.num_emitted == 2 for r in band)


def test_request_larger_than_memory_fails_with_an_error(make_req):
    big, small = make_req(prompt=5000, output=2), make_req(prompt=10, output=2, arrival=0.1)
    out = simulate([big, small], MODEL, SimConfig(global_policy="round_robin", num_kv_blocks=100))
    assert "exceeds the KV capacity" in big.error and big.num_emitted == 0
    assert small.num_emitted == 2 and small.error is None
    assert len(out.requests) == 2


def test_beta_tracks_a_slower_true_model():
    slower = LatencyModel(**{k: 1.5 * getattr(MODEL, k) for k in ("a_p", "b_p", "c_p", "a_d", "b_d", "t_c")})
    out = simulate(workload(200, 2.0), MODEL, SimConfig(global_policy="round_robin", true_model=slower))
    assert out.betas[0] == pytest.approx(1.5, rel=0.02)


@pytest.mark.parametrize("kw,match", [
    (dict(local_policy="nope"), "unknown local policy 'nope'"),
    (dict(global_policy="nope"), "unknown global policy 'nope'"),
    (dict(local_params={"gamma": 0}), "gamma must be a number > 0"),
    (dict(local_params={"gamma": -1}), "gamma"),
    (dict(deployment="mesh"), "simulator: deployment must be one of colocated, disaggregated, got 'mesh'"),
    (dict(instances=0), "simulator: instances must be an integer >= 1, got 0"),
    (dict(instances=2.5), "simulator: instances must be an integer >= 1, got 2.5"),
    (dict(noise_cv=-0.1), "simulator: noise_cv must be a number >= 0"),
    (dict(kv_bandwidth=0), "simulator: kv_bandwidth must be a number > 0"),
    (dict(num_kv_blocks=0), "simulator: num_kv_blocks must be an integer >= 1"),
])
def test_invalid_config_fails_at_start(kw, match):
    cfg = SimConfig(global_policy=kw.pop("global_policy", "round_robin"), **kw)
    with pytest.raises(ConfigError, match=match):
        simulate(workload(5), MODEL, cfg)


def test_empty_workload_is_rejected():
    with pytest.raises(ConfigError, match="no requests"):
        simulate([], MODEL, SimConfig())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "proserve.sim", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,match", [
    (["run", "--local", "bogus"], "unknown local policy 'bogus'"),
    (["run", "--local-param", "gamma=0"], "gamma must be a number > 0"),
    (["run", "--local-param", "eta=-1"], "eta must be a number > 0"),
    (["run", "--rate", "-2"], "--rate must be a number > 0"),
    (["sweep", "--rates", "1,x"], "--rates"),
    (["run", "--global-param", "alpha=2"], "alpha"),
])
def test_cli_rejects_bad_values_naming_them(args, match):
    p = _cli(*args, "--num-requests", "10")
    assert p.returncode == 2, p.stderr
    assert match in p.stderr


def test_cli_bad_classes_and_empty_trace(tmp_path):
    bad = tmp_path / "classes.json"
    bad.write_text(json.dumps([{"name": "gold", "weight": -1, "ttft_slo": 1, "tpot_slo": 0.1}]))
    p = _cli("run", "--classes", str(bad), "--num-requests", "10")
    assert p.returncode == 2 and "weight must be a number > 0, got -1" in p.stderr
    bad.write_text(json.dumps([{"name": "gold", "weight": 2, "ttft_slo": -1, "tpot_slo": 0.1}]))
    p = _cli("run", "--classes", str(bad), "--num-requests", "10")
    assert p.returncode == 2 and "'gold': ttft_slo must be a number > 0, got -1" in p.stderr
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    p = _cli("run", "--trace", str(empty), "--format", "azure")
    assert p.returncode == 2 and "no requests" in p.stderr and "empty.csv" in p.stderr


def test_cli_run_writes_json_and_timeline_plot(tmp_path):
    p = _cli("run", "--rate", "5", "--num-requests", "200", "--timeline", "--plot", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    run = json.loads((tmp_path / "run.json").read_text())
    assert len(run["records"]) == 200
    recs = run["records"]
    # the report agrees with the per-request records
    assert run["metrics"]["all"]["tdg"] == pytest.approx(sum(r["tdg"] for r in recs))
    assert run["metrics"]["all"]["slo_attainment"] == pytest.approx(sum(r["slo_met"] for r in recs) / 200)
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_cli_sweep_table_and_plot(tmp_path):
    p = _cli("sweep", "--rates", "2,6", "--local", "slide_batching,sarathi_fcfs", "--num-requests", "150",
             "--jobs", "1", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "slide_batching" in p.stdout and "sarathi_fcfs" in p.stdout
    assert len(json.loads((tmp_path / "sweep.json").read_text())["runs"]) == 4
    assert (tmp_path / "sweep.png").stat().st_size > 1000


def test_decode_backpressure_stalls_prefill_without_failing():
    """A full decode pool holds the prefill instances' KV (not yet transferred): prefill
    waits for blocks instead of failing requests."""
    reqs = workload(300, 20.0)
    cfg = SimConfig(deployment="disaggregated", prefill_instances=2, decode_instances=1, num_kv_blocks=800)
    out = simulate(reqs, MODEL, cfg, gain_for(reqs))
    assert all(r.error is None and r.num_emitted == r.output_len for r in out.requests)


@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_policies_hear_of_every_finished_request_once(deployment, monkeypatch):
    """on_request_finished reaches the prefilling instance's policy and the router,
    once per request, at its last token's time (policies that learn lengths need it)."""
    from proserve.scheduler.baselines.round_robin import RoundRobin
    from proserve.scheduler.local.slide_batching import SlideBatching
    seen_local, seen_global = [], []
    monkeypatch.setattr(SlideBatching, "on_request_finished",
                        lambda self, r, now: seen_local.append((r.id, now, r.num_emitted)), raising=False)
    monkeypatch.setattr(RoundRobin, "on_request_finished",
                        lambda self, r, now: seen_global.append(r.id), raising=False)
    reqs = workload(120, 3.0)
    cfg = SimConfig(deployment=deployment, local_policy="slide_batching", global_policy="round_robin",
                    instances=2, prefill_instances=2, decode_instances=2)
    simulate(reqs, MODEL, cfg, gain_for(reqs))
    assert sorted(i for i, _, _ in seen_local) == sorted(r.id for r in reqs)
    assert sorted(seen_global) == sorted(r.id for r in reqs)
    by_id = {r.id: r for r in reqs}
    for rid, now, n in seen_local:
        assert n == by_id[rid].output_len and now == pytest.approx(by_id[rid].token_times[-1])
