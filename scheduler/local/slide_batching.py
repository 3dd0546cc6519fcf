"""SlideBatching (§4.2, Algorithm 1).

Each step:

1. for every queued request compute ``exec`` (T~_pd, line 3), ``remain`` (time
   to the deadline of its next token, line 4) and ``density`` (w_r of that
   token per second of exec, line 5);
2. latency budget ``t_budget = max(min remain, η)`` (lines 6-7);
3. URGENT iff ``remain < γ·φ(r, Q)`` (lines 8-12), with φ_a (Eq. 8), φ_c
   (Eq. 9) or φ_p (prefill-only instances);
4. URGENT by density descending, then NORMAL by remain ascending (line 13);
5. fill from t_batch = t_c with GETMAXCHUNK chunks until the budget or the KV
   memory runs out (lines 14-18).

Defaults, which the paper leaves open:

* ``gamma = 1.0``: a request is URGENT exactly when the load-judgment φ says it
  would miss its deadline. γ > 1 leans to density-first (short-term gain),
  γ < 1 to deadline-first (§4.2 "aggressiveness coefficient").
* ``eta`` = the tightest TPOT SLO of the configured classes (0.1 s by default).
  §4.2 notes t_budget fluctuates in [η, max TPOT_SLO] under load; η equal to the
  TPOT SLO keeps decodes riding in an η-sized batch on time, and keeps the
  fixed overhead t_c a small share of each batch (12 ms of 100 ms on the
  bundled model) when every deadline has already passed and min remain < 0.
* ``phi = "auto"``: φ_a on co-located instances (the paper's choice, §4.4) and
  φ_p on prefill-only instances; ``"a"``, ``"c"`` or ``"p"`` force one.
"""

from __future__ import annotations

import math
import operator

from ..cost import queue_terms
from ..registry import register_local
from ..request import ConfigError
from .base import COLOCATED, PREFILL_ONLY, BatchBuilder, BatchPlan, InstanceView, LocalPolicy

PHIS = ("auto", "a", "c", "p")


@register_local
class SlideBatching(LocalPolicy):
    name = "slide_batching"
    summary = "PROSERVE SlideBatching (Alg. 1): latency budget, sliding URGENT/NORMAL boundary"

    #: how requests are ordered: "slide" (the algorithm), or an ablation of §5.4
    ordering = "slide"
    #: False for the "w/o latency-aware" ablation (fixed token budget instead of t_budget)
    latency_aware = True

    def __init__(self, estimator, gain=None, classes=None, gamma: float = 1.0,
                 eta: float | None = None, phi: str = "auto", token_budget: int | None = None):
        super().__init__(estimator, gain, classes)
        if not isinstance(gamma, (int, float)) or not gamma > 0 or math.isnan(gamma):
            raise ConfigError(f"{self.name}: gamma must be > 0, got {gamma!r}")
        if eta is None:
            eta = self.min_tpot_slo()
        if not isinstance(eta, (int, float)) or not eta > 0:
            raise ConfigError(f"{self.name}: eta must be > 0, got {eta!r}")
        if phi not in PHIS:
            raise ConfigError(f"{self.name}: phi must be one of {', '.join(PHIS)}, got {phi!r}")
        if token_budget is not None and token_budget < 1:
            raise ConfigError(f"{self.name}: token_budget must be >= 1, got {token_budget!r}")
        self.gamma = float(gamma)
        self.eta = float(eta)
        self.phi = phi
        self.token_budget = token_budget

    # -- Alg. 1 lines 1-7 --------------------------------------------------------
    def _annotate(self, Q, now: float) -> float:
        """Set r.exec, r.remain, r.density; return min remain (t_min)."""
        execs, remains = queue_terms(self.est.costs(), self.gain, Q, now)   # lines 3-4
        w_p, w_d = self.gain.w_p, self.gain.w_d
        t_min = math.inf
        for r, ex, rem in zip(Q, execs, remains):
            if ex <= 0:
                ex = 1e-9
            r.exec = ex
            r.remain = rem
            r.density = (w_d if r.token_times else w_p) * r.weight / ex  # line 5
            if rem < t_min:
                t_min = rem
        return t_min

    # -- Alg. 1 lines 8-12 ---------------------------------------------------------
    def _phi_kind(self, mode: str) -> str:
        if self.phi != "auto":
            return self.phi
        return "p" if mode == PREFILL_ONLY else "a"

    def _mark_urgent(self, Q, t_budget: float, mode: str) -> None:
        g = self.gamma
        t_c = self.est.t_c
        kind = self._phi_kind(mode)
        if kind == "p":
            # φ_p(r, Q) = Σ exec + |Q|·t_c  (one request per batch, worst case)
            limit = g * (sum(r.exec for r in Q) + len(Q) * t_c)
            for r in Q:
                r.urgent = r.remain < limit
            return
        scale = t_budget / (t_budget - t_c) if t_budget > t_c else math.inf
        if kind == "a":
            # Eq. 8: φ_a(Q) = t_budget/(t_budget - t_c) · Σ_{r∈Q} r.exec
            limit = g * scale * sum(r.exec for r in Q)
            for r in Q:
                r.urgent = r.remain < limit
        else:
            # Eq. 9: φ_c(req, Q) = t_budget/(t_budget - t_c) · Σ_{i≤req.index} Q[i].exec, Q by remain asc
            acc = 0.0
            for r in sorted(Q, key=_by_remain):
                acc += r.exec
                r.urgent = r.remain < g * scale * acc

    def _order(self, Q):
        """Line 13: URGENT by density desc, then NORMAL by remain asc."""
        if self.ordering == "deadline":
            for r in Q:
                r.urgent = False
            return sorted(Q, key=_by_remain), 0, len(Q)
        if self.ordering == "density":
            for r in Q:
                r.urgent = True
            return sorted(Q, key=_by_density, reverse=True), len(Q), 0
        urgent = [r for r in Q if r.urgent]
        normal = [r for r in Q if not r.urgent]
        urgent.sort(key=_by_density, reverse=True)   # stable, as a key of -density
        normal.sort(key=_by_remain)
        return urgent + normal, len(urgent), len(normal)

    def schedule(self, view: InstanceView) -> BatchPlan:
        Q = list(view.waiting)
        if view.mode == COLOCATED:
            Q += view.decoding
        b = BatchBuilder(view, self.est)
        if not Q:
            return b.finish(t_budget=0.0)
        t_min = self._annotate(Q, view.now)
        t_budget = max(t_min, self.eta)                        # lines 6-7
        if self.ordering == "slide":
            self._mark_urgent(Q, t_budget, view.mode)
        ordered, n_urgent, n_normal = self._order(Q)
        if self.latency_aware:
            self._fill_time(b, ordered, t_budget)
            return b.finish(t_budget=t_budget, n_urgent=n_urgent, n_normal=n_normal)
        tokens = self.token_budget or self.tbt_token_budget()
        b.fill_tokens(ordered, tokens)
        return b.finish(t_budget=float("nan"), token_budget=tokens, n_urgent=n_urgent, n_normal=n_normal)

    # -- Alg. 1 lines 14-18 ----------------------------------------------------------
    def _fill_time(self, b: BatchBuilder, ordered, t_budget: float) -> None:
        est = self.est
        c = est.costs()
        # nothing costs less than one prefill token or one decode step: stop when even that won't fit
        cheapest = min(c.prefill(1, 0), c.decode(0))
        for r in ordered:
            left = t_budget - b.time
            if left <= cheapest:
                break
            if r.prefilled < r.prefill_len:
                n = est.get_max_chunk(r.kv_len, r.prefill_len - r.prefilled, left)  # GETMAXCHUNK
                if n == 0:
                    continue
                # memory is not enough for this request (line 15): it waits; requests
                # already holding KV (decodes, partial prefills) may still fit
                b.add_prefill(r, n)
            elif r.exec <= left:
                b.add_decode(r)
        if b.plan.empty:
            # Budget smaller than any single item (η < t_c + one token): still make
            # progress with the first request in order, one block's worth of prompt.
            r = ordered[0]
            if r.prefilled < r.prefill_len:
                b.add_prefill(r, max(1, min(b.view.block_size, r.prefill_len - r.prefilled)))
            else:
                b.add_decode(r)


_by_remain = operator.attrgetter("remain")
_by_density = operator.attrgetter("density")
