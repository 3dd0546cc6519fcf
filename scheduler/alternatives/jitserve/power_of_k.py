"""JITServe's power-of-K multi-replica extension of GMAX as a global policy.

Source: JITServe (Zhang, Wu et al., NSDI 2026) §4.3 "Supporting Multiple Models"
(Wu's 2025 MS thesis "SLO-aware Optimization and Stateful Orchestration for LLM
Systems" §4.3, the same text for Concord/CALM): "For each request r, we create K dummy copies
[r_1, …, r_K], by randomly sampling K models from the M available models. Each
dummy r carries a replica-specific priority priority(r), and scheduling
proceeds as usual over the enlarged set. Once a request is assigned to a
replica, its other dummies are removed from the queue." K may equal M.

In this system a request is bound to one instance when it is dispatched (the
dispatcher's PrefillQueueMap, §4.3 of PROSERVE; an engine cannot hold dummies),
so the race of the dummies is decided at dispatch, by estimating, for each of
the K sampled instances ``p``, the priority the dummy would have there and
picking the best:

1. the dummy's priority on ``p`` as GMAX computes it
   (:mod:`proserve.scheduler.alternatives.jitserve.gmax`): ``goodput_p(r)/t_gen_p(r)``, with ``p``'s own
   β-corrected latency model (replica speed) and, co-located, its decode load
   ``n_d`` in the per-token time ``v_p = t_c + (n_d+1)·T~_d(l̄_d)`` (Eq. 6-7);
2. when it would be scheduled there: GMAX runs the higher-priority requests
   first, so the dummy waits for the prefill work of the requests queued on
   ``p`` whose priority (computed the same way) is at least its own,
   lag-compensated as ESTIMATEEXEC is (PROSERVE §4.3: minus the time since
   ``ts_p``), and co-located stretched by the decode share of each step
   (Eq. 8: ``η/(η − t_c − n_d·b_d)``). That delay enters the dummy's achievable
   goodput (its first token comes later; a late one may lose tokens);
3. the replica where the dummy's priority is highest wins; ties (e.g. idle
   identical replicas) go to the earliest estimated first token, then the
   lowest instance id.

Disaggregated, the decode happens on a decode instance the prefill estimator
does not model: ``v`` there is a lightly loaded decode step of the model
(``t_c + T~_d(prompt)``) and ``t_gen_p`` is the prefill on ``p``, the
bandwidth of ``p`` the dummy uses; the decode instance is the one with the
most free KV blocks (base class). Like the local policy, the router keeps an
online output-length bound (:class:`proserve.scheduler.alternatives.jitserve.length_bound.LengthBound`) fed
by :meth:`on_request_finished`.

Parameters (validated; the length-bound ones as in the local policy):

* ``k = None``: K = M, every healthy instance, as the paper allows ("K can be
  set equal to M, ensuring full replica coverage"); an integer samples K of
  them uniformly (seeded) per request, and is clamped to M.
* ``eta = None``: the step length in the co-located stretch factor, default the
  tightest class TPOT SLO (as GoRouting / SlideBatching's η).
* ``goodput = "tdg"``, ``quantile = 0.95``, ``history = 5000``,
  ``min_samples = 20``, ``prior_len = 1024``: see :mod:`proserve.scheduler.alternatives.jitserve.gmax`.

``last_decision`` keeps the sampled instances, per-instance priorities and
first-token estimates of the latest call, for logs and tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ... import validate
from ...registry import register_global
from ...request import Request
from ...routing.base import COLOCATED, DISAGGREGATED, GlobalPolicy, PrefillInstance
from ...routing.estimates import lag, queued_work, resolve_eta
from .gmax import GOODPUTS, achievable_goodput
from .length_bound import LengthBound


@dataclass
class KDecision:
    request: str
    chosen: int
    sampled: list[int] = field(default_factory=list)
    priority: dict[int, float] = field(default_factory=dict)   # replica-specific Priority(r)
    t_first: dict[int, float] = field(default_factory=dict)    # estimated time to r's first token
    ahead: dict[int, float] = field(default_factory=dict)      # queued work scheduled before r


@register_global
class PowerOfK(GlobalPolicy):
    name = "jitserve_power_of_k"
    summary = "JITServe power-of-K: K replica-specific GMAX priorities per request, best replica wins"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0,
                 k: int | None = None, eta: float | None = None, goodput: str = "tdg",
                 quantile: float = 0.95, history: int = 5000, min_samples: int = 20, prior_len: int = 1024):
        super().__init__(gain, classes, deployment, seed)
        self.k = None if k is None else validate.integer(self.name, "k", k)   # None: K = M
        self.eta = resolve_eta(eta, self.classes, self.name)
        self.goodput = validate.one_of(self.name, "goodput", goodput, GOODPUTS)
        self.bound = LengthBound(quantile, history, min_samples, prior_len, where=self.name)
        self.last_decision: KDecision | None = None

    def on_request_finished(self, req: Request, now: float) -> None:
        if req.error is None and req.num_emitted >= 1:
            self.bound.observe(req.num_emitted)

    # -- the dummy's priority on one replica --------------------------------------------------
    def _speeds(self, p: PrefillInstance, tpot: float) -> tuple[float, float]:
        """(v, stretch): per-token step time and the wall time per unit of prefill work."""
        est = p.estimator
        t_c = est.t_c
        if self.deployment == COLOCATED:
            b_d = est.decode(p.avg_decode_kv)
            v = t_c + (p.n_decode + 1) * b_d
            eta = self.eta if self.eta is not None else tpot
            cap = eta - t_c - p.n_decode * b_d
            return v, (eta / cap if cap > 0 else math.inf)                     # Eq. 8 scale
        return math.nan, 1.0

    def _priority(self, r: Request, p: PrefillInstance, t_pre: float, wait: float, now: float,
                  v: float) -> tuple[float, float]:
        """(Priority_p(r), t_first) if r's prefill, ``t_pre`` seconds on p (0: none left), starts
        after ``wait`` seconds."""
        est = p.estimator
        gain = self.gain
        n = r.num_emitted
        L = self.bound.remaining(n)
        if self.deployment == COLOCATED:
            t_next = t_pre if t_pre > 0 else v
            t_first = wait + t_next
            t_gen = t_next + (L - 1) * v
        else:
            t_first = wait + t_pre
            v = est.t_c + est.decode(r.prompt_len + n)                         # decode elsewhere, lightly loaded
            t_gen = t_pre if t_pre > 0 else est.t_c
        tdg = self.goodput == "tdg"
        w = r.weight if tdg else 1.0
        w_p, w_d = (gain.w_p, gain.w_d) if tdg else (1.0, 1.0)
        d_next = gain.next_token_deadline(r)
        g = achievable_goodput(L, now + t_first - d_next, r.tpot_slo - v, (w_p if n == 0 else w_d) * w, w_d * w)
        return g / max(t_gen, 1e-9), t_first

    def select_prefill(self, req, prefills, now):
        M = len(prefills)
        K = M if self.k is None else min(self.k, M)
        idx = list(range(M)) if K == M else sorted(self.rng.sample(range(M), K))
        dec = KDecision(request=req.id, chosen=-1, sampled=[prefills[i].id for i in idx])
        best_key, best = None, idx[0]
        l_q0, l_kv0 = req.remaining_prefill, req.kv_len
        for i in idx:
            p = prefills[i]
            est = p.estimator
            t_c = est.t_c
            v, stretch = self._speeds(p, req.tpot_slo)
            # the prefill on p, stretched by the decode share of each step, plus one step's overhead
            own = est.prefill(l_q0, l_kv0) * stretch + t_c if l_q0 > 0 else 0.0
            p0, _ = self._priority(req, p, own, 0.0, now, v)
            # prefill work GMAX would run on p before the dummy: the queued requests whose
            # priority there (computed the same way) is at least the dummy's
            ahead = total = 0.0
            for q in p.queue:
                l_q, l_kv = queued_work(p, q)
                if l_q <= 0:
                    continue
                work = est.prefill(l_q, l_kv) * stretch + t_c
                total += work
                if self._priority(q, p, work, 0.0, now, v)[0] >= p0:
                    ahead += work
            lag_ = lag(p, now)
            wait = max(0.0, ahead - lag_)                                         # lag compensation
            prio, t_first = self._priority(req, p, own, wait, now, v)
            dec.priority[p.id], dec.t_first[p.id], dec.ahead[p.id] = prio, t_first, ahead
            # ties (a request that outranks everything queued sees no wait anywhere) go to the
            # replica with the least queued work: in the paper the first replica to schedule one
            # of the request's copies wins, which is the idlest one, not the lowest-numbered
            key = (-prio, t_first, max(0.0, total - lag_), p.id)
            if best_key is None or key < best_key:
                best_key, best = key, i
        dec.chosen = prefills[best].id
        self.last_decision = dec
        return prefills[best]
