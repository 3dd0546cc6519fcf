"""The capacity planner (sim/plan.py, ``python -m proserve.sim plan``): target parsing, the
searches on a stand-in simulator whose capacity is known exactly, the same searches
on the real simulator with a small synthetic workload, the progress bar and the CLI.

Every assertion reads the planner's table (its trials), never the wall clock."""

import io
import math

import pytest

from proserve.scheduler.request import ConfigError
from proserve.sim import plan as pl
from proserve.sim.__main__ import RunSpec, main, run_spec
from proserve.sim.cluster import SimConfig

CLASSES = ("high", "low")


# -- targets -----------------------------------------------------------------------------------
def test_targets_parse_with_short_names_and_spaces():
    ts = pl.parse_targets(["high:tdg_ratio>=0.95,slo >= 0.9", "all:ttft_p99<=2.5"], CLASSES)
    assert ts == [pl.Target("high", "tdg_ratio", ">=", 0.95), pl.Target("high", "slo_attainment", ">=", 0.9),
                  pl.Target("all", "ttft_p99", "<=", 2.5)]
    m = {"high": {"tdg_ratio": 0.96, "slo_attainment": 0.9}, "all": {"ttft_p99": 2.6}}
    assert [t.holds(m) for t in ts] == [True, True, False]
    assert not pl.Target("low", "tdg_ratio", ">=", 0.5).holds(m)          # no such class in the run
    assert not pl.Target("high", "tdg_ratio", ">=", 0.5).holds({"high": {"tdg_ratio": float("nan")}})


@pytest.mark.parametrize("text, says", [
    ("high", "expected CLASS:METRIC"),
    ("high:", "expected CLASS:METRIC"),
    (":tdg>=0.9", "expected CLASS:METRIC"),
    ("medium:tdg>=0.9", "unknown class 'medium' (classes: all, high, low)"),
    ("high:goodput>=0.9", "unknown metric 'goodput'"),
    ("high:tdg 0.9", "cannot read 'tdg 0.9'"),
    ("high:tdg=0.9", "operator '=' in 'tdg=0.9'"),
    ("high:tdg>=high", "tdg_ratio bound 'high' is not a number"),
    ("high:tdg>=1.5", "must be in [0, 1], got 1.5"),
    ("high:ttft_p99<=-1", "ttft_p99 bound must be >= 0"),
    ("high:tdg>=nan", "must be finite"),
    ("high:tdg>=0.9,", "empty bound"),
    ("high:tdg>=0.9,tdg_ratio>=0.8", "high:tdg_ratio>= is given twice"),
])
def test_target_errors_name_the_flag_and_the_problem(text, says):
    with pytest.raises(ConfigError) as e:
        pl.parse_targets([text], CLASSES)
    assert says in str(e.value) and repr(text) in str(e.value)


def test_no_target_is_an_error():
    with pytest.raises(ConfigError, match="at least one --target"):
        pl.parse_targets([], CLASSES)


@pytest.mark.parametrize("text, dep", [("colocated:4", pl.colocated(4)), ("disagg:2:6", pl.disagg(2, 6)),
                                       ("disaggregated:1:1", pl.disagg(1, 1))])
def test_deployments_parse(text, dep):
    assert pl.parse_deployment(text) == dep and dep.cost == sum(int(x) for x in text.split(":")[1:])


@pytest.mark.parametrize("text", ["colocated", "colocated:0", "disagg:2", "disagg:2:x", "pd:1:1", "colocated:1:1"])
def test_bad_deployments_are_refused(text):
    with pytest.raises(ConfigError, match="expected colocated:N or disagg:P:D"):
        pl.parse_deployment(text)


# -- searches on a stand-in whose capacity is exact ------------------------------------------------
def capacity(sim: SimConfig) -> float:
    """Stand-in cluster: 3 req/s per co-located instance; disaggregated, 5 req/s per
    prefill and 2 per decode instance, whichever side is short."""
    if sim.deployment == "colocated":
        return 3.0 * sim.instances
    return min(5.0 * sim.prefill_instances, 2.0 * sim.decode_instances)


def fake_run(spec) -> dict:
    ok = spec.rate <= capacity(spec.sim)
    v = 1.0 if ok else 0.5
    return {"seed": spec.seed, "wall_s": 0.0, "requests": 1, "duration_s": 1.0,
            "metrics": {"all": {"tdg_ratio": v, "slo_attainment": v}, "high": {"tdg_ratio": v, "slo_attainment": v}}}


TARGETS = pl.parse_targets(["high:tdg>=0.95,slo>=0.9"], CLASSES)


def planner(run=fake_run, seeds=(0,), jobs=1, **kw):
    return pl.Planner(RunSpec(trace="synthetic", num_requests=150), run, TARGETS, seeds, jobs, **kw)


def assert_cheapest_is_tight(res: pl.PlanResult):
    a = res.answer
    assert a is not None and a.passed
    for run in a.runs:                                  # the answer's every seed meets every target
        assert all(t.holds(run["metrics"]) for t in TARGETS)
    cheaper = [t for t in res.trials if t.deployment.cost < a.deployment.cost]
    assert cheaper and not any(t.passed for t in cheaper)
    return a


def test_cheapest_colocated_gallops_then_bisects():
    with planner() as p:
        res = p.cheapest(10.0, 16, kinds=("colocated",))
    a = assert_cheapest_is_tight(res)
    assert a.deployment == pl.colocated(4)              # 3 × 4 >= 10 > 3 × 3
    tried = [t.deployment.p for t in res.trials]
    assert tried == [1, 2, 4, 3]                        # gallop 1, 2, 4 (pass), bisect 3 (fail)
    assert not res.notes


def test_cheapest_split_walks_the_staircase():
    with planner() as p:
        res = p.cheapest(10.0, 16, kinds=("disaggregated",))
    a = assert_cheapest_is_tight(res)
    assert a.deployment == pl.disagg(2, 5)              # 5 × 2 >= 10 and 2 × 5 >= 10
    tried = {t.deployment: t.passed for t in res.trials}
    assert tried[pl.disagg(1, 15)] is False             # P = 1 cannot make it whatever D
    assert tried[pl.disagg(2, 4)] is False              # the next-cheaper split at P = 2 fails
    # after the pass at cost 7 only splits of cost <= 6 are tried, and the scan ends at P = 5
    assert all(t.deployment.cost <= 6 for t in res.trials[res.trials.index(a) + 1:])
    assert max(t.deployment.p for t in res.trials) == 5


def test_cheapest_prefers_colocated_and_bounds_the_split_search_by_it():
    with planner() as p:
        res = p.cheapest(10.0, 16)
    assert res.answer.deployment == pl.colocated(4)
    assert res.best["disaggregated"] is None and res.bounds["disaggregated"] == 4
    assert all(t.deployment.cost <= 4 for t in res.trials)
    assert "none of at most 4 instances (the co-located answer's cost" in pl.describe(res, TARGETS, 10.0, 16)


def test_nothing_passes_within_the_limit():
    with planner() as p:
        res = p.cheapest(100.0, 4)
    assert res.answer is None and not any(t.passed for t in res.trials)
    assert "no deployment of at most 4 instances meets" in pl.describe(res, TARGETS, 100.0, 4)


def test_highest_rate_brackets_the_capacity_within_the_tolerance():
    with planner() as p:
        res = p.highest_rate(pl.colocated(3), start=1.0, tol=0.02)   # capacity 9 req/s
    ok, bad = res.best["pass"], res.best["fail"]
    assert res.answer is ok and ok.passed and not bad.passed
    assert ok.rate <= 9.0 < bad.rate and (bad.rate - ok.rate) / ok.rate <= 0.02
    assert [t.rate for t in res.trials[:5]] == [1, 2, 4, 8, 16]      # galloping ×2 from the start


def test_k_ary_search_with_spare_jobs_finds_the_same_answers():
    """jobs=3 and one seed: 3 points per round, in worker processes."""
    with planner(jobs=3) as p:
        assert p.width == 3
        res = p.cheapest(10.0, 16, kinds=("colocated",))
        rate = p.highest_rate(pl.colocated(3), start=1.0, tol=0.02)
    assert res.answer.deployment == pl.colocated(4)
    assert rate.best["pass"].rate <= 9.0 < rate.best["fail"].rate


def flaky_run(spec) -> dict:
    """Passes below 3 req/s and at exactly 8; fails elsewhere: not monotone in the rate."""
    out = fake_run(spec)
    ok = spec.rate < 3.0 or spec.rate == 8.0
    for m in out["metrics"].values():
        m["tdg_ratio"] = m["slo_attainment"] = 1.0 if ok else 0.5
    return out


def test_a_monotonicity_violation_is_noted_and_the_answer_stays_on_the_safe_side():
    # three points per round: the gallop's second round tries 2, 4 and 8 together
    with planner(run=flaky_run, jobs=3) as p:
        res = p.highest_rate(pl.colocated(1), start=1.0, tol=0.05)
    assert [t.rate for t in res.trials[:4]] == [1, 2, 4, 8]
    assert 2.0 <= res.answer.rate < 3.0 and 3.0 <= res.best["fail"].rate <= 4.0
    assert res.notes == [("monotonicity violated in the rate search: 8 passes but 4 below it fails; "
                          "the answer takes the safe side")]
    assert "note: monotonicity violated" in pl.describe(res, TARGETS, tol=0.05)


def test_boundary_takes_the_safe_side_for_instances():
    p = planner()
    assert p._boundary({1: False, 2: True, 3: False, 4: True, 8: True}, "N", fail_below=True) == (3, 4)
    assert p.notes == ["monotonicity violated in N: 2 passes but 3 above it fails; the answer takes the safe side"]
    assert p._boundary({1: False, 2: False}, "N", fail_below=True) == (2, None)


def test_a_point_passes_only_if_every_seed_passes():
    def by_seed(spec):
        out = fake_run(spec)
        if spec.seed == 1 and spec.sim.instances == 4:   # seed 1 needs one more instance
            out["metrics"]["high"]["slo_attainment"] = 0.5
        return out
    with planner(run=by_seed, seeds=(0, 1)) as p:
        res = p.cheapest(10.0, 16, kinds=("colocated",))
    assert res.answer.deployment == pl.colocated(5)
    four = next(t for t in res.trials if t.deployment == pl.colocated(4))
    assert not four.passed and four.failed == ["seed 1: high:slo_attainment=0.5, needs >=0.9"]
    assert four.worst("high", "slo_attainment") == 0.5 and four.worst("high", "tdg_ratio") == 1.0


# -- the real simulator on a small synthetic workload ----------------------------------------------
SYN = {"trace": "synthetic", "num_requests": 150}


def real_planner(seeds=(0,)):
    return pl.Planner(RunSpec(**SYN), run_spec, TARGETS, seeds, jobs=1)


def test_cheapest_on_the_simulator_meets_the_target_and_one_less_fails():
    with real_planner() as p:
        res = p.cheapest(20.0, 8)
    a = assert_cheapest_is_tight(res)
    assert a.deployment.cost >= 2
    if a.deployment.kind == "colocated":
        one_less = next(t for t in res.trials if t.deployment == pl.colocated(a.deployment.p - 1))
        assert not one_less.passed
    # the table prints the answer's row marked, with the worst seed's numbers
    row = next(line for line in pl.format_trials(res, TARGETS).splitlines() if line.lstrip().startswith(f"{a.index}*"))
    assert str(a.deployment) in row and f"{a.worst('high', 'slo_attainment'):.3f}" in row and "PASS" in row


def test_highest_rate_on_the_simulator_passes_and_a_slightly_higher_rate_fails():
    with real_planner() as p:
        res = p.highest_rate(pl.colocated(1), start=2.0, tol=0.05)
    ok, bad = res.best["pass"], res.best["fail"]
    assert ok.passed and not bad.passed and ok.rate < bad.rate <= ok.rate * 1.05 + 1e-9
    for run in ok.runs:
        assert all(t.holds(run["metrics"]) for t in TARGETS)
    assert any(not t.holds(run["metrics"]) for run in bad.runs for t in TARGETS)


# -- progress bar -------------------------------------------------------------------------------
class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_is_off_when_not_a_tty_or_quiet():
    for stream, enabled in ((io.StringIO(), None), (io.StringIO(), True), (FakeTTY(), False)):
        bar = pl.Progress(stream, enabled)
        bar.add(3)
        bar.show("colocated:1 @ 2 req/s")
        bar.done()
        bar.close()
        assert not bar.enabled and stream.getvalue() == ""


def test_progress_bar_draws_on_a_tty():
    tty = FakeTTY()
    bar = pl.Progress(tty)
    bar.add(2)
    bar.show("colocated:2 @ 4 req/s")
    bar.done()
    bar.done()
    bar.close()
    text = tty.getvalue()
    assert "\r" in text and "2/2 sims" in text and "colocated:2 @ 4 req/s" in text and text.endswith("\n")


def test_planner_drives_the_bar():
    tty = FakeTTY()
    with planner(progress=pl.Progress(tty)) as p:
        p.cheapest(10.0, 16, kinds=("colocated",))
    assert "4/4 sims" in tty.getvalue()


# -- command line -------------------------------------------------------------------------------
def test_cli_plan_prints_the_table_and_the_answer(capsys, tmp_path):
    rc = main(["plan", "--rate", "20", "--target", "high:tdg>=0.9", "--trace", "synthetic",
               "--num-requests", "120", "--max-instances", "4", "--kinds", "colocated", "--jobs", "1",
               "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc in (0, 1) and "search step" in out and "answer at 20 req/s" in out
    assert err == ""                                     # pytest's stderr is not a tty: no bar
    assert (tmp_path / "plan.json").exists() and (tmp_path / "table.txt").read_text().startswith(" #")


@pytest.mark.parametrize("argv, says", [
    (["plan", "--target", "high:tdg>=0.9"], "exactly one of --rate"),
    (["plan", "--rate", "2", "--deployment", "colocated:1", "--target", "high:tdg>=0.9"], "exactly one of --rate"),
    (["plan", "--rate", "2"], "at least one --target"),
    (["plan", "--rate", "2", "--target", "vip:tdg>=0.9"], "unknown class 'vip'"),
    (["plan", "--deployment", "colo:2", "--target", "high:tdg>=0.9"], "expected colocated:N or disagg:P:D"),
    (["plan", "--rate", "2", "--target", "high:tdg>=0.9", "--kinds", "pd"], "unknown deployment kind 'pd'"),
    (["plan", "--rate", "2", "--target", "high:tdg>=0.9", "--seeds", "0,0"], "distinct"),
    (["plan", "--rate", "-1", "--target", "high:tdg>=0.9"], "--rate must be a number > 0"),
])
def test_cli_plan_errors_exit_2_with_a_message(capsys, argv, says):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_cli_plan_with_ttft_slo_override_reaches_the_workload():
    from proserve.sim.__main__ import _spec_from, build_parser
    args = build_parser().parse_args(["plan", "--rate", "1", "--target", "high:tdg>=0.9", "--ttft-slo", "0.5",
                                      "--tpot-slo", "0.05"])
    spec = _spec_from(args, args.local, args.glob, args.rate, 0)
    assert {(c.ttft_slo, c.tpot_slo) for c in spec.classes.values()} == {(0.5, 0.05)}
    assert math.isclose(spec.classes["high"].weight, 2.0)


def test_shaped_workload_is_the_load_generators():
    """--prompt-div/--output-div/--max-model-len build what bench.loadgen (and bench.engine_policies)
    send to the real CPU cluster, so a plan can be checked against it request for request."""
    from proserve.bench.loadgen.workload import make_workload
    from proserve.sim.__main__ import _spec_from, _workload, build_parser
    args = build_parser().parse_args(["plan", "--rate", "8", "--target", "high:tdg>=0.9", "--num-requests", "60",
                                      "--prompt-div", "4", "--output-div", "4", "--max-model-len", "2048",
                                      "--ttft-slo", "0.5", "--tpot-slo", "0.05"])
    spec = _spec_from(args, args.local, args.glob, 8.0, 0)
    got = _workload(spec)
    want = make_workload("azure", 8.0, 60, 0, spec.classes, None, 4.0, 4.0, None, 2048)
    assert [(r.id, r.priority, r.arrival, r.prompt_len, r.output_len, r.ttft_slo) for r in got] == \
        [(r.id, r.priority, r.arrival, r.prompt_len, r.output_len, r.ttft_slo) for r in want]
    assert max(r.prompt_len for r in got) < 2048 and {r.tpot_slo for r in got} == {0.05}


def always(ok: bool):
    def run(spec):
        out = fake_run(spec)
        for m in out["metrics"].values():
            m["tdg_ratio"] = m["slo_attainment"] = 1.0 if ok else 0.0
        return out
    return run


def test_highest_rate_gives_up_at_the_rate_limits():
    with planner(run=always(False)) as p:
        res = p.highest_rate(pl.colocated(1), start=1.0)
    assert res.answer is None and min(t.rate for t in res.trials) >= pl.RATE_MIN
    assert "meets the targets at no rate tried (down to" in pl.describe(res, TARGETS, tol=0.02)
    with planner(run=always(True)) as p:
        res = p.highest_rate(pl.colocated(1), start=1.0)
    assert res.answer.rate == max(t.rate for t in res.trials) and res.answer.rate <= pl.RATE_MAX
    assert "passes at every rate tried, up to" in pl.describe(res, TARGETS, tol=0.02)
