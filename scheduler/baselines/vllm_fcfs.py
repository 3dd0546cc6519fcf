"""vLLM-FCFS (§5.1 baseline): vLLM's default (v0-style) scheduler.

"It prioritizes prefill requests and employs FCFS" — no chunked prefill:

* if any request waits, the step is a prefill-only batch of whole prompts in
  arrival order, admitted while the token budget ``max_num_batched_tokens``,
  ``max_num_seqs`` (running decodes + newly admitted) and the KV memory allow;
  admission stops at the first request that does not fit (FCFS, no skipping);
* a partially prefilled request (left so by memory pressure) continues first;
* the first admitted request is taken whole even when its prompt exceeds the
  token budget: vLLM requires ``max_num_batched_tokens >= max_model_len`` when
  chunked prefill is off, so a prompt never waits on the budget there; here the
  budget is a plain parameter and this keeps a long prompt from starving. A
  prompt whose whole KV does not fit in the free memory is not admitted (the
  rule of every policy, :meth:`BatchBuilder.admissible`); it waits for running
  requests to finish;
* otherwise (nothing waiting, nothing admissible) a decode-only batch of the
  running requests in arrival order, up to ``max_num_seqs``, memory permitting
  (a decode that needs a block that is not free is skipped; vLLM would preempt).

Defaults are vLLM's: ``max_num_batched_tokens = 8192``, ``max_num_seqs = 256``.
On a prefill-only instance there are no decodes, so only the prefill rule runs.
"""

from __future__ import annotations

from .. import validate
from ..local.base import COLOCATED, BatchBuilder, BatchPlan, InstanceView, LocalPolicy
from ..registry import register_local


@register_local
class VllmFCFS(LocalPolicy):
    name = "vllm_fcfs"
    summary = "vLLM default: prefill-first FCFS, whole prompts, no chunked prefill"

    def __init__(self, estimator, gain=None, classes=None,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 256):
        super().__init__(estimator, gain, classes)
        self.max_num_batched_tokens = validate.integer(self.name, "max_num_batched_tokens", max_num_batched_tokens)
        self.max_num_seqs = validate.integer(self.name, "max_num_seqs", max_num_seqs)

    def schedule(self, view: InstanceView) -> BatchPlan:
        decoding = view.decoding if view.mode == COLOCATED else []
        b = BatchBuilder(view, self.est)
        # partially prefilled requests continue first, then FCFS by arrival
        waiting = sorted(view.waiting, key=lambda r: (r.prefilled == 0, r.arrival))
        seqs = len(decoding)
        for r in waiting:
            if seqs + len(b.plan.prefill) >= self.max_num_seqs:
                break
            n = r.remaining_prefill
            if b.plan.prefill:
                if b.tokens + n > self.max_num_batched_tokens:
                    break
                if not b.can_fit(r, n):
                    break  # whole prompt must fit (no chunking)
            if b.add_prefill(r, n) == 0:
                break
        if b.plan.prefill:
            return b.finish(token_budget=self.max_num_batched_tokens)
        for r in sorted(decoding, key=_by_arrival)[: self.max_num_seqs]:
            b.add_decode(r)  # memory permitting
        return b.finish(token_budget=self.max_num_batched_tokens)


def _by_arrival(r):
    return r.arrival
