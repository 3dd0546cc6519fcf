"""JITServe (Zhang, Wu et al., NSDI 2026; Concord/CALM in Wu's 2025 MS thesis):
GMAX locally (:mod:`.gmax`), power-of-K across replicas (:mod:`.power_of_k`),
the online output-length bound both use (:mod:`.length_bound`) and the paper's
token goodput (:mod:`.metrics`)."""

from . import gmax, gmax_oracle, power_of_k  # noqa: F401  (registers the policies)
