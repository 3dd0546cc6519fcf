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

Two rules the paper does not have (issue 13; ``headroom=0, age_limit=None``
gives Algorithm 1's plan exactly whenever that plan is not empty; when nothing fits
the budget, e.g. η below one item's cost, Algorithm 1 plans nothing and this takes one
least step instead, :meth:`SlideBatching._least_step`). Defaults measured in
docs/results.md §10:

* ``headroom = h``: TPOT headroom. Line 7 becomes
  ``t_budget = max(min remain − h·η, (1 − h)·η)``: each step is planned to end
  ``h·η`` before the tightest next-token deadline, and the floor η drops by the
  same margin. Without it a loaded instance paces decodes at exactly η (the
  TPOT SLO): any estimate error or host overhead pushes the mean TPOT over the
  SLO, and strict SLO attainment (mean TPOT *below* the SLO, §5.1) is lost
  although every token meets its TDG deadline. Default 0.3: in the simulator
  (bundled trace, 1 co-located instance, step noise CV 0.1) the best of 0, 0.05,
  0.1, 0.2, 0.3, 0.4 and 0.5 for both TDG_Ratio and SLO attainment from 3.5
  req/s on (faster decodes also let late requests' later tokens catch up with
  their deadlines), and level with h = 0 below.
* ``pace``: which deadline of a decoding request bounds the budget (line 6).
  ``"eq3"`` (the default, Algorithm 1): its next token's Eq. 3 deadline, counted
  from arrival, so a request whose first token came early has slack, and the
  budget lets decode steps run slower than the TPOT SLO while that slack lasts:
  every token meets its TDG deadline, but the request's mean TPOT (what strict
  SLO attainment counts) can end above the SLO. ``"first_token"``: the earlier of
  that and the deadline anchored at the first token (the paper's footnote 2,
  ``t_1 + k·TPOT_SLO`` for token k+1), which keeps each decode's running mean
  TPOT within the SLO (less the headroom); NORMAL requests are ordered by that
  remain too (else a decode that bounds the budget could wait behind a prompt
  whose Eq. 3 deadline is earlier). URGENT marking and density keep Eq. 3.
  Measured on a real engine (docs/results.md §4.2): at 0.7× capacity it is
  the better setting (+0.02 TDG_Ratio, +0.08 SLO attainment), at 0.35× it did
  not raise strict attainment (a stream that ran fast has banked slack against
  its running mean, so single stalls remain), so it is not the default.
* ``budget_cap = c`` (default None: no cap): the budget is at most ``c·η`` (and
  at least the floor). Algorithm 1 lets the budget grow to the least remain, up
  to a TTFT SLO when every decode has slack, so one step can carry a long
  prefill that stalls every running stream and every request arriving during it;
  the paper (§4.2) expects ``[η, max TPOT_SLO]`` only under load. A cap keeps
  that range at every load. On the real engine (docs/results.md §4.2, one run)
  a cap of 1.2·η did not raise SLO attainment: steps stayed short, but decodes
  were still left out of steps for prompts with nearer deadlines.
* ``decode_first`` (default False): ``True``: NORMAL decodes go before NORMAL
  prefills (Sarathi-Serve's decode-first, within the sliding order). Under Eq. 3
  a decode with slack has a later remain than a new prompt, so Algorithm 1
  leaves it out of steps while prompts fill the budget, and its stream pauses
  (measured on the real engine: 9–15 of 28 decodes left out for six steps, a
  0.56 s gap; docs/results.md §4.2). URGENT requests keep density order.
  Measured there, it is worse (TDG_Ratio 0.930 against 1.000 at 0.35×
  capacity): at the budget's floor the decodes and t_c leave prompts a few ms,
  and URGENT prompts still push decodes out. ``"all"``: every decode goes
  first, URGENT or not (as vLLM's own scheduler does), and the prefills follow
  in Algorithm 1's order (URGENT by density, NORMAL by remain) in what is left
  (with aging on, aged prompts still take their share ρ first; and decodes that
  do not fit the budget wait, as in Algorithm 1). A decode costs a fraction of a
  millisecond, so a step then holds every running stream and its TPOT is the
  step's length, which ``headroom`` and ``budget_cap`` bound. On the real engine
  (docs/results.md §4.3, three runs) ``"all"`` with ``phi="c"``,
  ``headroom=0.1`` and ``budget_cap=0.9`` (steps planned at 0.9·η) raised SLO
  attainment below saturation (0.988 at 0.35× capacity, 0.918 at 0.7×, against
  the defaults' 0.950 and 0.739 the day before) but not past it (TDG_Ratio
  0.798 ± 0.094 at 1.1×, against 0.863); it is not the default, which stays
  the simulator's choice (§10).
* ``skip_late_prompts`` (default False): line 6 takes the least remain over
  the queue so that no request misses its deadline in this step. A prompt whose
  remaining prefill cannot end by its first-token deadline even alone in a step
  from now (``exec + t_c > remain``) misses it whatever the step's length, yet
  as written its remain (small, then negative) pins the budget to the floor, so
  the one request that most needs long steps is cut into η-sized chunks, each
  paying t_c (measured on the real engine: a 1,018-token prompt in 17 steps of
  45 ms; docs/results.md §4.5). With ``True`` such prompts do not bound the
  budget; decodes and prompts that can still make their deadline do. When only
  such prompts are queued, the budget is ``budget_cap·η``, or line 6 as
  written when no cap is set. Use it with a cap: on the real engine with
  ``budget_cap=4`` it raised 0.35× capacity from 0.974 to 0.982 TDG_Ratio
  (level with tuned stock vLLM); in the simulator without a cap it is level
  on the bundled trace and worse on long prompts (0.816 against 0.834 at
  0.2 req/s on the Mooncake trace: the budget grows to the decodes' Eq. 3
  slack, and 12k-token steps stall them).
* ``catch_up = m`` (default None: off): a request whose deadline is missed
  keeps gaining from its later tokens, whose Eq. 3 deadlines are fixed from
  its arrival: each decode step shorter than TPOT_SLO wins back the
  difference. Algorithm 1 does the opposite: a late decode's remain pins the
  budget to its floor η, which other prompts' chunks then fill, so the late
  stream runs at ~η a token and never catches up (measured on the real engine:
  a late 1,018-token prompt's 14 tokens 29 ms apart, all missed). With
  ``catch_up``, while a decode is late (its next deadline less than ``m·η``
  away: the engine's token reaches the client some tens of ms later), the
  budget is the least with which the queued prompts still end by their
  deadlines (:meth:`SlideBatching._catch_up_budget`); off when a prompt cannot
  make its deadline at all, so past saturation Algorithm 1 decides. On the
  real engine, added to §4.5's setting, ``catch_up=1`` made 0.35× capacity
  level with or ahead of the best-tuned stock vLLM overall on both metrics
  (0.985 / 0.937 against 0.984 / 0.928; docs/results.md §4.5), the setting
  without it 0.982 / 0.932 against 0.983 / 0.928. In the simulator, with the
  defaults otherwise, level (TDG_Ratio within 0.001 on the bundled trace and
  on the Mooncake trace's long prompts); off by default.
* ``stretch`` (default False; only with ``pace="first_token"``): first-token
  pacing bounds each step by the running decodes' mean-TPOT pace, so while a
  stream is decoding a prompt is cut into η-sized chunks even where every
  decode's Eq. 3 deadline (what TDG scores) has slack to spare; a prompt that
  could make its first-token deadline with longer steps then misses it, and a
  late one reaches its first token later, with fewer of its decode tokens
  catching up (measured on the real engine at 0.35× capacity: a 329-token
  high-class prompt's first token at 0.66 s against stock vLLM's 0.47 s with
  256-token chunks; docs/results.md §4.6). With ``True``, when the queued
  prompts do not all end by their deadlines at the paced budget
  (:meth:`SlideBatching._stretched`), the budget is lines 6-7 over the Eq. 3
  remains instead (late prompts skipped, the cap kept): a decode's TDG deadline
  is never given up, only its running-mean pace. Measured there over eight
  seeds, added to §4.5's setting: TDG_Ratio +0.008 ± 0.010 (high class +0.010),
  SLO attainment −0.036 ± 0.017 (longer steps break short streams' mean TPOT);
  at 0.7× and 1.1× (one run) SLO attainment 0.581 / 0.582 against 0.758 / 0.622
  (under load a prompt is nearly always at risk); off by default.
* ``age_limit = k`` (default 8), ``age_share = ρ`` (default 0.25): no starvation. A request that has
  waited ``k·TTFT_SLO`` for its first token is AGED: aged requests run before
  the sliding order, oldest first, within ``ρ·(t_budget − t_c)`` of each step
  (the rest of the budget follows Algorithm 1, and budget left at the end grows
  the aged chunks). Aging holds while the aged requests are at most ρ of the
  queued work (sum of exec): below saturation, where that is so, an aged
  request's wait for its first token is bounded by ``k·TTFT_SLO`` plus the
  prefill time of the aged requests ahead of it at share ρ. Past saturation the
  aged backlog outgrows ρ and Algorithm 1 alone decides: serving hopeless
  requests first there only loses gain (measured: TDG_Ratio 0.957 → 0.905 at
  1.1× capacity with share 0.1 and no such guard); the dispatcher's admission
  control (``on_overload``) is the remedy past saturation.
"""

from __future__ import annotations

import dataclasses
import math

from .. import validate
from ..cost import queue_terms
from ..registry import register_local
from .base import COLOCATED, PREFILL_ONLY, BatchBuilder, BatchPlan, InstanceView, LocalPolicy, StepTerms

PHIS = ("auto", "a", "c", "p")
PACES = ("eq3", "first_token")


@register_local
class SlideBatching(LocalPolicy):
    name = "slide_batching"
    summary = "PROSERVE SlideBatching (Alg. 1): latency budget, sliding URGENT/NORMAL boundary"
    router_order = "slide"   # what GoRouting's schedule-aware estimate assumes (routing.estimates)

    #: how requests are ordered: "slide" (the algorithm), or an ablation of §5.4
    ordering = "slide"
    #: False for the "w/o latency-aware" ablation (fixed token budget instead of t_budget)
    latency_aware = True

    def __init__(self, estimator, gain=None, classes=None, gamma: float = 1.0,
                 eta: float | None = None, phi: str = "auto", token_budget: int | None = None,
                 headroom: float = 0.3, age_limit: float | None = 8.0, age_share: float = 0.25,
                 pace: str = "eq3", budget_cap: float | None = None, decode_first: bool | str = False,
                 skip_late_prompts: bool = False, catch_up: float | None = None, stretch: bool = False):
        super().__init__(estimator, gain, classes)
        self.gamma = validate.positive(self.name, "gamma", gamma)
        self.eta = validate.positive(self.name, "eta", self.min_tpot_slo() if eta is None else eta)
        self.phi = validate.one_of(self.name, "phi", phi, PHIS)
        if token_budget is not None:
            token_budget = validate.integer(self.name, "token_budget", token_budget)
        self.token_budget = token_budget
        self.headroom = validate.number(self.name, "headroom", headroom, 0.0, 1.0, hi_open=True)
        # age_limit None or inf: no aging (Algorithm 1 as written)
        self.age_limit = math.inf if age_limit is None else validate.positive(
            self.name, "age_limit", age_limit, allow_inf=True)
        self.age_share = validate.number(self.name, "age_share", age_share, 0.0, 1.0, lo_open=True)
        self.pace = validate.one_of(self.name, "pace", pace, PACES)
        if decode_first is not True and decode_first is not False and decode_first != "all":
            validate.fail(self.name, "decode_first", 'true, false or "all"', decode_first)
        self.decode_first = decode_first
        self.skip_late_prompts = validate.boolean(self.name, "skip_late_prompts", skip_late_prompts)
        # catch_up None: off (Algorithm 1 as written); else the margin, in η, a decode's next
        # deadline must be ahead by for it not to count as late
        self.catch_up = None if catch_up is None else validate.non_negative(self.name, "catch_up", catch_up)
        self.stretch = validate.boolean(self.name, "stretch", stretch)
        if self.stretch and self.pace != "first_token":
            validate.fail(self.name, "stretch", 'false unless pace="first_token" (it relaxes that pacing)', stretch)
        # budget_cap None or inf: no cap (Algorithm 1 as written)
        self.budget_cap = math.inf if budget_cap is None else validate.positive(
            self.name, "budget_cap", budget_cap, allow_inf=True)

    # -- Alg. 1 lines 1-7 --------------------------------------------------------
    def _annotate(self, Q, now: float) -> tuple[list[float], list[float], list[float]]:
        """exec, remain and density of every request of ``Q`` (lines 3-5)."""
        execs, remains = queue_terms(self.est.costs(), self.gain, Q, now)   # lines 3-4
        execs = [ex if ex > 0 else 1e-9 for ex in execs]
        w_p, w_d = self.gain.w_p, self.gain.w_d
        dens = [(w_d if r.token_times else w_p) * r.weight / ex             # line 5
                for r, ex in zip(Q, execs)]
        return execs, remains, dens

    # -- Alg. 1 lines 8-12 ---------------------------------------------------------
    def _phi_kind(self, mode: str) -> str:
        if self.phi != "auto":
            return self.phi
        return "p" if mode == PREFILL_ONLY else "a"

    def _mark_urgent(self, execs: list[float], remains: list[float], t_budget: float, mode: str) -> list[bool]:
        g = self.gamma
        t_c = self.est.t_c
        kind = self._phi_kind(mode)
        if kind == "p":
            # φ_p(r, Q) = Σ exec + |Q|·t_c  (one request per batch, worst case)
            limit = g * (sum(execs) + len(execs) * t_c)
            return [rem < limit for rem in remains]
        scale = t_budget / (t_budget - t_c) if t_budget > t_c else math.inf
        if kind == "a":
            # Eq. 8: φ_a(Q) = t_budget/(t_budget - t_c) · Σ_{r∈Q} r.exec
            limit = g * scale * sum(execs)
            return [rem < limit for rem in remains]
        # Eq. 9: φ_c(req, Q) = t_budget/(t_budget - t_c) · Σ_{i≤req.index} Q[i].exec, Q by remain asc
        urgent = [False] * len(execs)
        acc = 0.0
        for i in sorted(range(len(execs)), key=remains.__getitem__):
            acc += execs[i]
            urgent[i] = remains[i] < g * scale * acc
        return urgent

    def _order(self, remains: list[float], dens: list[float], urgent: list[bool], Q=None) -> list[int]:
        """Line 13: URGENT by density desc, then NORMAL by remain asc (indices into Q). With
        ``Q`` and ``decode_first=True``, NORMAL decodes go before NORMAL prefills; with
        ``decode_first="all"``, every decode goes first (URGENT ones by density, then the
        NORMAL ones by remain), then the prefills in Algorithm 1's order."""
        idx = range(len(remains))
        up = sorted((i for i in idx if urgent[i]), key=dens.__getitem__, reverse=True)  # stable, as -density
        normal = sorted((i for i in idx if not urgent[i]), key=remains.__getitem__)
        if Q is None or not self.decode_first:
            return up + normal
        decode = [r.prefilled >= r.prefill_len for r in Q]
        split = lambda part: [i for i in part if decode[i]] + [i for i in part if not decode[i]]
        return split(up + normal) if self.decode_first == "all" else up + split(normal)

    def _paced(self, Q, remains: list[float], now: float) -> list[float]:
        """The remains that set the budget (line 6) and order the NORMAL requests (line 13).
        ``pace="eq3"``: Eq. 3's, as written. ``pace="first_token"``: a decoding request's
        remain is to the earlier of its Eq. 3 deadline and its first-token-anchored one
        (footnote 2: ``t_1 + k·TPOT_SLO`` for its token k+1), so slack won by an early first
        token is not spent on slower decode steps. URGENT marking and density keep Eq. 3."""
        if self.pace == "eq3":
            return remains
        # the footnote-2 deadline is GainConfig's own (deadline="ttft_anchored"): never later
        # than Eq. 3's, and the same for a request without its first token
        anchored = dataclasses.replace(self.gain, deadline="ttft_anchored")
        return [anchored.next_token_deadline(r) - now if r.token_times else rem for r, rem in zip(Q, remains)]

    def _late_prompt(self, r, ex: float, rem: float) -> bool:
        """A prompt whose remaining prefill cannot end by its first-token deadline even
        alone in a step from now (exec + t_c > remain): it misses that deadline whatever
        this step's length."""
        return r.prefilled < r.prefill_len and ex + self.est.t_c > rem

    def _late_prompts_skipped(self, Q, execs: list[float], paced: list[float]) -> list[float]:
        """The remains that bound the budget (line 6) with ``skip_late_prompts``: a late
        prompt's remain does not bound it (+inf); every other request's does, decodes always
        (a late decode's next tokens still gain from short steps: each has its own deadline)."""
        return [math.inf if self._late_prompt(r, ex, rem) else rem for r, ex, rem in zip(Q, execs, paced)]

    def _bounded(self, bounds: list[float], h: float) -> float:
        """Lines 6-7: the least of ``bounds`` less the headroom, at most the cap, at least the floor."""
        return max(min(min(bounds) - h * self.eta, self.budget_cap * self.eta), (1.0 - h) * self.eta)

    def _step_parts(self, Q, execs: list[float], remains: list[float], prompt_remains: list[float],
                    h: float) -> tuple[float, list[tuple[float, float]], list[float]]:
        """What :meth:`_stretched` and :meth:`_catch_up_budget` size a step from: ``t_c`` plus
        the decodes' exec (every step pays it), each queued prompt's (remain from
        ``prompt_remains`` less the headroom, exec), and each decode's remain."""
        fixed = self.est.t_c
        prompts: list[tuple[float, float]] = []
        decode_remains: list[float] = []
        for r, ex, rem, prem in zip(Q, execs, remains, prompt_remains):
            if r.prefilled >= r.prefill_len:
                fixed += ex
                decode_remains.append(rem)
            else:
                prompts.append((prem - h * self.eta, ex))
        return fixed, prompts, decode_remains

    def _stretched(self, Q, execs: list[float], remains: list[float], t_budget: float, h: float) -> float:
        """With ``stretch`` (and ``pace="first_token"``): the budget when a queued prompt is at
        risk at ``t_budget``, i.e. the prompts in remain order do not all end by their
        first-token deadlines (less the headroom) at steps of ``t_budget``, each paying ``t_c``
        and the decodes (``D``) first: a prefix of cumulative exec ``E_i`` takes
        ``E_i·B/(B − t_c − D)`` (the bound of :meth:`_catch_up_budget`); late prompts are at
        risk by that test. First-token pacing then yields to Eq. 3: the budget is lines 6-7
        over the Eq. 3 remains (late prompts skipped, as ``skip_late_prompts`` does), so no
        decode's TDG deadline is given up, only the running-mean pace, and the prompt's first
        token (and a late prompt's decodes, whose deadlines are fixed from its arrival) come
        sooner. Never shorter than ``t_budget``."""
        fixed, prompts, _ = self._step_parts(Q, execs, remains, remains, h)
        if not prompts:
            return t_budget
        cum = 0.0
        for rem, ex in sorted(prompts):
            cum += ex
            if t_budget <= fixed or cum * t_budget / (t_budget - fixed) > rem:
                break                                               # at risk
        else:
            return t_budget
        eq3 = self._late_prompts_skipped(Q, execs, remains)
        if min(eq3) == math.inf and self.budget_cap == math.inf:
            return t_budget                                         # nothing would bound it
        return max(t_budget, self._bounded(eq3, h))

    def _catch_up_budget(self, Q, execs: list[float], remains: list[float], paced: list[float],
                         h: float) -> float:
        """With ``catch_up``: the budget while a decode is late, i.e. its next token's Eq. 3
        deadline is less than ``catch_up·η`` away (or past). A late decode meets no deadline
        whatever this step's length, so line 6 pins the budget to its floor η; but its
        *later* tokens' deadlines are fixed from its arrival, so it wins them back by
        ``TPOT_SLO − step`` per token, and η-long steps (the floor, filled with other
        prompts' chunks) win nothing back. Here the step is as short as the queued prompts
        allow: the least ``B`` with which the prompts in remain order still end by their
        deadlines at steps of ``B``, each paying ``t_c`` and the decodes (``D``) before its
        prefill share: a prefix of cumulative exec ``E_i`` due in ``R_i`` needs
        ``E_i·B/(B − t_c − D) ≤ R_i``, i.e. ``B ≥ (t_c + D)·R_i/(R_i − E_i)`` (``R_i`` less
        the headroom), and at least ``t_c + D``. Off (inf) when no decode is late, or when
        a queued prompt cannot make its deadline at any B (a late prompt's own decodes need
        its prefill done soonest, and past saturation that is most of the queue:
        Algorithm 1 as set decides there)."""
        margin = self.catch_up * self.eta
        fixed, prompts, decode_remains = self._step_parts(Q, execs, remains, paced, h)
        if not any(rem < margin for rem in decode_remains):
            return math.inf
        need = fixed
        cum = 0.0
        for rem, ex in sorted(prompts):
            cum += ex
            if rem <= cum + fixed:
                return math.inf
            need = max(need, fixed * rem / (rem - cum))
        # + 1 ns: the batch adds up the same costs in its own order, and rounding must not
        # leave the last decode out of a step sized to hold exactly every decode
        return need + 1e-9

    def _aged(self, Q, now: float) -> list[int]:
        """Indices of the AGED requests of ``Q`` (waited ``age_limit·TTFT_SLO`` without a
        first token and still prefilling), oldest first."""
        k = self.age_limit
        if math.isinf(k):
            return []
        aged = [i for i, r in enumerate(Q)
                if not r.token_times and r.prefilled < r.prefill_len and now - r.arrival >= k * r.ttft_slo]
        return sorted(aged, key=lambda i: Q[i].arrival)

    def schedule(self, view: InstanceView) -> BatchPlan:
        Q = list(view.waiting)
        if view.mode == COLOCATED:
            Q += view.decoding
        b = BatchBuilder(view, self.est)
        if not Q:
            return b.finish(t_budget=0.0)
        execs, remains, dens = self._annotate(Q, view.now)
        h = self.headroom
        paced = self._paced(Q, remains, view.now)
        bounds = paced
        if self.skip_late_prompts:
            skipped = self._late_prompts_skipped(Q, execs, paced)
            # only late prompts queued: the cap bounds the budget, or without one line 6 as written
            bounds = skipped if min(skipped) < math.inf or self.budget_cap < math.inf else paced
        t_budget = self._bounded(bounds, h)                 # lines 6-7 (h = 0, eq3, no cap: as written)
        if self.stretch:                                   # validated: only with pace="first_token"
            t_budget = self._stretched(Q, execs, remains, t_budget, h)
        if self.catch_up is not None:
            t_budget = min(t_budget, self._catch_up_budget(Q, execs, remains, paced, h))
        if self.ordering == "slide":
            urgent = self._mark_urgent(execs, remains, t_budget, view.mode)
        else:                                                  # the ablations of §5.4
            urgent = [self.ordering == "density"] * len(Q)
        order = self._order(paced, dens, urgent, Q)
        n_urgent = sum(urgent)
        n_normal = len(Q) - n_urgent
        b.plan.terms = StepTerms(Q, execs, remains, dens, urgent)
        if self.latency_aware:
            aged = self._aged(Q, view.now)
            # aging holds while the aged requests are at most ρ of the queued work: past
            # saturation they are not, and Algorithm 1 alone decides (admission control is
            # the remedy there; serving hopeless requests first would only lose gain)
            if aged and sum(execs[i] for i in aged) <= self.age_share * sum(execs):
                order = self._fill_aged_first(b, Q, execs, order, aged, t_budget)
            else:
                self._fill_time(b, Q, execs, order, t_budget)
            for i in order if b.plan.empty else ():
                if self._least_step(b, Q[i]):     # the first request in order that memory admits
                    break
            return b.finish(t_budget=t_budget, n_urgent=n_urgent, n_normal=n_normal)
        tokens = self.token_budget or self.tbt_token_budget()
        b.fill_tokens([Q[i] for i in order], tokens)
        return b.finish(t_budget=float("nan"), token_budget=tokens, n_urgent=n_urgent, n_normal=n_normal)

    def _fill_aged_first(self, b: BatchBuilder, Q, execs, order, aged, t_budget: float) -> list[int]:
        """Aged requests first, oldest first, within ρ of the budget beyond t_c; then
        Algorithm 1's order over the others, with aged requests that got nothing at its end;
        then whatever budget is left grows the aged chunks in place."""
        t_c = self.est.t_c
        self._fill_time(b, Q, execs, aged, t_c + self.age_share * max(t_budget - t_c, 0.0))
        served = {id(r) for r, _ in b.plan.prefill}
        first = set(aged)
        rest = [i for i in order if i not in first] + [i for i in aged if id(Q[i]) not in served]
        self._fill_time(b, Q, execs, rest, t_budget)
        for i in aged:
            if id(Q[i]) in served and t_budget - b.time > 0:
                b.grow_prefill(Q[i], t_budget - b.time)
        return aged + [i for i in rest if i not in first]

    # -- Alg. 1 lines 14-18 ----------------------------------------------------------
    def _fill_time(self, b: BatchBuilder, Q, execs: list[float], order: list[int], t_budget: float) -> None:
        est = self.est
        c = est.costs()
        # nothing costs less than one prefill token or one decode step: stop when even that won't fit
        cheapest = min(c.prefill(1, 0), c.decode(0))
        for i in order:
            r = Q[i]
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
            elif execs[i] <= left:
                b.add_decode(r)

    @staticmethod
    def _least_step(b: BatchBuilder, r) -> bool:
        """Budget smaller than any single item (η < t_c + one token): still make progress
        with ``r``, one block's worth of prompt or one decode; False if memory refuses it."""
        if r.prefilled < r.prefill_len:
            return b.add_prefill(r, max(1, min(b.view.block_size, r.prefill_len - r.prefilled))) > 0
        return b.add_decode(r)
