"""Ablation "w/o latency-aware" (§5.4): SlideBatching's URGENT/NORMAL ordering
without the latency estimator bounding the batch — the batch is filled up to a
fixed token budget (Sarathi's TBT-profiled budget unless ``token_budget`` is
given) instead of the latency budget t_budget."""

from ..registry import register_local
from .slide_batching import SlideBatching


@register_local
class WithoutLatencyAware(SlideBatching):
    name = "wo_latency_aware"
    summary = "ablation: SlideBatching ordering with a fixed token budget"
    latency_aware = False
