"""JITServe / Concord GMAX (CALM): the online length bound, the Request
Analyzer's priority, Alg. 1's top-p filter and input-length window, frames,
anti-starvation and guarded preemption, the power-of-K router, and JITServe's
token goodput.

Latency model (as in test_local_policies): prefill 1 ms per token, decode step
1 ms per request, t_c = 10 ms, β = 1. TTFT SLO 1 s, TPOT SLO 0.1 s, so the
TBT-profiled token budget is 90 tokens. GainConfig() has w_p = w_d = 1. A
small ``prior_len`` keeps the length bound readable: before any completion,
``len_rem = prior_len − n``.
"""

from __future__ import annotations

import math
import random

import pytest

from proserve.scheduler import ConfigError, Estimator, LatencyModel, Request, make_global, make_local
from proserve.scheduler.alternatives.jitserve.gmax import achievable_goodput, gmax_select
from proserve.scheduler.alternatives.jitserve.length_bound import LengthBound
from proserve.scheduler.alternatives.jitserve.metrics import on_time_tokens, token_goodput
from proserve.scheduler.estimator import OnlineCorrector
from proserve.scheduler.local import COLOCATED, PREFILL_ONLY, InstanceView
from proserve.scheduler.request import Phase
from proserve.scheduler.routing.base import DecodeInstance, PrefillInstance, PrefillQueueMap
from proserve.scheduler.tdg import GainConfig as _G  # TDG, for the comparison with JITServe goodput

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=1e-2)
TTFT, TPOT = 1.0, 0.1
T_C, T_D = 0.01, 0.001


def policy(**params):
    params.setdefault("prior_len", 20)
    return make_local("jitserve_gmax", Estimator(MODEL), **params)


def wait(id, prompt, arrival=0.0, weight=1.0, out=1000):
    return Request(id, "high" if weight > 1 else "low", weight, TTFT, TPOT, arrival, prompt, out)


def dec(id, emitted=1, prompt=20, arrival=0.0, weight=1.0, t=0.05):
    r = wait(id, prompt, arrival, weight)
    r.advance_prefill(prompt, arrival + t)
    for _ in range(emitted - 1):
        r.emit(arrival + t)
        r.kv_len += 1
    return r


def view(waiting=(), decoding=(), now=0.0, mode=COLOCATED, free_blocks=1 << 30):
    return InstanceView(now=now, waiting=list(waiting), decoding=list(decoding), free_blocks=free_blocks,
                        block_size=16, mode=mode)


def terms(plan):
    """request id -> (t_gen, remain, Priority, in the group): what GMAX computed this step."""
    return plan.terms.of()


def run_step(pol, waiting, decoding, now):
    """One engine step: plan, then apply the plan's decodes (the bodies do this)."""
    plan = pol.schedule(view(waiting, decoding, now))
    for r in plan.decode:
        r.emit(now)
        r.kv_len += 1
    return plan


# -- the length bound (§4.1 replacement) --------------------------------------------------------

def test_length_bound_prior_before_any_completion():
    b = LengthBound()
    assert (b.upper(0), b.remaining(0)) == (1024, 1024)   # P95 of the paper's chatbot outputs
    assert b.upper(600) == 1200 and b.remaining(600) == 600  # outlived the prior: doubling bound
    assert b.upper(1023) == 2046


def test_length_bound_is_the_conditional_empirical_quantile():
    b = LengthBound(quantile=0.95, min_samples=20, prior_len=1024)
    for L in range(1, 101):
        b.observe(L)
    assert b.upper(0) == 95            # ⌈0.95·100⌉ = 95th smallest
    assert b.upper(50) == 98           # survivors 51..100: ⌈0.95·50⌉ = 48th → 98
    assert b.upper(80) == 99           # survivors 81..100 (20): 19th → 99
    assert b.upper(81) == 1024         # 19 survivors < min_samples: the prior
    # refined as tokens are generated: the remaining bound relaxes
    assert [b.remaining(n) for n in (0, 50, 80)] == [95, 48, 19]


def test_length_bound_window_forgets_the_oldest():
    b = LengthBound(quantile=0.5, history=3, min_samples=1)
    for L in (10, 20, 30, 40):
        b.observe(L)
    assert len(b) == 3 and b.seen == 4
    assert b.upper(0) == 30            # window {20, 30, 40}: ⌈1.5⌉ = 2nd
    b.observe(0)                       # not a length: ignored
    assert b.seen == 4


@pytest.mark.parametrize("kw, match", [
    ({"quantile": 1.0}, "quantile"), ({"quantile": 0}, "quantile"), ({"history": 0}, "history"),
    ({"min_samples": 2.5}, "min_samples"), ({"prior_len": 0}, "prior_len")])
def test_length_bound_rejects_bad_values(kw, match):
    with pytest.raises(ConfigError, match=match):
        LengthBound(**kw)


# -- achievable goodput --------------------------------------------------------------------------

def test_achievable_goodput_by_hand():
    # on time: all 10 tokens, the next one worth 4 (a first token, w_p·w)
    assert achievable_goodput(10, -0.5, 0.05, 4.0, 1.0) == 13.0
    # 0.12 s late, catching up 0.05 s per token: tokens j > 2.4 (j = 3..9) meet
    assert achievable_goodput(10, 0.12, 0.05, 4.0, 1.0) == 7.0
    # exactly 0.10 late: j·0.05 > 0.10 needs j >= 3 (strict, as Eq. 3)
    assert achievable_goodput(10, 0.10, 0.05, 4.0, 1.0) == 7.0
    # too late for the bound: catching up needs 2.4 tokens, only 2 to come
    assert achievable_goodput(2, 0.12, 0.05, 4.0, 1.0) == 0.0
    # slower than the TPOT SLO (0.02 s lost per token), 0.05 s early: j < 2.5 -> 3 tokens
    assert achievable_goodput(10, -0.05, -0.02, 4.0, 1.0) == 6.0
    assert achievable_goodput(10, 0.01, -0.02, 4.0, 1.0) == 0.0
    assert achievable_goodput(10, -0.01, 0.0, 4.0, 1.0) == 13.0
    assert achievable_goodput(0, -1.0, 0.05, 4.0, 1.0) == 0.0


# -- Request Analyzer: Priority(r) = goodput(r) / t_gen(r) ---------------------------------------

def test_priority_is_goodput_over_t_gen_by_hand():
    pol = policy(goodput="tdg")
    d = dec("d", emitted=5, weight=1.0)            # len_rem = 20 - 5 = 15
    a = wait("a", 100, weight=2.0)                 # len_rem = 20, prompt in ceil(100/90) = 2 chunks
    t = terms(pol.schedule(view([a], [d], now=0.1)))
    v = T_C + T_D                                  # one step: t_c + the one decode
    assert t["d"][0] == pytest.approx(15 * v)      # t_gen = len_rem · v_token
    assert t["d"][2] == pytest.approx(15 / (15 * v))
    t_first = 0.100 + 2 * v                        # T~_p(100) + a step per chunk
    assert t["a"][0] == pytest.approx(t_first + 19 * v)
    assert t["a"][2] == pytest.approx(2 * (1 + 19) / (t_first + 19 * v))   # w_prio·(w_p + 19·w_d)
    # the time to each one's next token's deadline
    assert t["d"][1] == pytest.approx(TTFT + 5 * TPOT - 0.1)
    assert t["a"][1] == pytest.approx(TTFT - 0.1)


def test_tokens_goodput_ignores_weights_and_late_requests_lose_priority():
    pol = policy(goodput="tokens")
    hi, lo = wait("hi", 50, weight=2.0), wait("lo", 50, weight=1.0)
    t = terms(pol.schedule(view([hi, lo], now=0.0)))
    assert t["hi"][2] == pytest.approx(t["lo"][2])
    pol = policy()
    late = wait("late", 50, arrival=-5.0)          # TTFT deadline 4 s ago, and 20 tokens cannot catch up
    fresh = wait("fresh", 50, arrival=0.0)
    t = terms(pol.schedule(view([late, fresh], now=0.0)))
    assert t["late"][2] == 0.0 and t["fresh"][2] > 0


def test_length_bound_learns_from_finished_requests_and_changes_t_gen():
    pol = policy(min_samples=1, quantile=0.5)
    for n in (4, 6, 8):
        r = dec(f"f{n}", emitted=n)
        r.phase = Phase.DONE
        pol.on_request_finished(r, 1.0)
    bad = dec("bad", emitted=3)
    bad.error = "aborted"                          # censored: its true length is unknown
    pol.on_request_finished(bad, 1.0)
    assert pol.bound.seen == 3
    d = dec("d", emitted=1)                        # survivors of n=1: {4, 6, 8}, median 6 -> len_rem 5
    t = terms(pol.schedule(view([], [d], now=0.1)))
    assert t["d"][0] == pytest.approx(5 * (T_C + T_D))


# -- Alg. 1: top-p filtering and the input-length window -----------------------------------------

def _items(prios, lens):
    """Requests x0, x1, ... with these prompt lengths, and their priorities by id."""
    reqs = [wait(f"x{i}", n) for i, n in enumerate(lens)]
    return reqs, {r.id: p for r, p in zip(reqs, prios)}


def _pick(items, B, cutoff):
    reqs, prio = items
    return sorted(r.prompt_len for r in gmax_select(reqs, B, cutoff, prio))


def test_window_pick_trades_priority_for_length_homogeneity():
    items = _items([10, 9.6, 9.5, 5], [100, 4000, 120, 110])
    # p = 0.95: bp = 9.6, candidates >= 9.12 are {10, 9.6, 9.5}; by length 100, 120, 4000;
    # windows 10+9.5 = 19.5 and 9.5+9.6 = 19.1 -> the two short prompts, not the top two
    assert _pick(items, 2, 0.95) == [100, 120]
    # p = 1: only the top two survive the filter
    assert _pick(items, 2, 1.0) == [100, 4000]
    # p = 0.5: all four are candidates; windows 15, 14.5, 19.1 -> {120, 4000}
    assert _pick(items, 2, 0.5) == [120, 4000]
    # B >= |Q|: everyone
    assert _pick(items, 4, 0.95) == [100, 110, 120, 4000]
    # equal windows: the first (shorter) one
    assert _pick(_items([1, 1, 1, 1], [40, 10, 30, 20]), 2, 1.0) == [10, 20]


# -- frames, free slots, guarded preemption -------------------------------------------------------

def test_group_is_bounded_by_B_and_free_slots_fill_mid_frame():
    pol = policy(batch_size=2, frame_steps=100)
    d1, d2 = dec("d1"), dec("d2")
    plan = run_step(pol, [], [d1, d2], 0.1)
    assert {r.id for r in plan.decode} == {"d1", "d2"}
    a = wait("a", 30, arrival=0.15)
    plan = run_step(pol, [a], [d1, d2], 0.15)       # group full, mid-frame: a waits
    assert not plan.prefill and len(plan.decode) == 2
    plan = run_step(pol, [a], [d2], 0.2)            # d1 finished: its slot goes to a at once
    assert [(r.id, n) for r, n in plan.prefill] == [("a", 30)]
    assert [r.id for r in plan.decode] == ["d2"]


def _preemption_case(frame_steps, prompt):
    """B = 1; D (weight 0.5) runs; at t = 0.2 a weight-2 request A arrives. Steps are 11 ms."""
    pol = policy(batch_size=1, frame_steps=frame_steps)
    D = dec("D", weight=0.5, prompt=20)
    now = 0.1
    run_step(pol, [], [D], now)                     # frame boundary: group {D}
    A = wait("A", prompt, arrival=0.2, weight=2.0)
    plans = []
    for _ in range(frame_steps):
        now += T_C + T_D
        plans.append(run_step(pol, [A], [D], now))
    return pol, D, A, plans


def test_frame_boundary_preemption_only_when_gain_exceeds_stall_cost():
    v = T_C + T_D
    # A's prompt (300 tokens) costs 0.3 s of batch stall and 4 chunk steps.
    t_gen_A = (0.300 + 4 * v) + 19 * v
    P_A = 2 * 20 / t_gen_A                           # 72.3 per s
    P_D = 0.5 / v                                    # 45.5 per s: goodput of every token / its step
    loss = 0.300 * P_D                               # stall_duration × token_generation_speed = 13.6
    # Δ = 20 steps: gain = (P_A − P_D)·0.22 s = 5.9 < loss -> D keeps its slot all along
    gain20 = (P_A - P_D) * min(20 * v, t_gen_A)
    assert gain20 < loss
    pol, _, _, plans = _preemption_case(20, 300)
    t = terms(plans[0])
    assert t["A"][2] > t["D"][2]                     # GMAX alone would take A
    assert all([r.id for r in p.decode] == ["D"] and not p.prefill for p in plans)
    assert (pol.preemptions, pol.kept) == (0, 1)
    # Δ = 50 steps: gain = (P_A − P_D)·0.55 s = 14.7 > loss -> A displaces D at the boundary
    gain50 = (P_A - P_D) * min(50 * v, t_gen_A)
    assert gain50 > loss
    pol, D, _, plans = _preemption_case(50, 300)
    assert all([r.id for r in p.decode] == ["D"] for p in plans[:-1])   # mid-frame: no preemption
    last = plans[-1]
    assert [(r.id, n) for r, n in last.prefill] == [("A", 90)] and not last.decode
    assert pol.preemptions == 1
    # the displaced decode waits with its KV kept: untouched, still decoding
    assert D.phase is Phase.DECODING and D.kv_len == 20 + len(D.token_times) - 1


def test_prefill_only_instance_plans_prefills_only():
    pol = policy()
    a, b = wait("a", 40), wait("b", 30)
    plan = pol.schedule(view([a, b], [dec("d")], mode=PREFILL_ONLY))
    assert not plan.decode
    assert sorted((r.id, n) for r, n in plan.prefill) == [("a", 40), ("b", 30)]


# -- anti-starvation ---------------------------------------------------------------------------------

def test_waiting_outside_the_group_adds_delta_per_frame():
    pol = policy(batch_size=1, frame_steps=1, delta=2.0)
    D = dec("D", weight=2.0)
    H = wait("H", 50, arrival=-10.0)                 # hopeless: no achievable goodput left
    now = 0.1
    for k in range(4):
        t = terms(run_step(pol, [H], [D], now))
        assert t["H"][2] == pytest.approx(2.0 * k / t["H"][0])   # δ·(frames waited) / t_gen
        now += T_C + T_D
    pol = policy(batch_size=1, frame_steps=1, delta=0.0)
    for k in range(3):
        t = terms(run_step(pol, [H], [D], 0.1 + k * 0.011))
    assert t["H"][2] == 0.0


# -- the policy must not read output_len (engines do not know it) -------------------------------------

class NoPeek(Request):
    __slots__ = ("_ol",)
    armed = False

    @property
    def output_len(self):
        if NoPeek.armed:
            raise AssertionError("policy read output_len")
        return self._ol

    @output_len.setter
    def output_len(self, v):
        self._ol = v


def _nopeek(id, prompt, arrival=0.0, weight=1.0):
    return NoPeek(id, "high" if weight > 1 else "low", weight, TTFT, TPOT, arrival, prompt, 50)


@pytest.mark.parametrize("mode", [COLOCATED, PREFILL_ONLY])
def test_gmax_and_router_never_read_output_len(mode):
    rs = [_nopeek(f"n{i}", 20 + 10 * i, arrival=0.01 * i, weight=1 + i % 2) for i in range(6)]
    for r in rs[:3]:
        r.advance_prefill(r.prompt_len, 0.05)
    pol = policy(batch_size=2, frame_steps=1)
    router = make_global("jitserve_power_of_k", deployment="colocated" if mode == COLOCATED else "disaggregated")
    ps = [PrefillInstance(i, Estimator(MODEL)) for i in range(2)]
    qm = PrefillQueueMap(ps)
    NoPeek.armed = True
    try:
        for k in range(3):
            pol.schedule(view(rs[3:], rs[:3], now=0.1 + 0.01 * k, mode=mode))
        for r in rs[3:]:
            p, _ = router.route(r, ps, [], 0.1)
            qm.add(p.id, r, 0.1)
        for r in rs:
            r.phase = Phase.DONE
            pol.on_request_finished(r, 0.2)
            router.on_request_finished(r, 0.2)
    finally:
        NoPeek.armed = False


# -- configuration ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"cutoff": 0.0}, "cutoff"), ({"cutoff": 1.5}, "cutoff"), ({"frame_steps": 0}, "frame_steps"),
    ({"delta": -1}, "delta"), ({"batch_size": 0}, "batch_size"), ({"batch_size": "big"}, "batch_size"),
    ({"token_budget": 0}, "token_budget"), ({"goodput": "requests"}, "goodput"),
    ({"quantile": 1.2}, "quantile"), ({"bogus": 1}, "bogus")])
def test_gmax_rejects_bad_parameters_naming_them(kw, match):
    with pytest.raises(ConfigError, match=match):
        policy(**kw)


def test_auto_batch_size_fits_the_tpot_slo():
    pol = make_local("jitserve_gmax", Estimator(LatencyModel(0, 0, 1e-3, 1e-6, 1e-3, 1e-2)))
    ds = [dec(f"d{i}", prompt=1000) for i in range(3)]    # context 1000: T~_d = 2 ms
    pol.schedule(view([], ds, now=0.1))
    assert pol.last_B == int((TPOT - T_C) / 0.002)         # 45 decodes per 0.1 s step
    pol.schedule(view([wait("a", 450), wait("b", 90)], mode=PREFILL_ONLY))
    assert pol.last_B == math.ceil(90 / 270)               # token budget 90 / mean prompt 270


def test_schedule_with_1000_queued_decides_every_frame():
    # 1,000 queued, every call a frame boundary (the heaviest case): each call gives a plan
    # of distinct requests of the view, within the group size B it chose, and the same view
    # gives the same plan. How fast: scripts/bench_scheduler.py (GMAX at 1,000 queued, its
    # frame-boundary calls on their own line), not a wall-clock assertion here.
    rng = random.Random(1)
    pol, again = policy(frame_steps=1), policy(frame_steps=1)
    waiting = [wait(f"w{i}", rng.randint(10, 4000), arrival=rng.uniform(0, 5), weight=1 + i % 2)
               for i in range(500)]
    decoding = [dec(f"d{i}", emitted=rng.randint(1, 100), prompt=rng.randint(10, 2000), weight=1 + i % 2)
                for i in range(500)]
    for k in range(15):
        v = view(waiting, decoding, now=5.0 + 0.02 * k)
        plan = pol.schedule(v)
        ids = [r.id for r, _ in plan.prefill] + [r.id for r in plan.decode]
        assert ids and len(ids) == len(set(ids))
        assert {r.id for r, _ in plan.prefill} <= {r.id for r in waiting}
        assert {r.id for r in plan.decode} <= {r.id for r in decoding}
        assert len(ids) <= pol.last_B                        # the group GMAX chose (B)
        twin = again.schedule(view(waiting, decoding, now=5.0 + 0.02 * k))
        assert [(r.id, n) for r, n in twin.prefill] == [(r.id, n) for r, n in plan.prefill]
        assert [r.id for r in twin.decode] == [r.id for r in plan.decode]


# -- power-of-K routing -----------------------------------------------------------------------------------

def _replicas(n, betas=None, deployment_colocated=False):
    ps = []
    for i in range(n):
        c = OnlineCorrector()
        if betas:
            c.beta = betas[i]
        ps.append(PrefillInstance(i, Estimator(MODEL, c)))
    return ps, PrefillQueueMap(ps)


def test_power_of_k_avoids_a_replica_where_higher_priority_work_makes_it_late():
    router = make_global("jitserve_power_of_k", prior_len=20)
    ps, qm = _replicas(2)
    for i in range(10):                               # ten short prompts: 10 × (0.1 + 0.01) s ahead
        qm.add(0, wait(f"q{i}", 100, arrival=0.0), 0.0)
    r = wait("r", 300, arrival=0.0)                   # lower priority there: goodput/prefill time
    p, _ = router.route(r, ps, [], 0.0)
    d = router.last_decision
    assert p.id == 1 and d.ahead[0] == pytest.approx(1.1) and d.ahead[1] == 0.0
    assert d.priority[1] > d.priority[0]              # on replica 0 its first token misses TTFT


def test_power_of_k_lets_the_dummy_overtake_lower_priority_work():
    router = make_global("jitserve_power_of_k", prior_len=20)
    ps, qm = _replicas(2)
    qm.add(0, wait("big", 3000, arrival=0.0), 0.0)    # 3 s of prefill, lower priority than r
    r = wait("r", 100, arrival=0.0)
    p, _ = router.route(r, ps, [], 0.0)
    d = router.last_decision
    # GMAX would run r first on replica 0 as well: no work ahead of it, so both replicas
    # tie on priority and first-token time; the tie goes to the replica with less queued
    # work (the paper's "first replica to schedule a copy wins" favours the idle one; a
    # lowest-id tie-break piled every outranking request onto replica 0 in the simulator)
    assert d.ahead == {0: 0.0, 1: 0.0} and p.id == 1
    # with equal queues the lower id still breaks the tie
    ps, qm = _replicas(2)
    assert router.route(wait("r2", 100, arrival=0.0), ps, [], 0.0)[0].id == 0


def test_power_of_k_prefers_the_faster_replica_colocated():
    router = make_global("jitserve_power_of_k", deployment="colocated", prior_len=20)
    ps, _ = _replicas(2, betas=[1.0, 0.5])
    p, _ = router.route(wait("r", 100), ps, [], 0.0)
    assert p.id == 1
    assert router.last_decision.priority[1] == pytest.approx(2 * router.last_decision.priority[0], rel=0.1)


def test_power_of_k_samples_k_replicas_and_picks_decode_by_free_blocks():
    router = make_global("jitserve_power_of_k", k=1, seed=3)
    ps, _ = _replicas(4)
    chosen = set()
    for i in range(40):
        p, d = router.route(wait(f"r{i}", 50), ps, [DecodeInstance(0, 5), DecodeInstance(1, 9)], 0.0)
        assert router.last_decision.sampled == [p.id]
        assert d.id == 1
        chosen.add(p.id)
    assert chosen == {0, 1, 2, 3}
    router = make_global("jitserve_power_of_k", k=10)       # K > M: all M
    router.route(wait("x", 50), ps, [], 0.0)
    assert router.last_decision.sampled == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="k must be"):
        make_global("jitserve_power_of_k", k=0)
    with pytest.raises(ConfigError, match="goodput"):
        make_global("jitserve_power_of_k", goodput="x")


def test_power_of_k_learns_lengths():
    router = make_global("jitserve_power_of_k")
    r = dec("f", emitted=7)
    r.phase = Phase.DONE
    router.on_request_finished(r, 1.0)
    assert router.bound.seen == 1


# -- in the simulator ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_simulator_runs_gmax_and_power_of_k_and_feeds_the_length_bound(deployment):
    from proserve.sim.cluster import SimConfig, Simulator
    rng = random.Random(7)
    reqs = []
    t = 0.0
    for i in range(150):
        t += rng.expovariate(6.0)
        reqs.append(Request(f"s{i}", "high" if i % 2 else "low", 2.0 if i % 2 else 1.0, TTFT, TPOT, t,
                            rng.randint(20, 600), rng.randint(1, 120)))
    cfg = SimConfig(deployment=deployment, instances=2, prefill_instances=2, decode_instances=2,
                    local_policy="jitserve_gmax", global_policy="jitserve_power_of_k",
                    local_params={"frame_steps": 10}, num_kv_blocks=2000, block_size=16)
    sim = Simulator(MODEL, cfg)
    res = sim.run(reqs)
    assert all(r.finished and r.error is None and r.num_emitted == r.output_len for r in res.requests)
    assert sum(i.policy.bound.seen for i in sim.front) == len(reqs)
    assert sim.router.bound.seen == len(reqs)


# -- JITServe's token goodput (paper metric) -------------------------------------------------------------------

def _finished(id, times, prio="low", arrival=0.0, error=None):
    r = Request(id, prio, 2.0 if prio == "high" else 1.0, TTFT, TPOT, arrival, 10, len(times))
    r.token_times = list(times)
    r.phase = Phase.DONE
    r.error = error
    return r


def test_token_goodput_counts_tokens_by_their_timeline():
    # deadlines 1.0, 1.1, 1.2, 1.3: the first on the dot counts ("finishes by"), the third is late
    a = _finished("a", [1.0, 1.05, 1.25, 1.28])
    assert on_time_tokens(a) == 3
    assert _G().tdg(a) == 2.0          # TDG counts strictly before the deadline: the first token misses
    b = _finished("b", [0.5, 0.6, 0.65], prio="high")
    c = _finished("c", [2.0], prio="high", error="aborted")   # late and failed
    m = token_goodput([a, b, c], duration=2.0)
    assert m["all"]["goodput_tokens"] == 6 and m["all"]["output_tokens"] == 8
    assert m["all"]["token_goodput_ratio"] == pytest.approx(6 / 8)
    assert m["all"]["token_goodput_per_s"] == pytest.approx(3.0)
    assert m["all"]["request_goodput"] == 1 and m["all"]["request_goodput_ratio"] == pytest.approx(1 / 3)
    assert m["high"]["goodput_tokens"] == 3 and m["high"]["request_goodput"] == 1
    assert m["low"]["goodput_tokens"] == 3 and m["low"]["request_goodput"] == 0
    # default duration: first arrival -> last token
    assert token_goodput([a, b])["all"]["token_goodput_per_s"] == pytest.approx(6 / 1.28)


def test_token_goodput_counts_unfinished_requests_tokens_not_the_request():
    r = Request("u", "low", 1.0, TTFT, TPOT, 0.0, 10, 5)
    r.token_times = [0.5, 0.6]
    r.phase = Phase.DECODING
    m = token_goodput([r], duration=1.0)["all"]
    assert (m["goodput_tokens"], m["output_tokens"], m["request_goodput"]) == (2, 5, 0)
