"""UniBoost (Li et al., "Beyond Prediction", Algorithm 1): MemGuard's geometric bins and the
priority-revision bound, the γ-boost curve, the γ-Ada tail estimator, the
policy's unified boosted-arrival order with pins and hysteresis, its
completion hook, and the P99 TTLT metric — on hand-computed cases.

Latency model (as in test_local_policies): prefill 1 ms per token, decode step
1 ms, t_c = 10 ms, β = 1. Most ordering cases set ``token_seconds`` so that a
bin of ŝ tokens is ŝ·τ seconds of service and boosts are easy to compute.
"""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from proserve.scheduler import ConfigError, Estimator, LatencyModel, Request, local_names, make_local
from proserve.scheduler.alternatives.uniboost.bins import (
    LN5,
    LN_99_95,
    TailGamma,
    boost,
    empirical_quantile,
    next_threshold,
    percentile,
    quantize,
    revision_bound,
)
from proserve.scheduler.alternatives.uniboost.metrics import p99_ttlt, ttlt, ttlt_stats
from proserve.scheduler.local import COLOCATED, PREFILL_ONLY, InstanceView
from proserve.scheduler.request import Phase

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=1e-2)


def policy(**params):
    params.setdefault("adaptive", False)
    return make_local("uniboost", Estimator(MODEL), **params)


def wait(id, arrival, prompt, out=100, prio="low") -> Request:
    return Request(id, prio, 2.0 if prio == "high" else 1.0, 1.0, 0.1, arrival, prompt, out)


def dec(id, arrival, emitted=1, prompt=20, out=100_000) -> Request:
    """Decoding, ``emitted`` tokens out; kv_len = prompt + emitted - 1 (20 + … with block 16)."""
    r = wait(id, arrival, prompt, out)
    r.advance_prefill(prompt, arrival + 0.01)
    for _ in range(emitted - 1):
        r.emit(arrival + 0.02)
        r.kv_len += 1
    return r


def step(r: Request, now: float) -> None:
    """Apply one decode step to ``r`` as the bodies do."""
    r.kv_len += 1
    r.emit(now)


def view(waiting=(), decoding=(), now=100.0, mode=COLOCATED, free_blocks=1 << 30):
    return InstanceView(now=now, waiting=list(waiting), decoding=list(decoding), free_blocks=free_blocks,
                        block_size=16, mode=mode)


def order(plan):
    return [r.id for r, _ in plan.prefill] + [r.id for r in plan.decode]


# -- MemGuard bins (Algorithm 1 QUANTIZE, §3.3) -----------------------------------------------------
def _reference_bin(s, k):
    """k·2^⌊log2(max(1, s/k))⌋ by counting doublings (no floating-point log)."""
    b = k
    while 2 * b <= max(s, k):
        b *= 2
    return b


@pytest.mark.parametrize("s, expected", [
    (0, 256), (1, 256), (255, 256), (256, 256), (511, 256),      # [0, 2k) -> k (floor rounding)
    (512, 512), (1023, 512), (1024, 1024), (2047, 1024), (2048, 2048),
    (10_000, 8192), (16_383, 8192), (16_384, 16_384)])
def test_bin_boundaries_k256(s, expected):
    assert quantize(s, 256) == expected
    assert next_threshold(s, 256) == 2 * expected


@pytest.mark.parametrize("k", [1, 3, 16, 100, 256])
def test_bins_match_the_formula_everywhere(k):
    for s in range(0, 9000):
        assert quantize(s, k) == _reference_bin(s, k), (s, k)
    # and the floating-point formula of Algorithm 1 away from the exact edges
    for s in (5, 77, 1234, 4097, 8191):
        assert quantize(s, k) == int(k * 2 ** math.floor(math.log2(max(1.0, s / k))))


def test_bins_are_geometric_and_below_the_signal():
    # each bin is a power-of-two multiple of k, never above max(s, k), and above s/2 (Lemma A.1)
    for s in range(256, 50_000, 37):
        b = quantize(s, 256)
        assert b % 256 == 0 and (b // 256) & (b // 256 - 1) == 0
        assert s / 2 < b <= s


def test_revision_bound_papers_worked_example():
    # §3.3: "For a 10k decode length, the number is at most 6 swap opportunities under k = 256."
    assert revision_bound(10_000, 256) == 6
    # the bins a 10k-token decode passes through: 256, 512, 1024, 2048, 4096, 8192
    assert len({quantize(w, 256) for w in range(1, 10_001)}) == 6
    # Eq. 8's ceiling would give 7, which contradicts the example: we round down
    assert 1 + math.ceil(math.log2(10_000 / 256)) == 7


@pytest.mark.parametrize("k", [16, 256])
def test_revision_bound_counts_the_distinct_bins(k):
    rng = random.Random(1)
    for S in [1, k - 1, k, 2 * k - 1, 2 * k, 4 * k, 4 * k + 1] + [rng.randint(1, 40 * k) for _ in range(30)]:
        bins = {quantize(w, k) for w in range(0, S + 1)}
        assert len(bins) == revision_bound(S, k) == 1 + math.floor(math.log2(max(S, k) / k))


# -- γ-boost (Eq. 2) ------------------------------------------------------------------------------------
def test_boost_matches_eq2_and_its_limits():
    for g in (0.01, 0.5, 1.0, 100.0):
        for x in (1e-3, 0.1, 1.0, 3.0):
            assert boost(x, g) == pytest.approx(math.log(1 / (1 - math.exp(-g * x))) / g, rel=1e-9)
    assert boost(0.0, 1.0) == math.inf
    # small γx: ≈ log(1/(γx))/γ; large γx: ≈ e^{-γx}/γ -> 0 (FCFS)
    assert boost(1e-6, 1.0) == pytest.approx(math.log(1e6), rel=1e-5)
    assert boost(20.0, 1.0) == pytest.approx(math.exp(-20.0), rel=1e-6)
    assert boost(10.0, 100.0) == 0.0
    xs = np.linspace(0.01, 20, 300)
    assert all(boost(a, 0.7) > boost(b, 0.7) for a, b in zip(xs, xs[1:]))


def test_quantized_boost_is_at_most_boost_of_half_the_service():
    # Lemma A.1's precondition: attained service a gets a boost of at most b_γ(a/2)
    for a in range(256, 40_000, 101):
        assert boost(quantize(a, 256) * 1e-3, 2.0) <= boost(a / 2 * 1e-3, 2.0)


# -- the paper's percentile and γ-Ada (§3.4) ------------------------------------------------------------
def test_empirical_quantile_is_the_inverse_survival_function():
    xs = list(range(1, 101))
    assert empirical_quantile(xs, 99) == 99        # numpy's default interpolation gives 99.01
    assert empirical_quantile(xs, 95) == 95
    assert empirical_quantile(xs, 50) == 50
    assert empirical_quantile(list(range(1, 11)), 99) == 10   # ⌈9.9⌉: the maximum
    assert empirical_quantile(list(range(1, 1001)), 99.9) == 999
    assert math.isnan(empirical_quantile([], 99))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    with pytest.raises(ConfigError, match="percentile"):
        empirical_quantile([1.0], 0)


def _exponential_quantiles(rate, n):
    """n latencies whose empirical distribution is Exp(rate): the (i-0.5)/n quantiles."""
    return [-math.log(1 - (i - 0.5) / n) / rate for i in range(1, n + 1)]


def test_eq9_recovers_an_exponential_tail_rate():
    for rate in (0.2, 2.0):
        t = TailGamma(1.0, 1e-3, 1e3, 1.0, 1e-6, 20_000, 100)
        for x in _exponential_quantiles(rate, 20_000):
            t.samples.append(x)
        assert t.estimate() == pytest.approx(rate, rel=0.01)
        # Algorithm 1 line 17's literal constant is 39x smaller
        a = TailGamma(1.0, 1e-3, 1e3, 1.0, 1e-6, 20_000, 100, tail_constant="alg1")
        a.samples.extend(t.samples)
        assert a.estimate() == pytest.approx(rate * LN_99_95 / LN5, rel=0.01)
        assert LN5 / LN_99_95 == pytest.approx(39.02, abs=0.01)


def test_update_gamma_ema_clip_and_warmup():
    t = TailGamma(gamma=1.0, gamma_min=0.01, gamma_max=100.0, smoothing=0.5, epsilon=1e-3, window=100,
                  min_samples=100)
    xs = list(range(1, 101))                     # t95 = 95, t99 = 99: γ̂ = ln5/4
    for x in xs[:-1]:
        assert t.observe(x) == 1.0              # fewer than min_samples: γ stays
    assert t.updates == 0
    g = t.observe(xs[-1])
    assert t.last_estimate == pytest.approx(LN5 / 4)
    assert g == pytest.approx(0.5 * 1.0 + 0.5 * LN5 / 4)      # line 18
    # a compressed tail: Δ = ε, γ̂ = ln5/ε = 1609 -> clipped to γ_max (line 19)
    c = TailGamma(1.0, 0.01, 100.0, 1.0, 1e-3, 10, 2)
    for _ in range(10):
        c.observe(5.0)
    assert c.last_estimate == pytest.approx(LN5 / 1e-3) and c.gamma == 100.0
    # a very long tail pushes γ down to γ_min
    lo = TailGamma(1.0, 0.01, 100.0, 1.0, 1e-3, 100, 100)
    for x in range(96):                          # t95 = 1, t99 = 1e6
        lo.observe(1.0)
    for x in range(4):
        lo.observe(1e6)
    assert lo.gamma == 0.01
    # the window slides: old samples leave
    assert len(t.samples) == 100
    t.observe(1000.0)
    assert len(t.samples) == 100 and t.samples[0] == 2
    # non-finite and negative samples are ignored
    n = len(c.samples)
    c.observe(float("nan")), c.observe(-1.0)
    assert len(c.samples) == n


# -- the policy: parameters -------------------------------------------------------------------------------
def test_registered_with_documented_defaults():
    assert "uniboost" in local_names()
    p = make_local("uniboost", Estimator(MODEL))
    assert (p.k, p.delta, p.gamma, p.max_num_seqs, p.adaptive, p.memguard) == (256, 0.1, 1.0, 256, True, True)
    assert (p.tail.gamma_min, p.tail.gamma_max, p.tail.smoothing, p.tail.epsilon) == (0.01, 100.0, 0.1, 1e-3)
    assert (p.tail.samples.maxlen, p.tail.min_samples, p.tail.C) == (1000, 100, LN5)
    assert p.token_budget is None and p.token_seconds is None and p.a_ref == "arrival"


@pytest.mark.parametrize("kw, match", [
    (dict(k=0), "k must be an integer >= 1, got 0"),
    (dict(k=2.5), "k must be an integer >= 1, got 2.5"),
    (dict(delta=-0.1), "delta must be a number >= 0, got -0.1"),
    (dict(gamma=0), "gamma must be a number > 0, got 0"),
    (dict(gamma_min=5.0, gamma_max=1.0), r"gamma_min must be <= gamma_max \(1.0\), got 5.0"),
    (dict(gamma_max=float("inf")), "gamma_max must be a number > 0, got inf"),
    (dict(smoothing=0), r"smoothing must be a number in \(0, 1\], got 0"),
    (dict(smoothing=1.5), r"smoothing must be a number in \(0, 1\], got 1.5"),
    (dict(epsilon=0), "epsilon must be a number > 0, got 0"),
    (dict(window=1), "window must be an integer >= 2, got 1"),
    (dict(window=50, min_samples=100), r"min_samples must be <= window \(50\), got 100"),
    (dict(tail_constant="log"), "tail_constant must be one of eq9, alg1, got 'log'"),
    (dict(adaptive="yes"), "adaptive must be true or false, got 'yes'"),
    (dict(memguard=1), "memguard must be true or false, got 1"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0"),
    (dict(token_budget=0), "token_budget must be an integer >= 1, got 0"),
    (dict(token_seconds=0), "token_seconds must be a number > 0, got 0"),
    (dict(a_ref="first_token"), "a_ref must be one of arrival, phase_entry, got 'first_token'"),
    (dict(theta=1), "unexpected keyword argument 'theta'"),
])
def test_bad_parameters_raise_config_error_naming_them(kw, match):
    with pytest.raises(ConfigError, match=match):
        make_local("uniboost", Estimator(MODEL), **kw)


# -- the policy: boosted arrival order (lines 5-11, 14) ------------------------------------------------------
def test_service_time_units_from_the_latency_model():
    p = policy()
    r = wait("a", 0.0, prompt=300)
    assert p.service_time(r, 256, False) == pytest.approx(256e-3 + 1e-2)          # T~_p(256) + t_c
    d = dec("d", 0.0, emitted=5, prompt=20)
    assert p.service_time(d, 256, True) == pytest.approx(256 * (1e-3 + 1e-2))      # 256·(T~_d + t_c)
    assert policy(token_seconds=2e-3).service_time(r, 512, False) == pytest.approx(1.024)
    # π = a - b_γ(x) with ŝ = QUANTIZE(SIGNAL): prompt 300 -> 256; 5 decoded tokens -> 256
    assert p.priority(r) == pytest.approx(0.0 - boost(0.266, 1.0))
    assert p.priority(d) == pytest.approx(0.0 - boost(2.816, 1.0))


def test_short_job_overtakes_a_long_one_only_within_its_boost():
    # A: prompt 4000 -> bin 2048 -> x = 2.048 s;  B: prompt 100 -> bin 256 -> x = 0.256 s  (τ = 1 ms)
    # γ = 1: b_A = 0.1381, b_B = 1.4879: B may overtake A if it arrived less than 1.3497 s later
    gap = boost(0.256, 1.0) - boost(2.048, 1.0)
    assert gap == pytest.approx(1.3497, abs=1e-4)
    for b_arrival, first in ((gap - 0.01, "B"), (gap + 0.01, "A")):
        p = policy(token_seconds=1e-3, token_budget=300)
        plan = p.schedule(view([wait("A", 0.0, 4000), wait("B", b_arrival, 100)], now=5.0))
        if first == "B":
            assert [(r.id, n) for r, n in plan.prefill] == [("B", 100), ("A", 200)]
        else:
            assert [(r.id, n) for r, n in plan.prefill] == [("A", 300)]


@pytest.mark.parametrize("gamma, expected", [(100.0, ["A", "B", "C"]),    # FCFS-like (Fig. 3)
                                             (0.01, ["C", "B", "A"])])    # LAS/size-first-like
def test_gamma_interpolates_between_fcfs_and_size_first(gamma, expected):
    p = policy(token_seconds=1e-3, gamma=gamma, token_budget=100_000)
    plan = p.schedule(view([wait("A", 0.0, 8000), wait("B", 1.0, 1500), wait("C", 2.0, 50)], now=3.0))
    assert order(plan) == expected


def test_unified_order_across_phases():
    p = policy(token_seconds=1e-3, token_budget=1000)
    # D1: decoding, arrived 0, bin 256 -> π = 0 - b(0.256) = -1.4879
    # W : waiting prompt 600 (bin 512), arrived 0.5 -> π = 0.5 - b(0.512) = -0.4145
    # D2: decoding, arrived 1.5 -> π = 1.5 - 1.49 = 0.01
    plan = p.schedule(view([wait("W", 0.5, 600)], [dec("D1", 0.0), dec("D2", 1.5)], now=2.0))
    assert order(plan) == ["W", "D1", "D2"]           # all fit (the plan lists prefills first)
    d1, w, d2 = plan.decode[0], plan.prefill[0][0], plan.decode[1]
    assert p.priority(d1) == pytest.approx(-1.4879, abs=1e-4)
    assert p.priority(w) == pytest.approx(0.5 - 0.9145, abs=1e-4)
    assert p.priority(d2) == pytest.approx(1.5 - 1.4879, abs=1e-4)
    # with a budget of 600 tokens D1 gets its token, W the rest (599), D2 nothing
    p = policy(token_seconds=1e-3, token_budget=600)
    plan = p.schedule(view([wait("W", 0.5, 600)], [dec("D1", 0.0), dec("D2", 1.5)], now=2.0))
    assert [(r.id, n) for r, n in plan.prefill] == [("W", 599)] and [r.id for r in plan.decode] == ["D1"]


@pytest.mark.parametrize("params", [{}, {"token_seconds": 1e-3, "gamma": 0.05}, {"memguard": False},
                                    {"a_ref": "phase_entry", "k": 16}])
def test_plan_order_is_increasing_priority(params):
    # the schedule loop inlines lines 6-9 for speed: it must agree with priority()
    rng = random.Random(7)
    waiting = [wait(f"w{i}", rng.uniform(0, 10), rng.randint(1, 5000)) for i in range(60)]
    decoding = [dec(f"d{i}", rng.uniform(0, 10), emitted=rng.randint(1, 3000)) for i in range(60)]
    for d in decoding:
        d.token_times[0] = d.arrival + rng.uniform(0, 5)
    p = policy(token_budget=10**7, max_num_seqs=1000, **params)
    plan = p.schedule(view(waiting, decoding, now=20.0))
    assert len(plan.prefill) == 60 and len(plan.decode) == 60
    for items in ([r for r, _ in plan.prefill], plan.decode):
        pis = [p.priority(r) for r in items]
        assert pis == sorted(pis)
    # and across phases: the requests that fit a small budget are the best-π ones
    q = policy(token_budget=50, max_num_seqs=1000, **params)
    small = q.schedule(view(waiting, decoding, now=20.0))
    best = sorted(waiting + decoding, key=q.priority)
    taken = {r.id for r, _ in small.prefill} | {r.id for r in small.decode}
    assert best[0].id in taken
    cutoff = max(q.priority(r) for r in best if r.id in taken)
    assert all(r.id in taken for r in best if q.priority(r) < cutoff)


def test_prefill_with_better_priority_can_take_the_whole_budget_from_decodes():
    p = policy(token_seconds=1e-3, token_budget=300)
    plan = p.schedule(view([wait("W", 0.0, 1000)], [dec("D", 5.0)], now=6.0))
    assert [(r.id, n) for r, n in plan.prefill] == [("W", 300)] and plan.decode == []


def test_phase_entry_reference_time():
    d = dec("D", 0.0)                    # first token at 0.01
    d.token_times[0] = 3.0
    w = wait("W", 1.0, 100)              # same bin and τ -> same boost as D's decode bin
    p = policy(token_seconds=1e-3, token_budget=1000)
    assert p.priority(d) < p.priority(w)                         # arrival 0 < 1
    q = policy(token_seconds=1e-3, token_budget=1000, a_ref="phase_entry")
    assert q.priority(d) == pytest.approx(3.0 - boost(0.256, 1.0))
    assert q.priority(d) > q.priority(w)                         # decode entry 3.0 > 1.0


def test_micro_batch_cap_and_prefill_only_mode():
    p = policy(token_seconds=1e-3, token_budget=10_000, max_num_seqs=2)
    ws = [wait(f"w{i}", float(i), 100) for i in range(4)]
    assert order(p.schedule(view(ws, now=10.0))) == ["w0", "w1"]
    # prefill-only instance: decodes are not planned
    q = policy(token_seconds=1e-3, token_budget=10_000)
    plan = q.schedule(view([wait("w", 1.0, 100)], [dec("d", 0.0)], now=2.0, mode=PREFILL_ONLY))
    assert order(plan) == ["w"]


def test_kv_need_that_does_not_fit_waits():
    # no free block: a decode at a block boundary (kv 32) cannot grow; one inside a block can;
    # a new prompt cannot start
    at_edge = dec("E", 0.0, emitted=13, prompt=20)      # kv_len = 32
    inside = dec("I", 1.0, emitted=1, prompt=20)        # kv_len = 20
    assert at_edge.kv_len % 16 == 0 and inside.kv_len % 16
    p = policy(token_seconds=1e-3, token_budget=1000)
    plan = p.schedule(view([wait("W", 0.0, 50)], [at_edge, inside], now=2.0, free_blocks=0))
    assert order(plan) == ["I"]


# -- MemGuard pins and Eq. 7 hysteresis ---------------------------------------------------------------------------
def test_dispatched_request_is_non_evictable_until_its_next_threshold():
    k = 4
    p = policy(k=k, token_seconds=1e-3, token_budget=1000, max_num_seqs=1)
    a = dec("A", 10.0, emitted=1)                        # signal 1, bin 4, next threshold 8
    now = 11.0
    assert order(p.schedule(view([], [a], now=now))) == ["A"]
    assert p.pinned(a)
    b = wait("B", 0.0, 10)                               # arrived 10 s earlier: far better π
    assert p.priority(b) < p.priority(a) - 5
    seats = []
    while a.num_emitted <= 8:
        plan = p.schedule(view([b], [a], now=now))
        seats.append((a.num_emitted, order(plan)))
        if not plan.decode:
            break
        step(a, now)
        now += 0.1
    # A keeps its seat at signals 1..7; at 8 (= 2·bin) the pin is released and B takes over
    assert seats[:7] == [(n, ["A"]) for n in range(1, 8)]
    assert seats[7:] == [(8, ["B"])]
    # without MemGuard B takes the seat at once
    q = policy(k=k, token_seconds=1e-3, token_budget=1000, max_num_seqs=1, memguard=False)
    a2 = dec("A2", 10.0, emitted=1)
    q.schedule(view([], [a2], now=11.0))
    assert order(q.schedule(view([wait("B2", 0.0, 10)], [a2], now=11.0))) == ["B2"]


def test_started_prefill_is_pinned_until_it_completes():
    p = policy(token_seconds=1e-3, token_budget=100, max_num_seqs=1)
    a = wait("A", 5.0, 300)
    assert [(r.id, n) for r, n in p.schedule(view([a], now=6.0)).prefill] == [("A", 100)]
    a.advance_prefill(100, 6.1)
    b = wait("B", 0.0, 50)                               # better π, arrives mid-prefill
    assert p.priority(b) < p.priority(a)
    assert order(p.schedule(view([a, b], now=6.1))) == ["A"]
    a.advance_prefill(100, 6.2)
    assert order(p.schedule(view([a, b], now=6.2))) == ["A"]
    a.advance_prefill(100, 6.3)                          # first token: A enters decode, pin released
    assert a.phase is Phase.DECODING and not p.pinned(a)
    assert order(p.schedule(view([b], [a], now=6.3))) == ["B"]


@pytest.mark.parametrize("advantage, winner", [(0.05, "A"), (0.099, "A"), (0.101, "B"), (0.2, "B")])
def test_eq7_hysteresis_delta(advantage, winner):
    # no pins (memguard off) to isolate Eq. 7: A ran last step; B (same bin and phase)
    # displaces it only if π(B) < π(A) - δ, δ = 0.1
    p = policy(memguard=False, token_seconds=1e-3, token_budget=1000, max_num_seqs=1, delta=0.1)
    a = dec("A", 1.0)
    assert order(p.schedule(view([], [a], now=2.0))) == ["A"]
    b = dec("B", 1.0 - advantage)
    assert p.priority(a) - p.priority(b) == pytest.approx(advantage)
    assert order(p.schedule(view([], [a, b], now=2.0))) == [winner]
    # a request that did not run last step gets no δ: the better π wins outright
    p2 = policy(memguard=False, token_seconds=1e-3, token_budget=1000, max_num_seqs=1, delta=0.1)
    assert order(p2.schedule(view([], [dec("A", 1.0), dec("B", 1.0 - advantage)], now=2.0))) == ["B"]


@pytest.mark.parametrize("S", [10_000, 600, 255])
def test_priority_revisions_over_a_requests_life_obey_the_bound(S):
    """Run one request through its whole decode alone; count (1) distinct priorities it
    is given and (2) the steps at which it was evictable (not pinned) — MemGuard's
    preemption opportunities — against 1 + ⌊log2(S/k)⌋ (6 for S = 10k, k = 256)."""
    k = 256
    p = policy(k=k, token_budget=1000, gamma=0.01)   # small γ: no bin's boost underflows to 0
    r = dec("R", 0.0, emitted=1, out=S)
    priorities, opportunities = [], 0
    now = 1.0
    while r.num_emitted < S:
        if not p.pinned(r):
            opportunities += 1
        plan = p.schedule(view([], [r], now=now))
        assert order(plan) == ["R"]
        priorities.append(p.priority(r))
        step(r, now)
        now += 0.01
    revisions = 1 + sum(1 for x, y in zip(priorities, priorities[1:]) if x != y)
    assert revisions == opportunities == revision_bound(S - 1, k) <= revision_bound(S, k)
    if S == 10_000:
        assert revision_bound(S, k) == 6 and revisions == 6


# -- γ-Ada through the completion hook (line 28) -------------------------------------------------------------------
def _finished(id, arrival, ttlt_s, error=None):
    r = wait(id, arrival, 10, out=1)
    r.advance_prefill(10, arrival + ttlt_s)
    r.error = error
    return r


def test_gamma_learns_from_finished_requests():
    p = make_local("uniboost", Estimator(MODEL), window=100, min_samples=100, smoothing=1.0)
    assert p.gamma == 1.0
    for i in range(1, 101):
        p.on_request_finished(_finished(f"r{i}", 0.0, float(i)), float(i))
    # TTLTs 1..100 s: t95 = 95, t99 = 99 -> γ = ln5/4
    assert p.gamma == pytest.approx(LN5 / 4)
    # the priority uses the learned γ
    w = wait("w", 0.0, 100)
    assert p.priority(w) == pytest.approx(-boost(0.266, LN5 / 4))
    # failed requests and ones without tokens are not samples; adaptive=false never moves γ
    n = len(p.tail.samples)
    p.on_request_finished(_finished("bad", 0.0, 5.0, error="aborted"), 5.0)
    p.on_request_finished(wait("none", 0.0, 10), 5.0)
    assert len(p.tail.samples) == n
    fixed = policy(min_samples=2, window=10)
    for i in range(10):
        fixed.on_request_finished(_finished(f"f{i}", 0.0, float(i + 1)), 1.0)
    assert fixed.gamma == 1.0 and not fixed.tail.samples


def test_pins_are_forgotten_when_requests_leave():
    p = policy(token_seconds=1e-3, token_budget=1000)
    a, b = dec("A", 0.0), dec("B", 0.0)
    p.schedule(view([], [a, b], now=1.0))
    assert p.pinned(a) and p.pinned(b)
    p.on_request_finished(a, 2.0)
    assert not p.pinned(a)
    p.schedule(view([], [dec("C", 0.0)], now=1.0))        # B left the instance (e.g. KV moved)
    assert not p.pinned(b)


def test_never_reads_output_len():
    # the engine leaves output_len at 1: the plan must not change with it
    def reqs(out):
        return [wait("w", 0.5, 600, out=out)], [dec("d", 0.0, emitted=3, out=max(out, 4))]
    plans = []
    for out in (4, 1000):
        w, d = reqs(out)
        plans.append([(r.id, n) for r, n in (policy().schedule(view(w, d, now=1.0))).prefill])
    assert plans[0] == plans[1]


def test_schedule_with_1000_queued_requests_is_fast():
    rng = random.Random(0)
    waiting, decoding = [], []
    for i in range(1000):
        if i % 2:
            decoding.append(dec(f"d{i}", rng.random() * 10, emitted=rng.randint(1, 900),
                                prompt=rng.randint(10, 2000)))
        else:
            waiting.append(wait(f"w{i}", rng.random() * 10, rng.randint(10, 4000)))
    p = make_local("uniboost", Estimator(MODEL))
    v = view(waiting, decoding, now=11.0)
    p.schedule(v)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        p.schedule(v)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.010


# -- in the simulator ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_simulator_runs_uniboost_and_feeds_gamma(deployment):
    from proserve.bench.workloads import build_workload
    from proserve.profiler.modelfile import BUNDLED, load
    from proserve.sim.cluster import SimConfig, Simulator

    reqs = build_workload("bench/data/azure_conv_2023.csv", rate=4.0, num_requests=300, seed=0, fmt="azure")
    sim = Simulator(load(BUNDLED), SimConfig(deployment=deployment, local_policy="uniboost",
                                             global_policy="round_robin", prefill_instances=1,
                                             local_params={"min_samples": 50}))
    res = sim.run(reqs)
    assert all(r.finished and r.error is None and r.num_emitted == r.output_len for r in res.requests)
    pol = sim.front[0].policy
    assert pol.tail.updates == 300 - 50 + 1 and pol.gamma != 1.0
    assert not pol._pins
    assert p99_ttlt(res.requests)["all"] > 0


# -- the paper's metric: P99 TTLT ---------------------------------------------------------------------------------------
def test_ttlt_p99_overall_and_per_class():
    reqs = []
    for i in range(1, 101):
        reqs.append(_finished(f"h{i}", 10.0, float(i)))
        reqs[-1].priority = "high"
    for i in range(1, 11):
        reqs.append(_finished(f"l{i}", 0.0, 2.0 * i))
    unfinished = wait("u", 0.0, 10)                      # never ran
    failed = _finished("f", 0.0, 1.0, error="request does not fit in KV memory")
    reqs += [unfinished, failed]
    assert ttlt(reqs[0]) == pytest.approx(1.0) and ttlt(unfinished) is None and ttlt(failed) is None
    s = ttlt_stats(reqs)
    assert set(s) == {"all", "high", "low"}
    assert s["high"].p99 == pytest.approx(99.0) and s["high"].p95 == pytest.approx(95.0)   # not 99.01
    assert s["low"].p99 == pytest.approx(20.0) and s["low"].p50 == pytest.approx(10.0)
    assert (s["low"].requests, s["low"].completed, s["low"].unfinished) == (12, 10, 2)
    assert s["all"].completed == 110 and s["all"].unfinished == 2
    ttlts = sorted([float(i) for i in range(1, 101)] + [2.0 * i for i in range(1, 11)])
    assert s["all"].p99 == ttlts[math.ceil(110 * 0.99) - 1] == 99.0
    assert s["all"].mean == pytest.approx(sum(ttlts) / 110)
    assert p99_ttlt(reqs) == {"all": s["all"].p99, "high": 99.0, "low": 20.0}
    empty = ttlt_stats([wait("x", 0.0, 10)])["all"]
    assert empty.completed == 0 and math.isnan(empty.p99) and math.isnan(empty.mean)
