"""Prefix caching (issue 14): the LRU of prefix blocks (scheduler/prefix.py) and the
simulator's use of it (sim/cluster.py): a request skips the prefill of its leading blocks
the instance holds, shares their KV, and every block comes back when the run ends.

Latency model: prefill 1 ms per token (no attention term), 10 ms per step, decode 1 ms.
"""

from __future__ import annotations

import pytest

from proserve.scheduler import ConfigError, GainConfig, LatencyModel, Request
from proserve.scheduler.prefix import BlockLRU, cached_tokens
from proserve.sim.cluster import SimConfig, Simulator

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01,
                     metadata={"block_size": 16, "num_kv_blocks": 4096})


def req(rid, prompt, blocks=(), arrival=0.0, out=2, bt=64):
    return Request(rid, "high", 2.0, 10.0, 1.0, arrival, prompt, output_len=out,
                   prefix_blocks=tuple(blocks), prefix_block_tokens=bt if blocks else 0)


# -- the LRU --------------------------------------------------------------------------------------

def test_lru_matches_the_leading_run_and_evicts_the_least_recently_used():
    c = BlockLRU(4)
    c.insert([1, 2, 3])
    assert c.match([1, 2, 3, 4]) == 3 and c.match([2, 3]) == 2 and c.match([9, 1]) == 0
    assert c.match([1, 5, 2]) == 1          # a block counts only after every block before it
    # recency now, oldest first: 2, 3, 1 (each match refreshed what it found)
    c.insert([4, 5])                        # 5 blocks > 4: the least recently used (2) goes
    assert 2 not in c and all(b in c for b in (1, 3, 4, 5)) and c.evictions == 1
    c.match([3])                            # 3 refreshed: 1 is now the oldest
    c.insert([6])
    assert 1 not in c and 3 in c and len(c) == 4
    c.insert(range(10, 20))                 # more than the capacity: the last ones stay
    assert [b in c for b in (16, 17, 18, 19)] == [True] * 4 and len(c) == 4
    empty = BlockLRU(0)
    empty.insert([1])
    assert empty.match([1]) == 0
    with pytest.raises(ConfigError):
        BlockLRU(-1)


def test_prefix_blocks_need_their_block_size():
    with pytest.raises(ConfigError, match="prefix_block_tokens"):
        Request("r", "high", 2.0, 1.0, 0.1, 0.0, 100, prefix_blocks=(1, 2), prefix_block_tokens=0)
    assert Request("r", "high", 2.0, 1.0, 0.1, 0.0, 100).prefix_block_tokens == 0   # no prefix: none needed


def test_cached_tokens_are_whole_kv_blocks_and_never_the_last_prompt_token():
    r = req("r", 200, blocks=[1, 2, 3, 4], bt=64)          # 4 blocks of 64: 256 > 200 tokens
    assert cached_tokens(r, 0, 16) == 0
    assert cached_tokens(r, 1, 16) == 64
    assert cached_tokens(r, 3, 16) == 192
    assert cached_tokens(r, 4, 16) == 192                  # at most (200 - 1) // 16 * 16 = 192
    assert cached_tokens(req("s", 128, blocks=[1, 2]), 2, 16) == 112   # 127 // 16 * 16: one block recomputed
    assert cached_tokens(req("t", 100, blocks=[1], bt=50), 1, 16) == 48  # 50 tokens: 3 whole blocks of 16


# -- the simulator --------------------------------------------------------------------------------

def run(reqs, **kw):
    sim = Simulator(MODEL, SimConfig(**kw), GainConfig())
    res = sim.run(reqs)
    # every block is back: hits shared, not held, and nothing leaked through preemption
    for inst in sim.front + sim.decoders:
        assert inst.free_blocks == inst.total_blocks, (inst.id, inst.free_blocks)
    return sim, res


@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_a_repeated_prefix_skips_its_prefill(deployment):
    """Two 1,000-token prompts sharing their first 768 tokens (12 blocks of 64), the second
    sent after the first finished: its prefill starts at token 768, so it takes
    0.232 + 0.01 s instead of 1.0 + 0.01 s; its KV is still all 1,000 tokens."""
    a = req("a", 1000, blocks=range(16), arrival=0.0)
    b = req("b", 1000, blocks=[*range(12), 100, 101, 102, 103], arrival=5.0)
    kw = {"deployment": deployment, "prefill_instances": 1, "decode_instances": 1, "instances": 1}
    _, res = run([a, b], **kw)
    assert a.ttft == pytest.approx(1.0 + 0.01)
    assert b.ttft == pytest.approx(0.232 + 0.01)
    assert (res.prefix_prompt_tokens, res.prefix_hit_tokens) == (2000, 768)
    assert b.finished and len(b.token_times) == 2
    # without the cache: both full
    a2 = req("a", 1000, blocks=range(16), arrival=0.0)
    b2 = req("b", 1000, blocks=[*range(12), 100, 101, 102, 103], arrival=5.0)
    _, res2 = run([a2, b2], prefix_cache=False, **kw)
    assert b2.ttft == pytest.approx(1.0 + 0.01) and res2.prefix_prompt_tokens == 0


def test_no_hit_for_a_prefix_that_is_not_leading_or_was_evicted():
    # 4,096 blocks of 16 tokens = 65,536 tokens = 1,024 prefix blocks of 64
    first = req("first", 640, blocks=range(10), arrival=0.0)
    shifted = req("shifted", 640, blocks=[99, *range(1, 10)], arrival=2.0)      # block 0 differs
    flood = [req(f"f{k}", 64 * 100, blocks=range(1000 + 100 * k, 1100 + 100 * k), arrival=4.0 + 10 * k)
             for k in range(11)]                                                 # 1,100 blocks pass through
    again = req("again", 640, blocks=range(10), arrival=200.0)
    _, res = run([first, shifted, *flood, again])
    assert shifted.ttft == pytest.approx(0.64 + 0.01)
    assert again.ttft == pytest.approx(0.64 + 0.01)          # evicted by the flood
    assert res.prefix_hit_tokens == 0


def test_requests_without_prefix_blocks_run_as_before():
    def reqs():
        return [req(f"r{k}", 300 + 37 * k, arrival=0.05 * k, out=5) for k in range(40)]
    on, off = reqs(), reqs()
    _, r1 = run(on)
    run(off, prefix_cache=False)
    assert [r.token_times for r in on] == [r.token_times for r in off]
    assert r1.prefix_prompt_tokens == 0


def test_tight_memory_with_hits_preempts_and_gives_every_block_back():
    """Little KV memory and long outputs: requests with cached prefixes get preempted and
    re-prefilled; the accounting of shared and held blocks still returns every block."""
    model = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01,
                         metadata={"block_size": 16, "num_kv_blocks": 160})
    reqs = [req(f"r{k}", 512, blocks=[k % 3, 10 + k % 3, 20 + k, 30 + k, 40 + k, 50 + k, 60 + k, 70 + k],
                arrival=0.6 * k, out=400) for k in range(12)]
    sim = Simulator(model, SimConfig(instances=1), GainConfig())
    res = sim.run(reqs)
    inst = sim.front[0]
    assert inst.free_blocks == inst.total_blocks
    assert res.preemptions > 0 and res.prefix_hit_tokens > 0
    assert all(r.finished and r.error is None and len(r.token_times) == 400 for r in reqs)


# -- the router's index (scheduler/routing/base.py) and prefix-aware GoRouting -----------------------

def _index_pair():
    from proserve.scheduler import Estimator
    from proserve.scheduler.routing.base import PrefillInstance, PrefillQueueMap
    ps = [PrefillInstance(i, Estimator(MODEL), order="slide", cache_tokens=64 * 100, block_size=16) for i in range(2)]
    return ps, PrefillQueueMap(ps)


def test_the_router_indexes_what_it_dispatched_and_expects_its_prefix_there():
    from proserve.scheduler.routing.base import expected_hit
    from proserve.scheduler.routing.estimates import evaluate
    ps, qm = _index_pair()
    first = req("first", 1000, blocks=range(16))
    qm.add(0, first, 0.0)
    assert ps[0].prefix is not None and ps[0].prefix.capacity == 100 and ps[1].prefix is None
    assert ps[0].dispatched["first"] == (1000, 0)            # nothing was cached before it
    again = req("again", 1000, blocks=[*range(12), 50, 51, 52, 53])
    assert expected_hit(ps[0], again) == 768 and expected_hit(ps[1], again) == 0
    # queued work is recorded net of the expected hit
    qm.add(0, again, 0.0)
    assert ps[0].dispatched["again"] == (1000 - 768, 768)
    # the estimate prices req's prefill net of the hit where the prefix is (Eq. 5: l_q down, l_kv up)
    third = req("third", 1000, blocks=[*range(12), 60, 61, 62, 63])
    e0 = evaluate(ps[0], third, 0.0, GainConfig(), "disaggregated")
    e1 = evaluate(ps[1], third, 0.0, GainConfig(), "disaggregated")
    assert e0.exec_with - e0.exec == pytest.approx(0.232 + 0.01) and e1.exec_with == pytest.approx(1.0 + 0.01)
    # peeking does not refresh: the index's LRU order is the dispatch order
    ps[0].prefix.insert(range(200, 297))   # 97 new blocks: the 3 least recent (0, 1, 2) go
    assert expected_hit(ps[0], third) == 0


def test_go_routing_sends_a_request_to_the_instance_that_holds_its_prefix():
    from proserve.scheduler import make_global
    ps, qm = _index_pair()
    qm.add(1, req("warm", 1000, blocks=range(16)), 0.0)
    qm.remove(1, ps[1].queue[0], 0.5)                       # its prefill ended: instance 1 idle again
    go = make_global("go_routing")
    r = req("r", 1000, blocks=[*range(12), 70, 71, 72, 73])
    assert go.route(r, ps, now=1.0)[0].id == 1                # both idle: it completes sooner there
    assert go.last_decision.branch == "light"
    assert make_global("go_routing", order="deadline").route(r, ps, now=1.0)[0].id == 0  # the paper's: a tie, id 0


def test_prefix_aware_routing_finds_more_hits_than_round_robin():
    def reqs():
        # 39 requests over 3 conversations (round-robin over 4 instances cycles each one
        # through every instance), each turn extending its conversation's prefix
        out = []
        for k in range(39):
            conv, turn = k % 3, k // 3
            blocks = [1000 * conv + j for j in range(4 + turn)]
            out.append(req(f"r{k}", 64 * len(blocks), blocks=blocks, arrival=0.4 * k, out=3))
        return out
    hits = {}
    for glob in ("go_routing", "round_robin"):
        sim = Simulator(MODEL, SimConfig(instances=4, global_policy=glob), GainConfig())
        res = sim.run(reqs())
        hits[glob] = res.prefix_hit_tokens / res.prefix_prompt_tokens
    assert hits["go_routing"] > hits["round_robin"] + 0.2, hits   # measured 0.88 against 0.55
