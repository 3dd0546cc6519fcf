"""FairBatching (§5.1 baseline; Lyu et al. 2025, arXiv 2510.14392).

What this follows: the PROSERVE paper's description — "an enhanced EDF policy.
It schedules requests by prioritizing decode sequences nearing their
deadlines, followed by prefill sequences, and finally the remaining decode
requests" — with FairBatching's per-token deadline envelope
``token_ddl_{i,j} = arrival_i + ttft_slo + j·tpot_slo`` (the same deadlines as
TDG, :meth:`GainConfig.next_token_deadline`). The FairBatching paper's own
batch-formation pseudo-code and its adaptive batch capacity could not be
looked up here, so the batch capacity is Sarathi's TBT-profiled token budget
(as for Sarathi-FCFS) and the rules are:

1. decodes whose next-token deadline is within ``slack`` of now, EDF;
2. prefill chunks (``min(remaining, budget left)`` tokens), EDF by the
   deadline of the token the prefill emits (the first token; the next one
   after a recompute preemption);
3. the remaining decodes (those with more slack), EDF;

each item taking tokens from the budget until it runs out (decodes 1 token),
memory permitting (an item that does not fit is skipped).

Default ``slack`` = the tightest TPOT SLO, i.e. about one batch time (batches
are sized to the TPOT SLO): a decode whose next deadline falls before the next
batch would end must run now; one that is ahead of its envelope by more gives
its share of the budget to prefills and runs after them if room is left.
"""

from __future__ import annotations

from .. import validate
from ..local.base import COLOCATED, BatchBuilder, BatchPlan, InstanceView, LocalPolicy
from ..registry import register_local


@register_local
class FairBatching(LocalPolicy):
    name = "fairbatching"
    summary = "FairBatching: near-deadline decodes, then EDF prefills, then other decodes (EDF)"

    def __init__(self, estimator, gain=None, classes=None, token_budget: int | None = None,
                 slack: float | None = None):
        super().__init__(estimator, gain, classes)
        if token_budget is not None:
            token_budget = validate.integer(self.name, "token_budget", token_budget)
        self.token_budget = token_budget
        self.slack = validate.non_negative(self.name, "slack", self.min_tpot_slo() if slack is None else slack)

    def schedule(self, view: InstanceView) -> BatchPlan:
        budget = self.token_budget or self.tbt_token_budget()
        ddl = self.gain.next_token_deadline
        now = view.now
        decodes = sorted(view.decoding, key=lambda r: (ddl(r), r.arrival)) if view.mode == COLOCATED else []
        near = [r for r in decodes if ddl(r) - now <= self.slack]
        far = [r for r in decodes if ddl(r) - now > self.slack]
        prefills = sorted(view.waiting, key=lambda r: (ddl(r), r.arrival))
        b = BatchBuilder(view, self.est)
        b.fill_tokens(near + prefills + far, budget)
        return b.finish(token_budget=budget, n_urgent=len(near))
