"""Adversarial pass over issue 13's pieces: admission control, n > 1 / prompt-list fan-out,
SlideBatching's headroom and aging. Each test is an attack a hostile client, an unlucky
operator or a property test would make; the ones that found a bug say so."""

from __future__ import annotations

import asyncio
import random

import pytest
from dispatcher_helpers import harness, metric, run, until
from test_admission_dispatcher import LOOSE, backlog, body, models

from proserve.dispatcher.requests import COMPLETIONS
from proserve.dispatcher import fanout
from proserve.dispatcher.errors import ApiError

LOW = "sk-low-0000001"
HIGH = "sk-high-000001"


async def settled(h) -> None:
    await until(lambda: h.d.limiter.total == 0 and h.d.limiter.per_client == {}, what="every slot back")
    await until(lambda: all(w.state.queue == [] or [q.id for q in w.state.queue] == ["seed"]
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
            assert [q.id for q in h.d.registry.prefill[0].state.queue] == ["seed"]
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
