"""SJF (§3.2): shortest-job-first ordering under a fixed token budget.

As :mod:`edf`, but all queued requests are ordered by the estimated execution
time of their remaining work, :meth:`LocalPolicy.exec_time` (T~_pd of the
remaining prefill for a waiting request, of one decode step for a decoding
one — so decodes, being short, naturally come first; ties by arrival).
"""

from __future__ import annotations

from ..registry import register_local
from .edf import EDF


@register_local
class SJF(EDF):
    name = "sjf"
    summary = "SJF over prefills and decodes by estimated remaining work, fixed token budget"

    def key(self, r) -> float:
        return self.exec_time(r)
