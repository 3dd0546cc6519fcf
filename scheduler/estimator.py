"""Batch latency estimator (§4.1, Eq. 4-7) with online correction β.

    T~_p(r) = a_p·l_q² + b_p·l_q·l_kv + c_p·l_q          (Eq. 5, prefill chunk)
    T~_d(r) = a_d·l_kv + b_d                             (Eq. 6, decode step)
    T_pd(B) = Σ_{B_p} T~_p + Σ_{B_d} T~_d + t_c          (Eq. 7)

``l_q`` is the number of tokens processed in this forward pass, ``l_kv`` the
tokens already in the KV cache that they attend to.

The model is fitted offline from (batch composition, measured time) samples by
non-negative least squares and serialised as JSON text (file I/O lives outside
``scheduler/``: see ``profiler.modelfile``). :class:`Estimator` wraps a model
with the online correction factor of §4.1::

    β_{i+1} = θ·β_i + (1-θ)·mean_{B in window}( T_real(B) / T_pd(B) )

where ``T_pd`` is the *uncorrected* model estimate, so β converges to the true
speed ratio instead of compounding (the paper's "T^{i+1} ← β·T^i" read as a
running product would drift on any bias).
"""

from __future__ import annotations

import functools
import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from .cost import StepCosts
from .request import ConfigError

COEFFS = ("a_p", "b_p", "c_p", "a_d", "b_d", "t_c")


@dataclass(frozen=True)
class BatchSample:
    """One measured step: prefill chunks as (l_q, l_kv), decodes as l_kv."""

    prefills: tuple[tuple[int, int], ...]
    decodes: tuple[int, ...]
    time: float

    @staticmethod
    def of(prefills: Iterable[tuple[int, int]] = (), decodes: Iterable[int] = (), time: float = 0.0) -> "BatchSample":
        return BatchSample(tuple((int(q), int(k)) for q, k in prefills), tuple(int(k) for k in decodes), float(time))

    def features(self) -> list[float]:
        """Regressors matching COEFFS: Σl_q², Σl_q·l_kv, Σl_q, Σl_kv(dec), n_dec, 1."""
        return [
            float(sum(q * q for q, _ in self.prefills)),
            float(sum(q * k for q, k in self.prefills)),
            float(sum(q for q, _ in self.prefills)),
            float(sum(self.decodes)),
            float(len(self.decodes)),
            1.0,
        ]


@dataclass(frozen=True)
class LatencyModel:
    """Coefficients of Eq. 5-7 in seconds, plus where they came from."""

    a_p: float
    b_p: float
    c_p: float
    a_d: float
    b_d: float
    t_c: float
    metadata: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in COEFFS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"latency model: coefficient {name} must be a finite number >= 0, got {v!r}")
        if self.c_p <= 0 and self.a_p <= 0:
            raise ConfigError("latency model: prefill cost is zero (a_p = c_p = 0); GETMAXCHUNK would be unbounded")

    # -- Eq. 5-7 (scheduler.cost, at β = 1) -------------------------------------
    @functools.cached_property
    def unit(self) -> StepCosts:
        """The model's own costs (β = 1)."""
        return StepCosts.of(self)

    def prefill_time(self, l_q: int, l_kv: int = 0) -> float:
        return self.unit.prefill(l_q, l_kv)

    def decode_time(self, l_kv: int) -> float:
        return self.unit.decode(l_kv)

    def batch_time(self, prefills: Iterable[tuple[int, int]] = (), decodes: Iterable[int] = ()) -> float:
        return self.unit.batch(prefills, decodes)

    def predict(self, sample: BatchSample) -> float:
        return self.batch_time(sample.prefills, sample.decodes)

    # -- fitting -------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Sequence[BatchSample], metadata: dict | None = None) -> "LatencyModel":
        """Non-negative least squares on relative error.

        Rows are scaled by 1/T so that short and long batches count alike (the
        quality target is MAPE, a relative error).
        """
        from scipy.optimize import nnls

        if len(samples) < len(COEFFS):
            raise ConfigError(f"latency model: need at least {len(COEFFS)} samples to fit, got {len(samples)}")
        X = np.array([s.features() for s in samples], dtype=float)
        y = np.array([s.time for s in samples], dtype=float)
        if np.any(y <= 0):
            raise ConfigError("latency model: sample times must be > 0")
        w = 1.0 / y
        # column scaling keeps NNLS well conditioned (features span ~12 decades)
        scale = np.maximum(np.abs(X * w[:, None]).max(axis=0), 1e-30)
        coef, _ = nnls(X * w[:, None] / scale, y * w)
        coef = coef / scale
        if coef[0] <= 0 and coef[2] <= 0:
            coef[2] = 1e-12  # degenerate grid without prefills: keep GETMAXCHUNK bounded
        return cls(*map(float, coef), metadata=dict(metadata or {}))

    def mape(self, samples: Sequence[BatchSample]) -> float:
        """Mean absolute percentage error (as a fraction) on ``samples``."""
        if not samples:
            return float("nan")
        return float(np.mean([abs(self.predict(s) - s.time) / s.time for s in samples]))

    @classmethod
    def fit_holdout(cls, samples: Sequence[BatchSample], holdout: float = 0.2, seed: int = 0,
                    metadata: dict | None = None) -> tuple["LatencyModel", float, float]:
        """Fit on a random (1-holdout) share; return (model, train MAPE, held-out MAPE)."""
        if not 0 < holdout < 1:
            raise ConfigError(f"latency model: holdout must be in (0, 1), got {holdout}")
        idx = np.random.default_rng(seed).permutation(len(samples))
        n_test = max(1, int(round(holdout * len(samples))))
        test = [samples[i] for i in idx[:n_test]]
        train = [samples[i] for i in idx[n_test:]]
        model = cls.fit(train, metadata)
        return model, model.mape(train), model.mape(test)

    # -- serialisation ----------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": "proserve-latency-model/1",
                "coefficients": {k: getattr(self, k) for k in COEFFS},
                "metadata": self.metadata}

    @classmethod
    def from_dict(cls, d: dict, where: str = "latency model") -> "LatencyModel":
        if not isinstance(d, dict) or "coefficients" not in d:
            raise ConfigError(f"{where}: expected an object with 'coefficients'")
        c = d["coefficients"]
        missing = [k for k in COEFFS if k not in c]
        if missing:
            raise ConfigError(f"{where}: missing coefficients {', '.join(missing)}")
        try:
            return cls(**{k: c[k] for k in COEFFS}, metadata=dict(d.get("metadata", {})))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def loads(cls, text: str, where: str = "latency model") -> "LatencyModel":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
        return cls.from_dict(d, where)


class OnlineCorrector:
    """β of §4.1: momentum θ over the ratios T_real/T_pd seen in a sliding time window.

    Defaults: θ = 0.8 and a 1 s window. A 1 s window holds tens of steps on a
    real engine (10-100 ms per step), enough to average out per-step jitter;
    θ = 0.8 then moves β 20 % of the way to the window mean per step, so a
    step change in speed is tracked to within ~5 % in about 15 steps after the
    window has refilled, i.e. within a few dozen steps, while a single outlier
    step moves β by at most (1-θ)/n_window of its error.
    """

    def __init__(self, theta: float = 0.8, window_s: float = 1.0, max_samples: int = 256,
                 beta_bounds: tuple[float, float] = (0.05, 20.0)):
        if not 0 <= theta < 1:
            raise ConfigError(f"online correction: theta must be in [0, 1), got {theta}")
        if window_s <= 0:
            raise ConfigError(f"online correction: window_s must be > 0, got {window_s}")
        self.theta = theta
        self.window_s = window_s
        self.beta = 1.0
        self.lo, self.hi = beta_bounds
        self._window: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (time, ratio)
        self._sum = 0.0

    def observe(self, t_real: float, t_est: float, now: float) -> float:
        """Add one step's measured and (uncorrected) estimated time; return β."""
        if t_est <= 0 or t_real <= 0 or not math.isfinite(t_real):
            return self.beta
        if len(self._window) == self._window.maxlen:
            self._sum -= self._window[0][1]
        ratio = t_real / t_est
        self._window.append((now, ratio))
        self._sum += ratio
        while self._window and self._window[0][0] < now - self.window_s:
            self._sum -= self._window.popleft()[1]
        mean = self._sum / len(self._window)
        self.beta = min(self.hi, max(self.lo, self.theta * self.beta + (1 - self.theta) * mean))
        return self.beta


class Estimator:
    """A latency model scaled by the online correction factor β.

    Every time the policies read (``prefill``, ``decode``, ``t_c``,
    ``get_max_chunk``) is the corrected one, ``β · T``.
    """

    def __init__(self, model: LatencyModel, corrector: OnlineCorrector | None = None):
        self.model = model
        self.corrector = corrector or OnlineCorrector()
        self._costs: StepCosts | None = None
        self._costs_of: LatencyModel | None = None

    @property
    def beta(self) -> float:
        return self.corrector.beta

    def costs(self) -> StepCosts:
        """Eq. 5-7 at the current β (:mod:`scheduler.cost`); rebuilt only when β or the model changed."""
        c = self._costs
        if c is None or c.beta != self.corrector.beta or self._costs_of is not self.model:
            c = self._costs = StepCosts.of(self.model, self.corrector.beta)
            self._costs_of = self.model
        return c

    @property
    def t_c(self) -> float:
        return self.costs().t_c

    def prefill(self, l_q: int, l_kv: int = 0) -> float:
        return self.costs().prefill(l_q, l_kv)

    def decode(self, l_kv: int) -> float:
        return self.costs().decode(l_kv)

    def batch(self, prefills: Iterable[tuple[int, int]] = (), decodes: Iterable[int] = ()) -> float:
        return self.costs().batch(prefills, decodes)

    # -- the online correction: every body feeds β through these -----------------------
    def observe(self, t_real: float, prefills: Iterable[tuple[int, int]], decodes: Iterable[int], now: float) -> float:
        """A step of this batch took ``t_real`` seconds, ending at ``now``; returns β."""
        return self.observe_time(t_real, self.model.batch_time(prefills, decodes), now)

    def observe_time(self, t_real: float, t_model: float, now: float) -> float:
        """``t_real`` measured where the uncorrected model predicted ``t_model`` (one step,
        or a run of steps whose model times were summed, as the simulator's macro-steps)."""
        return self.corrector.observe(t_real, t_model, now)

    def adopt(self, beta: float) -> None:
        """Take a β measured elsewhere (the dispatcher mirrors each prefill worker's)."""
        c = self.corrector
        c.beta = min(c.hi, max(c.lo, float(beta)))

    def get_max_chunk(self, l_kv: int, remaining: int, budget: float) -> int:
        """GETMAXCHUNK: largest l_q ≤ ``remaining`` with β·T~_p(l_q, l_kv) ≤ ``budget``."""
        return self.costs().max_chunk(l_kv, remaining, budget)
