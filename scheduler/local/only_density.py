"""Ablation "w/ only density" (§5.4): SlideBatching without the adaptive
urgency partition — every request is URGENT, ordered by density descending,
with the same latency budget and chunking."""

from ..registry import register_local
from .slide_batching import SlideBatching


@register_local
class OnlyDensity(SlideBatching):
    name = "only_density"
    summary = "ablation: SlideBatching with every request URGENT (density-first)"
    ordering = "density"
