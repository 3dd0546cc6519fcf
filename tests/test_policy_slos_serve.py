"""SLOs-Serve (Chen et al.): the roofline model and its inverse (§3.1.1), the
admission DP (§3.2.1, App. C) on the paper's Figure 3 toy example and on
cases where a greedy admission is worse, the ``slos_serve`` local policy
(Algorithm 2 batches, best-effort tier), the ``slos_serve_routing`` global
policy (§4.2) and the paper's attainment / capacity metric.

Figure 3: the system processes six tokens per time unit; three requests are
decoding (TPOT SLO one unit); a burst of four requests arrives, each with six
prefill tokens; TTFT SLO six units. SLOs-Serve "successfully attain[s] the
SLOs for all existing requests, as well as three out of the four new
requests". With a 1-second time unit that is the latency model
``c_p = b_d = 1/6 s``, ``t_c = 0`` (a prefill token and a decode cost alike).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from proserve.scheduler import (
    ConfigError,
    Estimator,
    GainConfig,
    LatencyModel,
    Phase,
    PriorityClass,
    Request,
    make_global,
    make_local,
)
from proserve.scheduler.alternatives.slos_serve import metrics as pm
from proserve.scheduler.alternatives.slos_serve.model import (
    Job,
    Roofline,
    admit_dp,
    decode_tokens,
    feasible_alone,
    greedy_admit,
    samples_from_batches,
)
from proserve.scheduler.estimator import BatchSample
from proserve.scheduler.local import COLOCATED, PREFILL_ONLY, InstanceView
from proserve.scheduler.routing.base import PrefillInstance, PrefillQueueMap

FIG3 = LatencyModel(a_p=0.0, b_p=0.0, c_p=1 / 6, a_d=0.0, b_d=1 / 6, t_c=0.0)
FIG3_CLASSES = {"x": PriorityClass("x", 1.0, 6.0, 1.0)}


def fig3_req(id, arrival, prompt=6, out=100, ttft=6.0):
    return Request(id, "x", 1.0, ttft, 1.0, arrival, prompt, out)


# -------------------------------------------------------------------------------------------
# roofline (§3.1.1)
# -------------------------------------------------------------------------------------------
def test_roofline_fit_recovers_a_two_line_max():
    # memory-bound line 1e-4·N + 10 ms, compute-bound line 2e-4·N: knee at N = 100
    truth = Roofline(((1e-4, 0.0, 0.01), (2e-4, 0.0, 0.0)))
    samples = [(n, 0, truth.time(n)) for n in (1, 5, 10, 20, 40, 60, 80, 100, 150, 200, 400, 800, 1600)]
    fit = Roofline.fit(samples)
    assert len(fit.lines) == 2
    got = sorted(fit.lines)
    assert got[0][0] == pytest.approx(1e-4, rel=1e-6) and got[0][2] == pytest.approx(0.01, rel=1e-6)
    assert got[1][0] == pytest.approx(2e-4, rel=1e-6) and got[1][2] == pytest.approx(0.0, abs=1e-9)
    # one line cannot follow the knee
    one = Roofline.fit(samples, pieces=1)
    assert max(abs(one.time(n) - t) / t for n, _, t in samples) > 0.1


def test_time2bs_is_the_inverse_of_the_roofline():
    roof = Roofline(((1e-4, 0.0, 0.01), (2e-4, 0.0, 0.0)))
    assert roof.time2bs(0.03) == 150           # min((0.03-0.01)/1e-4, 0.03/2e-4)
    assert roof.time2bs(0.015) == 50           # the memory-bound line binds below the knee
    assert roof.time2bs(0.005) == 0            # below the fixed cost: nothing fits
    for t in (0.0101, 0.02, 0.0333, 0.05, 0.1, 1.0):
        n = roof.time2bs(t)
        assert roof.time(n) <= t + 1e-12 < roof.time(n + 1)
    assert roof.marginal(10) == 1e-4 and roof.marginal(1000) == 2e-4


def test_roofline_spec_step_term_is_fitted():
    # §3.1.1's k2·#SpecStep (speculative decoding's draft overhead): one line with k2 = 1 ms
    samples = [(n, s, 1e-4 * n + 1e-3 * s + 0.005) for n in (10, 50, 200, 800) for s in (0, 2, 4)]
    (k1, k2, b), = Roofline.fit(samples, pieces=1).lines
    assert (k1, k2, b) == pytest.approx((1e-4, 1e-3, 0.005), rel=1e-6)
    assert Roofline(((1e-4, 1e-3, 0.005),)).time2bs(0.1, spec_steps=5) == 900


def test_roofline_from_the_estimators_model_tracks_eq5_7():
    """Fitted to Eq. 5+7 for a prefill chunk on the bundled 7B model (t_c = 12 ms and a
    quadratic a_p term, which two lines can only approximate): within 2.5 % of the model
    over the default fit range (0.4 s), and its Time2BS within 2 % of GETMAXCHUNK's
    answer for the same batch time. Fitting over 1 s instead costs accuracy here."""
    from proserve.profiler.modelfile import BUNDLED, load

    m = load(BUNDLED)
    est = Estimator(m)
    roof = make_local("slos_serve", est).roofline
    n_hi = est.get_max_chunk(0, 1 << 20, 0.4 - m.t_c)

    def max_err(r):
        return max(abs(r.time(n) - m.batch_time([(n, 0)])) / m.batch_time([(n, 0)]) for n in range(1, n_hi, 7))

    assert max_err(roof) < 0.025 < max_err(Roofline.from_latency_model(m, 1.0))
    for t in (0.05, 0.1, 0.2, 0.3):
        assert roof.time2bs(t) == pytest.approx(est.get_max_chunk(0, 1 << 20, t - m.t_c), rel=0.02)


def test_roofline_from_profiler_samples_and_decode_tokens():
    batches = [BatchSample.of([(100, 0)], [5, 7], 0.02), BatchSample.of([], [3] * 4, 0.01)]
    assert samples_from_batches(batches) == [(102, 0, 0.02), (4, 0, 0.01)]
    roof = Roofline(((1e-4, 0.0, 0.0),))
    m = LatencyModel(a_p=0, b_p=0, c_p=1e-4, a_d=1e-7, b_d=2e-4, t_c=0.01)
    # a decode at l_kv = 1000 costs 3e-4 s = three roofline tokens of 1e-4 s
    assert decode_tokens(m, roof, 1000, 50) == pytest.approx(3.0)


def test_roofline_validation():
    with pytest.raises(ConfigError, match="at least one line"):
        Roofline(())
    with pytest.raises(ConfigError, match="k1 = 0"):
        Roofline(((0.0, 0.0, 0.01),))
    with pytest.raises(ConfigError, match=">= 0"):
        Roofline(((-1e-4, 0.0, 0.0),))
    with pytest.raises(ConfigError, match="pieces"):
        Roofline.fit([(1, 0, 0.1), (2, 0, 0.2)], pieces=3)
    with pytest.raises(ConfigError, match="times must be > 0"):
        Roofline.fit([(1, 0, 0.1), (2, 0, 0.0)])


# -------------------------------------------------------------------------------------------
# admission DP (§3.2.1, App. C)
# -------------------------------------------------------------------------------------------
def test_dp_admits_the_figure3_subset():
    """σ = 6 tokens/unit, three decodes running (1 token/unit each), four new
    requests of 6 prefill tokens due at t = 6: budget by then (6 - 3)·6 = 18
    tokens, so three of the four are admitted, the first three."""
    burst = [Job(6.0, 6.0) for _ in range(4)]
    res = admit_dp(0.0, sigma=6.0, base_rate=3.0, forced=[], candidates=burst, tier_rates=[1.0])
    assert res.admitted == [True, True, True, False]
    assert res.n == 3 and res.pb_end == pytest.approx(0.0, abs=1e-9)
    # with all seven decoding, demand 6 tokens/unit equals the budget's slope: still feasible
    assert res.rate_end == pytest.approx(6.0)


def test_dp_budget_slope_limits_admissions():
    """§3.2: admitted decode demand must stay within the budget's slope σ. With
    TTFT 8 the prefill budget (6-3)·8 = 24 covers all four, but four more decodes
    would need 7 tokens/unit > 6: still three. With two decodes running, four fit."""
    burst = [Job(8.0, 6.0) for _ in range(4)]
    assert admit_dp(0.0, 6.0, 3.0, [], burst, [1.0]).n == 3
    assert admit_dp(0.0, 6.0, 2.0, [], [Job(6.0, 6.0) for _ in range(4)], [1.0]).admitted == [True] * 4


def test_dp_beats_greedy_deadline_order():
    """Greedy admission in deadline order takes A (10 tokens by t=10) and then
    neither B nor C fits; the DP skips A and admits B and C (15 ≤ 11? no: 5 ≤ 11
    and 11 ≤ 12)."""
    jobs = [Job(10.0, 10.0), Job(11.0, 5.0), Job(12.0, 6.0)]
    assert greedy_admit(0.0, 1.0, 0.0, [], jobs, [0.0]) == [True, False, False]
    res = admit_dp(0.0, 1.0, 0.0, [], jobs, [0.0])
    assert res.admitted == [False, True, True]
    assert res.pb_end == pytest.approx(1.0)


def test_dp_protects_forced_requests():
    # forced job: 8 tokens by t=10; a candidate of 4 tokens by t=5 fits alone at t=5 but
    # leaves the forced one 2 short at t=10: declined
    forced = [Job(10.0, 8.0)]
    assert feasible_alone(0.0, 1.0, 0.0, forced, [Job(5.0, 4.0)], [0.0]) == [True]
    assert admit_dp(0.0, 1.0, 0.0, forced, [Job(5.0, 4.0)], [0.0]).admitted == [False]
    assert admit_dp(0.0, 1.0, 0.0, forced, [Job(5.0, 2.0)], [0.0]).admitted == [True]
    # a forced request already late (deadline passed, 5 tokens left) goes first: a candidate
    # due before the backlog clears is declined, one due after it is admitted
    late = [Job(-1.0, 5.0)]
    res = admit_dp(0.0, 1.0, 0.0, late, [Job(4.0, 1.0), Job(10.0, 3.0)], [0.0])
    assert res.admitted == [False, True]


def test_dp_multi_tier_counts_and_memory():
    # tier 0 (tight TPOT) adds 4 tokens/s of decode demand, tier 1 adds 1; σ = 10: at most
    # four admitted (e.g. 2+2 or 1+3), never a set whose demand exceeds σ
    cands = [Job(1.0, 1.0, tier=0) for _ in range(3)] + [Job(1.0, 1.0, tier=1) for _ in range(3)]
    res = admit_dp(0.0, 10.0, 0.0, [], cands, [4.0, 1.0])
    assert res.n == 4
    n0 = sum(res.admitted[:3])
    assert 4 * n0 + (res.n - n0) <= 10 and res.rate_end <= 10
    # memory (App. C's m): Figure 3's burst with 2 units each and 5 units free: two admitted
    burst = [Job(6.0, 6.0, m=2) for _ in range(4)]
    res = admit_dp(0.0, 6.0, 3.0, [], burst, [1.0], mem_cap=5)
    assert res.admitted == [True, True, False, False] and res.mem == 4
    assert feasible_alone(0.0, 6.0, 3.0, [], [Job(6.0, 6.0, m=6)], [1.0], mem_cap=5) == [False]


def _feasible(now, sigma, base_rate, jobs) -> bool:
    """Plain EDF walk over (deadline, prefill tokens, decode rate) jobs: the budget never
    negative at a deadline, the final decode demand within σ."""
    t, pb, rate = now, 0.0, base_rate
    for d, p, r in sorted(jobs, key=lambda x: x[0]):
        pb += (sigma - rate) * (d - t)
        t = d
        pb -= p
        rate += r
        if pb < -1e-6:
            return False
    return rate <= sigma + 1e-6


def _brute_force_max(now, sigma, base_rate, forced, cands, rates, mem_cap) -> int:
    """Size of the largest feasible subset of ``cands``, by enumeration."""
    fixed = [(j.pddl, j.p, j.rate) for j in forced]
    for k in range(len(cands), 0, -1):
        for sub in itertools.combinations(range(len(cands)), k):
            if mem_cap is not None and sum(cands[i].m for i in sub) > mem_cap:
                continue
            if _feasible(now, sigma, base_rate, fixed + [(cands[i].pddl, cands[i].p, rates[cands[i].tier])
                                                         for i in sub]):
                return k
    return 0


@pytest.mark.parametrize("seed", range(40))
def test_dp_is_optimal_on_random_instances(seed):
    """The DP admits as many as the best subset found by brute force (on-time forced
    jobs, two tiers, memory), what it admits is feasible, and the pre-filter never
    rejects what the DP admits."""
    rng = random.Random(seed)
    sigma = rng.uniform(5, 20)
    forced = [Job(rng.uniform(0.5, 3), rng.uniform(0, 5), rng.uniform(0, 1)) for _ in range(rng.randint(0, 2))]
    base = rng.uniform(0, 2)
    if not _feasible(0.0, sigma, base, [(j.pddl, j.p, j.rate) for j in forced]):
        pytest.skip("the forced jobs alone are infeasible (covered by test_dp_protects_forced_requests)")
    cands = [Job(rng.uniform(0.2, 4), rng.uniform(1, 15), tier=rng.randint(0, 1), m=rng.randint(0, 3))
             for _ in range(rng.randint(1, 7))]
    rates = [rng.uniform(0.5, 3), rng.uniform(0, 1)]
    mem_cap = rng.choice([None, rng.randint(0, 8)])
    res = admit_dp(0.0, sigma, base, forced, cands, rates, mem_cap)
    assert res.n == sum(res.admitted) == _brute_force_max(0.0, sigma, base, forced, cands, rates, mem_cap)
    chosen = [(c.pddl, c.p, rates[c.tier]) for c, a in zip(cands, res.admitted) if a]
    assert _feasible(0.0, sigma, base, [(j.pddl, j.p, j.rate) for j in forced] + chosen)
    assert mem_cap is None or sum(c.m for c, a in zip(cands, res.admitted) if a) <= mem_cap
    alone = feasible_alone(0.0, sigma, base, forced, cands, rates, mem_cap)
    assert all(alone[i] for i, a in enumerate(res.admitted) if a)


def test_dp_validation():
    with pytest.raises(ConfigError, match="sigma"):
        admit_dp(0.0, -1.0, 0.0, [], [], [])
    with pytest.raises(ConfigError, match="tier"):
        admit_dp(0.0, 1.0, 0.0, [], [Job(1.0, 1.0, tier=2)], [0.0])
    with pytest.raises(ConfigError, match="mem_cap"):
        admit_dp(0.0, 1.0, 0.0, [], [], [], mem_cap=-1)


# -------------------------------------------------------------------------------------------
# the local policy
# -------------------------------------------------------------------------------------------
def fig3_policy(**params):
    return make_local("slos_serve", Estimator(FIG3), None, FIG3_CLASSES, **params)


def fig3_decoding(n=3):
    """Requests decoding at t = 0, exactly on their line (next token due at t = 1)."""
    out = []
    for i in range(n):
        r = fig3_req(f"old{i}", -6.0)
        r.advance_prefill(6, -0.5)     # first token (deadline t = 0) at -0.5
        out.append(r)
    return out


@pytest.mark.parametrize("decode_cost", ["model", "unit"])
def test_policy_admits_the_figure3_subset_and_plans_algorithm2(decode_cost):
    pol = fig3_policy(decode_cost=decode_cost)
    burst = [fig3_req(f"new{i}", 0.0) for i in range(4)]
    plan = pol.schedule(InstanceView(0.0, burst, fig3_decoding()))
    d = pol.last
    assert (d.t0, d.tokens, d.sigma) == (1.0, 6, pytest.approx(6.0))  # t0 = TPOT; Time2BS(1) = 6
    assert d.admitted == ["new0", "new1", "new2"] and d.declined == ["new3"]
    assert [pol.tier(r) for r in burst] == ["admitted"] * 3 + ["best_effort"]
    # Alg. 2: the three due decodes, then the earliest admitted prefill gets the other 3 tokens
    assert sorted(r.id for r in plan.decode) == ["old0", "old1", "old2"]
    assert [(r.id, n) for r, n in plan.prefill] == [("new0", 3)]
    assert plan.info.est_time == pytest.approx(1.0)
    # the decision is final: the next step does not reconsider new3
    plan = pol.schedule(InstanceView(1.0, burst, fig3_decoding()))
    assert pol.last.admitted == [] and pol.last.declined == []


def test_figure3_in_the_simulator():
    """End to end: the three running requests and three of the burst meet every
    token deadline (the §3.2 line); the fourth is served best-effort and finishes.
    The burst arrives 0.1 s before a planning point with TTFT 6.1, so its prefill
    deadline is six units after the decision, as in Figure 3."""
    from proserve.sim.cluster import SimConfig, Simulator

    classes = {"x": PriorityClass("x", 1.0, 6.1, 1.0)}
    old = [Request(f"old{i}", "x", 1.0, 6.1, 1.0, -6.0, 6, 30) for i in range(3)]
    burst = [Request(f"new{i}", "x", 1.0, 6.1, 1.0, -0.1, 6, 8) for i in range(4)]
    sim = Simulator(FIG3, SimConfig(local_policy="slos_serve", global_policy="round_robin"), GainConfig(), classes)
    pol = sim.front[0].policy
    tiers, decisions = {}, []
    finished, schedule = pol.on_request_finished, pol.schedule

    def on_finished(r, now):
        tiers[r.id] = pol.tier(r)
        finished(r, now)

    def sched(view):
        plan = schedule(view)
        if pol.last.admitted or pol.last.declined:
            decisions.append((view.now, list(pol.last.admitted), list(pol.last.declined)))
        return plan

    pol.on_request_finished, pol.schedule = on_finished, sched
    res = sim.run(old + burst)
    assert decisions[-1] == (pytest.approx(0.0, abs=1e-9), ["new0", "new1", "new2"], ["new3"])
    assert all(r.finished and r.error is None and r.num_emitted == r.output_len for r in res.requests)
    attained = {r.id: pm.request_attained(r) for r in res.requests}
    assert attained == {"old0": True, "old1": True, "old2": True, "new0": True, "new1": True, "new2": True,
                        "new3": False}
    assert tiers["new3"] == "best_effort"
    assert min(t.token_times[0] for t in burst[:3]) < burst[3].token_times[0]


def test_due_decodes_first_then_admitted_prefills_then_best_effort():
    pol = fig3_policy()
    burst = [fig3_req(f"new{i}", 0.0) for i in range(4)]
    pol.schedule(InstanceView(0.0, burst, fig3_decoding()))   # new3 declined
    # later: no admitted prefill left to do, one admitted decode ahead of its line
    ahead = fig3_req("ahead", -5.9)
    ahead.advance_prefill(6, -5.5)
    for k in range(12):                     # 13 tokens by t=0; token 14 due at 0.1 + 13 = 13.1
        ahead.emit(-5.0 + 0.1 * k)
        ahead.kv_len += 1
    pol.admitted.add(ahead.id)
    plan = pol.schedule(InstanceView(0.0, [burst[3]], fig3_decoding() + [ahead]))
    # 3 due decodes, then leftover: the admitted decode ahead of its line, then new3 (2 tokens)
    assert [r.id for r in plan.decode][:3] == ["old0", "old1", "old2"]
    assert "ahead" in [r.id for r in plan.decode]
    assert [(r.id, n) for r, n in plan.prefill] == [("new3", 2)]
    assert (plan.info.n_urgent, plan.info.n_normal) == (3, 1)


def test_best_effort_gets_nothing_while_admitted_work_fills_the_batch():
    pol = fig3_policy()
    burst = [fig3_req(f"new{i}", 0.0) for i in range(4)]
    plan = pol.schedule(InstanceView(0.0, burst, fig3_decoding()))
    assert "new3" not in [r.id for r, _ in plan.prefill]


def test_running_requests_are_forced_admissions():
    pol = fig3_policy()
    partial = fig3_req("partial", -1.0)
    partial.advance_prefill(2, -0.5)        # holds KV: was running before the policy saw it
    pol.schedule(InstanceView(0.0, [partial], fig3_decoding()))
    assert pol.tier(partial) == "admitted" and all(pol.tier(r) == "admitted" for r in fig3_decoding())


def test_prefill_only_instance_has_no_decode_demand():
    # prefill-only: t0 = batch_time (the class TPOT, 1 s), no decode demand: all 6 tokens/unit
    # go to prefill, 36 by t = 6: six of seven 6-token requests
    pol = fig3_policy()
    burst = [fig3_req(f"new{i}", 0.0) for i in range(7)]
    plan = pol.schedule(InstanceView(0.0, burst, [], mode=PREFILL_ONLY))
    assert pol.last.admitted == [f"new{i}" for i in range(6)] and pol.last.declined == ["new6"]
    assert [(r.id, n) for r, n in plan.prefill] == [("new0", 6)]


def test_memory_dimension_and_learned_output_length():
    # 16-token blocks; a request takes prompt + ô = 6 + 10 = 16 tokens = 1 block
    pol = fig3_policy(output_len_prior=10.0)
    burst = [fig3_req(f"new{i}", 0.0) for i in range(4)]
    pol.schedule(InstanceView(0.0, burst, [], free_blocks=2, mode=PREFILL_ONLY))
    assert pol.last.admitted == ["new0", "new1"] and pol.last.declined == ["new2", "new3"]
    # ô is learned from finished requests (the prior counts as 8 of them)
    done = fig3_req("done", 0.0, out=100)
    done.advance_prefill(6, 0.1)
    for _ in range(99):
        done.emit(0.2)
    pol.on_request_finished(done, 1.0)
    assert pol.mean_output_len == pytest.approx((8 * 10 + 100) / 9)
    assert pol.tier(burst[0]) == "admitted"
    pol.on_request_finished(burst[0], 2.0)
    assert pol.tier(burst[0]) is None


def test_best_effort_starts_no_prefill_while_arrivals_are_declined_for_memory():
    pol = fig3_policy(output_len_prior=10.0)              # 6 + 10 tokens: one block each
    burst = [fig3_req(f"new{i}", 0.0) for i in range(4)]
    pol.schedule(InstanceView(0.0, burst, [], free_blocks=2, mode=PREFILL_ONLY))
    assert pol.last.declined == ["new2", "new3"]            # no memory for them
    burst[0].advance_prefill(4, 0.5)                         # admitted, 2 tokens left
    view = lambda now: InstanceView(now, [burst[0], burst[2], burst[3]], [], free_blocks=100,  # noqa: E731
                                    mode=PREFILL_ONLY)
    # memory is free again, but within the horizon (TTFT 6) of a memory decline: no new BE prefill
    plan = pol.schedule(view(1.0))
    assert [(r.id, n) for r, n in plan.prefill] == [("new0", 2)]
    # after it, the leftover 4 tokens go to the oldest best-effort request
    plan = pol.schedule(view(6.5))
    assert [(r.id, n) for r, n in plan.prefill] == [("new0", 2), ("new2", 4)]


def test_mem_growth_horizon_counts_only_the_planned_growth():
    # ô = 100: "peak" counts 6 + 100 tokens = 7 blocks, more than the 2 free; "horizon"
    # counts the growth within TTFT/TPOT = 6 tokens: 12 tokens = 1 block each
    burst = [fig3_req(f"new{i}", 0.0) for i in range(3)]
    peak = fig3_policy(output_len_prior=100.0)
    peak.schedule(InstanceView(0.0, burst, [], free_blocks=2, mode=PREFILL_ONLY))
    assert peak.last.admitted == [] and peak.last.declined == ["new0", "new1", "new2"]
    hor = fig3_policy(output_len_prior=100.0, mem_growth="horizon")
    hor.schedule(InstanceView(0.0, burst, [], free_blocks=2, mode=PREFILL_ONLY))
    assert hor.last.admitted == ["new0", "new1"] and hor.last.declined == ["new2"]


def test_overload_declines_but_every_request_finishes():
    from proserve.bench.workloads import build_workload
    from proserve.profiler.modelfile import BUNDLED, load
    from proserve.sim.cluster import SimConfig, simulate

    reqs = build_workload("bench/data/azure_conv_2023.csv", rate=8.0, num_requests=300, seed=1, fmt="azure")
    res = simulate(reqs, load(BUNDLED), SimConfig(local_policy="slos_serve", global_policy="round_robin",
                                                  record_timeline=True))
    assert all(r.finished and r.error is None and r.num_emitted == r.output_len for r in res.requests)
    # steps that served the best-effort tier (ScheduleInfo.n_normal counts its items)
    assert any(t.n_normal > 0 for t in res.timeline), "8 req/s on one instance should decline some requests"
    assert 0.2 < pm.attainment(res.requests) < 0.95


class Sealed(Request):
    """A request whose output length a policy must not read (engines do not know it)."""

    __slots__ = ("_out",)
    sealed = False

    @property
    def output_len(self):
        if Sealed.sealed:
            raise AssertionError("the policy read output_len")
        return self._out

    @output_len.setter
    def output_len(self, v):
        self._out = v


@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_policy_and_router_never_read_output_len(deployment):
    """Run both through a few hundred steps, applying their plans, with output_len sealed
    whenever a policy runs."""
    mode = COLOCATED if deployment == "colocated" else PREFILL_ONLY
    est = Estimator(FIG3)
    pol = make_local("slos_serve", est, None, FIG3_CLASSES)
    router = make_global("slos_serve_routing", classes=FIG3_CLASSES, deployment=deployment)
    ps = [PrefillInstance(0, est), PrefillInstance(1, Estimator(FIG3))]
    qmap = PrefillQueueMap(ps)
    reqs = [Sealed(f"s{i}", "x", 1.0, 6.0, 1.0, 0.5 * i, 6, 3 + i % 4) for i in range(12)]
    now, waiting, decoding, done = 0.0, [], [], []
    while len(done) < len(reqs):
        for r in reqs:
            if r.arrival <= now and r not in waiting and r not in decoding and r not in done:
                Sealed.sealed = True
                try:
                    p, _ = router.route(r, ps, [], now)
                finally:
                    Sealed.sealed = False
                qmap.add(p.id, r, now)
                waiting.append(r)
        Sealed.sealed = True
        try:
            plan = pol.schedule(InstanceView(now, list(waiting), list(decoding), mode=mode))
        finally:
            Sealed.sealed = False
        now += max(est.batch([(n, r.kv_len) for r, n in plan.prefill], [r.kv_len for r in plan.decode]), 0.1)
        for r, n in plan.prefill:
            if r.advance_prefill(n, now):
                waiting.remove(r)
                qmap.remove(0, r, now)
                qmap.remove(1, r, now)
                (decoding if not r.finished and mode == COLOCATED else done).append(r)
        for r in plan.decode:
            r.kv_len += 1
            r.emit(now)
            if r.finished:
                decoding.remove(r)
                done.append(r)
        for r in done:
            if r.phase is not Phase.DONE:
                r.phase = Phase.DONE
            Sealed.sealed = True
            try:
                pol.on_request_finished(r, now)
                router.on_request_finished(r, now)
            finally:
                Sealed.sealed = False
        assert now < 200, "the loop should drain"
    assert {pol.tier(r) for r in reqs} == {None}


@pytest.mark.parametrize("params,match", [
    (dict(batch_time=0), "batch_time"), (dict(batch_time=math.inf), "batch_time"),
    (dict(decode_cost="free"), "decode_cost"), (dict(max_new=0), "max_new"), (dict(max_new=1.5), "max_new"),
    (dict(roofline_pieces=3), "roofline_pieces"), (dict(fit_max_time=0.0), "fit_max_time"),
    (dict(mem_units=-1), "mem_units"), (dict(output_len_prior=0), "output_len_prior"),
    (dict(mem_growth="all"), "mem_growth"),
])
def test_policy_parameters_are_validated(params, match):
    with pytest.raises(ConfigError, match=match):
        fig3_policy(**params)
    with pytest.raises(ConfigError, match="nope"):
        fig3_policy(nope=1)


# -------------------------------------------------------------------------------------------
# routing (§4.2)
# -------------------------------------------------------------------------------------------
ROUTE_MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.0)  # 1000 tokens/s


def route_setup(n=2, **params):
    router = make_global("slos_serve_routing", deployment="disaggregated", **params)
    ps = [PrefillInstance(i, Estimator(ROUTE_MODEL)) for i in range(n)]
    return router, ps, PrefillQueueMap(ps)


def rreq(id, prompt, arrival=0.0):
    return Request(id, "low", 1.0, 1.0, 0.1, arrival, prompt, 10)


def route(router, ps, qmap, req, now=0.0):
    p, _ = router.route(req, ps, [], now)
    qmap.add(p.id, req, now)
    return p.id


def test_routing_is_round_robin_until_a_replica_cannot_admit():
    router, ps, qmap = route_setup()
    assert route(router, ps, qmap, rreq("a", 900)) == 0          # RR proposes 0: 900 ≤ 1000 by t=1
    assert route(router, ps, qmap, rreq("b", 100)) == 1          # RR proposes 1
    # RR proposes 0, which would need 900 + 500 tokens by t=1: routed on to replica 1
    assert route(router, ps, qmap, rreq("c", 500)) == 1
    d = router.last_decision
    assert (d.first, d.tried, d.chosen, d.admitted) == (0, [0, 1], 1, True)
    # nobody can take 950 more: the backup sends it to the round-robin replica, best-effort
    assert route(router, ps, qmap, rreq("d", 950)) == 1
    d = router.last_decision
    assert (d.first, d.tried, d.chosen, d.admitted) == (1, [1, 0], 1, False)


def test_routing_max_hops_and_min_load_backup():
    router, ps, qmap = route_setup(max_hops=1, backup="min_load")
    route(router, ps, qmap, rreq("a", 900))
    route(router, ps, qmap, rreq("b", 100))
    # proposal 0 cannot admit; one hop only, then the least loaded replica (1) as backup
    assert route(router, ps, qmap, rreq("c", 500)) == 1
    assert router.last_decision.tried == [0] and not router.last_decision.admitted


def test_routing_forgets_finished_requests():
    router, ps, qmap = route_setup()
    a = rreq("a", 900)
    route(router, ps, qmap, a)
    qmap.remove(0, a, 0.5)
    router.on_request_finished(a, 0.5)
    assert router.attainable(rreq("c", 900, arrival=0.5), ps[0], 0.5)
    assert router._admitted[0] == set() and router._resident[0] == {}


def test_routing_memory_check_colocated():
    md = {"num_kv_blocks": 100, "block_size": 16}
    model = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-5, a_d=0.0, b_d=1e-5, t_c=0.0, metadata=md)
    router = make_global("slos_serve_routing", deployment="colocated", kv_reserve=0.0, output_len_prior=64.0)
    ps = [PrefillInstance(0, Estimator(model)), PrefillInstance(1, Estimator(model))]
    qmap = PrefillQueueMap(ps)
    # each request: prompt 736 + ô 64 = 800 tokens = 50 blocks; 100 blocks minus one per resident
    assert route(router, ps, qmap, rreq("a", 736)) == 0
    assert route(router, ps, qmap, rreq("b", 736)) == 1
    assert route(router, ps, qmap, rreq("c", 736)) == 0 and not router.last_decision.admitted


def test_routing_parameters_are_validated():
    for params, match in [(dict(max_hops=0), "max_hops"), (dict(backup="x"), "backup"),
                          (dict(batch_time=-1), "batch_time"), (dict(decode_cost="x"), "decode_cost"),
                          (dict(kv_reserve=1.0), "kv_reserve"), (dict(output_len_prior=0.5), "output_len_prior"),
                          (dict(roofline_pieces=0), "roofline_pieces")]:
        with pytest.raises(ConfigError, match=match):
            make_global("slos_serve_routing", **params)


def test_routing_in_the_simulator_colocated():
    from proserve.bench.workloads import build_workload
    from proserve.profiler.modelfile import BUNDLED, load
    from proserve.sim.cluster import SimConfig, simulate

    reqs = build_workload("bench/data/azure_conv_2023.csv", rate=8.0, num_requests=200, seed=0, fmt="azure")
    res = simulate(reqs, load(BUNDLED), SimConfig(instances=2, local_policy="slos_serve",
                                                  global_policy="slos_serve_routing"))
    assert all(r.finished and r.error is None for r in res.requests)
    assert {r.instance for r in res.requests} == {0, 1}


# -------------------------------------------------------------------------------------------
# the paper's metric
# -------------------------------------------------------------------------------------------
def done_req(times, arrival=0.0, ttft=1.0, tpot=0.1, prio="low"):
    r = Request("m", prio, 1.0, ttft, tpot, arrival, 10, len(times))
    r.advance_prefill(10, times[0])
    for t in times[1:]:
        r.emit(t)
    return r


def test_request_attained_line_and_window():
    on_line = done_req([1.0, 1.1, 1.2, 1.3])            # every token exactly on its deadline
    assert pm.request_attained(on_line) and pm.request_attained(on_line, "window")
    late = done_req([0.5, 0.6, 0.7, 1.31])               # token 4 due at 1.3
    assert not pm.request_attained(late)
    assert not pm.request_attained(done_req([1.01, 1.05]))   # TTFT missed
    # early first token, then tokens spaced 0.3 s: still above the line until token 5, but
    # the §6 windowed TPOT (3-token windows: 0.3 s per token) misses
    early = done_req([0.1, 0.4, 0.7, 1.0, 1.3])
    assert pm.request_attained(early)
    assert not pm.request_attained(early, "window", window=3)
    assert pm.request_attained(done_req([0.1, 0.15, 0.2, 0.4]), "window", window=3)    # 0.3/3 = 0.1: on the SLO
    assert not pm.request_attained(done_req([0.1, 0.15, 0.2, 0.5]), "window", window=3)  # 0.4/3 > 0.1
    unfinished = Request("u", "low", 1.0, 1.0, 0.1, 0.0, 10, 5)
    unfinished.advance_prefill(10, 0.2)
    assert not pm.request_attained(unfinished)
    failed = done_req([0.2, 0.3])
    failed.error = "boom"
    assert not pm.request_attained(failed)
    with pytest.raises(ConfigError, match="mode"):
        pm.request_attained(on_line, "mean")
    with pytest.raises(ConfigError, match="window"):
        pm.request_attained(on_line, "window", window=0)


def test_attainment_by_class():
    rs = [done_req([0.5, 0.6]), done_req([1.5, 1.6]), done_req([0.5, 0.6], prio="high")]
    assert pm.attainment(rs) == pytest.approx(2 / 3)
    assert pm.attainment_by_class(rs) == {"all": pytest.approx(2 / 3), "high": 1.0, "low": 0.5}
    assert math.isnan(pm.attainment([]))
    s = pm.summary(rs)
    assert s["attained"] == 2 and s["requests"] == 3


def test_capacity_at_90_percent():
    pts = [(1.0, 1.0), (2.0, 0.95), (3.0, 0.85), (4.0, 0.5)]
    assert pm.capacity(pts) == pytest.approx(2.5)          # 2 + (0.95-0.9)/(0.95-0.85)·1
    assert pm.capacity(pts, interpolate=False) == 2.0
    assert pm.capacity(pts, num_gpus=2) == pytest.approx(1.25)
    assert pm.capacity(list(reversed(pts))) == pytest.approx(2.5)   # order of points does not matter
    assert pm.capacity([(1.0, 0.8), (2.0, 0.7)]) == 0.0
    assert pm.capacity([(1.0, 0.99), (2.0, 0.95)]) == 2.0          # all pass: a lower bound
    # a dip then a recovery: cut at the first dip
    assert pm.capacity([(1.0, 0.95), (2.0, 0.85), (3.0, 0.92)], interpolate=False) == 1.0
    assert pm.capacity(pts, target=0.5) == 4.0
    with pytest.raises(ConfigError, match="target"):
        pm.capacity(pts, target=0.0)
    with pytest.raises(ConfigError, match="no"):
        pm.capacity([])
    with pytest.raises(ConfigError, match="bad point"):
        pm.capacity([(1.0, 1.5)])
