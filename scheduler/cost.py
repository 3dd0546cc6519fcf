"""What work costs, as every policy, router and the simulator read it (§4.1, Eq. 5-7).

    T~_p(l_q, l_kv) = a_p·l_q² + b_p·l_q·l_kv + c_p·l_q      (Eq. 5, prefill chunk)
    T~_d(l_kv)      = a_d·l_kv + b_d                          (Eq. 6, decode step)
    T_pd(B)         = Σ T~_p + Σ T~_d + t_c                   (Eq. 7, one batch)

:class:`StepCosts` holds the six coefficients with the online correction
already applied (β = 1, δ = 0: the fitted model itself), so that a policy's
per-request loop reads a cost with one call and no coefficient juggling. The
correction is a scale β and a per-step offset δ (a corrected step takes
β·T_pd + δ, :class:`proserve.scheduler.estimator.OnlineCorrector`): every coefficient
is multiplied by β, and δ joins the per-step constant, t_c' = β·t_c + δ, since
every formula here charges t_c exactly once per step (Eq. 7; ``decode_run``
once per step of the run) and nothing else (``exec`` and GETMAXCHUNK price a
request's share of a step, without t_c). Build one per
scheduling step with :meth:`proserve.scheduler.estimator.Estimator.costs` (cached while
β and δ are unchanged) or :meth:`StepCosts.of`. Alongside Eq. 5-7 it answers the
derived questions the policies and the simulator ask:

* :meth:`StepCosts.next_work`: ``exec`` of Alg. 1 line 3, the time of a
  request's next piece of work (its remaining prefill, or one decode step);
  :func:`queue_terms` the same with the time to each next token's deadline,
  for a whole queue in one pass (a policy's per-step loop);
* :meth:`StepCosts.max_chunk`: GETMAXCHUNK (Alg. 1 line 15), the largest
  prefill chunk within a time budget;
* :meth:`StepCosts.decode_run`: the step times of ``k`` consecutive decode
  steps of one batch whose contexts grow by a token each step (the simulator's
  macro-steps).

The next token's deadline (Eq. 3) is :meth:`proserve.scheduler.tdg.GainConfig.next_token_deadline`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np


class StepCosts:
    """Eq. 5-7 with every coefficient scaled by ``beta`` and ``delta`` added to the
    per-step constant: a step's time is ``beta·T_pd + delta``."""

    __slots__ = ("a_d", "a_p", "b_d", "b_p", "beta", "c_p", "delta", "t_c")

    def __init__(self, a_p: float, b_p: float, c_p: float, a_d: float, b_d: float, t_c: float,
                 beta: float = 1.0, delta: float = 0.0):
        self.a_p, self.b_p, self.c_p = a_p * beta, b_p * beta, c_p * beta
        self.a_d, self.b_d = a_d * beta, b_d * beta
        self.t_c = t_c * beta + delta          # δ is a per-step cost: it joins t_c
        self.beta, self.delta = beta, delta

    @classmethod
    def of(cls, model, beta: float = 1.0, delta: float = 0.0) -> StepCosts:
        """The costs of a :class:`~proserve.scheduler.estimator.LatencyModel` at correction ``beta``, ``delta``."""
        return cls(model.a_p, model.b_p, model.c_p, model.a_d, model.b_d, model.t_c, beta, delta)

    # -- Eq. 5-7 -------------------------------------------------------------------
    def prefill(self, l_q: int, l_kv: int = 0) -> float:
        """Eq. 5: a prefill chunk of ``l_q`` tokens over ``l_kv`` cached ones."""
        return (self.a_p * l_q + self.b_p * l_kv + self.c_p) * l_q

    def decode(self, l_kv: float) -> float:
        """Eq. 6: one decode step at context ``l_kv``."""
        return self.a_d * l_kv + self.b_d

    def batch(self, prefills: Iterable[tuple[int, int]] = (), decodes: Iterable[int] = ()) -> float:
        """Eq. 7: a batch of prefill chunks ``(l_q, l_kv)`` and decodes at contexts ``l_kv``."""
        return (sum(self.prefill(q, k) for q, k in prefills)
                + sum(self.decode(k) for k in decodes) + self.t_c)

    # -- what the policies derive from them ------------------------------------------
    def next_work(self, r) -> float:
        """``exec`` of Alg. 1 line 3: T~_p of the remaining prefill, else one T~_d (no t_c)."""
        q = r.prefill_len - r.prefilled
        return self.prefill(q, r.kv_len) if q > 0 else self.decode(r.kv_len)

    def max_chunk(self, l_kv: int, remaining: int, budget: float) -> int:
        """GETMAXCHUNK: the largest ``l_q ≤ remaining`` with ``prefill(l_q, l_kv) ≤ budget``.

        The positive root of a_p·l² + (b_p·l_kv + c_p)·l − budget = 0, floored.
        """
        if budget <= 0 or remaining <= 0:
            return 0
        lin = self.b_p * l_kv + self.c_p
        if self.a_p > 0:
            root = (-lin + math.sqrt(lin * lin + 4 * self.a_p * budget)) / (2 * self.a_p)
        else:
            root = budget / lin
        n = min(remaining, int(root + 1e-9))  # +eps: float noise just below an integer root
        # guard the floor against rounding at the boundary
        while n > 0 and self.prefill(n, l_kv) > budget * (1 + 1e-12):
            n -= 1
        return max(n, 0)

    def decode_run(self, kv_sum: int, n: int, k: int) -> np.ndarray:
        """Times of ``k`` consecutive decode-only steps of ``n`` requests whose contexts sum
        to ``kv_sum`` at the first step and each grow by one token per step (Eq. 6-7)."""
        return self.t_c + n * self.b_d + self.a_d * (kv_sum + n * np.arange(k))

    def decode_run_total(self, kv_sum: int, n: int, k: int) -> float:
        """``decode_run(kv_sum, n, k).sum()`` in closed form."""
        return k * (self.t_c + n * self.b_d + self.a_d * kv_sum) + self.a_d * n * k * (k - 1) / 2


def queue_terms(costs: StepCosts, gain, Q, now: float) -> tuple[list[float], list[float]]:
    """``exec`` and ``remain`` of every request of ``Q`` (Alg. 1 lines 3-4) in one pass:
    :meth:`StepCosts.next_work`, and the time from ``now`` to the next token's deadline
    (Eq. 3, :meth:`proserve.scheduler.tdg.GainConfig.next_token_deadline`). The form for a
    policy's per-step loop over its whole queue; ``tests/test_cost.py`` checks it
    against the scalar definitions."""
    a_p, b_p, c_p, a_d, b_d = costs.a_p, costs.b_p, costs.c_p, costs.a_d, costs.b_d
    anchored = gain.deadline == "ttft_anchored"
    execs, remains = [], []
    for r in Q:
        q = r.prefill_len - r.prefilled
        kv = r.kv_len
        execs.append((a_p * q + b_p * kv + c_p) * q if q > 0 else a_d * kv + b_d)   # Eq. 5 / Eq. 6
        tt = r.token_times
        anchor = r.ttft_slo
        if anchored and tt:
            anchor = min(tt[0] - r.arrival, anchor)
        remains.append(r.arrival + anchor + len(tt) * r.tpot_slo - now)            # Eq. 3
    return execs, remains

