"""Local (engine-level) batch policies: SlideBatching, the paper's baselines
and ablations. Importing this package registers all of them by name."""

import importlib
import pkgutil

from .base import COLOCATED, MODES, PREFILL_ONLY, BatchPlan, InstanceView, LocalPolicy, ScheduleInfo

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["COLOCATED", "MODES", "PREFILL_ONLY", "BatchPlan", "InstanceView", "LocalPolicy", "ScheduleInfo"]
