"""SlideBatching inside a real vLLM engine: the admission order the engine
produces is the one Algorithm 1 prescribes.

Three scenarios on one prefill-only engine (φ_p), each submitted at once:

* light load: three short prompts, every one NORMAL → earliest deadline first,
  even though the latest deadline belongs to the high-priority request;
* overload: four long low-priority prompts that arrived earlier, then a short
  high-priority one whose deadline is inside φ_p → URGENT, and by density it
  is admitted ahead of all the long ones;
* the control: the same, except the short request's deadline lies well beyond
  φ_p → it is NORMAL and waits behind the URGENT long prompts.

The expected order is computed here with the pure ``scheduler`` policy on the
same requests, for β anywhere in [0.3, 3] (the engine's β moves as it measures
steps); the scenario sizes are derived from the latency model so the margins
hold whatever the profiled coefficients are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from profiler import modelfile
from scheduler.config import default_classes
from scheduler.estimator import Estimator, OnlineCorrector
from scheduler.local.base import PREFILL_ONLY, InstanceView
from scheduler.local.slide_batching import SlideBatching
from scheduler.request import Request

ROOT = Path(__file__).resolve().parent.parent
LONG = 1800


def _model():
    path = os.environ.get("PROSERVE_TEST_LATENCY_MODEL") or str(modelfile.CPU_TINY)
    return path, modelfile.load(path)


def scenarios(model) -> list[dict]:
    t_c = model.t_c
    phi = 4 * model.prefill_time(LONG) + model.prefill_time(40) + 5 * t_c    # φ_p of the overload queue
    longs = [{"tag": f"L{i}", "prompt_len": LONG - 32 * i, "priority_class": "low", "ttft_slo": 1.0,
              "age": 1.0 - 0.05 * phi + 0.001 * i} for i in range(4)]      # remain ≈ 0.05·φ_p: URGENT
    return [
        {"name": "light", "requests": [
            {"tag": "A", "prompt_len": 64, "priority_class": "low", "ttft_slo": 1.0, "age": 0.5},
            {"tag": "B", "prompt_len": 96, "priority_class": "high", "ttft_slo": 1.0, "age": 0.0},
            {"tag": "C", "prompt_len": 128, "priority_class": "low", "ttft_slo": 1.0, "age": 0.2}]},
        {"name": "overload", "requests": longs + [
            {"tag": "H", "prompt_len": 40, "priority_class": "high", "ttft_slo": 0.2 * phi, "age": 0.0}]},
        {"name": "control", "requests": longs + [
            {"tag": "H", "prompt_len": 40, "priority_class": "high", "ttft_slo": max(1.0, 5 * phi), "age": 0.0}]},
    ]


def predicted_order(model, sc: dict, beta: float) -> list[tuple[str, bool]]:
    """(tag, urgent) in the order SlideBatching's first plan takes them."""
    classes = default_classes()
    est = Estimator(model, OnlineCorrector())
    est.corrector.beta = beta
    now = 1000.0
    reqs = []
    for r in sc["requests"]:
        pc = classes[r["priority_class"]]
        reqs.append(Request(id=r["tag"], priority=pc.name, weight=pc.weight, ttft_slo=r["ttft_slo"],
                            tpot_slo=pc.tpot_slo, arrival=now - r["age"], prompt_len=r["prompt_len"],
                            prefill_len=r["prompt_len"]))
    pol = SlideBatching(est, classes=classes)
    Q = list(reqs)
    t_min = pol._annotate(Q, now)
    pol._mark_urgent(Q, max(t_min, pol.eta), PREFILL_ONLY)
    ordered, _, _ = pol._order(Q)
    plan = pol.schedule(InstanceView(now=now, waiting=reqs, mode=PREFILL_ONLY))
    assert plan.prefill, "the first plan admits something"
    return [(r.id, r.urgent) for r in ordered]


def test_scenarios_are_robust_to_beta():
    """Precondition of the engine test (no engine needed): the expected order is
    the same for any β the engine may have reached, and it is the one described."""
    _, model = _model()
    for sc in scenarios(model):
        orders = {tuple(predicted_order(model, sc, b)) for b in (0.3, 1.0, 3.0)}
        assert len(orders) == 1, (sc["name"], orders)
    light, over, ctrl = (predicted_order(model, sc, 1.0) for sc in scenarios(model))
    assert light == [("A", False), ("C", False), ("B", False)]           # EDF
    assert over[0] == ("H", True) and all(u for _, u in over)            # URGENT by density: H first
    assert ctrl[-1] == ("H", False) and all(u for _, u in ctrl[:-1])     # H NORMAL, behind URGENT longs


def _admissions(records: list[dict], lens: dict[int, str]) -> list[tuple[int, str]]:
    """(step, tag) of every admission of a scenario's requests, in engine order."""
    out = []
    for rec in records:
        for _rid, _cls, plen, _chunk in rec.get("admitted", []):
            if plen in lens:
                out.append((rec["step"], lens[plen]))
    return out


@pytest.mark.vllm
def test_engine_admits_in_slide_batching_order(tmp_path):
    model_path, model = _model()
    scs = scenarios(model)
    spec = tmp_path / "scenarios.json"
    spec.write_text(json.dumps(scs))
    record = tmp_path / "steps.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "engine_order_run.py"), str(spec), str(record),
                        model_path], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    done = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [d["name"] for d in done] == [sc["name"] for sc in scs]
    records = [json.loads(line) for line in record.read_text().splitlines()]
    # split the step records by scenario: scenario k's steps start after scenario k-1 was submitted
    bounds = [d["submitted_at"] for d in done] + [float("inf")]
    for k, sc in enumerate(scs):
        recs = [r for r in records if r.get("plan") and bounds[k] <= r["plan"]["now"] < bounds[k + 1]]
        lens = {r["prompt_len"]: r["tag"] for r in sc["requests"]}
        adm = _admissions(recs, lens)
        assert sorted(t for _, t in adm) == sorted(lens.values()), (sc["name"], adm)
        got = [t for _, t in adm]
        want = [t for t, _ in predicted_order(model, sc, 1.0)]
        first_plan = recs[0]["plan"]
        if sc["name"] == "light":
            assert got == want == ["A", "C", "B"], adm
            assert adm[0][0] == adm[-1][0], "light load: all three fit one step"
            assert first_plan["n_urgent"] == 0
        elif sc["name"] == "overload":
            assert got[0] == "H", f"the URGENT high-priority short request is admitted first: {adm}"
            assert adm[0][0] == recs[0]["step"], "…in the first step"
            assert first_plan["n_normal"] == 0 and first_plan["n_urgent"] == 5
        else:
            assert got[-1] == "H", f"a NORMAL request waits behind the URGENT ones: {adm}"
            assert first_plan["n_urgent"] == 4 and first_plan["n_normal"] == 1
        # the engine ran the plan's chunks: the first plan's items were admitted with those sizes
        planned = {rid: n for rid, n, _ in first_plan["items"]}
        first = recs[0]
        for rid, _cls, plen, chunk in first["admitted"]:
            assert planned.get(rid) == chunk, (sc["name"], rid, chunk, planned)
