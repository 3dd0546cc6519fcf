"""scripts/bench_fidelity.py's pure parts: matching step records to requests, the
start-to-start step samples, and the comparison (its engines are exercised by running it)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_fidelity", ROOT / "scripts" / "bench_fidelity.py")
bf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bf)


def step(n, wall, time, prefills=(), decodes=(), admitted=(), scheduled=()):
    return {"step": n, "wall": wall, "time": time, "prefills": [list(p) for p in prefills],
            "decodes": list(decodes), "admitted": [list(a) for a in admitted],
            "scheduled": [list(s) for s in scheduled], "sched_s": 0.0, "finished": [], "plan": None}


def test_lifecycle_finds_first_step_and_prefill_end_across_chunks():
    steps = [step(1, 1.10, 0.10, [(64, 0)], admitted=[("a", "high", 100, 64)], scheduled=[("a", 64)]),
             step(2, 1.25, 0.10, [(36, 64)], scheduled=[("a", 36)]),
             step(3, 1.30, 0.04, decodes=[100], scheduled=[("a", 1)])]
    (a,) = bf._lifecycle(steps)
    assert a["first_start"] == pytest.approx(1.0) and a["prefill_end"] == pytest.approx(1.25)


def test_served_samples_are_start_to_start_and_skip_idle_pauses(tmp_path):
    path = tmp_path / "steps.jsonl"
    steps = [step(1, 1.010, 0.010, decodes=[10]), step(2, 1.021, 0.010, decodes=[11]),  # 1 ms gap
             step(3, 2.000, 0.010, decodes=[12]), step(4, 2.011, 0.010, decodes=[13])]   # idle before 3
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    samples = bf.served_samples(path, [(0.0, 10.0)])
    assert [s.time for s in samples] == pytest.approx([0.011, 0.011])   # steps 1 and 3; 2 is followed by idle
    assert [s.decodes for s in samples] == [(10,), (12,)]


def test_compare_reports_relative_latency_errors_and_absolute_ratio_differences():
    figs = dict(ttft_p50=0.1, ttft_p90=0.2, ttft_p99=0.4, tpot_p50=0.01, tpot_p90=0.02, tpot_p99=0.04,
                tdg_ratio=0.9, slo_attainment=0.8, requests=10, errors=0)
    sim = {**figs, "ttft_p50": 0.105, "ttft_p90": 0.25, "tdg_ratio": 0.92}
    row = bf.compare({"all": figs}, {"all": sim})["all"]
    assert row["ttft_p50"][2] == pytest.approx(0.05) and row["ttft_p90"][2] == pytest.approx(0.25)
    assert row["tdg_ratio"][2] == pytest.approx(0.02) and not row["pass"]      # P90 off by 25 %
    ok = bf.compare({"all": figs}, {"all": {**figs, "ttft_p90": 0.21}})["all"]
    assert ok["pass"] and math.isnan(bf.rel(1.0, 0.0))
