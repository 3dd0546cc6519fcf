"""Policy registries: every local and global policy is chosen by name.

Policies register themselves with :func:`register_local` / :func:`register_global`
when their module is imported; ``proserve.scheduler.local`` and ``proserve.scheduler.routing``
import all of theirs, so ``make_local("slide_batching", ...)`` works after
``import scheduler``.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from .request import ConfigError

_LOCAL: dict[str, type] = {}
_GLOBAL: dict[str, type] = {}

T = TypeVar("T", bound=type)


def _register(table: dict[str, type], kind: str) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        name = getattr(cls, "name", "")
        if not name:
            raise TypeError(f"{cls.__name__} has no 'name'")
        if name in table and table[name] is not cls:
            raise TypeError(f"{kind} policy {name!r} registered twice")
        table[name] = cls
        return cls
    return deco


register_local = _register(_LOCAL, "local")
register_global = _register(_GLOBAL, "global")


def _lookup(table: dict[str, type], kind: str, name: str) -> type:
    try:
        return table[name]
    except KeyError:
        raise ConfigError(f"unknown {kind} policy {name!r}; choose one of: {', '.join(sorted(table))}") from None


def local_policy(name: str) -> type:
    return _lookup(_LOCAL, "local", name)


def is_clairvoyant(name: str) -> bool:
    """A clairvoyant policy reads ``Request.output_len`` as the true output length, which
    only the simulator knows (an engine has ``max_tokens`` there): a reference for how far
    from the limit a real policy is, never one to serve with."""
    return bool(getattr(_LOCAL.get(name), "clairvoyant", False))


def global_policy(name: str) -> type:
    return _lookup(_GLOBAL, "global", name)


def local_names(clairvoyant: bool = False) -> list[str]:
    """The local policies an engine may run; ``clairvoyant=True`` adds the simulator-only
    references (:func:`is_clairvoyant`)."""
    return sorted(n for n in _LOCAL if clairvoyant or not is_clairvoyant(n))


def router_order(name: str) -> str:
    """The queue order GoRouting's schedule-aware estimate assumes for an instance running
    local policy ``name`` (``LocalPolicy.router_order``); "deadline", the paper's estimate,
    for a name outside the registry (vLLM's own scheduling)."""
    cls = _LOCAL.get(name)
    return getattr(cls, "router_order", "deadline") if cls is not None else "deadline"


def global_names() -> list[str]:
    return sorted(_GLOBAL)


def make_local(name: str, estimator, gain=None, classes=None, **params):
    """Instantiate local policy ``name``; bad parameters raise ConfigError."""
    cls = local_policy(name)
    try:
        return cls(estimator, gain, classes, **params)
    except TypeError as e:
        raise ConfigError(f"local policy {name!r}: {e}") from None


def make_global(name: str, **params):
    cls = global_policy(name)
    try:
        return cls(**params)
    except TypeError as e:
        raise ConfigError(f"global policy {name!r}: {e}") from None
