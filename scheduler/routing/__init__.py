"""Global (service-level) routing: GoRouting (Algorithm 2), the interface every
router implements and the PrefillQueueMap estimates. The baselines are in
:mod:`proserve.scheduler.baselines`, other papers' routers in :mod:`proserve.scheduler.alternatives`.
Importing this package registers GoRouting by name."""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "queue_map", "estimates"):
        importlib.import_module(f"{__name__}.{_m.name}")
