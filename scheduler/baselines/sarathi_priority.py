"""Sarathi-Priority (§5.1 baseline): Sarathi-FCFS with priority ordering.

"It strictly prioritizes decode requests first, followed by those with higher
priority, and finally, those that arrived earlier": running decodes first as in
Sarathi-FCFS, then prefill chunks of the waiting requests ordered by priority
weight descending, then arrival, in the same TBT-profiled token budget.
"""

from __future__ import annotations

from ..registry import register_local
from .sarathi_fcfs import SarathiFCFS


@register_local
class SarathiPriority(SarathiFCFS):
    name = "sarathi_priority"
    summary = "Sarathi-Serve with strict priority: decodes, then prefills by weight desc, arrival"

    def order_waiting(self, waiting):
        return sorted(waiting, key=lambda r: (-r.weight, r.arrival))
