"""Local (engine-level) batch policies: SlideBatching and its ablations (§5.4).
The baselines are in :mod:`proserve.scheduler.baselines`, other papers' policies in
:mod:`proserve.scheduler.alternatives`. Importing this package registers these by name."""

import importlib
import pkgutil

from .base import COLOCATED, MODES, PREFILL_ONLY, BatchPlan, InstanceView, LocalPolicy, ScheduleInfo

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["COLOCATED", "MODES", "PREFILL_ONLY", "BatchPlan", "InstanceView", "LocalPolicy", "ScheduleInfo"]
