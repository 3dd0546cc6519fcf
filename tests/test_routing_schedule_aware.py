"""GoRouting's schedule-aware estimate (issue 14): ESTIMATEGAIN in the order the local
policy serves, the loads it reads, and the tie-break on decodes.

The latency model of tests/test_routing.py: prefill 1 ms per token, 10 ms per batch, so
(φ_p, one request per batch) ``n`` tokens cost ``n/1000 + 0.01`` s.
"""

from __future__ import annotations

import random

import pytest

from proserve.scheduler import ConfigError, Estimator, GainConfig, LatencyModel, Request, make_global
from proserve.scheduler.registry import make_local, router_order
from proserve.scheduler.routing.base import COLOCATED, DISAGGREGATED, PrefillInstance, PrefillQueueMap
from proserve.scheduler.routing.estimates import (
    DEADLINE,
    ORDERS,
    _ordered_delta,
    _ordered_gain,
    evaluate,
    queue_snapshot,
)

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01)
GAIN = GainConfig()


def req(rid, tokens, arrival=0.0, ttft=1.0, weight=1.0):
    return Request(rid, "high" if weight > 1 else "low", weight, ttft, 0.1, arrival, tokens)


def instances(n, order="slide"):
    ps = [PrefillInstance(i, Estimator(MODEL), order=order) for i in range(n)]
    return ps, PrefillQueueMap(ps)


# A long low-priority prompt already past its first-token deadline (arrived 2 s ago, TTFT
# SLO 1 s): 1,490 tokens, 1.5 s. A new short high-priority one: 90 tokens, 0.1 s, w = 2.
def late_queue(qm, inst=0):
    qm.add(inst, req("late", 1490, arrival=-2.0), 0.0)


def test_slide_order_lets_a_dense_request_overtake_work_already_late():
    ps, qm = instances(1)
    late_queue(qm)
    r = req("r", 90, weight=2.0)
    # the paper's order: the late prompt first (deadline -1 s), req done at 1.6 s > 1 s: no gain
    paper = evaluate(ps[0], r, 0.0, GAIN, DISAGGREGATED, order="deadline")
    assert paper.delta == 0.0 and paper.exec_with == pytest.approx(1.6)
    # SlideBatching: backlog 1.6 s, both remains (−1 s, 1 s) below it, both URGENT; density
    # 2/0.09 against 1/1.49: req first, done at 0.1 s, gains w = 2; the late one gains nothing either way
    slide = evaluate(ps[0], r, 0.0, GAIN, DISAGGREGATED, order="slide")
    assert slide.delta == pytest.approx(2.0)
    assert slide.start == 0.0 and slide.done == pytest.approx(0.1)
    assert (slide.exec, slide.exec_with) == (paper.exec, paper.exec_with)    # the backlog is order-free
    # FCFS: req after everything dispatched before it
    fcfs = evaluate(ps[0], r, 0.0, GAIN, DISAGGREGATED, order="fcfs")
    assert fcfs.delta == 0.0 and fcfs.start == pytest.approx(1.5) and fcfs.done == pytest.approx(1.6)


def test_slide_order_counts_what_overtaking_costs_the_requests_behind():
    ps, qm = instances(1)
    # a NORMAL-looking request that just makes its deadline: 940 tokens (0.95 s), deadline 0.99 s
    qm.add(0, req("q", 940, arrival=-0.01), 0.0)
    r = req("r", 90, weight=2.0)
    # with r: backlog 1.05 s; both remains (0.99, 1.0) below it, URGENT, r denser: r first (0.1 s),
    # q then done at 1.05 s, past its 0.99 s: Δ = +2 (r) − 1 (q)
    e = evaluate(ps[0], r, 0.0, GAIN, DISAGGREGATED, order="slide")
    assert e.delta == pytest.approx(1.0)
    # the paper's order keeps q first: r done at 1.05 s, misses; q unaffected
    assert evaluate(ps[0], r, 0.0, GAIN, DISAGGREGATED, order="deadline").delta == 0.0


def test_slide_order_is_the_deadline_order_while_everything_fits():
    ps, qm = instances(1)
    qm.add(0, req("a", 190, ttft=5.0), 0.0)
    qm.add(0, req("b", 290, ttft=3.0), 0.0)
    r = req("r", 90, ttft=4.0, weight=2.0)
    for dep in (DISAGGREGATED, COLOCATED):
        slide = evaluate(ps[0], r, 0.0, GAIN, dep, eta=0.1, order="slide")
        paper = evaluate(ps[0], r, 0.0, GAIN, dep, eta=0.1, order="deadline")
        assert slide.delta == paper.delta == pytest.approx(2.0)
    # disaggregated: r's slot is after b (deadline 3 s) and before a (5 s)
    slide = evaluate(ps[0], r, 0.0, GAIN, DISAGGREGATED, order="slide")
    assert slide.start == pytest.approx(0.3) and slide.done == pytest.approx(0.4)


@pytest.mark.parametrize("seed", range(6))
def test_the_ordered_walk_in_deadline_order_is_the_papers_delta(seed):
    """The general walk used for the other orders, run in deadline order, gives exactly
    Δ of the paper's incremental estimate (random queues, β ≠ 1, offset, lag)."""
    rng = random.Random(seed)
    ps, qm = instances(1, order="deadline")
    p = ps[0]
    for k in range(rng.randint(0, 12)):
        qm.add(0, req(f"q{k}", rng.randint(1, 900), arrival=-rng.uniform(0, 2), ttft=rng.choice([0.5, 1.0, 2.0]),
                      weight=rng.choice([1.0, 2.0])), 0.0)
    p.estimator.corrector.beta = rng.uniform(0.8, 1.3)
    for _ in range(5):
        now = rng.uniform(0, 0.6)
        r = req("r", rng.randint(1, 900), arrival=now - rng.uniform(0, 0.3), ttft=rng.choice([0.5, 1.0, 2.0]),
                weight=rng.choice([1.0, 2.0]))
        e = evaluate(p, r, now, GAIN, DISAGGREGATED)
        s = queue_snapshot(p, GAIN)
        est = p.estimator
        lag = max(0.0, now - p.ts)
        x0 = MODEL.prefill_time(r.remaining_prefill, r.kv_len)
        pre, _, _ = _ordered_gain(s, DEADLINE, now, lag, est.beta, est.t_c, e.exec)
        post, _, _ = _ordered_gain(s, DEADLINE, now, lag, est.beta, est.t_c, e.exec_with,
                                      (GAIN.next_token_deadline(r), x0, GAIN.next_token_weight(r)))
        assert post - pre == pytest.approx(e.delta, abs=1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_the_one_walk_delta_is_the_two_walks_bit_for_bit(seed):
    """_ordered_delta walks the queue once for ESTIMATEGAIN(Q) and ESTIMATEGAIN(Q ∪ {req})
    together (a speed-up of the router's decision): on random queues, every order, scales and
    limits that put the same or a different prefix in URGENT, it returns exactly (==, not
    approx) Δ, start and completion of the two separate walks."""
    rng = random.Random(seed)
    ps, qm = instances(1)
    for k in range(rng.randint(0, 14)):
        qm.add(0, req(f"q{k}", rng.randint(1, 900), arrival=-rng.uniform(0, 2),
                      ttft=rng.choice([0.5, 1.0, 2.0]), weight=rng.choice([1.0, 2.0])), 0.0)
    s = queue_snapshot(ps[0], GAIN)
    for _ in range(20):
        now, lag = rng.uniform(0, 0.6), rng.choice([0.0, rng.uniform(0, 0.05)])
        a0 = rng.uniform(0.8, 1.3)
        a1 = a0 if rng.random() < 0.5 else a0 * rng.uniform(1.0, 1.5)     # co-located: post's scale
        b = rng.choice([0.0, 0.01])
        lim0 = rng.uniform(0, 2.0)
        lim1 = lim0 + rng.choice([0.0, rng.uniform(0, 0.5), rng.uniform(0, 2.0)])
        r = (now + rng.uniform(-0.2, 1.5), rng.choice([0.0, rng.uniform(0, 0.9)]), rng.choice([1.0, 2.0, 5.0]))
        for order in ORDERS:
            pre, _, _ = _ordered_gain(s, order, now, lag, a0, b, lim0)
            post, start, done = _ordered_gain(s, order, now, lag, a1, b, lim1, r)
            assert _ordered_delta(s, order, now, lag, (a0, b, lim0), (a1, b, lim1), r) == (post - pre, start, done)


def test_go_routing_sends_a_dense_request_where_it_overtakes_late_work():
    ps, qm = instances(2)
    late_queue(qm, 0)                                   # instance 0: 1.5 s of hopeless work
    qm.add(1, req("q", 940, arrival=-0.01), 0.0)       # instance 1: 0.95 s that still meets its deadline
    r = req("r", 90, weight=2.0)
    go = make_global("go_routing", gain=GAIN)
    # Δ_0 = 2 (r overtakes, nobody lost), Δ_1 = 2 − 1: C = {0}; r's own wait there is 0: light
    assert go.route(r, ps, now=0.0)[0].id == 0
    d = go.last_decision
    assert d.branch == "light" and d.candidates == [0] and d.wait[0] == 0.0 and d.exec[0] == pytest.approx(1.5)
    # the paper's estimate sees r behind 1.5 s and behind 0.95 s: no instance meets it, random
    paper = make_global("go_routing", gain=GAIN, order="deadline")
    paper.route(r, ps, now=0.0)
    assert paper.last_decision.branch == "fallback" and paper.last_decision.delta_max <= 0


def test_forced_order_overrides_the_instances_own():
    ps, qm = instances(1, order="fcfs")
    late_queue(qm)
    r = req("r", 90, weight=2.0)
    local = make_global("go_routing", gain=GAIN)
    local.route(r, ps, now=0.0)
    assert local.last_decision.delta_max == 0.0            # fcfs: r behind the late prompt
    forced = make_global("go_routing", gain=GAIN, order="slide")
    forced.route(r, ps, now=0.0)
    assert forced.last_decision.delta_max == pytest.approx(2.0)


@pytest.mark.parametrize("name", ["go_routing", "min_load"])
def test_equal_loads_go_to_the_instance_with_fewer_decodes(name):
    """Co-located, every prefill queue empty: every load is 0. The tie goes to the fewest
    running decodes (not to instance 0, which then collected every request's decode)."""
    ps, _ = instances(3)
    for p, n in zip(ps, (3, 1, 2)):
        p.n_decode = n
    pol = make_global(name, gain=GAIN, deployment=COLOCATED)
    assert pol.route(req("r", 90), ps, now=0.0)[0].id == 1
    ps[1].n_decode = 3
    assert pol.route(req("r2", 90), ps, now=0.0)[0].id == 2


def test_local_policies_name_their_order_and_bad_orders_are_refused():
    est = Estimator(MODEL)
    assert type(make_local("slide_batching", est)).router_order == "slide"
    assert router_order("slide_batching") == "slide"
    # the others keep the paper's estimate (arrival order measured no better for Sarathi-FCFS)
    assert router_order("sarathi_fcfs") == router_order("vllm_fcfs") == "deadline"
    assert router_order("sarathi_priority") == router_order("only_deadline") == "deadline"
    assert router_order("stock") == "deadline"          # vLLM's own scheduling: the paper's estimate
    with pytest.raises(ConfigError, match="order"):
        make_global("go_routing", order="density")
    with pytest.raises(ValueError, match="unknown queue order"):
        evaluate(PrefillInstance(0, Estimator(MODEL), order="lifo"), req("r", 9), 0.0, GAIN, DISAGGREGATED,
                 order="lifo")


def test_dispatcher_config_names_each_prefill_workers_policy():
    from proserve.dispatcher.config import config_from_dict
    from proserve.dispatcher.instances import Registry

    dec = [{"url": "http://127.0.0.1:8200", "kv_addr": "tcp://127.0.0.1:15600"}]
    cfg = config_from_dict({"prefill": [{"url": "http://127.0.0.1:8100"},
                                        {"url": "http://127.0.0.1:8101", "local_policy": "only_deadline"},
                                        {"url": "http://127.0.0.1:8102", "local_policy": "stock"}],
                            "decode": dec}, "c.toml")
    assert [s.local_policy for s in cfg.prefill] == ["slide_batching", "only_deadline", "stock"]
    assert [w.state.order for w in Registry(cfg, None).prefill] == ["slide", "deadline", "deadline"]
    with pytest.raises(ConfigError, match=r"c.toml: prefill\[0\].local_policy: expected one of .*got 'slide'"):
        config_from_dict({"prefill": [{"url": "http://127.0.0.1:8100", "local_policy": "slide"}], "decode": dec},
                         "c.toml")


@pytest.mark.parametrize(("local", "order"), [("slide_batching", "slide"), ("sarathi_fcfs", "deadline")])
def test_the_simulator_gives_the_router_each_instances_order(local, order):
    from proserve.sim.cluster import SimConfig, Simulator

    sim = Simulator(MODEL, SimConfig(deployment="disaggregated", prefill_instances=2, decode_instances=1,
                                     local_policy=local))
    assert [p.order for p in sim.p_states] == [order, order]


def test_dispatcher_command_line_names_a_workers_policy():
    from proserve.dispatcher.cli import build_parser, config_from_args

    def cfg(*prefill):
        args = build_parser().parse_args([a for u in prefill for a in ("--prefill", u)] + ["--deployment", "colocated"])
        return config_from_args(args)

    c = cfg("http://127.0.0.1:8100", "http://127.0.0.1:8101,local_policy=vllm_fcfs")
    assert [s.local_policy for s in c.prefill] == ["slide_batching", "vllm_fcfs"]
    with pytest.raises(ConfigError, match="local_policy: expected one of"):
        cfg("http://127.0.0.1:8100,local_policy=nope")
