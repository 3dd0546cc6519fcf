"""Request progress goes through Request's methods, whichever body drives it: the
simulator (prefill chunks, decode steps, macro-steps, preemption, failure), the engine
plugin (mirroring vLLM's counters, tokens reported in bulk, the end) and the dispatcher
(tokens counted from the stream, the end)."""

import pytest

from proserve.scheduler import Request
from proserve.scheduler.request import Phase


def req(prompt=40, output=4):
    return Request("r", "low", 1.0, 1.0, 0.1, 0.0, prompt, output)


def test_simulated_progress_prefill_decode_steps_and_macro_steps():
    r = req()
    assert not r.advance_prefill(32, 0.1) and r.phase is Phase.PREFILLING and r.kv_len == 32
    assert r.advance_prefill(8, 0.2) and r.phase is Phase.DECODING and r.token_times == [0.2]
    r.decode_step(0.3)
    assert r.kv_len == 41 and r.num_emitted == 2 and r.phase is Phase.DECODING
    r.decode_steps([0.4, 0.5])
    assert r.kv_len == 43 and r.token_times == [0.2, 0.3, 0.4, 0.5] and r.phase is Phase.DONE
    with pytest.raises(ValueError):
        r.advance_prefill(1, 0.6)


def test_preemption_then_failure_keeps_the_intended_output_length():
    r = req()
    r.advance_prefill(40, 0.1)
    r.decode_step(0.2)
    r.preempt()
    assert (r.prefill_len, r.prefilled, r.kv_len, r.phase) == (42, 0, 0, Phase.WAITING)
    r.fail("no memory")
    assert r.error == "no memory" and r.finished and r.output_len == 4


def test_engine_mirror_sync_record_tokens_and_end():
    r = Request("e", "low", 1.0, 1.0, 0.1, 0.0, 40)        # an engine does not know output_len
    r.sync(40, 16, decoding=False)
    assert (r.prefill_len, r.prefilled, r.kv_len, r.phase) == (40, 16, 16, Phase.PREFILLING)
    r.sync(40, 0, decoding=False)
    assert r.phase is Phase.WAITING
    r.sync(41, 41, decoding=True)
    assert r.phase is Phase.DECODING and r.kv_len == 41
    r.record_tokens(3, 0.5)
    r.record_tokens(0, 0.6)
    assert r.token_times == [0.5, 0.5, 0.5] and r.phase is Phase.DECODING   # the engine owns the phase
    r.end()
    assert r.finished and r.error is None and r.output_len == 3              # what it emitted
    a = Request("a", "low", 1.0, 1.0, 0.1, 0.0, 40)
    a.end("aborted")
    assert a.error == "aborted" and a.output_len == 1
