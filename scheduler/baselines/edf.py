"""EDF (§3.2): earliest-deadline-first ordering under a fixed token budget.

All queued requests — waiting (prefill) and, on a co-located instance,
decoding — are ordered together by the deadline of their next token
(:meth:`GainConfig.next_token_deadline`; ties by arrival) and taken in that
order: a decode takes 1 token, a prefill ``min(remaining, budget left)``
tokens, until the token budget is spent; an item the KV memory cannot hold is
skipped. The token budget is fixed (§3.2 studies EDF under a static budget):
``token_budget``, by default the TBT-profiled one
(:meth:`LocalPolicy.tbt_token_budget`).
"""

from __future__ import annotations

from .. import validate
from ..local.base import COLOCATED, BatchBuilder, BatchPlan, InstanceView, LocalPolicy
from ..registry import register_local


@register_local
class EDF(LocalPolicy):
    name = "edf"
    summary = "EDF over prefills and decodes by next-token deadline, fixed token budget"

    def __init__(self, estimator, gain=None, classes=None, token_budget: int | None = None):
        super().__init__(estimator, gain, classes)
        if token_budget is not None:
            token_budget = validate.integer(self.name, "token_budget", token_budget)
        self.token_budget = token_budget

    def key(self, r) -> float:
        """Sort key, smallest first: the next token's deadline."""
        return self.gain.next_token_deadline(r)

    def schedule(self, view: InstanceView) -> BatchPlan:
        budget = self.token_budget or self.tbt_token_budget()
        Q = list(view.waiting)
        if view.mode == COLOCATED:
            Q += view.decoding
        b = BatchBuilder(view, self.est)
        b.fill_tokens(sorted(Q, key=lambda r: (self.key(r), r.arrival)), budget)
        return b.finish(token_budget=budget)
