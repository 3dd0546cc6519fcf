"""Workloads for the simulator and the load generator.

* :mod:`proserve.bench.traces`    — trace loaders (Azure, BurstGPT, Mooncake, ShareGPT)
  returning :class:`TraceRecord` lists
* :mod:`proserve.bench.workloads` — synthetic workloads, arrival scaling (§5.1),
  priority tagging and :func:`build_workload`, which the simulator CLI calls
"""

from .traces import (
    FORMATS,
    TraceError,
    TraceRecord,
    load_azure,
    load_burstgpt,
    load_mooncake,
    load_sharegpt,
    load_trace,
    sniff_format,
)
from .workloads import (
    ARRIVALS,
    LengthDist,
    assign_arrivals,
    build_workload,
    fit_to_context,
    poisson_arrivals,
    scale_to_rate,
    synthetic,
    tag_priorities,
)

__all__ = [
    "ARRIVALS", "FORMATS", "LengthDist", "TraceError", "TraceRecord", "assign_arrivals",
    "build_workload", "fit_to_context", "load_azure", "load_burstgpt", "load_mooncake",
    "load_sharegpt", "load_trace", "poisson_arrivals", "scale_to_rate", "sniff_format",
    "synthetic", "tag_priorities",
]
