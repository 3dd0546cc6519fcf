"""TDG (Eq. 3), its footnote-2 variant, and the §5.1 metrics, on hand-computed cases."""

import math

import pytest

from proserve.scheduler import ConfigError, GainConfig, summarize
from proserve.scheduler.tdg import slo_attained


def test_eq3_token_weights_and_deadlines(make_req):
    g = GainConfig(w_p=4.0, w_d=1.0)
    r = make_req(output=3, arrival=10.0, weight=2.0, ttft=1.0, tpot=0.1)
    assert g.token_weight(r, 1) == 8.0          # w_p · w_prio
    assert g.token_weight(r, 2) == 2.0          # w_d · w_prio
    assert g.token_deadline(r, 1) == pytest.approx(11.0)
    assert g.token_deadline(r, 3) == pytest.approx(11.2)


def test_eq3_gain_counts_tokens_strictly_before_deadline(make_req):
    g = GainConfig(w_p=4.0, w_d=1.0)
    r = make_req(output=4, arrival=0.0, weight=2.0, ttft=1.0, tpot=0.1)
    # deadlines 1.0, 1.1, 1.2, 1.3; token 2 exactly on its deadline earns nothing
    r.token_times = [0.9, 1.1, 1.15, 1.4]
    assert g.tdg(r) == pytest.approx(2.0 * (4.0 + 0 + 1.0 + 0))
    assert g.ideal_gain(r) == pytest.approx(2.0 * (4.0 + 3 * 1.0))


def test_late_first_token_propagates_with_fixed_deadlines(make_req):
    g = GainConfig(w_p=1.0, w_d=1.0)
    r = make_req(output=3, ttft=1.0, tpot=0.1)
    r.token_times = [1.5, 1.55, 1.6]           # deadlines 1.0, 1.1, 1.2: all missed
    assert g.tdg(r) == 0.0
    # footnote 2: deadline_i = min(TTFT_r, TTFT_SLO) + (i-1)·TPOT = 1.0 + ... still missed
    assert GainConfig(1.0, 1.0, "ttft_anchored").tdg(r) == 0.0


def test_footnote2_variant_tightens_after_fast_first_token(make_req):
    r = make_req(output=3, ttft=1.0, tpot=0.1)
    r.token_times = [0.2, 0.5, 0.6]
    # fixed: deadlines 1.0, 1.1, 1.2 -> all met (3); anchored: 0.2, 0.3, 0.4 -> first met only
    assert GainConfig(1.0, 1.0).tdg(r) == 3.0
    assert GainConfig(1.0, 1.0, "ttft_anchored").tdg(r) == 0.0  # 0.2 < 0.2 is false
    r.token_times = [0.2, 0.25, 0.6]
    assert GainConfig(1.0, 1.0, "ttft_anchored").tdg(r) == 1.0  # only token 2 (0.25 < 0.3)


def test_from_workload_sets_ratio_of_means():
    g = GainConfig.from_workload([1000, 2000], [100, 200])
    assert g.w_p == pytest.approx(10.0) and g.w_d == 1.0


@pytest.mark.parametrize("kw", [dict(w_p=-1), dict(w_d=float("nan")), dict(w_p=0, w_d=0),
                                dict(deadline="nope")])
def test_invalid_gain_config(kw):
    with pytest.raises(ConfigError):
        GainConfig(**kw)


def test_slo_attainment_is_strict_and_needs_completion(make_req):
    r = make_req(output=3, ttft=1.0, tpot=0.1)
    r.token_times = [0.5, 0.6, 0.7]
    r.phase = r.phase.DONE
    assert slo_attained(r)
    r.token_times = [1.0, 1.05, 1.1]            # TTFT == SLO: not strictly below
    assert not slo_attained(r)
    r.token_times = [0.5, 0.6, 0.7000001]       # TPOT just above 0.1
    assert not slo_attained(r)
    u = make_req(output=3)
    u.token_times = [0.1]                       # unfinished
    assert not slo_attained(u)


def test_summary_per_class(make_req):
    g = GainConfig(w_p=2.0, w_d=1.0)
    hi = make_req(output=2, weight=2.0, priority="high")
    lo = make_req(output=2, weight=1.0, priority="low")
    hi.token_times, lo.token_times = [0.5, 0.55], [1.5, 1.55]
    for r in (hi, lo):
        r.phase = r.phase.DONE
    s = summarize([hi, lo], g)
    # hi: ideal 2*(2+1)=6 all met; lo: ideal 3, first missed (1.5 > 1.0), second 1.55 > 1.1 missed
    assert s["high"].tdg_ratio == 1.0 and s["low"].tdg_ratio == 0.0
    assert s["all"].tdg_ratio == pytest.approx(6 / 9)
    assert s["all"].miss_tdg_ratio == pytest.approx(3 / 9)
    assert s["all"].slo_attainment == 0.5
    assert s["all"].ttft_p50 == pytest.approx(1.0)
    assert s["all"].first_token_tdg_ratio == pytest.approx(4 / 6)
    assert math.isclose(s["all"].throughput_tokens_s, 4 / 1.55)


def test_late_decode_gain_counts_the_tokens_that_cannot_catch_up():
    """A first token `late` s past its deadline, later tokens every `step` s: with fixed
    deadlines the first late / (TPOT_SLO − step) decode tokens miss, each w_d·w_prio, at most the
    n_out there are; all of them when the step is no faster than the SLO; none when on time or
    with ttft_anchored deadlines (they move with the first token)."""
    g = GainConfig(3.0, 0.5)            # a request of weight 2 with a TPOT SLO of 0.05 s
    assert g.late_decode_gain(2.0, 0.05, 0.3, 0.03, 100) == pytest.approx(0.5 * 2.0 * 0.3 / 0.02)   # 15 tokens
    assert g.late_decode_gain(2.0, 0.05, 0.3, 0.03, 10) == pytest.approx(0.5 * 2.0 * 10)            # all 10
    assert g.late_decode_gain(2.0, 0.05, 0.3, 0.05, 100) == pytest.approx(0.5 * 2.0 * 100)          # no catch-up
    assert g.late_decode_gain(2.0, 0.05, float("inf"), 0.03, 7) == pytest.approx(7.0)
    assert g.late_decode_gain(2.0, 0.05, 0.0, 0.03, 100) == g.late_decode_gain(2.0, 0.05, -1.0, 0.03, 100) == 0.0
    assert GainConfig(3.0, 0.5, "ttft_anchored").late_decode_gain(2.0, 0.05, 0.3, 0.03, 100) == 0.0
