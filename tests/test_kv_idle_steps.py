"""The connector's per-step bookkeeping on steps that compute nothing.

A decode engine whose only request waits for its KV, or a prefill engine whose last
request just finished, steps without a forward pass. On such a step vLLM 0.32+ calls
``wait_for_save`` and then ``get_transfer_results``; vLLM 0.23 and 0.27
(``KVConnectorModelRunnerMixin.kv_connector_no_forward``) call ``start_load_kv`` and
``get_finished`` only. The step's loads, finishes, aborts and discards must take effect
either way, and once: otherwise on 0.23/0.27 a decode request waits for its KV for ever
and a prefill request's "done" is never sent. Driven here through the connector's own
hooks, in the order each vLLM calls them."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

connector = pytest.importorskip("proserve.kvtransfer.connector")
from proserve.kvtransfer import connector_metrics  # noqa: E402

pytestmark = pytest.mark.vllm


class RecordingPusher:
    """Records what the connector asks of its pusher (no network: the bookkeeping is tested)."""

    def __init__(self):
        self.calls = []

    def finish(self, xfer, addr, digest):
        self.calls.append(("finish", xfer))

    def abort(self, xfer, addr, why):
        self.calls.append(("abort", xfer))

    def flush(self, xfer, addr):
        self.calls.append(("flush", xfer))

    def is_failed(self, xfer):
        return False

    def failures(self):
        return {}

    def outcomes(self):
        return {}

    def busy(self):
        return False


def _worker_side(producer: bool):
    c = connector.ProServeConnector.__new__(connector.ProServeConnector)
    c.is_producer, c.block_size, c.timeout_s = producer, 16, 30.0
    c._pusher = RecordingPusher() if producer else None
    c._receiver = c._loader = None
    c._done_sending, c._finishing, c._meta_failed = set(), {}, {}
    c._loads, c._loading, c._error_blocks = {}, {}, set()
    c._applied, c._step = None, 0
    c._kv_transfer_config = SimpleNamespace(kv_load_failure_policy="recompute")
    c.metrics = connector_metrics.get()
    return c


def _no_forward_step_old(c, meta):
    """vLLM 0.23/0.27 on a step with nothing scheduled."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    out = c.get_finished(set())
    c.clear_connector_metadata()
    return out


def _no_forward_step_new(c, meta):
    """vLLM 0.32+ on a step with nothing scheduled."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    c.wait_for_save()
    out = c.get_transfer_results(set())
    c.clear_connector_metadata()
    return out.finished_sending, out.finished_recving


@pytest.mark.parametrize("step", [_no_forward_step_old, _no_forward_step_new], ids=["vllm-0.23-0.27", "vllm-0.32+"])
def test_a_load_on_a_step_without_forward_pass_is_taken_and_ends(step):
    """The decode request's load comes in a step with nothing scheduled (the request waits
    for its KV): the connector takes it and reports the request finished receiving (here at
    once, failed: no receiver runs), so vLLM recomputes instead of waiting for ever."""
    c = _worker_side(producer=False)
    load = connector.LoadSpec("req-1", "x-1", [3, 4], 0, "d" * 32)
    _, recving = step(c, connector.ProServeConnectorMetadata(loads=[load], idle=True))
    assert recving and "req-1" in recving
    assert not c._loads and not c._loading


@pytest.mark.parametrize("step", [_no_forward_step_old, _no_forward_step_new], ids=["vllm-0.23-0.27", "vllm-0.32+"])
def test_a_finish_on_a_step_without_forward_pass_is_sent_once(step):
    """The prefill request finished in the step before; the next step schedules nothing:
    its "done" (and an abort) goes to the pusher exactly once, whichever hooks vLLM calls."""
    c = _worker_side(producer=True)
    meta = connector.ProServeConnectorMetadata(
        finishes=[connector.FinishSpec("req-1", "x-1", "tcp://127.0.0.1:1", 32, "d" * 32)],
        aborts=[("x-2", "tcp://127.0.0.1:1")], idle=True)
    step(c, meta)
    assert c._pusher.calls == [("finish", "x-1"), ("abort", "x-2")]
    assert c._finishing == {"x-1": "req-1"}


def test_a_step_with_a_forward_pass_is_applied_by_wait_for_save_only():
    """A step that computes: its finishes wait for wait_for_save, after the layers were
    staged (with speculative decoding vLLM defers wait_for_save past get_finished)."""
    c = _worker_side(producer=True)
    meta = connector.ProServeConnectorMetadata(
        finishes=[connector.FinishSpec("req-1", "x-1", "tcp://127.0.0.1:1", 32, "d" * 32)], idle=False)
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    c.get_finished(set())
    assert c._pusher.calls == []                 # not before the forward pass's layers
    c.wait_for_save()
    c.wait_for_save()
    assert c._pusher.calls == [("finish", "x-1")]
