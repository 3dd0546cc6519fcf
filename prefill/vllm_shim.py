"""Every private vLLM internal the engine plugin (``proserve.prefill.engine_scheduler``)
relies on, in one place, checked at start-up.

vLLM's scheduler has no public hook to reorder its waiting queue or to cap one
request's chunk for one step, so the plugin reaches inside it. The touch points:

* ``Scheduler.waiting`` and ``Scheduler.kv_holding_waiting``: the two waiting
  queues (requests new or preempted; requests holding KV blocks while they wait
  for remote KV). :func:`planned_queues` swaps them, for the duration of one
  ``schedule()`` call, for queues holding the planned requests in plan order.
* ``RequestQueue.add_request / remove_requests / prepend_requests`` and
  ``create_request_queue(SchedulingPolicy.FCFS)``: how those queues are built
  and given back.
* ``Scheduler._reserve_prefill_lookahead(request, num_computed_tokens,
  num_new_tokens) -> int``: the last per-request clamp vLLM applies (in its
  running and its waiting loop) before allocating blocks; the plugin overrides
  it to apply the plan's chunk.
* ``Scheduler.kv_cache_manager.block_pool.get_num_free_blocks()`` and
  ``.num_gpu_blocks``: the free and total KV blocks the policy sees.
* ``Scheduler._preempt_request(request, timestamp)`` (a running request, taken out of
  ``running`` first, back to the waiting queue with its KV freed) and the
  ``Scheduler.grammar_compile_error_reqs`` set (requests ``update_from_output``
  finishes with FINISHED_ERROR and reports to the client): :func:`preempt` and
  :func:`fail`, how the plugin frees memory when its plan is empty
  (``LocalHost.unstick``).
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

:func:`check` runs before the engine starts: a vLLM outside
:data:`SUPPORTED` (the range tested, also pinned in ``pyproject.toml``) or
lacking one of the touch points stops it with :class:`UnsupportedVLLM` saying
what is wrong. ``PROSERVE_ALLOW_UNSUPPORTED_VLLM=1`` skips the version check
(to try a newer vLLM); the touch points are checked all the same.
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

#: vLLM releases the plugin is tested on: [low, high)
SUPPORTED = ("0.32", "0.33")
ALLOW_ENV = "PROSERVE_ALLOW_UNSUPPORTED_VLLM"
#: statuses of requests a policy may schedule now
SCHEDULABLE = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)
ABORTED = RequestStatus.FINISHED_ABORTED

_LOOKAHEAD = "_reserve_prefill_lookahead"
_LOOKAHEAD_PARAMS = ["self", "request", "num_computed_tokens", "num_new_tokens"]
_QUEUE_METHODS = ("add_request", "remove_requests", "prepend_requests")
_PREEMPT = "_preempt_request"
_PREEMPT_PARAMS = ["self", "request", "timestamp"]
_ERRORS = "grammar_compile_error_reqs"
#: the hook where AsyncScheduler counts the tokens in flight (num_output_placeholders)
_AFTER_SCHEDULE = "_update_after_schedule"
#: request fields the plugin reads
_REQUEST_FIELDS = ("num_computed_tokens", "num_tokens", "num_prompt_tokens", "num_output_tokens",
                   "num_tokens_with_spec", "num_output_placeholders", "max_tokens", "next_decode_eligible_step")


class UnsupportedVLLM(ConfigError):
    """The installed vLLM lacks what the engine plugin needs."""


def check(version: str | None = None, scheduler_cls: type = Scheduler) -> None:
    """Raise :class:`UnsupportedVLLM` unless ``version`` (default: the installed
    vLLM's) is in :data:`SUPPORTED` and ``scheduler_cls`` has the touch points."""
    version = vllm.__version__ if version is None else version
    lo, hi = SUPPORTED
    if os.environ.get(ALLOW_ENV) != "1":
        try:
            v = Version(version).release[:2]
        except InvalidVersion:
            raise UnsupportedVLLM(f"vLLM version {version!r} cannot be parsed; the ProServe scheduler "
                                  f"supports vLLM >= {lo}, < {hi} ({ALLOW_ENV}=1 to try it anyway)") from None
        if not Version(lo).release <= v < Version(hi).release:
            raise UnsupportedVLLM(f"vLLM {version} is not supported by the ProServe scheduler, which reaches "
                                  f"into vLLM's scheduler internals tested on vLLM >= {lo}, < {hi}: install "
                                  f"a supported vLLM, or set {ALLOW_ENV}=1 to try this one")
    hook = getattr(scheduler_cls, _LOOKAHEAD, None)
    if not callable(hook):
        raise UnsupportedVLLM(f"vLLM {version}: Scheduler.{_LOOKAHEAD} is missing; the ProServe scheduler "
                              f"applies each request's planned chunk there")
    params = list(inspect.signature(hook).parameters)
    if params != _LOOKAHEAD_PARAMS:
        raise UnsupportedVLLM(f"vLLM {version}: Scheduler.{_LOOKAHEAD} takes ({', '.join(params)}), not the "
                              f"({', '.join(_LOOKAHEAD_PARAMS)}) the ProServe scheduler overrides")
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


def check_instance(sched: Scheduler) -> None:
    """The touch points that exist only once a scheduler is built."""
    for name in ("waiting", "kv_holding_waiting", "running", "requests", "current_step"):
        if not hasattr(sched, name):
            raise UnsupportedVLLM(f"vLLM {vllm.__version__}: Scheduler.{name} is missing; the ProServe "
                                  f"scheduler reads vLLM's queues and step count through it")
    if not isinstance(getattr(sched, _ERRORS, None), set):
        raise UnsupportedVLLM(f"vLLM {vllm.__version__}: Scheduler.{_ERRORS} is missing; the ProServe "
                              f"scheduler fails requests that can never fit the KV cache through it")
    pool = getattr(getattr(sched, "kv_cache_manager", None), "block_pool", None)
    if not callable(getattr(pool, "get_num_free_blocks", None)) or not isinstance(
            getattr(pool, "num_gpu_blocks", None), int):
        raise UnsupportedVLLM(f"vLLM {vllm.__version__}: Scheduler.kv_cache_manager.block_pool."
                              f"get_num_free_blocks or num_gpu_blocks is missing")


def queues(sched: Scheduler) -> tuple:
    """vLLM's request queues in the order a policy's view lists them."""
    return sched.running, sched.kv_holding_waiting, sched.waiting


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
    return req.num_output_placeholders


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
    return len(sched.waiting) + len(sched.kv_holding_waiting)


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
    return True


def fail(sched: Scheduler, request_ids) -> None:
    """Have the next ``update_from_output()`` finish these requests with FINISHED_ERROR and
    report them to their clients (vLLM's path for requests it cannot serve)."""
    getattr(sched, _ERRORS).update(request_ids)


@contextlib.contextmanager
def planned_queues(sched: Scheduler, caps: dict[str, int], order: list[str]) -> Iterator[None]:
    """For one ``schedule()`` call: vLLM's waiting queues hold only the requests of
    ``caps`` in ``order`` (plus the blocked ones, which vLLM must still see to notice
    they became ready). Afterwards what the step did not take (and anything vLLM
    preempted into them) goes back in front of the requests the plan left out."""
    saved = sched.waiting, sched.kv_holding_waiting
    sched.waiting = _planned_queue(saved[0], caps, order)
    sched.kv_holding_waiting = _planned_queue(saved[1], caps, order)
    try:
        yield
    finally:
        for tmp, orig in ((sched.waiting, saved[0]), (sched.kv_holding_waiting, saved[1])):
            if tmp:
                # FCFS prepend_requests reverses its argument (it is extendleft)
                orig.prepend_requests(reversed(list(tmp)) if isinstance(orig, deque) else list(tmp))
        sched.waiting, sched.kv_holding_waiting = saved


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
