"""Global routing: GoRouting (Alg. 2), Min-Load, round-robin, random; PrefillQueueMap.

A hand-made latency model keeps the numbers readable: prefill costs 1 ms per
token and every batch 10 ms of overhead, so (one request per batch, φ_p) a
request of ``n`` tokens costs ``n/1000 + 0.01`` s: 190 tokens → 0.2 s,
490 tokens → 0.5 s. A decode step costs b_d = 1 ms per request.
"""

from __future__ import annotations

import math
import random

import pytest

from proserve.scheduler import ConfigError, Estimator, GainConfig, LatencyModel, Request, make_global
from proserve.scheduler.config import default_classes
from proserve.scheduler.registry import global_names
from proserve.scheduler.routing.base import COLOCATED, DISAGGREGATED, DecodeInstance, PrefillInstance, PrefillQueueMap
from proserve.scheduler.routing.estimates import estimate_exec, estimate_gain, evaluate
from proserve.scheduler.routing.go_routing import GoRouting
from proserve.scheduler.host import RouterHost

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01)
GAIN = GainConfig()


def req(rid, tokens, arrival=0.0, ttft=1.0, tpot=0.1, weight=1.0):
    return Request(rid, "high" if weight > 1 else "low", weight, ttft, tpot, arrival, tokens)


def tok(seconds):
    """Prompt length whose φ_p cost (exec + t_c) is ``seconds``."""
    return round((seconds - 0.01) * 1000)


def cluster(*loads, ts=0.0):
    """Prefill instances whose queues hold one request of φ_p cost ``load`` (0 → empty)."""
    ps = [PrefillInstance(i, Estimator(MODEL)) for i in range(len(loads))]
    qm = PrefillQueueMap(ps)
    for p, load in zip(ps, loads):
        if load:
            # arrived just before: its deadline precedes a new request's, so it stays ahead
            qm.add(p.id, req(f"q{p.id}", tok(load), arrival=-0.01), ts)
    return ps, qm


# -- ESTIMATEEXEC -----------------------------------------------------------------------

def test_estimate_exec_by_hand_with_and_without_lag():
    ps, qm = cluster(0)
    p = ps[0]
    qm.add(0, req("a", 190), 0.0)   # 0.19 + 0.01
    qm.add(0, req("b", 290), 0.0)   # 0.29 + 0.01
    r = req("r", 90)                # 0.09 + 0.01
    assert estimate_exec(p, r, 0.0) == pytest.approx(0.5)
    assert estimate_exec(p, r, 0.0, include=True) == pytest.approx(0.6)
    # 0.3 s since the last update: the instance has worked through 0.3 s of its queue
    assert estimate_exec(p, r, 0.3) == pytest.approx(0.2)
    assert estimate_exec(p, r, 0.3, include=True) == pytest.approx(0.3)
    # lag beyond the queued work: clamped at 0, req's own cost is still due
    assert estimate_exec(p, r, 2.0) == 0.0
    assert estimate_exec(p, r, 2.0, include=True) == pytest.approx(0.1)


def test_estimate_exec_follows_beta_and_remaining_prefill():
    ps, qm = cluster(0)
    p = ps[0]
    half = req("h", 400)
    half.prefilled = half.kv_len = 200   # partially prefilled before dispatch: 200 left
    qm.add(0, half, 0.0)
    r = req("r", 90)
    assert estimate_exec(p, r, 0.0) == pytest.approx(0.21)
    p.estimator.corrector.beta = 2.0     # online correction (§4.1) scales every cost
    assert estimate_exec(p, r, 0.0) == pytest.approx(0.42)
    assert estimate_exec(p, r, 0.0, include=True) == pytest.approx(0.42 + 0.2)


def test_dispatcher_work_is_frozen_at_dispatch_and_lag_covers_progress():
    """The dispatcher does not see chunk progress (§4.3): a request whose shared object
    advances in the simulator must not be counted as progressed twice."""
    ps, qm = cluster(0)
    p = ps[0]
    a = req("a", 490)
    qm.add(0, a, 0.0)
    r = req("r", 90)
    a.prefilled = a.kv_len = 300           # the engine ran 0.3 s of it
    assert estimate_exec(p, r, 0.3) == pytest.approx(0.2)   # 0.5 − lag 0.3, not 0.2 − 0.3
    # a request put into the queue by hand (not through PrefillQueueMap) is read live
    p.queue.append(req("b", 90))
    assert estimate_exec(p, r, 0.3) == pytest.approx(0.3)


# -- ESTIMATEGAIN ------------------------------------------------------------------------

def _gain_queue():
    ps, qm = cluster(0)
    p = ps[0]
    qm.add(0, req("r1", tok(0.3), ttft=1.0), 0.0)             # deadline 1.0, w 1
    qm.add(0, req("r2", tok(0.5), ttft=0.6, weight=2.0), 0.0)  # deadline 0.6, w 2
    return p


def test_estimate_gain_by_hand():
    p = _gain_queue()
    # remain order: r2 done 0.5 < 0.6 (+2), r1 done 0.8 < 1.0 (+1)
    assert estimate_gain(p, 0.0, GAIN) == pytest.approx(3.0)
    # req (deadline 0.9, w 2) slots between: r2 0.5 ✓, req 0.8 ✓, r1 1.1 ✗
    x = req("x", tok(0.3), ttft=0.9, weight=2.0)
    assert estimate_gain(p, 0.0, GAIN, req=x) == pytest.approx(4.0)
    assert evaluate(p, x, 0.0, GAIN, DISAGGREGATED).delta == pytest.approx(1.0)
    # 0.2 s of lag: r2 0.3, req 0.6, r1 0.9 — everybody meets
    p.ts = -0.2
    assert estimate_gain(p, 0.0, GAIN, req=x) == pytest.approx(5.0)
    assert evaluate(p, x, 0.0, GAIN, DISAGGREGATED).delta == pytest.approx(2.0)
    # a request that cannot make it anywhere in the order adds nothing
    hopeless = req("y", tok(1.5), ttft=1.0)
    assert evaluate(p, hopeless, 0.0, GAIN, DISAGGREGATED).delta == 0.0


def test_estimate_gain_uses_w_p_and_priority_weight():
    p = _gain_queue()
    g = GainConfig(w_p=3.0, w_d=1.0)
    assert estimate_gain(p, 0.0, g) == pytest.approx(3.0 * 3.0)


@pytest.mark.parametrize("deployment", [DISAGGREGATED, COLOCATED])
def test_incremental_delta_matches_reference(deployment):
    """evaluate()'s one-bisect Δ equals ESTIMATEGAIN(Q ∪ {req}) − ESTIMATEGAIN(Q) from the definitions."""
    rnd = random.Random(7)
    for trial in range(300):
        ps = [PrefillInstance(0, Estimator(MODEL), n_decode=rnd.choice([0, 5, 30]),
                              avg_decode_kv=rnd.choice([0, 512]))]
        qm = PrefillQueueMap(ps)
        now = 10.0
        for k in range(rnd.randrange(0, 12)):
            qm.add(0, req(f"q{k}", rnd.randrange(1, 800), arrival=now - rnd.uniform(0, 1.5),
                          ttft=rnd.choice([0.5, 1.0, 2.0]), weight=rnd.choice([1.0, 2.0])),
                   now - rnd.uniform(0, 0.5))
        x = req("x", rnd.randrange(1, 900), arrival=now - rnd.uniform(0, 0.2),
                ttft=rnd.choice([0.5, 1.0, 2.0]), weight=rnd.choice([1.0, 2.0]))
        eta = rnd.choice([None, 0.05])
        p = ps[0]
        e = evaluate(p, x, now, GAIN, deployment, eta)
        ref = (estimate_gain(p, now, GAIN, deployment, req=x, eta=eta)
               - estimate_gain(p, now, GAIN, deployment, tpot=x.tpot_slo, eta=eta))
        assert e.delta == pytest.approx(ref, abs=1e-9), trial
        assert e.exec_with >= e.exec


# -- Algorithm 2 branches --------------------------------------------------------------------

def test_branch_light_picks_most_idle_in_L():
    ps, _ = cluster(0.15, 0.05, 0.5)
    g = GoRouting()
    p = g.select_prefill(req("r", tok(0.2)), ps, 0.0)
    d = g.last_decision
    assert d.branch == "light" and sorted(d.light) == [0, 1]
    assert p.id == 1


def test_branch_fill_picks_heaviest_of_C_minus_H():
    # loads 0.3, 0.5, 0.7 (+0.2 for req: 0.5, 0.7, 0.9 → only id 2 is heavy);
    # id 3 (0.85 + 0.2 > 1.0) cannot meet the SLO, so it is no candidate though it is heavier
    ps, _ = cluster(0.3, 0.5, 0.7, 0.85)
    g = GoRouting()
    p = g.select_prefill(req("r", tok(0.2)), ps, 0.0)
    d = g.last_decision
    assert d.deltas == pytest.approx({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.0})
    assert d.candidates == [0, 1, 2] and d.light == [] and d.heavy == [2]
    assert d.branch == "fill" and p.id == 1


def test_branch_balance_when_all_candidates_heavy():
    ps, _ = cluster(0.7, 0.65, 0.75)
    g = GoRouting()
    p = g.select_prefill(req("r", tok(0.2)), ps, 0.0)
    d = g.last_decision
    assert d.candidates == [0, 1, 2] and d.heavy == [0, 1, 2]
    assert d.branch == "balance" and p.id == 1


def test_branch_random_fallback_when_no_instance_meets_ttft():
    ps, _ = cluster(0.9, 1.2, 0.95)
    g = GoRouting(seed=3)
    picks = []
    for k in range(60):
        picks.append(g.select_prefill(req(f"r{k}", tok(0.2)), ps, 0.0).id)
        assert g.last_decision.branch == "fallback"
        assert g.last_decision.delta_max <= 0
    assert set(picks) == {0, 1, 2}
    g2 = GoRouting(seed=3)
    assert [g2.select_prefill(req(f"r{k}", tok(0.2)), ps, 0.0).id for k in range(60)] == picks


def test_candidates_exclude_instances_where_req_pushes_others_past_deadline():
    """A high-priority req fits on both instances, but on id 0 it would make a queued
    request miss (Δ = 2 − 1): with α = 0.9 only id 1 (Δ = 2) is a candidate."""
    ps, qm = cluster(0, 0)
    qm.add(0, req("tight", tok(0.7), ttft=0.85), 0.0)    # meets at 0.7; after req (0.2): 0.9 > 0.85
    qm.add(1, req("loose", tok(0.3), ttft=5.0), 0.0)
    x = req("x", tok(0.2), ttft=0.5, weight=2.0)          # deadline 0.5 < 0.85: goes first on id 0
    g = GoRouting()
    assert g.select_prefill(x, ps, 0.0).id == 1
    assert g.last_decision.deltas == pytest.approx({0: 1.0, 1: 2.0})
    assert g.last_decision.candidates == [1]
    # α small enough admits both; with H disabled (λ = 2: ESTIMATEEXEC(p, req) is the whole
    # queue plus req, 0.9 and 0.5 here, above λ·TTFT = 0.4 for the default λ) id 0 is the heavier
    g = GoRouting(alpha=0.5, lam=2.0)
    assert g.select_prefill(x, ps, 0.0).id == 0
    assert g.last_decision.candidates == [0, 1] and g.last_decision.branch == "fill"


# -- §3.3 Figure 8: over-balancing ------------------------------------------------------------

def _simulate(assign, est):
    """Each instance runs its queue one request at a time (φ_p), earliest deadline first
    among the requests that have arrived; returns request id → first-token time."""
    done = {}
    for reqs in assign.values():
        pending = list(reqs)
        t = 0.0
        while pending:
            ready = [r for r in pending if r.arrival <= t] or [min(pending, key=lambda r: r.arrival)]
            r = min(ready, key=lambda r: GAIN.token_deadline(r, 1))
            t = max(t, r.arrival) + est.prefill(r.prompt_len) + est.t_c
            done[r.id] = t
            pending.remove(r)
    return done


def _figure8(policy_name):
    ps, qm = cluster(0, 0)
    a0 = req("a0", tok(0.5), ttft=1.0)       # instance A (id 0): moderately loaded
    b0 = req("b0", tok(0.25), ttft=1.0)      # instance B (id 1): lightly loaded
    qm.add(0, a0, 0.0)
    qm.add(1, b0, 0.0)
    r1 = req("R1", tok(0.2), arrival=0.0)    # short
    r2 = req("R2", tok(0.7), arrival=0.01)   # long, shortly after
    pol = make_global(policy_name)
    assign = {0: [a0], 1: [b0]}
    branches = []
    for r in (r1, r2):
        p, _ = pol.route(r, ps, now=r.arrival)
        qm.add(p.id, r, r.arrival)
        assign[p.id].append(r)
        branches.append(getattr(getattr(pol, "last_decision", None), "branch", None))
    done = _simulate(assign, ps[0].estimator)
    ttft = {r.id: done[r.id] - r.arrival for r in (r1, r2)}
    where = {r.id: next(i for i, q in assign.items() if r in q) for r in (r1, r2)}
    return ttft, where, branches, (a0, b0, r1, r2)


def test_figure8_go_routing_keeps_room_for_the_long_request():
    ttft, where, branches, (_, _, r1, r2) = _figure8("go_routing")
    assert where == {"R1": 0, "R2": 1}
    assert branches == ["fill", "balance"]
    assert ttft["R1"] == pytest.approx(0.7) and ttft["R1"] < r1.ttft_slo
    assert ttft["R2"] == pytest.approx(0.94) and ttft["R2"] < r2.ttft_slo


def test_figure8_min_load_over_balances_and_the_long_request_misses():
    ttft, where, _, (a0, b0, r1, r2) = _figure8("min_load")
    assert where == {"R1": 1, "R2": 1}
    assert ttft["R1"] < r1.ttft_slo
    assert ttft["R2"] > r2.ttft_slo
    # and not because min_load chose badly between two options: R2 misses on A as well
    alt = _simulate({0: [a0, r2], 1: [b0, r1]}, Estimator(MODEL))
    assert alt["R2"] - r2.arrival > r2.ttft_slo


# -- co-located ---------------------------------------------------------------------------------

def _coloc_pair():
    ps = [PrefillInstance(0, Estimator(MODEL), n_decode=50),   # busy decoding: n_d·b_d = 0.05
          PrefillInstance(1, Estimator(MODEL), n_decode=0)]
    qm = PrefillQueueMap(ps)
    for p in ps:
        qm.add(p.id, req(f"q{p.id}", 200, ttft=1.0), 0.0)     # Σexec = 0.2
    return ps


def test_colocated_decode_load_makes_instance_look_slower():
    ps = _coloc_pair()
    x = req("x", 300)                                         # exec 0.3, TPOT SLO 0.1
    # t_budget = max(min(remain 1.0, TPOT 0.1), η = TPOT 0.1) = 0.1
    # idle: 0.1/(0.1 − 0.01) per second of exec; busy: 0.1/(0.1 − 0.01 − 0.05)
    assert estimate_exec(ps[1], x, 0.0, deployment=COLOCATED) == pytest.approx(0.2 / 0.9)
    assert estimate_exec(ps[0], x, 0.0, deployment=COLOCATED) == pytest.approx(0.5)
    assert estimate_exec(ps[0], x, 0.0, deployment=COLOCATED, include=True) == pytest.approx(1.25)
    # on the busy instance req misses and delays q0 past its deadline: Δ = 0 − 1
    assert evaluate(ps[0], x, 0.0, GAIN, COLOCATED).delta == pytest.approx(-1.0)
    assert evaluate(ps[1], x, 0.0, GAIN, COLOCATED).delta == pytest.approx(1.0)
    assert make_global("go_routing", deployment=COLOCATED).select_prefill(x, ps, 0.0).id == 1
    assert make_global("min_load", deployment=COLOCATED).select_prefill(x, ps, 0.0).id == 1
    # disaggregated accounting ignores n_d: the two look alike (the tie then goes to fewer decodes)
    for est in ("exec", "exec_with", "delta"):
        assert getattr(evaluate(ps[0], x, 0.0, GAIN, DISAGGREGATED), est) == \
            getattr(evaluate(ps[1], x, 0.0, GAIN, DISAGGREGATED), est)
    assert make_global("go_routing").select_prefill(x, ps, 0.0).id == 1
    assert make_global("min_load").select_prefill(x, ps, 0.0).id == 1


def test_colocated_budget_from_tightest_remain_and_eta_floor():
    ps = [PrefillInstance(0, Estimator(MODEL))]
    qm = PrefillQueueMap(ps)
    qm.add(0, req("late-ish", 200, arrival=-0.92, ttft=1.0), 0.0)   # remain 0.08 < TPOT 0.1
    x = req("x", 100)
    # η = 0.05: t_budget = max(min(0.08, 0.1), 0.05) = 0.08
    assert estimate_exec(ps[0], x, 0.0, deployment=COLOCATED, eta=0.05) == pytest.approx(0.2 * 0.08 / 0.07)
    # default η (no classes: req's TPOT SLO) floors it at 0.1
    assert estimate_exec(ps[0], x, 0.0, deployment=COLOCATED) == pytest.approx(0.2 * 0.1 / 0.09)
    assert GoRouting(classes=default_classes()).eta == 0.1


def test_colocated_decodes_filling_the_budget_means_no_prefill_in_time():
    ps = [PrefillInstance(0, Estimator(MODEL), n_decode=100)]       # n_d·b_d = 0.1 ≥ 0.1 − t_c
    qm = PrefillQueueMap(ps)
    qm.add(0, req("q", 200), 0.0)
    x = req("x", 100)
    e = evaluate(ps[0], x, 0.0, GAIN, COLOCATED)
    assert math.isinf(e.exec) and math.isinf(e.exec_with) and e.delta == 0.0
    ps[0].queue.clear()
    assert estimate_exec(ps[0], x, 0.0, deployment=COLOCATED) == 0.0   # no queued work, no wait


# -- baselines, PrefillQueueMap, decode side, health, config ---------------------------------------

def test_min_load_least_exec_ties_lowest_id():
    ps, _ = cluster(0.5, 0.3, 0.3)
    assert make_global("min_load").select_prefill(req("r", 100), ps, 0.0).id == 1
    # lag compensation counts: id 0 was last updated 0.4 s ago
    ps[0].ts = -0.4
    assert make_global("min_load").select_prefill(req("r", 100), ps, 0.0).id == 0


def test_round_robin_cycles_and_skips_unhealthy():
    ps, _ = cluster(0, 0, 0)
    rr = make_global("round_robin")
    assert [rr.route(req(f"r{k}", 10), ps)[0].id for k in range(4)] == [0, 1, 2, 0]
    ps[1].healthy = False
    assert [rr.route(req(f"s{k}", 10), ps)[0].id for k in range(3)] == [2, 0, 2]


def test_random_is_seeded_and_covers_all():
    ps, _ = cluster(0, 0, 0, 0)
    r1, r2 = make_global("random", seed=5), make_global("random", seed=5)
    s1 = [r1.select_prefill(req("r", 10), ps, 0.0).id for _ in range(50)]
    s2 = [r2.select_prefill(req("r", 10), ps, 0.0).id for _ in range(50)]
    assert s1 == s2 and set(s1) == {0, 1, 2, 3}


def test_all_policies_registered():
    assert {"go_routing", "min_load", "round_robin", "random"} <= set(global_names())


def test_queue_map_add_remove_updates_ts_and_version():
    ps, qm = cluster(0, 0)
    r = req("r", 100)
    qm.add(1, r, 2.5)
    assert ps[1].queue == [r] and ps[1].ts == 2.5 and ps[1].dispatched == {"r": (100, 0)}
    v = ps[1].version
    qm.remove(1, req("other", 5), 3.0)        # not queued there: nothing changes
    assert ps[1].ts == 2.5 and ps[1].version == v
    qm.remove(1, r, 3.5)
    assert ps[1].queue == [] and ps[1].ts == 3.5 and ps[1].version == v + 1 and not ps[1].dispatched
    assert ps[0].ts == 0.0
    qm.decode_started(0)
    qm.decode_started(0)
    qm.decode_finished(0)
    assert ps[0].n_decode == 1


def test_decode_kv_follows_the_running_decodes():
    """Co-located, b_d (Eq. 8's n_d·b_d) is priced at the mean KV length of the decodes
    running on the instance, not a fixed 1,024 tokens: with 15k-token prompts a fixed b_d
    made an instance's decodes look ~10× lighter than they are."""
    ps, qm = cluster(0, 0)
    p = ps[0]
    assert p.avg_decode_kv == 1024.0                 # nothing reported yet: the default
    qm.decode_started(0, 16000)
    qm.decode_started(0, 2000)
    assert p.n_decode == 2 and p.avg_decode_kv == 9000.0
    qm.decode_finished(0, 16000)
    assert p.n_decode == 1 and p.avg_decode_kv == 2000.0
    qm.decode_finished(0, 2000)
    qm.decode_finished(0, 2000)                      # a repeated end changes nothing
    assert p.n_decode == 0 and p.decode_kv == 0.0
    host = RouterHost(make_global("min_load", deployment=COLOCATED), ps)
    r = req("long", 12000)
    host.dispatched(r, 1, 0.0)
    host.prefill_finished(r, 0.5)                    # it now decodes on 1 with its prompt's KV
    assert ps[1].n_decode == 1 and ps[1].avg_decode_kv == 12000.0
    host.finished(r, 9.0)
    assert ps[1].n_decode == 0 and ps[1].decode_kv == 0.0


def test_snapshot_cache_follows_queue_changes():
    ps, qm = cluster(0)
    p = ps[0]
    x = req("x", 90)
    qm.add(0, req("a", 190), 0.0)
    assert estimate_exec(p, x, 0.0) == pytest.approx(0.2)
    qm.add(0, req("b", 290), 0.0)
    assert estimate_exec(p, x, 0.0) == pytest.approx(0.5)
    qm.remove(0, p.queue[0], 0.0)
    assert estimate_exec(p, x, 0.0) == pytest.approx(0.3)


@pytest.mark.parametrize("name", ["go_routing", "min_load", "round_robin", "random"])
def test_decode_most_free_blocks_and_health(name):
    ps, _ = cluster(0.5, 0.2)
    ds = [DecodeInstance(0, 10), DecodeInstance(1, 40), DecodeInstance(2, 90, healthy=False)]
    pol = make_global(name)
    p, d = pol.route(req("r", 100), ps, ds, 0.0)
    assert d.id == 1
    ps[0].healthy = False
    for k in range(5):
        assert pol.route(req(f"r{k}", 100), ps, ds, 0.0)[0].id == 1
    assert pol.route(req("r", 100), ps, [], 0.0)[1] is None
    ps[1].healthy = False
    with pytest.raises(RuntimeError):
        pol.route(req("r", 100), ps, ds, 0.0)


@pytest.mark.parametrize("params, bad", [
    (dict(alpha=0), "alpha"), (dict(alpha=1.5), "alpha"), (dict(alpha="x"), "alpha"),
    (dict(alpha=float("nan")), "alpha"), (dict(mu=-0.1), "mu"), (dict(lam=0), "lam"),
    (dict(mu=0.9, lam=0.5), "mu"), (dict(eta=0), "eta"), (dict(eta=-1.0), "eta"),
    (dict(deployment="both"), "deployment"), (dict(beta=1), "beta"),
])
def test_invalid_params_raise_config_error(params, bad):
    with pytest.raises(ConfigError, match=bad):
        make_global("go_routing", **params)


def test_invalid_min_load_eta():
    with pytest.raises(ConfigError, match="eta"):
        make_global("min_load", eta=0.0)


def test_valid_edge_params():
    g = GoRouting(alpha=1.0, mu=0.0, lam=2.0, eta=0.05)
    assert (g.alpha, g.mu, g.lam, g.eta) == (1.0, 0.0, 2.0, 0.05)


def test_fallback_variant_picks_least_loaded_when_no_instance_meets_the_slo():
    from proserve.scheduler import Estimator, LatencyModel, Request, make_global
    from proserve.scheduler.routing.base import PrefillInstance, PrefillQueueMap

    m = LatencyModel(a_p=0, b_p=0, c_p=1e-3, a_d=0, b_d=1e-3, t_c=0.01)
    insts = [PrefillInstance(i, Estimator(m)) for i in range(3)]
    qmap = PrefillQueueMap(insts)
    for i, n in enumerate((3, 1, 2)):           # 3, 1 and 2 long requests queued
        for k in range(n):
            qmap.add(i, Request(f"q{i}{k}", "low", 1.0, 1.0, 0.1, 0.0, 2000, 5), 0.0)
    req = Request("new", "low", 1.0, 1.0, 0.1, 0.0, 2000, 5)   # cannot meet 1 s anywhere
    go = make_global("go_routing", fallback="min_load")
    p, _ = go.route(req, insts, (), 0.0)
    assert go.last_decision.branch == "fallback" and go.last_decision.delta_max <= 0
    assert p.id == 1
    with pytest.raises(ConfigError, match="fallback"):
        make_global("go_routing", fallback="nearest")
