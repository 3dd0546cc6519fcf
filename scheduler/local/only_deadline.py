"""Ablation "w/ only deadline" (§5.4): SlideBatching without the adaptive
urgency partition — every request is NORMAL, ordered by remain ascending,
with the same latency budget and chunking."""

from ..registry import register_local
from .slide_batching import SlideBatching


@register_local
class OnlyDeadline(SlideBatching):
    name = "only_deadline"
    summary = "ablation: SlideBatching with every request NORMAL (deadline-first)"
    router_order = "deadline"
    ordering = "deadline"
