"""UniBoost (Li et al., "Beyond Prediction: Tail-Aware Scheduling for LLM
Inference"): the local policy (:mod:`.local`), its boost function, MemGuard bins
and adaptive γ (:mod:`.bins`) and the paper's P99 TTLT (:mod:`.metrics`)."""

from . import local  # noqa: F401  (registers the policy)
