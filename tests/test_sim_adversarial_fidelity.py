"""Adversarial checks of the simulator's first_token='decode' hand-off: the prefill
instance must get back every KV block it allocated once the KV moved."""

import pytest

from proserve.scheduler import LatencyModel
from proserve.sim.cluster import SimConfig, Simulator

M = LatencyModel(a_p=0, b_p=0, c_p=1e-3, a_d=0, b_d=1e-3, t_c=0.01, metadata={"kv_bytes_per_token": 1000})


@pytest.mark.parametrize("first_token", ["prefill", "decode"])
def test_prefill_blocks_all_return_after_the_handoff(make_req, first_token):
    # a 17-token prompt fills 2 blocks of 16 on the prefill instance; hand_off drops kv_len
    # to 16, so freeing blocks_held(r) then gives back only 1 of them
    reqs = [make_req(prompt=17, output=3, arrival=float(i), ttft=10.0, tpot=1.0) for i in range(2)]
    sim = Simulator(M, SimConfig(deployment="disaggregated", local_policy="slide_batching",
                                 global_policy="round_robin", num_kv_blocks=2, block_size=16,
                                 first_token=first_token))
    sim.run(reqs)
    assert sim.front[0].free_blocks == sim.front[0].total_blocks
    # the leaked block leaves the second request waiting forever, neither finished nor failed
    assert all(r.finished and r.error is None and r.num_emitted == 3 for r in reqs)
