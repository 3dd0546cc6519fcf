"""llm-d-style weighted scorers (issue 14's baseline), after llm-d's inference
scheduler (the Gateway API Inference Extension's endpoint picker): each instance gets
``Σ weight · score`` from three scorers, every score in [0, 1], and the max-score
picker takes the highest (ties: uniformly at random, seeded, as the picker does).

* ``prefix-cache-scorer``: the fraction of the request's prompt the instance's cache
  is expected to hold (here: the router's block index, ``routing.base.expected_hit``);
* ``queue-scorer``: ``(max_q − q) / (max_q − min_q)`` over the instances' waiting
  queues (1 for all when they are equal); ``q`` is the requests queued for prefill;
* ``kv-cache-utilization-scorer``: ``1 − kv_usage``, the fraction of KV memory free
  (``PrefillInstance.kv_usage``, vLLM's ``vllm:kv_cache_usage_perc``; where an instance
  has not reported it, the router's own estimate: the queued prompts' and, co-located,
  the running decodes' KV over the instance's KV capacity).

Weights default to llm-d's published inference-scheduling profile: prefix 3,
queue 2, KV utilisation 2 (``prefix``, ``queue``, ``kv``, all settable).
Simplified: llm-d scrapes queue and KV metrics from the engines on an interval
(the simulator hands this policy exact values at each decision, which favours it)
and its prefix scorer hashes the prompt in blocks of its own size.
"""

from __future__ import annotations

from .. import validate
from ..registry import register_global
from ..routing.base import DISAGGREGATED, GlobalPolicy, expected_hit, kv_capacity


def kv_usage(p) -> float:
    """``p``'s KV memory in use: as reported, else the router's estimate from what it
    dispatched (queued prompts, running decodes) over its KV capacity; 0 without one. A NaN
    report counts as none (as in ``routing.base.kv_room``): a NaN score would beat no other
    and empty the max-score picker's choice."""
    if p.kv_usage is not None and p.kv_usage == p.kv_usage:
        return p.kv_usage
    capacity = kv_capacity(p)
    if not capacity:
        return 0.0
    queued = sum(lq + lkv for lq, lkv in p.dispatched.values())
    return min(1.0, (queued + p.n_decode * p.avg_decode_kv) / capacity)


# llm-d's published inference-scheduling profile (the module doc)
W_PREFIX, W_QUEUE, W_KV = 3.0, 2.0, 2.0


def llmd_scores(req, prefills, w_prefix: float = W_PREFIX, w_queue: float = W_QUEUE,
                w_kv: float = W_KV, hits: list[int] | None = None) -> dict[int, float]:
    """Instance id -> ``w_prefix·prefix + w_queue·queue + w_kv·(1 − KV usage)`` (the module doc);
    ``hits``: each instance's ``expected_hit`` for req, where the caller has them already."""
    qs = {p.id: len(p.queue) for p in prefills}
    lo, hi = min(qs.values()), max(qs.values())
    scores = {}
    for k, p in enumerate(prefills):
        s_prefix = (expected_hit(p, req) if hits is None else hits[k]) / req.prompt_len
        s_queue = 1.0 if hi == lo else (hi - qs[p.id]) / (hi - lo)
        s_kv = 1.0 - kv_usage(p)
        scores[p.id] = w_prefix * s_prefix + w_queue * s_queue + w_kv * s_kv
    return scores


def pick_max(pool, scores: dict[int, float], rng):
    """The instance of ``pool`` with the highest score; ties uniformly at random (``rng``)."""
    top = max(scores[p.id] for p in pool)
    best = [p for p in pool if scores[p.id] >= top - 1e-12]
    return best[0] if len(best) == 1 else best[rng.randrange(len(best))]


@register_global
class LlmdScorers(GlobalPolicy):
    name = "llmd_scorers"
    summary = "llm-d's weighted scorers: 3·prefix + 2·queue + 2·KV utilisation, max score"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0,
                 prefix: float = W_PREFIX, queue: float = W_QUEUE, kv: float = W_KV):
        super().__init__(gain, classes, deployment, seed)
        self.w_prefix = validate.non_negative(self.name, "prefix", prefix)
        self.w_queue = validate.non_negative(self.name, "queue", queue)
        self.w_kv = validate.non_negative(self.name, "kv", kv)
        self.last_scores: dict[int, float] = {}   # instance id -> total score of the latest call

    def select_prefill(self, req, prefills, now):
        scores = llmd_scores(req, prefills, self.w_prefix, self.w_queue, self.w_kv)
        self.last_scores = scores
        return pick_max(prefills, scores, self.rng)
