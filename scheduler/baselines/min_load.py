"""Min-Load (§5.1 baseline): the instance with the least predicted queued prefill time.

The load is ESTIMATEEXEC(p) exactly as GoRouting computes it (φ_p with
timestamp lag compensation; φ_a with the decode load ``n_d·b_d`` when
co-located; :mod:`proserve.scheduler.routing.estimates`), so a comparison of the two
isolates GoRouting's gain candidates and dual thresholds from the quality of
the load estimate. Ties go to the lowest instance id.
"""

from __future__ import annotations

from ..registry import register_global
from ..routing.base import DISAGGREGATED, GlobalPolicy
from ..routing.estimates import evaluate, resolve_eta


@register_global
class MinLoad(GlobalPolicy):
    name = "min_load"
    summary = "Min-Load: least predicted queued prefill time (GoRouting's ESTIMATEEXEC)"

    def __init__(self, gain=None, classes=None, deployment: str = DISAGGREGATED, seed: int = 0,
                 eta: float | None = None):
        super().__init__(gain, classes, deployment, seed)
        self.eta = resolve_eta(eta, self.classes, self.name)

    def select_prefill(self, req, prefills, now):
        gain, dep, eta = self.gain, self.deployment, self.eta
        return min(prefills, key=lambda p: (evaluate(p, req, now, gain, dep, eta, with_gain=False).exec,
                                            p.n_decode, p.id))
