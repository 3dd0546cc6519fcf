"""SLOs-Serve (Chen et al.): soft admission control + SLO-driven batch sizing.

Each step (Algorithm 1, one batch per call):

1. **Admission** (Alg. 1 line 4, §3.2.1, App. C). Requests waiting for
   their first prefill that have no decision yet are the new requests. Running
   requests (admitted earlier, or holding KV/tokens when the policy first sees
   them) are forced admissions. The throughput-form DP
   (:func:`proserve.scheduler.alternatives.slos_serve.model.admit_dp`) picks the largest subset of
   the new requests whose prefill deadlines ``pDDL = arrival + TTFT_SLO``,
   decode rates and KV memory fit, with the forced ones, under the token
   budget and the free memory. The others are *declined* into the best-effort
   tier (§4.1): never dropped, served with whatever the admitted requests
   leave. Decisions are final on this replica.

   Memory (the DP's ``m``): the paper counts each request's KV at its final
   length, knowing decode lengths; engines here do not, so a request is
   counted at ``prompt + ô`` tokens, ``ô`` the mean output length of the
   requests that finished on this instance (learned in
   ``on_request_finished``, starting from ``output_len_prior``). The memory
   left for new requests is the free KV blocks, less the view's reserve, less
   the growth still expected of the admitted requests (to ``prompt + ô``).
2. **Batch formation** (Algorithm 2, §3.2.2). ``t0`` = the tightest TPOT SLO
   among the admitted decoding requests (line 1); the batch gets
   ``prefillBgt = Time2BS(t0)`` roofline tokens (line 7). Admitted decodes that
   are due go first, earliest deadline first (lines 8-13), each taking its
   decode tokens out of ``prefillBgt``; then admitted prefills by pDDL (§3.2.1
   "we allocate the prefill budget in every batch by prioritizing requests with
   earlier prefill deadlines"); what is left goes to admitted decodes that are
   not yet due, then to the best-effort tier (its decodes, then its prefills,
   oldest first). A batch with no prefill in it takes every decode that fits in
   memory (there is nothing for the tokens to be saved for).

Decode deadlines follow the line of §3.2: token ``k`` of request ``r`` is due
at ``pDDL_r + (k-1)·TPOT_r`` (the project's TDG deadline, Eq. 3). Alg. 2 keeps
a schedule deadline ``schDDL`` per decode and takes the requests whose schDDL
has come; here a decode is *due* when deferring it by one batch could miss its
token deadline: ``deadline < now + 2·t0``. (Alg. 2 line 8 prints ``schDDL ≥
i·t0``; read literally a decode with a loose TPOT would be taken in every batch,
contradicting the EDF purpose stated in §3.2.2, so it is read as "has come".)

Two guards beside the roofline: each prefill chunk is also cut with this
project's Eq. 5-7 estimator (GETMAXCHUNK) so that the batch's β-corrected
time stays within ``t0`` (the roofline ignores context length); and admitted
decodes that are due are always taken, even past ``t0``.

Best-effort memory. §4.1 preempts best-effort requests when new requests
arrive; a policy here cannot preempt (the body does, only when memory runs
out), and best-effort requests that started would hold their KV while later
arrivals are declined for lack of it. So a best-effort prefill may start only
with the memory the admitted requests are not expected to need, and none
starts while new requests are being declined for memory (within the last
planning horizon, the largest class TTFT SLO). Partially prefilled and
decoding best-effort requests continue with leftovers.

Parameters (all settable with ``--local-param``):

* ``batch_time`` (default: the tightest TPOT SLO of the configured classes,
  0.1 s by default): ``t0`` when no admitted request is decoding (Alg. 2 line
  1 is undefined then; always on a prefill-only instance). It keeps batches at
  the granularity the co-located case has, so a new arrival waits at most
  about one TPOT for the next planning point.
* ``decode_cost = "model"``: a decode costs ``T~_d(l_kv)/k1`` roofline tokens
  (:func:`proserve.scheduler.alternatives.slos_serve.model.decode_tokens`), because this project's
  Eq. 6 prices a decode by its context; ``"unit"`` is the paper's one token per
  decode (exact when decode and prefill tokens cost alike, as in Fig. 3).
* ``max_new = 32``: at most this many new requests enter one DP call (earliest
  pDDL first; those beyond wait undecided, served best-effort, until the next
  step). §3.2.1 reports "zero to ten new requests" per invocation; 32 keeps a
  burst's DP (33 × 33 count × memory states) within a few milliseconds in
  CPython. New requests that could not
  be admitted even alone are declined before the DP (exact: see
  :func:`proserve.scheduler.alternatives.slos_serve.model.feasible_alone`).
* ``roofline_pieces = 2``: lines in the roofline (L = 2 "in practice", §3.1.1).
* ``fit_max_time`` (default: 4 × the loosest class TPOT SLO, 0.4 s by default):
  the roofline is fitted on prefill chunks taking up to this long. Alg. 2 asks
  for batches of ``t0`` ≤ the loosest TPOT; the margin covers β > 1. Two
  lines fit Eq. 5's quadratic term within 2 % over 0.4 s on the bundled 7B
  model but only within 10 % over 1 s, so the range is kept to what is used.
  The roofline is refitted when the estimator's model object changes; the
  online factor β is applied on top (``Time2BS(t0/β)``).
* ``mem_units = 32``: the memory dimension's resolution: the KV blocks left
  for new requests are counted in 32 units (each request's need rounded up);
  0 drops the dimension. Enough to tell apart requests whose footprints
  differ by a few percent of the free memory, at a DP cost of 33× the states.
* ``mem_growth = "peak"``: a request's memory is counted at ``prompt + ô``,
  as the paper counts it at its final length. ``"horizon"`` counts only the
  decode growth within the planning horizon (the largest class TTFT SLO, i.e.
  ``TTFT/TPOT`` tokens), like the DP's compute plan, re-planning memory as
  requests finish; it admits more when memory binds (on the bundled model,
  one instance, 600 Azure requests at 3.5 req/s: attainment 0.94 instead of
  0.88; equal at 4-6 req/s) at the risk of a few more recompute preemptions.
* ``output_len_prior = 266`` tokens: ô before requests finish, the mean output
  length of the paper's ChatBot workload (Table 4); it counts as 8 finished
  requests, because the first requests to finish are the short ones.

Invocation: the paper re-plans on a timeout or once enough requests arrive or
finish (Alg. 1 line 17); here the batch is re-planned every step and the DP
runs in every step that has new requests (thresholds 0), which the per-step
cost allows.

Not implemented: speculative decoding (see :mod:`proserve.scheduler.alternatives.slos_serve.model`);
preempting best-effort requests on new arrivals (§4.1), see above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ... import validate
from ...local.base import COLOCATED, BatchBuilder, BatchPlan, InstanceView, LocalPolicy
from ...registry import register_local
from .model import (
    Job,
    MeanOutputLen,
    Roofline,
    admit_dp,
    check_policy_params,
    default_fit_max_time,
    feasible_alone,
    line_deadline,
)

_ONE = 1.0 - 1e-9   # one roofline token, less float noise
MEM_GROWTH = ("peak", "horizon")


@dataclass
class SLOsDecision:
    """What the latest schedule() decided, for logs and tests."""

    now: float
    t0: float = 0.0             # batch latency target (Alg. 2 line 1)
    tokens: int = 0             # Time2BS(t0): token budget of a batch (line 7)
    sigma: float = 0.0          # token budget rate σ used by the DP (tokens/s)
    admitted: list[str] = field(default_factory=list)   # new requests admitted in this call
    declined: list[str] = field(default_factory=list)   # new requests declined in this call
    pending: list[str] = field(default_factory=list)    # new requests beyond max_new, still undecided


@register_local
class SLOsServe(LocalPolicy):
    name = "slos_serve"
    summary = "SLOs-Serve: DP soft admission over prefill deadlines, SLO-sized batches, best-effort tier"

    def __init__(self, estimator, gain=None, classes=None, batch_time: float | None = None,
                 decode_cost: str = "model", max_new: int = 32, roofline_pieces: int = 2,
                 fit_max_time: float | None = None, mem_units: int = 32, output_len_prior: float = 266.0,
                 mem_growth: str = "peak"):
        super().__init__(estimator, gain, classes)
        if batch_time is None:
            batch_time = self.min_tpot_slo()
        n = self.name
        batch_time = validate.positive(n, "batch_time", batch_time)
        output_len_prior = check_policy_params(n, decode_cost, roofline_pieces, output_len_prior)
        max_new = validate.integer(n, "max_new", max_new)
        if fit_max_time is None:
            fit_max_time = default_fit_max_time(self.classes, batch_time)
        fit_max_time = validate.number(n, "fit_max_time", fit_max_time, estimator.model.t_c, lo_open=True)
        self.mem_units = validate.integer(n, "mem_units", mem_units, 0)   # 0: no memory dimension
        self.mem_growth = validate.one_of(n, "mem_growth", mem_growth, MEM_GROWTH)
        self.batch_time = batch_time
        self._horizon = max(c.ttft_slo for c in self.classes.values())
        self._o_hat = MeanOutputLen(output_len_prior)
        self._mem_pressure_at = -math.inf   # last time a new request was declined for memory
        self.decode_cost = decode_cost
        self.max_new = max_new
        self.roofline_pieces = roofline_pieces
        self.fit_max_time = fit_max_time
        self.admitted: set[str] = set()   # guaranteed tier
        self.declined: set[str] = set()   # best-effort tier (§4.1)
        self._roof: Roofline | None = None
        self._roof_model = None
        self.last: SLOsDecision | None = None
        _ = self.roofline   # fit now: a bad model fails at start-up, and schedule() stays fast

    # -- the performance model ---------------------------------------------------------
    @property
    def roofline(self) -> Roofline:
        m = self.est.model
        if self._roof is None or self._roof_model is not m:
            self._roof = Roofline.from_latency_model(m, self.fit_max_time, pieces=self.roofline_pieces)
            self._roof_model = m
        return self._roof

    def time2bs(self, t: float) -> int:
        """Time2BS with the online correction: largest #Tokens with β·T^ + δ ≤ t."""
        return self.roofline.time2bs(self.est.model_time(t))

    # -- Algorithm 1 -----------------------------------------------------------------------
    def schedule(self, view: InstanceView) -> BatchPlan:
        now = view.now
        colocated = view.mode == COLOCATED
        admitted, declined = self.admitted, self.declined

        # partition (forced admission of running requests, §3.2.1 "Continuous Optimization")
        dec_adm, dec_be = [], []
        if colocated:
            for r in view.decoding:
                if r.id in declined:
                    dec_be.append(r)
                else:
                    admitted.add(r.id)
                    dec_adm.append(r)
        pre_adm, pre_be, new = [], [], []
        for r in view.waiting:
            rid = r.id
            if rid in admitted:
                pre_adm.append(r)
            elif rid in declined:
                pre_be.append(r)
            elif r.holds_kv or r.token_times:
                admitted.add(rid)
                pre_adm.append(r)
            else:
                new.append(r)

        # t0 (Alg. 2 line 1) and Time2BS(t0) (line 7)
        t0 = min((r.tpot_slo for r in dec_adm), default=self.batch_time) if colocated else self.batch_time
        tokens = self.time2bs(t0)
        dcost = self._decode_cost(tokens)
        info = SLOsDecision(now, t0, tokens)
        self.last = info
        # memory the admitted requests are expected to still need: up to prompt + ô tokens each
        bs, o_hat = view.block_size, self.mean_output_len
        committed = int(sum(max(0, self._blocks_to_come(r, r.kv_len, bs, o_hat)) for r in dec_adm)
                        + sum(max(0, self._blocks_to_come(r, r.prefill_len, bs, o_hat)) for r in pre_adm))

        if new:
            self._admit(view, new, pre_adm, dec_adm, committed, t0, tokens, dcost, info)
            for r in new:
                if r.id in admitted:
                    pre_adm.append(r)
                else:
                    pre_be.append(r)

        # -- Algorithm 2, one batch ------------------------------------------------------
        b = BatchBuilder(view, self.est)
        budget = float(tokens)                                  # b.prefillBgt
        horizon = now + 2.0 * t0
        due, early = [], []
        for r in dec_adm:
            d = line_deadline(r)
            (due if d < horizon else early).append((d, r))
        due.sort(key=_first)
        n_adm = 0
        for _, r in due:                                        # lines 8-13: EDF over due decodes
            if b.add_decode(r):
                budget -= dcost(r.kv_len)
                n_adm += 1
        pre_adm.sort(key=_pddl)
        one = self.est.prefill(1, 0)                            # the cheapest chunk there is
        for r in pre_adm:                                       # prefill budget by pDDL
            if budget < _ONE or t0 - b.time < one:              # no chunk fits any more
                break
            n = self._chunk(b, r, budget, t0)
            if n:
                budget -= n
                n_adm += 1
        # leftovers: admitted decodes ahead of their line, then the best-effort tier (§4.1)
        early.sort(key=_first)
        n_be = 0
        for _, r in early:
            if budget < _ONE or b.time >= t0:
                break
            if b.add_decode(r):
                budget -= dcost(r.kv_len)
        dec_be.sort(key=_arrival)
        for r in dec_be:
            if budget < _ONE or b.time >= t0:
                break
            if b.add_decode(r):
                budget -= dcost(r.kv_len)
                n_be += 1
        # best-effort prefills may not take the memory the admitted requests are expected to
        # need, and start none while new requests are being declined for memory (the paper
        # preempts best-effort requests for new arrivals instead, §4.1)
        keep = max(0, committed - (view.free_blocks - b.free_blocks)) + view.reserve_blocks
        start_be = now - self._mem_pressure_at >= self._horizon
        pre_be.sort(key=_be_order)
        for r in pre_be:
            if budget < _ONE or t0 - b.time < one:
                break
            if not r.holds_kv and not start_be:
                continue
            n = self._chunk(b, r, budget, t0, keep if not r.holds_kv else 0)
            if n:
                budget -= n
                n_be += 1
        if colocated and not b.plan.prefill:
            # a pure-decode batch: every decode that fits in memory rides along
            chosen = set(map(id, b.plan.decode))
            for _, r in early:
                if id(r) not in chosen:
                    b.add_decode(r)
            for r in dec_be:
                if id(r) not in chosen and b.add_decode(r):
                    n_be += 1
        if b.plan.empty:
            self._progress(b, pre_adm + pre_be)
        return b.finish(t_budget=t0, token_budget=tokens, n_urgent=n_adm, n_normal=n_be)

    def _chunk(self, b: BatchBuilder, r, budget: float, t0: float, keep: int = 0) -> int:
        """Prefill chunk of ``r``: at most ``budget`` roofline tokens, and (guard) what
        GETMAXCHUNK allows in the batch time left before ``t0``; with ``keep``, only
        as many tokens as fit while leaving ``keep`` KV blocks free."""
        n = min(r.remaining_prefill, int(budget + 1e-9))   # +eps: decode costs are float multiples of a token
        room = b.free_blocks - keep
        if n <= 0 or (keep and room <= 0) or not b.admissible(r):
            return 0
        n = min(n, self.est.get_max_chunk(r.kv_len, n, t0 - b.time))
        if keep:
            n = min(n, room * b.view.block_size + (-r.kv_len) % b.view.block_size)
        return b.add_prefill(r, n)   # 0 if n <= 0

    def _progress(self, b: BatchBuilder, waiting) -> None:
        """Nothing fitted (t0 below one token's time): one block of the first prefill."""
        for r in waiting:
            if b.add_prefill(r, max(1, min(b.view.block_size, r.remaining_prefill))):
                return

    # -- admission (Alg. 1 line 4) --------------------------------------------------------------
    def _admit(self, view, new, pre_adm, dec_adm, committed, t0, tokens, e, info: SLOsDecision) -> None:
        """``tokens`` = Time2BS(t0); ``e(l_kv)``: a decode's demand in roofline tokens."""
        now = view.now
        colocated = view.mode == COLOCATED
        # DP horizon: batches sized for the tightest TPOT that will be decoding
        t_dp = t0
        if colocated:
            t_dp = min([t0] + [r.tpot_slo for r in pre_adm] + [r.tpot_slo for r in new])
        sigma = (tokens if t_dp == t0 else self.time2bs(t_dp)) / t_dp   # σ = Time2BS(t0)/t0
        info.sigma = sigma
        base_rate = sum(e(r.kv_len) / r.tpot_slo for r in dec_adm) if colocated else 0.0
        # a re-prefill after a preemption is due by its next token's deadline on the line
        forced = [Job(line_deadline(r), r.remaining_prefill, e(r.prefill_len) / r.tpot_slo if colocated else 0.0)
                  for r in pre_adm]
        # tiers by TPOT SLO (§3.2.1 "Multi-Decode SLOs"); a tier's rate uses its mean prompt length
        new.sort(key=_pddl_id)
        tiers: dict[float, list] = {}
        for r in new:
            tiers.setdefault(r.tpot_slo, []).append(r)
        tier_of = {tp: i for i, tp in enumerate(sorted(tiers))}
        tier_rates = [0.0] * len(tier_of)
        if colocated:
            for tp, rs in tiers.items():
                tier_rates[tier_of[tp]] = e(sum(r.prompt_len for r in rs) / len(rs)) / tp
        # memory (the m dimension of §3.2.1): KV blocks left once the admitted requests have
        # theirs, in mem_units units; a new request takes its prompt plus ô tokens
        mem_cap = None
        if self.mem_units:
            bs, o_hat = view.block_size, self.mean_output_len
            cap_blocks = view.free_blocks - view.reserve_blocks - committed
            unit_blocks = max(1, -(-max(cap_blocks, 1) // self.mem_units))
            mem_cap = int(max(cap_blocks, 0) // unit_blocks)
            m_units = [int(-(-self._blocks_to_come(r, r.prefill_len, bs, o_hat) // unit_blocks)) for r in new]
        else:
            m_units = [0] * len(new)
        jobs = [Job(r.arrival + r.ttft_slo, r.remaining_prefill, 0.0, tier_of[r.tpot_slo], mu)
                for r, mu in zip(new, m_units)]
        ok = feasible_alone(now, sigma, base_rate, forced, jobs, tier_rates, mem_cap)
        dp_idx = [i for i, f in enumerate(ok) if f]
        for i, f in enumerate(ok):
            if not f:
                self.declined.add(new[i].id)
                info.declined.append(new[i].id)
                if mem_cap is not None and jobs[i].m > mem_cap:
                    self._mem_pressure_at = now
        later = dp_idx[self.max_new:]
        dp_idx = dp_idx[:self.max_new]
        info.pending = [new[i].id for i in later]
        if dp_idx:
            res = admit_dp(now, sigma, base_rate, forced, [jobs[i] for i in dp_idx], tier_rates, mem_cap)
            mem_left = None if mem_cap is None else mem_cap - res.mem
            for i, a in zip(dp_idx, res.admitted):
                rid = new[i].id
                if a:
                    self.admitted.add(rid)
                    info.admitted.append(rid)
                else:
                    self.declined.add(rid)
                    info.declined.append(rid)
                    if mem_left is not None and jobs[i].m > mem_left:
                        self._mem_pressure_at = now

    def on_request_finished(self, req, now: float) -> None:
        self.admitted.discard(req.id)
        self.declined.discard(req.id)
        self._o_hat.observe(req)   # its true output length (learned, never read early)

    def _blocks_to_come(self, r, length: int, bs: int, o_hat: float) -> float:
        """KV blocks ``r`` is expected to take beyond those it holds: enough for ``length``
        tokens plus the output it is still expected to add, up to ô in all
        (``mem_growth="horizon"``: only what falls within the planning horizon)."""
        left = max(o_hat - r.num_emitted, 1.0)
        if self.mem_growth == "horizon":
            left = min(left, max(self._horizon / r.tpot_slo, 1.0))
        return -(-(length + left) // bs) - (-(-r.kv_len // bs))

    def _decode_cost(self, tokens: int):
        """A decode's cost in roofline tokens, as a function of its KV length: ``T~_d(l_kv)/k̂``
        with k̂ the marginal of the roofline line active at ``tokens`` (1 with
        ``decode_cost="unit"``)."""
        k_hat = self.roofline.marginal(tokens)
        if self.decode_cost == "unit" or k_hat <= 0:
            return _unit_cost
        decode, inv_k = self.est.model.unit.decode, 1.0 / k_hat      # Eq. 6 without β: the roofline
        return lambda l_kv: decode(l_kv) * inv_k                      # is fitted to the model, β applied in time2bs

    @property
    def mean_output_len(self) -> float:
        """ô: mean output length of the finished requests (the prior counted as PRIOR_WEIGHT of them)."""
        return self._o_hat.value

    def tier(self, req) -> str | None:
        """"admitted", "best_effort", or None (not decided yet)."""
        if req.id in self.admitted:
            return "admitted"
        if req.id in self.declined:
            return "best_effort"
        return None


def _first(x):
    return x[0]


def _unit_cost(l_kv) -> float:
    return 1.0


def _pddl(r):
    return r.arrival + r.ttft_slo


def _pddl_id(r):
    return (r.arrival + r.ttft_slo, r.arrival)


def _arrival(r):
    return r.arrival


def _be_order(r):
    # partial prefills first (they hold KV blocks), then oldest first
    return (not r.holds_kv, r.arrival)
