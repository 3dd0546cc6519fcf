"""The online correction with a scale and a per-step offset (a step takes β·T_pd + δ).

The corrector, fed synthetic step records: a multiplicative slowdown (every step
1.5x) and an additive one (every step +5 ms, a CPU quota's wait) are both back
within 10 % within 50 steps; the paper's β alone is not, for the additive one.
Then the ill-conditioned fallback, the bounds, ``adopt`` with δ, how δ enters the
costs (once per step) and the two places outside ``scheduler/cost.py`` that turn
a correction into time (GoRouting's queue estimate, SLOs-Serve's Time2BS), the
simulator, and what the worker reports and the dispatcher reads.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from proserve.scheduler import ConfigError, Estimator, GainConfig, LatencyModel, Request
from proserve.scheduler.cost import StepCosts
from proserve.scheduler.estimator import SCALE, SCALE_OFFSET, OnlineCorrector

MODEL = LatencyModel(a_p=1e-8, b_p=2e-9, c_p=5e-5, a_d=2e-7, b_d=1e-4, t_c=2e-3)
SLOWDOWN_AT = 200     # steps of the unchanged engine before the slowdown
FIXED = 0.005         # the additive slowdown: seconds added to every step


def slowdown(kind: str, x: float) -> float:
    """A step's measured time after the slowdown, where the model says ``x``."""
    return 1.5 * x if kind == "multiplicative" else x + FIXED


def track(mode: str, kind: str, steps: int = 400, seed: int = 0) -> tuple[list[float], OnlineCorrector]:
    """Relative error |estimate − measured| / measured of each step after the slowdown, where
    the estimate is the corrected one the step was planned with; steps of mixed size
    (model times 2-60 ms) on a clock that advances by each measured time."""
    rng = random.Random(seed)
    c = OnlineCorrector(mode=mode)
    now, errs = 0.0, []
    for i in range(SLOWDOWN_AT + steps):
        x = rng.uniform(0.002, 0.06)
        y = x if i < SLOWDOWN_AT else slowdown(kind, x)
        if i >= SLOWDOWN_AT:
            errs.append(abs(c.beta * x + c.delta - y) / y)
        now += y
        c.observe(y, x, now, 1)
    return errs, c


def steps_until_within(errs: list[float], tol: float = 0.10) -> int | None:
    """Steps after which every later step's estimate is within ``tol`` (None: never)."""
    bad = [i for i, e in enumerate(errs) if e >= tol]
    if not bad:
        return 0
    return bad[-1] + 1 if bad[-1] + 1 < len(errs) else None


# -- convergence ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["multiplicative", "additive"])
def test_scale_and_offset_converge_within_50_steps(kind):
    errs, c = track(SCALE_OFFSET, kind)
    n = steps_until_within(errs)
    assert n is not None and n <= 50, n
    beta, delta = (1.5, 0.0) if kind == "multiplicative" else (1.0, FIXED)
    assert c.beta == pytest.approx(beta, rel=1e-3) and c.delta == pytest.approx(delta, abs=1e-5)


def test_scale_alone_tracks_a_multiplicative_slowdown_but_not_an_additive_one():
    """The paper's β: exact for a multiplicative slowdown, never within 10 % of every step
    for an additive one (one factor over-corrects small steps, under-corrects large ones)."""
    errs, c = track(SCALE, "multiplicative")
    assert steps_until_within(errs) <= 50 and c.delta == 0.0
    errs, c = track(SCALE, "additive")
    assert steps_until_within(errs) is None
    assert c.delta == 0.0 and max(errs[-100:]) > 0.3


def test_runs_of_steps_count_the_offset_once_per_step():
    """The simulator observes a run of k decode steps at once (``steps=k``): δ is per step."""
    rng = random.Random(1)
    c = OnlineCorrector()
    now = 0.0
    for _ in range(300):
        k = rng.choice([1, 1, 4, 16, 64])
        x = sum(rng.uniform(0.002, 0.03) for _ in range(k))
        y = 1.2 * x + k * FIXED
        now += y
        c.observe(y, x, now, k)
    assert c.beta == pytest.approx(1.2, rel=1e-3) and c.delta == pytest.approx(FIXED, rel=1e-3)


# -- the ill-conditioned window -------------------------------------------------------------------

def test_steps_of_one_size_fit_the_scale_alone_as_the_paper_does():
    """Every step the same size: scale and offset cannot be told apart. From δ = 0 the
    corrector then computes exactly the paper's β, step for step."""
    both, alone = OnlineCorrector(mode=SCALE_OFFSET), OnlineCorrector(mode=SCALE)
    now = 0.0
    for i in range(300):
        x = 0.02
        y = x if i < 100 else x + FIXED
        now += y
        assert both.observe(y, x, now, 1) == alone.observe(y, x, now, 1)
        assert both.delta == 0.0
    assert both.beta == pytest.approx((0.02 + FIXED) / 0.02)


def test_steps_of_one_size_hold_the_offset_learned_before():
    """δ learned from steps of mixed size is held while the steps are all alike (then only
    the scale moves), and the steps alike are still estimated right."""
    rng = random.Random(2)
    c = OnlineCorrector()
    now = 0.0
    for _ in range(300):                          # mixed sizes: δ is found
        x = rng.uniform(0.002, 0.06)
        now += x + FIXED
        c.observe(x + FIXED, x, now, 1)
    assert c.delta == pytest.approx(FIXED, rel=1e-3)
    deltas = []
    for _ in range(300):                          # one size, and 1.3x slower
        x = 0.02
        y = 1.3 * x + FIXED
        now += y
        c.observe(y, x, now, 1)
        deltas.append(c.delta)
    # once the window (1 s, ~30 of these steps) holds only steps of this size, δ keeps the
    # last fit (close to where it was) and the scale alone moves; the estimate is right
    assert deltas[100] == pytest.approx(deltas[-1], rel=1e-6) and deltas[-1] == pytest.approx(FIXED, rel=0.2)
    assert c.beta * 0.02 + c.delta == pytest.approx(1.3 * 0.02 + FIXED, rel=1e-6)


def test_few_samples_are_ill_conditioned():
    c = OnlineCorrector(min_samples=4)
    c.observe(0.012, 0.002, 1.0, 1)
    c.observe(0.065, 0.06, 1.1, 1)   # two very different steps: still too few to fit δ
    assert c.delta == 0.0


# -- bounds --------------------------------------------------------------------------------------

def test_bounds_of_scale_and_offset():
    c = OnlineCorrector(delta_max=0.004, window_s=1000.0)
    rng = random.Random(3)
    now = 0.0
    for _ in range(200):                          # a large fixed cost: δ stops at delta_max,
        x = rng.uniform(0.002, 0.06)              # β takes what it can of the rest
        now += x + 0.05
        c.observe(x + 0.05, x, now, 1)
    assert c.delta == pytest.approx(0.004) and c.delta <= 0.004 and c.lo <= c.beta <= c.hi
    assert c.beta > 2
    c = OnlineCorrector(window_s=1000.0)
    for _ in range(300):                          # 100x slower: β stops at its bound, δ takes the rest
        x = rng.uniform(0.002, 0.06)
        now += 100 * x
        c.observe(100 * x, x, now, 1)
    assert c.beta == pytest.approx(c.hi) and c.beta <= c.hi and 0 < c.delta <= c.delta_max
    c = OnlineCorrector()
    for _ in range(300):                          # large steps slower than the model in proportion,
        x = rng.uniform(0.002, 0.06)              # small ones not: the best line has a negative
        y = 2 * x - 0.003                         # offset; δ stays 0 and β is the paper's
        now += y
        c.observe(y, x, now, 1)
    assert c.delta == 0.0 and 1 < c.beta < 2


def test_bad_measurements_are_ignored():
    c = OnlineCorrector()
    for t_real, t_est, steps in [(float("nan"), 0.01, 1), (0.01, 0.0, 1), (-1.0, 0.01, 1),
                                 (0.01, float("inf"), 1), (0.01, 0.01, 0)]:
        c.observe(t_real, t_est, 1.0, steps)
    assert (c.beta, c.delta) == (1.0, 0.0)


@pytest.mark.parametrize("kw", [{"mode": "offset"}, {"delta_max": -1}, {"delta_max": float("inf")},
                                {"min_spread": 0}, {"min_samples": 1}])
def test_invalid_corrector_settings(kw):
    with pytest.raises(ConfigError):
        OnlineCorrector(**kw)


# -- the estimator: costs, adopt ---------------------------------------------------------------------

def test_offset_joins_the_per_step_constant_only():
    c = StepCosts.of(MODEL, 1.7, 0.003)
    u = MODEL.unit
    assert c.t_c == pytest.approx(1.7 * MODEL.t_c + 0.003)
    assert c.prefill(300, 100) == pytest.approx(1.7 * u.prefill(300, 100))   # a request's share: no δ
    assert c.decode(500) == pytest.approx(1.7 * u.decode(500))
    assert c.batch([(300, 100)], [500, 20]) == pytest.approx(1.7 * u.batch([(300, 100)], [500, 20]) + 0.003)
    run = c.decode_run(1000, 3, 5)                                         # δ in each of the 5 steps
    assert np.allclose(run, 1.7 * u.decode_run(1000, 3, 5) + 0.003)
    assert c.decode_run_total(1000, 3, 5) == pytest.approx(run.sum())
    n = c.max_chunk(100, 10_000, 0.05)                                     # GETMAXCHUNK prices no t_c
    assert n == StepCosts.of(MODEL, 1.7).max_chunk(100, 10_000, 0.05)


def test_estimator_adopts_scale_and_offset_within_its_bounds():
    est = Estimator(MODEL)
    first = est.costs()
    est.adopt(2.0, 0.003)
    assert (est.beta, est.delta) == (2.0, 0.003) and est.costs() is not first
    assert est.t_c == pytest.approx(2 * MODEL.t_c + 0.003)
    assert est.batch([(100, 0)], [10]) == pytest.approx(2 * MODEL.batch_time([(100, 0)], [10]) + 0.003)
    assert est.corrected(0.05, steps=3) == pytest.approx(0.1 + 0.009)
    assert est.model_time(est.corrected(0.05, steps=3), steps=3) == pytest.approx(0.05)
    est.adopt(100.0, 5.0)                          # clamped: β to its bound, δ to delta_max
    assert (est.beta, est.delta) == (est.corrector.hi, est.corrector.delta_max)
    est.adopt(1.0, -1.0)                           # the offset only adds
    assert est.delta == 0.0 and est.t_c == MODEL.t_c
    est.adopt(1.5)                                 # β alone (a scale-only worker): δ = 0
    assert (est.beta, est.delta) == (1.5, 0.0)
    scale_only = Estimator(MODEL, OnlineCorrector(mode=SCALE))
    scale_only.adopt(1.5, 0.003)                   # a scale-only estimator keeps δ = 0
    assert scale_only.delta == 0.0


def test_estimator_observe_time_fits_the_offset():
    est = Estimator(MODEL)
    rng = random.Random(4)
    now = 0.0
    for _ in range(200):
        pf = [(rng.randrange(16, 2048), rng.randrange(0, 2048))]
        x = MODEL.batch_time(pf, [])
        now += x + FIXED
        est.observe(x + FIXED, pf, [], now)
    assert est.delta == pytest.approx(FIXED, rel=1e-3)
    assert est.batch([(100, 0)], []) == pytest.approx(MODEL.batch_time([(100, 0)], []) + FIXED, rel=1e-3)


# -- where a correction turns into time outside the cost module ------------------------------------

def test_go_routing_queue_estimate_charges_the_offset_per_queued_step():
    """ESTIMATEEXEC (disaggregated: one request per step) is Σ corrected(exec + t_c), and the
    incremental Δ still equals the reference ESTIMATEGAIN difference, at any β and δ."""
    from proserve.scheduler.routing.base import (
        COLOCATED,
        DISAGGREGATED,
        PrefillInstance,
        PrefillQueueMap,
    )
    from proserve.scheduler.routing.estimates import estimate_exec, estimate_gain, evaluate

    gain = GainConfig()
    rnd = random.Random(5)
    for trial in range(300):
        est = Estimator(MODEL)
        est.adopt(rnd.uniform(0.5, 3.0), rnd.uniform(0.0, 0.05))
        p = PrefillInstance(0, est, n_decode=rnd.choice([0, 5]), avg_decode_kv=rnd.choice([0, 512]))
        qm = PrefillQueueMap([p])
        now = 10.0
        queued = []
        for k in range(rnd.randrange(0, 10)):
            r = Request(f"q{k}", "low", rnd.choice([1.0, 2.0]), rnd.choice([0.5, 1.0, 2.0]), 0.1,
                        now - rnd.uniform(0, 1.5), rnd.randrange(1, 3000))
            queued.append(r)
            qm.add(0, r, now)
        x = Request("x", "low", 1.0, rnd.choice([0.5, 1.0, 2.0]), 0.1, now, rnd.randrange(1, 3000))
        want = sum(est.prefill(r.prompt_len) + est.t_c for r in queued)   # the corrected per-step costs
        assert estimate_exec(p, x, now, gain, DISAGGREGATED) == pytest.approx(want, abs=1e-12)
        for dep in (DISAGGREGATED, COLOCATED):
            e = evaluate(p, x, now, gain, dep)
            ref = (estimate_gain(p, now, gain, dep, req=x)
                   - estimate_gain(p, now, gain, dep, tpot=x.tpot_slo))
            assert e.delta == pytest.approx(ref, abs=1e-9), (trial, dep)


def test_slos_serve_time2bs_takes_the_offset_off_the_budget():
    from proserve.scheduler import make_local

    est = Estimator(MODEL)
    pol = make_local("slos_serve", est, GainConfig())
    base = pol.time2bs(0.05)
    est.adopt(1.0, 0.01)                 # 10 ms of every step is the fixed cost
    assert pol.time2bs(0.05) == pol.roofline.time2bs(0.04) < base
    est.adopt(2.0, 0.01)
    assert pol.time2bs(0.05) == pol.roofline.time2bs(0.02)


# -- the simulator ------------------------------------------------------------------------------

@pytest.mark.parametrize("fast_forward", [False, True])
def test_simulator_true_model_with_a_fixed_per_step_cost(fast_forward):
    """--true-latency-model = the profile + 5 ms per step: the estimators find β ≈ 1, δ ≈ 5 ms,
    also when the simulator observes a run of decode steps at once (fast-forward: δ counts once
    per step of the run)."""
    from proserve.scheduler import default_classes
    from proserve.sim.cluster import SimConfig, Simulator

    slower = LatencyModel(**{**{k: getattr(MODEL, k) for k in ("a_p", "b_p", "c_p", "a_d", "b_d")},
                             "t_c": MODEL.t_c + FIXED})
    rng = random.Random(6)
    reqs = [Request(f"r{i}", "low", 1.0, 5.0, 1.0, 0.2 * i, rng.randrange(32, 2048),
                    output_len=rng.randrange(4, 64)) for i in range(300)]
    cfg = SimConfig(global_policy="round_robin", true_model=slower, fast_forward=fast_forward)
    sim = Simulator(MODEL, cfg, classes=default_classes())
    sim.run(reqs)
    est = sim.p_states[0].estimator
    assert est.beta == pytest.approx(1.0, abs=0.02) and est.delta == pytest.approx(FIXED, rel=0.05)


# -- the knob, what the worker reports, what the dispatcher reads ---------------------------------

def test_engine_config_selects_the_correction():
    from proserve.prefill.engine_config import EngineConfig, build

    assert build(EngineConfig.from_dict({}), model=MODEL).estimator.corrector.mode == SCALE_OFFSET
    assert build(EngineConfig.from_dict({"correction": "scale"}), model=MODEL).estimator.corrector.mode == SCALE
    with pytest.raises(ConfigError, match="mode must be one of"):
        build(EngineConfig.from_dict({"correction": "offset"}), model=MODEL)


def test_worker_flag_sets_the_correction():
    from proserve.prefill import worker

    args = worker.build_parser("prefill").parse_args(["--correction", "scale"])
    cfg, _ = worker.scheduling_config("prefill", args)
    assert cfg["correction"] == "scale"
    cfg, _ = worker.scheduling_config("prefill", worker.build_parser("prefill").parse_args([]))
    assert "correction" not in cfg          # the engine's default
    with pytest.raises(SystemExit):
        worker.build_parser("prefill").parse_args(["--correction", "offset"])


def test_worker_metrics_report_the_offset():
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY

    from proserve.prefill import sched_metrics

    est = Estimator(MODEL)
    m = sched_metrics.for_policy("test-offset", est)
    est.adopt(1.2, 0.004)
    m.step(0.05, 0.04, est.beta, 0.001)
    labels = {"policy": "test-offset"}
    assert REGISTRY.get_sample_value("proserve:beta", labels) == 1.2
    assert REGISTRY.get_sample_value("proserve:step_offset_seconds", labels) == 0.004


def test_dispatcher_reads_scale_and_offset_and_rejects_bad_values():
    pytest.importorskip("aiohttp")
    from proserve.dispatcher.instances import correction_of

    page = ('# HELP proserve:beta ...\nproserve:beta{policy="slide_batching"} 1.25\n'
            'proserve:step_offset_seconds{policy="slide_batching"} 0.0042\nvllm:x 1\n')
    assert correction_of(page) == (1.25, 0.0042)
    assert correction_of('proserve:beta{policy="slide_batching"} 1.25\n') == (1.25, 0.0)  # β alone
    assert correction_of("vllm:x 1\n") is None                                            # no plugin
    for bad in ('proserve:beta 0\n', 'proserve:beta -2\n', 'proserve:beta 1e999\n', 'proserve:beta 1e\n',
                'proserve:beta 1.0\nproserve:step_offset_seconds 1e999\n',
                'proserve:beta 1.0\nproserve:step_offset_seconds --1\n'):
        with pytest.raises(ValueError):
            correction_of(bad)
    # what the dispatcher then does with it: its estimator adopts, within its bounds
    est = Estimator(MODEL)
    est.adopt(*correction_of('proserve:beta 1.25\nproserve:step_offset_seconds 7\n'))
    assert (est.beta, est.delta) == (1.25, est.corrector.delta_max)
