"""The memory-light simulator path (sim/stream.py) and the workload streams it reads
(bench.workloads.repeat_arrivals / iter_tagged): same decisions and metrics as a plain
run, and nothing kept per request."""

import gc
import itertools

import pytest

from proserve.bench.traces import TraceRecord, load_trace
from proserve.bench.workloads import (
    build_workload,
    iter_tagged,
    repeat_arrivals,
    scale_to_rate,
    tag_priorities,
)
from proserve.profiler.modelfile import BUNDLED, load
from proserve.scheduler import ConfigError, GainConfig, Request, summarize
from proserve.sim.cluster import SimConfig, simulate
from proserve.sim.report import MetricsAccumulator
from proserve.sim.stream import simulate_stream

MODEL = load(BUNDLED)
TRACE = "bench/data/azure_conv_2023.csv"


def workload(n=400, rate=6.0, seed=0):
    return build_workload(TRACE, rate=rate, num_requests=n, seed=seed, fmt="azure")


def gain_for(reqs):
    return GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs])


@pytest.mark.parametrize("cfg", [
    {"deployment": "colocated", "instances": 2},
    {"deployment": "disaggregated", "prefill_instances": 1, "decode_instances": 2},
    {"deployment": "colocated", "instances": 1, "noise_cv": 0.2, "local_policy": "sarathi_fcfs"},
])
def test_stream_equals_a_plain_run(cfg):
    a, b = workload(), workload()
    g = gain_for(a)
    plain = simulate(a, MODEL, SimConfig(**cfg), g)
    stream = simulate_stream(iter(b), MODEL, SimConfig(**cfg), g)
    assert (stream.steps, stream.preemptions, stream.requests, stream.unended) == \
        (plain.steps, plain.preemptions, len(a), 0)
    assert stream.duration == pytest.approx(plain.duration, abs=1e-12)
    want = {k: v.as_dict() for k, v in summarize(plain.requests, g, plain.duration).items()}
    got = {k: v.as_dict() for k, v in stream.metrics.items()}
    assert list(got) == list(want) == ["all", "high", "low"]
    for cls, ms in want.items():
        for k, v in ms.items():
            assert got[cls][k] == (v if isinstance(v, (str, int)) else pytest.approx(v, rel=1e-12, nan_ok=True)), \
                (cls, k)


def test_accumulator_equals_summarize_on_unfinished_and_failed_requests(make_req):
    done = make_req(prompt=10, output=3, arrival=0.0, weight=2.0)     # high, every deadline met
    done.advance_prefill(10, 0.5)
    done.decode_steps([0.55, 0.6])
    late = make_req(prompt=10, output=2, arrival=0.0, weight=2.0)     # high, first token late
    late.advance_prefill(10, 1.5)
    late.decode_step(1.55)
    partial = make_req(prompt=10, output=5, arrival=1.0)              # low, still decoding
    partial.advance_prefill(10, 1.2)
    failed = make_req(prompt=10, output=4, arrival=2.0)               # low, failed without a token
    failed.fail("does not fit")
    rs = [done, late, partial, failed]
    g = GainConfig(3.0, 1.0)
    acc = MetricsAccumulator(g)
    for r in reversed(rs):
        acc.add(r)
    want = {k: v.as_dict() for k, v in summarize(rs, g, 10.0).items()}
    got = {k: v.as_dict() for k, v in acc.result(10.0).items()}
    assert list(got) == list(want) == ["all", "high", "low"]
    for cls, ms in want.items():
        for k, v in ms.items():
            assert got[cls][k] == (v if isinstance(v, str) else pytest.approx(v, nan_ok=True)), (cls, k)
    assert got["high"]["slo_attainment"] == 0.5 and got["low"]["finished"] == 1
    assert acc.count == 4


def test_stream_keeps_no_request():
    ids = set()

    def gen():
        for r in workload(300, 8.0):
            ids.add(r.id)
            yield r

    seen = []
    res = simulate_stream(gen(), MODEL, SimConfig(deployment="disaggregated", prefill_instances=1,
                                                  decode_instances=2), on_end=lambda r: seen.append(r.id))
    assert res.requests == 300 and len(seen) == 300 and set(seen) == ids
    gc.collect()
    alive = [o for o in gc.get_objects() if isinstance(o, Request) and o.id in ids]
    assert alive == []


def test_stream_refuses_unsorted_or_empty_input():
    reqs = workload(20)
    reqs[3], reqs[10] = reqs[10], reqs[3]
    with pytest.raises(ConfigError, match="arrival order"):
        simulate_stream(iter(reqs), MODEL)
    with pytest.raises(ConfigError, match="no requests"):
        simulate_stream(iter([]), MODEL)


# -- workload streams --------------------------------------------------------------------------------
def test_repeat_arrivals_plays_the_trace_back_to_back():
    recs = [TraceRecord(0.0, 10, 1), TraceRecord(1.0, 20, 2), TraceRecord(3.0, 30, 3)]
    out = list(repeat_arrivals(recs, 10.0))
    # span 3, mean gap 1.5: period 4.5
    assert [r.arrival for r in out] == [0.0, 1.0, 3.0, 4.5, 5.5, 7.5, 9.0]
    assert [r.prompt_len for r in out] == [10, 20, 30] * 2 + [10]
    assert list(repeat_arrivals(recs, 3.0)) == recs[:2]


def test_repeat_arrivals_keeps_a_scaled_traces_rate():
    recs = scale_to_rate(load_trace(TRACE, limit=2000), 40.0)
    out = list(repeat_arrivals(recs, 600.0))
    assert len(out) == pytest.approx(40.0 * 600, rel=0.001)
    assert all(b.arrival >= a.arrival for a, b in itertools.pairwise(out))


@pytest.mark.parametrize("recs, says", [
    ([TraceRecord(0.0, 1, 1)], "at least two records"),
    ([TraceRecord(0.0, 1, 1), TraceRecord(0.0, 2, 1)], "at least two records"),
])
def test_repeat_arrivals_needs_an_arrival_process(recs, says):
    with pytest.raises(ConfigError, match=says):
        next(repeat_arrivals(recs, 10.0))


def test_iter_tagged_equals_tag_priorities_whatever_the_chunk():
    recs = load_trace(TRACE, limit=3000)
    want = [(r.id, r.priority, r.weight, r.arrival, r.prompt_len, r.output_len)
            for r in tag_priorities(recs, shares={"high": 0.3, "low": 0.7}, seed=5)]
    for chunk in (1, 1000, 65536):
        got = [(r.id, r.priority, r.weight, r.arrival, r.prompt_len, r.output_len)
               for r in iter_tagged(iter(recs), shares={"high": 0.3, "low": 0.7}, seed=5, chunk=chunk)]
        assert got == want


def test_scale_script_end_to_end(tmp_path):
    """scripts/bench_sim_scale.py on a tiny cluster and a minute of arrivals: every request of the
    repeated trace is simulated and counted (no assertion on the wall time)."""
    import importlib.util
    import json
    spec = importlib.util.spec_from_file_location("bench_sim_scale", "scripts/bench_sim_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "rows.json"
    rc = mod.main(["--hours", str(30 / 3600), "--rate", "10", "--instances", "2", "--split", "1:1",
                   "--progress", "0", "--limit", "1e9", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    want = sum(1 for _ in repeat_arrivals(scale_to_rate(load_trace(TRACE), 10.0), 30.0))
    assert rc == 0 and [r["deployment"] for r in rows] == ["colocated", "disaggregated"]
    assert all(r["requests"] == want and r["unended"] == 0 and r["metrics"]["all"]["requests"] == want
               for r in rows)
    assert rows[0]["rate"] == pytest.approx(10.0)
