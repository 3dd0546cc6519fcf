"""Latency estimator (Eq. 4-7): fit, MAPE, JSON, GETMAXCHUNK, online β."""

import numpy as np
import pytest

from proserve.scheduler import BatchSample, ConfigError, Estimator, LatencyModel, OnlineCorrector

TRUE = LatencyModel(a_p=2e-9, b_p=4e-9, c_p=7e-5, a_d=3.5e-7, b_d=1e-4, t_c=0.012)


def test_eq5_to_eq7_by_hand():
    m = LatencyModel(a_p=1e-6, b_p=2e-6, c_p=1e-3, a_d=1e-5, b_d=1e-3, t_c=0.01)
    assert m.prefill_time(100, 50) == pytest.approx(1e-6 * 1e4 + 2e-6 * 5000 + 0.1)   # 0.12
    assert m.decode_time(200) == pytest.approx(2e-3 + 1e-3)
    assert m.batch_time([(100, 50)], [200, 200]) == pytest.approx(0.12 + 2 * 3e-3 + 0.01)


def _grid(rng, n):
    out = []
    for _ in range(n):
        prefills = [(int(rng.integers(1, 2048)), int(rng.integers(0, 4096))) for _ in range(rng.integers(0, 4))]
        decodes = [int(rng.integers(1, 4096)) for _ in range(rng.integers(0, 64))]
        if not prefills and not decodes:
            decodes = [100]
        t = TRUE.batch_time(prefills, decodes) * rng.normal(1.0, 0.02)
        out.append(BatchSample.of(prefills, decodes, t))
    return out


def test_fit_recovers_known_coefficients_from_noisy_samples():
    samples = _grid(np.random.default_rng(0), 600)
    model, train_mape, test_mape = LatencyModel.fit_holdout(samples, holdout=0.2, seed=1)
    for name, rel in [("c_p", 0.05), ("a_d", 0.1), ("b_d", 0.25), ("t_c", 0.1), ("b_p", 0.25), ("a_p", 0.5)]:
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=rel), name
    assert test_mape < 0.03  # noise is 2 %


def test_fit_is_nonnegative_and_mape_detects_a_bad_model():
    samples = _grid(np.random.default_rng(2), 200)
    model = LatencyModel.fit(samples)
    assert all(getattr(model, k) >= 0 for k in ("a_p", "b_p", "c_p", "a_d", "b_d", "t_c"))
    bad = LatencyModel(TRUE.a_p, TRUE.b_p, TRUE.c_p * 2, TRUE.a_d, TRUE.b_d, TRUE.t_c)
    assert bad.mape(samples) > 0.2


def test_json_roundtrip_and_errors():
    m = LatencyModel(1e-9, 2e-9, 3e-5, 4e-7, 5e-5, 0.01, metadata={"model": "x", "device": "cpu",
                                                                    "dtype": "bf16", "engine": "vllm 0.32"})
    back = LatencyModel.loads(m.dumps())
    assert back == m and back.metadata["engine"] == "vllm 0.32"
    with pytest.raises(ConfigError, match="not valid JSON"):
        LatencyModel.loads("{")
    with pytest.raises(ConfigError, match="missing coefficients t_c"):
        LatencyModel.loads('{"coefficients": {"a_p":0,"b_p":0,"c_p":1,"a_d":0,"b_d":0}}')
    with pytest.raises(ConfigError, match="c_p"):
        LatencyModel(0, 0, -1.0, 0, 0, 0)


def test_get_max_chunk_is_the_inverse_of_eq5():
    est = Estimator(TRUE)
    for l_kv in (0, 1000, 8000):
        for budget in (0.001, 0.05, 0.3):
            n = est.get_max_chunk(l_kv, 10**6, budget)
            assert est.prefill(n, l_kv) <= budget
            assert est.prefill(n + 1, l_kv) > budget
    assert est.get_max_chunk(0, 17, 10.0) == 17           # capped by the remaining prompt
    assert est.get_max_chunk(0, 100, 0.0) == 0


def test_get_max_chunk_scales_with_beta():
    est = Estimator(TRUE)
    n1 = est.get_max_chunk(0, 10**6, 0.1)
    est.corrector.beta = 2.0
    n2 = est.get_max_chunk(0, 10**6, 0.1)
    assert est.prefill(n2) <= 0.1 < 2.0 * TRUE.prefill_time(n1)
    assert n2 < n1


def test_beta_converges_to_a_step_change_in_speed():
    c = OnlineCorrector(theta=0.8, window_s=1.0)
    t = 0.0
    for _ in range(100):                 # estimator exact: β stays 1
        t += 0.05
        c.observe(0.05, 0.05, t)
    assert c.beta == pytest.approx(1.0)
    steps = None
    for i in range(200):                 # the hardware becomes 1.6x slower
        t += 0.08
        c.observe(0.08, 0.05, t)
        if steps is None and abs(c.beta - 1.6) < 0.05 * 1.6:
            steps = i + 1
    assert c.beta == pytest.approx(1.6, rel=1e-3)
    assert steps is not None and steps <= 40, steps


def test_beta_damps_a_single_outlier():
    c = OnlineCorrector(theta=0.8, window_s=1.0)
    for i in range(20):
        c.observe(0.05, 0.05, i * 0.05)
    c.observe(0.5, 0.05, 1.0)            # one 10x step
    assert c.beta < 1.2


@pytest.mark.parametrize("kw", [dict(theta=1.0), dict(theta=-0.1), dict(window_s=0)])
def test_invalid_corrector(kw):
    with pytest.raises(ConfigError):
        OnlineCorrector(**kw)


def test_absolute_fit_keeps_the_total_time_where_relative_fit_does_not():
    """relative=False minimises absolute error: the predicted times of the samples sum to
    about the measured ones even when long steps run slower than the short ones suggest
    (what a simulator replaying served steps needs); the default (relative) fit does not."""
    from proserve.scheduler.estimator import BatchSample
    samples = [BatchSample.of([], [100] * n, 0.010 + 0.001 * n) for n in range(1, 40)]
    samples += [BatchSample.of([(q, 0)], [], 0.010 + 0.0002 * q * (1.3 if q > 400 else 1.0))
                for q in range(50, 1000, 50)]
    total = sum(s.time for s in samples)
    absolute = LatencyModel.fit(samples, relative=False)
    relative = LatencyModel.fit(samples)
    assert sum(absolute.predict(s) for s in samples) == pytest.approx(total, rel=0.01)
    assert abs(sum(relative.predict(s) for s in samples) / total - 1) > \
        abs(sum(absolute.predict(s) for s in samples) / total - 1)
