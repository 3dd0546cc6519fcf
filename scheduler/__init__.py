"""ProServe's policy core: pure Python, no engine, network or file I/O.

* :mod:`proserve.scheduler.request`   — the request model
* :mod:`proserve.scheduler.tdg`       — TDG gain (Eq. 3) and the §5.1 metrics
* :mod:`proserve.scheduler.estimator` — batch latency estimator (Eq. 4-7) with online β
* :mod:`proserve.scheduler.local`     — SlideBatching (Alg. 1) and its §5.4 ablations
* :mod:`proserve.scheduler.routing`   — GoRouting (Alg. 2)
* :mod:`proserve.scheduler.baselines` — the paper's baselines, local and global (§3.2, §5.1)
* :mod:`proserve.scheduler.alternatives` — other papers' schedulers, one subpackage per paper
* :mod:`proserve.scheduler.validate`  — the value checks every configuration uses
* :mod:`proserve.scheduler.registry`  — choose any policy by name
"""

from . import alternatives, baselines, local, routing  # noqa: F401  (registers the policies)
from .config import default_classes
from .estimator import BatchSample, Estimator, LatencyModel, OnlineCorrector
from .registry import global_names, local_names, make_global, make_local
from .request import ConfigError, Phase, PriorityClass, Request
from .tdg import GainConfig, summarize

__all__ = [
    "BatchSample", "ConfigError", "Estimator", "GainConfig", "LatencyModel", "OnlineCorrector",
    "Phase", "PriorityClass", "Request", "default_classes", "global_names", "local_names",
    "make_global", "make_local", "summarize",
]
