"""Round-robin: the healthy prefill instance after the last one chosen, in id order."""

from __future__ import annotations

from ..registry import register_global
from ..routing.base import DISAGGREGATED, GlobalPolicy


@register_global
class RoundRobin(GlobalPolicy):
    name = "round_robin"
    summary = "Round-robin over the healthy prefill instances (by id)"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0):
        super().__init__(gain, classes, deployment, seed)
        self._last: int | None = None

    def select_prefill(self, req, prefills, now):
        # next id after the last chosen one, wrapping; robust to instances leaving or rejoining
        ordered = sorted(prefills, key=lambda p: p.id)
        nxt = ordered[0]
        if self._last is not None:
            nxt = next((p for p in ordered if p.id > self._last), ordered[0])
        self._last = nxt.id
        return nxt
