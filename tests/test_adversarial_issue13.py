"""Adversarial pass over issue 13's pieces: admission control, n > 1 / prompt-list fan-out,
SlideBatching's headroom and aging. Each test is an attack a hostile client, an unlucky
operator or a property test would make; the ones that found a bug say so."""

from __future__ import annotations

import asyncio
import random

import pytest
from dispatcher_helpers import harness, metric, run, until
from test_admission_dispatcher import LOOSE, backlog, body, models, seeds_only

from proserve.dispatcher.requests import COMPLETIONS
from proserve.dispatcher import fanout
from proserve.dispatcher.errors import ApiError

LOW = "sk-low-0000001"
HIGH = "sk-high-000001"


async def settled(h) -> None:
    await until(lambda: h.d.limiter.total == 0 and h.d.limiter.per_client == {}, what="every slot back")
    await until(lambda: all(w.state.queue == [] or seeds_only(w.state.queue)
                            for w in h.d.registry.prefill), what="the queue map to empty")


# -- fan-out: hostile bodies -------------------------------------------------------------------------
HOSTILE = [
    body(n=10**40), body(n=-(10**40)), body(n=1.5), body(n=[2]), body(n={"n": 2}), body(n=False), body(n="3"),
    body(prompt=[[[1]]]), body(prompt=[[1, 2.5]]), body(prompt=[[True]]), body(prompt=[None]),
    body(prompt=["a", None]), body(prompt=[""] * 3), body(prompt=["x"] * 10_000), body(prompt=[[]]),
    body(n=2, max_tokens=0), body(prompt=[[1], [2]], max_tokens=-1), body(n=2, seed=1.5), body(n=2, seed=True),
    body(n=2, stream="yes"), body(prompt=[[1], [2]], stream_options=[1]),
]


def test_hostile_fanout_bodies_are_400_and_nothing_is_held():
    async def go():
        async with harness() as h:
            for b in HOSTILE:
                r = await h.post("/v1/completions", b)
                assert r.status_code == 400, (b, r.text)
                assert h.d.limiter.total == 0 and h.d.limiter.per_client == {}
            assert sum(w.requests for w in h.prefills + h.decodes) == 0
    run(go())


def test_more_completions_than_the_concurrency_limit_is_400_not_a_429_for_ever():
    """Found: n above max_concurrent_per_key (or max_concurrent) answered 429 with
    Retry-After 1 s, which no retry could ever get past."""
    async def go():
        async with harness(max_concurrent_per_key=2, max_concurrent=4) as h:
            for b in (body(n=3), body(prompt=[[1], [2], [3]]), body(n=2, prompt=[[1], [2]])):
                r = await h.post("/v1/completions", b)
                assert r.status_code == 400, r.text
                assert "at most" in r.json()["error"]["message"] and "retry-after" not in r.headers
                assert h.d.limiter.total == 0 and h.d.limiter.per_client == {}
            assert (await h.post("/v1/completions", body(n=2))).status_code == 200
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="client_error") == 3
            assert metric(m, "proserve:dispatcher_rejected_total") == 0
    # open access (no keys file): only the overall limit applies
    async def open_access():
        async with harness(keys=None, max_concurrent=3) as h:
            r = await h.post("/v1/completions", body(n=4), key=None)
            assert r.status_code == 400, r.text
            r = await h.post("/v1/completions", body(n=3), key=None)
            assert r.status_code == 200, r.text
    run(go())
    run(open_access())


# -- admission control --------------------------------------------------------------------------------
@pytest.mark.parametrize("adm", [{"on_overload": {"low": "reject"}}, {"max_queued_requests": 1}])
def test_every_decode_instance_down_is_503_not_an_admission_429(adm):
    """Found: with no live decode instance, admission control still ran and answered 429
    (slo_unreachable, or queue_full with Retry-After 60) where routing answers 503."""
    async def go():
        async with harness(**adm) as h:
            backlog(h, 0, 100.0)
            await h.decodes[0].stop()
            await until(lambda: not h.d.registry.live_decode(), what="the decode instance to be out")
            r = await h.post("/v1/completions", body(), key=LOW)
            assert r.status_code == 503 and "no healthy decode instance" in r.json()["error"]["message"], r.text
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_admission_total") == 0
    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_fanout_whose_sub_requests_are_refused_is_one_429_and_leaves_nothing_behind(stream):
    async def go():
        async with harness(on_overload={"low": "reject"}) as h:
            backlog(h, 0, 100.0)
            b = body(n=3, prompt=[[1], [2]], stream=stream)
            r = await h.post("/v1/completions", b, key=LOW)
            assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unreachable", r.text
            assert 1 <= int(r.headers["retry-after"]) <= 60 and r.headers["retry-after"].isdigit()
            await settled(h)
            assert sum(w.requests for w in h.prefills + h.decodes) == 0
            assert seeds_only(h.d.registry.prefill[0].state.queue)
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="rejected") == 1
            assert metric(m, "proserve:dispatcher_requests_in_flight") == 0
    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_a_downgraded_fanout_says_so_in_its_headers(stream):
    """Found: a fanned-out request whose sub-requests were downgraded carried no
    x-proserve-priority / x-proserve-downgraded-from (a single request does)."""
    async def go():
        async with harness(classes=LOOSE, on_overload={"high": "downgrade"}) as h:
            backlog(h, 0, 100.0)
            async with h.http.stream("POST", "/v1/completions", json=body(n=2, stream=stream),
                                     headers={"authorization": f"Bearer {HIGH}"}) as r:
                assert r.status_code == 200
                await r.aread()
            assert r.headers["x-proserve-downgraded-from"] == "high"
            assert r.headers["x-proserve-priority"] == "low, low"
            assert [b["vllm_xargs"]["priority_class"] for b in h.decodes[0].received] == ["low", "low"]
            await settled(h)
    run(go())


def test_concurrent_fanouts_at_the_concurrency_limit_give_every_slot_back():
    """20 fan-outs (n=3 unstreamed, n=2 streamed) against a per-key limit of 5: most get a
    429 part-way through taking their slots; every slot comes back, nothing stays in flight."""
    async def go():
        async with harness(max_concurrent_per_key=5, worker_kw={"decode_s": 0.02}) as h:
            async def one(k):
                if k % 2:
                    return (await h.stream("/v1/completions", body(n=2, max_tokens=4)))[0]
                return (await h.post("/v1/completions", body(n=3, max_tokens=4))).status_code
            got = await asyncio.gather(*[one(k) for k in range(20)])
            assert set(got) <= {200, 429} and 200 in got
            await settled(h)
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_in_flight") == 0
            assert metric(m, "proserve:dispatcher_requests_total", outcome="rejected") == got.count(429)
    run(go())



@pytest.mark.parametrize("cap", [{"max_queued_requests": 1}, {"max_queued_tokens": 10}])
def test_a_fanout_larger_than_the_queue_caps_is_served_on_an_idle_cluster(cap):
    """Found: the sub-requests of one fan-out counted against each other's queue caps, so on
    an idle cluster n = 2 under max_queued_requests = 1 got 429 queue_full (Retry-After 1 s)
    for ever, after its first sub-request's prefill had started. One client request may
    take an instance over a cap, as one long prompt may; others' requests still count."""
    async def go():
        async with harness(**cap) as h:
            r = await h.post("/v1/completions", body(n=3))
            assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
            r = await h.post("/v1/completions", body(prompt=[[1] * 20, [2] * 20], stream=False))
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
            await settled(h)
            calls = sum(w.requests for w in h.prefills + h.decodes)
            backlog(h, 0, 100.0)                # someone else's request at the cap
            r = await h.post("/v1/completions", body(n=3))
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert sum(w.requests for w in h.prefills + h.decodes) == calls
    run(go())


def test_a_fanout_is_not_refused_behind_its_own_parts_and_a_refusal_spends_no_work():
    """Found: each part of a fan-out was admitted as it started, behind the parts before it,
    so on an idle cluster n = 4 prompts of 0.41 s prefill against a 1 s TTFT SLO (low =
    reject) got 429 slo_unreachable with Retry-After 1 s for ever, and the first part's
    prefill had been sent before the refusal. Now every part is judged first, on the
    cluster as it is, and a refused part refuses the whole request before any work."""
    async def go():
        async with harness(on_overload={"low": "reject"}) as h:
            models(h)                                   # 1 ms per prompt token + 10 ms per batch
            r = await h.post("/v1/completions", body(n=4, prompt=[1] * 400), key=LOW)
            assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
            await settled(h)
            calls = sum(w.requests for w in h.prefills + h.decodes)
            # behind 0.5 s of someone else's work: a 40-token prompt meets 1 s, a 900-token one not
            backlog(h, 0, 0.5)
            h.d.registry.prefill[0].state.ts = 1e18     # no lag: the backlog stays 0.5 s however slow this host
            r = await h.post("/v1/completions", body(prompt=[[1] * 40, [2] * 900]), key=LOW)
            assert r.status_code == 429 and r.json()["error"]["code"] == "slo_unreachable", r.text
            assert sum(w.requests for w in h.prefills + h.decodes) == calls      # no part was sent
            await settled(h)
    run(go())

# -- the admission rule: a property test ----------------------------------------------------------------
def test_admission_rule_properties_on_random_states():
    """Random queues, classes (high > mid > low), actions and caps: a refusal has no instance
    and an integer Retry-After in 1..60; otherwise the request is never moved up, never into
    a full instance, passes only through classes that downgrade, and is queued only where
    its class queues; the request itself is not changed."""
    from proserve.scheduler import Estimator, GainConfig, LatencyModel, Request
    from proserve.scheduler.admission import (ACTIONS, ADMIT, DOWNGRADE, QUEUE, REJECT, SLO_UNREACHABLE,
                                              Admission, AdmissionConfig, lower_class)
    from proserve.scheduler.request import PriorityClass
    from proserve.scheduler.routing.base import COLOCATED, DISAGGREGATED, PrefillInstance, PrefillQueueMap
    model = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01)
    rng = random.Random(5)
    seen = set()
    for _ in range(400):
        classes = {"high": PriorityClass("high", 3.0, rng.choice([0.2, 1.0, 5.0]), 0.1),
                   "mid": PriorityClass("mid", 2.0, rng.choice([0.5, 2.0, 50.0]), 0.1),
                   "low": PriorityClass("low", 1.0, rng.choice([1.0, 10.0, 1000.0]), rng.choice([0.05, 0.1]))}
        acts = {c: rng.choice(ACTIONS) for c in ("high", "mid")} | {"low": rng.choice([QUEUE, REJECT])}
        caps = {k: rng.randint(1, hi) for k, hi in (("max_queued_requests", 4), ("max_queued_tokens", 5000))
                if rng.random() < 0.3}
        dep = rng.choice([COLOCATED, DISAGGREGATED])
        adm = Admission(AdmissionConfig(acts, **caps), classes, GainConfig(), dep)
        ps = [PrefillInstance(i, Estimator(model)) for i in range(rng.randint(1, 3))]
        qm = PrefillQueueMap(ps)
        now = 10.0
        for p in ps:
            p.n_decode = rng.choice([0, 0, 3, 50]) if dep == COLOCATED else 0
            for k in range(rng.randint(0, 5)):
                c = classes[rng.choice(list(classes))]
                qm.add(p.id, Request(f"q{p.id}.{k}", c.name, c.weight, c.ttft_slo, c.tpot_slo,
                                     now - rng.uniform(0, 3), rng.randint(1, 3000)), now - rng.uniform(0, 1))
        c = classes[rng.choice(list(classes))]
        r = Request("r", c.name, c.weight, c.ttft_slo, c.tpot_slo, now, rng.randint(1, 3000))
        d = adm.decide(r, ps, now)
        seen.add(d.decision)
        assert (r.priority, r.weight, r.ttft_slo) == (c.name, c.weight, c.ttft_slo)
        if d.decision == REJECT:
            assert type(d.retry_after_s) is int and 1 <= d.retry_after_s <= 60 and d.instances == []
            continue
        assert d.instances and all(adm.has_room(p) for p in d.instances) and d.served.weight <= c.weight
        if d.decision == ADMIT:
            assert d.delta_max > 0 and d.served is c
        elif d.decision == QUEUE:
            assert acts[c.name] == QUEUE and d.reason == SLO_UNREACHABLE
        else:
            assert d.decision == DOWNGRADE and d.served is not c
            assert d.reason is None or acts[d.served.name] == QUEUE
            cls = c
            while cls is not d.served:
                assert acts[cls.name] == DOWNGRADE
                cls = lower_class(classes, cls.name)
    assert seen == {ADMIT, QUEUE, REJECT, DOWNGRADE}


# -- the simulator: every request ends, under every global policy ------------------------------------------
def test_sim_admission_every_request_ends_under_every_global_policy():
    """Each global policy, co-located and disaggregated, with rejects, downgrades, queue caps
    (routing then sees a subset of the instances) and concurrency limits, on a small KV
    memory (some prompts can never fit): count in == count out, every request finished or
    ended with an error, and every arrival counted once by admission."""
    from test_admission import CLASSES, GAIN, MODEL

    from proserve.scheduler import Request
    from proserve.scheduler.admission import AdmissionConfig
    from proserve.sim.cluster import SimConfig, simulate
    from proserve.scheduler.registry import global_names

    def workload():
        rng = random.Random(1)
        t, out = 0.0, []
        for i in range(40):
            t += rng.expovariate(8)
            c = CLASSES[rng.choice(["high", "low"])]
            out.append(Request(f"r{i}", c.name, c.weight, c.ttft_slo, c.tpot_slo, t, rng.randint(1, 400),
                               output_len=rng.randint(1, 12)))
        return out

    adm = AdmissionConfig({"high": "downgrade", "low": "reject"}, max_queued_requests=2)
    for glob in global_names():
        for dep in ("colocated", "disaggregated"):
            cfg = SimConfig(deployment=dep, instances=2, prefill_instances=2, decode_instances=1, global_policy=glob,
                            num_kv_blocks=20, block_size=16, admission=adm, max_concurrent=12,
                            max_concurrent_per_class=8)
            res = simulate(workload(), MODEL, cfg, GAIN, CLASSES)
            assert len(res.requests) == 40, (glob, dep)
            assert all(r.finished or r.error is not None for r in res.requests), (glob, dep)
            counted = sum(v[k] for v in res.admission.values() for k in ("admit", "queue", "downgrade", "reject"))
            assert counted == 40, (glob, dep, res.admission)


# -- SlideBatching: a property test over random queues ------------------------------------------------------
def test_slide_batching_plans_hold_their_invariants_on_random_queues():
    """Random queues (new, part-prefilled and decoding requests, some long overdue), memory
    from none to plenty, reserves, β/δ, and every headroom/aging setting: no request twice,
    no chunk beyond its prompt, never more KV blocks than are free, a new request only when
    its whole prompt fits above the reserve, est_time the plan's own cost, over t_budget
    only for a one-item least step; aging past its guard (or with nothing aged) plans
    exactly as without aging; headroom 0 gives Algorithm 1's t_budget = max(min remain, η)."""
    from proserve.profiler.modelfile import BUNDLED, load
    from proserve.scheduler import Estimator, Request
    from proserve.scheduler.cost import queue_terms
    from proserve.scheduler.local.base import COLOCATED, PREFILL_ONLY, InstanceView, blocks_for
    from proserve.scheduler.local.slide_batching import SlideBatching

    model = load(BUNDLED)
    rng = random.Random(11)
    now = 100.0

    def queue():
        waiting, decoding = [], []
        for i in range(rng.randint(1, 10)):
            w, cls = rng.choice([(2.0, "high"), (1.0, "low")])
            arr = now - rng.choice([0.0, 1.0, 10.0, 100.0]) * rng.random()
            plen = rng.choice([1, 16, 17, 100, 513, 2000, 8000])
            r = Request(f"r{i}", cls, w, rng.choice([0.5, 1.0, 3.0]), rng.choice([0.05, 0.1]), arr, plen, 20)
            kind = rng.random()
            if kind < 0.2 and plen > 1:
                r.prefilled = r.kv_len = rng.randint(1, plen - 1)
            elif kind > 0.6:
                r.prefilled, r.kv_len = plen, plen + rng.randint(0, 20)
                r.token_times = [arr + 0.1 * j for j in range(1 + rng.randint(0, 5))]
                decoding.append(r)
                continue
            waiting.append(r)
        return waiting, decoding

    def key(plan):
        return [(r.id, n) for r, n in plan.prefill], [r.id for r in plan.decode]

    fired = guarded = 0
    for _ in range(500):
        waiting, decoding = queue()
        mode = rng.choice([COLOCATED, COLOCATED, PREFILL_ONLY])
        view = InstanceView(now, waiting, decoding if mode == COLOCATED else [], free_blocks=rng.choice(
            [0, 1, 3, 10, 50, 1000, 1 << 20]), block_size=16, mode=mode, reserve_blocks=rng.choice([0, 0, 2, 20]))
        est = Estimator(model)
        est.corrector.beta, est.corrector.delta = rng.choice([1.0, 0.6, 1.7]), rng.choice([0.0, 0.004])
        eta = rng.choice([None, None, 0.005, 0.02, 0.3])
        kw = dict(eta=eta, headroom=rng.choice([0.0, 0.3, 0.9]), age_limit=rng.choice([None, 8.0, 0.5]),
                  age_share=rng.choice([0.25, 0.05, 1.0]))
        sb = SlideBatching(est, **kw)
        plan = sb.schedule(view)
        items = [r.id for r, _ in plan.prefill] + [r.id for r in plan.decode]
        assert len(items) == len(set(items))
        bs = view.block_size
        assert sum(blocks_for(r, n, bs) for r, n in plan.prefill) + \
            sum(blocks_for(r, 1, bs) for r in plan.decode) <= view.free_blocks
        for r, n in plan.prefill:
            assert 0 < n <= r.remaining_prefill
            assert r.kv_len > 0 or blocks_for(r, r.remaining_prefill, bs) <= view.free_blocks - view.reserve_blocks
        cost = est.t_c + sum(est.prefill(n, r.kv_len) for r, n in plan.prefill) + \
            sum(est.decode(r.kv_len) for r in plan.decode)
        assert plan.info.est_time == pytest.approx(cost, abs=1e-12)
        assert plan.info.est_time <= plan.info.t_budget + 1e-12 or len(items) <= 1   # (0: nothing to plan)
        Q = view.waiting + view.decoding
        if kw["headroom"] == 0.0 and Q:
            _, remains = queue_terms(est.costs(), sb.gain, Q, now)
            assert plan.info.t_budget == max(min(remains), sb.eta)
        if kw["age_limit"] is not None:
            aged = sb._aged(Q, now)
            execs = sb._annotate(Q, now)[0]
            if aged and sum(execs[i] for i in aged) <= sb.age_share * sum(execs):
                fired += 1
            else:
                guarded += 1
                plain = SlideBatching(est, **{**kw, "age_limit": None}).schedule(view)
                assert key(plan) == key(plain)
    assert fired > 50 and guarded > 50      # both branches were exercised


def test_headroom_0_without_aging_is_algorithm_1_but_for_the_least_step():
    """η below one item's cost: Algorithm 1's loop (lines 14-18) plans nothing; the policy
    takes one least step (one block of the first prompt in order) so the instance moves."""
    from proserve.profiler.modelfile import BUNDLED, load
    from proserve.scheduler import Estimator, Request
    from proserve.scheduler.local.base import BatchBuilder, InstanceView
    from proserve.scheduler.local.slide_batching import SlideBatching

    est = Estimator(load(BUNDLED))
    reqs = [Request(f"r{i}", "high", 2.0, 1.0, 0.1, 0.0, 500) for i in range(3)]
    view = InstanceView(5.0, reqs, block_size=16)     # every TTFT deadline passed: t_budget = η
    sb = SlideBatching(est, eta=est.t_c / 2, headroom=0.0, age_limit=None)
    plan = sb.schedule(view)
    alg1 = BatchBuilder(view, est)
    sb._fill_time(alg1, reqs, [1.0] * 3, [0, 1, 2], plan.info.t_budget)
    assert alg1.plan.empty and plan.info.t_budget == est.t_c / 2
    assert [(r.id, n) for r, n in plan.prefill] == [("r0", 16)] and plan.decode == []


def test_an_empty_sub_stream_fails_the_fanout_instead_of_dropping_its_choice():
    """Found: a worker answering one part of a streamed fan-out with an empty stream (200,
    then [DONE] with no chunk) gave the client a 200 stream missing that choice (and the
    usage chunk), counted ok; a plain request gets 502 for the same answer."""
    from aiohttp import web

    async def go():
        async with harness(colocated=True) as h:
            w = h.prefills[0]
            generate = w._generate_inner

            async def empty_for_seed_1(request, chat):
                b = await request.json()
                if b.get("seed") != 1:
                    return await generate(request, chat)
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp

            w._generate_inner = empty_for_seed_1
            st, ev = await h.stream("/v1/completions", body(n=3, seed=0, stream_options={"include_usage": True}))
            errors = [e for e in ev if isinstance(e, dict) and "error" in e]
            if st == 200:
                assert len(errors) == 1 and errors[0]["error"]["code"] == 502 and ev[-1] == "[DONE]", ev
            else:
                assert st == 502, ev
            await settled(h)
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_requests_total", outcome="upstream_error") == 1
            assert metric(m, "proserve:dispatcher_requests_total", outcome="ok") < 3
    run(go())
