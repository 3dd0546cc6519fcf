"""scheduler.cost: the one implementation of Eq. 5-7 and what the policies derive from it."""

import random
import re
from pathlib import Path

import numpy as np
import pytest

from proserve.scheduler import Estimator, GainConfig, LatencyModel, Request
from proserve.scheduler.cost import StepCosts, queue_terms
from proserve.scheduler.estimator import OnlineCorrector

M = LatencyModel(a_p=2e-9, b_p=4e-9, c_p=7.2e-5, a_d=3.5e-7, b_d=1e-4, t_c=0.012)
ROOT = Path(__file__).resolve().parent.parent


def test_eq5_to_7_at_beta():
    c = StepCosts.of(M, 1.5)
    assert c.prefill(100, 50) == pytest.approx(1.5 * (2e-9 * 100 ** 2 + 4e-9 * 100 * 50 + 7.2e-5 * 100))
    assert c.decode(300) == pytest.approx(1.5 * (3.5e-7 * 300 + 1e-4))
    assert c.batch([(100, 50), (7, 0)], [300, 10]) == pytest.approx(
        c.prefill(100, 50) + c.prefill(7, 0) + c.decode(300) + c.decode(10) + 1.5 * 0.012)
    # the model's own times are the β = 1 costs
    assert M.prefill_time(100, 50) == StepCosts.of(M).prefill(100, 50)
    assert M.batch_time([(3, 4)], [5]) == M.unit.batch([(3, 4)], [5])


def test_next_work_is_the_remaining_prefill_or_one_decode():
    c = StepCosts.of(M, 2.0)
    r = Request("r", "low", 1.0, 1.0, 0.1, 0.0, 500, 10)
    assert c.next_work(r) == c.prefill(500, 0)
    r.advance_prefill(200, 0.1)
    assert c.next_work(r) == c.prefill(300, 200)
    r.advance_prefill(300, 0.2)
    assert c.next_work(r) == c.decode(500)


@pytest.mark.parametrize("deadline", ["fixed", "ttft_anchored"])
def test_queue_terms_agree_with_the_scalar_definitions(deadline):
    rng = random.Random(1)
    gain = GainConfig(w_p=5.0, w_d=1.0, deadline=deadline)
    Q = []
    for i in range(200):
        r = Request(f"r{i}", "low", 1.0, rng.uniform(0.2, 2), rng.uniform(0.02, 0.2), rng.uniform(0, 5),
                    rng.randint(1, 4000), 50)
        k = rng.randint(0, 3)
        if k:
            r.advance_prefill(r.prompt_len if k > 1 else rng.randint(1, r.prompt_len), 5.5)
        for j in range(rng.randint(0, 5) if r.token_times else 0):
            r.emit(6.0 + j)
        Q.append(r)
    c = StepCosts.of(M, 1.3)
    execs, remains = queue_terms(c, gain, Q, now=7.0)
    assert execs == pytest.approx([c.next_work(r) for r in Q], rel=1e-12)
    assert remains == pytest.approx([gain.next_token_deadline(r) - 7.0 for r in Q], rel=1e-12)


def test_max_chunk_is_the_largest_chunk_within_budget():
    rng = random.Random(0)
    for _ in range(300):
        c = StepCosts.of(M, rng.uniform(0.3, 3.0))
        kv, remaining, budget = rng.randint(0, 20000), rng.randint(1, 5000), rng.uniform(0, 0.5)
        n = c.max_chunk(kv, remaining, budget)
        assert 0 <= n <= remaining
        if n:
            assert c.prefill(n, kv) <= budget * (1 + 1e-12)
        if n < remaining:
            assert c.prefill(n + 1, kv) > budget
    assert c.max_chunk(0, 10, 0.0) == 0 and c.max_chunk(0, 0, 1.0) == 0


def test_estimator_get_max_chunk_agrees_with_the_costs_at_beta():
    est = Estimator(M, OnlineCorrector())
    est.corrector.beta = 1.7
    for kv, rem, budget in [(0, 10_000, 0.1), (4000, 800, 0.05), (123, 5, 1.0)]:
        n = est.get_max_chunk(kv, rem, budget)
        assert n == est.costs().max_chunk(kv, rem, budget)
        assert est.prefill(n, kv) <= budget * (1 + 1e-9)


def test_decode_run_matches_step_by_step_batches():
    c = StepCosts.of(M, 1.2)
    kvs = [100, 2000, 37]
    k = 9
    run = c.decode_run(sum(kvs), len(kvs), k)
    steps = [c.batch((), [kv + j for kv in kvs]) for j in range(k)]
    assert np.allclose(run, steps)
    assert c.decode_run_total(sum(kvs), len(kvs), k) == pytest.approx(sum(steps))


def test_estimator_costs_follow_beta_and_the_model():
    est = Estimator(M, OnlineCorrector())
    first = est.costs()
    assert est.costs() is first                      # cached while nothing changed
    est.observe(0.5, [(1000, 0)], [], now=1.0)       # slower than estimated: β moves
    assert est.beta != 1.0 and est.costs() is not first
    assert est.prefill(1000) == pytest.approx(est.beta * M.prefill_time(1000))
    est.model = LatencyModel(a_p=0, b_p=0, c_p=1e-3, a_d=0, b_d=1e-3, t_c=0.01)
    assert est.prefill(10) == pytest.approx(est.beta * 1e-2)


def test_no_policy_writes_the_latency_model_out_again():
    """Eq. 5-7 live in scheduler/cost.py; nothing else reads the raw coefficients to
    recompute them (the estimator fits and serialises them, the profiler reports them)."""
    allowed = {"scheduler/cost.py", "scheduler/estimator.py"}
    pattern = re.compile(r"\.(a_p|b_p|c_p|a_d|b_d)\b")
    offenders = []
    for folder in ("scheduler", "sim", "prefill", "decode", "dispatcher"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel in allowed:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
