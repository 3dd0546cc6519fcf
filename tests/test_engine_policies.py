"""bench.engine_policies: the pure parts (metrics parsing, overhead, step
statistics, the table, the workloads it replays). The benchmark itself needs
engines and runs by hand: `flock /tmp/proserve-engine.lock python -m proserve.bench.engine_policies`."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from proserve.bench import engine_policies as ep
from proserve.bench import loadgen as lg

METRICS = """# HELP proserve:steps_total Executed engine steps
# TYPE proserve:steps_total counter
proserve:steps_total{policy="slide_batching"} 200.0
proserve:step_seconds_total{policy="slide_batching"} 2.5
proserve:schedule_seconds_total{policy="slide_batching"} 0.05
proserve:beta{policy="slide_batching"} 1.25
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
garbage line
"""


def test_parse_metrics_and_overhead():
    m = ep.parse_metrics(METRICS)
    assert m["proserve:steps_total"] == 200 and m["proserve:beta"] == 1.25
    assert m["vllm:num_requests_running"] == 3
    before = {"proserve:steps_total": 100, "proserve:step_seconds_total": 1.5,
              "proserve:schedule_seconds_total": 0.03, "vllm:num_preemptions_total": 1.0}
    o = ep.overhead(before, m)
    assert o["steps"] == 100
    assert o["sched_ms_per_step"] == pytest.approx(0.2) and o["step_ms"] == pytest.approx(10.0)
    assert o["sched_share"] == pytest.approx(0.02) and o["preemptions"] == 0
    assert math.isnan(ep.overhead(m, m)["sched_ms_per_step"])


def test_step_stats_window(tmp_path):
    p = tmp_path / "steps.jsonl"
    lines = [{"wall": 10.0 + i, "time": t, "prefills": pf, "decodes": [], "beta": b,
              "plan": {"n_urgent": u}}
             for i, (t, pf, b, u) in enumerate([(0.01, [[100, 0]], 1.0, 0), (0.2, [[500, 0], [20, 4]], 1.3, 2),
                                                 (0.03, [], 0.9, 0), (9.0, [[1, 0]], 5.0, 0)])]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    s = ep.step_stats(p, 10.0, 12.5, tpot_slo=0.05)     # the last step is outside the window
    assert s["steps"] == 3 and s["max_prefill_tokens"] == 520 and s["step_max_ms"] == pytest.approx(200)
    assert s["steps_over_tpot_slo"] == pytest.approx(1 / 3) and s["steps_with_urgent"] == pytest.approx(1 / 3)
    assert (s["beta_min"], s["beta_max"], s["beta_last"]) == (0.9, 1.3, 0.9)
    assert ep.step_stats(tmp_path / "missing", 0, 1, 0.05) == {"steps": 0}


def test_same_requests_for_every_policy_and_rates_by_duration():
    args = SimpleNamespace(duration=10.0, seed=0, prompt_div=4.0, output_div=4.0, max_model_len=2048)
    classes = lg.load_classes(None, 0.5, 0.05)
    a, b = ep.workload(args, 3.0, classes), ep.workload(args, 3.0, classes)
    assert len(a) == 30
    assert [(r.id, r.priority, r.prompt_len, r.output_len, r.arrival) for r in a] == \
           [(r.id, r.priority, r.prompt_len, r.output_len, r.arrival) for r in b]
    assert {r.ttft_slo for r in a} == {0.5} and {r.tpot_slo for r in a} == {0.05}
    assert ep.POLICIES["stock_priority"].class_body == {"high": {"priority": 0}, "low": {"priority": 1}}
    assert ep.POLICIES["stock_fcfs"].class_body is None and ep.POLICIES["slide_batching"].class_body is None


def test_table_has_every_policy_rate_class():
    def metrics(tdg):
        row = {"requests": 10, "errors": 0, "tdg_ratio": tdg, "slo_attainment": 0.5, "ttft_p50": 0.1,
               "ttft_p99": 0.4, "tpot_p50": 0.01, "tpot_p99": 0.04}
        return {"all": row, "high": dict(row, tdg_ratio=tdg + 0.01), "low": dict(row, errors=1)}

    rows = [{"policy": p, "rate": r, "metrics": metrics(0.5), "beta": {},
             "overhead": {"sched_ms_per_step": 0.2, "step_ms": 10.0, "sched_share": 0.02},
             "step_stats": {"steps": 5, "step_p99_ms": 80.0, "beta_min": 0.95, "beta_max": 1.2}}
            for p in ("slide_batching", "stock_fcfs") for r in (3.8, 7.59)]
    t = ep.format_table(rows).splitlines()
    assert len(t) == 2 + 4 * 3
    assert "sched_ms/step" in t[0] and "beta_min-max" in t[0]
    assert t[2].split()[:3] == ["slide_batching", "3.8", "all"] and "2.00%" in t[2] and "0.95-1.20" in t[2]
    assert t[4].split()[:5] == ["slide_batching", "3.8", "low", "10", "1"]


def test_cli_rejects_unknown_policy(capsys):
    assert ep.main(["--policies", "slide_batching,nope"]) == 2
    assert "unknown nope" in capsys.readouterr().err
