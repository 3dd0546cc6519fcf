"""SLOs-Serve's multi-replica routing (Chen et al., §4.2, Fig. 7, §6.2).

A one-shot round-robin dispatcher proposes a replica; the centralized
controller, which keeps a virtual copy of every replica's scheduler, checks
whether that replica can admit the request with its SLOs attained. If not,
the request is routed to the next replica, sequentially, until one admits it
or the routing count reaches ``max_hops``; then the backup policy sends it
somewhere as best effort (§4.2: "deciding whether to decline the request or
offload it to lower-tier resources"; here it is never dropped).

The admission check is the same DP as the local policy's
(:func:`proserve.scheduler.alternatives.slos_serve.model.admit_dp` with one candidate), run on what
the global scheduler knows of the replica (:class:`PrefillInstance`): the
requests this router admitted there whose prefill has not finished (forced,
with their work as recorded at dispatch), the replica's decoding requests
``n_d`` (co-located), and the replica's estimator (roofline fitted from its
Eq. 5-7 model, β applied). The replica's local ``slos_serve`` policy then
decides with its exact state and is authoritative; the two agree when the
global view is current.

Parameters (``--global-param``):

* ``max_hops`` (default: every replica): routing count limit.
* ``backup = "first"``: where a request no replica admits goes: ``"first"``,
  the round-robin replica (it is served there best-effort); ``"min_load"``,
  the replica with the least queued prefill time (GoRouting's ESTIMATEEXEC).
* ``batch_time`` (default: tightest class TPOT SLO), ``decode_cost =
  "model"``, ``fit_max_time`` (default: 4 × the loosest class TPOT SLO),
  ``roofline_pieces = 2``: as in the local ``slos_serve`` policy, so both
  sides plan with the same numbers.
* ``output_len_prior = 266``: ô before requests finish, as the local policy.
* ``kv_reserve = 0.01``: share of a replica's KV blocks kept free (vLLM's
  watermark), besides one block per resident request for growth.

Simplifications: the decoding requests of a co-located replica are counted
at the tightest class TPOT and the instance's ``avg_decode_kv`` (the global
view has their number only); no memory dimension (the global view has no KV
occupancy of the prefill instances; the local DP has it); queued work is
counted as dispatched, without progress since (conservative).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import validate
from ...registry import register_global
from ...routing.base import COLOCATED, DISAGGREGATED, GlobalPolicy
from ...routing.estimates import evaluate, queued_work, resolve_eta
from .model import (
    FIT_SPAN,
    Job,
    MeanOutputLen,
    Roofline,
    admit_dp,
    check_policy_params,
    default_fit_max_time,
    line_deadline,
)

BACKUPS = ("first", "min_load")


@dataclass
class RouteDecision:
    """Why the latest call chose what it chose."""

    request: str
    first: int                                    # the round-robin proposal
    tried: list[int] = field(default_factory=list)  # replicas checked, in order
    chosen: int = -1
    admitted: bool = False                        # False: sent by the backup policy, best-effort


@register_global
class SLOsServeRouting(GlobalPolicy):
    name = "slos_serve_routing"
    summary = "SLOs-Serve: round-robin proposal, sequential re-routing to a replica whose DP admits the request"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0,
                 max_hops: int | None = None, backup: str = "first", batch_time: float | None = None,
                 decode_cost: str = "model", fit_max_time: float | None = None, roofline_pieces: int = 2,
                 output_len_prior: float = 266.0, kv_reserve: float = 0.01):
        super().__init__(gain, classes, deployment, seed)
        n = self.name
        if max_hops is not None:
            max_hops = validate.integer(n, "max_hops", max_hops)
        validate.one_of(n, "backup", backup, BACKUPS)
        if batch_time is not None:
            batch_time = validate.positive(n, "batch_time", batch_time)
        output_len_prior = check_policy_params(n, decode_cost, roofline_pieces, output_len_prior)
        if fit_max_time is None:
            fit_max_time = default_fit_max_time(self.classes, batch_time)
        else:
            fit_max_time = validate.positive(n, "fit_max_time", fit_max_time)
        self.kv_reserve = validate.number(n, "kv_reserve", kv_reserve, 0, 1, hi_open=True)
        self._o_hat = MeanOutputLen(output_len_prior)
        self._resident: dict[int, dict[str, object]] = {}   # per replica: routed, unfinished requests
        self.max_hops = max_hops
        self.backup = backup
        self.batch_time = batch_time
        self.decode_cost = decode_cost
        self.fit_max_time = fit_max_time
        self.roofline_pieces = roofline_pieces
        self._admitted: dict[int, set[str]] = {}   # per replica: requests this router admitted there
        self._where: dict[str, int] = {}
        self._roofs: dict[int, tuple[object, Roofline]] = {}
        self._rr = 0
        # the tightest class TPOT SLO (None without classes): the decodes' TPOT in the
        # admission check, and the t_budget floor of the min_load backup (as GoRouting's η)
        self._tpot_min = resolve_eta(None, self.classes, self.name)
        self.last_decision: RouteDecision | None = None

    def _roofline(self, model, tpot: float) -> Roofline:
        hit = self._roofs.get(id(model))
        if hit is None or hit[0] is not model:
            span = self.fit_max_time if self.fit_max_time is not None else FIT_SPAN * tpot
            roof = Roofline.from_latency_model(model, max(span, 2 * model.t_c), pieces=self.roofline_pieces)
            hit = (model, roof)
            self._roofs[id(model)] = hit
        return hit[1]

    def attainable(self, req, p, now: float) -> bool:
        """Would replica ``p``'s (virtual) scheduler admit ``req``? (§4.2)"""
        est = p.estimator
        m = est.model
        colocated = self.deployment == COLOCATED
        tpot_min = self._tpot_min if self._tpot_min is not None else req.tpot_slo
        roof = self._roofline(m, max(req.tpot_slo, self.batch_time or 0.0))
        t0 = self.batch_time if self.batch_time is not None else tpot_min
        if colocated:
            t0 = min(t0, req.tpot_slo, tpot_min)
        tokens = roof.time2bs(est.model_time(t0))
        sigma = tokens / t0
        k_hat = roof.marginal(tokens)
        unit = self.decode_cost == "unit" or k_hat <= 0

        def e(l_kv: float) -> float:
            return 1.0 if unit else m.decode_time(l_kv) / k_hat

        mine = self._admitted.get(p.id, ())
        if colocated and not self._memory_fits(req, p, m.metadata, mine):
            return False
        base_rate = p.n_decode * e(p.avg_decode_kv) / tpot_min if colocated and p.n_decode else 0.0
        forced = []
        for r in p.queue:
            if r.id not in mine or r.id == req.id:
                continue
            l_q, l_kv = queued_work(p, r)
            forced.append(Job(line_deadline(r), l_q, e(l_q + l_kv) / r.tpot_slo if colocated else 0.0))
        cand = Job(req.arrival + req.ttft_slo, req.remaining_prefill, 0.0, 0)
        rate = e(req.prompt_len) / req.tpot_slo if colocated else 0.0
        return admit_dp(now, sigma, base_rate, forced, [cand], [rate]).admitted[0]

    @property
    def mean_output_len(self) -> float:
        """ô, learned from finished requests as the local policy does."""
        return self._o_hat.value

    def _memory_fits(self, req, p, md: dict, mine) -> bool:
        """The m dimension on the virtual replica (co-located): KV blocks of the requests
        routed there and not finished, plus the growth (to prompt + ô) of those this
        router admitted, must leave room for ``req``'s prompt + ô. Skipped when the
        latency model does not say how many KV blocks an instance has."""
        total, bs = md.get("num_kv_blocks"), md.get("block_size")
        if not total or not bs:
            return True
        o_hat = self.mean_output_len
        resident = self._resident.get(p.id, {})
        queued = {r.id for r in p.queue}
        used = 0.0
        for rid, r in resident.items():
            held = 0 if rid in queued else -(-(r.prompt_len + r.num_emitted) // bs)
            if rid in mine:
                held = max(held, -(-(r.prompt_len + max(o_hat, r.num_emitted + 1)) // bs))
            used += held
        reserve = self.kv_reserve * total + len(resident)
        return -(-(req.prompt_len + o_hat) // bs) <= total - reserve - used

    def select_prefill(self, req, prefills, now):
        n = len(prefills)
        start = self._rr % n
        self._rr += 1
        hops = n if self.max_hops is None else min(self.max_hops, n)
        dec = RouteDecision(req.id, prefills[start].id)
        self.last_decision = dec
        for h in range(hops):
            p = prefills[(start + h) % n]
            dec.tried.append(p.id)
            if self.attainable(req, p, now):
                dec.chosen, dec.admitted = p.id, True
                self._admitted.setdefault(p.id, set()).add(req.id)
                self._note(req, p)
                return p
        if self.backup == "min_load":
            gain, dep, eta = self.gain, self.deployment, self._tpot_min
            p = min(prefills, key=lambda q: (evaluate(q, req, now, gain, dep, eta, with_gain=False).exec, q.id))
        else:
            p = prefills[start]
        dec.chosen = p.id
        self._note(req, p)
        return p

    def _note(self, req, p) -> None:
        self._where[req.id] = p.id
        self._resident.setdefault(p.id, {})[req.id] = req

    def on_request_finished(self, req, now: float) -> None:
        where = self._where.pop(req.id, None)
        if where is not None:
            self._admitted.get(where, set()).discard(req.id)
            self._resident.get(where, {}).pop(req.id, None)
        self._o_hat.observe(req)
