"""scheduler.host: the host layer every body runs (no engine needed).

RouterHost moves PrefillQueueMap and n_d from events, whatever order and
repetition a body's failure paths produce; LocalHost builds the view with its
admission reserve, turns a plan into per-request tokens and feeds β; ViewOrder
lists requests as the simulator's instance does. The sim-vs-plugin check is
tests/test_host_equivalence.py.
"""

from __future__ import annotations

import pytest

from proserve.profiler.modelfile import BUNDLED, load
from proserve.scheduler import Estimator, OnlineCorrector, Request, make_global, make_local
from proserve.scheduler.host import LocalHost, RouterHost, ViewOrder
from proserve.scheduler.local.base import COLOCATED, PREFILL_ONLY, BatchPlan, InstanceView
from proserve.scheduler.routing.base import PROMISE_S, DecodeInstance, PrefillInstance, decode_blocks

MODEL = load(BUNDLED)


def req(i: int, prompt: int = 100, arrival: float = 0.0) -> Request:
    return Request(f"r{i}", "low", 1.0, 1.0, 0.1, arrival, prompt, 8)


class Recorder:
    """A router stand-in's on_request_finished: who was told, in order."""

    def __init__(self, policy):
        self.told = []
        policy.on_request_finished = lambda r, now: self.told.append(r.id)


def router(deployment: str, n: int = 2):
    pol = make_global("round_robin", deployment=deployment)
    ps = [PrefillInstance(i, Estimator(MODEL)) for i in range(n)]
    return RouterHost(pol, ps), ps, Recorder(pol)


def test_colocated_events_move_the_queue_and_the_decode_count():
    host, ps, rec = router(COLOCATED)
    a, b = req(0), req(1)
    host.dispatched(a, 0, 1.0)
    host.dispatched(b, 0, 2.0)
    assert ps[0].queue == [a, b] and ps[0].ts == 2.0 and set(ps[0].dispatched) == {"r0", "r1"}
    host.prefill_finished(a, 3.0)                 # first token: out of the queue, decoding there
    assert ps[0].queue == [b] and ps[0].n_decode == 1 and ps[0].ts == 3.0
    host.prefill_finished(a, 3.5)                 # repeated: nothing changes
    assert ps[0].n_decode == 1 and ps[0].ts == 3.0
    host.requeued(a, 4.0)                         # preempted while decoding: queued again
    assert ps[0].queue == [b, a] and ps[0].n_decode == 0
    host.requeued(b, 4.5)                         # still prefilling: nothing to requeue
    assert ps[0].queue == [b, a]
    host.prefill_finished(a, 5.0)
    host.finished(a, 6.0)                         # its last token
    assert ps[0].n_decode == 0 and ps[0].queue == [b] and rec.told == ["r0"]
    host.finished(b, 7.0)                         # failed while queued
    assert ps[0].queue == [] and ps[0].dispatched == {} and rec.told == ["r0", "r1"]
    host.released(b, 8.0)                         # a failure path releasing again
    assert ps[0].queue == [] and ps[0].n_decode == 0 and ps[0].ts == 7.0


def test_disaggregated_hand_off_leaves_the_prefill_instance():
    host, ps, rec = router("disaggregated")
    a = req(0)
    host.dispatched(a, 1, 1.0)
    host.prefill_finished(a, 2.0)                 # KV handed off: nothing left on p
    assert ps[1].queue == [] and ps[1].n_decode == 0
    host.released(a, 3.0)
    host.finished(a, 4.0)                         # ends on the decode side: the router is told
    assert ps[1].n_decode == 0 and ps[1].ts == 2.0 and rec.told == ["r0"]


def test_decode_blocks_are_promised_until_the_prefill_ends():
    """Disaggregated: the decode instance picked at dispatch has the request's blocks
    promised (its KV is not there yet, so the reported free blocks miss them) until its
    prefill ends, the attempt ends first, or ``promise_s`` passes; a repeated or stray
    event changes nothing."""
    host, ps, _ = router("disaggregated")
    assert host.promise_s == PROMISE_S
    d0, d1 = DecodeInstance(0, 100), DecodeInstance(1, 90)
    a, b, c = req(0), req(1), req(2)
    host.dispatched(a, 0, 1.0, d0, decode_blocks(a.prompt_len, a.output_len, 16))   # 108 tokens: 7 blocks
    assert d0.room(1.0) == 93 and d0.free_blocks == 100
    assert host.route(b, ps, [d0, d1], 1.0)[1] is d0                   # 93 against 90
    host.dispatched(b, 1, 1.0, d0, 20)
    assert d0.room(1.0) == 73 and host.route(c, ps, [d0, d1], 1.0)[1] is d1   # 73 against 90, though 100 reported
    host.prefill_finished(a, 1.1)                 # a's KV goes to d0: d0 itself reports it now
    assert d0.room(1.1) == 80 and set(d0.reserved) == {"r1"}
    host.prefill_finished(a, 1.15)
    host.released(b, 1.2)                         # b failed in prefill: nothing promised any more
    assert d0.room(1.2) == 100 and d0.reserved == {} and d1.reserved == {}
    host.dispatched(c, 0, 4.0, d1, 5)
    host.dispatched(c, 1, 4.0, d0, 6)             # retried elsewhere without a release: moved
    assert (d0.room(4.0), d1.room(4.0)) == (94, 90)
    # a promise lapses after promise_s even while the prefill goes on (queued for long, its
    # landing time is unknown)
    assert d0.room(4.0 + PROMISE_S) == 100 and d0.reserved == {}
    host.finished(c, 5.0)
    assert (d0.room(5.0), d1.room(5.0)) == (100, 90)


def test_a_retry_elsewhere_releases_the_first_instance():
    host, ps, rec = router(COLOCATED)
    a = req(0)
    host.dispatched(a, 0, 1.0)
    host.prefill_finished(a, 2.0)                 # streamed its first token, then the worker broke
    host.released(a, 3.0)
    host.dispatched(a, 1, 3.0)                    # the retry
    assert ps[0].n_decode == 0 and ps[0].queue == [] and ps[1].queue == [a]
    host.dispatched(a, 0, 4.0)                    # dispatched again without a release: moved
    assert ps[1].queue == [] and ps[0].queue == [a]
    host.finished(a, 5.0)
    assert ps[0].queue == [] and rec.told == ["r0"]


def local(mode=COLOCATED, policy="slide_batching", blocks=1000):
    est = Estimator(MODEL, OnlineCorrector())
    return LocalHost(make_local(policy, est), est, mode, 16, blocks)


def test_view_keeps_the_admission_reserve_except_on_an_idle_instance():
    host = local(blocks=1000)
    d = [req(i) for i in range(3)]
    busy = host.view(5.0, [req(9)], d, free_blocks=400, idle=False)
    assert (busy.now, busy.free_blocks, busy.block_size, busy.mode) == (5.0, 400, 16, COLOCATED)
    assert busy.reserve_blocks == 3 + 1000 // 100            # a block per decode + 1 % of the cache
    assert host.view(5.0, [req(9)], [], free_blocks=1000, idle=True).reserve_blocks == 0


def test_tokens_follow_the_plan_and_riders_decode_on_a_prefill_only_instance():
    a, b, c, rider = req(0), req(1), req(2), req(3)
    plan = BatchPlan(prefill=[(b, 64), (a, 100)], decode=[c])
    view = InstanceView(0.0, [a, b], [c, rider])
    assert list(local(COLOCATED).tokens(plan, view).items()) == [("r1", 64), ("r0", 100), ("r2", 1)]
    assert list(local(PREFILL_ONLY).tokens(plan, view).items()) == [("r1", 64), ("r0", 100), ("r2", 1),
                                                                    ("r3", 1)]


def test_an_empty_view_is_not_shown_to_the_policy():
    host = local()
    host.policy.schedule = lambda view: pytest.fail("the policy was asked to plan nothing")
    assert host.plan(InstanceView(0.0, [], [])).empty


def test_observe_feeds_beta_and_batch_done_and_finished_reach_the_policy():
    host = local(policy="weighted_vtc")
    twin = Estimator(MODEL, OnlineCorrector())                  # fed the same by hand
    t_model = MODEL.batch_time([(100, 0)], [500])
    beta = host.observe(2 * t_model, [(100, 0)], [500], 1.0)
    assert beta == host.est.beta == twin.observe_time(2 * t_model, t_model, 1.0) > 1.0   # slower: β grows
    assert host.observe_run(0.5 * t_model, t_model, 1.1) == twin.observe_time(0.5 * t_model, t_model, 1.1)
    assert host.est.beta == twin.beta != beta
    a = req(0)
    host.batch_done(BatchPlan(prefill=[(a, 100)]), 1.2)
    assert host.policy.counters["low"] > 0                      # weighted VTC charged the batch
    told = []
    host.policy.on_request_finished = lambda r, now: told.append((r.id, now))
    host.finished(a, 1.3)
    assert told == [("r0", 1.3)]
    bare = LocalHost(None, Estimator(MODEL), "decode", 16, 100)  # no policy: β only
    bare.batch_done(BatchPlan(), 0.0)
    bare.finished(a, 0.0)
    assert bare.observe(2 * t_model, [(100, 0)], [500], 1.0) > 1.0


def test_view_order_is_the_simulators_list_order():
    """Replay one history through ViewOrder and through lists kept as the simulator keeps
    them (append on arrival, insert at the front on preemption, append on the first token)."""
    order, waiting, decoding = ViewOrder(), [], []
    r = {i: req(i, arrival=float(i)) for i in range(6)}

    def arrive(i):
        order.arrived(r[i].id)
        waiting.append(r[i])

    def prefilled(i):
        order.prefilled(r[i].id)
        waiting.remove(r[i])
        decoding.append(r[i])

    def preempted(i):
        order.preempted(r[i].id)
        decoding.remove(r[i])
        waiting.insert(0, r[i])

    for i in range(5):
        arrive(i)
    prefilled(3)
    prefilled(1)
    preempted(3)
    prefilled(0)
    arrive(5)
    preempted(1)
    prefilled(3)
    w = sorted(waiting, key=lambda x: x.id, reverse=True)     # any order in, the same order out
    d = sorted(decoding, key=lambda x: x.id)
    order.sort(w, d)
    assert [x.id for x in w] == [x.id for x in waiting] == ["r1", "r2", "r4", "r5"]
    assert [x.id for x in d] == [x.id for x in decoding] == ["r0", "r3"]
    order.forget("r0")
    d = [r[3], r[0]]
    order.sort([], d)
    assert d == [r[0], r[3]]                                   # unknown ids first
