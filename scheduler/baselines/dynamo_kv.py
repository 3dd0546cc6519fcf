"""Dynamo-style KV-aware cost routing (issue 14's baseline), after NVIDIA Dynamo's KV
router (``--router-mode kv``): per instance

    logit = kv_overlap_score_weight · potential_prefill_blocks + potential_active_blocks

and the lowest logit wins (temperature 0, Dynamo's default; ties at random, seeded).

* ``potential_prefill_blocks``: the prefill the instance would have to compute with the
  request added, in KV blocks: the queued prefills' tokens (as recorded at dispatch,
  net of their expected hits) plus the request's prompt less the prefix its cache is
  expected to hold (``routing.base.expected_hit``), over the block size;
* ``potential_active_blocks``: the KV blocks the instance's active sequences would hold
  with the request added: the queued requests' prompts and, co-located, the running
  decodes (``n_d`` at ``avg_decode_kv`` tokens each), plus the request's prompt.

``overlap_weight`` (Dynamo's ``--kv-overlap-score-weight``, default 1) trades
TTFT (cache affinity, less prefill) against ITL (spreading the active blocks);
``temperature`` > 0 samples ``softmax(−logit / T)`` over logits normalised as Dynamo
does (divided by the largest), as ``--router-temperature``.
Simplified: Dynamo tracks the active sequences' blocks as they grow token by token
and reads the cached blocks from the engines' KV events; here the router's own
bookkeeping (queued work, ``n_d``) and its block index stand in for both.
"""

from __future__ import annotations

import math

from .. import validate
from ..registry import register_global
from ..routing.base import DISAGGREGATED, GlobalPolicy, expected_hit


@register_global
class DynamoKV(GlobalPolicy):
    name = "dynamo_kv"
    summary = "Dynamo's KV router: min of overlap_weight·prefill blocks + active blocks"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0,
                 overlap_weight: float = 1.0, temperature: float = 0.0):
        super().__init__(gain, classes, deployment, seed)
        self.overlap_weight = validate.non_negative(self.name, "overlap_weight", overlap_weight)
        self.temperature = validate.non_negative(self.name, "temperature", temperature)
        self.last_logits: dict[int, float] = {}   # instance id -> logit of the latest call

    def logit(self, p, req) -> float:
        bs = p.block_size
        queued_prefill = sum(lq for lq, _ in p.dispatched.values())
        queued_kv = sum(lq + lkv for lq, lkv in p.dispatched.values())
        prefill_blocks = (queued_prefill + req.remaining_prefill - expected_hit(p, req)) / bs
        active_blocks = (queued_kv + p.n_decode * p.avg_decode_kv + req.prompt_len) / bs
        return self.overlap_weight * prefill_blocks + active_blocks

    def select_prefill(self, req, prefills, now):
        logits = {p.id: self.logit(p, req) for p in prefills}
        self.last_logits = logits
        if self.temperature > 0:
            top = max(logits.values()) or 1.0
            z = [-(logits[p.id] / top) / self.temperature for p in prefills]
            zmax = max(z)      # softmax shifted by its max: a small temperature underflows no weight to 0
            ws = [math.exp(v - zmax) for v in z]
            return self.rng.choices(prefills, weights=ws)[0]
        low = min(logits.values())
        best = [p for p in prefills if logits[p.id] <= low + 1e-9]
        return best[0] if len(best) == 1 else best[self.rng.randrange(len(best))]
