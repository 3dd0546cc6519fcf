"""scripts/compare_alternatives.py: per-run metrics, seed means, capacity at 90 %
attainment, tables, and a tiny end-to-end sweep."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from proserve.scheduler.request import Request

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compare_alternatives", ROOT / "scripts" / "compare_alternatives.py")
ca = importlib.util.module_from_spec(_spec)
sys.modules["compare_alternatives"] = ca      # ProcessPoolExecutor pickles run_one by module name
_spec.loader.exec_module(ca)


def _run(series, rate, seed, **metrics):
    return {"series": series, "policy": series, "global": "round_robin", "rate": rate, "seed": seed,
            "errors": 0, "metrics": {"all": dict(metrics)}}


def _req(rid, prio, arrival, times, output_len=None):
    r = Request(rid, prio, 2.0 if prio == "high" else 1.0, 1.0, 0.1, arrival, 100, output_len or len(times))
    r.prefilled = r.prefill_len
    for t in times:
        r.emit(t)
    return r


# -- paper metrics of one run ------------------------------------------------------------------
def test_paper_metrics_by_hand():
    # a: every token on its line (1.0 + (i-1)·0.1 after arrival 0), TTLT 0.7
    a = _req("a", "high", 0.0, [0.5, 0.6, 0.7])
    # b: first token late (1.5 > 1.0), the later ones miss 1.1 and 1.2 too; TTLT 1.7
    b = _req("b", "low", 0.0, [1.5, 1.6, 1.7])
    # c: the second token misses its deadline (11.12 > 11.1), the others are on time; its
    # mean TPOT (11.15 - 10.95) / 2 is within the SLO; TTLT 1.15
    c = _req("c", "low", 10.0, [10.95, 11.12, 11.15])
    m = ca.paper_metrics([a, b, c], duration=11.15)
    assert m["all"]["token_goodput_ratio"] == pytest.approx(5 / 9)      # 3 + 0 + 2 tokens on time
    assert m["high"]["token_goodput_ratio"] == 1.0
    assert m["all"]["request_goodput_ratio"] == pytest.approx(1 / 3)
    assert m["all"]["slos_attainment"] == pytest.approx(1 / 3)          # only a stays on its line
    assert m["low"]["slos_attainment"] == 0.0
    # 10-token windows (§6): c passes (TTFT 0.95, mean TPOT 0.1), b misses its TTFT
    assert m["all"]["slos_attainment_window"] == pytest.approx(2 / 3)
    assert m["all"]["ttlt_p99"] == pytest.approx(1.7)                   # ⌈0.99·3⌉-th of 0.7, 1.15, 1.7
    assert m["all"]["ttlt_p50"] == pytest.approx(1.15)
    assert m["all"]["ttlt_unfinished"] == 0


def test_paper_metrics_count_unfinished():
    done = _req("a", "high", 0.0, [0.5, 0.6])
    stuck = _req("b", "high", 0.0, [0.5], output_len=5)                 # 1 of 5 tokens
    m = ca.paper_metrics([done, stuck], duration=1.0)
    assert m["all"]["ttlt_unfinished"] == 1
    assert m["all"]["ttlt_p99"] == pytest.approx(0.6)                   # completed requests only
    assert m["all"]["token_goodput_ratio"] == pytest.approx(3 / 7)      # tokens to produce: 2 + 5
    assert m["all"]["slos_attainment"] == 0.5


# -- seed means and capacity ---------------------------------------------------------------------
def test_aggregate_means_and_sd_over_seeds():
    runs = [_run("p", 2.0, 0, tdg_ratio=0.8, ttlt_p99=10.0), _run("p", 2.0, 1, tdg_ratio=1.0, ttlt_p99=None),
            _run("p", 3.0, 0, tdg_ratio=0.5, ttlt_p99=20.0)]
    rows = ca.aggregate(runs)
    assert [(r["series"], r["rate"]) for r in rows] == [("p", 2.0), ("p", 3.0)]
    assert rows[0]["metrics"]["all"]["tdg_ratio"] == pytest.approx(0.9)
    assert rows[0]["sd"]["all"]["tdg_ratio"] == pytest.approx(math.sqrt(0.02))
    assert rows[0]["metrics"]["all"]["ttlt_p99"] == 10.0                 # missing values left out
    assert rows[0]["seeds"] == [0, 1]
    assert rows[1]["sd"]["all"]["tdg_ratio"] == 0.0


def test_capacity_interpolates_per_seed_then_averages():
    runs = []
    for seed, atts in ((0, (1.0, 0.95, 0.85, 0.5)), (1, (1.0, 0.9, 0.7, 0.4))):
        for rate, a in zip((2.0, 3.0, 4.0, 5.0), atts):
            runs.append(_run("p", rate, seed, slos_attainment=a))
    (cap,) = ca.capacity_table(runs, "slos_attainment", 0.9)
    # seed 0 crosses 0.9 halfway between 3 and 4; seed 1 exactly at 3 (0.9 counts) → 3.0 + (0.9-0.9)…
    assert cap["per_seed"] == pytest.approx([3.5, 3.0])
    assert cap["capacity"] == pytest.approx(3.25)
    assert cap["sd"] == pytest.approx(math.sqrt(0.125))
    assert cap["bound"] == ""
    assert ca.format_capacity(cap) == "3.25 ± 0.35"


def test_capacity_bounds_and_per_gpu():
    above = [_run("a", r, 0, slos_attainment=0.99) for r in (20.0, 30.0)]
    below = [_run("b", r, 0, slos_attainment=0.5) for r in (20.0, 30.0)]
    caps = {c["series"]: c for c in ca.capacity_table(above + below, "slos_attainment", 0.9, num_gpus=12)}
    assert caps["a"]["bound"] == ">=" and caps["a"]["capacity"] == 30.0
    assert caps["a"]["per_gpu"] == pytest.approx(2.5)
    assert ca.format_capacity(caps["a"]) == "≥ 30.00 (2.50/GPU)"
    assert caps["b"]["bound"] == "<" and caps["b"]["capacity"] == 0.0
    assert ca.format_capacity(caps["b"]) == "< 20"


def test_pivot_table_layout():
    runs = [_run("x", 2.0, 0, tdg_ratio=0.91234), _run("y", 2.0, 0, tdg_ratio=0.5),
            _run("x", 4.0, 0, tdg_ratio=0.25)]
    rows = ca.aggregate(runs)
    t = ca.pivot_table(rows, "tdg_ratio", "{:.3f}").splitlines()
    assert t[0] == "| policy | 2 req/s | 4 req/s |"
    assert t[2] == "| x | 0.912 | 0.250 |"
    assert t[3] == "| y | 0.500 | - |"


# -- a tiny sweep through the simulator -----------------------------------------------------------
def test_tiny_sweep_end_to_end(tmp_path):
    from proserve.sim.__main__ import run_spec

    combos = [("slide_batching", "round_robin"), ("uniboost", "round_robin")]
    res = ca.sweep("colocated", combos, [2.0, 8.0], [0], num_requests=40, jobs=1, out=tmp_path,
                   command="test", make_plot=False)
    assert len(res["runs"]) == 4 and len(res["rows"]) == 4
    data = json.loads((tmp_path / "colocated.json").read_text())
    assert {r["series"] for r in data["rows"]} == {"slide_batching", "uniboost"}
    assert {c["series"] for c in data["capacity"]["slos_attainment"]} == {"slide_batching", "uniboost"}
    # the JSON keeps full precision: tables printed from it (--summary) round as the sweep's own
    assert ca.pivot_table(data["rows"], "tdg_ratio", "{:.3f}") == ca.pivot_table(res["rows"], "tdg_ratio", "{:.3f}")
    assert "#### colocated: TDG_Ratio" in ca.summary(tmp_path)
    md = (tmp_path / "colocated.md").read_text()
    assert "| uniboost | 2 req/s" not in md and "| uniboost |" in md and "capacity @ 90 %" in md
    for run in res["runs"]:
        m = run["metrics"]["all"]
        for key in ("tdg_ratio", "slo_attainment", "ttft_p99", "token_goodput_ratio", "slos_attainment",
                    "ttlt_p99"):
            assert key in m
        assert set(run["metrics"]) == {"all", "high", "low"}
        assert sum(run["diagnostics"]["requests_per_instance"]) == 40
    assert all("final_gamma" in r["diagnostics"] for r in res["runs"] if r["policy"] == "uniboost")
    # the same run as `python -m proserve.sim sweep` makes, same TDG
    spec = ca.make_specs("colocated", combos[:1], [8.0], [0], 40)[0]
    ref = run_spec(spec)["metrics"]["all"]
    mine = next(r for r in res["runs"] if r["series"] == "slide_batching" and r["rate"] == 8.0)
    assert mine["metrics"]["all"]["tdg_ratio"] == pytest.approx(ref["tdg_ratio"])
    assert mine["metrics"]["all"]["slo_attainment"] == pytest.approx(ref["slo_attainment"])


def test_disaggregated_series_names_and_gpus(tmp_path):
    res = ca.sweep("disaggregated", [("sarathi_fcfs", "min_load")], [20.0], [0], num_requests=30, jobs=1,
                   out=None, prefill=1, decode=1, command="test")
    assert res["rows"][0]["series"] == "sarathi_fcfs+min_load"
    cap = res["capacity"]["slos_attainment"][0]
    assert cap["num_gpus"] == 2
    assert "first-token TDG" in res["markdown"]


def test_variants_are_their_own_series():
    assert ca.series_name("colocated", "uniboost", "round_robin", {"adaptive": False}) == "uniboost[adaptive=false]"
    assert ca.series_name("colocated", "jitserve_gmax", "round_robin", {"goodput": "tokens"}) == \
        "jitserve_gmax[goodput=tokens]"
    assert ca.series_name("disaggregated", "slos_serve", "slos_serve_routing") == "slos_serve+slos_serve_routing"
    specs = ca.make_specs("colocated", [("uniboost", "round_robin", {"memguard": False}),
                                        ("uniboost", "round_robin")], [3.0], [0, 1], 10)
    assert [s.sim.local_params for s in specs] == [{"memguard": False}] * 2 + [{}] * 2
    assert [s.seed for s in specs] == [0, 1, 0, 1]


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [_run(s, r, 0, tdg_ratio=0.9, slo_attainment=0.8, ttft_p99=1.0 + r, ttlt_p99=10.0 + r,
                 token_goodput_ratio=0.7, slos_attainment=0.6)
            for s in ("slide_batching", "uniboost") for r in (2.0, 3.0)]
    for r in runs:
        r["metrics"]["high"] = {"slo_attainment": 0.9}
        r["metrics"]["low"] = {"slo_attainment": 0.7}
    ca.plot(ca.aggregate(runs), tmp_path / "p.png", title="t")
    assert (tmp_path / "p.png").stat().st_size > 1000
