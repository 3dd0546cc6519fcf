"""JITServe GMAX with its output-length predictor made perfect: ``len_rem(r)`` is the true
number of tokens still to come instead of the online bound (§4.1). A clairvoyant reference
for the simulator only (see :mod:`proserve.scheduler.local.slide_batching_oracle`)."""

from __future__ import annotations

from ...registry import register_local
from .gmax import GMAX


@register_local
class GMAXOracle(GMAX):
    name = "jitserve_gmax_oracle"
    summary = "simulator only: JITServe GMAX that knows each request's true output length"
    clairvoyant = True

    def _len_rem(self, r, n: int) -> float:
        return max(r.output_len - n, 0)
