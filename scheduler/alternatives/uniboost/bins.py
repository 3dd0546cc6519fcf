"""UniBoost's building blocks as small pure functions (Li et al., "Beyond
Prediction: Tail-Aware Scheduling for LLM Inference", Algorithm 1
and §3.2-3.4): the γ-boost curve, MemGuard's geometric bins and the bound on
priority revisions they give, the paper's empirical percentile, and the
adaptive-γ tail estimator (γ-Ada). The policy that uses them is
:mod:`proserve.scheduler.alternatives.uniboost.local`; they live outside ``scheduler/local/`` because
every module there is registered as a policy.

Choices where the paper contradicts itself (each is stated again where it is
used):

* **Rounding of the bins.** Eq. 8 rounds up (``k·2^⌈log2(max{w,k}/k)⌉``, bound
  ``1 + ⌈log2(S/k)⌉``); Algorithm 1's QUANTIZE rounds down
  (``k·2^⌊log2(max{1,s/k})⌋``, line 23's bound ``1 + ⌊log2(S/k)⌋``). We round
  **down**: it is the algorithm's own helper, it is the one that matches the
  paper's worked example (§3.3: a 10k-token decode with k = 256 has "at most 6"
  revision points: ``1 + ⌊log2(10000/256)⌋ = 1 + 5 = 6``, whereas rounding up
  gives 7), and it is the one Lemma A.1 analyses (a job of attained service
  ``a`` gets a boost of at most ``b_γ(a/2)``: rounding down keeps the bin above
  ``a/2``).
* **The γ estimator's constant.** Eq. 9 fits ``ln F̄(t) ≈ a - γ·t`` through
  ``(t95, F̄ = 0.05)`` and ``(t99, F̄ = 0.01)``, which gives
  ``γ̂ = (ln 0.05 - ln 0.01)/(t99 - t95) = ln 5/Δ``; Algorithm 1 line 17 writes
  ``(log 99 - log 95)/Δ = ln(99/95)/Δ``, 39 times smaller (it takes the CDF
  values 0.99/0.95 where Eq. 9 takes the survival values 0.01/0.05). We use
  Eq. 9 (``tail_constant="eq9"``): it recovers the rate of an exponential tail
  exactly, which is what γ means in γ-Boost (Yu & Scully 2024);
  ``tail_constant="alg1"`` reproduces the algorithm's literal constant.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable, Sequence

from ... import validate

#: Eq. 9: -(ln F̄(t99) - ln F̄(t95)) = ln(0.05/0.01)
LN5 = math.log(5.0)
#: Algorithm 1 line 17: log(99) - log(95)
LN_99_95 = math.log(99.0) - math.log(95.0)
TAIL_CONSTANTS = {"eq9": LN5, "alg1": LN_99_95}


# -- Eq. 2 / Algorithm 1 BOOST -----------------------------------------------------------
def boost(x: float, gamma: float) -> float:
    """``b_γ(x) = (1/γ)·log(1/(1 - e^{-γx}))`` (Eq. 2), decreasing in ``x``.

    Written as ``-log(-expm1(-γx))/γ`` so that it stays accurate both for
    ``γx`` near 0 (large boost, ``≈ log(1/(γx))/γ``) and for large ``γx``
    (boost ``≈ e^{-γx}/γ`` → 0: FCFS). ``x`` and ``1/γ`` must be in the same
    unit (the policy uses seconds). ``b_γ(0) = ∞``.
    """
    if x <= 0:
        return math.inf
    return -math.log(-math.expm1(-gamma * x)) / gamma


# -- MemGuard (§3.3, Algorithm 1 QUANTIZE) ----------------------------------------------------
def quantize(s: int, k: int) -> int:
    """``k·2^⌊log2(max{1, s/k})⌋``: the geometric bin of ``s`` tokens (Alg. 1 QUANTIZE).

    Bins are ``[0, 2k) → k``, ``[2k, 4k) → 2k``, ``[4k, 8k) → 4k``, … (rounding
    down, see the module docstring). Integer arithmetic, so bin edges are exact:
    for ``s ≥ k``, ``⌊log2(s/k)⌋ = ⌊log2(⌊s/k⌋)⌋`` because the floor of a log2
    only changes at powers of two, which are integers.
    """
    q = int(s) // k
    if q <= 1:
        return k
    return k << (q.bit_length() - 1)


def next_threshold(s: int, k: int) -> int:
    """The signal value at which ``s`` leaves its bin: ``2·quantize(s, k)``.

    MemGuard keeps a dispatched request non-evictable until its signal reaches
    this value (§3.3 "until it reaches the next threshold")."""
    return 2 * quantize(s, k)


def revision_bound(S: int, k: int) -> int:
    """Most priority-revision points a request of ``S`` decode tokens can have:
    ``1 + ⌊log2(S/k)⌋`` (Algorithm 1 line 23; 1 when ``S < 2k``)."""
    q = max(int(S) // k, 1)
    return q.bit_length()  # = 1 + ⌊log2 q⌋


# -- §3.4: the empirical percentile and γ-Ada ------------------------------------------------------
def empirical_quantile(sorted_values: Sequence[float], p: float) -> float:
    """The paper's empirical ``p``-th percentile (§3.4, under Eq. 9):
    ``t_p = inf{t : F̄_n(t) ≤ (100 - p)/100}`` with ``F̄_n`` the empirical survival
    function — the smallest sample with at most a ``(100-p)%`` share above it, i.e.
    the ``⌈n·p/100⌉``-th smallest (no interpolation). ``sorted_values`` ascending."""
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    validate.number("", "percentile", p, 0, 100, lo_open=True)
    # ⌈n·p/100⌉, rounded first so that float noise (n·p/100 = 99.00000000000001) cannot add one
    i = math.ceil(round(n * p / 100, 9))
    return float(sorted_values[max(i, 1) - 1])


def percentile(values: Iterable[float], p: float) -> float:
    """:func:`empirical_quantile` of unsorted ``values``."""
    return empirical_quantile(sorted(values), p)


class TailGamma:
    """γ-Ada (§3.4; Algorithm 1 UPDATEGAMMA): the exponential rate of the recent
    end-to-end latency tail, EMA-smoothed and clipped.

    Each :meth:`observe` adds one completed request's latency (TTLT, seconds)
    to a sliding window of the last ``window`` samples; once ``min_samples`` are
    in, it runs UPDATEGAMMA (lines 15-19)::

        Δ  = max(t99 - t95, ε)                 # line 16
        γ̂  = C / Δ,  C = ln 5 (Eq. 9) or ln(99/95) (line 17, literal)
        γ  ← (1 - smoothing)·γ + smoothing·γ̂   # line 18 (the paper's β)
        γ  ← clip(γ, γ_min, γ_max)             # line 19

    Algorithm 1 calls UPDATEGAMMA at every scheduler iteration (line 4), but its
    input ``S`` only changes when a request completes (line 28); running the
    EMA once per new sample instead makes γ independent of how often the engine
    steps (and of the simulator's macro-steps) while using exactly the same
    information.
    """

    def __init__(self, gamma: float, gamma_min: float, gamma_max: float, smoothing: float,
                 epsilon: float, window: int, min_samples: int, tail_constant: str = "eq9",
                 where: str = "uniboost"):
        gamma = validate.positive(where, "gamma", gamma)
        self.gamma_min = validate.positive(where, "gamma_min", gamma_min)
        self.gamma_max = validate.positive(where, "gamma_max", gamma_max)
        self.epsilon = validate.positive(where, "epsilon", epsilon)
        if self.gamma_min > self.gamma_max:
            validate.fail(where, "gamma_min", f"<= gamma_max ({gamma_max!r})", gamma_min)
        self.smoothing = validate.number(where, "smoothing", smoothing, 0, 1, lo_open=True)
        window = validate.integer(where, "window", window, 2)
        self.min_samples = validate.integer(where, "min_samples", min_samples, 2)
        if self.min_samples > window:
            validate.fail(where, "min_samples", f"<= window ({window})", min_samples)
        validate.one_of(where, "tail_constant", tail_constant, TAIL_CONSTANTS)
        self.gamma = min(max(gamma, self.gamma_min), self.gamma_max)
        self.C = TAIL_CONSTANTS[tail_constant]
        self.samples: deque[float] = deque(maxlen=window)   # the window 𝓛
        self.updates = 0
        self.last_estimate = float("nan")                     # γ̂ of the latest update

    def estimate(self) -> float:
        """γ̂ of the current window (lines 15-17), NaN below ``min_samples``."""
        if len(self.samples) < self.min_samples:
            return float("nan")
        xs = sorted(self.samples)
        x95 = empirical_quantile(xs, 95)                      # line 15
        x99 = empirical_quantile(xs, 99)
        delta = max(x99 - x95, self.epsilon)                  # line 16
        return self.C / delta                                 # line 17 (Eq. 9)

    def observe(self, latency: float) -> float:
        """Add one E2E latency sample (line 28) and update γ (lines 15-19); returns γ."""
        if not math.isfinite(latency) or latency < 0:
            return self.gamma
        self.samples.append(float(latency))
        g_hat = self.estimate()
        if g_hat == g_hat:  # not NaN
            self.last_estimate = g_hat
            g = (1.0 - self.smoothing) * self.gamma + self.smoothing * g_hat   # line 18
            self.gamma = min(max(g, self.gamma_min), self.gamma_max)           # line 19
            self.updates += 1
        return self.gamma
