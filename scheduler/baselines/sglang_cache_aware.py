"""SGLang-style cache-aware routing (issue 14's baseline), after the SGLang router's
``cache_aware`` policy (sgl-project/sglang, ``sgl-router`` / sgl-model-gateway:
"Cache-Aware Load Balancing Router"; its ``--cache-threshold``,
``--balance-abs-threshold`` and ``--balance-rel-threshold`` are this policy's
``cache_threshold``, ``balance_abs`` and ``balance_rel``).

Per request:

1. **Imbalanced?** With ``load`` each instance's requests in flight (the SGLang router
   counts the requests it sent and has not seen finish: here the queued prefills
   plus, co-located, the running decodes), the system is imbalanced when
   ``max − min > balance_abs`` **and** ``max > balance_rel · min``; then the least
   loaded instance is chosen (shortest queue).
2. Otherwise the instance whose cache holds the longest prefix of the request; if
   its match rate (matched / prompt tokens) exceeds ``cache_threshold`` it is chosen,
   else the instance whose cache holds the fewest blocks (the most room, as the
   router picks the smallest tree).

Simplified: the SGLang router keeps an approximate radix tree of the *text* it
routed per worker, evicted by size on an interval; here the cache view is the
router's block index (``PrefillInstance.prefix``, the same approximate index
GoRouting reads), counted in whole KV blocks. Defaults are the current router's
(cache threshold 0.3, absolute 64, relative 1.5); earlier releases used 0.5 / 32 /
1.0001. Ties go to the lowest load, then the lowest id.
"""

from __future__ import annotations

from .. import validate
from ..registry import register_global
from ..routing.base import DISAGGREGATED, GlobalPolicy, expected_hit


def in_flight(p) -> int:
    """The requests the router has in flight on ``p``: queued prefills plus, co-located,
    running decodes."""
    return len(p.queue) + p.n_decode


@register_global
class SGLangCacheAware(GlobalPolicy):
    name = "sglang_cache_aware"
    summary = "SGLang router's cache_aware: longest prefix match unless the load is imbalanced"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0,
                 cache_threshold: float = 0.3, balance_abs: float = 64, balance_rel: float = 1.5):
        super().__init__(gain, classes, deployment, seed)
        self.cache_threshold = validate.number(self.name, "cache_threshold", cache_threshold, 0.0, 1.0)
        self.balance_abs = validate.number(self.name, "balance_abs", balance_abs, 0.0)
        self.balance_rel = validate.number(self.name, "balance_rel", balance_rel, 1.0)
        self.last_branch = ""   # "balance", "cache" or "room": which rule chose (tests, logs)

    def select_prefill(self, req, prefills, now):
        loads = {p.id: in_flight(p) for p in prefills}
        lo, hi = min(loads.values()), max(loads.values())
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            self.last_branch = "balance"
            return min(prefills, key=lambda p: (loads[p.id], p.id))
        hits = {p.id: expected_hit(p, req) for p in prefills}
        best = max(prefills, key=lambda p: (hits[p.id], -loads[p.id], -p.id))
        if hits[best.id] > self.cache_threshold * req.prompt_len:
            self.last_branch = "cache"
            return best
        self.last_branch = "room"
        return min(prefills, key=lambda p: (len(p.prefix) if p.prefix is not None else 0, loads[p.id], p.id))
