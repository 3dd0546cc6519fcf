"""Random: a uniformly random healthy prefill instance (seeded, reproducible)."""

from __future__ import annotations

from ..registry import register_global
from ..routing.base import DISAGGREGATED, GlobalPolicy


@register_global
class RandomSelect(GlobalPolicy):
    name = "random"
    summary = "Uniformly random prefill instance (seeded)"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0):
        super().__init__(gain, classes, deployment, seed)

    def select_prefill(self, req, prefills, now):
        return prefills[self.rng.randrange(len(prefills))]
