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
   over-balancing fix of §3.3), else the least loaded of C (line 17); with
   the schedule-aware estimate (``order``, below) L and line 17 read req's own
   wait and completion instead of the backlog;
4. otherwise a uniformly random instance (line 19, seeded);
5. with ``choose="scorers"``, steps 3-4 choose by llm-d's score instead (below).

The decode instance is the one with the most free KV blocks, less those promised to requests
routed there whose prefill has not ended (line 20, base class: ``DecodeInstance.room``).
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
  With the schedule-aware estimate it is req's own wait that must be under
  20 %: an instance with a long backlog that req overtakes is light for req
  (and may be in H too, which line 13 never reads).
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
* ``kv_fit = True`` (not the paper's): KV memory is a capability too. An
  instance whose free KV (``routing.base.kv_room``: the reported
  ``kv_usage`` less the prefills queued there) cannot hold req's prompt (net
  of its expected cached prefix) cannot start req's prefill until decodes free
  memory, which ESTIMATEEXEC (compute time) does not see: it is put in H and
  kept out of L, and line 19's fallback picks among the instances that can
  hold req when any can. Inert where the usage is not reported or every
  prompt fits (short prompts); on the Mooncake trace (15k-token prompts, an
  instance's KV holds ~7) it is what keeps GoRouting from queueing behind a
  full cache (docs/results.md §2.3).
* ``fallback = "random"``'s alternatives: ``"min_load"`` (above) and
  ``"most_room"``, the instance with the most KV room: a request that can meet
  its TTFT nowhere starts its prefill, and its decode catches up, soonest
  where its KV can be allocated (§2.3).
* ``fallback = "catch_up"`` (issue 14, not the paper's; not the default): line
  19 in TDG's own currency. Under fixed deadlines (Eq. 3) a request that
  misses its first token still earns every decode token that catches up with
  its deadline, so where no instance meets req's first token the instances
  still differ in gain. Each is priced by the decode-token gain lost there
  (:meth:`~proserve.scheduler.tdg.GainConfig.late_decode_gain`): req's own
  (its first token ``done − remain`` late) plus that of every request queued
  there, each counted as delayed by req's prefill (``exec_with − exec``; an
  upper bound, as some go before req in the local order). The decode step is
  ``t_c + (n_d + 1)·b_d`` co-located (Eq. 7's decode-only step with req's
  decode added) and half the TPOT SLO on prefill-only instances (the decode
  side is chosen afterwards, line 20, so no prefill choice changes it), at
  most 0.95 of the TPOT SLO; the number of decode tokens is the mean of the
  requests that finished so far (256 before the first). Line 19's random
  draw is then made among the instances whose loss is within one decode
  token's gain (w_d·w_prio) of the least: taking the least outright, ties by
  backlog and id, piled the hopeless requests onto the few idle instances
  that tie at light load and evicted the prefixes cached there
  (docs/results.md §2.3).
* ``choose = "thresholds"``: how to choose among the instances once lines
  2-11 have judged them. ``"scorers"`` (issue 14, not the paper's) keeps
  GoRouting's judgement of *which* instances can serve req (C − H: near-max
  gain, not too risky to pile onto, with ``kv_fit`` enough KV room; all of C
  if that is empty) and picks *among* them by llm-d's weighted score (3 ·
  prefix-match fraction + 2 · relative queue + 2 · free KV, its published
  weights; ``baselines.llmd_scorers``), ties at random; on prefill-only
  instances (disaggregated) without the free-KV term: their KV is handed to
  the decode side as each prefill ends, so its usage says how much prefill is
  in flight (the queue term's business) and nothing about room for later
  requests (``kv_fit`` judges room); measured on 4P+4D, dropping it gained
  0.0007-0.0016 TDG_Ratio at 1-2 req/s, 8 seeds (docs/results.md §2.3). Line 19 (no instance
  meets req's TTFT) picks the same way among *all* instances, ``kv_fit``'s
  filter left out (the score's KV term weighs free memory already; filtering
  too cost 0.003 TDG_Ratio at 14 req/s on 32 instances), so ``fallback`` must
  stay ``"random"``. Why: on the Mooncake trace (15k-token prompts, an
  instance's KV holds ~7) lines 13-17 pick by this request's wait alone, while
  the score's prefix and free-KV terms stand for what a choice leaves the
  *next* requests (cache affinity, room to start), which no request's gain
  prices; docs/results.md §2.3 measures both.
* ``order = "local"``: the queue order ESTIMATEGAIN assumes on each instance
  (issue 14, not the paper's): ``"local"`` takes the order its local policy
  serves in (``PrefillInstance.order``, from the policy's ``router_order``:
  SlideBatching's URGENT-by-density then deadline; the paper's for the others),
  so that requests the local scheduler has already given up on do not count
  as ahead of the new request; ``"deadline"`` is the paper's estimate for every
  instance (remain order, §4.3); ``"slide"`` or ``"fcfs"`` force one. See ``estimates``, "Schedule-aware estimate",
  and docs/results.md §2.

Loads under a schedule-aware estimate. Where the local order lets req overtake
queued work, the backlog no longer says how long req waits, so line 10's
light set and line 17's balance read req's own wait (``Estimate.start``) and
completion (``Estimate.done``) in that order. Lines 11 and 15 keep the backlog
as written: the order is dynamic (a later, denser arrival overtakes req in
turn), so whether an instance is too risky to pile onto is judged on all its
queued work. Measured (docs/results.md §2, SlideBatching, 4P+8D, 3 seeds):
reading req's own completion for H and its wait for line 15 as well packs
requests that later arrivals then push past their deadline (first-token
TDG_Ratio 0.998 against 0.999 at 35 req/s, 0.894 against 0.898 at 45).

Line 13's "most idle" under a schedule-aware estimate is the instance with
the least wait for req less the prefill its expected cached prefix saves there
(``Estimate.saved``; with a prefix index, ``PrefillInstance.prefix``); as
written (``order=deadline``) the least backlog. Ranking by req's completion
instead (wait plus its own prefill) is the same up to each instance's β,
and that difference cost 0.0003-0.0008 TDG_Ratio co-located at 29-35 req/s.

Ties (not in the paper): equal loads go to the smaller backlog, then to the
instance with fewer running decodes (co-located: with empty prefill queues
every instance's load is 0, and a tie broken by id alone sent every request
to instance 0 and its decodes with them), then the lower id.

``TTFT_SLO`` in lines 10-11 is ``req.ttft_slo`` as written in the paper (not
its remaining time; they differ only if the dispatcher holds req before routing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import validate
from ..baselines.llmd_scorers import W_KV, llmd_scores, pick_max
from ..registry import register_global
from .base import DISAGGREGATED, GlobalPolicy, expected_hit, kv_room
from .estimates import evaluate, order_of, queue_classes, resolve_eta, resolve_order

FALLBACKS = ("random", "min_load", "most_room", "catch_up")
#: ``fallback="catch_up"``: decode tokens per request assumed before the first request ends here
N_OUT_PRIOR = 256.0
CHOOSE = ("thresholds", "scorers")
BRANCHES = ("light", "fill", "balance", "scored", "fallback")


@dataclass
class GoDecision:
    """Why GoRouting chose what it chose (the last call), for logs and tests."""

    request: str
    chosen: int
    branch: str                       # "light" (line 13), "fill" (15), "balance" (17), "fallback" (19),
    #                                   "scored" (C − H by llm-d's score, choose="scorers")
    delta_max: float
    deltas: dict[int, float] = field(default_factory=dict)     # Δ_p per instance id
    exec: dict[int, float] = field(default_factory=dict)       # ESTIMATEEXEC(p)
    exec_with: dict[int, float] = field(default_factory=dict)  # ESTIMATEEXEC(p, req)
    wait: dict[int, float] = field(default_factory=dict)       # req's wait read by lines 10, 13 (= exec as written)
    candidates: list[int] = field(default_factory=list)        # C
    light: list[int] = field(default_factory=list)             # L
    heavy: list[int] = field(default_factory=list)             # H


@register_global
class GoRouting(GlobalPolicy):
    name = "go_routing"
    summary = "PROSERVE GoRouting (Alg. 2): TDG-gain candidates, dual-threshold capability-aware choice"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0,
                 alpha: float = 0.9, mu: float = 0.2, lam: float = 0.8, eta: float | None = None,
                 fallback: str = "random", order: str = "local", kv_fit: bool = True,
                 choose: str = "thresholds"):
        super().__init__(gain, classes, deployment, seed)
        n = self.name
        self.alpha = validate.number(n, "alpha", alpha, 0, 1, lo_open=True)
        self.mu = validate.non_negative(n, "mu", mu)
        self.lam = validate.positive(n, "lam", lam)
        if self.mu > self.lam:
            validate.fail(n, "mu (lower threshold)", f"<= lam (upper threshold) = {lam!r}", mu)
        self.eta = resolve_eta(eta, self.classes, n)
        self.fallback = validate.one_of(n, "fallback", fallback, FALLBACKS)
        self.order = resolve_order(order, n)
        self.kv_fit = validate.boolean(n, "kv_fit", kv_fit)
        self.choose = validate.one_of(n, "choose", choose, CHOOSE)
        if self.choose == "scorers" and self.fallback != "random":
            validate.fail(n, "fallback", "'random' (unread: choose=scorers scores line 19's pool too)", fallback)
        # choose=scorers: llm-d's free-KV weight, none on prefill-only instances (the module doc)
        self._w_kv = 0.0 if self.deployment == DISAGGREGATED else W_KV
        self.last_decision: GoDecision | None = None
        self._finished = 0          # fallback="catch_up": requests finished, and their decode tokens
        self._decoded = 0

    def on_request_finished(self, req, now):
        """``fallback="catch_up"`` learns the mean decode tokens of the requests that ended well."""
        if not req.error:
            self._finished += 1
            self._decoded += max(0, len(req.token_times) - 1)

    def select_prefill(self, req, prefills, now):
        gain, dep, eta, order = self.gain, self.deployment, self.eta, self.order
        ests = [evaluate(p, req, now, gain, dep, eta, order=order_of(order, p)) for p in prefills]  # lines 2-7
        # the loads of lines 10-17 (see the module doc): with a schedule-aware estimate (Estimate.start
        # and .done set) req's own wait and completion in the instance's order for L and line 17, and
        # the backlog, as written, for H, line 15 and the min-load fallback; ties go to the smaller
        # backlog, then fewer decodes
        wait = [e.exec if e.start != e.start else e.start for e in ests]         # NaN: as written
        fin = [e.exec_with if e.done != e.done else e.done for e in ests]
        tie = [(e.exec, p.n_decode, p.id) for e, p in zip(ests, prefills)]
        # line 13's "most idle": as written the least backlog; schedule-aware, req's own wait less
        # the prefill its cached prefix saves there (the prefix index; 0 without one)
        light = [w - e.saved for w, e in zip(wait, ests)]
        # kv_fit: can p's free KV hold req's prompt (net of its cached prefix) now?
        rooms = [kv_room(p) for p in prefills] if self.kv_fit or self.fallback == "most_room" else None
        # req's expected cached prefix per instance, looked up once where two rules read it
        hits = [expected_hit(p, req) for p in prefills] if self.choose == "scorers" else None
        # (an unknown room, ∞, fits without looking the prefix up again)
        fits = [r == math.inf or r >= req.remaining_prefill - (hits[i] if hits is not None else expected_hit(p, req))
                for i, (r, p) in enumerate(zip(rooms, prefills))] if self.kv_fit else None
        delta_max = max(e.delta for e in ests)
        # line 8; the relative slack absorbs float noise in sums of equal weights
        thr = self.alpha * delta_max - 1e-9 * abs(delta_max)
        C = [i for i, e in enumerate(ests) if e.delta >= thr]
        L: list[int] = []
        H: list[int] = []
        if delta_max > 0:                                                   # line 9
            ttft = req.ttft_slo
            L = [i for i in C if wait[i] < self.mu * ttft]                  # line 10
            H = [i for i in C if ests[i].exec_with > self.lam * ttft]       # line 11
            if fits is not None and not all(fits):                          # kv_fit: no room is heavy
                L = [i for i in L if fits[i]]
                H = sorted(set(H) | {i for i in C if not fits[i]})
            if self.choose == "scorers":                                    # variant of lines 12-17
                heavy = set(H)
                pool = [i for i in C if i not in heavy] or C
                best, branch = self._scored(req, prefills, pool, hits), "scored"
            elif L:                                                         # line 13: most idle in L
                best, branch = min(L, key=lambda i: (light[i], tie[i])), "light"
            else:
                heavy = set(H)
                rest = [i for i in C if i not in heavy]
                if rest:                                                    # line 15: heaviest of C − H
                    best, branch = min(rest, key=lambda i: (-ests[i].exec, prefills[i].n_decode,
                                                            prefills[i].id)), "fill"
                else:                                                       # line 17: least loaded of C
                    best, branch = min(C, key=lambda i: (fin[i], tie[i])), "balance"
        else:
            # line 19's pool: with kv_fit, the instances that can hold req (all if none can);
            # choose=scorers scores every instance (its KV term weighs their free memory)
            pool = list(range(len(prefills)))
            if fits is not None and not all(fits) and self.choose != "scorers":
                pool = [i for i in pool if fits[i]] or pool
            if self.choose == "scorers":                                    # variant of line 19
                best = self._scored(req, prefills, pool, hits)
            elif self.fallback == "min_load":                               # variant of line 19
                best = min(pool, key=tie.__getitem__)
            elif self.fallback == "catch_up":                               # variant of line 19
                # RANDOMSELECT among the instances that lose the least decode-token gain, losses
                # within one decode token (w_d·w_prio) of the least counting as equal
                n_out = self._decoded / self._finished if self._finished else N_OUT_PRIOR
                lost = [self._catch_up_loss(req, prefills[i], ests[i], now, n_out) for i in pool]
                least = min(lost) + self.gain.w_d * req.weight
                near = [i for i, x in zip(pool, lost) if x <= least]
                best = near[self.rng.randrange(len(near))]
            elif self.fallback == "most_room":                              # variant of line 19
                best = min(pool, key=lambda i: (-rooms[i], tie[i]))
            else:                                                           # line 19: RANDOMSELECT(P)
                best = pool[self.rng.randrange(len(pool))]
            branch = "fallback"
        ids = [p.id for p in prefills]
        self.last_decision = GoDecision(
            request=req.id, chosen=ids[best], branch=branch, delta_max=delta_max,
            deltas={ids[i]: e.delta for i, e in enumerate(ests)},
            exec={ids[i]: e.exec for i, e in enumerate(ests)},
            exec_with={ids[i]: e.exec_with for i, e in enumerate(ests)},
            wait={ids[i]: wait[i] for i in range(len(ests))},
            candidates=[ids[i] for i in C], light=[ids[i] for i in L], heavy=[ids[i] for i in H])
        return prefills[best]

    def _catch_up_loss(self, req, p, e, now, n_out: float) -> float:
        """``fallback="catch_up"``: the decode-token gain lost if req goes to ``p``, ``n_out``
        decode tokens per request (module doc)."""
        gain = self.gain
        tpot = req.tpot_slo
        if self.deployment == DISAGGREGATED:
            step = 0.5 * tpot
        else:
            est = p.estimator
            step = min(est.t_c + (p.n_decode + 1) * est.decode(p.avg_decode_kv), 0.95 * tpot)
        done = e.exec_with if e.done != e.done else e.done            # NaN: as written
        lost = gain.late_decode_gain(req.weight, tpot, done - (gain.next_token_deadline(req) - now), step, n_out)
        # req's prefill delays every queued request (without end where the decodes fill every
        # step: exec = ∞); counted per class, O(classes) once the queue's snapshot is built
        x = e.exec_with - e.exec if e.exec_with < math.inf else math.inf
        for (weight, slo), n in queue_classes(p, gain).items():
            lost += n * gain.late_decode_gain(weight, slo, x, min(step, 0.95 * slo), n_out)
        return lost

    def _scored(self, req, prefills, pool: list[int], hits: list[int]) -> int:
        """``choose="scorers"``: the index in ``pool`` with the highest llm-d weighted score
        (prefix, queue, free KV at llm-d's published weights; ``baselines.llmd_scorers``),
        ties at random; prefill-only instances without the free-KV term (the module doc)."""
        # the queue score is relative to every instance, not only the pool's
        scores = llmd_scores(req, prefills, w_kv=self._w_kv, hits=hits)
        chosen = pick_max([prefills[i] for i in pool], scores, self.rng)
        return next(i for i in pool if prefills[i] is chosen)
