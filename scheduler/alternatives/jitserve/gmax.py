"""JITServe's GMAX (Grouped Margin Goodput Maximization) as a local policy.

Source: JITServe (Zhang, Wu et al., NSDI 2026) §4.2 and Algorithm 1; Wu's 2025 MS
thesis "SLO-aware Optimization and Stateful Orchestration for LLM Systems"
(Concord, the same algorithm under the name CALM) §4.2 and Algorithm 4.1.

Request Analyzer (Alg. 1 lines 2-6), for every queued request ``r``:

* ``len_rem(r)``: upper bound of the tokens still to come, refined as ``r``
  generates: the conditional quantile ``Q_q(L | L > n_r) − n_r`` of
  :class:`proserve.scheduler.alternatives.jitserve.length_bound.LengthBound` (in place of the paper's QRF;
  why, and its prior, are in that module). It learns from
  completed requests through :meth:`on_request_finished`.
* ``t_gen(r) = len_rem(r)·v_token(r)`` (§4.2): the slot time ``r`` still needs
  on this instance. ``v_token`` is the time of one step of this instance's
  batch (a running request gets one token per step): ``t_c`` plus the decodes
  of the running group, β-corrected (Eq. 5-7). Before its first (or, after a
  recompute preemption, next) token ``r`` also needs its prefill: ``T~_p`` of
  the remaining prompt plus one step overhead per ``token_budget`` chunk. On a
  prefill-only instance ``t_gen`` is the prefill alone: that is all of this
  instance's bandwidth ``r`` uses.
* ``goodput(r)``: "the achievable goodput contribution of completing r,
  depending on the developer's SLO specification" (§4.2). JITServe is agnostic
  to the goodput definition (§3); here it is the one the system is judged on.
  The requests of this project are JITServe's *latency-sensitive* type: token
  ``i`` is worth something iff it is emitted before
  ``deadline_{r,i} = arrival + TTFT_SLO + (i−1)·TPOT_SLO`` (JITServe §3 and
  PROSERVE Eq. 3 agree on this timeline; the footnote-2 ``ttft_anchored``
  variant of :class:`GainConfig` is honoured). So ``goodput(r)`` is the sum of
  ``w_r(i)`` over the tokens ``i = n+1 … n+len_rem`` that can still meet their
  deadline if ``r`` is served from now on (next token at ``now + t_first``,
  the following ones every ``v_token``): a late request that generates faster
  than its TPOT SLO catches up and regains its later tokens, one that cannot
  is worth nothing (the paper's scheduling filter ``t^r_SLO − t^r_comp ≥ 0``,
  Appendix C). With ``goodput="tdg"`` (default) ``w_r(i)`` is the TDG weight
  of Eq. 3 (``w_p·w_prio`` for the first token, ``w_d·w_prio`` after), so GMAX
  maximises the headline metric; ``goodput="tokens"`` counts every token as 1,
  JITServe's own token goodput (:mod:`proserve.scheduler.alternatives.jitserve.metrics`).
  The TTFT SLO enters through the first token's deadline, the TPOT SLO
  through the spacing of the later ones and through the catch-up rate
  ``TPOT_SLO − v_token``.
* ``Priority(r) = goodput(r) / t_gen(r)`` (§4.2: ``goodput_Δ/bw_Δ``, margin
  goodput per unit of bandwidth), with anti-starvation: ``goodput(r)`` is
  inflated by ``δ`` for every frame ``r`` has spent waiting outside the running
  group (§4.2, "inflates each deemed goodput(r) by a small additive constant δ
  per frame").

Scheduler (Alg. 1 lines 11-26), over the running *group* (the paper's batch of
size ``B``; vLLM's running set):

1. ``bp`` = the B-th highest priority; candidates = requests with priority
   ``≥ cutoff·bp`` (line 18, top-p filtering);
2. candidates sorted by input (prompt) length; a window of ``B`` slides over
   them and the window with the largest summed priority is the group (lines
   20-25; ties go to the first, i.e. shorter, window). With ``B`` or fewer
   requests all of them form the group.

Frames (§4.2 "Preemption to Correct Scheduling Errors"): the group is
re-decided only at frame boundaries, every ``frame_steps`` engine steps (steps
are counted from tokens emitted, so the simulator's fast-forwarded decode
stretches count in full). Between boundaries a finished member's slot is
filled at once, by the same top-p + window selection over the requests outside
the group (no running request is displaced: no churn). At a boundary the new
group may displace running members; each displacement of a member that has
started (holds KV) by an incoming request ``a`` happens only if::

    gain = P(a)·min(t_gen(a), t_Δ) − P(v)·min(t_gen(v), t_Δ)     t_Δ = frame_steps·v_token
    goodput_loss = stall_duration × token_generation_speed
    gain > goodput_loss

where ``token_generation_speed`` is the goodput rate of the running group,
``Σ P(r)``, and ``stall_duration`` is the batch stall the swap causes. In this
interface a displaced decode simply waits with its KV kept (it is left out of
the batches; nothing is evicted or reloaded, so its own stall is 0) and a
displaced partial prefill keeps its computed KV; what does stall the batch is
computing the incoming request's KV: ``β·T~_p`` of its remaining prefill (0 if
it is itself a paused decode, whose KV is kept). The pairs are taken highest
incoming priority against lowest victim priority first.

Each step the batch is formed from the group as vLLM's chunked prefill would
(the paper's backend, §5): the group's decodes (co-located), then its prefills
in priority order with chunks of what is left of ``token_budget`` (decodes
count one token each), within the KV memory. If the group can make no progress
at all (its prefills do not fit in memory) the rest of the queue is tried in
priority order, so that the instance never idles while something could run.
On a prefill-only instance (``InstanceView.mode == "prefill_only"``) only the
waiting requests are considered and only prefills are planned.

``ScheduleInfo.n_urgent`` reports the size of the running group and
``n_normal`` the requests outside it; ``t_budget`` is NaN (token budget).

Parameters and defaults (the paper's value where it gives one):

* ``batch_size`` (B) ``= "auto"``. Co-located: the number of decodes whose
  step fits the tightest TPOT SLO, ``⌊(TPOT_min − t_c)/T~_d(l̄)⌋`` with ``l̄``
  the mean context length of the queue, re-evaluated each step — §4.2: "for
  latency-sensitive requests, explicit SLOs (e.g., TBT) already define the
  per-token service bandwidth", and a slot yields one token per step, so this
  is the largest group whose members each still get that bandwidth.
  Prefill-only: the number of mean-sized remaining prompts that fit one step's
  token budget (the group is then the prefill batch itself, as in Alg. 1). An
  integer fixes B (vLLM's ``max_num_seqs``). Note: on the bundled 7B-class
  model the KV memory (about 80 requests of the Azure trace's mean context)
  fills before this B (about 150) is reached, so there the group holds every
  queued request and GMAX reduces to goodput/t_gen-ordered chunked prefill;
  the window, the frames and the preemption guard act when B binds (a smaller
  ``batch_size``, a larger memory, longer contexts).
* ``cutoff`` (p) ``= 0.95``: the paper's example value (§4.2).
* ``frame_steps`` (Δ) ``= 50``: the paper's frame, "Δ = 50 decoding steps;
  about 300 ms" (§4.2).
* ``delta`` (δ) ``= 1.0``: in goodput units, one decode token of a weight-1
  request per frame waited. "Small" as the paper asks: it never outweighs the
  achievable goodput of an on-time request (hundreds of tokens) for many
  frames, but it orders the requests that have no achievable goodput left
  (hopelessly late) by how long they have waited, which is what keeps them from
  starving behind each other.
* ``token_budget = None``: Sarathi-Serve's TBT-profiled budget
  (:meth:`LocalPolicy.tbt_token_budget`), as the project's other token-budget
  policies use; an integer fixes it (vLLM's ``max_num_batched_tokens``).
* ``goodput = "tdg"`` (see above) or ``"tokens"``.
* ``quantile = 0.95``, ``history = 5000``, ``min_samples = 20``,
  ``prior_len = 1024``: the length bound (reasons in
  :mod:`proserve.scheduler.alternatives.jitserve.length_bound`).

Left out, with reasons: the online adaptation of ``p`` (§4.2 explores
thresholds and keeps the best; per-frame goodput is dominated by arrival
fluctuations at the trace lengths simulated here, so a bandit would mostly
chase noise — ``p`` is a fixed parameter instead); compound requests and
pattern-graph sub-deadlines (§4.1; requests here are single calls);
deadline-sensitive (E2EL) requests (requests here carry TTFT/TPOT SLOs only);
the fairness blend ``(1−f)·priority + f·Fair`` (§4.3, an optional extension);
dropping requests unscheduled after ``waiting_time`` (§5; a policy cannot fail
a request in this interface).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

from ... import validate
from ...local.base import COLOCATED, BatchBuilder, BatchPlan, InstanceView, LocalPolicy, StepTerms
from ...registry import register_local
from ...request import Request
from .length_bound import LengthBound

GOODPUTS = ("tdg", "tokens")


# -- Request Analyzer (Alg. 1 lines 2-6) ------------------------------------------------------

def achievable_goodput(L: int, lam: float, s: float, w_first: float, w_rest: float) -> float:
    """Goodput still achievable by a request with ``L`` tokens to come (bound).

    Its next token is emitted ``lam`` seconds after that token's deadline
    (``lam < 0``: early), and each later one ``v`` seconds after the previous
    while their deadlines are ``TPOT_SLO`` apart; ``s = TPOT_SLO − v``. Token
    ``j = 0 … L−1`` (counted from the next one) meets its deadline iff
    ``j·s > lam`` (strict, as Eq. 3). The next token is worth ``w_first``, the
    others ``w_rest`` each.
    """
    if L <= 0:
        return 0.0
    if s > 0.0:
        if lam < 0.0:
            j_min = 0
        else:
            x = lam / s
            if x >= L:
                return 0.0
            j_min = math.floor(x) + 1
        count = L - j_min
        if count <= 0:
            return 0.0
        return w_first + (count - 1) * w_rest if j_min == 0 else count * w_rest
    if lam >= 0.0:
        return 0.0
    if s == 0.0:
        count = L
    else:  # slower than the TPOT SLO: the early lead is used up after -lam/|s| tokens
        x = lam / s
        count = L if x >= L else math.ceil(x)
    return w_first + (count - 1) * w_rest


def gmax_select(reqs: list[Request], B: int, cutoff: float, prio: Mapping[str, float]) -> list[Request]:
    """Alg. 1 lines 16-25 over requests whose Priority(r) is ``prio[r.id]``.

    Top-p filtering against the B-th highest priority, then the size-B window
    of the candidates sorted by input length with the largest summed priority.
    """
    if B <= 0:
        return []
    if len(reqs) <= B:
        return list(reqs)
    bp = heapq.nlargest(B, (prio[r.id] for r in reqs))[-1]         # line 16: BATCHPRIORITY
    thr = bp * cutoff
    cand = [r for r in reqs if prio[r.id] >= thr]                  # line 18
    cand.sort(key=_by_input_len)                                   # line 20 (stable)
    p = [prio[r.id] for r in cand]
    score = math.fsum(p[:B])
    best, best_i = score, 0
    for i in range(B, len(cand)):                                  # lines 22-25
        score += p[i] - p[i - B]
        if score > best * (1 + 1e-12) + 1e-300:   # strict; the slack absorbs the running sum's rounding
            best, best_i = score, i - B + 1
    return cand[best_i:best_i + B]


def _by_input_len(r: Request) -> int:
    return r.prompt_len


def _by_priority_desc(reqs, prio: Mapping[str, float]) -> list[Request]:
    """``reqs`` by Priority descending (stable: equal priorities keep their order)."""
    return sorted(reqs, key=lambda r: prio[r.id], reverse=True)


@register_local
class GMAX(LocalPolicy):
    name = "jitserve_gmax"
    summary = ("JITServe GMAX: goodput/t_gen priority with an online length bound, top-p + "
               "input-length window, frame-boundary preemption")

    def __init__(self, estimator, gain=None, classes=None, batch_size="auto", cutoff: float = 0.95,
                 frame_steps: int = 50, delta: float = 1.0, token_budget: int | None = None,
                 goodput: str = "tdg", quantile: float = 0.95, history: int = 5000,
                 min_samples: int = 20, prior_len: int = 1024):
        super().__init__(estimator, gain, classes)
        n = self.name
        if batch_size is None or batch_size == "auto":
            self.batch_size = None
        else:
            self.batch_size = validate.integer(n, "batch_size", batch_size)
        self.cutoff = validate.number(n, "cutoff", cutoff, 0, 1, lo_open=True)
        self.frame_steps = validate.integer(n, "frame_steps", frame_steps)
        self.delta = validate.non_negative(n, "delta", delta)
        if token_budget is not None:
            token_budget = validate.integer(n, "token_budget", token_budget)
        self.token_budget = token_budget
        self.goodput = validate.one_of(n, "goodput", goodput, GOODPUTS)
        self.bound = LengthBound(quantile, history, min_samples, prior_len, where=n)
        # state across steps
        self._group: set[str] = set()               # ids of the running group
        self._waited: dict[str, int] = {}           # frames spent waiting outside the group
        self._frame_pos = self.frame_steps          # steps into the current frame (first call: boundary)
        self._last_decodes: list[tuple[Request, int]] = []  # (decode, tokens emitted) of the last plan
        self.preemptions = 0                        # displacements of started members
        self.kept = 0                               # displacements refused by the cost check
        self.last_B = 0

    # -- learning ------------------------------------------------------------------------
    def on_request_finished(self, req: Request, now: float) -> None:
        if req.error is None and req.num_emitted >= 1:
            self.bound.observe(req.num_emitted)     # its true output length (§4.1 refinement data)
        self._group.discard(req.id)
        self._waited.pop(req.id, None)

    # -- helpers ---------------------------------------------------------------------------
    def _steps_elapsed(self) -> int:
        """Engine steps since the last call: the tokens the last plan's decodes have
        emitted since (the simulator runs a pure-decode stretch as one call)."""
        k = 1
        for r, e in self._last_decodes:
            d = len(r.token_times) - e
            if d > k:
                k = d
        return k

    def _group_size(self, Q: list[Request], mode: str, tb: int, t_d: float) -> int:
        """B; ``t_d`` is T~_d at the queue's mean context."""
        if self.batch_size is not None:
            return self.batch_size
        if mode == COLOCATED:
            if t_d <= 0:
                return len(Q)
            room = self.min_tpot_slo() - self.est.t_c
            return max(1, int(room / t_d)) if room > 0 else 1
        mean_q = sum(r.remaining_prefill for r in Q) / len(Q)
        return max(1, math.ceil(tb / max(mean_q, 1.0)))

    def _len_rem(self, r: Request, n: int) -> float:
        """len_rem(r): the online bound on the tokens still to come after ``n``."""
        return self.bound.remaining(n)

    def _analyze(self, Q: list[Request], now: float, colocated: bool, v_step: float,
                 tb: int) -> tuple[list[float], list[float], list[float]]:
        """Alg. 1 lines 2-6 for every request: t_gen(r), the time to its next token's
        deadline, and Priority(r) (three lists over ``Q``)."""
        gain = self.gain
        cost = self.est.costs()
        t_c = cost.t_c
        tdg = self.goodput == "tdg"
        w_p, w_d = (gain.w_p, gain.w_d) if tdg else (1.0, 1.0)
        delta, waited = self.delta, self._waited
        step_base = v_step if colocated else t_c
        execs, remains, prios = [], [], []
        for r in Q:
            n = len(r.token_times)
            L = self._len_rem(r, n)                                   # len_rem(r), §4.1
            q = r.prefill_len - r.prefilled
            if q > 0:
                # prefill: T~_p (Eq. 5) plus one step per token-budget chunk
                t_first = cost.prefill(q, r.kv_len) + (-(-q // tb)) * step_base
            else:
                t_first = v_step
            if colocated:
                v = v_step
                t_gen = t_first + (L - 1) * v                         # len_rem·v_token (+ prefill)
            else:
                v = t_c + cost.decode(r.prompt_len + n)               # decode elsewhere, lightly loaded
                t_gen = t_first                                       # this instance's bandwidth: the prefill
            d_next = gain.next_token_deadline(r)                      # deadline_{r,n+1} (Eq. 3)
            w = r.weight if tdg else 1.0
            g = achievable_goodput(L, now + t_first - d_next, r.tpot_slo - v,
                                   (w_p if n == 0 else w_d) * w, w_d * w)
            c = waited.get(r.id)
            if c:
                g += delta * c                                        # anti-starvation, §4.2
            if t_gen <= 0:
                t_gen = 1e-9
            execs.append(t_gen)
            remains.append(d_next - now)
            prios.append(g / t_gen)                                   # Priority(r) = goodput/t_gen
        return execs, remains, prios

    # -- frame boundary: re-decide the group, guarded preemption ------------------------------
    def _regroup(self, Q: list[Request], members: list[Request], B: int, v_step: float,
                 prio: dict[str, float], t_gen: dict[str, float]) -> list[Request]:
        chosen = gmax_select(Q, B, self.cutoff, prio)
        chosen_ids = {r.id for r in chosen}
        member_ids = {r.id for r in members}
        group = [r for r in members if r.id in chosen_ids]
        adds = _by_priority_desc((r for r in chosen if r.id not in member_ids), prio)
        victims = sorted((r for r in members if r.id not in chosen_ids), key=lambda r: prio[r.id])
        free = B - len(members)
        if free > 0:
            group += adds[:free]
            adds = adds[free:]
        if adds:
            est = self.est
            t_frame = self.frame_steps * v_step
            speed = sum(prio[r.id] for r in members if _started(r))   # goodput rate of the running group
            for a, v in zip(adds, victims):
                if not _started(v):
                    group.append(a)       # not running yet: nothing to preempt
                    continue
                gain = prio[a.id] * min(t_gen[a.id], t_frame) - prio[v.id] * min(t_gen[v.id], t_frame)
                stall = est.prefill(a.prefill_len - a.prefilled, a.kv_len) if a.needs_prefill else 0.0
                if gain > stall * speed:   # goodput_loss = stall_duration × token_generation_speed
                    group.append(a)
                    self.preemptions += 1
                else:
                    group.append(v)
                    self.kept += 1
        return group

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self, view: InstanceView) -> BatchPlan:
        colocated = view.mode == COLOCATED
        Q = list(view.waiting)
        if colocated:
            Q += view.decoding
        tb = self.token_budget or self.tbt_token_budget()
        b = BatchBuilder(view, self.est)
        self._frame_pos += self._steps_elapsed()
        self._last_decodes = []
        if not Q:
            return b.finish(token_budget=tb)
        est = self.est
        t_d = est.decode(sum(_context(r) for r in Q) / len(Q))   # T~_d at the mean context (Eq. 6)
        B = self.last_B = self._group_size(Q, view.mode, tb, t_d)
        # v_token: one step of the running batch (t_c + its decodes, Eq. 6-7)
        if colocated and view.decoding:
            dec = view.decoding
            mean_kv = sum(r.kv_len for r in dec) / len(dec)
            v_step = est.t_c + min(B, len(dec)) * est.decode(mean_kv)
        else:
            v_step = est.t_c + t_d
        execs, remains, prios = self._analyze(Q, view.now, colocated, v_step, tb)
        ids_q = [r.id for r in Q]
        prio = dict(zip(ids_q, prios))
        group_ids = self._group
        members = [r for r in Q if r.id in group_ids]
        if self._frame_pos >= self.frame_steps:
            self._frame_pos = 0
            group = self._regroup(Q, members, B, v_step, prio, dict(zip(ids_q, execs)))
            ids = {r.id for r in group}
            old = self._waited                # δ per frame spent outside the group; drop gone ids
            self._waited = {r.id: c for r in Q if (c := old.get(r.id, 0) + (r.id not in ids))}
        else:
            group = members
            free = B - len(members)
            if free > 0:
                others = [r for r in Q if r.id not in group_ids]
                group = members + gmax_select(others, free, self.cutoff, prio)
            ids = {r.id for r in group}
        self._group = ids
        b.plan.terms = StepTerms(Q, execs, remains, prios, [i in ids for i in ids_q])
        self._fill(b, _by_priority_desc(group, prio), colocated, tb)
        if b.plan.empty:
            # the group cannot progress (memory): stay work-conserving with the rest
            self._fill(b, _by_priority_desc((r for r in Q if r.id not in ids), prio), colocated, tb)
        self._last_decodes = [(r, len(r.token_times)) for r in b.plan.decode]
        return b.finish(token_budget=tb, n_urgent=len(group), n_normal=len(Q) - len(group))

    @staticmethod
    def _fill(b: BatchBuilder, ordered: list[Request], colocated: bool, tb: int) -> None:
        """vLLM chunked prefill over ``ordered``: decodes first, then prefill chunks."""
        if colocated:
            for r in ordered:
                if not r.needs_prefill and b.tokens < tb:
                    b.add_decode(r)       # one that needs a missing block waits
        for r in ordered:
            if r.needs_prefill:
                left = tb - b.tokens
                if left <= 0:
                    break
                b.add_prefill(r, left)    # 0 if memory is short: others holding KV may still fit


def _context(r: Request) -> int:
    """The KV length ``r``'s next decode step attends to (prompt + emitted − 1)."""
    n = len(r.token_times)
    return r.prompt_len + n - 1 if n else r.prompt_len


def _started(r: Request) -> bool:
    """Running in the paper's sense: holds KV or has emitted tokens."""
    return r.holds_kv or bool(r.token_times)
