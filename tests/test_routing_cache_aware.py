"""The cache-aware routers users would pick instead of GoRouting (issue 14):
SGLang's cache_aware, llm-d's weighted scorers and Dynamo's KV cost, each on hand-made
router views (PrefillQueueMap with a prefix index) whose right answer is worked out here.

Latency model: prefill 1 ms per token, 10 ms per step, decode 1 ms; KV blocks of 16
tokens; prefix blocks of 64 tokens.
"""

from __future__ import annotations

import pytest

from proserve.scheduler import ConfigError, Estimator, LatencyModel, Request
from proserve.scheduler.baselines.llmd_scorers import kv_usage
from proserve.scheduler.registry import make_global
from proserve.scheduler.routing.base import COLOCATED, PrefillInstance, PrefillQueueMap

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01)


def req(rid, prompt, blocks=(), arrival=0.0):
    return Request(rid, "high", 2.0, 10.0, 1.0, arrival, prompt, output_len=8,
                   prefix_blocks=tuple(blocks), prefix_block_tokens=64 if blocks else 0)


def cluster(n=3, cache_tokens=64 * 100):
    insts = [PrefillInstance(i, Estimator(MODEL), cache_tokens=cache_tokens, block_size=16) for i in range(n)]
    return insts, PrefillQueueMap(insts)


def warm(qm, inst, rid, prompt, blocks):
    """Dispatch one request to ``inst`` (its blocks enter the index) and finish its prefill."""
    r = req(rid, prompt, blocks)
    qm.add(inst, r, 0.0)
    qm.remove(inst, r, 0.0)


def queue(qm, inst, k, prompt=640):
    for j in range(k):
        qm.add(inst, req(f"q{inst}-{j}", prompt), 0.0)


# -- SGLang cache_aware ---------------------------------------------------------------------------

def test_sglang_takes_the_longest_match_above_the_threshold():
    insts, qm = cluster()
    warm(qm, 1, "w", 640, range(10))            # instance 1 holds blocks 0..9
    queue(qm, 1, 3)                              # and is busier (3 in flight), within the thresholds
    pol = make_global("sglang_cache_aware", deployment=COLOCATED)
    r = req("r", 640, range(10))                 # 639 // 16 * 16 = 624 of 640 cached: 0.975 > 0.3
    assert pol.route(r, insts)[0].id == 1 and pol.last_branch == "cache"


def test_sglang_below_the_threshold_picks_the_emptiest_cache():
    insts, qm = cluster()
    warm(qm, 0, "a", 640, range(10))
    warm(qm, 1, "b", 640, range(100, 102))       # instance 1 holds 2 blocks, 2 none, 0 ten
    pol = make_global("sglang_cache_aware", deployment=COLOCATED, cache_threshold=0.5)
    r = req("r", 640, [0, 1, 2, 50, 51, 52, 53, 54, 55, 56])   # 3 of 10 blocks on 0: 0.3 <= 0.5
    assert pol.route(r, insts)[0].id == 2 and pol.last_branch == "room"


def test_sglang_imbalance_overrides_the_cache():
    insts, qm = cluster()
    warm(qm, 1, "w", 640, range(10))
    queue(qm, 1, 6)
    queue(qm, 0, 1)
    queue(qm, 2, 2)                              # in flight: 1, 6, 2
    r = req("r", 640, range(10))
    loose = make_global("sglang_cache_aware", deployment=COLOCATED)    # 6 - 1 <= 64: balanced
    assert loose.route(r, insts)[0].id == 1 and loose.last_branch == "cache"
    tight = make_global("sglang_cache_aware", deployment=COLOCATED, balance_abs=4, balance_rel=1.5)
    assert tight.route(r, insts)[0].id == 0 and tight.last_branch == "balance"   # 5 > 4 and 6 > 1.5
    rel = make_global("sglang_cache_aware", deployment=COLOCATED, balance_abs=4, balance_rel=10)
    assert rel.route(r, insts)[0].id == 1        # both conditions are needed: 6 <= 10·1
    insts[1].n_decode = 0
    insts[0].n_decode = 9                        # co-located, running decodes are in flight too
    assert tight.route(r, insts)[0].id == 2      # in flight: 10, 6, 2


# -- llm-d scorers --------------------------------------------------------------------------------

def test_llmd_weighs_prefix_queue_and_kv_as_published():
    insts, qm = cluster()
    warm(qm, 1, "w", 640, range(10))
    queue(qm, 1, 2)                             # queues 0, 2, 1
    queue(qm, 2, 1)
    for p, u in zip(insts, (0.5, 0.0, 0.0)):
        p.kv_usage = u
    pol = make_global("llmd_scorers", deployment=COLOCATED)
    r = req("r", 640, range(10))
    p = pol.route(r, insts)[0]
    # 0: 3·0 + 2·1 + 2·0.5 = 3;  1: 3·0.975 + 2·0 + 2·1 = 4.925;  2: 0 + 2·0.5 + 2·1 = 3
    assert pol.last_scores[0] == pytest.approx(3.0) and pol.last_scores[2] == pytest.approx(3.0)
    assert pol.last_scores[1] == pytest.approx(3 * 624 / 640 + 2.0) and p.id == 1
    no_prefix = make_global("llmd_scorers", deployment=COLOCATED, prefix=0)
    assert no_prefix.route(r, insts)[0].id in (0, 2)        # a tie, broken at random (seeded)
    picks = {make_global("llmd_scorers", deployment=COLOCATED, prefix=0, seed=s).route(r, insts)[0].id
             for s in range(20)}
    assert picks == {0, 2}


def test_llmd_kv_usage_falls_back_to_the_routers_view():
    insts, qm = cluster(cache_tokens=10_000)
    queue(qm, 0, 2, prompt=1000)                # 2000 queued tokens
    insts[0].n_decode, insts[0].avg_decode_kv = 3, 1000.0
    assert kv_usage(insts[0]) == pytest.approx(0.5)
    insts[0].kv_usage = 0.1
    assert kv_usage(insts[0]) == 0.1            # reported beats estimated
    assert kv_usage(PrefillInstance(9, Estimator(MODEL))) == 0.0   # no capacity known, no queue


# -- Dynamo KV cost -------------------------------------------------------------------------------

def test_dynamo_logit_is_overlap_weighted_prefill_plus_active_blocks():
    insts, qm = cluster()
    warm(qm, 1, "w", 640, range(10))
    queue(qm, 1, 1, prompt=480)                 # instance 1: its cache, and 480 queued tokens
    r = req("r", 640, range(10))                # 624 of its 640 tokens cached on 1
    pol = make_global("dynamo_kv", deployment=COLOCATED)
    assert pol.route(r, insts)[0].id in (0, 2)
    # 0 and 2: prefill 640/16 = 40 blocks, active 640/16 = 40: 80
    # 1: prefill (480 + 16)/16 = 31, active (480 + 640)/16 = 70: 101
    assert pol.last_logits == pytest.approx({0: 80.0, 1: 101.0, 2: 80.0})
    ttft_first = make_global("dynamo_kv", deployment=COLOCATED, overlap_weight=4)   # 200 vs 4·31 + 70 = 194
    assert ttft_first.route(r, insts)[0].id == 1
    insts[1].n_decode = 1                       # co-located: a running decode's KV (1024 tokens) is active
    assert ttft_first.route(r, insts)[0].id in (0, 2)
    assert ttft_first.last_logits[1] == pytest.approx(194 + 64)


def test_dynamo_temperature_samples_and_bad_parameters_are_refused():
    insts, qm = cluster()
    queue(qm, 0, 1, prompt=6400)
    r = req("r", 640)
    picks = [make_global("dynamo_kv", temperature=1.0, seed=s).route(r, insts)[0].id for s in range(60)]
    assert set(picks) == {0, 1, 2} and picks.count(0) < picks.count(1) + picks.count(2)
    for name, bad in (("dynamo_kv", {"overlap_weight": -1}), ("dynamo_kv", {"temperature": -0.1}),
                      ("llmd_scorers", {"queue": -1}), ("sglang_cache_aware", {"cache_threshold": 1.5}),
                      ("sglang_cache_aware", {"balance_rel": 0.5}), ("sglang_cache_aware", {"nope": 1})):
        with pytest.raises(ConfigError):
            make_global(name, **bad)


@pytest.mark.parametrize("name", ["sglang_cache_aware", "llmd_scorers", "dynamo_kv"])
def test_without_an_index_each_still_routes_every_request(name):
    """No prefix index (cache_tokens 0) and requests without blocks: each baseline falls back to
    its load terms and never fails."""
    insts, qm = cluster(cache_tokens=0)
    pol = make_global(name, deployment=COLOCATED)
    for j in range(30):
        r = req(f"r{j}", 100 + 37 * j, blocks=range(j % 3) if j % 2 else ())
        p = pol.route(r, insts)[0]
        qm.add(p.id, r, 0.0)
    assert sum(len(p.queue) for p in insts) == 30
    assert max(len(p.queue) for p in insts) - min(len(p.queue) for p in insts) <= 10


@pytest.mark.parametrize("name", ["sglang_cache_aware", "llmd_scorers", "dynamo_kv"])
def test_in_the_simulator_each_keeps_conversations_on_their_cache(name):
    """Three conversations whose turns extend their prefix, round-robin cycles each through
    every instance; a cache-aware router keeps each on the instance that holds it. The
    simulator reports each instance's KV use to the router (llm-d's KV scorer reads it)."""
    from proserve.scheduler import GainConfig
    from proserve.sim.cluster import SimConfig, Simulator
    model = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01,
                         metadata={"block_size": 16, "num_kv_blocks": 4096})

    def reqs():
        out = []
        for k in range(39):
            conv, turn = k % 3, k // 3
            blocks = [1000 * conv + j for j in range(4 + turn)]
            out.append(Request(f"r{k}", "high", 2.0, 10.0, 1.0, 0.4 * k, 64 * len(blocks), output_len=3,
                               prefix_blocks=tuple(blocks), prefix_block_tokens=64))
        return out
    hits = {}
    for glob in (name, "round_robin"):
        sim = Simulator(model, SimConfig(instances=4, global_policy=glob), GainConfig())
        res = sim.run(reqs())
        assert all(r.finished for r in res.requests)
        hits[glob] = res.prefix_hit_tokens / res.prefix_prompt_tokens
        assert all(p.kv_usage is not None and 0.0 <= p.kv_usage <= 1.0 for p in sim.p_states)
    assert hits[name] > hits["round_robin"] + 0.2, hits


# -- GoRouting's KV capability (kv_fit) and its most_room fallback ---------------------------------

def test_go_routing_keeps_a_request_off_an_instance_whose_kv_cannot_hold_it():
    """Instance 0 is idle but its KV is nearly full (500 tokens free): a 2,000-token prompt
    cannot start there until decodes finish, which ESTIMATEEXEC does not see. kv_fit puts it in
    H and out of L; without a reported usage the rule is inert."""
    insts, qm = cluster(cache_tokens=10_000)
    queue(qm, 1, 1, prompt=300)                   # 1 has a little queued work, 2 more
    queue(qm, 2, 2, prompt=300)
    for p, u in zip(insts, (0.95, 0.3, 0.3)):
        p.kv_usage = u
    r = req("r", 2000)
    blind = make_global("go_routing", deployment=COLOCATED, kv_fit=False)
    assert blind.route(r, insts)[0].id == 0 and blind.last_decision.branch == "light"
    fit = make_global("go_routing", deployment=COLOCATED)
    assert fit.route(r, insts)[0].id == 1
    assert 0 in fit.last_decision.heavy and 0 not in fit.last_decision.light
    for p in insts:
        p.kv_usage = None                         # not reported: every instance may hold it
    assert fit.route(r, insts)[0].id == 0
    with pytest.raises(ConfigError):
        make_global("go_routing", kv_fit="yes")


def test_go_routing_fallbacks_pick_among_instances_that_can_hold_the_request():
    """A request no instance can serve before its TTFT SLO (line 19): the random fallback draws
    among the instances with KV room for it; most_room takes the one with the most."""
    insts, qm = cluster(n=4, cache_tokens=100_000)
    for p, u in zip(insts, (0.99, 0.5, 0.2, 0.99)):
        p.kv_usage = u
    r = Request("big", "high", 2.0, 1.0, 1.0, 0.0, 20_000, output_len=8)   # 20 s of prefill > 1 s TTFT
    picks = {make_global("go_routing", deployment=COLOCATED, seed=s).route(r, insts)[0].id for s in range(30)}
    assert picks == {1, 2}                        # 0 and 3 have 1,000 tokens free
    most = make_global("go_routing", deployment=COLOCATED, fallback="most_room")
    assert most.route(r, insts)[0].id == 2 and most.last_decision.branch == "fallback"
    for p in insts:
        p.kv_usage = 0.999                        # none can hold it: every instance stays a choice
    picks = {make_global("go_routing", deployment=COLOCATED, seed=s).route(r, insts)[0].id for s in range(40)}
    assert picks == {0, 1, 2, 3}


def test_kv_fit_reads_the_kv_memory_without_a_prefix_index():
    """kv_fit needs the instance's KV memory, not its prefix index: with the index off
    (cache_tokens 0) the KV capacity (kv_tokens) still keeps a request off a full instance."""
    insts, qm = cluster(n=2, cache_tokens=0)
    for p, u in zip(insts, (0.999, 0.0)):
        p.kv_tokens, p.kv_usage = 100_000, u
    r = req("r", 8000)
    assert make_global("go_routing", deployment=COLOCATED).route(r, insts)[0].id == 1
    insts[0].kv_usage = float("nan")             # a NaN report counts as unknown, not as full or empty
    assert make_global("go_routing", deployment=COLOCATED).route(r, insts)[0].id == 0


def test_dynamo_small_temperature_never_underflows():
    """Near-equal logits at a tiny temperature: every weight exp(-l/T) used to underflow to 0
    and random.choices raised; the softmax is shifted by its max."""
    insts, qm = cluster()
    r = req("r", 640)
    for t in (1e-3, 1e-6):
        assert make_global("dynamo_kv", temperature=t).route(r, insts)[0].id in (0, 1, 2)


# -- GoRouting choose=scorers: GoRouting judges which instances can serve, llm-d's score which -----

def test_go_routing_scorers_choose_within_the_candidates_gorouting_allows():
    """Instance 0 holds the request's prefix and has the most free KV, so llm-d's scorers take
    it, but behind its backlog (3 queued prompts, 1.9 s) the request misses its 1 s TTFT:
    Δ_0 = 0, not a candidate. Of the light instances 1 and 2, lines 13-17 take 1 (no running decode), the score takes 2
    (more free KV)."""
    insts, qm = cluster()
    warm(qm, 0, "w", 640, range(10))
    queue(qm, 0, 3)
    insts[2].n_decode = 1
    for p, u in zip(insts, (0.1, 0.5, 0.1)):
        p.kv_usage = u
    r = Request("r", "high", 2.0, 1.0, 1.0, 0.0, 640, output_len=8,
                prefix_blocks=tuple(range(10)), prefix_block_tokens=64)
    assert make_global("llmd_scorers", deployment=COLOCATED).route(r, insts)[0].id == 0
    go = make_global("go_routing", deployment=COLOCATED)
    assert go.route(r, insts)[0].id == 1 and go.last_decision.branch == "light"
    assert go.last_decision.deltas[0] == 0 and go.last_decision.candidates == [1, 2]
    sc = make_global("go_routing", deployment=COLOCATED, choose="scorers")
    assert sc.route(r, insts)[0].id == 2 and sc.last_decision.branch == "scored"
    for p in insts:
        p.kv_usage = 0.1                          # 1 and 2 tie on the score: drawn at random (seeded)
    picks = {make_global("go_routing", deployment=COLOCATED, choose="scorers", seed=s).route(r, insts)[0].id
             for s in range(20)}
    assert picks == {1, 2}


def test_go_routing_scorers_score_every_instance_for_a_request_none_serves_in_time():
    """A request no instance serves before its TTFT (20k tokens, 1 s): line 19. Instance 3
    holds 64 % of its prompt but its KV (1 % free) cannot hold the other 7,200 tokens, so
    kv_fit's random fallback draws among 1 and 2; choose=scorers scores every instance, as
    llm-d does (the KV term weighs the free memory), and takes 3."""
    insts, qm = cluster(n=4, cache_tokens=100_000)
    blocks = tuple(range(313))                    # 313 blocks of 64 tokens >= 20,000
    warm(qm, 3, "w", 12_800, blocks[:200])
    for p, u in zip(insts, (0.99, 0.5, 0.2, 0.99)):
        p.kv_usage = u
    r = Request("big", "high", 2.0, 1.0, 1.0, 0.0, 20_000, output_len=8,
                prefix_blocks=blocks, prefix_block_tokens=64)
    picks = {make_global("go_routing", deployment=COLOCATED, seed=s).route(r, insts)[0].id for s in range(20)}
    assert picks == {1, 2}
    assert make_global("llmd_scorers", deployment=COLOCATED).route(r, insts)[0].id == 3
    sc = make_global("go_routing", deployment=COLOCATED, choose="scorers")
    assert sc.route(r, insts)[0].id == 3 and sc.last_decision.branch == "fallback"
    assert sc.last_decision.delta_max <= 0
    # 3: 3·0.64 + 2 + 2·0.01 = 3.94; 2: 2 + 2·0.8 = 3.6; with 1's KV empty, 1: 2 + 2·1 = 4
    insts[1].kv_usage = 0.0
    assert sc.route(r, insts)[0].id == 1
    with pytest.raises(ConfigError, match="fallback"):
        make_global("go_routing", choose="scorers", fallback="most_room")
    with pytest.raises(ConfigError, match="choose"):
        make_global("go_routing", choose="llmd")


def test_go_routing_scorers_leave_out_the_kv_term_on_prefill_only_instances():
    """Two light instances, the same queue, no prefix: co-located the score's free-KV term
    takes the emptier one (1); on prefill-only instances (disaggregated) their KV is on its
    way to the decode side, the term is left out, and the two tie (drawn at random)."""
    insts, qm = cluster(n=2)
    for p, u in zip(insts, (0.8, 0.1)):          # both can hold the prompt (kv_fit): 1,280 and 5,760 free
        p.kv_usage = u
    r = req("r", 640)
    colo = {make_global("go_routing", deployment=COLOCATED, choose="scorers", seed=s).route(r, insts)[0].id
            for s in range(20)}
    assert colo == {1}
    pd = [make_global("go_routing", choose="scorers", seed=s) for s in range(20)]   # disaggregated
    picks = {pol.route(r, insts)[0].id for pol in pd}
    assert picks == {0, 1} and all(pol.last_decision.branch == "scored" for pol in pd)


@pytest.mark.parametrize("name,params", [("llmd_scorers", {}), ("go_routing", {"choose": "scorers"})])
def test_a_nan_kv_usage_counts_as_unreported_in_the_score(name, params):
    """A NaN usage (the dispatcher validates its reports, a caller of the API may not) made
    the instance's score NaN; first in the list it beat nothing and nothing beat it, so the
    max-score picker had no choice and raised. It now counts as unreported, as kv_room does."""
    insts, _ = cluster()
    for p, u in zip(insts, (float("nan"), 0.3, None)):
        p.kv_usage = u
    assert kv_usage(insts[0]) == 0.0               # the router's own estimate: nothing queued
    pol = make_global(name, deployment=COLOCATED, **params)
    assert pol.route(req("r", 100), insts)[0].id in (0, 2)   # queues equal; 0 and 2 have all KV free


def _job(rid, prompt, cls="high", ttft=1.0, arrival=0.0):
    return Request(rid, cls, 2.0 if cls == "high" else 1.0, ttft, 0.05, arrival, prompt, output_len=8)


def _catch_up_cluster():
    """Instance 0 queues six low-priority requests of 100 tokens, instance 1 one of 650 (a
    little more work); their TTFT SLO is 3 s, so req (1 s) goes before them in deadline order."""
    insts, qm = cluster(n=2, cache_tokens=0)
    for j in range(6):
        qm.add(0, _job(f"a{j}", 100, "low", 3.0), 0.0)
    qm.add(1, _job("b", 650, "low", 3.0), 0.0)
    return insts, qm


def test_go_routing_catch_up_fallback_loses_the_least_decode_gain():
    """fallback=catch_up: a request no instance serves before its TTFT SLO goes where the least
    decode-token gain is lost (Eq. 3's fixed deadlines). req's 5 s prefill runs first on either
    instance, so its own first token is as late on both; on 0 it pushes six requests past their
    deadlines, on 1 one. Min-Load takes 0, the smaller backlog. With ttft_anchored deadlines a
    late first token costs no later token: every loss is 0 and the choice is line 19's random
    one among both."""
    from proserve.scheduler.tdg import GainConfig
    insts, _ = _catch_up_cluster()
    r = _job("big", 5000)
    go = make_global("go_routing", deployment=COLOCATED, fallback="catch_up")
    assert go.route(r, insts)[0].id == 1 and go.last_decision.branch == "fallback"
    assert go.last_decision.delta_max <= 0
    assert go.last_decision.exec[0] < go.last_decision.exec[1]
    assert make_global("go_routing", deployment=COLOCATED, fallback="min_load").route(r, insts)[0].id == 0
    assert {make_global("go_routing", deployment=COLOCATED, fallback="catch_up", seed=s).route(r, insts)[0].id
            for s in range(20)} == {1}
    anchored = GainConfig(deadline="ttft_anchored")
    assert {make_global("go_routing", gain=anchored, deployment=COLOCATED, fallback="catch_up", seed=s)
            .route(r, insts)[0].id for s in range(20)} == {0, 1}
    with pytest.raises(ConfigError):
        make_global("go_routing", choose="scorers", fallback="catch_up")


def test_go_routing_catch_up_learns_the_output_length_from_finished_requests():
    """The decode tokens a late request can lose are capped by the mean decode tokens of the
    requests that finished (errors not counted): with one-token outputs a late first token
    costs nothing more, every loss is 0 and the choice is random among both."""
    insts, _ = _catch_up_cluster()
    go = make_global("go_routing", deployment=COLOCATED, fallback="catch_up")
    assert go.route(_job("big", 5000), insts)[0].id == 1
    done = _job("done", 10)
    done.record_tokens(1, 0.1)                    # one token: nothing after the first to catch up
    go.on_request_finished(done, 0.2)
    failed = _job("failed", 10)
    failed.record_tokens(1, 0.1)
    failed.record_tokens(500, 0.3)
    failed.end("engine died")                     # an error: its length is not a completed output
    go.on_request_finished(failed, 0.4)
    assert {go.route(_job(f"big{k}", 5000), insts)[0].id for k in range(20)} == {0, 1}


def test_go_routing_catch_up_spreads_hopeless_requests_over_equal_instances():
    """Prefill-only instances, three idle and one with a queue that req's prefill would push back:
    the idle ones lose the same (req's own lateness) and are drawn at random, not the lowest id
    every time (which piled the hopeless requests onto one instance and evicted its cached
    prefixes); the queued one is never drawn."""
    from proserve.scheduler.routing.base import DISAGGREGATED
    insts, qm = cluster(n=4, cache_tokens=0)
    qm.add(3, _job("q", 100, "low", 3.0), 0.0)
    picks = {make_global("go_routing", deployment=DISAGGREGATED, fallback="catch_up", seed=s)
             .route(_job("big", 5000), insts)[0].id for s in range(40)}
    assert picks == {0, 1, 2}
