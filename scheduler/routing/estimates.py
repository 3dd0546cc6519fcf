"""ESTIMATEEXEC and ESTIMATEGAIN of Algorithm 2 (§4.3), shared by GoRouting and Min-Load.

Not a policy: the global scheduler's view of one prefill (or co-located)
instance ``p``, built from ``PrefillQueueMap[p]`` only.

Per-request cost. For each queued request the prefill work the dispatcher knows
of: ``exec = T~_p(l_q, l_kv)`` (Eq. 5) with ``(l_q, l_kv)`` the request's
remaining prefill and KV length *as recorded at dispatch*
(``PrefillInstance.dispatched``; live ``r.remaining_prefill``/``r.kv_len`` for a
request put in the queue by hand). The dispatcher sees dispatches and
completions, not chunk progress; progress since the last queue update is what
timestamp lag compensation subtracts, so reading live progress as well would
count it twice (and would make the simulator, whose requests are shared
objects, see more than the cluster's dispatcher does). Costs are kept in
uncorrected model units and scaled by the instance's current β when read.

Disaggregated (prefill-only instance), φ_p of §4.2: one request per batch, so
request ``r`` costs ``exec_r + t_c``::

    ESTIMATEEXEC(p)      = max(0, Σ_{r∈Q} (exec_r + t_c) − lag),   lag = now − ts_p
    ESTIMATEEXEC(p, req) = ESTIMATEEXEC(p) + exec_req + t_c

    ESTIMATEGAIN(Q): order Q by remain ascending (the conservative,
    request-specific order of φ_c, Eq. 9); the k-th request completes at
    C_k = Σ_{i≤k} (exec_i + t_c) − lag, clamped at 0 for queued requests (the
    lag may have finished them) and at exec_req + t_c for the routed request
    (nothing of it has run yet); gain = Σ_{r: C_r < remain_r} w_r.

``remain_r`` is the time to the deadline of the request's next token and
``w_r`` that token's weight (Eq. 3). For a fresh request that is the first
token, ``deadline_{r,1} = arrival + TTFT_SLO`` and ``w_r(1) = w_p·w_prio``; a
recompute-preempted request waiting to be prefilled again (co-located) counts
with its next token instead of a first token it already emitted.

Co-located, φ_a (Eq. 8) with the decode load of §4.3: the batches of the
instance also carry its ``n_d`` decodes, each ``b_d = T~_d(avg_decode_kv)``::

    t_budget = max(min(min_{r∈Q} remain_r, TPOT_SLO(req)), η)
    capacity = t_budget − t_c − n_d·b_d           (prefill time per batch)
    batches  = Σ exec / capacity                  (fractional, as in Eq. 8)
    C        = batches · t_budget − lag           (the same for every request)

i.e. ``C = t_budget/(t_budget − t_c − n_d·b_d) · Σ exec − lag``. With
``capacity ≤ 0`` the decodes alone fill the budget: no queued prefill can
finish in time, ``C = ∞``, every request misses. ``η`` floors ``t_budget``
because ``remain`` is negative once a queued request is late; see
:func:`resolve_eta`. For ``Q ∪ {req}`` the budget also takes ``req``'s remain,
and ``C = max(0, scale·Σ_Q exec − lag) + scale·exec_req``.

Schedule-aware estimate (issue 14; not the paper's). The order above is the
paper's: conservative, and right for a local policy that serves by deadline.
SlideBatching does not once it is loaded: a request whose remain is below the
load-judgment φ is URGENT and URGENT requests go first *by density* (Alg. 1
lines 8-13), so a queued request already past its deadline (long, low
priority) does not hold back a new short high-priority one, yet the paper's
estimate puts it at the head of the queue and judges every instance unable to
meet the new request (measured: docs/results.md §2). ``order`` names the local
order the estimate assumes, each instance's own in ``PrefillInstance.order``
(set from the local policy's ``router_order``):

* ``"deadline"``: remain ascending, the paper's estimate above;
* ``"slide"``: SlideBatching's line 13 with γ = 1 and the φ of the
  deployment (φ_p prefill-only, φ_a co-located; the router sees no local
  parameters): ``limit`` = the lag-compensated backlog of the set being
  judged (Q, or Q ∪ {req}), URGENT = ``{r : remain_r < limit}`` ordered by
  density ``w_r/exec_r`` descending, then the others by remain ascending;
* ``"fcfs"``: dispatch order, ``req`` last. Selectable (``order=fcfs``) but
  no policy's default: for Sarathi-FCFS it measured no better than the
  paper's order (docs/results.md §2.1): the same disaggregated, where arrival
  order is deadline order when the classes share a TTFT SLO, and within
  ±0.004 TDG_Ratio co-located, where the paper's φ_a (everything queued
  finishes together) is the more cautious about piling onto a queue whose
  prefills will turn into decodes.

The k-th request in the order completes at ``C_k = Σ_{i≤k} cost_i − lag``
(clamped as above), ``cost = β·(exec + t_c) + δ`` prefill-only and
``scale·β·exec`` co-located (Eq. 8's fractional batches, the same scale as
the paper's estimate, so every request no longer completes at the same time);
gain = ``Σ_{r: C_r < remain_r} w_r``, and Δ_p the gain of Q ∪ {req} under
its order minus that of Q under its own. ESTIMATEEXEC does not depend on the
order. ``order="deadline"`` keeps the paper's code above; the walk in
deadline order gives the paper's disaggregated Δ exactly (tested), while
co-located the walk's per-request completions differ from φ_a's common one,
so "slide" and "deadline" can differ there even when the orders agree.
Equal densities: the walk keeps deadline order, SlideBatching its queue's.
The walk also gives req's own wait and completion in that order
(``Estimate.start``, ``Estimate.done``), which GoRouting's light set and
balance read (see its module doc). O(|Q|) per instance after the snapshot's
cached sorts.

Prefix caches (issue 14). Where the router keeps an index of an instance's
prefix cache (``PrefillInstance.prefix``, :func:`~proserve.scheduler.routing.base.expected_hit`),
a request's prefill is priced net of the prefix the instance is expected to
hold: ``exec = T~_p(l_q − hit, l_kv + hit)`` (Eq. 5), for the routed request
here and for each queued one as recorded at dispatch. Cache affinity, queueing
and deadlines then meet in one currency, the gain.

Speed. :func:`queue_snapshot` sorts a queue once per queue update and caches
it on the instance; :func:`evaluate` then gets both pre- and post-gain from one
bisect (where ``req`` would slot in) and a pass over the requests after it,
which are the only ones ``req`` can delay (co-located: two bisects). The
ordered walk (``"slide"``, ``"fcfs"``) passes over the whole queue twice per
instance per route (scripts/bench_scheduler.py times both).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate
from operator import itemgetter
from typing import Mapping, NamedTuple

from .. import validate
from ..request import PriorityClass, Request
from ..tdg import GainConfig
from .base import COLOCATED, PrefillInstance, expected_hit

_by_deadline = itemgetter(0)

DEADLINE, SLIDE, FCFS = "deadline", "slide", "fcfs"
#: the local orders the estimate can assume (module doc, "Schedule-aware estimate")
ORDERS = (DEADLINE, SLIDE, FCFS)
#: a router's ``order`` setting: "local" (each instance's own ``PrefillInstance.order``) or one for all
LOCAL = "local"
ORDER_SETTINGS = (LOCAL, *ORDERS)


def resolve_order(order: str, where: str) -> str:
    """Validate a router's ``order`` setting (one of :data:`ORDER_SETTINGS`)."""
    return validate.one_of(where, "order", order, ORDER_SETTINGS)


def order_of(order: str, p: PrefillInstance) -> str:
    """The order the estimate assumes for ``p`` under the router's setting ``order``."""
    return p.order if order == LOCAL else order


class QueueSnapshot:
    """``PrefillQueueMap[p]`` ordered by deadline, in uncorrected model units."""

    __slots__ = ("key", "gain", "deadlines", "prefix", "weights", "suffix_w", "sum_exec",
                 "execs", "seq", "dens", "by_density", "classes")

    def __init__(self, key, gain, deadlines, prefix, weights, suffix_w, sum_exec, execs, seq, dens, by_density,
                 classes):
        self.key = key
        self.gain = gain
        self.deadlines = deadlines  # absolute next-token deadlines, ascending (remain order)
        self.prefix = prefix        # prefix[k] = Σ_{i≤k} (exec_i + t_c)   (φ_p)
        self.weights = weights      # w_r of the next token, same order
        self.suffix_w = suffix_w    # suffix_w[k] = Σ_{i≥k} weights[i], len n+1
        self.sum_exec = sum_exec    # Σ exec without t_c                     (φ_a)
        self.execs = execs          # exec_r, same order
        self.seq = seq              # positions (in the order above) in dispatch order ("fcfs")
        self.dens = dens            # density w_r/exec_r (Alg. 1 line 5), same order
        self.by_density = by_density  # positions by density w_r/exec_r descending ("slide")
        self.classes = classes      # (priority weight, TPOT SLO) -> count; None until queue_classes asks


def queue_classes(p: PrefillInstance, gain: GainConfig) -> dict[tuple[float, float], int]:
    """How many of ``p``'s queued requests have each (priority weight, TPOT SLO), counted once
    per queue snapshot and only when asked (GoRouting's ``fallback="catch_up"``), not on
    every snapshot rebuild."""
    s = queue_snapshot(p, gain)
    if s.classes is None:
        classes: dict[tuple[float, float], int] = {}
        for r in p.queue:
            k = (r.weight, r.tpot_slo)
            classes[k] = classes.get(k, 0) + 1
        s.classes = classes
    return s.classes


def queued_work(p: PrefillInstance, r: Request) -> tuple[int, int]:
    """(l_q, l_kv) of ``r``'s prefill as the dispatcher knows it (see module doc)."""
    w = p.dispatched.get(r.id)
    return w if w is not None else (r.remaining_prefill, r.kv_len)


def _exec(model, l_q: int, l_kv: int) -> float:
    return model.prefill_time(l_q, l_kv) if l_q > 0 else 0.0


def _density(w: float, x: float) -> float:
    """Alg. 1 line 5: gain of the next token per second of exec (no work: first)."""
    return w / x if x > 0 else math.inf


def queue_snapshot(p: PrefillInstance, gain: GainConfig) -> QueueSnapshot:
    """The sorted queue of ``p``, rebuilt only when the queue (or model, or gain) changed."""
    q = p.queue
    m = p.estimator.model
    key = (p.version, len(q), id(q), id(m))
    s = p.cache
    if s is not None and s.key == key and (s.gain is gain or s.gain == gain):
        return s
    rows = []
    get = p.dispatched.get
    prefill = m.unit.prefill
    w_p = gain.w_p
    for k, r in enumerate(q):
        w = get(r.id)
        l_q, l_kv = w if w is not None else (r.remaining_prefill, r.kv_len)
        x = prefill(l_q, l_kv) if l_q > 0 else 0.0                              # Eq. 5
        if r.token_times:  # re-prefill after a preemption: its next token
            rows.append((gain.next_token_deadline(r), x, gain.next_token_weight(r), k))
        else:              # deadline_{r,1} = arrival + TTFT_SLO, w_r(1) = w_p·w_prio (Eq. 3)
            rows.append((r.arrival + r.ttft_slo, x, w_p * r.weight, k))
    rows.sort(key=_by_deadline)  # stable: equal deadlines keep dispatch order
    deadlines = [row[0] for row in rows]
    execs = [row[1] for row in rows]
    weights = [row[2] for row in rows]
    seq = sorted(range(len(rows)), key=lambda i: rows[i][3])
    dens = [_density(w, x) for w, x in zip(weights, execs)]
    by_density = sorted(range(len(rows)), key=lambda i: -dens[i])  # stable
    t_c = m.t_c
    prefix = list(accumulate(x + t_c for x in execs))
    suffix_w = list(accumulate(reversed(weights), initial=0.0))[::-1]
    s = QueueSnapshot(key, gain, deadlines, prefix, weights, suffix_w, math.fsum(execs), execs, seq, dens,
                      by_density, None)
    p.cache = s
    return s


def lag(p: PrefillInstance, now: float) -> float:
    """Timestamp lag compensation (§4.3): time elapsed since the last queue update."""
    return max(0.0, now - p.ts)


def resolve_eta(eta: float | None, classes: Mapping[str, PriorityClass], where: str) -> float | None:
    """Floor of the co-located t_budget estimate.

    Default: the tightest TPOT SLO of the configured classes, the same default
    as SlideBatching's η (§4.2: t_budget ∈ [η, max TPOT_SLO]). ``None`` when no
    classes are configured: the routed request's TPOT SLO is used then.
    SlideBatching's TPOT headroom h lowers its own floor to (1 − h)·η, which this
    estimate does not know (it sees no local policy's parameters): with the
    default h = 0.3 the global estimate's budget floor is η, the local one 0.7·η.
    Pass ``eta`` to GoRouting to match a headroom. The local policy tells the router
    its queue order (``router_order``), not its parameters.
    """
    if eta is None:
        return min((c.tpot_slo for c in classes.values()), default=None)
    return validate.positive(where, "eta", eta)


class Estimate(NamedTuple):
    exec: float       # ESTIMATEEXEC(p)
    exec_with: float  # ESTIMATEEXEC(p, req)
    delta: float      # Δ_p = ESTIMATEGAIN(Q ∪ {req}) − ESTIMATEGAIN(Q); NaN if not asked for
    start: float = math.nan  # schedule-aware only: the prefill the instance runs before req's ...
    done: float = math.nan   # ... and when req's own prefill completes, in the assumed order
    saved: float = 0.0       # prefill time req's expected cached prefix saves here (prefix index)


def _scale(t_budget: float, overhead: float) -> float:
    """t_budget / (t_budget − t_c − n_d·b_d): wall time per unit of prefill exec (Eq. 8)."""
    cap = t_budget - overhead
    return t_budget / cap if cap > 0 else math.inf


def _times(scale: float, x: float) -> float:
    return scale * x if x > 0 else 0.0  # no work takes no time, even at scale ∞


def evaluate(p: PrefillInstance, req: Request, now: float, gain: GainConfig, deployment: str,
             eta: float | None = None, with_gain: bool = True, order: str = DEADLINE) -> Estimate:
    """ESTIMATEEXEC(p), ESTIMATEEXEC(p, req) and Δ_p (Alg. 2 lines 3-6) for one instance,
    Δ_p with the queue served in ``order`` (one of :data:`ORDERS`; the paper's: "deadline")."""
    s = queue_snapshot(p, gain)
    est = p.estimator
    beta, off = est.beta, est.delta   # a step takes β·T_pd + δ (the snapshot holds T_pd)
    D = s.deadlines
    n = len(D)
    lag_ = now - p.ts
    if lag_ < 0.0:
        lag_ = 0.0
    hit = expected_hit(p, req)                                      # prefix index (issue 14)
    x0_req = _exec(est.model, req.remaining_prefill - hit, req.kv_len + hit)   # model units
    x0_saved = _exec(est.model, req.remaining_prefill, req.kv_len) - x0_req if hit else 0.0
    x_req = beta * x0_req
    d_req = gain.next_token_deadline(req)
    r_req = d_req - now

    if deployment == COLOCATED:
        t_c = est.t_c
        overhead = t_c + (p.n_decode * est.decode(p.avg_decode_kv) if p.n_decode else 0.0)  # + n_d·b_d
        tpot = req.tpot_slo
        floor = eta if eta is not None else tpot
        t_min = D[0] - now if n else math.inf
        s_pre = _scale(max(min(t_min, tpot), floor), overhead)
        s_post = _scale(max(min(t_min, r_req, tpot), floor), overhead)
        work = beta * s.sum_exec
        e_pre = max(0.0, _times(s_pre, work) - lag_)
        e_post = max(0.0, _times(s_post, work) - lag_) + _times(s_post, x_req)
        if not with_gain:
            return Estimate(e_pre, e_post, math.nan)
        if order != DEADLINE:
            w_req = gain.next_token_weight(req)
            delta, start, done = _ordered_delta(s, order, now, lag_, (s_pre * beta, 0.0, e_pre),
                                                (s_post * beta, 0.0, e_post), (d_req, x0_req, w_req))
            return Estimate(e_pre, e_post, delta, start, done, _times(s_post, beta * x0_saved))
        # φ_a is request-agnostic: every request completes at e; it gains iff e < remain
        w_req = gain.next_token_weight(req)
        pre = s.suffix_w[bisect_right(D, now + e_pre)]
        post = s.suffix_w[bisect_right(D, now + e_post)] + (w_req if e_post < r_req else 0.0)
        return Estimate(e_pre, e_post, post - pre)

    # disaggregated: φ_p, one request per batch
    t_c = est.t_c
    c = x_req + t_c
    e_pre = beta * s.prefix[-1] + n * off - lag_ if n else 0.0
    if e_pre < 0.0:
        e_pre = 0.0
    if not with_gain:
        return Estimate(e_pre, e_pre + c, math.nan)
    w_req = gain.next_token_weight(req)
    if order != DEADLINE:
        delta, start, done = _ordered_delta(s, order, now, lag_, (beta, t_c, e_pre), (beta, t_c, e_pre + c),
                                            (d_req, x0_req, w_req))
        return Estimate(e_pre, e_pre + c, delta, start, done, beta * x0_saved)
    j = bisect_right(D, d_req)  # req's slot in remain order (after equal deadlines)
    P = s.prefix
    done_req = (beta * P[j - 1] + j * off if j else 0.0) + c - lag_
    if done_req < c:
        done_req = c
    delta = w_req if done_req < r_req else 0.0
    W = s.weights
    for k in range(j, n):  # only the requests after req are delayed, each by c
        rk = D[k] - now
        pk = beta * P[k] + (k + 1) * off - lag_
        if 0.0 < rk and pk < rk <= pk + c:  # met before, missed after
            delta -= W[k]
    return Estimate(e_pre, e_pre + c, delta)


def _ordered_delta(s: QueueSnapshot, order: str, now: float, lag_: float, pre: tuple[float, float, float],
                   post: tuple[float, float, float], req: tuple[float, float, float]) -> tuple[float, float, float]:
    """ESTIMATEGAIN(Q ∪ {req}) − ESTIMATEGAIN(Q) in ``order``, and req's start and completion:
    ``_ordered_gain`` for ``pre`` = (a, b, limit) without req and for ``post`` with it. Where
    both walks visit the queue in the same order (always, except under "slide" when the two
    limits put a different prefix of the queue in URGENT), it walks once, with one running sum
    for each, summed in the same order as two calls would (the same floats); else two calls."""
    a0, b0, lim0 = pre
    a1, b1, lim1 = post
    D, X, W = s.deadlines, s.execs, s.weights
    if order == SLIDE and bisect_left(D, now + lim0) != bisect_left(D, now + lim1):
        g0, _, _ = _ordered_gain(s, order, now, lag_, a0, b0, lim0)
        g1, start, done = _ordered_gain(s, order, now, lag_, a1, b1, lim1, req)
        return g1 - g0, start, done
    pos, u = _walk(s, order, now, lim1)
    d_r, x_r, w_r = req
    k = _insert_at(s, order, now, pos, u, lim1, d_r, x_r, w_r)
    acc0 = acc1 = total0 = total1 = 0.0
    t0 = now - lag_
    for j, i in enumerate(pos):
        if j == k:                                     # req, in the post walk only
            c = a1 * x_r + b1 if x_r > 0 else b1
            start_req = acc1 - lag_ if acc1 > lag_ else 0.0
            acc1 += c
            done_req = start_req + c
            if done_req < d_r - now:
                total1 += w_r
        x = X[i]
        d = D[i]
        acc0 += a0 * x + b0 if x > 0 else b0
        acc1 += a1 * x + b1 if x > 0 else b1
        if now < d:
            if acc0 + t0 < d:
                total0 += W[i]
            if acc1 + t0 < d:
                total1 += W[i]
    if k >= len(pos):                                  # req last
        c = a1 * x_r + b1 if x_r > 0 else b1
        start_req = acc1 - lag_ if acc1 > lag_ else 0.0
        done_req = start_req + c
        if done_req < d_r - now:
            total1 += w_r
    return total1 - total0, start_req, done_req


def _walk(s: QueueSnapshot, order: str, now: float, limit: float) -> tuple[list[int], int]:
    """The queue's indices in the order ``order`` serves them, and (``"slide"``) how many lead
    the remain order as URGENT (remain < ``limit``; 0 for the other orders)."""
    D = s.deadlines
    if order == FCFS:
        return list(s.seq), 0
    if order == SLIDE:
        u = bisect_left(D, now + limit)                 # URGENT: remain < limit, a prefix of D
        pos = [i for i in s.by_density if i < u]       # ... by density descending (line 13)
        pos += range(u, len(D))                        # NORMAL by remain ascending
        return pos, u
    if order == DEADLINE:
        return list(range(len(D))), 0
    raise ValueError(f"unknown queue order {order!r}; choose one of {', '.join(ORDERS)}")


def _insert_at(s: QueueSnapshot, order: str, now: float, pos: list[int], u: int, limit: float,
               d_r: float, x_r: float, w_r: float) -> int:
    """Where req goes in the walk ``pos``: after the requests it ties with."""
    D = s.deadlines
    if order == FCFS:
        return len(pos)
    if order == SLIDE and d_r < now + limit:
        dr, dens = _density(w_r, x_r), s.dens
        return next((k for k, i in enumerate(pos) if i >= u or dens[i] < dr), len(pos))
    if order == DEADLINE:
        return bisect_right(D, d_r)
    return next((k for k, i in enumerate(pos) if D[i] > d_r and (order != SLIDE or i >= u)), len(pos))


def _ordered_gain(s: QueueSnapshot, order: str, now: float, lag_: float, a: float, b: float,
                  limit: float, req: tuple[float, float, float] | None = None) -> tuple[float, float, float]:
    """ESTIMATEGAIN of the snapshot's queue (plus ``req`` = (deadline, exec, weight), exec in
    model units) served in ``order``, and when ``req`` starts and completes (NaN without it): item i
    costs ``a·exec_i + b`` and completes at the sum of the costs up to it less the lag;
    ``limit`` is the backlog φ judges URGENT against ("slide"). See the module doc,
    "Schedule-aware estimate"."""
    D, X, W = s.deadlines, s.execs, s.weights
    pos, u = _walk(s, order, now, limit)
    if req is not None:  # where req goes: after the requests it ties with
        d_r, x_r, w_r = req
        pos.insert(_insert_at(s, order, now, pos, u, limit, d_r, x_r, w_r), -1)
    total = acc = 0.0
    start_req = done_req = math.nan
    t0 = now - lag_   # a queued item done at max(acc − lag, 0) meets iff acc + t0 < deadline and now < deadline
    for i in pos:
        if i < 0:
            c = a * x_r + b if x_r > 0 else b
            start_req = acc - lag_ if acc > lag_ else 0.0
            acc += c
            done_req = start_req + c                   # nothing of req has run yet
            if done_req < d_r - now:
                total += w_r
            continue
        x = X[i]
        acc += a * x + b if x > 0 else b
        d = D[i]
        if acc + t0 < d and now < d:                   # done = max(acc − lag, 0) < remain
            total += W[i]
    return total, start_req, done_req


def estimate_exec(p: PrefillInstance, req: Request, now: float, gain: GainConfig | None = None,
                  deployment: str = "disaggregated", eta: float | None = None,
                  include: bool = False) -> float:
    """ESTIMATEEXEC(p) (``include=False``) or ESTIMATEEXEC(p, req) while routing ``req``."""
    e = evaluate(p, req, now, gain or GainConfig(), deployment, eta, with_gain=False)
    return e.exec_with if include else e.exec


def estimate_gain(p: PrefillInstance, now: float, gain: GainConfig | None = None,
                  deployment: str = "disaggregated", req: Request | None = None,
                  tpot: float | None = None, eta: float | None = None) -> float:
    """ESTIMATEGAIN(Q) or, with ``req``, ESTIMATEGAIN(Q ∪ {req}), straight from the
    definitions in the module docstring (O(|Q| log |Q|), no cache).

    The reference that :func:`evaluate`'s incremental Δ is tested against, and a
    readable account of what Δ means. ``tpot`` (co-located) is the routed
    request's TPOT SLO; it defaults to ``req.tpot_slo``.
    """
    gain = gain or GainConfig()
    est = p.estimator
    lag_ = lag(p, now)
    t_c = est.t_c
    items = []  # (deadline, is_req, exec, weight)
    for r in p.queue:
        l_q, l_kv = queued_work(p, r)
        items.append((gain.next_token_deadline(r), False,
                      est.prefill(l_q, l_kv) if l_q > 0 else 0.0, gain.next_token_weight(r)))
    hit = expected_hit(p, req) if req is not None else 0
    if req is not None:
        items.append((gain.next_token_deadline(req), True,
                      est.prefill(req.remaining_prefill - hit, req.kv_len + hit), gain.next_token_weight(req)))
    items.sort(key=lambda it: (it[0], it[1]))  # remain ascending; req after equal deadlines
    total = 0.0
    if deployment == COLOCATED:
        if tpot is None:
            if req is None:
                raise ValueError("co-located ESTIMATEGAIN needs the routed request's TPOT SLO")
            tpot = req.tpot_slo
        floor = eta if eta is not None else tpot
        t_min = min((d - now for d, _, _, _ in items), default=math.inf)
        t_budget = max(min(t_min, tpot), floor)
        overhead = t_c + p.n_decode * est.decode(p.avg_decode_kv)
        scale = _scale(t_budget, overhead)
        work_q = sum(x for _, is_req, x, _ in items if not is_req)
        work_req = sum(x for _, is_req, x, _ in items if is_req)
        done = max(0.0, _times(scale, work_q) - lag_) + _times(scale, work_req)  # Eq. 8, every request
        return sum(w for d, _, _, w in items if done < d - now)
    acc = 0.0
    for d, is_req, x, w in items:
        acc += x + t_c                                   # φ_p: one request per batch
        done = max(acc - lag_, x + t_c if is_req else 0.0)
        if done < d - now:
            total += w
    return total
