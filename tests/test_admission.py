"""Admission control (scheduler/admission.py): the pure rule, its validation, and the
simulator applying it (the dispatcher's side: tests/test_admission_dispatcher.py).

The hand-made latency model of tests/test_routing.py keeps the numbers readable:
prefill costs 1 ms per token and every batch 10 ms, so (one request per batch, φ_p) a
queued request of ``n`` tokens costs ``n/1000 + 0.01`` s.
"""

from __future__ import annotations

import json

import pytest

from proserve.scheduler import ConfigError, Estimator, GainConfig, LatencyModel, Request, make_global
from proserve.scheduler.admission import (
    ADMIT,
    DOWNGRADE,
    QUEUE,
    QUEUE_FULL,
    REJECT,
    SLO_UNREACHABLE,
    Admission,
    AdmissionConfig,
    ConcurrencyCount,
    lower_class,
    parse_actions,
    queued_tokens,
)
from proserve.scheduler.config import default_classes, overload_actions_from_dicts
from proserve.scheduler.request import Phase, PriorityClass
from proserve.scheduler.routing.base import COLOCATED, DISAGGREGATED, PrefillInstance, PrefillQueueMap
from proserve.scheduler.tdg import summarize
from proserve.sim.cluster import SimConfig, Simulator, simulate
from proserve.sim.stream import simulate_stream

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01)
GAIN = GainConfig()
CLASSES = default_classes()   # high w=2, low w=1, TTFT 1 s, TPOT 0.1 s


def req(rid, tokens, cls="low", arrival=0.0, classes=CLASSES):
    c = classes[cls]
    return Request(rid, c.name, c.weight, c.ttft_slo, c.tpot_slo, arrival, tokens)


def cluster(*loads):
    """Prefill instances whose queues hold one request of φ_p cost ``load`` seconds (0: empty),
    dispatched at t = 0, arrived just before (its deadline precedes a new request's)."""
    ps = [PrefillInstance(i, Estimator(MODEL)) for i in range(len(loads))]
    qm = PrefillQueueMap(ps)
    for p, load in zip(ps, loads):
        if load:
            qm.add(p.id, req(f"q{p.id}", round((load - 0.01) * 1000), arrival=-0.01), 0.0)
    return ps, qm


def rule(on_overload=None, classes=CLASSES, deployment=DISAGGREGATED, **caps):
    return Admission(AdmissionConfig(on_overload or {}, **caps), classes, GAIN, deployment)


# -- the rule --------------------------------------------------------------------------------

def test_admitted_when_some_instance_meets_the_ttft_slo():
    ps, _ = cluster(1.5, 0.5)
    d = rule({"low": "reject"}).decide(req("r", 190), ps, 0.0)   # 0.5 + 0.2 < 1 s on instance 1
    assert (d.decision, d.reason, d.served.name) == (ADMIT, None, "low")
    assert d.instances == ps and d.delta_max > 0 and not d.refused


def test_reject_when_no_instance_can_meet_it_and_gorouting_agrees():
    ps, _ = cluster(1.5, 2.0)
    r = req("r", 190)
    d = rule({"low": "reject"}).decide(r, ps, 0.0)
    assert (d.decision, d.reason, d.served, d.instances) == (REJECT, SLO_UNREACHABLE, None, [])
    assert d.refused and d.delta_max <= 0
    # Retry-After: the least loaded instance's backlog (1.5 s), rounded up
    assert d.retry_after_s == 2
    # the router, on the same state, takes its fallback branch (Alg. 2 line 19): the same test
    router = make_global("go_routing", gain=GAIN, classes=CLASSES, deployment=DISAGGREGATED)
    router.select_prefill(r, ps, 0.0)
    assert router.last_decision.branch == "fallback"


def test_a_queue_class_is_routed_anyway_and_says_it_was_overloaded():
    ps, _ = cluster(1.5, 2.0)
    d = rule({"low": "reject"}).decide(req("r", 190, "high"), ps, 0.0)   # high: queue (the default)
    assert (d.decision, d.reason, d.served.name, d.instances) == (QUEUE, SLO_UNREACHABLE, "high", ps)


def test_lag_compensation_counts_work_done_since_the_queue_changed():
    """1.2 s after the queue update the instance has worked 1.2 s of its 1.5 s backlog."""
    ps, _ = cluster(1.5)
    assert rule({"low": "reject"}).decide(req("r", 190, arrival=1.2), ps, 1.2).decision == ADMIT


def test_downgrade_serves_in_the_next_class_down_with_its_slos():
    classes = {"gold": PriorityClass("gold", 4, 1.0, 0.1), "silver": PriorityClass("silver", 2, 5.0, 0.1),
               "bronze": PriorityClass("bronze", 1, 30.0, 0.1)}
    assert lower_class(classes, "gold").name == "silver" and lower_class(classes, "bronze") is None
    ps, _ = cluster(3.0)
    # gold (TTFT 1 s) cannot start before 3 s; silver's 5 s can be met: served as silver
    d = rule({"gold": "downgrade"}, classes).decide(req("r", 190, "gold", classes=classes), ps, 0.0)
    assert (d.decision, d.served.name, d.reason) == (DOWNGRADE, "silver", None)
    ps, _ = cluster(8.0)
    # neither gold nor silver (5 s) can be met: silver's own action applies
    r = req("r", 190, "gold", classes=classes)
    assert rule({"gold": "downgrade"}, classes).decide(r, ps, 0.0).decision == DOWNGRADE   # silver queues
    d = rule({"gold": "downgrade", "silver": "reject"}, classes).decide(r, ps, 0.0)
    assert (d.decision, d.reason) == (REJECT, SLO_UNREACHABLE)
    d = rule({"gold": "downgrade", "silver": "downgrade"}, classes).decide(r, ps, 0.0)
    assert (d.decision, d.served.name) == (DOWNGRADE, "bronze")   # twice down: 30 s can be met
    assert r.priority == "gold" and r.ttft_slo == 1.0   # deciding moves nothing: the body does


def test_colocated_deployment_uses_the_colocated_estimate():
    ps, _ = cluster(2.0)
    d = rule({"low": "reject"}, deployment=COLOCATED).decide(req("r", 190), ps, 0.0)
    assert d.decision == REJECT
    ps, _ = cluster(0.3)
    assert rule({"low": "reject"}, deployment=COLOCATED).decide(req("r", 190), ps, 0.0).decision == ADMIT


def test_caps_leave_full_instances_out_and_refuse_when_all_are_full():
    ps, qm = cluster(0.2, 0)
    d = rule(max_queued_requests=1).decide(req("r", 100), ps, 0.0)
    assert d.decision == ADMIT and [p.id for p in d.instances] == [1]
    qm.add(1, req("x", 50), 0.0)
    for cls in ("high", "low"):   # a cap is hard: every class is refused, "queue" ones too
        d = rule(max_queued_requests=1).decide(req("r", 100, cls), ps, 0.0)
        assert (d.decision, d.reason, d.instances) == (REJECT, QUEUE_FULL, [])
        assert d.retry_after_s >= 1
    # tokens: instance 0 holds 190 queued prompt tokens, instance 1 holds 50
    assert [queued_tokens(p) for p in ps] == [190, 50]
    d = rule(max_queued_tokens=100).decide(req("r", 100), ps, 0.0)
    assert [p.id for p in d.instances] == [1]
    assert rule(max_queued_tokens=50).decide(req("r", 100), ps, 0.0).reason == QUEUE_FULL


def test_off_unless_something_is_configured():
    assert not AdmissionConfig().active
    assert not AdmissionConfig({"high": "queue", "low": "queue"}).active
    assert AdmissionConfig({"low": "reject"}).active and AdmissionConfig(max_queued_tokens=10).active


def test_concurrency_count():
    c = ConcurrencyCount(3, 2)
    assert [c.acquire("a"), c.acquire("a"), c.acquire("a")] == [None, None, "client_overloaded"]
    assert c.acquire(None) is None and c.acquire("b") == "overloaded"
    c.release("a")
    assert c.total == 2 and c.per_client == {"a": 1}
    assert ConcurrencyCount(None, None).acquire("x") is None


@pytest.mark.parametrize("config, message", [
    (AdmissionConfig({"low": "drop"}), "low.on_overload must be one of queue, reject, downgrade, got 'drop'"),
    (AdmissionConfig({"mid": "reject"}), "on_overload must be keyed by configured classes (high, low), got 'mid'"),
    (AdmissionConfig({"low": "downgrade"}), "needs a class of lower weight than 'low'"),
    (AdmissionConfig(max_queued_requests=0), "max_queued_requests must be an integer >= 1, got 0"),
    (AdmissionConfig(max_queued_tokens=1.5), "max_queued_tokens must be an integer >= 1, got 1.5"),
])
def test_bad_config_is_refused_naming_the_field(config, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config.check(CLASSES)


def test_parsing_actions_from_flags_and_class_files():
    assert parse_actions(["low=reject", "high=downgrade, low=queue"]) == {"low": "queue", "high": "downgrade"}
    with pytest.raises(ConfigError, match="expects CLASS=ACTION"):
        parse_actions(["reject"])
    with pytest.raises(ConfigError, match="--on-overload: low must be one of"):
        parse_actions(["low=drop"])
    items = [{"name": "high", "weight": 2, "ttft_slo": 1, "tpot_slo": 0.1},
             {"name": "low", "weight": 1, "ttft_slo": 1, "tpot_slo": 0.1, "on_overload": "reject"}]
    assert overload_actions_from_dicts(items) == {"low": "reject"}
    with pytest.raises(ConfigError, match=r"classes\[0\].on_overload must be one of"):
        overload_actions_from_dicts([{"name": "x", "on_overload": 1}], "classes")


# -- the simulator ------------------------------------------------------------------------------

def burst(n=40, tokens=290, cls=("high", "low")):
    """``n`` requests of 0.3 s prefill arriving 0.05 s apart (one instance serves one per 0.3 s:
    a queue builds), classes alternating, 4 output tokens each."""
    out = []
    for i in range(n):
        c = CLASSES[cls[i % len(cls)]]
        out.append(Request(f"r{i}", c.name, c.weight, c.ttft_slo, c.tpot_slo, 0.05 * i, tokens, output_len=4))
    return out


def sim(reqs, deployment="colocated", **kw):
    cfg = SimConfig(deployment=deployment, prefill_instances=2, decode_instances=1, instances=2,
                    local_policy="sarathi_fcfs", **kw)
    return simulate(reqs, MODEL, cfg, GAIN, CLASSES)


def timeline(res):
    return [(r.id, r.priority, r.error, tuple(r.token_times)) for r in res.requests]


@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_sim_reject_refuses_low_requests_at_arrival(deployment):
    base = sim(burst(), deployment)
    res = sim(burst(), deployment, admission=AdmissionConfig({"low": "reject"}))
    rejected = [r for r in res.requests if r.error is not None]
    assert rejected and all(r.priority == "low" for r in rejected)
    for r in rejected:   # scored as the load generator scores a 429: no token, not finished
        assert r.error.startswith("rejected (HTTP 429: slo_unreachable") and not r.token_times
        assert r.phase is Phase.WAITING and r.instance is None
    assert all(r.finished and r.error is None for r in res.requests if r not in rejected)
    c = res.admission
    assert c["low"]["reject"] == c["low"]["reject:slo_unreachable"] == len(rejected)
    assert c["high"]["reject"] == 0 and c["high"]["admit"] + c["high"]["queue"] == 20
    assert sum(c["low"][k] for k in ("admit", "queue", "downgrade", "reject")) == 20
    # refused requests count with zero gain and their ideal gain, and miss their SLO
    m = summarize(res.requests, GAIN)["low"]
    assert m.requests == 20 and m.finished == 20 - len(rejected)
    assert m.ideal_gain == pytest.approx(summarize(base.requests, GAIN)["low"].ideal_gain)
    # the high class gains from the room the refused requests left
    assert summarize(res.requests, GAIN)["high"].tdg_ratio > summarize(base.requests, GAIN)["high"].tdg_ratio


def test_sim_queue_everywhere_is_todays_behaviour():
    base = sim(burst())
    same = sim(burst(), admission=AdmissionConfig({"high": "queue", "low": "queue"}))
    assert timeline(same) == timeline(base) and same.admission == {}


def test_sim_downgrade_serves_high_requests_as_low_and_scores_them_as_high():
    seen = {}
    cfg = SimConfig(instances=2, local_policy="sarathi_fcfs", admission=AdmissionConfig({"high": "downgrade"}))
    s = Simulator(MODEL, cfg, GAIN, CLASSES)
    s.router.on_request_finished = lambda r, now: seen.setdefault(r.id, (r.priority, r.weight))
    res = s.run(burst())
    c = res.admission["high"]
    assert c["downgrade"] == len(s.downgraded) > 0 and c["reject"] == 0
    assert set(s.downgraded.values()) == {"low"}
    for r in res.requests:
        if r.id in s.downgraded:
            assert seen[r.id] == ("low", 1.0)                # the policies saw it in the lower class
            assert (r.priority, r.weight) == ("high", 2.0)   # scored in the class it came in
            assert r.finished and r.error is None
    assert summarize(res.requests, GAIN)["high"].requests == 20


def test_sim_caps_refuse_when_every_instance_is_full():
    res = sim(burst(), admission=AdmissionConfig(max_queued_requests=2))
    refused = [r for r in res.requests if r.error is not None]
    assert refused and {r.priority for r in refused} == {"high", "low"}
    assert sum(c["reject:queue_full"] for c in res.admission.values()) == len(refused)


def test_sim_concurrency_limit_per_class():
    """--max-concurrent-per-class: the dispatcher's per-key limit, one key per class; a slot
    is held from arrival to the last token."""
    res = sim(burst(), max_concurrent_per_class=3)
    refused = [r for r in res.requests if r.error is not None]
    assert refused and all("client_overloaded" in r.error for r in refused)
    served = [r for r in res.requests if r.error is None]
    for r in res.requests:
        same = [q for q in served if q.priority == r.priority and q is not r
                and q.arrival <= r.arrival < q.token_times[-1]]
        assert len(same) <= 3 and (len(same) == 3) == (r in refused)


def test_sim_stream_sees_refused_requests():
    cfg = SimConfig(instances=2, local_policy="sarathi_fcfs", admission=AdmissionConfig({"low": "reject"}))
    full = simulate(burst(), MODEL, cfg, GAIN, CLASSES)
    streamed = simulate_stream(burst(), MODEL, cfg, GAIN, CLASSES)
    assert streamed.unended == 0 and streamed.requests == 40
    want = summarize(full.requests, GAIN)
    for k in ("all", "high", "low"):
        assert streamed.metrics[k].requests == want[k].requests
        assert streamed.metrics[k].tdg == pytest.approx(want[k].tdg)


def test_sim_bad_admission_config_fails_at_start():
    with pytest.raises(ConfigError, match="simulator: low.on_overload = \"downgrade\" needs a class"):
        Simulator(MODEL, SimConfig(admission=AdmissionConfig({"low": "downgrade"})), GAIN, CLASSES)
    with pytest.raises(ConfigError, match="max_concurrent_per_class must be an integer >= 1"):
        Simulator(MODEL, SimConfig(max_concurrent_per_class=0), GAIN, CLASSES)


def test_sim_cli_reports_refused_requests_per_class(tmp_path, capsys):
    from proserve.sim.__main__ import main
    classes = tmp_path / "classes.json"
    classes.write_text(json.dumps([{"name": "high", "weight": 2, "ttft_slo": 1.0, "tpot_slo": 0.1},
                                   {"name": "low", "weight": 1, "ttft_slo": 1.0, "tpot_slo": 0.1,
                                    "on_overload": "reject"}]))
    args = ["run", "--num-requests", "150", "--rate", "40", "--classes", str(classes), "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "# admission per class" in out and "slo_unreachable" in out
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["admission"]["low"]["reject"] == run["metrics"]["low"]["rejected"] > 0
    assert run["metrics"]["high"]["rejected"] == 0
    assert run["metrics"]["all"]["rejected"] == run["metrics"]["low"]["rejected"]
    # the flag overrides the file; a bad value is a start-up error (exit 2)
    assert main(args + ["--on-overload", "low=queue"]) == 0
    assert "# admission per class" not in capsys.readouterr().out
    assert main(["run", "--num-requests", "10", "--on-overload", "low=downgrade"]) == 2
    assert "needs a class of lower weight" in capsys.readouterr().err
