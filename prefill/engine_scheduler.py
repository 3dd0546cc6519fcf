"""ProServe's vLLM scheduler plugin: SlideBatching (or any registered local
policy) decides each step's batch inside a real vLLM engine.

Load it with ``scheduler_cls="proserve.prefill.engine_scheduler.ProServeScheduler"`` and
configure it under ``additional_config={"proserve": {...}}`` (``python -m
proserve.prefill --local-policy ...`` does both; see :class:`EngineConfig`).

How the two decisions of Algorithm 1 reach vLLM, with vLLM left to do the rest
(block allocation, prefix cache, KV connector, outputs); the vLLM internals this
takes are all in :mod:`proserve.prefill.vllm_shim`, checked when the engine starts:

1. **Which requests, in which order.** Before vLLM's ``schedule()`` runs, the
   plugin shows the policy an :class:`~proserve.scheduler.local.base.InstanceView` built
   from vLLM's queues and gets a :class:`~proserve.scheduler.local.base.BatchPlan`. The
   waiting queues are swapped, for the duration of the call, for queues holding
   only the planned requests in plan order; everything else goes back, in its
   old order, afterwards.
2. **How many tokens each.** The plan's chunk for every request (GETMAXCHUNK of
   the latency budget) becomes a per-request cap applied through
   ``_reserve_prefill_lookahead``, the last per-request clamp vLLM applies
   (in both its running and waiting loops) before allocating blocks. A running
   request without a chunk is capped to 0, which vLLM treats as "skip this
   step". vLLM's own token budget (``max_num_batched_tokens``) still bounds the
   batch.

Online correction (§4.1): the time from the end of ``schedule()`` to the
matching ``update_from_output()`` is the step's measured time (vLLM on CPU
schedules synchronously; the plugin refuses async scheduling), the estimate is
T_pd of the batch vLLM actually scheduled, and the pair feeds β.

What is not vLLM-specific — the view with its admission reserve, the tokens each
request runs, β, telling the policy of finished batches and requests — is
:class:`proserve.scheduler.host.LocalHost`, the same code the simulator runs;
``tests/test_host_equivalence.py`` drives this plugin and the simulator through
one event sequence and checks they take the same decisions.

``local_policy = "stock"`` runs vLLM's own decisions unchanged, with the same
per-step timing and recording: that is what the profiler drives and what the
scheduling-overhead benchmark compares against.

Step record (``record_steps``): one JSON line per executed step, written only
when recording is on. Besides the batch's composition and timing (``step``,
``wall``, ``prefills``, ``decodes``, ``time``, ``sched_s``, ``est``, ``beta``
after the step, ``waiting``, ``finished``) it holds what vLLM did, ``admitted``
(``[id, class, prompt length, chunk]`` of the requests it took from its waiting
queue, in admission order) and ``scheduled`` (``[id, tokens]`` of every request
in the step, in vLLM's order: running requests first, then the waiting ones),
and ``plan``, what the policy decided and from which state (``null`` for
"stock"):

* ``now``, ``beta`` and ``delta`` (the online correction β·T + δ the policy
  planned with; δ is 0 under ``correction = "scale"``), ``t_budget``,
  ``n_urgent``, ``n_normal``, ``est`` and ``items`` (``[id, chunk, urgent]``
  of the batch, in plan order; decodes have chunk 1);
* ``terms``: the policy's per-request terms of the step (``BatchPlan.terms``,
  ``id -> [exec, remain, density, urgent]``; for SlideBatching these give the
  full order of Alg. 1 line 13, including the requests that did not fit the
  budget), or ``null`` for a policy that computes none;
* ``view``: the :class:`InstanceView` the policy saw, ``mode``,
  ``free_blocks``, ``block_size``, ``reserve_blocks`` and its ``waiting`` and
  ``decoding`` requests in view order, each with the fields a policy reads
  (see :func:`request_record`). Rebuilding the view with
  :func:`view_from_record` and giving it to the same policy at the same β and
  δ reproduces the plan.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from proserve.scheduler.host import LocalHost, ViewOrder
from proserve.scheduler.local.base import PREFILL_ONLY, InstanceView
from proserve.scheduler.request import ConfigError, Phase
from proserve.scheduler.request import Request as PolicyRequest

from . import vllm_shim
from .engine_config import EngineConfig, build
from .params import ParamsError, parse

logger = logging.getLogger("proserve.scheduler")


class ProServeScheduler(Scheduler):
    """A thin vLLM ``Scheduler`` whose batch decisions come from a ``scheduler/`` policy."""

    #: the clocks the plugin reads: Unix time for request and token times (arrival times come
    #: as Unix times), a monotonic clock for step durations; a test replaying an event sequence
    #: replaces both
    wall_clock = staticmethod(time.time)
    step_clock = staticmethod(time.perf_counter)

    def __init__(self, vllm_config, *args: Any, **kwargs: Any) -> None:
        vllm_shim.check()              # an unsupported vLLM stops here, saying why
        super().__init__(vllm_config, *args, **kwargs)
        vllm_shim.check_instance(self)
        extra = getattr(vllm_config, "additional_config", None) or {}
        cfg = self.ps_config = EngineConfig.from_dict(extra.get("proserve"))
        if getattr(self.scheduler_config, "async_scheduling", False):
            raise ConfigError("ProServeScheduler needs synchronous scheduling (it times each step between "
                              "schedule() and update_from_output()): run vLLM with --no-async-scheduling")
        # issue 14: vLLM's KV-cache events for the dispatcher's index, on ProServe's publisher
        from .kv_events import CONFIG_KEY, install

        install(self, extra.get(CONFIG_KEY))
        parts = build(cfg)
        self.classes, self.default_class = parts.classes, parts.default_class
        self.estimator, self.gain, self.policy = parts.estimator, parts.gain, parts.policy
        self.mode = cfg.mode
        self.host = LocalHost(self.policy, self.estimator, self.mode, self.block_size, vllm_shim.total_blocks(self))
        self._views: dict[str, PolicyRequest] = {}
        self._order = ViewOrder()   # the simulator's order of the view, not vLLM's queue order
        self._caps: dict[str, int] | None = None      # the plan's tokens, while vLLM schedules
        self._planned: dict[str, int] | None = None   # ... and until the step is noted (_remember)
        # (t_end, prefills, decodes, sched_s, admitted, scheduled) of the step in flight
        self._last: tuple | None = None
        self._plan_record: dict | None = None
        self._plan_view: InstanceView | None = None   # the view of that plan, recorded after timing
        self._plan = None          # the BatchPlan of the step in flight, for policy.on_batch_done
        self._failing: dict[str, str] = {}   # request id -> why, failed until update_from_output reports it
        self.last_info = None      # ScheduleInfo of the latest plan
        self.steps = 0
        self._record = open(cfg.record_steps, "a", buffering=1) if cfg.record_steps else None
        from . import sched_metrics
        self.metrics = sched_metrics.for_policy(cfg.local_policy, self.estimator)
        from . import queue_publisher  # issue 15: the queued prefill work, for several dispatchers
        self._publisher = queue_publisher.from_config(cfg)
        logger.info("ProServe scheduler: policy=%s mode=%s classes=%s", cfg.local_policy, cfg.mode,
                    ",".join(self.classes))

    # -- requests in and out -------------------------------------------------------
    def add_request(self, request) -> None:
        if request.request_id not in self.requests:
            try:
                p = parse(request.sampling_params.extra_args if request.sampling_params else None,
                          self.classes, self.default_class)
            except ParamsError as e:
                # the API server's validator rejects these before they get here; a
                # request submitted around it is served in the default class, loudly
                logger.error("request %s: %s; scheduling it in class %r", request.request_id, e,
                             self.default_class)
                p = parse(None, self.classes, self.default_class)
            self._views[request.request_id] = PolicyRequest(
                id=request.request_id, priority=p.priority, weight=p.weight, ttft_slo=p.ttft_slo,
                tpot_slo=p.tpot_slo, arrival=p.arrival_time if p.arrival_time is not None else request.arrival_time,
                prompt_len=request.num_prompt_tokens, prefill_len=request.num_prompt_tokens)
            self._order.arrived(request.request_id)
            if getattr(self, "_publisher", None) is not None:
                xa = (request.sampling_params.extra_args if request.sampling_params else None) or {}
                did = xa.get("dispatch_id")
                self._publisher.arrived(request.request_id, did if isinstance(did, str) else None)
        super().add_request(request)

    def finish_requests(self, request_ids, finished_status):
        out = super().finish_requests(request_ids, finished_status)
        self._publish_queue()
        now = self.wall_clock()
        for r in out:
            # stop strings end requests here too (the front end detects them), not only aborts
            self._finished(self._views.pop(r.request_id, None), now,
                           aborted=finished_status == vllm_shim.ABORTED,
                           error=self._failing.pop(r.request_id, None))
        return out

    def _finished(self, v: PolicyRequest | None, now: float, aborted: bool = False,
                  error: str | None = None) -> None:
        """Tell the policy a request ended (policies that learn output lengths need it)."""
        if v is None:
            return
        self._order.forget(v.id)
        if error is not None:
            v.fail(error)
        elif aborted:
            v.end("aborted")
        elif self.mode == PREFILL_ONLY:
            # a prefill-only engine hands the request off after its first token: its true
            # output length is the decode side's, so policies that learn lengths must skip it
            v.end("handed off to decode")
        else:
            v.end()
        self.host.finished(v, now)

    # -- the view the policy sees ------------------------------------------------------
    def _sync(self, req) -> PolicyRequest | None:
        """Refresh the policy's copy of a vLLM request; None if it cannot be scheduled now."""
        v = self._views.get(req.request_id)
        if v is None or req.status not in vllm_shim.SCHEDULABLE or req.request_id in self._failing:
            return None
        done = req.num_computed_tokens
        n_out = req.num_output_tokens
        if n_out == 0 or req.num_tokens - done > 1:
            # prompt (or, after a recompute preemption, prompt + outputs) still to prefill
            if v.phase is Phase.DECODING:
                self._order.preempted(v.id)   # vLLM preempted it while it decoded
            v.sync(req.num_tokens if n_out else req.num_prompt_tokens, done, decoding=False)
        else:
            v.sync(done, done, decoding=True)
        return v

    def _view(self, now: float) -> InstanceView:
        waiting, decoding = [], []
        for q in vllm_shim.queues(self):
            for req in q:
                v = self._sync(req)
                if v is None:
                    continue
                (waiting if v.needs_prefill else decoding).append(v)
        self._order.sort(waiting, decoding)
        return self.host.view(now, waiting, decoding, vllm_shim.free_blocks(self), idle=vllm_shim.holds_no_kv(self))

    # -- one step ------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        t0 = self.step_clock()
        self._publish_queue()   # the queue as of the step's start (issue 15; a no-op unless publishing)
        if self.policy is None:
            out = super().schedule(*args, **kwargs)
        else:
            out = self._schedule_planned(*args, **kwargs)
        t1 = self.step_clock()
        self._remember(out, t1, t1 - t0)
        if self._plan_view is not None:
            # written out here, after timing, so that recording does not count as scheduling time;
            # nothing changes the policy's requests between the plan and here
            self._plan_record["view"] = view_record(self._plan_view)
            self._plan_view = None
        return out

    def _schedule_planned(self, *args, **kwargs):
        now = self.wall_clock()
        view = self._view(now)
        plan = self.host.plan(view)
        while plan.empty and self._unstick(view, now):
            view = self._view(now)
            plan = self.host.plan(view)
        self.last_info = plan.info
        self._plan = plan if not plan.empty else None
        if self._record is not None:
            urgent = plan.urgent_ids()
            self._plan_record = {
                "t_budget": plan.info.t_budget, "n_urgent": plan.info.n_urgent, "n_normal": plan.info.n_normal,
                "est": plan.info.est_time, "now": now, "beta": self.estimator.beta,
                "delta": self.estimator.delta,
                "items": [[r.id, n, r.id in urgent] for r, n in plan.prefill] + [[r.id, 1, r.id in urgent]
                                                                                 for r in plan.decode],
                "terms": plan.terms.of() if plan.terms is not None else None}
            self._plan_view = view
        # each planned request's tokens, in plan order: vLLM takes its waiting ones in this order
        caps = self._caps = self.host.tokens(plan, view)
        try:
            with vllm_shim.planned_queues(self, caps, list(caps)):
                out = super().schedule(*args, **kwargs)
        finally:
            self._caps, self._planned = None, caps
        info = plan.info
        if not plan.empty:
            self.metrics.plan(info, self.estimator.beta)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %d: beta=%.3f t_budget=%.4f urgent=%d normal=%d planned=%d tokens est=%.4fs",
                         self.steps, self.estimator.beta, info.t_budget, info.n_urgent, info.n_normal,
                         plan.num_tokens, info.est_time)
        return out

    def _unstick(self, view: InstanceView, now: float) -> bool:
        """The plan is empty although requests are queued: free memory by the simulator's
        rule (``LocalHost.unstick``) through vLLM's own preemption and error paths; True if
        something changed and the step should be planned again. Without this an engine whose
        KV is held by partial prefills the policy will not run now schedules nothing, for ever."""
        if not view.waiting and not view.decoding:
            return False
        what = self.host.unstick(view, idle=vllm_shim.holds_no_kv(self))
        if what.preempt is not None:
            logger.info("empty plan with KV held: preempting %s", what.preempt.id)
            return vllm_shim.preempt(self, what.preempt.id, now)
        for r in what.fail:
            logger.warning("request %s: %d tokens to prefill do not fit the KV cache of %d blocks; failing it",
                           r.id, r.prefill_len, view.free_blocks)
            self._failing[r.id] = "request does not fit in KV memory"
        if what.fail:
            vllm_shim.fail(self, [r.id for r in what.fail])
        return not what.wait

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        # the last per-request clamp of vLLM's schedule(): apply the plan's chunk here
        # (a private vLLM method: vllm_shim.check verifies it exists with this signature)
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self._caps is None:
            return n
        return min(n, self._caps.get(request.request_id, 0))

    def _remember(self, out, t_end: float, sched_s: float) -> None:
        """Note the batch vLLM actually scheduled, for β and the step record."""
        self.steps += 1
        planned, self._planned = self._planned or {}, None
        if out.total_num_scheduled_tokens <= 0:
            self._last = None
            return
        # the batch in plan order (then anything unplanned), as the simulator lists it: β adds the
        # batch's costs in this order, and a float sum depends on its order
        tokens = out.num_scheduled_tokens
        prefills, decodes = [], []
        for rid in [rid for rid in planned if rid in tokens] + [rid for rid in tokens if rid not in planned]:
            req = self.requests.get(rid)
            if req is None:
                continue
            n = tokens[rid]
            l_kv = req.num_computed_tokens - n   # vLLM advanced it by n in schedule()
            if n == 1 and l_kv >= req.num_prompt_tokens:
                decodes.append(l_kv)
            else:
                prefills.append((n, l_kv))
        # requests vLLM admitted this step, in admission order: [id, class, prompt length, chunk]
        admitted = []
        for new in out.scheduled_new_reqs:
            v = self._views.get(new.req_id)
            req = self.requests.get(new.req_id)
            admitted.append([new.req_id, v.priority if v else None, req.num_prompt_tokens if req else None,
                             out.num_scheduled_tokens.get(new.req_id, 0)])
        scheduled = list(map(list, out.num_scheduled_tokens.items())) if self._record is not None else None
        self._last = (t_end, prefills, decodes, sched_s, admitted, scheduled)

    def update_from_output(self, scheduler_output, model_runner_output):
        t_real_end = self.step_clock()
        last, self._last = self._last, None
        # vLLM drops finished requests from self.requests in update_from_output: hold on
        # to them so that their last tokens are counted too
        stepped = {rid: self.requests.get(rid) for rid in scheduler_output.num_scheduled_tokens}
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        now = self.wall_clock()
        plan, self._plan = self._plan, None
        prefilling = [(r, len(r.token_times)) for r, _ in plan.prefill] if plan is not None else ()
        # token timestamps (the deadlines of Eq. 3 count emitted tokens) and finished requests
        finished = []
        for rid, req in stepped.items():
            v = self._views.get(rid)
            if v is None:
                continue
            if req is not None:
                v.record_tokens(req.num_output_tokens - len(v.token_times), now)
            if req is None or req.is_finished():
                finished.append([rid, len(v.token_times)])
                self._finished(self._views.pop(rid, None), now)
        for r, n in prefilling:                 # in plan order
            if len(r.token_times) > n and r.id in self._views:
                self._order.prefilled(r.id)     # its first token: the prefill is done, it decodes
        if plan is not None:
            self.host.batch_done(plan, now)   # stateful policies (e.g. weighted_vtc) count here
        if last is not None:
            t_end, prefills, decodes, sched_s, admitted, scheduled = last
            t_real = t_real_end - t_end
            t_model = self.estimator.model.batch_time(prefills, decodes)   # priced once (Eq. 5-7)
            est = self.estimator.corrected(t_model)      # what the step was expected to take
            beta = self.host.observe_run(t_real, t_model, now)   # the online correction (§4.1)
            self.metrics.step(t_real, est, beta, sched_s)
            if self._record is not None:
                self._record.write(json.dumps({
                    "step": self.steps, "wall": now, "prefills": prefills, "decodes": decodes, "time": t_real,
                    "sched_s": sched_s, "est": est, "beta": beta,
                    "waiting": vllm_shim.num_waiting(self), "admitted": admitted,
                    "scheduled": scheduled, "finished": finished, "plan": self._plan_record}) + "\n")
        self._publish_queue()   # ... and as of its end
        return outputs

    def _publish_queue(self) -> None:
        """Hand the queue publisher (``publish_queue``, :mod:`proserve.prefill.queue_publisher`)
        the requests waiting for prefill, as ``_sync`` classifies them but without touching the
        policy's view; co-located also the decodes (each counted as its prompt)."""
        pub = getattr(self, "_publisher", None)
        if pub is None:
            return
        entries, n_d, kv, seen = [], 0, 0, set()
        for q in vllm_shim.queues(self):
            for req in q:
                rid = req.request_id
                v = self._views.get(rid)
                if v is None or req.status not in vllm_shim.SCHEDULABLE or rid in self._failing:
                    continue
                seen.add(rid)
                done, n_out = req.num_computed_tokens, req.num_output_tokens
                if n_out == 0 or req.num_tokens - done > 1:
                    did, t_in = pub.identity(rid)
                    total = req.num_tokens if n_out else req.num_prompt_tokens
                    entries.append((did, v.priority, v.weight, v.ttft_slo, v.tpot_slo, t_in,
                                    max(0, total - done), done, req.num_prompt_tokens))
                else:
                    n_d += 1
                    kv += req.num_prompt_tokens
        pub.prune(lambda rid: rid in seen or rid in self.requests)
        if self.mode == PREFILL_ONLY:
            pub.snapshot(entries)
        else:
            pub.snapshot(entries, n_d, float(kv))

    def shutdown(self) -> None:
        if self._record is not None:
            self._record.close()
            self._record = None
        if getattr(self, "_publisher", None) is not None:
            self._publisher.close()
            self._publisher = None
        super().shutdown()


# -- the step record's view: what the policy saw, enough to replay its decision ---------------------
def request_record(r: PolicyRequest) -> dict:
    """The fields of ``r`` a policy reads.

    Of the emitted tokens' times only the count and the first and last ones are
    kept (what SlideBatching and the TDG deadlines read), so that a record stays
    small however long a request decodes.
    """
    times = r.token_times
    return {"id": r.id, "class": r.priority, "weight": r.weight, "ttft_slo": r.ttft_slo, "tpot_slo": r.tpot_slo,
            "arrival": r.arrival, "prompt_len": r.prompt_len, "prefill_len": r.prefill_len,
            "prefilled": r.prefilled, "kv_len": r.kv_len, "phase": r.phase.value, "emitted": len(times),
            "first_token": times[0] if times else None, "last_token": times[-1] if times else None}


def view_record(view: InstanceView) -> dict:
    return {"mode": view.mode, "free_blocks": view.free_blocks, "block_size": view.block_size,
            "reserve_blocks": view.reserve_blocks, "waiting": [request_record(r) for r in view.waiting],
            "decoding": [request_record(r) for r in view.decoding]}


def request_from_record(d: dict) -> PolicyRequest:
    """A fresh policy request in the state :func:`request_record` saw."""
    n = d["emitted"]
    times = [] if n == 0 else [d["first_token"]] + [d["last_token"]] * (n - 1)
    return PolicyRequest(id=d["id"], priority=d["class"], weight=d["weight"], ttft_slo=d["ttft_slo"],
                         tpot_slo=d["tpot_slo"], arrival=d["arrival"], prompt_len=d["prompt_len"],
                         phase=Phase(d["phase"]), token_times=times, prefill_len=d["prefill_len"],
                         prefilled=d["prefilled"], kv_len=d["kv_len"])


def view_from_record(plan_record: dict) -> InstanceView:
    """The :class:`InstanceView` a step record's ``plan`` was made from (its ``now`` and ``view``);
    the policy decides on it as recorded at the plan's ``beta`` and ``delta`` (a record written
    before δ was recorded has no ``delta``: read it as 0)."""
    v = plan_record["view"]
    return InstanceView(now=plan_record["now"], waiting=[request_from_record(d) for d in v["waiting"]],
                        decoding=[request_from_record(d) for d in v["decoding"]], free_blocks=v["free_blocks"],
                        block_size=v["block_size"], mode=v["mode"], reserve_blocks=v["reserve_blocks"])
