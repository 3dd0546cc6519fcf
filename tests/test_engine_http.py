"""The scheduler plugin behind vLLM's HTTP server (`python -m proserve.prefill --colocated`):
bad per-request parameters are answered 400 before anything is queued, good
ones are served, and the plugin's metrics are on the worker's /metrics.

The worker is the session's shared colocated worker (tests/conftest.py), with a step
record: a test reads the steps of its own requests (those recorded after it began)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from pd_helpers import ROOT

pytestmark = pytest.mark.vllm
MODEL = str(ROOT / "prefill" / "models" / "tiny-llama")


@pytest.fixture(scope="module")
def worker(shared_colocated):
    """The shared colocated worker (SlideBatching plugin, --record-steps), idle."""
    return shared_colocated


def post(w, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(w.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def body(xargs, n=24, max_tokens=4):
    return {"model": MODEL, "prompt": list(range(1, n + 1)), "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True, "vllm_xargs": xargs}


def steps(w) -> list[dict]:
    return [json.loads(line) for line in w.steps.read_text().splitlines()] if w.steps.exists() else []


@pytest.mark.parametrize("xargs, msg", [
    ({"priority_class": "platinum"}, "vllm_xargs.priority_class must be one of high, low, got 'platinum'"),
    ({"priority_class": "high", "ttft_slo": -0.5}, "vllm_xargs.ttft_slo must be a number > 0, got -0.5"),
    ({"tpot_slo": "soon"}, "vllm_xargs.tpot_slo must be a number > 0, got 'soon'"),
])
def test_bad_params_are_rejected_before_queueing(worker, xargs, msg):
    before = len(steps(worker))
    status, out = post(worker, body(xargs, n=40 + len(steps(worker))))
    assert status == 400, out
    assert msg in out["error"]["message"]
    # nothing reached the engine: no step ran for it
    assert len(steps(worker)) == before


def test_good_params_are_served_and_scheduled(worker):
    first = len(steps(worker))       # the steps before this test are other tests' (shared worker)
    status, out = post(worker, body({"priority_class": "high", "ttft_slo": 0.5, "tpot_slo": 0.05}, n=77))
    assert status == 200, out
    assert len(out["choices"][0]["token_ids"]) == 4
    adm = [a for s in steps(worker)[first:] for a in s["admitted"] if a[2] == 77]
    assert len(adm) == 1 and adm[0][1] == "high"
    # the policy heard of the request's end, with all its tokens counted
    fin = [f for s in steps(worker)[first:] for f in s.get("finished", []) if f[0] == adm[0][0]]
    assert fin == [[adm[0][0], 4]]
    status, out = post(worker, body({}, n=78))          # no class: the default (lowest-weight) class
    assert status == 200
    adm = [a for s in steps(worker)[first:] for a in s["admitted"] if a[2] == 78]
    assert adm[0][1] == "low"


def test_plugin_metrics_on_the_worker(worker):
    post(worker, body({"priority_class": "low"}, n=200, max_tokens=8))
    with urllib.request.urlopen(worker.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    vals = {}
    for line in text.splitlines():
        if line.startswith("proserve:") and 'policy="slide_batching"' in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            vals[name] = value
    assert vals["proserve:steps_total"] >= 8
    # the counters are what the plugin measured, step by step (its step record has the same
    # numbers); how the two times compare depends on the host, so that is not asserted
    recs = steps(worker)
    assert vals["proserve:steps_total"] == len(recs)
    assert vals["proserve:step_seconds_total"] == pytest.approx(sum(r["time"] for r in recs), rel=1e-9)
    assert vals["proserve:schedule_seconds_total"] == pytest.approx(sum(r["sched_s"] for r in recs), rel=1e-9)
    assert vals["proserve:schedule_seconds_total"] > 0
    assert vals["proserve:beta"] == recs[-1]["beta"] and 0.05 <= vals["proserve:beta"] <= 20
    assert vals["proserve:t_budget_seconds"] > 0
    assert "proserve:urgent_requests" in vals and "proserve:normal_requests" in vals
    assert "vllm:num_requests_running" in text    # vLLM's own metrics are still there
