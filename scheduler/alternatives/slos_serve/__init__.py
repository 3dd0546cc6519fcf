"""SLOs-Serve (Chen et al.): the local policy (:mod:`.local`), its multi-replica
router (:mod:`.routing`), the roofline batch model and DP admission both use
(:mod:`.model`) and the paper's SLO attainment (:mod:`.metrics`)."""

from . import local, routing  # noqa: F401  (registers the policies)
