"""Global (service-level) routing policies: GoRouting and its baselines.
Importing this package registers all of them by name."""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "queue_map", "estimates"):
        importlib.import_module(f"{__name__}.{_m.name}")
