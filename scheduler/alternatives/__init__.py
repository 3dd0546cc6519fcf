"""Other papers' schedulers, one subpackage per paper, each with its local
policy, its router where the paper has one, the models they share and the
paper's own headline metric (so a policy is judged on its paper's terms as well
as on TDG):

* :mod:`proserve.scheduler.alternatives.jitserve`   -- JITServe / Concord: GMAX, power-of-K,
  the online length bound, token goodput;
* :mod:`proserve.scheduler.alternatives.slos_serve` -- SLOs-Serve: DP admission and SLO-driven
  batch sizing, its router, the roofline batch model, SLO attainment;
* :mod:`proserve.scheduler.alternatives.uniboost`   -- UniBoost (tail-aware scheduling): γ-boost
  priorities, MemGuard bins, adaptive γ, P99 TTLT.

Importing this package registers their policies by name.
"""

from . import jitserve, slos_serve, uniboost  # noqa: F401
