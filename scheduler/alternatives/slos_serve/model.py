"""SLOs-Serve's performance model and admission DP (Chen et al., §3.1.1, §3.2, App. C).

Plain functions and classes shared by the ``slos_serve`` local policy and the
``slos_serve_routing`` global policy. Not a policy (modules under
``scheduler/local/`` are auto-registered as policies, so this lives here).

Roofline batch-time model (§3.1.1)
----------------------------------
::

    T^(batch) = max_l ( k1^l · #Tokens + k2^l · #SpecStep + b_l ),   l = 1..L (L = 2 in practice)

``#Tokens`` is every token the forward pass processes (prefill chunk tokens and
one per decode), ``#SpecStep`` the speculation steps of the draft model (0
here: speculative decoding is out of scope, see below). ``Time2BS(t)`` is its
inverse: the largest ``#Tokens`` whose batch time is at most ``t``.

How it relates to this project's Eq. 5-7 :class:`~proserve.scheduler.estimator.LatencyModel`:
for one prefill chunk of ``N`` tokens on an empty KV cache, Eq. 5 + Eq. 7 give
``t_c + c_p·N + a_p·N²``, a convex function of ``N``; the roofline's max of
``L`` lines is a convex piecewise-linear fit of it: ``b_l`` plays the part of
``t_c`` (weights read once per step, launch overhead), ``k1^l`` that of
``c_p + a_p·N`` over the line's range (compute per token).
:meth:`Roofline.from_latency_model` fits the roofline to that curve, so a
policy that gets only an :class:`~proserve.scheduler.estimator.Estimator` can build it;
:meth:`Roofline.fit` fits it to measured ``(#Tokens, #SpecStep, time)``
samples as the paper does (e.g. the profiler's samples through
:func:`samples_from_batches`). The roofline is kept in uncorrected model units;
callers apply the estimator's online factor β (``Time2BS(t/β)``).

The roofline counts a decode as one token. Eq. 6 prices it ``a_d·l_kv + b_d``
(reading the request's KV cache), which on the bundled 7B model is ~6× a
prefill token at l_kv = 1024. :func:`decode_tokens` converts a decode into
roofline tokens at the marginal cost of the active roofline line
(``T~_d(l_kv) / k1``); with ``decode_cost="unit"`` the policies use the
paper's 1 token per decode instead.

Admission DP, throughput form (§3.2.1, App. C Eq. 5)
-----------------------------------------------------
Requests ordered by prefill deadline ``pDDL_i`` need ``p_i`` prefill tokens by
``pDDL_i`` and, from then on, a decode token every ``TPOT_i`` (the "line" of
§3.2 starting at ``(pDDL_i, p_i)`` with slope ``1/TPOT_i``). The token budget
grows at ``σ = Time2BS(t0)/t0`` tokens/s; the *prefill budget* is what is left
after the decode demand of the admitted requests. App. C's recurrence::

    pb[i, n] = max_{j: pDDL_j < pDDL_i} { pb[j, n-1] - p_i + Δpb },   pb ≥ 0

with ``Δpb = PB*(pDDL_i - pDDL_j, n-1)`` the prefill budget generated between
the two deadlines with ``n-1`` admitted requests decoding. ``PB*`` is taken in
its fluid form ``(σ - decode demand rate)·Δt`` (Algorithm 2's ⌊t/t0⌋ batches
of Time2BS(t0) tokens, without the floor); it is additive over consecutive
intervals, so enumerating the last admitted ``j`` equals a pass over the
requests in deadline order that either admits or skips each one, keeping per
state the largest prefill budget (:func:`admit_dp`). With several TPOT tiers
the state carries the admitted count per tier, ``(n_1, ..., n_L)`` (§3.2.1
"Multi-Decode SLOs"). The answer is the state with the most admissions (ties:
most budget left) whose total decode demand does not exceed ``σ`` (§3.2: "their
combined generation rate is less than the budget's slope").

Running requests are *forced* (§3.2.1 "Continuous Optimization"): their
prefill jobs and decode demand are always in, and a new request may be
admitted only if no forced deadline then has a negative budget, or, for a
forced request that is already late (its forced-only budget is negative), only
if it does not make it later.

Memory (App. C's ``m``): each candidate takes ``m_i`` units of the
``mem_cap`` units left once the forced requests have theirs; the state then
also carries the units used. (What ``m_i`` is, when decode lengths are
unknown, is the caller's choice: see the ``slos_serve`` policy.)

Simplification, because the information is not available here: the decode
demand of an admitted request continues through the planning horizon (at most
one TTFT SLO ahead): its finishing time is unknown, so this is the
conservative choice.

Speculative decoding (§3.2.3, App. D) is out of scope. It would plug in at
two places: ``#SpecStep`` in :meth:`Roofline.time` (``k2^l`` is fitted when
samples carry speculation steps), and the per-batch budget: instead of
``Time2BS(t0)`` with one token per decode, App. D's search over speculation
lengths ``sl_l`` gives a batch time ``min_l TPOT_l·Acc(sl_l)`` and
``Time2BS(T, sl) - Σ n_l·sl_l`` prefill tokens per batch, which replaces ``σ``
and the per-tier decode rates passed to :func:`admit_dp`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from ... import validate
from ...cost import StepCosts
from ...request import ConfigError

_BIG = 1 << 40  # "unbounded" batch size when no line limits it

#: weight, in finished requests, of the prior output length in the learned mean ô: the first
#: requests to finish are the short ones and would otherwise drag ô far down
PRIOR_WEIGHT = 8

#: default roofline fit range of the policies: batches up to this many times the loosest TPOT SLO
FIT_SPAN = 4.0

#: how the policies price a decode in roofline tokens (``decode_cost``)
DECODE_COSTS = ("model", "unit")


# --------------------------------------------------------------------------------------
# parameters shared by the ``slos_serve`` local policy and the ``slos_serve_routing`` router
# --------------------------------------------------------------------------------------
def check_policy_params(where: str, decode_cost: str, roofline_pieces: int, output_len_prior: float) -> float:
    """Validate the parameters both SLOs-Serve policies take; returns ``output_len_prior`` as a float."""
    validate.one_of(where, "decode_cost", decode_cost, DECODE_COSTS)
    validate.integer(where, "roofline_pieces", roofline_pieces, 1, 2)
    return validate.number(where, "output_len_prior", output_len_prior, 1)


class MeanOutputLen:
    """ô: the mean output length of the finished requests, learned online. Starts at
    ``prior``, which counts as PRIOR_WEIGHT finished requests."""

    __slots__ = ("total", "count")

    def __init__(self, prior: float):
        self.total = PRIOR_WEIGHT * prior
        self.count = PRIOR_WEIGHT

    def observe(self, req) -> None:
        """Count a finished request's true output length (failed or empty ones are skipped)."""
        if req.error is None and req.num_emitted > 0:
            self.total += req.num_emitted
            self.count += 1

    @property
    def value(self) -> float:
        return self.total / self.count


def line_deadline(r) -> float:
    """Deadline of request ``r``'s next token on the line of §3.2: pDDL + (#emitted)·TPOT
    (its prefill deadline pDDL before the first token; Eq. 3's fixed deadline, whatever
    the gain's deadline variant)."""
    return r.arrival + r.ttft_slo + len(r.token_times) * r.tpot_slo


def default_fit_max_time(classes, batch_time: float | None = None) -> float | None:
    """The default ``fit_max_time``: FIT_SPAN × the loosest of the classes' TPOT SLOs and
    ``batch_time`` (None when no classes are configured)."""
    if not classes:
        return None
    return FIT_SPAN * max([c.tpot_slo for c in classes.values()] + [batch_time or 0.0])


# --------------------------------------------------------------------------------------
# roofline (§3.1.1)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roofline:
    """``T^ = max_l (k1^l·#Tokens + k2^l·#SpecStep + b_l)``; ``lines`` = ((k1, k2, b), ...)."""

    lines: tuple[tuple[float, float, float], ...]

    def __post_init__(self) -> None:
        if not self.lines:
            raise ConfigError("roofline: needs at least one line")
        for i, ln in enumerate(self.lines):
            if len(ln) != 3:
                validate.fail("roofline", f"lines[{i}]", "(k1, k2, b)", ln)
            for name, v in zip(("k1", "k2", "b"), ln):
                validate.non_negative("roofline", f"lines[{i}].{name}", v)
        if all(k1 <= 0 for k1, _, _ in self.lines):
            raise ConfigError("roofline: every line has k1 = 0; Time2BS would be unbounded")

    def time(self, tokens: float, spec_steps: float = 0.0) -> float:
        """T^(BatchForward(batch)) of §3.1.1."""
        return max(k1 * tokens + k2 * spec_steps + b for k1, k2, b in self.lines)

    def time2bs(self, t: float, spec_steps: float = 0.0) -> int:
        """Time2BS(t) (Algorithm 2 line 7): the largest #Tokens with T^ ≤ t (0 if none)."""
        n = _BIG
        for k1, k2, b in self.lines:
            room = t - b - k2 * spec_steps
            if room < 0:
                return 0
            if k1 > 0:
                n = min(n, int(room / k1 + 1e-9))
        return max(n, 0)

    def marginal(self, tokens: float, spec_steps: float = 0.0) -> float:
        """dT^/d#Tokens at ``tokens``: k1 of the line that attains the max (the bottleneck)."""
        best = max(self.lines, key=lambda ln: (ln[0] * tokens + ln[1] * spec_steps + ln[2], ln[0]))
        return best[0]

    # -- fitting -------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float, float]], pieces: int = 2) -> "Roofline":
        """Regression of §3.1.1 on ``(#Tokens, #SpecStep, time)`` samples.

        Non-negative least squares on relative error (rows scaled by 1/time).
        For ``pieces = 2`` every split of the samples sorted by #Tokens is
        tried (one line per side), the max-of-lines model with the lowest mean
        relative error over all samples is kept, then refined by reassigning
        each sample to the line that predicts its time and refitting.
        """
        validate.integer("roofline", "pieces", pieces, 1, 2)   # the paper uses L = 2
        rows = sorted((float(n), float(s), float(t)) for n, s, t in samples)
        if len(rows) < 2:
            raise ConfigError(f"roofline: need at least 2 samples to fit, got {len(rows)}")
        A = np.array(rows, dtype=float)
        if np.any(A[:, 2] <= 0) or np.any(A[:, :2] < 0):
            raise ConfigError("roofline: sample times must be > 0 and token counts >= 0")
        spec = bool(np.any(A[:, 1] > 0))
        X = np.column_stack([A[:, 0], A[:, 1], np.ones(len(A))]) if spec else \
            np.column_stack([A[:, 0], np.zeros(len(A)), np.ones(len(A))])
        y = A[:, 2]
        one = _nnls_line(X, y, spec)
        best, best_err = (one,), _rel_err((one,), X, y)
        if pieces == 2 and len(rows) >= 4:
            for split in range(2, len(rows) - 1):
                if A[split - 1, 0] == A[split, 0]:
                    continue
                ls = (_nnls_line(X[:split], y[:split], spec), _nnls_line(X[split:], y[split:], spec))
                err = _rel_err(ls, X, y)
                if err < best_err - 1e-15:
                    best, best_err = ls, err
            for _ in range(5):  # refine: each sample to the line that attains the max there
                if len(best) < 2:
                    break
                P = np.column_stack([X @ np.array(ln) for ln in best])
                who = P.argmax(axis=1)
                groups = [np.flatnonzero(who == g) for g in range(len(best))]
                if any(len(g) < 2 for g in groups):
                    break
                ls = tuple(_nnls_line(X[g], y[g], spec) for g in groups)
                err = _rel_err(ls, X, y)
                if err >= best_err - 1e-15:
                    break
                best, best_err = ls, err
        lines = tuple(ln for ln in best if ln[0] > 0 or len(best) == 1)
        try:
            return cls(lines or best)
        except ConfigError:
            # all slopes 0 (degenerate samples): keep Time2BS bounded
            k1, k2, b = best[0]
            return cls(((1e-12, k2, b),))

    @classmethod
    def from_latency_model(cls, model, max_time: float = 1.0, points: int = 40,
                           pieces: int = 2) -> "Roofline":
        """Fit to Eq. 5+7 for one prefill chunk on an empty KV cache:
        ``T(N) = t_c + c_p·N + a_p·N²`` for N on a geometric grid from 1 token
        to the largest chunk that takes ``max_time`` seconds."""
        validate.number("roofline", "max_time", max_time, model.t_c, lo_open=True)   # > t_c
        # GETMAXCHUNK on an empty cache: the largest chunk with t_c + T~_p(N) <= max_time
        n_hi = max(2, StepCosts.of(model).max_chunk(0, 1 << 40, max_time - model.t_c))
        grid = sorted({max(1, int(round(v))) for v in np.geomspace(1, n_hi, points)})
        samples = [(n, 0, model.batch_time([(n, 0)], ())) for n in grid]
        return cls.fit(samples, pieces)


def _nnls_line(X: np.ndarray, y: np.ndarray, spec: bool) -> tuple[float, float, float]:
    from scipy.optimize import nnls

    cols = [0, 1, 2] if spec else [0, 2]
    w = 1.0 / y
    Xw = X[:, cols] * w[:, None]
    scale = np.maximum(np.abs(Xw).max(axis=0), 1e-30)
    coef, _ = nnls(Xw / scale, y * w)
    coef = coef / scale
    if spec:
        return float(coef[0]), float(coef[1]), float(coef[2])
    return float(coef[0]), 0.0, float(coef[1])


def _rel_err(lines, X: np.ndarray, y: np.ndarray) -> float:
    pred = np.max(np.column_stack([X @ np.array(ln) for ln in lines]), axis=1)
    return float(np.mean(np.abs(pred - y) / y))


def samples_from_batches(batches) -> list[tuple[int, int, float]]:
    """``(#Tokens, 0, time)`` from :class:`~proserve.scheduler.estimator.BatchSample` records
    (e.g. the profiler's samples), for :meth:`Roofline.fit`."""
    return [(sum(q for q, _ in s.prefills) + len(s.decodes), 0, s.time) for s in batches]


def decode_tokens(model, roofline: Roofline, l_kv: float, at_tokens: float) -> float:
    """A decode at context ``l_kv`` in roofline tokens: ``T~_d(l_kv) / k1`` with k1 the
    slope of the roofline line active at ``at_tokens`` (the batch size being formed)."""
    k = roofline.marginal(at_tokens)
    if k <= 0:
        return 1.0
    return model.decode_time(l_kv) / k


# --------------------------------------------------------------------------------------
# admission DP (§3.2.1, App. C)
# --------------------------------------------------------------------------------------
class Job(NamedTuple):
    """One prefill job of the plan.

    ``pddl``: absolute prefill deadline pDDL_i; ``p``: prefill tokens p_i still
    to allocate; ``rate``: decode demand (tokens/s) the request adds from its
    pDDL on (forced jobs; candidates take theirs from their tier); ``tier``:
    index into ``tier_rates`` (candidates only); ``m``: memory units m_i
    (candidates only, when the DP has a memory capacity).
    """

    pddl: float
    p: float
    rate: float = 0.0
    tier: int = 0
    m: int = 0


@dataclass
class Admission:
    admitted: list[bool]   # per candidate, in the order given
    n: int                 # number admitted
    pb_end: float          # prefill budget left at the last deadline (budget units: tokens)
    rate_end: float        # decode demand rate once every admitted request decodes
    mem: int = 0           # memory units the admitted candidates take


def _base_walk(now: float, sigma: float, base_rate: float, forced: Sequence[Job]):
    """Forced-only prefill budget: deadlines of the sorted forced jobs, the budget
    just after each (``pb_base``, its prefill deducted) and the decode rate after it."""
    t, pb, rate = now, 0.0, base_rate
    times, after, rates = [], [], []
    for j in sorted(forced, key=lambda j: j.pddl):
        d = max(j.pddl, now)
        pb += (sigma - rate) * (d - t)
        t = d
        pb -= j.p
        rate += j.rate
        times.append(d)
        after.append(pb)
        rates.append(rate)
    return times, after, rates


def _base_at(t: float, now: float, sigma: float, base_rate: float, times, after, rates) -> float:
    """Forced-only budget at time ``t`` (forced jobs due at ``t`` already deducted)."""
    k = bisect_right(times, t)
    if k == 0:
        return (sigma - base_rate) * (max(t, now) - now)
    return after[k - 1] + (sigma - rates[k - 1]) * (t - times[k - 1])


def feasible_alone(now: float, sigma: float, base_rate: float, forced: Sequence[Job],
                   candidates: Sequence[Job], tier_rates: Sequence[float], mem_cap: int | None = None,
                   eps: float = 1e-6) -> list[bool]:
    """A necessary condition for each candidate: the forced-only budget at its
    deadline covers its prefill, its decode demand fits beside the forced one,
    and its memory fits. Adding requests only lowers the budget and raises the
    demand, so a candidate failing this is declined by every admission
    (:func:`admit_dp`) as well."""
    times, after, rates = _base_walk(now, sigma, base_rate, forced)
    rate_end = rates[-1] if rates else base_rate
    out = []
    for c in candidates:
        d = max(c.pddl, now)
        ok = _base_at(d, now, sigma, base_rate, times, after, rates) - c.p >= -eps
        ok = ok and rate_end + tier_rates[c.tier] <= sigma + eps
        out.append(ok and (mem_cap is None or c.m <= mem_cap))
    return out


def admit_dp(now: float, sigma: float, base_rate: float, forced: Sequence[Job],
             candidates: Sequence[Job], tier_rates: Sequence[float], mem_cap: int | None = None,
             eps: float = 1e-6) -> Admission:
    """App. C's DP: the largest subset of ``candidates`` whose prefill deadlines
    (and the forced jobs') are all met, whose decode demand fits under ``σ`` and
    whose memory fits in ``mem_cap`` units.

    ``sigma``: token budget rate σ (tokens/s); ``base_rate``: decode demand of
    the requests decoding now (tokens/s); ``forced``: prefill jobs of running
    (already admitted) requests; ``candidates``: new requests, each with a
    ``tier`` and memory ``m``; ``tier_rates[l]``: decode demand (tokens/s) of
    one admitted request of tier l; ``mem_cap``: memory units left for the
    candidates (None: no memory dimension). Deadlines before ``now`` count as
    ``now``. Candidates with equal deadlines keep their given order, and
    between equally good subsets the earlier candidates win (a tie prefers
    skipping the later one).

    State ``(n_1, ..., n_L, m)``: admitted counts per tier and memory used,
    flattened; per state the smallest deficit ``D`` = forced-only budget −
    budget of the state (the largest pb of App. C's ``pb[i, m, n]``).
    """
    validate.non_negative("admission DP", "sigma", sigma)
    validate.non_negative("admission DP", "base_rate", base_rate)
    for i, r in enumerate(tier_rates):
        validate.non_negative("admission DP", f"tier_rates[{i}]", r)
    if mem_cap is not None:
        mem_cap = validate.integer("admission DP", "mem_cap", mem_cap, 0)
    L = len(tier_rates)
    counts = [0] * L
    for c in candidates:   # inline conditions: this loop runs every step
        if not 0 <= c.tier < L:
            validate.fail("admission DP", "a candidate's tier", f"in 0..{L - 1}", c.tier)
        if mem_cap is not None and (c.m < 0 or c.m != int(c.m)):
            validate.fail("admission DP", "a candidate's memory", "a whole number of units >= 0", c.m)
        counts[c.tier] += 1
    times, after, rates = _base_walk(now, sigma, base_rate, forced)
    rate_end = rates[-1] if rates else base_rate
    mem_total = sum(int(c.m) for c in candidates) if mem_cap is not None else 0
    if mem_cap is not None and mem_total <= mem_cap:
        mem_cap = None                                  # all of them fit: the dimension cannot bind
    M = 1 if mem_cap is None else mem_cap + 1          # memory axis (last, stride 1)
    shape = [c + 1 for c in counts]
    Sc = int(np.prod(shape)) if shape else 1           # count states
    S = Sc * M
    strides = [int(np.prod(shape[l + 1:])) * M for l in range(L)]
    cidx = np.arange(Sc)
    n_c = [(cidx // (strides[l] // M)) % shape[l] for l in range(L)]
    Rc = np.zeros(Sc)
    Nc = np.zeros(Sc, dtype=int)
    for l in range(L):
        Rc += n_c[l] * float(tier_rates[l])
        Nc += n_c[l]
    R = np.repeat(Rc, M)
    N = np.repeat(Nc, M)
    has_l = [np.repeat(n_c[l] >= 1, M) for l in range(L)]
    mem = np.tile(np.arange(M), Sc)
    idx = np.arange(S)
    D = np.full(S, np.inf)
    D[0] = 0.0
    t_c = now                               # the time D refers to
    order = sorted(range(len(candidates)), key=lambda i: max(candidates[i].pddl, now))
    k = 0                                   # next forced checkpoint not yet applied
    choices: list[tuple[int, int, int, np.ndarray]] = []

    def check_forced(upto: float) -> None:
        """Forced checkpoints in (t_c, upto]: the state keeps budget ≥ min(0, pb_base)."""
        nonlocal k, D
        k0 = k
        while k < len(times) and times[k] <= upto:
            k += 1
        if k == k0:
            return
        slack = np.maximum(np.asarray(after[k0:k]), 0.0)          # max(0, pb_base_k)
        tau = np.asarray(times[k0:k]) - t_c
        bound = np.repeat((slack[None, :] - Rc[:, None] * tau[None, :]).min(axis=1), M)
        D = np.where(D > bound + eps, np.inf, D)

    for i in order:
        c = candidates[i]
        d = max(c.pddl, now)
        check_forced(d)                     # forced jobs due at the same time go first
        D = D + R * (d - t_c)               # the deficit grows with the admitted decode demand
        t_c = d
        base = _base_at(d, now, sigma, base_rate, times, after, rates)
        l = c.tier
        m_i = int(c.m) if mem_cap is not None else 0
        shift = strides[l] + m_i
        can = has_l[l] & (mem >= m_i)
        Dn = np.full(S, np.inf)
        Dn[can] = D[idx[can] - shift] + c.p
        choose = can & (base - Dn >= -eps) & (Dn < D - eps)
        D = np.where(choose, Dn, D)
        choices.append((i, l, m_i, choose))
    check_forced(math.inf)
    valid = np.isfinite(D) & (rate_end + R <= sigma + eps)
    admitted = [False] * len(candidates)
    if not valid.any():
        # the forced requests alone exceed the decode rate: admit nothing
        return Admission(admitted, 0, _final_pb(now, sigma, base_rate, times, after, rates, t_c, 0.0, 0.0),
                         rate_end)
    key = np.where(valid, N * 1.0, -1.0)
    cand = np.flatnonzero(key == key.max())
    s = int(cand[np.argmin(D[cand])])
    state = s
    for i, l, m_i, choose in reversed(choices):
        if choose[state]:
            admitted[i] = True
            state -= strides[l] + m_i
    pb_end = _final_pb(now, sigma, base_rate, times, after, rates, t_c, float(D[s]), float(R[s]))
    used = sum(int(c.m) for c, a in zip(candidates, admitted) if a)
    return Admission(admitted, int(N[s]), pb_end, rate_end + float(R[s]), used)


def _final_pb(now, sigma, base_rate, times, after, rates, t_c, deficit, rate) -> float:
    """Budget of the chosen state at the last deadline (forced or admitted)."""
    t_end = max([t_c] + list(times[-1:]))
    return _base_at(t_end, now, sigma, base_rate, times, after, rates) - deficit - rate * (t_end - t_c)


def greedy_admit(now: float, sigma: float, base_rate: float, forced: Sequence[Job],
                 candidates: Sequence[Job], tier_rates: Sequence[float], eps: float = 1e-6) -> list[bool]:
    """Admit in deadline order whenever the set stays feasible: the baseline the
    DP improves on (used in tests to show the difference)."""
    taken: list[Job] = []
    out = [False] * len(candidates)
    for i in sorted(range(len(candidates)), key=lambda i: max(candidates[i].pddl, now)):
        c = candidates[i]
        trial = [Job(j.pddl, j.p, tier_rates[j.tier]) for j in taken] + [Job(c.pddl, c.p, tier_rates[c.tier])]
        res = admit_dp(now, sigma, base_rate, list(forced) + trial[:-1], [trial[-1]], [trial[-1].rate], eps=eps)
        if res.admitted[0]:
            taken.append(c)
            out[i] = True
    return out
