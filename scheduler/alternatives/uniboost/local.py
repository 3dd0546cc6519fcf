"""UniBoost (Li et al., "Beyond Prediction: Tail-Aware Scheduling for LLM
Inference"; Algorithm 1 with §3.2-3.4 and Appendix A).

Prediction-free and tail-aware: every active request (waiting, partially
prefilled or decoding) gets a γ-boosted arrival time, and the batch is filled in
increasing order of it across both phases (one unified order, line 14)::

    s_r  = SIGNAL(r)          prompt tokens before the first token,
                              attained decode tokens after it       (lines 6, 7-13 of SIGNAL)
    ŝ_r  = QUANTIZE(s_r, k) = k·2^⌊log2(max{1, s_r/k})⌋               (line 7, MemGuard bins)
    x_r  = service time of ŝ_r tokens on this instance, seconds        (units: see below)
    b_r  = b_γ(x_r) = (1/γ)·log(1/(1 - e^{-γ·x_r}))                    (line 8, Eq. 2)
    π(r) = a_r - b_r,   smaller first                                   (line 9)

Each step (lines 12-26) requests are taken in that order, a decode costing one
token and a prefill chunk ``min(remaining prompt, tokens left)``, until the
micro-batch holds ``max_num_seqs`` (M) requests or the per-step token budget
(the chunk size c) is spent; a request whose KV growth does not fit the free
blocks (KVNEED, lines 18-19) waits this step.

MemGuard (§3.3), quantised priorities plus minimum-run hysteresis:

* the priority of a request changes only when its signal crosses a bin edge
  (2k, 4k, 8k, … tokens), so a request of S decode tokens has at most
  ``1 + ⌊log2(S/k)⌋`` priority-revision points (line 23; 6 for S = 10k,
  k = 256, the §3.3 example);
* once dispatched (placed in a batch), a request is **non-evictable until its
  signal reaches the next threshold** ``2·ŝ``: it keeps its seat ahead of every
  unpinned request. A prefill's signal (its prompt length) is constant, so a
  started prefill is pinned until it completes — entering decode is its next
  revision point;
* Eq. 7 hysteresis: an unpinned request that ran in the previous batch is
  displaced only by a request ``j`` with ``π(j) < π(curr) - δ`` (implemented
  as the sort key ``π - δ`` for requests that ran last step).

γ-Ada (§3.4): γ is re-estimated from the P95-P99 band of recent end-to-end
latencies (TTLT) of requests this policy served, fed through
``on_request_finished`` (simulator and engine), see
:class:`proserve.scheduler.alternatives.uniboost.bins.TailGamma`.

Where the paper is inconsistent or silent, and what this module does:

* **Bin rounding**: Algorithm 1's floor, not Eq. 8's ceiling (floor matches the
  paper's "at most 6 for 10k tokens" example and Lemma A.1's ``b_γ(a/2)``;
  details in :mod:`proserve.scheduler.alternatives.uniboost.bins`).
* **γ estimator constant**: Eq. 9's ``ln 5 / (t99 - t95)``, not line 17's
  ``ln(99/95)/Δ`` (39× smaller; it uses CDF instead of survival values). Eq. 9
  recovers an exponential tail's rate exactly. ``tail_constant="alg1"`` gives
  the literal line 17.
* **Token-vs-time units**: Eq. 2 needs ``γ·x`` dimensionless, but γ is
  estimated from latencies in seconds (1/s) while SIGNAL/QUANTIZE count tokens.
  We convert the quantised token count to the seconds this instance needs to
  serve it alone — the "job size" of the M/G/1 γ-Boost theory the paper builds
  on — with the (β-corrected) latency model of ``proserve.scheduler.estimator``:
  ``x = T~_p(ŝ) + t_c`` for a prompt of ŝ tokens (Eq. 5 + t_c, one batch) and
  ``x = ŝ·(T~_d(l_prompt) + t_c)`` for ŝ decode tokens (ŝ decode steps, Eq. 6).
  A prompt token costs an order of magnitude (CPU) to two (GPU) less than a
  decode step, so a single tokens-to-seconds factor could not put both phases
  on one clock.
  ``token_seconds=τ`` instead uses ``x = ŝ·τ`` for both phases (the paper's
  literal "tokens as time" reading when latencies are read in units of τ, e.g.
  τ = 1e-3 for milliseconds).
* **Signal in decode**: Algorithm 1's SIGNAL (attained decode tokens), not §3.2's
  unified ``w̃ = max(w, s_pre)`` (prompt + decoded tokens); §3.3 also defines
  MemGuard's ``w_i`` as decoded tokens. The "attained decode tokens" of a
  request are the tokens it has emitted; a recompute-preempted request keeps
  its decode signal (and its pin) while it re-prefills.
* **a_r**: line 9 allows "arrival time (or phase-entry time)": ``a_ref``
  picks; default arrival (the γ-Boost definition, §3 ``φ_i(t) = a_i - b_γ``).
* **UPDATEGAMMA frequency**: once per completed request rather than once per
  iteration (its input changes only then; see ``TailGamma``).
* **SELECTVICTIM / SWAPOUT (lines 21-24)**: a policy here plans batches and
  cannot evict KV; eviction stays with the body (the simulator's and vLLM's
  recompute preemption). Leaving a request out of the batch (its KV stays
  resident) is the preemption this policy controls, under MemGuard's pins and δ.
* **Chunk size c**: read as the per-step token budget (vLLM's
  ``max_num_batched_tokens``, SGLang's ``chunked_prefill_size``), since the
  algorithm has no other per-step token cap.

Parameters and defaults (``--local-param KEY=VALUE``):

* ``k = 256`` tokens: bin size, the paper's default (§A.4, Table 6).
* ``delta = 0.1`` s: hysteresis δ of Eq. 7, the paper's default (Table 7),
  in the unit of π (seconds of boosted arrival time).
* ``gamma = 1.0`` 1/s: initial γ (Alg. 1 "initial γ"; the paper reports
  insensitivity to it, §A.4). ``1/γ`` is the service time beyond which a
  request gets almost no boost; 1 s is the default TTFT SLO, the time scale at
  which waiting becomes visible to a user.
* ``gamma_min = 0.01``, ``gamma_max = 100`` 1/s: the clip bounds of line 19;
  the two ends of the paper's Figure 3 interpolation (γ = 0.01 behaves like
  LAS, γ = 100 like FCFS).
* ``smoothing = 0.1``: β of line 18 (EMA weight of a new estimate, per
  completed request): a shift in the tail is followed within ~20 completions
  (0.9²⁰ ≈ 0.12) while one request moves γ by at most 10 % of the gap.
* ``epsilon = 0.001`` s: ε of line 16; 1 ms is below any meaningful latency
  difference, so it only guards against t99 = t95.
* ``window = 1000`` samples: 𝓛 of UPDATEGAMMA; P99 of 1000 samples rests on
  the 10 slowest, P95 on 50.
* ``min_samples = 100``: no estimate before 100 samples (the P99 of fewer is the
  maximum); γ stays at its initial value until then.
* ``adaptive = true``: γ-Ada on; ``false`` keeps γ fixed (the paper's Phase-3
  ablation, §4.3).
* ``tail_constant = "eq9"`` (see above) or ``"alg1"``.
* ``memguard = true``: bins and pins on; ``false`` boosts the raw signal and
  pins nothing (the paper's Phase-2 "UniBoost-base", §3.2/§4.3; δ still applies).
* ``max_num_seqs = 256``: M, the micro-batch cap; the paper gives no value,
  256 is vLLM's default ``max_num_seqs``.
* ``token_budget = None``: c, tokens per step; by default Sarathi's
  TBT-profiled budget (:meth:`LocalPolicy.tbt_token_budget`), following the
  paper's rule "the chunk size is typically set based on the desired TBT/TPOT
  SLO" (§A.5; it used 1024 for CodeLlama-34B on an A100).
* ``token_seconds = None``: latency-model units (above); a number τ > 0 uses
  ``x = ŝ·τ``.
* ``a_ref = "arrival"`` or ``"phase_entry"`` (first-token time for decodes).

The plan's ``ScheduleInfo`` carries ``token_budget`` (c), ``n_urgent`` = queued
requests pinned by MemGuard and ``n_normal`` = the others; :meth:`UniBoost.pinned`
says whether a request is.

UniBoost has no routing component: the paper schedules within an instance and
composes with an exogenous dispatcher (random, round-robin, JSQ; §A.5,
Table 9), so it pairs with the existing global policies.
"""

from __future__ import annotations

import math
from operator import itemgetter

from ... import validate
from ...local.base import COLOCATED, BatchBuilder, BatchPlan, InstanceView, LocalPolicy
from ...registry import register_local
from ...request import Request
from .bins import TailGamma, boost, next_threshold, quantize

A_REFS = ("arrival", "phase_entry")
_first = itemgetter(0)


@register_local
class UniBoost(LocalPolicy):
    name = "uniboost"
    summary = "UniBoost (tail-aware, Li et al. Alg. 1): γ-boosted arrival order, MemGuard bins/pins, adaptive γ"

    def __init__(self, estimator, gain=None, classes=None, k: int = 256, delta: float = 0.1,
                 gamma: float = 1.0, gamma_min: float = 0.01, gamma_max: float = 100.0,
                 smoothing: float = 0.1, epsilon: float = 1e-3, window: int = 1000, min_samples: int = 100,
                 adaptive: bool = True, tail_constant: str = "eq9", memguard: bool = True,
                 max_num_seqs: int = 256, token_budget: int | None = None,
                 token_seconds: float | None = None, a_ref: str = "arrival"):
        super().__init__(estimator, gain, classes)
        n = self.name
        self.k = validate.integer(n, "k", k)
        self.max_num_seqs = validate.integer(n, "max_num_seqs", max_num_seqs)
        if token_budget is not None:
            token_budget = validate.integer(n, "token_budget", token_budget)
        self.token_budget = token_budget
        self.delta = validate.non_negative(n, "delta", delta)
        self.adaptive = validate.boolean(n, "adaptive", adaptive)
        self.memguard = validate.boolean(n, "memguard", memguard)
        if token_seconds is not None:
            token_seconds = validate.positive(n, "token_seconds", token_seconds)
        self.token_seconds = token_seconds
        self.a_ref = validate.one_of(n, "a_ref", a_ref, A_REFS)
        # UPDATEGAMMA's state (§3.4); validates gamma, bounds, smoothing, epsilon, window, constant
        self.tail = TailGamma(gamma, gamma_min, gamma_max, smoothing, epsilon, window, min_samples,
                              tail_constant, where=n)
        #: MemGuard pins: request id -> (in decode phase, signal value that releases the pin)
        self._pins: dict[str, tuple[bool, int]] = {}
        #: ids in the previous batch ("currently executing", Eq. 7)
        self._running: set[str] = set()

    @property
    def gamma(self) -> float:
        """The current γ (1/s)."""
        return self.tail.gamma

    # -- lines 6-9: SIGNAL, QUANTIZE, BOOST, π -------------------------------------------
    def signal(self, r: Request) -> tuple[bool, int]:
        """SIGNAL (Alg. 1): (decode phase?, prompt tokens before the first token,
        else attained decode tokens)."""
        n = len(r.token_times)
        return (True, n) if n else (False, r.prompt_len)

    def service_time(self, r: Request, s_hat: int, dec: bool) -> float:
        """x: seconds to serve ``s_hat`` tokens of ``r``'s current phase alone (units, see module doc)."""
        return _service_time(self.est.costs(), self.token_seconds, r, s_hat, dec)

    def priority(self, r: Request) -> float:
        """π(r) = a_r - b_γ(x(QUANTIZE(SIGNAL(r)))) under the current γ (lines 6-9), no hysteresis."""
        dec, s = self.signal(r)
        s_hat = quantize(s, self.k) if self.memguard else max(s, 1)
        a = r.token_times[0] if dec and self.a_ref == "phase_entry" else r.arrival
        return a - boost(self.service_time(r, s_hat, dec), self.tail.gamma)

    def pinned(self, r: Request) -> bool:
        """MemGuard: dispatched and its signal has not yet reached the next threshold."""
        pin = self._pins.get(r.id)
        if pin is None:
            return False
        dec, s = self.signal(r)
        return pin[0] == dec and s < pin[1]

    # -- one step -------------------------------------------------------------------------------
    def schedule(self, view: InstanceView) -> BatchPlan:
        Q = list(view.waiting)
        if view.mode == COLOCATED:
            Q += view.decoding                      # line 14: unified order across phases
        budget = self.token_budget or self.tbt_token_budget()
        b = BatchBuilder(view, self.est)
        if not Q:
            self._pins.clear()
            self._running = set()
            return b.finish(token_budget=budget)

        # constants of this step, hoisted out of the per-request loop
        g = self.tail.gamma                          # line 4 (updated on completions)
        k, memguard, delta = self.k, self.memguard, self.delta
        phase_entry = self.a_ref == "phase_entry"
        tau = self.token_seconds
        costs = self.est.costs()
        prefill, decode, t_c = costs.prefill, costs.decode, costs.t_c
        log, expm1 = math.log, math.expm1
        old_pins, running = self._pins, self._running
        pins: dict[str, tuple[bool, int]] = {}
        pinned: list[tuple[float, Request, bool, int]] = []
        free: list[tuple[float, Request, bool, int]] = []

        for r in Q:                                  # lines 5-11
            tt = r.token_times
            dec = bool(tt)
            s = len(tt) if dec else r.prompt_len     # SIGNAL
            if memguard:                             # QUANTIZE (integer form of k·2^⌊log2 max(1,s/k)⌋)
                q = s // k
                s_hat = k if q <= 1 else k << (q.bit_length() - 1)
            else:
                s_hat = s if s > 0 else 1
            # x: _service_time written out (the hot loop)
            if tau is not None:
                x = s_hat * tau
            elif dec:
                x = s_hat * (decode(r.prompt_len) + t_c)
            else:
                x = prefill(s_hat, 0) + t_c
            if x <= 0:
                x = 1e-12
            a = tt[0] if dec and phase_entry else r.arrival
            phi = a + log(-expm1(-g * x)) / g        # line 9: π = a_r - b_γ(x)   (Eq. 2)
            pin = old_pins.get(r.id)
            if pin is not None and pin[0] == dec and s < pin[1]:
                pins[r.id] = pin                     # MemGuard: non-evictable until the next threshold
                pinned.append((phi, r, dec, s))
            else:
                # Eq. 7: the running request yields only to π(j) < π(curr) - δ
                free.append((phi - delta if r.id in running else phi, r, dec, s))
        pinned.sort(key=_first)
        free.sort(key=_first)

        # lines 12-26: fill the micro-batch
        chosen: set[str] = set()
        M = self.max_num_seqs
        for _, r, dec, s in pinned + free:
            if len(chosen) >= M:                     # line 13
                break
            left = budget - b.tokens
            if left <= 0:
                break
            if r.prefilled < r.prefill_len:
                if b.add_prefill(r, left) == 0:      # KVNEED does not fit (line 19): wait
                    continue
            elif not b.add_decode(r):
                continue
            chosen.add(r.id)                         # line 20
            if memguard and r.id not in pins:
                pins[r.id] = (dec, next_threshold(s, k))
        self._pins = pins
        self._running = chosen
        b.plan.marked = {r.id for _, r, _, _ in pinned}
        return b.finish(token_budget=budget, n_urgent=len(pinned), n_normal=len(free))

    # -- line 28: UPDATESTATS ----------------------------------------------------------------------
    def on_request_finished(self, req: Request, now: float) -> None:
        self._pins.pop(req.id, None)
        self._running.discard(req.id)
        if not self.adaptive or req.error is not None or not req.token_times:
            return
        self.tail.observe(req.token_times[-1] - req.arrival)   # TTLT sample for γ-Ada


def _service_time(c, tau: float | None, r: Request, s_hat: int, dec: bool) -> float:
    """x of :meth:`UniBoost.service_time` with the step's costs ``c`` (hoisted out of the loop)."""
    if tau is not None:
        return s_hat * tau
    if dec:
        x = s_hat * (c.decode(r.prompt_len) + c.t_c)                # ŝ steps of Eq. 6 + t_c
    else:
        x = c.prefill(s_hat, 0) + c.t_c                             # Eq. 5 + t_c
    return x if x > 0 else 1e-12

