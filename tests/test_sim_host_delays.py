"""What the real cluster adds around the engine steps, in the simulator
(``SimConfig.first_token / dispatch_delay / handoff_delay / stream_delay``):
one request alone, so every token time is known in closed form."""

import pytest

from proserve.scheduler import ConfigError, LatencyModel
from proserve.scheduler.request import Phase
from proserve.sim.cluster import SimConfig, simulate

# 1 ms per prefill token, 1 ms per decode request, 10 ms per step; 1 KB of KV per token
M = LatencyModel(a_p=0, b_p=0, c_p=1e-3, a_d=0, b_d=1e-3, t_c=0.01, metadata={"kv_bytes_per_token": 1000})
STEP_P = 0.1 + 0.01          # a 100-token prefill step
STEP_D = 0.001 + 0.01        # a one-request decode step


def one(make_req, **cfg):
    r = make_req(prompt=100, output=3, arrival=0.0, ttft=10.0, tpot=1.0)
    simulate([r], M, SimConfig(local_policy="slide_batching", global_policy="round_robin", **cfg))
    return r


def test_colocated_delays_shift_the_first_token_not_the_gaps(make_req):
    r = one(make_req, dispatch_delay=0.005, stream_delay=0.002)
    assert r.token_times == pytest.approx([0.005 + STEP_P + 0.002 + i * STEP_D for i in range(3)])
    assert r.tpot == pytest.approx(STEP_D)


def test_disaggregated_prefill_token_is_the_first_by_default(make_req):
    r = one(make_req, deployment="disaggregated", kv_bandwidth=1e6)
    kv = 100 * 1000 / 1e6
    # the paper's hand-off: the prefill's token at the prefill's end, then 2 decode steps after the KV
    assert r.token_times == pytest.approx([STEP_P, STEP_P + kv + STEP_D, STEP_P + kv + 2 * STEP_D])


def test_disaggregated_decode_emits_every_token_after_the_handoff(make_req):
    r = one(make_req, deployment="disaggregated", kv_bandwidth=1e6, first_token="decode",
            dispatch_delay=0.005, handoff_delay=0.012, stream_delay=0.002)
    # the KV of the prompt but its last position moves; the decode side recomputes that one
    kv = 99 * 1000 / 1e6
    first = 0.005 + STEP_P + kv + 0.012 + STEP_D + 0.002
    assert r.token_times == pytest.approx([first + i * STEP_D for i in range(3)])
    assert r.num_emitted == r.output_len == 3 and r.phase is Phase.DONE


def test_a_one_token_request_still_goes_through_decode(make_req):
    r = make_req(prompt=100, output=1, arrival=0.0, ttft=10.0, tpot=1.0)
    simulate([r], M, SimConfig(deployment="disaggregated", kv_bandwidth=1e6, first_token="decode",
                               local_policy="slide_batching", global_policy="round_robin"))
    assert r.token_times == pytest.approx([STEP_P + 99 * 1000 / 1e6 + STEP_D])


def test_hand_off_withdraws_the_prefill_token(make_req):
    r = make_req(prompt=10, output=2)
    assert r.advance_prefill(10, 1.0)
    assert r.token_times == [1.0] and r.kv_len == 10
    r.hand_off()
    assert r.token_times == [] and r.kv_len == 9 and r.phase is Phase.DECODING
    r.decode_step(2.0)
    assert r.kv_len == 10 and r.token_times == [2.0]


@pytest.mark.parametrize("field,value", [("first_token", "client"), ("dispatch_delay", -1e-3),
                                         ("handoff_delay", float("nan")), ("stream_delay", -1.0)])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        SimConfig(**{field: value}).validate()


@pytest.mark.parametrize("exact", [False, True])
def test_kv_reaching_a_busy_decode_instance_waits_a_step(make_req, exact):
    """vLLM loads received KV during the decode instance's next step; the request computes
    its first token in the step after (first_token="decode")."""
    r1 = make_req(prompt=100, output=30, arrival=0.0, ttft=10.0, tpot=1.0)
    r2 = make_req(prompt=100, output=3, arrival=0.2, ttft=10.0, tpot=1.0)
    simulate([r1, r2], M, SimConfig(deployment="disaggregated", kv_bandwidth=1e15, first_token="decode",
                                    local_policy="slide_batching", global_policy="round_robin",
                                    fast_forward=not exact))
    # r1 decodes alone from 0.11 (steps of 0.011 s). r2's KV arrives at 0.31, inside r1's step
    # ending at 0.319; r2 loads during [0.319, 0.330] and computes with r1 in [0.330, 0.342]
    assert r1.token_times[:3] == pytest.approx([0.121, 0.132, 0.143])
    assert r2.token_times[0] == pytest.approx(0.319 + STEP_D + (0.002 + 0.01))
    assert r2.num_emitted == 3 and r1.num_emitted == 30
