"""The baselines the PROSERVE paper measures SlideBatching and GoRouting against
(§3.2 and §5.1), local and global: vLLM-FCFS, Sarathi-FCFS/-Priority, EDF, SJF,
FairBatching and weighted VTC; Min-Load, round-robin and random routing.
Importing this package registers all of them by name."""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
