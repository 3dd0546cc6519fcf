"""GoRouting (§4.3, Algorithm 2): gain-oriented, capability-aware dispatching.

For each prefill (or co-located) instance ``p``:

1. ``Δ_p = ESTIMATEGAIN(Q ∪ {req}) − ESTIMATEGAIN(Q)`` (lines 2-7), with the
   φ_p-based estimate on prefill-only instances and the φ_a-based one (Eq. 8,
   plus the decode load ``n_d·b_d``) on co-located instances; see
   :mod:`proserve.scheduler.routing.estimates`;
2. candidates ``C = {p : Δ_p ≥ α·Δ_max}`` (line 8);
3. if ``Δ_max > 0`` (some instance meets req's TTFT SLO): light set
   ``L = {p ∈ C : ESTIMATEEXEC(p) < μ·TTFT_SLO}``, heavy set
   ``H = {p ∈ C : ESTIMATEEXEC(p, req) > λ·TTFT_SLO}`` (lines 10-11); the most
   idle of L (line 13), else the *heaviest* of C − H (line 15: pack, keeping
   the lighter instances free for later long or high-priority requests, the
   over-balancing fix of §3.3), else the least loaded of C (line 17);
4. otherwise a uniformly random instance (line 19, seeded).

The decode instance is the one with the most free KV blocks (line 20, base class).
``last_decision`` (:class:`GoDecision`) keeps the Δ_p, loads, C, L, H and the
branch of the latest call, for logs and tests. ``C`` is recorded as line 8
computes it; it is only used when Δ_max > 0 (for Δ_max < 0, α·Δ_max lies
above Δ_max and C may even be empty, which the fallback never reads).

Defaults (the paper gives none; all settable, validated):

* ``alpha = 0.9``: near-max gain. When every instance can serve req and
  nobody else is pushed past a deadline, all Δ_p equal w_r(1) and all are
  candidates; an instance where admitting req would also make a queued request
  miss (Δ_p = w_req − w_other) drops out unless the loss is under 10 % of the
  best Δ. α = 1 keeps only exact ties.
* ``mu = 0.2``: an instance whose queued prefill drains within 20 % of the
  TTFT SLO counts as light (nearly idle); sending req there costs it little
  latency and avoids idling an instance (case 1 of §4.3). μ = 0 disables L.
* ``lam = 0.8`` (λ): an instance that would finish req only after 80 % of its
  TTFT SLO is too risky to pile onto: the estimate has error (the latency model's
  ~5 % MAPE, lag, requests that jump the queue locally) and the last 20 % is
  the margin. Note ESTIMATEEXEC(p, req) is the instance's whole backlog with
  req added, not req's own completion: req may overtake queued requests with
  later deadlines, so a candidate can still be heavy at λ = 1; a large λ
  disables H. ``mu <= lam`` is required (μ is the lower threshold, λ the upper).
* ``fallback = "random"``: line 19 when no instance can meet req's TTFT SLO
  (Δ_max ≤ 0). ``"min_load"`` picks the least ESTIMATEEXEC instead — not in
  the paper; an option because under sustained load the fallback is taken for
  most requests (see docs/results.md).
* ``eta`` (co-located only): floor of the t_budget estimate, default the
  tightest class TPOT SLO, as SlideBatching's η (see ``estimates.resolve_eta``).

``TTFT_SLO`` in lines 10-11 is ``req.ttft_slo`` as written in the paper (not
its remaining time; they differ only if the dispatcher holds req before routing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import validate
from ..registry import register_global
from .base import DISAGGREGATED, GlobalPolicy
from .estimates import evaluate, resolve_eta

FALLBACKS = ("random", "min_load")
BRANCHES = ("light", "fill", "balance", "fallback")


@dataclass
class GoDecision:
    """Why GoRouting chose what it chose (the last call), for logs and tests."""

    request: str
    chosen: int
    branch: str                       # "light" (line 13), "fill" (15), "balance" (17), "fallback" (19)
    delta_max: float
    deltas: dict[int, float] = field(default_factory=dict)     # Δ_p per instance id
    exec: dict[int, float] = field(default_factory=dict)       # ESTIMATEEXEC(p)
    exec_with: dict[int, float] = field(default_factory=dict)  # ESTIMATEEXEC(p, req)
    candidates: list[int] = field(default_factory=list)        # C
    light: list[int] = field(default_factory=list)             # L
    heavy: list[int] = field(default_factory=list)             # H


@register_global
class GoRouting(GlobalPolicy):
    name = "go_routing"
    summary = "PROSERVE GoRouting (Alg. 2): TDG-gain candidates, dual-threshold capability-aware choice"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0,
                 alpha: float = 0.9, mu: float = 0.2, lam: float = 0.8, eta: float | None = None,
                 fallback: str = "random"):
        super().__init__(gain, classes, deployment, seed)
        n = self.name
        self.alpha = validate.number(n, "alpha", alpha, 0, 1, lo_open=True)
        self.mu = validate.non_negative(n, "mu", mu)
        self.lam = validate.positive(n, "lam", lam)
        if self.mu > self.lam:
            validate.fail(n, "mu (lower threshold)", f"<= lam (upper threshold) = {lam!r}", mu)
        self.eta = resolve_eta(eta, self.classes, n)
        self.fallback = validate.one_of(n, "fallback", fallback, FALLBACKS)
        self.last_decision: GoDecision | None = None

    def select_prefill(self, req, prefills, now):
        gain, dep, eta = self.gain, self.deployment, self.eta
        ests = [evaluate(p, req, now, gain, dep, eta) for p in prefills]   # lines 2-7
        delta_max = max(e.delta for e in ests)
        # line 8; the relative slack absorbs float noise in sums of equal weights
        thr = self.alpha * delta_max - 1e-9 * abs(delta_max)
        C = [i for i, e in enumerate(ests) if e.delta >= thr]
        L: list[int] = []
        H: list[int] = []
        if delta_max > 0:                                                   # line 9
            ttft = req.ttft_slo
            L = [i for i in C if ests[i].exec < self.mu * ttft]             # line 10
            H = [i for i in C if ests[i].exec_with > self.lam * ttft]       # line 11
            if L:                                                           # line 13: most idle in L
                best, branch = min(L, key=lambda i: (ests[i].exec, prefills[i].id)), "light"
            else:
                heavy = set(H)
                rest = [i for i in C if i not in heavy]
                if rest:                                                    # line 15: heaviest of C − H
                    best, branch = min(rest, key=lambda i: (-ests[i].exec, prefills[i].id)), "fill"
                else:                                                       # line 17: least loaded of C
                    best, branch = min(C, key=lambda i: (ests[i].exec, prefills[i].id)), "balance"
        elif self.fallback == "min_load":                                   # variant of line 19
            best, branch = min(range(len(prefills)), key=lambda i: (ests[i].exec, prefills[i].id)), "fallback"
        else:                                                               # line 19: RANDOMSELECT(P)
            best, branch = self.rng.randrange(len(prefills)), "fallback"
        ids = [p.id for p in prefills]
        self.last_decision = GoDecision(
            request=req.id, chosen=ids[best], branch=branch, delta_max=delta_max,
            deltas={ids[i]: e.delta for i, e in enumerate(ests)},
            exec={ids[i]: e.exec for i, e in enumerate(ests)},
            exec_with={ids[i]: e.exec_with for i, e in enumerate(ests)},
            candidates=[ids[i] for i in C], light=[ids[i] for i in L], heavy=[ids[i] for i in H])
        return prefills[best]
