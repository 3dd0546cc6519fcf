"""Local batch policies: the §5.1 baselines, the §3.2 orderings, SlideBatching
(Alg. 1) and its §5.4 ablations, on hand-computed cases.

Latency model used throughout (numbers chosen so that times are easy):

    prefill chunk of q tokens : 1 ms per token   (a_p = b_p = 0, c_p = 1e-3)
    decode step               : 1 ms             (a_d = 0, b_d = 1e-3)
    per-batch overhead t_c    : 10 ms
    β = 1 (no online correction)

Default classes: "high" (weight 2) and "low" (weight 1), TTFT SLO 1.0 s,
TPOT SLO 0.1 s. The TBT-profiled token budget is then
(0.1 - 0.01) / 1e-3 = 90 tokens.

Where a latency budget cuts a prefill chunk, deadlines are offset by half a
millisecond so the chunk is x.5 tokens before GETMAXCHUNK's floor (no float
ties at integer boundaries).
"""

from __future__ import annotations

import math
import random

import pytest

from proserve.scheduler import (
    ConfigError,
    Estimator,
    LatencyModel,
    Request,
    make_local,
    registry,
)
from proserve.scheduler.local import COLOCATED, PREFILL_ONLY, InstanceView
from proserve.scheduler.local.base import blocks_for

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=1e-2)
TTFT, TPOT = 1.0, 0.1
TOKEN_BUDGET_POLICIES = ["sarathi_fcfs", "sarathi_priority", "fairbatching", "weighted_vtc", "edf", "sjf"]
NEW_POLICIES = ["vllm_fcfs"] + TOKEN_BUDGET_POLICIES
SLIDE_FAMILY = ["slide_batching", "only_deadline", "only_density", "wo_latency_aware"]
ALL_POLICIES = NEW_POLICIES + SLIDE_FAMILY


def est() -> Estimator:
    return Estimator(MODEL)


#: SlideBatching's own rules beyond the paper off: the hand-computed tests below are of Algorithm 1
ALG1 = {"headroom": 0.0, "age_limit": None}


def policy(name: str, **params):
    if name in SLIDE_FAMILY:
        params = {**ALG1, **params}
    return make_local(name, est(), **params)


def wait(id, arrival, prompt, prio="low", out=100) -> Request:
    """A request waiting for its prefill."""
    return Request(id, prio, 2.0 if prio == "high" else 1.0, TTFT, TPOT, arrival, prompt, out)


def dec(id, arrival, emitted=1, prompt=20, prio="low") -> Request:
    """A decoding request that has emitted ``emitted`` tokens; kv_len = prompt + emitted - 1
    (prompt 20 with block 16: the next decode token needs no new block)."""
    r = wait(id, arrival, prompt, prio)
    r.advance_prefill(prompt, arrival + 0.01)
    for _ in range(emitted - 1):
        r.emit(arrival + 0.02)
        r.kv_len += 1
    return r


def view(waiting=(), decoding=(), now=0.0, mode=COLOCATED, free_blocks=1 << 30, block_size=16):
    return InstanceView(now=now, waiting=list(waiting), decoding=list(decoding),
                        free_blocks=free_blocks, block_size=block_size, mode=mode)


def chunks(plan):
    return [(r.id, n) for r, n in plan.prefill]


def decs(plan):
    return [r.id for r in plan.decode]


def urgent(plan):
    """request id -> URGENT, as the policy decided it this step (``BatchPlan.terms``)."""
    return {rid: t[3] for rid, t in plan.terms.of().items()}


def test_tbt_token_budget_of_the_test_model():
    # largest chunk q with q·1ms + 10ms <= 100 ms  ->  90
    assert policy("sarathi_fcfs").tbt_token_budget() == 90


# ---------------------------------------------------------------- vllm_fcfs
def test_vllm_fcfs_whole_prompts_fcfs_within_token_budget():
    d1 = dec("d1", 0.0)
    w1, w2, w3 = wait("w1", 1.0, 3000), wait("w2", 0.5, 4000), wait("w3", 2.0, 2000)
    plan = policy("vllm_fcfs").schedule(view([w1, w2, w3], [d1]))
    # arrival order w2 (4000), w1 (3000) -> 7000; + w3 (2000) = 9000 > 8192: stop.
    # Prefill has priority: the running decode d1 waits.
    assert chunks(plan) == [("w2", 4000), ("w1", 3000)]
    assert decs(plan) == []
    assert plan.info.token_budget == 8192 and math.isnan(plan.info.t_budget)


def test_vllm_fcfs_first_prompt_admitted_whole_even_over_budget():
    w1, w2 = wait("w1", 0.0, 3000), wait("w2", 0.1, 10)
    plan = policy("vllm_fcfs", max_num_batched_tokens=1000).schedule(view([w2, w1]))
    # w1 (3000 > 1000) is first in arrival order: taken whole; w2 then no longer fits
    assert chunks(plan) == [("w1", 3000)]


def test_vllm_fcfs_max_num_seqs_counts_running_decodes():
    ds = [dec("d1", 0.0), dec("d2", 0.1)]
    ws = [wait("w1", 1.0, 10), wait("w2", 1.1, 10)]
    # 2 running + 1 new = 3 = max_num_seqs
    plan = policy("vllm_fcfs", max_num_seqs=3).schedule(view(ws, ds))
    assert chunks(plan) == [("w1", 10)] and decs(plan) == []
    # 2 running = max_num_seqs: nothing admissible, so a decode batch runs
    plan = policy("vllm_fcfs", max_num_seqs=2).schedule(view(ws, ds))
    assert chunks(plan) == [] and decs(plan) == ["d1", "d2"]


def test_vllm_fcfs_decode_batch_when_nothing_waits():
    ds = [dec("d3", 0.3), dec("d1", 0.1), dec("d2", 0.2)]
    plan = policy("vllm_fcfs").schedule(view([], ds))
    assert decs(plan) == ["d1", "d2", "d3"] and chunks(plan) == []
    plan = policy("vllm_fcfs", max_num_seqs=2).schedule(view([], ds))
    assert decs(plan) == ["d1", "d2"]


def test_vllm_fcfs_partial_prefill_continues_first():
    early = wait("early", 0.0, 100)
    partial = wait("partial", 5.0, 100)
    partial.advance_prefill(32, 5.1)
    plan = policy("vllm_fcfs").schedule(view([early, partial]))
    assert chunks(plan) == [("partial", 68), ("early", 100)]


def test_vllm_fcfs_memory():
    w1, w2 = wait("w1", 0.0, 100), wait("w2", 0.1, 100)
    # 100 tokens = 7 blocks of 16; 10 free: w1 fits whole, w2 (7 more) does not
    plan = policy("vllm_fcfs").schedule(view([w1, w2], free_blocks=10))
    assert chunks(plan) == [("w1", 100)]
    # a prompt whose whole KV (300 tokens = 19 blocks) does not fit is not admitted, and
    # FCFS does not let w2 pass it (vLLM's scheduler_reserve_full_isl): the step decodes
    big = wait("big", 0.0, 300)
    plan = policy("vllm_fcfs").schedule(view([big, w2], [dec("d", 0.0)], free_blocks=10))
    assert chunks(plan) == [] and decs(plan) == ["d"]
    # once it holds KV (admitted earlier), it continues with what memory allows
    big.advance_prefill(16, 0.5)
    plan = policy("vllm_fcfs").schedule(view([big, w2], free_blocks=10))
    assert chunks(plan) == [("big", 160)]


def test_weighted_vtc_lets_another_class_finish_its_prefill_when_a_head_does_not_fit():
    """The class with the smaller counter has a head memory cannot take; the other class
    holds a partial prefill that must finish for memory to free up. Stopping the batch
    there (VTC's plain rule) left the plan empty, and the simulator then preempted the
    partial prefill, over and over (and the engine plugin, planning nothing, would
    have idled with the partial prefill's KV held)."""
    pol = policy("weighted_vtc")
    pol.counters = {"high": 0.0, "low": 100.0}
    pol._active = {"high", "low"}
    part = wait("part", 0.0, 176, prio="low")
    part.advance_prefill(16, 0.1)
    head = wait("head", 0.05, 400, prio="high")       # 25 blocks: does not fit in 12
    plan = pol.schedule(view([head, part], free_blocks=12))
    assert [r.id for r, _ in plan.prefill] == ["part"]


def test_new_requests_are_admitted_only_when_their_whole_prefill_fits():
    """The admission rule of every policy (BatchBuilder.admissible), the same in the
    simulator and the engine: a request without KV takes blocks only if its whole
    remaining prefill fits above the reserve; one holding KV may take any free block."""
    for name in registry.local_names():
        new = wait("new", 0.0, 300)                      # 19 blocks
        plan = policy(name).schedule(view([new], free_blocks=18))
        assert chunks(plan) == [], name
        plan = policy(name).schedule(InstanceView(0.0, [new], [], 20, 16, COLOCATED, reserve_blocks=2))
        assert chunks(plan) == [], name                  # 20 free but 2 reserved
        plan = policy(name).schedule(view([new], free_blocks=19))
        assert [r for r, _ in chunks(plan)] == ["new"], name


def test_vllm_fcfs_prefill_only_mode():
    ws = [wait("w1", 0.2, 100), wait("w2", 0.1, 100)]
    plan = policy("vllm_fcfs").schedule(view(ws, mode=PREFILL_ONLY))
    assert chunks(plan) == [("w2", 100), ("w1", 100)]
    assert policy("vllm_fcfs").schedule(view([], mode=PREFILL_ONLY)).empty


def test_vllm_fcfs_never_mixes_prefill_and_decode():
    rng = random.Random(1)
    pol = policy("vllm_fcfs", max_num_batched_tokens=2048, max_num_seqs=8)
    for _ in range(300):
        ws = [wait(f"w{i}", rng.uniform(0, 5), rng.randint(1, 3000)) for i in range(rng.randint(0, 6))]
        ds = [dec(f"d{i}", rng.uniform(0, 5)) for i in range(rng.randint(0, 10))]
        plan = pol.schedule(view(ws, ds, now=6.0, free_blocks=rng.choice([0, 3, 50, 1 << 20])))
        assert not (plan.prefill and plan.decode)
        if ws and plan.prefill:
            assert len(plan.prefill) + len(ds) <= 8


# ---------------------------------------------------------------- sarathi
def test_sarathi_fcfs_decodes_first_then_fcfs_chunks():
    d1, d2 = dec("d1", 0.0), dec("d2", 0.1)
    w1, w2 = wait("w1", 0.3, 50), wait("w2", 0.2, 100)
    plan = policy("sarathi_fcfs").schedule(view([w1, w2], [d2, d1]))
    # budget 90: d1, d2 (2 tokens), then FCFS: w2 (arrived 0.2) gets 88 of 100; w1 none
    assert decs(plan) == ["d1", "d2"]
    assert chunks(plan) == [("w2", 88)]
    assert plan.num_tokens == 90 and plan.info.token_budget == 90
    # budget 200: 2 + 100 (w2 whole) + 50 (w1 whole) = 152
    plan = policy("sarathi_fcfs", token_budget=200).schedule(view([w1, w2], [d1, d2]))
    assert chunks(plan) == [("w2", 100), ("w1", 50)] and plan.num_tokens == 152
    # prefill-only: the whole budget to chunks
    plan = policy("sarathi_fcfs").schedule(view([w1, w2], mode=PREFILL_ONLY))
    assert chunks(plan) == [("w2", 90)] and decs(plan) == []


def test_sarathi_priority_later_high_before_earlier_low():
    d1 = dec("d1", 0.0)
    low = wait("low", 0.0, 60, prio="low")
    high = wait("high", 1.0, 60, prio="high")
    plan = policy("sarathi_priority").schedule(view([low, high], [d1], now=1.0))
    # budget 90: d1 (1), high (60), low gets the remaining 29
    assert decs(plan) == ["d1"]
    assert chunks(plan) == [("high", 60), ("low", 29)]
    # Sarathi-FCFS on the same queue: low (earlier) first
    plan = policy("sarathi_fcfs").schedule(view([low, high], [d1], now=1.0))
    assert chunks(plan) == [("low", 60), ("high", 29)]


# ---------------------------------------------------------------- fairbatching
def _fairbatching_queue():
    # now = 10.0; next-token deadline = arrival + 1.0 + emitted·0.1
    d_near = dec("d_near", 8.95)          # deadline 10.05: within slack 0.1 -> first
    d_far = dec("d_far", 9.5)             # deadline 10.6:  far -> after the prefills
    w1 = wait("w1", 9.5, 200)             # first-token deadline 10.5
    w2 = wait("w2", 9.4, 30)              # first-token deadline 10.4
    return d_near, d_far, w1, w2


def test_fairbatching_near_decode_then_edf_prefills_then_far_decodes():
    d_near, d_far, w1, w2 = _fairbatching_queue()
    q = dict(waiting=[w1, w2], decoding=[d_far, d_near], now=10.0)
    # budget 90: d_near (1), w2 (30, deadline 10.4), w1 (59 of 200); d_far does not run
    plan = policy("fairbatching").schedule(view(**q))
    assert decs(plan) == ["d_near"]
    assert chunks(plan) == [("w2", 30), ("w1", 59)]
    assert plan.info.n_urgent == 1
    # budget 231 = 1 + 30 + 200: the far decode is still left out ...
    plan = policy("fairbatching", token_budget=231).schedule(view(**q))
    assert decs(plan) == ["d_near"] and chunks(plan) == [("w2", 30), ("w1", 200)]
    # ... and one more token lets it in, after the prefills
    plan = policy("fairbatching", token_budget=232).schedule(view(**q))
    assert decs(plan) == ["d_near", "d_far"] and plan.num_tokens == 232


def test_fairbatching_near_decodes_edf_and_slack_parameter():
    d_a = dec("d_a", 8.95)   # deadline 10.05
    d_b = dec("d_b", 8.92)   # deadline 10.02: earlier
    plan = policy("fairbatching", token_budget=1).schedule(view([], [d_a, d_b], now=10.0))
    assert decs(plan) == ["d_b"]
    # slack 0: no decode is "near" (both deadlines are in the future); prefill goes first
    _, _, w1, w2 = _fairbatching_queue()
    plan = policy("fairbatching", slack=0.0).schedule(view([w1, w2], [d_a, d_b], now=10.0))
    assert decs(plan) == [] and chunks(plan) == [("w2", 30), ("w1", 60)]


def test_fairbatching_prefill_only_is_edf_on_first_token_deadline():
    _, _, w1, w2 = _fairbatching_queue()
    plan = policy("fairbatching").schedule(view([w1, w2], now=10.0, mode=PREFILL_ONLY))
    assert chunks(plan) == [("w2", 30), ("w1", 60)]


# ---------------------------------------------------------------- edf / sjf
def _edf_queue():
    # now = 10.0; next-token deadline = arrival + 1.0 + emitted·0.1
    d1 = dec("d1", 9.0)                  # deadline 10.1,  exec 1 ms
    d2 = dec("d2", 8.0, emitted=10)      # deadline 10.0,  exec 1 ms
    w1 = wait("w1", 9.05, 80)            # deadline 10.05, exec 80 ms
    w2 = wait("w2", 9.5, 20)             # deadline 10.5,  exec 20 ms
    return [w1, w2], [d1, d2]


def test_edf_orders_prefills_and_decodes_together_by_deadline():
    ws, ds = _edf_queue()
    # EDF: d2 (10.0), w1 (10.05), d1 (10.1), w2 (10.5); budget 90: 1 + 80 + 1 + 8
    plan = policy("edf").schedule(view(ws, ds, now=10.0))
    assert decs(plan) == ["d2", "d1"] and chunks(plan) == [("w1", 80), ("w2", 8)]
    assert plan.num_tokens == 90 and plan.info.token_budget == 90
    # budget 81: d2 + w1 (80) fill it; d1, whose deadline is later than w1's, waits
    plan = policy("edf", token_budget=81).schedule(view(ws, ds, now=10.0))
    assert decs(plan) == ["d2"] and chunks(plan) == [("w1", 80)]


def test_sjf_orders_by_remaining_work_decodes_first():
    ws, ds = _edf_queue()
    # SJF: d2, d1 (1 ms each, d2 arrived first), w2 (20 ms), w1 (80 ms); budget 81: 1+1+20+59
    plan = policy("sjf", token_budget=81).schedule(view(ws, ds, now=10.0))
    assert decs(plan) == ["d2", "d1"] and chunks(plan) == [("w2", 20), ("w1", 59)]
    # prefill-only: w2 then w1
    plan = policy("sjf").schedule(view(ws, mode=PREFILL_ONLY, now=10.0))
    assert chunks(plan) == [("w2", 20), ("w1", 70)]


# ---------------------------------------------------------------- weighted_vtc
def test_weighted_vtc_hand_computed_two_steps():
    pol = policy("weighted_vtc")
    h1, h2 = wait("h1", 0.0, 60, prio="high"), wait("h2", 0.1, 60, prio="high")
    l1 = wait("l1", 0.05, 60, prio="low")
    # step 1, budget 90, counters high 0 = low 0 (tie -> earlier head h1):
    #   h1 60 tokens (scratch high 60/2 = 30); low 0 < 30 -> l1 gets the last 30 of its 60
    plan = pol.schedule(view([h1, h2, l1]))
    assert chunks(plan) == [("h1", 60), ("l1", 30)]
    h1.advance_prefill(60, 0.1)
    l1.advance_prefill(30, 0.1)
    pol.on_batch_done(plan, 0.1)
    assert pol.counters == {"high": 30.0, "low": 30.0}
    # step 2: decode h1 (1 token); counters tie 30/30 -> earlier head l1 (0.05 < 0.1):
    #   l1 its last 30 (scratch low 60); high 30 < 60 -> h2 gets 59 of 60
    plan = pol.schedule(view([h2, l1], [h1], now=0.1))
    assert decs(plan) == ["h1"] and chunks(plan) == [("l1", 30), ("h2", 59)]
    pol.on_batch_done(plan, 0.2)
    # high += (59·1 + 1·2) / 2 = 30.5 -> 60.5; low += 30·1 / 1 -> 60
    assert pol.counters == {"high": 60.5, "low": 60.0}


def test_weighted_vtc_counter_lift():
    pol = policy("weighted_vtc")
    h = wait("h", 0.0, 10_000, prio="high")
    # only "high" is active for 10 steps: 90 tokens / weight 2 = 45 per step
    for i in range(10):
        plan = pol.schedule(view([h], now=float(i)))
        h.advance_prefill(90, i + 0.1)
        pol.on_batch_done(plan, i + 0.1)
    assert pol.counters["high"] == pytest.approx(450.0)
    # "low" becomes active: lifted to the minimum counter of the active classes (450),
    # not left at 0 (which would let it monopolise the instance for 450 tokens)
    low = wait("l", 10.0, 1000, prio="low")
    plan = pol.schedule(view([h, low], now=10.0))
    assert pol.counters["low"] == pytest.approx(450.0)
    # tie 450/450 -> earlier head (h): h takes the whole budget
    assert chunks(plan) == [("h", 90)]
    # a lift never lowers a counter: low far ahead stays where it is
    pol2 = policy("weighted_vtc")
    pol2.counters["low"] = 800.0
    pol2.schedule(view([wait("h", 0, 100, prio="high")]))
    pol2.counters["high"] = 450.0
    pol2.schedule(view([wait("h", 0, 100, prio="high"), wait("l", 1, 100)], now=1.0))
    assert pol2.counters["low"] == 800.0
    # queue empty in between: lifted to the counter of the class that left last (VTC)
    pol3 = policy("weighted_vtc")
    pol3.schedule(view([wait("h", 0, 100, prio="high")]))
    pol3.counters["high"] = 300.0
    pol3.schedule(view([]))                       # high leaves, nobody active
    pol3.schedule(view([wait("l", 2, 100)], now=2.0))
    assert pol3.counters["low"] == 300.0


def _simulate(pol, waiting, decoding, steps, mode=COLOCATED):
    """Apply each plan as an engine would, then report it to the policy."""
    now = 0.0
    for _ in range(steps):
        plan = pol.schedule(view(waiting, decoding, now=now, mode=mode))
        assert not plan.empty
        now += plan.info.est_time
        for r, n in plan.prefill:
            if r.advance_prefill(n, now):
                waiting.remove(r)
                if not r.finished and mode == COLOCATED:
                    decoding.append(r)
        for r in plan.decode:
            r.emit(now)
            r.kv_len += 1
            if r.finished:
                decoding.remove(r)
        pol.on_batch_done(plan, now)
    return now


@pytest.mark.parametrize("mode", [COLOCATED, PREFILL_ONLY])
def test_weighted_vtc_serves_backlogged_classes_in_weight_ratio(mode):
    pol = policy("weighted_vtc")
    waiting = []
    for i in range(400):
        waiting.append(wait(f"h{i}", i * 1e-3, 64, prio="high", out=4))
        waiting.append(wait(f"l{i}", i * 1e-3 + 5e-4, 64, prio="low", out=4))
    served = {"high": 0.0, "low": 0.0}
    orig = pol.on_batch_done

    def count(plan, now):
        for r, n in plan.prefill:
            served[r.priority] += 1.0 * n        # w_in = 1
        for r in plan.decode:
            served[r.priority] += 2.0            # w_out = 2
        orig(plan, now)

    pol.on_batch_done = count
    _simulate(pol, waiting, [], steps=400, mode=mode)
    # both classes still backlogged at the end
    assert {r.priority for r in waiting} == {"high", "low"}
    assert served["high"] / served["low"] == pytest.approx(2.0, rel=0.03)
    # the counters (service / weight) stay within one batch's worth of each other
    assert abs(pol.counters["high"] - pol.counters["low"]) < 90 * 2


# ---------------------------------------------------------------- common contracts
@pytest.mark.parametrize("name", ALL_POLICIES)
def test_memory_limits_respected(name):
    w = wait("w", 0.0, 500)
    # a new prompt of 32 blocks is not admitted into 2 free blocks (its whole prefill must fit)
    assert chunks(policy(name).schedule(view([w], mode=PREFILL_ONLY, free_blocks=2))) == []
    w.advance_prefill(16, 0.1)                  # admitted earlier: holds one block
    big = policy(name).schedule(view([w], mode=PREFILL_ONLY))
    small = policy(name).schedule(view([w], mode=PREFILL_ONLY, free_blocks=2))
    # 2 free blocks of 16 tokens hold 32 more tokens of the prompt
    assert chunks(small) == [("w", 32)]
    assert big.num_tokens > small.num_tokens
    # decodes at a block boundary need a new block: with 0 free blocks they cannot run
    d_full = dec("d_full", 0.0, prompt=32)      # kv 32: next token needs block 3
    d_room = dec("d_room", 0.0, prompt=20)      # kv 20: room left in block 2
    plan = policy(name).schedule(view([], [d_full, d_room], free_blocks=0))
    assert "d_full" not in decs(plan)


@pytest.mark.parametrize("name", ALL_POLICIES)
@pytest.mark.parametrize("mode", [COLOCATED, PREFILL_ONLY])
def test_random_views_keep_the_plan_contract(name, mode):
    rng = random.Random(f"{name}-{mode}")
    pol = policy(name)
    budget = pol.tbt_token_budget()
    for _ in range(150):
        now = 10.0
        ws = [wait(f"w{i}", rng.uniform(8, 10), rng.randint(1, 800), prio=rng.choice(["high", "low"]))
              for i in range(rng.randint(0, 6))]
        for r in ws:
            if rng.random() < 0.3 and r.prompt_len > 1:
                r.advance_prefill(rng.randint(1, r.prompt_len - 1), 9.9)
        ds = [dec(f"d{i}", rng.uniform(8, 10), emitted=rng.randint(1, 5), prompt=rng.randint(1, 100))
              for i in range(rng.randint(0, 8))]
        free = rng.choice([0, 1, 4, 40, 1 << 20])
        v = view(ws, ds, now=now, mode=mode, free_blocks=free)
        plan = pol.schedule(v)
        if mode == PREFILL_ONLY:
            assert plan.decode == []
        ids = [r.id for r, _ in plan.prefill] + decs(plan)
        assert len(ids) == len(set(ids))
        for r, n in plan.prefill:
            assert r in ws and 1 <= n <= r.remaining_prefill
        assert all(r in ds for r in plan.decode)
        used = sum(blocks_for(r, n, 16) for r, n in plan.prefill) + sum(blocks_for(r, 1, 16) for r in plan.decode)
        assert used <= free
        if name in TOKEN_BUDGET_POLICIES:
            assert plan.info.token_budget == budget
            assert plan.num_tokens <= max(budget, len(plan.decode))
        if (ws or (ds and mode == COLOCATED)) and free >= 1 << 20:
            assert not plan.empty


@pytest.mark.parametrize("name, params, bad", [
    ("vllm_fcfs", {"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ("vllm_fcfs", {"max_num_seqs": 2.5}, "max_num_seqs"),
    ("sarathi_fcfs", {"token_budget": -5}, "token_budget"),
    ("sarathi_priority", {"token_budget": 0}, "token_budget"),
    ("fairbatching", {"slack": -1.0}, "slack"),
    ("fairbatching", {"token_budget": "90"}, "token_budget"),
    ("weighted_vtc", {"w_in": -1.0}, "w_in"),
    ("weighted_vtc", {"w_out": float("nan")}, "w_out"),
    ("weighted_vtc", {"token_budget": True}, "token_budget"),
    ("edf", {"token_budget": 1.5}, "token_budget"),
    ("sjf", {"token_budget": 0}, "token_budget"),
    ("slide_batching", {"gamma": 0.0}, "gamma"),
    ("slide_batching", {"eta": -0.1}, "eta"),
    ("slide_batching", {"phi": "x"}, "phi"),
    ("slide_batching", {"headroom": 1.0}, "headroom"),
    ("slide_batching", {"headroom": -0.1}, "headroom"),
    ("slide_batching", {"age_limit": 0.0}, "age_limit"),
    ("slide_batching", {"pace": "mean"}, "pace"),
    ("slide_batching", {"budget_cap": 0.0}, "budget_cap"),
    ("slide_batching", {"skip_late_prompts": "yes"}, "skip_late_prompts"),
    ("slide_batching", {"catch_up": -1.0}, "catch_up"),
    ("slide_batching", {"catch_up": "soon"}, "catch_up"),
    ("slide_batching", {"stretch": "yes", "pace": "first_token"}, "stretch"),
    ("slide_batching", {"stretch": True}, "stretch"),                 # inert without pace=first_token
    ("slide_batching", {"decode_first": "yes"}, "decode_first"),
    ("slide_batching", {"decode_first": 1}, "decode_first"),
    ("slide_batching", {"age_share": 0.0}, "age_share"),
    ("slide_batching", {"age_share": 1.5}, "age_share"),
    ("wo_latency_aware", {"token_budget": 0}, "token_budget"),
    ("sarathi_fcfs", {"chunk": 3}, "chunk"),
])
def test_invalid_parameters_raise_config_error(name, params, bad):
    with pytest.raises(ConfigError, match=bad):
        policy(name, **params)


# ---------------------------------------------------------------- slide_batching (Alg. 1)
# Shared hand-computed queue at now = 0 (deadline of the next token = arrival + 1.0 + emitted·0.1):
#   d1: decoding, arrival -0.95, 1 token out -> remain 0.15, exec 1 ms, density 1·1/0.001 = 1000
#   w1: waiting,  arrival -0.7, prompt 100   -> remain 0.30, exec 0.1 s, density 1/0.1 = 10
#   w2: waiting,  arrival -0.5, prompt 200   -> remain 0.50, exec 0.2 s, density 1/0.2 = 5
# t_budget = max(min remain 0.15, η 0.1) = 0.15; t_budget/(t_budget - t_c) = 0.15/0.14
#   φ_a       = 0.15/0.14 · (0.001 + 0.1 + 0.2)       = 0.3225
#   φ_c(d1)   = 0.15/0.14 · 0.001                     = 0.0010714
#   φ_c(w1)   = 0.15/0.14 · 0.101                     = 0.1082143
#   φ_c(w2)   = 0.15/0.14 · 0.301                     = 0.3225
#   φ_p (prefill-only, Q = {w1, w2}) = 0.1 + 0.2 + 2·0.01 = 0.32
def _alg1_queue():
    return dec("d1", -0.95), wait("w1", -0.7, 100), wait("w2", -0.5, 200)


def _urgent_at(gamma, phi, mode=COLOCATED):
    d1, w1, w2 = _alg1_queue()
    pol = policy("slide_batching", gamma=gamma, phi=phi)
    plan = pol.schedule(view([w2, w1], [d1] if mode == COLOCATED else [], mode=mode))
    return plan, urgent(plan)


def test_slide_t_budget_is_max_of_min_remain_and_eta():
    d1, w1, w2 = _alg1_queue()
    assert policy("slide_batching").schedule(view([w1, w2], [d1])).info.t_budget == pytest.approx(0.15)
    assert policy("slide_batching", eta=0.2).schedule(view([w1, w2], [d1])).info.t_budget == pytest.approx(0.2)
    # every deadline already passed: min remain < 0, so η
    late = wait("late", -5.0, 10)
    assert policy("slide_batching").schedule(view([late])).info.t_budget == pytest.approx(0.1)


def test_slide_phi_a_boundary():
    phi_a = 0.15 / 0.14 * 0.301
    # γ·φ_a just below w1's remain 0.3: w1 NORMAL; just above: URGENT (d1 always, w2 never)
    _, u = _urgent_at(0.3 / phi_a * (1 - 1e-6), "a")
    assert u == {"d1": True, "w1": False, "w2": False}
    _, u = _urgent_at(0.3 / phi_a * (1 + 1e-6), "a")
    assert u == {"d1": True, "w1": True, "w2": False}
    _, u = _urgent_at(0.5 / phi_a * (1 + 1e-6), "a")
    assert u == {"d1": True, "w1": True, "w2": True}


def test_slide_phi_c_boundary():
    s = 0.15 / 0.14
    _, u = _urgent_at(0.3 / (s * 0.101) * (1 - 1e-6), "c")
    # γ ≈ 2.77: w1 at its boundary (NORMAL), w2: 0.5 < 2.77·0.3225 URGENT, d1: 0.15 > 2.77·0.00107
    assert u == {"d1": False, "w1": False, "w2": True}
    _, u = _urgent_at(0.3 / (s * 0.101) * (1 + 1e-6), "c")
    assert u == {"d1": False, "w1": True, "w2": True}
    # γ = 1: nobody is late by its own position in the remain-ordered queue
    _, u = _urgent_at(1.0, "c")
    assert u == {"d1": False, "w1": False, "w2": False}
    # d1's boundary: 0.15 / (s·0.001) = 140
    _, u = _urgent_at(140 * (1 + 1e-6), "c")
    assert u["d1"] is True


def test_slide_phi_p_boundary_and_auto():
    phi_p = 0.32
    _, u = _urgent_at(0.3 / phi_p * (1 - 1e-6), "p", mode=PREFILL_ONLY)
    assert u == {"w1": False, "w2": False}
    _, u = _urgent_at(0.3 / phi_p * (1 + 1e-6), "p", mode=PREFILL_ONLY)
    assert u == {"w1": True, "w2": False}
    # phi="auto" uses φ_p on a prefill-only instance (γ = 1: 0.3 < 0.32, 0.5 > 0.32) ...
    _, u = _urgent_at(1.0, "auto", mode=PREFILL_ONLY)
    assert u == {"w1": True, "w2": False}
    # ... and φ_a co-located (γ = 1: 0.15, 0.3 < 0.3225 < 0.5)
    _, u = _urgent_at(1.0, "auto")
    assert u == {"d1": True, "w1": True, "w2": False}


def test_slide_low_load_all_normal_earliest_deadline_first():
    # now = 0; d: remain 0.2 (arrival -0.9), exec 1 ms;
    # wa: remain 0.5, prompt 40 (40 ms); wb: remain 0.7, prompt 39 (39 ms)
    # t_budget = 0.2; φ_a = 0.2/0.19 · 0.08 = 0.0842 < every remain: all NORMAL, EDF order.
    d = dec("d", -0.9)
    wa, wb = wait("wa", -0.5, 40), wait("wb", -0.3, 39)
    plan = policy("slide_batching").schedule(view([wb, wa], [d]))
    assert urgent(plan) == {"d": False, "wa": False, "wb": False}
    assert (plan.info.n_urgent, plan.info.n_normal) == (0, 3)
    assert decs(plan) == ["d"] and chunks(plan) == [("wa", 40), ("wb", 39)]
    # the order decides who gets scarce memory: 3 free blocks (48 tokens) go to wa
    plan = policy("slide_batching").schedule(view([wb, wa], [d], free_blocks=3))
    assert chunks(plan) == [("wa", 40)]
    # prefill-only: φ_p = 0.079 + 2·0.01 = 0.099 < 0.5: all NORMAL too
    plan = policy("slide_batching").schedule(view([wb, wa], mode=PREFILL_ONLY))
    assert urgent(plan) == {"wa": False, "wb": False} and chunks(plan) == [("wa", 40), ("wb", 39)]


def test_slide_medium_load_urgent_first_then_normal_by_remain():
    # the shared queue with the decode's remain 0.1505 (arrival -0.9495):
    # t_budget 0.1505, φ_a = 0.1505/0.1405 · 0.301 = 0.3224: d1, w1 URGENT, w2 NORMAL.
    # Order: URGENT by density (d1 1000, w1 10), then w2. Fill from t_c = 0.01:
    # d1 -> 0.011, w1 (100 tokens) -> 0.111, w2: (0.1505 - 0.111)/1 ms = 39.5 -> 39 tokens.
    d1, w1, w2 = dec("d1", -0.9495), wait("w1", -0.7, 100), wait("w2", -0.5, 200)
    plan = policy("slide_batching").schedule(view([w2, w1], [d1]))
    assert urgent(plan) == {"d1": True, "w1": True, "w2": False}
    assert (plan.info.n_urgent, plan.info.n_normal) == (2, 1)
    assert decs(plan) == ["d1"] and chunks(plan) == [("w1", 100), ("w2", 39)]
    assert plan.info.est_time <= plan.info.t_budget


def _high_load_queue():
    # prefill-only, now = 0:
    #   lo1: arrival -0.4995, prompt 500 -> remain 0.5005, exec 0.5, density 1/0.5 = 2
    #   lo2: arrival -0.4,    prompt 500 -> remain 0.6,    exec 0.5, density 2
    #   hi:  arrival  0,      prompt 50, high -> remain 1.0, exec 0.05, density 2/0.05 = 40
    # φ_p = 1.05 + 3·0.01 = 1.08 > every remain: all URGENT; t_budget = 0.5005
    return wait("lo1", -0.4995, 500), wait("lo2", -0.4, 500), wait("hi", 0.0, 50, prio="high")


def test_slide_high_load_urgent_by_density():
    lo1, lo2, hi = _high_load_queue()
    plan = policy("slide_batching").schedule(view([lo1, lo2, hi], mode=PREFILL_ONLY))
    assert urgent(plan) == {"lo1": True, "lo2": True, "hi": True}
    # hi (density 40) first: 0.01 + 0.05 = 0.06; lo1: (0.5005 - 0.06)/1 ms = 440.5 -> 440
    assert chunks(plan) == [("hi", 50), ("lo1", 440)]
    assert plan.info.t_budget == pytest.approx(0.5005)
    # co-located with φ_a: the same ordering (φ_a = 0.5005/0.4905 · 1.05 = 1.071 > remains)
    lo1, lo2, hi = _high_load_queue()
    plan = policy("slide_batching").schedule(view([lo1, lo2, hi]))
    assert chunks(plan) == [("hi", 50), ("lo1", 440)]


def test_slide_headroom_lowers_the_budget_and_its_floor():
    # the shared queue: min remain 0.15, η 0.1. headroom h = 0.2 plans each step h·η = 0.02 s
    # before the tightest deadline: max(0.15 - 0.02, 0.8·0.1) = 0.13
    d1, w1, w2 = _alg1_queue()
    plan = policy("slide_batching", headroom=0.2).schedule(view([w1, w2], [d1]))
    assert plan.info.t_budget == pytest.approx(0.13)
    assert plan.info.est_time <= 0.13 + 1e-12
    # every deadline passed: the floor drops to (1 - h)·η = 0.08
    late = wait("late", -5.0, 10)
    assert policy("slide_batching", headroom=0.2).schedule(view([late])).info.t_budget == pytest.approx(0.08)
    # h = 0 is Algorithm 1 as written
    assert policy("slide_batching", headroom=0.0).schedule(view([w1, w2], [d1])).info.t_budget == pytest.approx(0.15)


def test_slide_pace_first_token_bounds_the_budget_by_the_running_mean_tpot():
    # d: arrived at 0, first token at 0.01 (its TTFT deadline was 1.0), 3 tokens by now = 0.2.
    # Eq. 3: token 4 is due at 0 + TTFT + 3·TPOT = 1.3 -> remain 1.1; anchored at the first
    # token (footnote 2): 0.01 + 3·0.1 = 0.31 -> remain 0.11. The waiting prompt: remain 0.8.
    d = dec("d", 0.0, emitted=3)
    w = wait("w", 0.0, 400)
    assert d.token_times[0] == pytest.approx(0.01) and len(d.token_times) == 3
    eq3 = policy("slide_batching", headroom=0.2).schedule(view([w], [d], now=0.2))
    assert eq3.info.t_budget == pytest.approx(0.8 - 0.02)          # the prompt's deadline bounds it
    paced = policy("slide_batching", headroom=0.2, pace="first_token").schedule(view([w], [d], now=0.2))
    assert paced.info.t_budget == pytest.approx(0.11 - 0.02)
    assert paced.info.est_time <= 0.09 + 1e-12
    # Eq. 3: the whole prompt (0.4 s) rides in this 0.42 s step, stalling d's stream.
    # Paced: d (remain 0.11) goes before w (0.8) and w gets what is left:
    # (0.09 - t_c 0.01 - d's 0.001) / 1 ms = 79 tokens
    assert chunks(eq3) == [("w", 400)] and decs(eq3) == ["d"]
    assert decs(paced) == ["d"] and chunks(paced) == [("w", 79)]
    assert urgent(paced) == urgent(eq3)                            # URGENT marking keeps Eq. 3
    # a decode behind its pace floors the budget at (1 - h)·η, as a passed deadline does
    late = policy("slide_batching", headroom=0.2, pace="first_token").schedule(view([w], [d], now=0.5))
    assert late.info.t_budget == pytest.approx(0.08)


#: a model with context-dependent costs (a_d > 0), as a profiled one
PROFILED_LIKE = LatencyModel(a_p=1e-7, b_p=3e-8, c_p=4.54e-4, a_d=3e-7, b_d=4.1e-4, t_c=8.9e-3)


def _random_queue(rng, arrivals, prompts, decode_arrivals, decodes):
    """0-4 waiting prompts (1..``prompts`` tokens, either class) and 1..``decodes`` decodes
    (1-12 tokens emitted), arrivals drawn uniformly from the given (lo, hi)."""
    ws = [wait(f"w{i}", rng.uniform(*arrivals), rng.randint(1, prompts), prio=rng.choice(["high", "low"]))
          for i in range(rng.randint(0, 4))]
    ds = [dec(f"d{i}", rng.uniform(*decode_arrivals), emitted=rng.randint(1, 12), prompt=rng.randint(1, 900))
          for i in range(rng.randint(1, decodes))]
    return ws, ds


def test_slide_stretch_yields_first_token_pacing_to_a_prompt_at_risk():
    # the queue of the test above: d's next token is due at 0.31 by its running mean (remain
    # 0.11), at 1.3 by Eq. 3 (remain 1.1); paced budget 0.11 - 0.02 = 0.09, of which t_c and d
    # take 0.011. w (400 tokens, exec 0.4) due at 1.0 (remain 0.8) ends in time at 0.09-s steps
    # (0.4·0.09/0.079 = 0.456 <= 0.78): no stretch
    d, w = dec("d", 0.0, emitted=3), wait("w", 0.0, 400)
    paced = {"headroom": 0.2, "pace": "first_token"}
    calm = policy("slide_batching", stretch=True, **paced).schedule(view([w], [d], now=0.2))
    assert calm.info.t_budget == pytest.approx(0.09)
    # w arrived at -0.35 instead (due at 0.65, remain 0.45; exec + t_c 0.41 fits one step, so
    # not late): at 0.09-s steps it needs 0.456 > 0.43, at risk. Paced, w (URGENT) takes the
    # short step whole and d waits anyway. Stretched: lines 6-7 over the Eq. 3 remains, w's own
    # bounding it (0.45 - 0.02): all of w in this step, d in it too
    w = wait("w", -0.35, 400)
    as_paced = policy("slide_batching", **paced).schedule(view([w], [d], now=0.2))
    assert as_paced.info.t_budget == pytest.approx(0.09)
    assert chunks(as_paced) == [("w", 80)] and decs(as_paced) == [] and urgent(as_paced)["w"]
    stretched = policy("slide_batching", stretch=True, **paced).schedule(view([w], [d], now=0.2))
    assert stretched.info.t_budget == pytest.approx(0.43)
    assert chunks(stretched) == [("w", 400)] and decs(stretched) == ["d"]
    # the cap holds: at 2·η the step is 0.2 s
    capped = policy("slide_batching", stretch=True, budget_cap=2.0, **paced).schedule(view([w], [d], now=0.2))
    assert capped.info.t_budget == pytest.approx(0.2)
    # a late prompt (p: 500 tokens due at 0.4, remain 0.2 < exec) is at risk too, and skipped
    # as a bound: d's Eq. 3 remain bounds the step (1.1 - 0.02), the cap 4·η before it
    p = wait("p", -0.6, 500)
    late = policy("slide_batching", stretch=True, budget_cap=4.0, **paced).schedule(view([p], [d], now=0.2))
    assert late.info.t_budget == pytest.approx(0.4)
    assert policy("slide_batching", stretch=True, **paced).schedule(
        view([p], [d], now=0.2)).info.t_budget == pytest.approx(1.08)
    # a decode past its Eq. 3 deadline (now 1.5: token 4 was due at 1.3) keeps the floor
    assert policy("slide_batching", stretch=True, budget_cap=4.0, **paced).schedule(
        view([p], [d], now=1.5)).info.t_budget == pytest.approx(0.08)


def test_slide_stretch_random_views():
    # stretch only lengthens the budget, and only as far as no decode's Eq. 3 deadline (less
    # the headroom) and the cap allow
    rng = random.Random(13)
    base = {**ALG1, "decode_first": "all", "pace": "first_token", "skip_late_prompts": True,
            "budget_cap": 4.0, "headroom": 0.1, "phi": "c", "catch_up": 1.0}
    with_rule = make_local("slide_batching", Estimator(PROFILED_LIKE), **base, stretch=True)
    without = make_local("slide_batching", Estimator(PROFILED_LIKE), **base)
    eta, h, stretched = with_rule.eta, 0.1, 0
    for _ in range(1000):
        now = 10.0
        ws, ds = _random_queue(rng, arrivals=(9, 10), prompts=900, decode_arrivals=(8.5, 9.9), decodes=6)
        for d in ds:       # first tokens at 8.6-10: some streams ahead of their running-mean pace
            d.token_times[:] = [min(now, d.arrival + 0.1 + 0.02 * k) for k in range(len(d.token_times))]
        v = view(ws, ds, now=now)
        plan, ref = with_rule.schedule(v), without.schedule(v)
        assert plan.info.t_budget >= ref.info.t_budget - 1e-12
        assert not plan.empty
        if plan.info.t_budget > ref.info.t_budget + 1e-12:
            stretched += 1
            eq3 = min(with_rule.gain.next_token_deadline(d) - now for d in ds)
            assert plan.info.t_budget <= max(min(eq3 - h * eta, 4.0 * eta), (1 - h) * eta) + 1e-12
            assert sorted(decs(plan)) == sorted(d.id for d in ds)
    assert stretched > 50                                           # the rule did act


def test_slide_budget_cap_bounds_the_budget_in_multiples_of_eta():
    # the same queue as above under Eq. 3: budget 0.78; a cap of 2·η = 0.2 bounds it, and the
    # floor (1 - h)·η still holds under a cap below it
    d, w = dec("d", 0.0, emitted=3), wait("w", 0.0, 400)
    capped = policy("slide_batching", headroom=0.2, budget_cap=2.0).schedule(view([w], [d], now=0.2))
    assert capped.info.t_budget == pytest.approx(0.2) and capped.info.est_time <= 0.2 + 1e-12
    tiny = policy("slide_batching", headroom=0.2, budget_cap=0.5).schedule(view([w], [d], now=0.2))
    assert tiny.info.t_budget == pytest.approx(0.08)
    assert policy("slide_batching", headroom=0.2, budget_cap=None).schedule(
        view([w], [d], now=0.2)).info.t_budget == pytest.approx(0.78)


def test_slide_decode_first_puts_normal_decodes_before_normal_prefills():
    # d: a decode with slack (Eq. 3 remain 1.1 at now 0.2); p: a prompt of 300 tokens due at 0.8;
    # budget capped at 1.0·η = 0.1 s (headroom 0): Algorithm 1 orders p (0.8) before d (1.1) and
    # p takes the whole budget, (0.1 - t_c) / 1 ms = 90 tokens, leaving d out of this step
    d, p = dec("d", 0.0, emitted=3), wait("p", 0.0, 300)
    alg1 = policy("slide_batching", budget_cap=1.0).schedule(view([p], [d], now=0.2))
    assert urgent(alg1) == {"p": False, "d": False}
    assert chunks(alg1) == [("p", 90)] and decs(alg1) == []
    # decode_first: d first (1 ms), p gets the 89 left
    first = policy("slide_batching", budget_cap=1.0, decode_first=True).schedule(view([p], [d], now=0.2))
    assert decs(first) == ["d"] and chunks(first) == [("p", 89)]


def test_slide_decode_first_all_puts_every_decode_before_urgent_prefills():
    # d: a decode with slack (Eq. 3 remain 1.1 at now 0.2); p: a 500-token prompt that arrived at
    # -0.4, due at 0.6 (remain 0.4). Budget capped at η = 0.1 (headroom 0). φ_a (Eq. 8) =
    # 0.1/0.09 · (0.5 + 0.001) = 0.557: p (0.4) is URGENT, d (1.1) NORMAL
    d, p = dec("d", 0.0, emitted=3), wait("p", -0.4, 500)
    mark = policy("slide_batching", budget_cap=1.0, decode_first=True).schedule(view([p], [d], now=0.2))
    assert urgent(mark) == {"p": True, "d": False}
    # decode_first=True reorders NORMAL requests only: the URGENT prompt takes the whole budget,
    # (0.1 - t_c) / 1 ms = 90 tokens, and d is left out of the step
    assert chunks(mark) == [("p", 90)] and decs(mark) == []
    # "all": every decode first (1 ms), the URGENT prompt gets the 89 tokens left
    every = policy("slide_batching", budget_cap=1.0, decode_first="all").schedule(view([p], [d], now=0.2))
    assert decs(every) == ["d"] and chunks(every) == [("p", 89)]
    assert urgent(every) == urgent(mark)                           # the marking is unchanged


def test_slide_skip_late_prompts_lets_a_prompt_past_hope_take_long_steps():
    # now 0.2: p, a 500-token prompt that arrived at -0.6 (first-token deadline 0.4, remain 0.2;
    # exec 0.5 + t_c 0.01 > 0.2: late whatever the step); d, a decode with Eq. 3 remain 1.1
    p, d = wait("p", -0.6, 500), dec("d", 0.0, emitted=3)
    as_written = policy("slide_batching", budget_cap=4.0).schedule(view([p], [d], now=0.2))
    assert as_written.info.t_budget == pytest.approx(0.2)           # line 6: p's own remain
    assert chunks(as_written) == [("p", 190)] and decs(as_written) == []
    # skipped: d's remain (1.1) bounds it, then the cap 4·η = 0.4; p (URGENT) takes 0.39 s
    skip = policy("slide_batching", budget_cap=4.0, skip_late_prompts=True).schedule(view([p], [d], now=0.2))
    assert skip.info.t_budget == pytest.approx(0.4)
    assert chunks(skip) == [("p", 390)] and urgent(skip) == urgent(as_written) == {"p": True, "d": False}
    # a prompt that can still make its deadline bounds it: q, 50 tokens due at 1.0 (remain 0.8)
    q = wait("q", 0.0, 50)
    both = policy("slide_batching", budget_cap=10.0, skip_late_prompts=True).schedule(view([p, q], [d], now=0.2))
    assert both.info.t_budget == pytest.approx(0.8)
    # only late prompts queued: the cap, or without a cap line 6 as written
    alone = {"skip_late_prompts": True}
    assert policy("slide_batching", budget_cap=4.0, **alone).schedule(
        view([p], now=0.2)).info.t_budget == pytest.approx(0.4)
    assert policy("slide_batching", **alone).schedule(view([p], now=0.2)).info.t_budget == pytest.approx(0.2)
    # a late decode still bounds it: d at now 1.5 is 0.2 past its deadline -> the floor η
    assert policy("slide_batching", budget_cap=4.0, **alone).schedule(
        view([], [d], now=1.5)).info.t_budget == pytest.approx(0.1)


def test_slide_catch_up_shortens_steps_while_a_decode_is_late():
    # now 1.5: d has emitted 3 tokens, its 4th is due at 0 + 1.0 + 3·0.1 = 1.3 (Eq. 3): late by
    # 0.2 s; q, a 100-token prompt due at 2.4 (remain 0.9, exec 0.1)
    d, q = dec("d", 0.0, emitted=3), wait("q", 1.4, 100)
    as_written = policy("slide_batching").schedule(view([q], [d], now=1.5))
    assert as_written.info.t_budget == pytest.approx(0.1)           # line 7: d pins the floor η
    assert decs(as_written) == ["d"] and chunks(as_written) == [("q", 89)]
    # catch_up: the least B with which q still ends by its deadline at steps of B, each paying
    # t_c + d's decode (11 ms): (t_c + D)·R/(R − E) = 0.011 · 0.9 / 0.8; d's next tokens come
    # every ~12 ms and win back 88 ms each, while q keeps 1 token a step
    fast = policy("slide_batching", catch_up=0.0).schedule(view([q], [d], now=1.5))
    assert fast.info.t_budget == pytest.approx(0.011 * 0.9 / 0.8)
    assert decs(fast) == ["d"] and chunks(fast) == [("q", 1)]
    # no late decode: Algorithm 1's budget (d at 1.25 is 0.05 ahead of its deadline) ...
    on_time = policy("slide_batching", catch_up=0.0).schedule(view([q], [d], now=1.25))
    assert on_time.info.t_budget == pytest.approx(
        policy("slide_batching").schedule(view([q], [d], now=1.25)).info.t_budget)
    # ... unless the margin asks for more: catch_up=1 counts a decode late until it is a whole
    # η (a token) ahead of its deadline
    ahead = policy("slide_batching", catch_up=1.0).schedule(view([q], [d], now=1.25))
    q_rem = 2.4 - 1.25
    assert ahead.info.t_budget == pytest.approx(0.011 * q_rem / (q_rem - 0.1))
    # a late prompt queued (p: 500 tokens due at 1.6, remain 0.1): off, Algorithm 1 decides
    p = wait("p", 0.6, 500)
    assert policy("slide_batching", catch_up=0.0).schedule(view([p, q], [d], now=1.5)).info.t_budget \
        == pytest.approx(policy("slide_batching").schedule(view([p, q], [d], now=1.5)).info.t_budget)
    # decodes alone: a decode-only step
    alone = policy("slide_batching", catch_up=0.0).schedule(view([], [d], now=1.5))
    assert alone.info.t_budget == pytest.approx(0.011) and decs(alone) == ["d"]


@pytest.mark.parametrize("params", [
    {"catch_up": 0.0}, {"catch_up": 1.0, "decode_first": "all"},
    {"catch_up": 1.0, "decode_first": "all", "pace": "first_token", "skip_late_prompts": True,
     "budget_cap": 4.0, "headroom": 0.1, "phi": "c"},
])
def test_slide_catch_up_random_views(params):
    # what catch_up may change is the budget, only downwards, and never below the running
    # decodes: with memory to spare every decode of the view is in the step. A model with
    # context-dependent decode costs (a_d > 0), as a profiled one: a step sized to hold exactly
    # the decodes once left the last one out, by float rounding
    rng = random.Random(repr(params))
    slide = lambda **p: make_local("slide_batching", Estimator(PROFILED_LIKE), **{**ALG1, **p})
    with_rule, without = slide(**params), slide(**{k: v for k, v in params.items() if k != "catch_up"})
    for _ in range(1000):
        ws, ds = _random_queue(rng, arrivals=(8.5, 10), prompts=400, decode_arrivals=(8, 10), decodes=9)
        v = view(ws, ds, now=10.0)
        plan, base = with_rule.schedule(v), without.schedule(v)
        assert plan.info.t_budget <= base.info.t_budget + 1e-12
        assert not plan.empty
        if params.get("decode_first") == "all":
            assert sorted(decs(plan)) == sorted(d.id for d in ds)


def _starving_queue():
    # prefill-only, now = 0, η = 0.1:
    #   old: low, arrival -3 (waited 3 s = 3·TTFT_SLO), prompt 500 -> remain -2, exec 0.5, density 2
    #   hi2: high, arrival -0.5, prompt 300 -> remain 0.5, exec 0.3, density 6.67
    #   hi1: high, arrival 0, prompt 50 -> remain 1.0
    # t_budget = max(-2, 0.1) = 0.1; φ_p = 0.85 + 3·0.01 = 0.88: old and hi2 URGENT, hi1 NORMAL
    return wait("old", -3.0, 500), wait("hi2", -0.5, 300, prio="high"), wait("hi1", 0.0, 50, prio="high")


def test_slide_without_aging_a_low_density_request_gets_nothing():
    old, hi2, hi1 = _starving_queue()
    plan = policy("slide_batching").schedule(view([old, hi2, hi1], mode=PREFILL_ONLY))
    assert urgent(plan) == {"old": True, "hi2": True, "hi1": False}
    # hi2 (density 6.67) takes the whole 0.1 s budget: (0.1 - 0.01)/1 ms = 90 tokens
    assert chunks(plan) == [("hi2", 90)]


def test_slide_aged_request_runs_first_within_its_share():
    old, hi2, hi1 = _starving_queue()
    # age_limit 2: old has waited 3 s >= 2·TTFT_SLO: AGED; its work 0.5 s is 0.59 of the
    # queue's 0.85 s, within ρ = 0.6. It runs first within 0.6 of the budget beyond t_c:
    # 0.01 + 0.6·0.09 = 0.064 -> 54 tokens; Algorithm 1's order fills the rest: hi2 (0.1 - 0.064)/1 ms = 36
    plan = policy("slide_batching", age_limit=2.0, age_share=0.6).schedule(
        view([old, hi2, hi1], mode=PREFILL_ONLY))
    got = dict(chunks(plan))
    assert next(iter(got)) == "old" and got["old"] == pytest.approx(54, abs=1)
    assert got["hi2"] == pytest.approx(36, abs=1) and "hi1" not in got
    assert plan.info.est_time <= plan.info.t_budget + 1e-12
    # not aged yet at age_limit 4 (3 s < 4 s): the plan of Algorithm 1
    plan = policy("slide_batching", age_limit=4.0, age_share=0.6).schedule(view([old, hi2, hi1], mode=PREFILL_ONLY))
    assert chunks(plan) == [("hi2", 90)]


def test_slide_aging_stands_aside_past_saturation():
    # ρ = 0.5: the aged work (0.5 s of 0.85 s queued) is more than half of the queue: the
    # instance is past saturation as aging judges it, and Algorithm 1 alone decides
    old, hi2, hi1 = _starving_queue()
    plan = policy("slide_batching", age_limit=2.0, age_share=0.5).schedule(view([old, hi2, hi1], mode=PREFILL_ONLY))
    assert chunks(plan) == [("hi2", 90)]


def test_slide_aged_chunk_grows_into_budget_nobody_else_can_use():
    # aged b (prompt 300, 0.3 s of work) and new n (prompt 400, not aged); 20 free blocks of 16:
    # b's whole prompt fits (19 blocks), n's does not (25), so n is not admitted.
    # Pass 1: b gets 0.5 of the 0.09 s beyond t_c = 45 tokens; pass 2: n cannot take blocks;
    # the 0.045 s left grows b's chunk in place to 90 tokens.
    b = wait("b", -3.0, 300)
    n = wait("n", 0.0, 400)
    plan = policy("slide_batching", age_limit=2.0, age_share=0.5).schedule(
        view([b, n], mode=PREFILL_ONLY, free_blocks=20))
    [(rid, k)] = chunks(plan)
    assert rid == "b" and k == pytest.approx(90, abs=1)
    assert plan.info.est_time <= plan.info.t_budget + 1e-12


def test_ablations_on_the_high_load_queue():
    # only_deadline: all NORMAL, remain ascending: lo1 takes the whole budget (0.4905 s)
    lo1, lo2, hi = _high_load_queue()
    plan = policy("only_deadline").schedule(view([lo1, lo2, hi], mode=PREFILL_ONLY))
    assert not any(urgent(plan).values())
    assert chunks(plan) == [("lo1", 490)] and plan.info.n_normal == 3
    # only_density: all URGENT, density descending — even at low load
    plan = policy("only_density").schedule(view([lo1, lo2, hi], mode=PREFILL_ONLY))
    assert chunks(plan) == [("hi", 50), ("lo1", 440)] and plan.info.n_urgent == 3
    d = dec("d", -0.9)
    wa, wb = wait("wa", -0.5, 40), wait("wb", -0.3, 30)    # densities 25, 33: wb first
    plan = policy("only_density").schedule(view([wa, wb], [d]))
    assert chunks(plan) == [("wb", 30), ("wa", 40)] and urgent(plan)["wa"]
    # wo_latency_aware: SlideBatching's order, a fixed token budget (TBT-profiled: 90)
    lo1, lo2, hi = _high_load_queue()
    plan = policy("wo_latency_aware").schedule(view([lo1, lo2, hi], mode=PREFILL_ONLY))
    assert chunks(plan) == [("hi", 50), ("lo1", 40)]
    assert plan.info.token_budget == 90 and math.isnan(plan.info.t_budget)
    plan = policy("wo_latency_aware", token_budget=600).schedule(view([lo1, lo2, hi], mode=PREFILL_ONLY))
    assert chunks(plan) == [("hi", 50), ("lo1", 500), ("lo2", 50)]


def test_ablations_low_load_deadline_order():
    # at low load only_deadline and wo_latency_aware keep the EDF order too
    d = dec("d", -0.9)
    wa, wb = wait("wa", -0.5, 40), wait("wb", -0.3, 39)
    for name in ("only_deadline", "wo_latency_aware", "slide_batching"):
        plan = policy(name).schedule(view([wb, wa], [d], free_blocks=3))
        assert chunks(plan) == [("wa", 40)], name


@pytest.mark.parametrize("name", ["slide_batching", "only_deadline", "only_density"])
@pytest.mark.parametrize("phi", ["a", "c", "p"])
def test_slide_latency_budget_never_exceeded(name, phi):
    rng = random.Random(7)
    pol = policy(name, phi=phi, eta=0.05)
    for _ in range(300):
        now = 10.0
        ws = [wait(f"w{i}", rng.uniform(8.5, 10), rng.randint(1, 2000), prio=rng.choice(["high", "low"]))
              for i in range(rng.randint(0, 8))]
        ds = [dec(f"d{i}", rng.uniform(8.5, 10), emitted=rng.randint(1, 10), prompt=rng.randint(1, 300))
              for i in range(rng.randint(0, 8))]
        mode = rng.choice([COLOCATED, PREFILL_ONLY])
        plan = pol.schedule(view(ws, ds, now=now, mode=mode, free_blocks=rng.choice([2, 30, 1 << 20])))
        if plan.empty:
            continue
        # η = 0.05 > t_c + one token, so the progress fallback never fires: GETMAXCHUNK
        # floors each chunk, and the batch ends within t_budget up to float rounding
        assert plan.info.est_time <= plan.info.t_budget * (1 + 1e-9)
        assert plan.info.est_time == pytest.approx(
            MODEL.batch_time([(n, r.kv_len) for r, n in plan.prefill], [r.kv_len for r in plan.decode]))


def test_slide_progress_fallback_when_budget_is_tiny():
    # η = 1 ms < t_c = 10 ms and every deadline has passed: t_budget = 1 ms leaves no room
    # for anything after t_c. The first request in order still gets one block of prompt.
    late = wait("late", -5.0, 100)
    plan = policy("slide_batching", eta=0.001).schedule(view([late]))
    assert plan.info.t_budget == pytest.approx(0.001)
    assert chunks(plan) == [("late", 16)]
    # a short prompt gets all of it
    plan = policy("slide_batching", eta=0.001).schedule(view([wait("s", -5.0, 5)]))
    assert chunks(plan) == [("s", 5)]
    # a decode first in order (highest density) runs alone
    d = dec("d", -5.0)
    plan = policy("slide_batching", eta=0.001).schedule(view([wait("late", -5.0, 100)], [d]))
    assert decs(plan) == ["d"] and chunks(plan) == []
    # nothing queued: an empty plan
    assert policy("slide_batching").schedule(view()).empty
