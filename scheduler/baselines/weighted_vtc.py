"""Weighted VTC (§5.1 baseline): the Virtual Token Counter of Sheng et al.,
"Fairness in Serving Large Language Models" (OSDI'24, §4), with weights.

One counter per client; a client here is a priority class (``r.priority``)
and its weight the class weight ``r.weight``. Counters advance by the service
a class received divided by its weight, service being VTC's linear cost
``w_in·input tokens + w_out·output tokens`` (``w_in = 1``, ``w_out = 2`` as in
the VTC paper), so two backlogged classes get service in the ratio of their
weights (the paper's §5.1: "the ratio of tokens processed approximates the
ratio of assigned priority weights").

Counter lift (VTC Alg. 2): when a class becomes active — has a waiting
request after having none — its counter becomes ``max(own, min counter of the
other active classes)``; if no other class is active, ``max(own, counter of
the class that last left the active set)``. Activity is observed at each
``schedule`` call (the policy sees the queue only then).

Each step: all running decodes continue (memory permitting), then prefill
chunks are admitted, each time from the active class with the smallest
counter (FCFS within the class), ``min(remaining, budget left)`` tokens, until
the token budget (``token_budget``, default the TBT-profiled one, as for
Sarathi) runs out; a class whose head memory cannot take now sits out the rest
of the batch (a prefill of another class may hold the KV that has to finish
first). While forming the batch a scratch copy of
the counters is advanced by each admitted chunk so that classes interleave as
in VTC; the real counters advance in :meth:`on_batch_done`: prefill chunk
tokens (input, charged as they are admitted — with chunked prefill, chunk by
chunk) and one output token per decode in the batch. The first token, emitted
by the last prefill chunk, is not charged as output (VTC charges output tokens
in decode steps).
"""

from __future__ import annotations

from .. import validate
from ..local.base import COLOCATED, BatchBuilder, BatchPlan, InstanceView, LocalPolicy
from ..registry import register_local
from ..request import ConfigError


@register_local
class WeightedVTC(LocalPolicy):
    name = "weighted_vtc"
    summary = "Weighted Virtual Token Counter (VTC, OSDI'24): fair share of tokens by class weight"

    def __init__(self, estimator, gain=None, classes=None, token_budget: int | None = None,
                 w_in: float = 1.0, w_out: float = 2.0):
        super().__init__(estimator, gain, classes)
        if token_budget is not None:
            token_budget = validate.integer(self.name, "token_budget", token_budget)
        self.token_budget = token_budget
        self.w_in = validate.non_negative(self.name, "w_in", w_in)
        self.w_out = validate.non_negative(self.name, "w_out", w_out)
        if self.w_in == 0 and self.w_out == 0:
            raise ConfigError(f"{self.name}: w_in and w_out cannot both be 0")
        self.counters: dict[str, float] = {}
        self._active: set[str] = set()
        self._last_left: float | None = None

    def _lift(self, active: set[str]) -> None:
        """VTC's counter lift for classes that became active since the last step."""
        left = self._active - active
        if left:
            self._last_left = max(self.counters[c] for c in left)
        staying = [self.counters[c] for c in active & self._active]
        floor = min(staying) if staying else self._last_left
        for c in sorted(active - self._active):
            own = self.counters.get(c, 0.0)
            self.counters[c] = own if floor is None else max(own, floor)
        self._active = set(active)

    def schedule(self, view: InstanceView) -> BatchPlan:
        budget = self.token_budget or self.tbt_token_budget()
        queues: dict[str, list] = {}
        for r in sorted(view.waiting, key=lambda r: r.arrival):
            queues.setdefault(r.priority, []).append(r)
        self._lift(set(queues))
        b = BatchBuilder(view, self.est)
        if view.mode == COLOCATED:
            for r in sorted(view.decoding, key=lambda r: r.arrival):
                b.add_decode(r)
        vc = {c: self.counters[c] for c in queues}  # scratch counters for this batch
        heads = {c: 0 for c in queues}
        while vc:
            left = budget - b.tokens
            if left <= 0:
                break
            c = min(vc, key=lambda k: (vc[k], queues[k][heads[k]].arrival))
            r = queues[c][heads[c]]
            n = b.add_prefill(r, left)
            if n == 0:
                # memory cannot take this class's head now: the class sits out this batch,
                # the others go on (one of them may hold a partial prefill that must finish
                # for memory to free up; stopping here would starve it)
                del vc[c]
                continue
            vc[c] += self.w_in * n / r.weight
            if n < r.remaining_prefill:
                break  # budget or memory ran out inside this chunk
            heads[c] += 1
            if heads[c] == len(queues[c]):
                del vc[c]
        return b.finish(token_budget=budget)

    def on_batch_done(self, plan: BatchPlan, now: float) -> None:
        for r, n in plan.prefill:
            self._charge(r, self.w_in * n)
        for r in plan.decode:
            self._charge(r, self.w_out)

    def _charge(self, r, cost: float) -> None:
        self.counters[r.priority] = self.counters.get(r.priority, 0.0) + cost / r.weight
