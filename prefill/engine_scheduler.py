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
   (in both its running and waiting loops) before allocating blocks (vLLM
   0.23/0.27: ``_mamba_block_aligned_split``, called at the same places;
   :func:`vllm_shim.route_chunk_clamp`). A running
   request without a chunk is capped to 0, which vLLM treats as "skip this
   step". vLLM's own token budget (``max_num_batched_tokens``) still bounds the
   batch.

Synchronous and async scheduling. ``ProServeScheduler`` is the one class users
name; built under vLLM's async scheduling (``scheduler_config.async_scheduling``:
on by default on CUDA, forced off on CPU) it is a :class:`ProServeAsyncScheduler`,
the same plugin over vLLM's ``AsyncScheduler`` (``vllm/v1/core/sched/async_scheduler.py``),
which keeps the output placeholders that let vLLM schedule step N+1 while step N
runs. vLLM's engine then keeps several steps in flight (``EngineCore.step_with_batch_queue``
in ``vllm/v1/engine/core.py``: ``schedule()`` of step N+1 comes before
``update_from_output()`` of step N; up to ``vllm_config.max_concurrent_batches``
of them, 2 with async scheduling, ``pp_size`` with pipeline parallelism), so the
plugin keeps its steps in flight first in, first out, each matched to its
``update_from_output(scheduler_output, ...)`` by identity of the ``SchedulerOutput``.
Under async scheduling a request whose last prefill chunk or decode token is in
flight has ``num_computed_tokens`` already advanced; the policy sees it as vLLM
will schedule it next (decoding, with that KV), and does not see it at all when
vLLM will skip it (its tokens in flight already reach ``max_tokens``, e.g. a
prefill-only request's first token), so that it is not priced as a phantom
decode. Under synchronous scheduling nothing is in flight when a step is
planned, and the view is what it always was.

Online correction (§4.1): a step's measured time runs from when it started
executing to when its result came back, the entry of its ``update_from_output()``;
it started when it was scheduled (the end of its ``schedule()``) or when the
previous step's result came back, whichever is later:
``T_real(N) = t_update(N) - max(t_sched_end(N), t_update(N-1))``. Scheduled
synchronously, step N-1's result is back before step N is scheduled, and this is
the time from the end of ``schedule()`` to the matching ``update_from_output()``.
The estimate is T_pd of the batch vLLM actually scheduled, and the pair feeds β.

What is not vLLM-specific — the view with its admission reserve, the tokens each
request runs, β, telling the policy of finished batches and requests — is
:class:`proserve.scheduler.host.LocalHost`, the same code the simulator runs;
``tests/test_host_equivalence.py`` drives this plugin and the simulator through
one event sequence and checks they take the same decisions.

``local_policy = "stock"`` runs vLLM's own decisions unchanged, with the same
per-step timing and recording: that is what the profiler drives and what the
scheduling-overhead benchmark compares against.

Step record (``record_steps``): one JSON line per executed step, written only
when recording is on, when its result comes back (so in the order steps were
scheduled). Besides the batch's composition and timing (``step``, ``wall``,
``prefills``, ``decodes``, ``time``, ``sched_s``, ``est``, ``beta`` after the
step, ``waiting``, ``finished``, and ``in_flight``: how many steps scheduled
after it were still in flight when its result came back, always 0 when
scheduling synchronously) it holds what vLLM did, ``admitted``
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
from collections import deque
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from proserve.scheduler.host import LocalHost, ViewOrder
from proserve.scheduler.local.base import PREFILL_ONLY, BatchPlan, InstanceView
from proserve.scheduler.request import ConfigError, Phase
from proserve.scheduler.request import Request as PolicyRequest

from . import vllm_shim
from .engine_config import EngineConfig, build
from .params import ParamsError, parse

logger = logging.getLogger("proserve.scheduler")

#: steps in flight past which the oldest is given up for lost (vLLM keeps at most
#: ``max_concurrent_batches`` in flight: 2 with async scheduling, ``pp_size`` + 1 at most)
MAX_IN_FLIGHT = 64
# why a request whose prompt can never fit the KV cache is failed (the client sees it)
DOES_NOT_FIT = "request does not fit in KV memory"


@dataclass(slots=True, eq=False)
class InFlight:
    """A step scheduled and not yet given back to ``update_from_output()``."""

    out: Any                 # the SchedulerOutput schedule() returned: matched by identity
    step: int                # the plugin's step number
    t_end: float             # step_clock at the end of its schedule()
    sched_s: float           # how long its schedule() took
    behind: bool             # an executed step was still in flight when it was scheduled
    batch: tuple | None      # (prefills, decodes) vLLM scheduled, in plan order; None: nothing
    admitted: list
    scheduled: list | None   # [id, tokens] in vLLM's order, for the step record
    plan: BatchPlan | None   # what the policy planned (for policy.on_batch_done); None: nothing
    plan_record: dict | None


class ProServeScheduler(Scheduler):
    """A thin vLLM ``Scheduler`` whose batch decisions come from a ``scheduler/`` policy.

    Under vLLM's async scheduling, constructing it gives a :class:`ProServeAsyncScheduler`."""

    #: the clocks the plugin reads: Unix time for request and token times (arrival times come
    #: as Unix times), a monotonic clock for step durations; a test replaying an event sequence
    #: replaces both
    wall_clock = staticmethod(time.time)
    step_clock = staticmethod(time.perf_counter)

    def __new__(cls, vllm_config, *args: Any, **kwargs: Any):
        # vLLM builds the class it is given (SchedulerConfig.get_scheduler_cls uses scheduler_cls as
        # is), so the async behaviour vLLM's engine expects under async scheduling comes from here:
        # the async variant is a subclass, so Python runs __init__ on it as usual
        if cls is ProServeScheduler and vllm_shim.async_scheduling(vllm_config):
            return super().__new__(ProServeAsyncScheduler)
        return super().__new__(cls)

    def __init__(self, vllm_config, *args: Any, **kwargs: Any) -> None:
        vllm_shim.check()              # an unsupported vLLM stops here, saying why
        if vllm_shim.async_scheduling(vllm_config) and not isinstance(self, vllm_shim.AsyncScheduler):
            # a subclass of the synchronous plugin: vLLM would run ahead of it without placeholders
            raise ConfigError(f"{type(self).__name__} is a synchronous scheduler but vLLM runs this engine with "
                              f"async scheduling: derive it from ProServeAsyncScheduler, or run vLLM with "
                              f"--no-async-scheduling")
        super().__init__(vllm_config, *args, **kwargs)
        vllm_shim.check_instance(self)
        self._vllm_split = vllm_shim.route_chunk_clamp(self)   # vLLM 0.23/0.27: its Mamba split is the hook
        extra = getattr(vllm_config, "additional_config", None) or {}
        cfg = self.ps_config = EngineConfig.from_dict(extra.get("proserve"))
        # issue 14: vLLM's KV-cache events for the dispatcher's index, on ProServe's publisher
        from .kv_events import CONFIG_KEY, install

        install(self, extra.get(CONFIG_KEY))
        parts = build(cfg)
        self.classes, self.default_class = parts.classes, parts.default_class
        # named so as not to shadow vLLM's Scheduler.policy (its queues' SchedulingPolicy, read in schedule())
        self.estimator, self.gain, self.local_policy = parts.estimator, parts.gain, parts.policy
        self.mode = cfg.mode
        self.host = LocalHost(self.local_policy, self.estimator, self.mode, self.block_size, vllm_shim.total_blocks(self))
        self._views: dict[str, PolicyRequest] = {}
        self._order = ViewOrder()   # the simulator's order of the view, not vLLM's queue order
        self._caps: dict[str, int] | None = None      # the plan's tokens, while vLLM schedules
        self._planned: dict[str, int] | None = None   # ... and until the step is noted (_remember)
        # the plan of the step being scheduled, until _remember files it with the step
        self._plan: BatchPlan | None = None
        self._plan_record: dict | None = None
        self._plan_view: InstanceView | None = None   # the view of that plan, recorded after timing
        self._in_flight: deque[InFlight] = deque()    # steps scheduled, oldest first
        self._t_result: float | None = None   # step_clock when the latest executed step's result came back
        # request id -> the step whose schedule() put it in the decoding order because its first
        # token was in flight (async), so that that step's update_from_output does not add it again
        self._joined: dict[str, int] = {}
        self._failing: dict[str, str] = {}   # request id -> why, failed until update_from_output reports it
        self.last_info = None      # ScheduleInfo of the latest plan
        self.steps = 0
        self._record = open(cfg.record_steps, "a", buffering=1) if cfg.record_steps else None
        from . import sched_metrics
        self.metrics = sched_metrics.for_policy(cfg.local_policy, self.estimator)
        from . import queue_publisher  # issue 15: the queued prefill work, for several dispatchers
        self._publisher = queue_publisher.from_config(cfg)
        logger.info("ProServe scheduler: policy=%s mode=%s classes=%s scheduling=%s", cfg.local_policy, cfg.mode,
                    ",".join(self.classes), "async" if isinstance(self, vllm_shim.AsyncScheduler) else "synchronous")

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
        for rid in vllm_shim.finished_ids(out):
            # stop strings end requests here too (the front end detects them), not only aborts
            self._finished(self._views.pop(rid, None), now, aborted=finished_status == vllm_shim.ABORTED,
                           error=self._failing.pop(rid, None))
        return out

    def _finished(self, v: PolicyRequest | None, now: float, aborted: bool = False,
                  error: str | None = None) -> None:
        """Tell the policy a request ended (policies that learn output lengths need it)."""
        if v is None:
            return
        self._order.forget(v.id)
        self._joined.pop(v.id, None)
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
    def _state(self, req) -> tuple[PolicyRequest, int, int, bool] | None:
        """``(policy request, tokens to prefill, computed tokens, decoding)`` of a vLLM request as
        the next step can run it; None if the next step cannot run it (not the plugin's, not
        schedulable, being failed, or skipped by vLLM's running loop whatever it is offered).

        Under async scheduling the tokens sampled by steps still in flight count as outputs
        already (vLLM advanced ``num_computed_tokens`` over their inputs when it scheduled them):
        a request whose last prefill chunk is in flight decodes next. Their times are not known
        yet, so the policy's ``token_times`` still lack them. Synchronously nothing is in flight."""
        rid = req.request_id
        v = self._views.get(rid)
        if v is None or req.status not in vllm_shim.SCHEDULABLE or rid in self._failing:
            return None
        if vllm_shim.skipped_next_step(self, req):
            return None    # e.g. a prefill-only request whose first (and only) token is in flight
        done = req.num_computed_tokens
        pending = vllm_shim.in_flight_tokens(req)
        n_out = req.num_output_tokens + pending
        if n_out == 0 or req.num_tokens + pending - done > 1:
            # prompt (or, after a recompute preemption, prompt + outputs) still to prefill
            return v, (req.num_tokens if n_out else req.num_prompt_tokens), done, False
        return v, done, done, True

    def _sync(self, req) -> PolicyRequest | None:
        """Refresh the policy's copy of a vLLM request; None if it cannot be scheduled now."""
        state = self._state(req)
        if state is None:
            return None
        v, prefill_len, done, decoding = state
        if not decoding and v.phase is Phase.DECODING:
            self._order.preempted(v.id)   # vLLM preempted it while it decoded
            self._joined.pop(v.id, None)
        v.sync(prefill_len, done, decoding=decoding)
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
        if self.local_policy is None:
            out = super().schedule(*args, **kwargs)
        else:
            out = self._schedule_planned(*args, **kwargs)
        t1 = self.step_clock()
        self._remember(out, t1, t1 - t0)
        if self._plan_view is not None:
            # written out here, after timing, so that recording does not count as scheduling time;
            # nothing changes the policy's requests between the plan and here
            self._in_flight[-1].plan_record["view"] = view_record(self._plan_view)
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
        for r, _ in plan.prefill:                 # in plan order
            req = self.requests.get(r.id)
            if req is not None and vllm_shim.in_flight_tokens(req) > 0 and r.id not in self._joined:
                # async: its last chunk was scheduled and its first token is in flight; the next
                # view (planned before that token is back) lists it as decoding, in the order in
                # which prefills finish, as the simulator does (_remember numbers this step next)
                self._order.prefilled(r.id)
                self._joined[r.id] = self.steps + 1
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
            self._failing[r.id] = DOES_NOT_FIT
        if what.fail:
            vllm_shim.fail(self, [r.id for r in what.fail], DOES_NOT_FIT)
        return not what.wait

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        # the last per-request clamp of vLLM's schedule() (vLLM 0.32+): apply the plan's chunk here
        # (a private vLLM method: vllm_shim.check verifies it exists with this signature)
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        return self._planned_chunk(request, n)

    def _mamba_block_aligned_split(self, request, num_new_tokens: int, *args, **kwargs) -> int:
        # vLLM 0.23/0.27 call this at the same two places (vllm_shim.route_chunk_clamp); on
        # 0.32+ only for Mamba models, after which _reserve_prefill_lookahead clamps again.
        # The plan's cap comes first, so that a hybrid model's chunk is still block-aligned
        n = self._planned_chunk(request, num_new_tokens)
        if self._vllm_split and n > 0:
            aligned = super()._mamba_block_aligned_split(request, n, *args, **kwargs)
            if aligned == 0:
                # the planned chunk is shorter than one of the model's (Mamba-aligned) blocks:
                # vLLM would schedule nothing, step after step. One block instead, the least
                # step that makes progress (as LocalHost's least step does for a token budget)
                one_block = min(num_new_tokens, max(n, vllm_shim.split_block_size(self)))
                aligned = super()._mamba_block_aligned_split(request, one_block, *args, **kwargs)
            n = aligned
        return n

    def _planned_chunk(self, request, n: int) -> int:
        if self._caps is None:
            return n
        return min(n, self._caps.get(request.request_id, 0))

    def _remember(self, out, t_end: float, sched_s: float) -> None:
        """Note the step vLLM actually scheduled (the batch, for β and the step record; the plan,
        for the policy) as the newest in flight."""
        self.steps += 1
        planned, self._planned = self._planned or {}, None
        plan, self._plan = self._plan, None
        plan_record, self._plan_record = self._plan_record, None
        q = self._in_flight
        behind = any(s.batch is not None for s in q)
        step = InFlight(out, self.steps, t_end, sched_s, behind, None, [], None, plan, plan_record)
        q.append(step)
        if len(q) > MAX_IN_FLIGHT:
            lost = q.popleft()
            logger.error("step %d was never given back to update_from_output (%d steps in flight); dropping it "
                         "from the online correction", lost.step, len(q))
        if out.total_num_scheduled_tokens <= 0:
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
        step.batch = (prefills, decodes)
        step.admitted = admitted
        step.scheduled = list(map(list, out.num_scheduled_tokens.items())) if self._record is not None else None

    @property
    def _last(self) -> tuple | None:
        """The newest step's batch as ``(t_end, prefills, decodes, sched_s, admitted, scheduled)``,
        None if it scheduled nothing (what a test driving the plugin reads after ``schedule()``)."""
        if not self._in_flight or self._in_flight[-1].batch is None:
            return None
        s = self._in_flight[-1]
        return (s.t_end, *s.batch, s.sched_s, s.admitted, s.scheduled)

    def _given_back(self, out) -> InFlight | None:
        """The step in flight whose SchedulerOutput is ``out``: the oldest one, as vLLM's batch queue
        is first in, first out. Anything else is logged loudly, not raised: steps older than the one
        given back are dropped (they will not come back), and a result for a step not in flight
        here is served without observing its time or reporting its plan."""
        q = self._in_flight
        for i, step in enumerate(q):
            if step.out is out:
                break
        else:
            logger.error("update_from_output for a step the ProServe scheduler did not schedule (%d steps in "
                         "flight, the oldest step %s): its time is not observed and its plan not reported to "
                         "the policy", len(q), q[0].step if q else None)
            return None
        for _ in range(i):
            lost = q.popleft()
            logger.error("step %d never came back to update_from_output: step %d, scheduled after it, came back "
                         "first (vLLM's batch queue is first in, first out); dropping step %d from the online "
                         "correction and the policy's notifications", lost.step, step.step, lost.step)
        return q.popleft()

    def update_from_output(self, scheduler_output, model_runner_output):
        t_result = self.step_clock()      # the step's result is back: its execution ended
        step = self._given_back(scheduler_output)
        # vLLM drops finished requests from self.requests in update_from_output: hold on
        # to them so that their last tokens are counted too
        stepped = {rid: self.requests.get(rid) for rid in scheduler_output.num_scheduled_tokens}
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        vllm_shim.finish_failed(self, outputs)     # vLLM 0.23 only: the requests fail() named
        now = self.wall_clock()
        plan = step.plan if step is not None else None
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
            joined = self._joined.get(r.id)
            if joined is not None:              # in the decoding order since a schedule() (async)
                if joined == step.step:
                    del self._joined[r.id]
            elif len(r.token_times) > n and r.id in self._views:
                self._order.prefilled(r.id)     # its first token: the prefill is done, it decodes
        if plan is not None:
            self.host.batch_done(plan, now)   # stateful policies (e.g. weighted_vtc) count here
        # the step ran from when it was scheduled or when the previous step's result came back,
        # whichever is later, to now: T_real(N) = t_update(N) - max(t_sched_end(N), t_update(N-1)).
        # Which is later follows from the order of events, not from comparing clock readings: the
        # previous result came back later iff that step was still in flight when this one was
        # scheduled. Synchronously it never is, and T_real is the time since the end of schedule().
        t_prev = self._t_result
        if scheduler_output.total_num_scheduled_tokens > 0:
            self._t_result = t_result
        if step is not None and step.batch is not None:
            prefills, decodes = step.batch
            t_real = t_result - (t_prev if step.behind and t_prev is not None else step.t_end)
            t_model = self.estimator.model.batch_time(prefills, decodes)   # priced once (Eq. 5-7)
            est = self.estimator.corrected(t_model)      # what the step was expected to take
            beta = self.host.observe_run(t_real, t_model, now)   # the online correction (§4.1)
            self.metrics.step(t_real, est, beta, step.sched_s)
            if self._record is not None:
                self._record.write(json.dumps({
                    "step": step.step, "wall": now, "prefills": prefills, "decodes": decodes, "time": t_real,
                    "sched_s": step.sched_s, "est": est, "beta": beta,
                    "waiting": vllm_shim.num_waiting(self), "admitted": step.admitted,
                    "scheduled": step.scheduled, "finished": finished, "in_flight": len(self._in_flight),
                    "plan": step.plan_record}) + "\n")
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
                state = self._state(req)
                if state is None:
                    continue
                seen.add(rid)
                v, total, done, decoding = state
                if not decoding:
                    did, t_in = pub.identity(rid)
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


class ProServeAsyncScheduler(ProServeScheduler, vllm_shim.AsyncScheduler):
    """The plugin under vLLM's async scheduling: ``ProServeScheduler`` over vLLM's
    ``AsyncScheduler``, as vLLM's own ``DiffusionAsyncScheduler(DiffusionScheduler,
    AsyncScheduler)`` (``vllm/v1/core/sched/diffusion_scheduler.py``) is built. In the method
    order the plugin comes first and ``AsyncScheduler`` before ``Scheduler``, so the plugin's
    ``super()`` calls reach ``AsyncScheduler``'s overrides (``_update_after_schedule`` adds the
    output placeholders, ``_update_request_with_output`` takes them back). Users name
    ``ProServeScheduler``; it becomes this class when ``async_scheduling`` is on."""


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
