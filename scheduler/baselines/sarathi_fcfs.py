"""Sarathi-FCFS (§5.1 baseline): the Sarathi-Serve scheduler.

Stall-free batching with chunked prefill: each step

1. every running decode joins the batch (memory permitting; one token each,
   counted against the token budget);
2. the rest of the token budget goes to prefill chunks, waiting requests in
   arrival order (FCFS), each taking ``min(remaining prompt, budget left)``
   tokens, until the budget or the KV memory runs out.

The token budget is Sarathi's profiled one: by default
:meth:`LocalPolicy.tbt_token_budget` — the largest prefill chunk whose batch
fits within the tightest TPOT (TBT) SLO on the (β-corrected) latency model,
re-read each step so it follows the online correction; ``token_budget`` fixes
it. On a prefill-only instance there are no decodes and only step 2 runs.
"""

from __future__ import annotations

from .. import validate
from ..local.base import COLOCATED, BatchBuilder, BatchPlan, InstanceView, LocalPolicy
from ..registry import register_local


@register_local
class SarathiFCFS(LocalPolicy):
    name = "sarathi_fcfs"
    summary = "Sarathi-Serve: decodes first, then FCFS prefill chunks in a TBT-profiled token budget"

    def __init__(self, estimator, gain=None, classes=None, token_budget: int | None = None):
        super().__init__(estimator, gain, classes)
        if token_budget is not None:
            token_budget = validate.integer(self.name, "token_budget", token_budget)
        self.token_budget = token_budget

    def order_waiting(self, waiting):
        """Admission order of the prefills: FCFS by arrival."""
        return sorted(waiting, key=lambda r: r.arrival)

    def schedule(self, view: InstanceView) -> BatchPlan:
        budget = self.token_budget or self.tbt_token_budget()
        b = BatchBuilder(view, self.est)
        if view.mode == COLOCATED:
            for r in sorted(view.decoding, key=lambda r: r.arrival):
                b.add_decode(r)  # decodes first; one that needs a missing block is skipped
        for r in self.order_waiting(view.waiting):
            left = budget - b.tokens
            if left <= 0:
                break
            if b.add_prefill(r, left) == 0:
                break  # KV memory is full
        return b.finish(token_budget=budget)
