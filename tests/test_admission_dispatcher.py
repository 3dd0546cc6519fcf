"""Admission control in the dispatcher (scheduler/admission.py through dispatcher/server.py),
over HTTP in front of fake workers, and the same decisions as the simulator's.

Overload is made by hand, not by load: the dispatcher's PrefillQueueMap gets a queued
request of known cost (the hand-made latency model of tests/test_admission.py: 1 ms per
prompt token + 10 ms per batch) that is never sent anywhere. Backlogs are far from the
SLOs (100 s against 1 s) so that the wall time a test takes cannot change a decision.
"""

from __future__ import annotations

import random
import time

import pytest
from dispatcher_helpers import harness, metric, run

from proserve.dispatcher.auth import Grant
from proserve.dispatcher.cli import build_parser, config_from_args
from proserve.dispatcher.config import DecodeSpec, DispatcherConfig, PrefillSpec, config_from_dict
from proserve.dispatcher.errors import ApiError
from proserve.dispatcher.requests import COMPLETIONS, make_job, scheduler_request
from proserve.dispatcher.server import Dispatcher
from proserve.scheduler import ConfigError, Estimator, GainConfig, LatencyModel, Request
from proserve.scheduler.admission import AdmissionConfig
from proserve.scheduler.request import PriorityClass
from proserve.sim.cluster import SimConfig, Simulator

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01)
PROMPT = list(range(1, 41))
LOOSE = {"high": PriorityClass("high", 2.0, 1.0, 0.1), "low": PriorityClass("low", 1.0, 3000.0, 0.1)}


def body(**kw):
    return {"prompt": PROMPT, "max_tokens": 3, **kw}


def backlog(h, inst: int, seconds: float, tag: str = "") -> list[str]:
    """``seconds`` of queued prefill on prefill instance ``inst`` (never sent): high-priority
    requests of one token (0.011 s each, one per batch), as dense as any request these tests
    send, so that no queue order GoRouting's estimate may assume (SlideBatching's, by density,
    included) lets a new request overtake them. Their ids ("seed.<tag>0", ...)."""
    w = h.d.registry.prefill[inst]
    w.state.estimator = Estimator(MODEL)
    now = time.time()
    ids = [f"seed.{tag}{k}" for k in range(max(1, round(seconds / 0.011)))]
    for rid in ids:
        h.d.router_host.dispatched(Request(rid, "high", 2.0, 1.0, 0.1, now - 0.01, 1), w.state.id, now)
    return ids


def seeds_only(queue) -> bool:
    """The queue holds nothing but :func:`backlog`'s requests (and holds some)."""
    return bool(queue) and all(q.id.startswith("seed.") for q in queue)


def models(h) -> None:
    for w in h.d.registry.prefill:
        w.state.estimator = Estimator(MODEL)


def sent(h) -> int:
    return sum(w.requests for w in h.prefills + h.decodes)


# -- over HTTP ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_reject_answers_429_before_any_worker_sees_the_request(stream):
    async def go():
        async with harness(on_overload={"low": "reject"}) as h:
            backlog(h, 0, 100.0)
            finished = []
            h.d.policy.on_request_finished = lambda r, now: finished.append(r.id)
            r = await h.post("/v1/completions", body(stream=stream), key="sk-low-0000001")
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "slo_unreachable" and err["param"] is None
            assert "TTFT SLO" in err["message"] and "retry after" in err["message"]
            # answered before any prefill work: no worker got it, the queue map never held it
            assert sent(h) == 0 and seeds_only(h.d.registry.prefill[0].state.queue)
            assert finished == []       # nor did the router hear of it
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_admission_total", priority="low", decision="reject",
                          reason="slo_unreachable") == 1
            assert metric(m, "proserve:dispatcher_requests_total", priority="low", outcome="rejected") == 1
            assert metric(m, "proserve:dispatcher_rejected_total", reason="slo_unreachable") == 1
            # the class that queues (high, by default) is served as before, and counted
            r = await h.post("/v1/completions", body(stream=stream))
            assert r.status_code == 200 and sent(h) == 2
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_admission_total", priority="high", decision="queue",
                          reason="slo_unreachable") == 1
    run(go())


def test_admitted_when_an_instance_can_meet_the_slo():
    async def go():
        async with harness(n_prefill=2, on_overload={"low": "reject"}) as h:
            models(h)
            backlog(h, 0, 100.0)
            r = await h.post("/v1/completions", body(), key="sk-low-0000001")
            assert r.status_code == 200, r.text
            assert len(h.prefills[1].received) == 1 and h.prefills[0].received == []
            assert "x-proserve-downgraded-from" not in r.headers
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_admission_total", priority="low", decision="admit", reason="-") == 1
    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_downgrade_serves_the_request_in_the_lower_class(stream, tmp_path):
    rec = tmp_path / "requests.jsonl"

    async def go():
        async with harness(classes=LOOSE, on_overload={"high": "downgrade"}, record_requests=str(rec)) as h:
            backlog(h, 0, 100.0)   # high's 1 s cannot be met; low's 3000 s can
            if stream:
                async with h.http.stream("POST", "/v1/completions", json=body(stream=True),
                                         headers={"authorization": "Bearer sk-high-000001"}) as r:
                    assert r.status_code == 200
                    headers = r.headers
                    await r.aread()
            else:
                r = await h.post("/v1/completions", body())
                assert r.status_code == 200, r.text
                headers = r.headers
            assert headers["x-proserve-priority"] == "low" and headers["x-proserve-downgraded-from"] == "high"
            for w in (h.prefills[0], h.decodes[0]):
                xa = w.received[0]["vllm_xargs"]
                assert xa["priority_class"] == "low" and xa["weight"] == 1.0 and xa["ttft_slo"] == 3000.0
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_admission_total", priority="high", decision="downgrade",
                          reason="-") == 1
            assert metric(m, "proserve:dispatcher_requests_total", priority="low", outcome="ok") == 1
    run(go())
    import json
    (line,) = rec.read_text().splitlines()
    r = json.loads(line)
    assert (r["priority"], r["downgraded_from"], r["admission"], r["weight"]) == ("low", "high", "downgrade", 1.0)


def test_no_admission_config_is_todays_behaviour():
    async def go():
        async with harness() as h:
            assert h.d.admission is None
            backlog(h, 0, 100.0)
            r = await h.post("/v1/completions", body(), key="sk-low-0000001")
            assert r.status_code == 200 and sent(h) == 2
            assert "proserve:dispatcher_admission_total{" not in await h.metrics()
    run(go())


def test_queue_caps_route_around_full_instances_and_refuse_when_all_are_full():
    async def go():
        async with harness(n_prefill=2, max_queued_requests=1) as h:
            models(h)
            backlog(h, 0, 0.5, "a")      # instance 0 is past its cap of one queued request
            r = await h.post("/v1/completions", body())
            assert r.status_code == 200 and len(h.prefills[1].received) == 1 and h.prefills[0].received == []
            backlog(h, 1, 0.5, "b")      # now both are
            n = sent(h)
            r = await h.post("/v1/completions", body())   # high queues on overload, but a cap is hard
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1 and sent(h) == n
            m = await h.metrics()
            assert metric(m, "proserve:dispatcher_admission_total", priority="high", decision="reject",
                          reason="queue_full") == 1
    run(go())


# -- configuration ---------------------------------------------------------------------------------

def test_config_file_keys_and_flags():
    cfg = config_from_dict({
        "dispatcher": {"max_queued_requests": 8, "max_queued_tokens": 4096, "deployment": "colocated"},
        "classes": [{"name": "high", "weight": 2, "ttft_slo": 1, "tpot_slo": 0.1, "on_overload": "downgrade"},
                    {"name": "low", "weight": 1, "ttft_slo": 1, "tpot_slo": 0.1, "on_overload": "reject"}],
        "prefill": [{"url": "http://127.0.0.1:8100"}]})
    cfg.validate()
    assert cfg.admission == AdmissionConfig({"high": "downgrade", "low": "reject"}, 8, 4096)
    args = build_parser().parse_args(["--prefill", "http://127.0.0.1:8100", "--deployment", "colocated",
                                      "--on-overload", "low=reject", "--max-queued-tokens", "100"])
    cfg = config_from_args(args)
    assert cfg.admission == AdmissionConfig({"low": "reject"}, None, 100)


@pytest.mark.parametrize("change, message", [
    ({"classes": [{"name": "a", "weight": 1, "ttft_slo": 1, "tpot_slo": 0.1, "on_overload": "drop"}]},
     r"classes\[0\].on_overload must be one of queue, reject, downgrade, got 'drop'"),
    ({"classes": [{"name": "a", "weight": 1, "ttft_slo": 1, "tpot_slo": 0.1, "on_overload": "downgrade"}]},
     "needs a class of lower weight than 'a'"),
    ({"dispatcher": {"max_queued_requests": 0}}, "dispatcher.max_queued_requests must be an integer >= 1, got 0"),
    ({"dispatcher": {"max_queued_tokens": "many"}}, "dispatcher.max_queued_tokens must be an integer >= 1"),
])
def test_bad_admission_config_is_refused(change, message):
    data = {"prefill": [{"url": "http://127.0.0.1:8100"}], "dispatcher": {"deployment": "colocated"}}
    data = {**data, **change, "dispatcher": {**data["dispatcher"], **change.get("dispatcher", {})}}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data, "cluster.toml").validate("cluster.toml")


def test_bad_on_overload_flag_is_refused():
    args = build_parser().parse_args(["--prefill", "http://127.0.0.1:8100", "--deployment", "colocated",
                                      "--on-overload", "mid=reject"])
    with pytest.raises(ConfigError, match="on_overload must be keyed by configured classes"):
        config_from_args(args)


# -- the dispatcher and the simulator take the same decisions ------------------------------------------

CLASSES3 = {"gold": PriorityClass("gold", 4.0, 0.5, 0.1), "silver": PriorityClass("silver", 2.0, 1.5, 0.1),
            "bronze": PriorityClass("bronze", 1.0, 2.5, 0.1)}


@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_dispatcher_and_simulator_decide_alike_from_the_same_state(deployment):
    """Random queues on three instances, requests of every class: the dispatcher's
    ``_admit`` and the simulator's ``_admit`` (each calling scheduler.admission with its
    own state objects, filled alike) refuse, downgrade and restrict alike."""
    adm = AdmissionConfig({"gold": "downgrade", "silver": "reject"}, max_queued_requests=5)
    gain = GainConfig()
    rng = random.Random(7)
    seen = set()
    for case in range(80):
        # the workers' policy sets the queue order GoRouting's estimate assumes (the dispatcher
        # reads it from its config, the simulator from its instances): both orders, alike
        local = ("slide_batching", "only_deadline")[case % 2]
        cfg = DispatcherConfig(deployment=deployment, classes=CLASSES3, gain=gain, on_overload=dict(adm.on_overload),
                               max_queued_requests=adm.max_queued_requests,
                               prefill=[PrefillSpec(f"http://127.0.0.1:{8100 + i}", local_policy=local)
                                        for i in range(3)],
                               decode=[] if deployment == "colocated" else
                               [DecodeSpec("http://127.0.0.1:8200", "tcp://127.0.0.1:16000")])
        d = Dispatcher(cfg)
        sim = Simulator(MODEL, SimConfig(deployment=deployment, instances=3, prefill_instances=3, admission=adm,
                                         local_policy=local), gain, CLASSES3)
        assert [w.state.order for w in d.registry.prefill] == [p.order for p in sim.p_states]
        for w in d.registry.prefill:
            w.healthy = True
            w.state.estimator = Estimator(MODEL)
        for w in d.registry.decode:
            w.healthy = True      # (with no live decode instance the dispatcher answers 503 first)
        t0 = 10.0
        for i in range(3):
            for k in range(rng.randrange(7)):
                cls = CLASSES3[rng.choice(list(CLASSES3))]
                n = rng.randrange(10, 2500)
                at = t0 - rng.uniform(0, 2)
                for host in (d.router_host, sim.router_host):
                    host.dispatched(Request(f"q{i}.{k}", cls.name, cls.weight, cls.ttft_slo, cls.tpot_slo,
                                            at - 0.01, n), i, at)
        now = t0 + rng.uniform(0, 0.5)
        cls = CLASSES3[rng.choice(list(CLASSES3))]
        n = rng.randrange(10, 800)
        # the dispatcher's view of the request
        job = make_job(COMPLETIONS, {"prompt": list(range(n)), "max_tokens": 4},
                       Grant("c", cls, cls.ttft_slo, cls.tpot_slo), now, None)
        job.sreq = scheduler_request(job)
        # (decision, why refused, class served in, instances it may go to)
        try:
            allowed = d._admit(job, now)
            assert job.sreq.priority == job.grant.cls.name
            got_d = (job.record["admission"], None, job.grant.cls.name, sorted(allowed))
        except ApiError as e:
            assert e.status == 429 and int(e.headers["retry-after"]) >= 1
            got_d = (job.record["admission"], e.code, None, [])
        # the simulator's
        r = Request(f"r{case}", cls.name, cls.weight, cls.ttft_slo, cls.tpot_slo, now, n, output_len=4)
        insts = sim._admit(r, now)
        (asked, counts), = sim.admission_counts.items()
        assert asked == cls.name and sum(counts[k] for k in ("admit", "queue", "downgrade", "reject")) == 1
        decision = next(k for k in ("admit", "queue", "downgrade", "reject") if counts[k])
        if insts is None:
            got_s = (decision, r.error.split("HTTP 429: ")[1].rstrip(")"), None, [])
        else:
            got_s = (decision, None, r.priority, sorted(p.id for p in insts))
        assert got_d == got_s, f"case {case}"
        seen.update((got_d[0], got_d[1]))
        if got_d[3] and len(got_d[3]) < 3:
            seen.add("capped")
    # every branch was exercised: each decision, each reason to refuse, an instance left out by the cap
    assert seen == {"admit", "queue", "downgrade", "reject", None, "slo_unreachable", "queue_full", "capped"}, seen
