"""Batch latency estimator (§4.1, Eq. 4-7) with online correction β (and δ).

    T~_p(r) = a_p·l_q² + b_p·l_q·l_kv + c_p·l_q          (Eq. 5, prefill chunk)
    T~_d(r) = a_d·l_kv + b_d                             (Eq. 6, decode step)
    T_pd(B) = Σ_{B_p} T~_p + Σ_{B_d} T~_d + t_c          (Eq. 7)

``l_q`` is the number of tokens processed in this forward pass, ``l_kv`` the
tokens already in the KV cache that they attend to.

The model is fitted offline from (batch composition, measured time) samples by
non-negative least squares and serialised as JSON text (file I/O lives outside
``scheduler/``: see ``proserve.profiler.modelfile``). :class:`Estimator` wraps a model
with the online correction of §4.1::

    β_{i+1} = θ·β_i + (1-θ)·mean_{B in window}( T_real(B) / T_pd(B) )

where ``T_pd`` is the *uncorrected* model estimate, so β converges to the true
speed ratio instead of compounding (the paper's "T^{i+1} ← β·T^i" read as a
running product would drift on any bias). By default the correction also has a
per-step offset δ, fitted with β from the same window (a corrected step takes
β·T_pd + δ; :class:`OnlineCorrector` says why and how); ``mode="scale"`` keeps
the paper's β alone.
"""

from __future__ import annotations

import functools
import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from . import validate
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
            validate.non_negative("latency model", f"coefficient {name}", getattr(self, name))
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
    def fit(cls, samples: Sequence[BatchSample], metadata: dict | None = None,
            relative: bool = True) -> "LatencyModel":
        """Non-negative least squares on relative error.

        Rows are scaled by 1/T so that short and long batches count alike (the
        quality target is MAPE, a relative error). ``relative=False`` fits the
        absolute error instead: the predicted times then sum to about the measured
        ones (what a simulator replaying a served workload needs; long steps weigh more).
        """
        from scipy.optimize import nnls

        if len(samples) < len(COEFFS):
            raise ConfigError(f"latency model: need at least {len(COEFFS)} samples to fit, got {len(samples)}")
        X = np.array([s.features() for s in samples], dtype=float)
        y = np.array([s.time for s in samples], dtype=float)
        if np.any(y <= 0):
            raise ConfigError("latency model: sample times must be > 0")
        w = 1.0 / y if relative else np.ones_like(y)
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
        validate.number("latency model", "holdout", holdout, 0, 1, lo_open=True, hi_open=True)
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


#: the two forms of the online correction (``OnlineCorrector(mode=...)``)
SCALE = "scale"                  # §4.1 as the paper writes it: T = β·T_pd
SCALE_OFFSET = "scale_offset"    # T = β·T_pd + δ per step, β and δ fitted together
CORRECTIONS = (SCALE, SCALE_OFFSET)


class OnlineCorrector:
    """The online correction of §4.1 over a sliding time window of measured steps.

    ``mode = "scale"`` is the paper's: one factor β with momentum θ,

        β_{i+1} = θ·β_i + (1-θ)·mean_{B in window}( T_real(B) / T_pd(B) )

    ``mode = "scale_offset"`` (the default) corrects a step to β·T_pd + δ, with
    δ a fixed cost per step. A slowdown that adds time to every step however
    small (a CPU quota, a co-scheduled process: the engine waits up to a
    scheduling quantum per step) is not a multiple of T_pd; one factor then
    over-corrects small steps and under-corrects large ones (docs/results.md
    §6). Both are fitted from the same window, by least squares on the relative
    error (the paper's mean of ratios is this fit with δ = 0): with
    r = T_real/T_pd and u = n/T_pd (``n`` steps in the measurement),

        r = β + δ·u      regressed over the window -> (β^, δ^),
        β_{i+1} = θ·β_i + (1-θ)·β^,   δ_{i+1} = θ·δ_i + (1-θ)·δ^.

    When the window's steps are all about the same size (the spread of u below
    ``min_spread`` of its mean, or fewer than ``min_samples`` steps) the two
    cannot be told apart: then the offset of the last window that could
    (initially 0) is kept, δ^ = δ^_last, and only the scale is fitted,
    β^ = mean((T_real − δ^·n) / T_pd) -- with δ^ = 0 exactly the paper's β.

    Bounds: β in ``beta_bounds``, δ in [0, ``delta_max``] seconds. The offset
    only adds: a slowdown adds time to a step; an engine that is faster than
    its profile is a β below 1. A window whose best line has a negative offset
    (large steps slower than the model in proportion, small ones not: the
    model's size dependence is off, not a per-step cost) gets δ = 0 and the
    paper's β. When β^ falls outside its bounds it is clamped and δ^ refitted
    given that β.

    Defaults: θ = 0.8 and a 1 s window. A 1 s window holds tens of steps on a
    real engine (10-100 ms per step), enough to average out per-step jitter;
    θ = 0.8 then moves the correction 20 % of the way to the window's fit per
    step, so a step change in speed is tracked within a few dozen steps, while a
    single outlier step moves it by at most (1-θ)/n_window of its error.
    """

    def __init__(self, theta: float = 0.8, window_s: float = 1.0, max_samples: int = 256,
                 beta_bounds: tuple[float, float] = (0.05, 20.0), mode: str = SCALE_OFFSET,
                 delta_max: float = 1.0, min_spread: float = 0.25, min_samples: int = 4):
        where = "online correction"
        self.theta = validate.number(where, "theta", theta, 0, 1, hi_open=True)
        self.window_s = validate.positive(where, "window_s", window_s)
        self.mode = validate.one_of(where, "mode", mode, CORRECTIONS)
        self.delta_max = validate.non_negative(where, "delta_max", delta_max)
        self.min_spread = validate.positive(where, "min_spread", min_spread)
        self.min_samples = validate.integer(where, "min_samples", min_samples, 2)
        self.beta = 1.0
        self.delta = 0.0
        self._delta_fit = 0.0     # δ^ of the last window that determined it
        self.lo, self.hi = beta_bounds
        self._window: deque[tuple[float, float, float]] = deque(maxlen=max_samples)  # (time, r, u)
        # running sums over the window of r, u, u², u·r (re-summed now and then against drift)
        self._sums = [0.0, 0.0, 0.0, 0.0]
        self._since_resum = 0

    def _add(self, r: float, u: float, sign: float) -> None:
        s = self._sums
        s[0] += sign * r
        s[1] += sign * u
        s[2] += sign * u * u
        s[3] += sign * u * r

    def _resum(self) -> None:
        self._sums = [0.0, 0.0, 0.0, 0.0]
        for _, r, u in self._window:
            self._add(r, u, 1.0)
        self._since_resum = 0

    def observe(self, t_real: float, t_est: float, now: float, steps: int = 1) -> float:
        """Add a measurement: ``steps`` steps took ``t_real`` seconds where the uncorrected
        model predicted ``t_est`` for them together, ending at ``now``. Returns β."""
        if t_est <= 0 or t_real <= 0 or not math.isfinite(t_real) or not math.isfinite(t_est) or steps < 1:
            return self.beta
        w = self._window
        if len(w) == w.maxlen:
            _, r0, u0 = w[0]
            self._add(r0, u0, -1.0)
        r, u = t_real / t_est, steps / t_est
        w.append((now, r, u))
        self._add(r, u, 1.0)
        while w and w[0][0] < now - self.window_s:
            _, r0, u0 = w.popleft()
            self._add(r0, u0, -1.0)
        self._since_resum += 1
        if self._since_resum >= 4 * (w.maxlen or 256):
            self._resum()
        beta_hat, delta_hat = self._fit()
        th = self.theta
        self._set(th * self.beta + (1 - th) * beta_hat, th * self.delta + (1 - th) * delta_hat)
        return self.beta

    def _fit(self) -> tuple[float, float]:
        """(β^, δ^) of the window (see the class docstring), within the bounds."""
        n = len(self._window)
        sr, su, suu, sur = self._sums
        mr, mu = sr / n, su / n
        if self.mode == SCALE:
            return mr, 0.0                                     # §4.1: mean(T_real / T_pd)
        var_u = suu / n - mu * mu
        determined = n >= self.min_samples and var_u > (self.min_spread * mu) ** 2
        # the slope of r on u, or (ill-conditioned) the last window's
        delta = self._clamp_delta((sur / n - mu * mr) / var_u if determined else self._delta_fit)
        beta = mr - delta * mu                                 # the best scale given that offset
        if not self.lo <= beta <= self.hi:
            beta = min(self.hi, max(self.lo, beta))
            delta = self._clamp_delta((sur - beta * su) / suu) # the best offset given that scale
        if determined:
            self._delta_fit = delta
        return beta, delta

    def _clamp_delta(self, delta: float) -> float:
        return min(self.delta_max, max(0.0, delta))

    def _set(self, beta: float, delta: float) -> None:
        self.beta = min(self.hi, max(self.lo, beta))
        self.delta = 0.0 if self.mode == SCALE else self._clamp_delta(delta)

    def adopt(self, beta: float, delta: float = 0.0) -> None:
        """Take a correction measured elsewhere, within this corrector's bounds."""
        self._set(float(beta), float(delta))


class Estimator:
    """A latency model with the online correction applied: a step of batch B takes
    β·T_pd(B) + δ (δ = 0 under the paper's scale-only correction).

    Every time the policies read (``costs()``, and through it ``prefill``,
    ``decode``, ``t_c``, ``get_max_chunk``) is the corrected one.
    """

    def __init__(self, model: LatencyModel, corrector: OnlineCorrector | None = None):
        self.model = model
        self.corrector = corrector or OnlineCorrector()
        self._costs: StepCosts | None = None
        self._costs_of: LatencyModel | None = None

    @property
    def beta(self) -> float:
        return self.corrector.beta

    @property
    def delta(self) -> float:
        """The correction's per-step offset δ in seconds (0 under ``mode="scale"``)."""
        return self.corrector.delta

    def costs(self) -> StepCosts:
        """Eq. 5-7 at the current β and δ (:mod:`proserve.scheduler.cost`); rebuilt only when they or the model changed."""
        c, k = self._costs, self.corrector
        if c is None or c.beta != k.beta or c.delta != k.delta or self._costs_of is not self.model:
            c = self._costs = StepCosts.of(self.model, k.beta, k.delta)
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

    def corrected(self, t_model: float, steps: int = 1) -> float:
        """The corrected time of ``steps`` steps whose uncorrected model times sum to ``t_model``."""
        return self.corrector.beta * t_model + self.corrector.delta * steps

    def model_time(self, t: float, steps: int = 1) -> float:
        """The inverse of :meth:`corrected`: the uncorrected model time that ``steps`` steps
        taking ``t`` seconds correspond to (a policy with a model of its own, such as
        SLOs-Serve's roofline, converts its time budget with this)."""
        return (t - self.corrector.delta * steps) / self.corrector.beta

    # -- the online correction: every body feeds it through these -----------------------
    def observe(self, t_real: float, prefills: Iterable[tuple[int, int]], decodes: Iterable[int], now: float) -> float:
        """A step of this batch took ``t_real`` seconds, ending at ``now``; returns β."""
        return self.observe_time(t_real, self.model.batch_time(prefills, decodes), now)

    def observe_time(self, t_real: float, t_model: float, now: float, steps: int = 1) -> float:
        """``t_real`` measured where the uncorrected model predicted ``t_model``: one step, or a
        run of ``steps`` steps whose model times were summed (the simulator's macro-steps).
        Returns β; δ is :attr:`delta`."""
        return self.corrector.observe(t_real, t_model, now, steps)

    def adopt(self, beta: float, delta: float = 0.0) -> None:
        """Take a correction measured elsewhere (the dispatcher mirrors each prefill worker's
        β and δ), clamped to this estimator's bounds."""
        self.corrector.adopt(beta, delta)

    def get_max_chunk(self, l_kv: int, remaining: int, budget: float) -> int:
        """GETMAXCHUNK: largest l_q ≤ ``remaining`` with β·T~_p(l_q, l_kv) ≤ ``budget``."""
        return self.costs().max_chunk(l_kv, remaining, budget)
