"""The one family of value checks every configuration surface uses.

Policy parameters, simulator and dispatcher configs, workload specs and the
per-request ``vllm_xargs`` all check their numbers, counts and choices here,
so every error reads the same way::

    <where>: <name> must be <requirement>, got <value!r>

``where`` names the surface (``"slide_batching"``, ``"config.toml"``,
``"vllm_xargs"``; empty for none) and ``name`` the field. Booleans are never
numbers, NaN never passes, and infinities pass only where a bound allows them
(``allow_inf``). Each check returns the value in its canonical type, so a
caller can validate and convert in one line. ``error`` picks the exception
class (default :class:`ConfigError`; the request parser passes its own so a bad
request maps to HTTP 400). Checks that relate two fields (``mu <= lam``) stay
with their caller and raise through :func:`fail` where the wording fits.

``ConfigError`` lives here, not in :mod:`proserve.scheduler.request`, so that the
request model can use these checks without an import cycle;
``proserve.scheduler.request.ConfigError`` is the same class.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any, NoReturn

__all__ = ["ConfigError", "boolean", "fail", "fraction", "integer", "non_negative", "number", "one_of",
           "positive", "text"]


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the bad value."""


def fail(where: str, name: str, requirement: str, v: Any, error: type[Exception] = ConfigError) -> NoReturn:
    """Raise ``error`` with the family's message."""
    head = f"{where}: {name}" if where else name
    raise error(f"{head} must be {requirement}, got {v!r}")


def _as_float(v: Any) -> float:
    """``v`` as a float if it is a real number (not a bool), else NaN."""
    t = type(v)
    if t is float:              # the common case first, without the slower ABC check
        return v
    if t is int or (t is not bool and isinstance(v, numbers.Real)):
        try:
            return float(v)
        except OverflowError:   # an integer too large for a float
            return math.nan
    return math.nan


def _bound(x: float) -> str:
    """A bound as people write it: whole numbers in full (3600000, not 3.6e+06), others as ``:g``."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool, noun: str) -> str:
    if lo is not None and hi is not None:
        return f"{noun} in {'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{noun} {'>' if lo_open else '>='} {_bound(lo)}"
    if hi is not None:
        return f"{noun} {'<' if hi_open else '<='} {_bound(hi)}"
    return noun


def number(where: str, name: str, v: Any, lo: float | None = None, hi: float | None = None, *,
           lo_open: bool = False, hi_open: bool = False, allow_inf: bool = False,
           error: type[Exception] = ConfigError) -> float:
    """``v`` as a float if it is a real number in the interval, else ``error``."""
    f = _as_float(v)
    ok = not math.isnan(f) and (allow_inf or math.isfinite(f))
    if ok and lo is not None:
        ok = f > lo if lo_open else f >= lo
    if ok and hi is not None:
        ok = f < hi if hi_open else f <= hi
    if not ok:
        fail(where, name, _interval(lo, hi, lo_open, hi_open, "a number"), v, error)
    return f


def positive(where: str, name: str, v: Any, *, allow_inf: bool = False,
             error: type[Exception] = ConfigError) -> float:
    """A number > 0."""
    return number(where, name, v, 0, lo_open=True, allow_inf=allow_inf, error=error)


def non_negative(where: str, name: str, v: Any, *, allow_inf: bool = False,
                 error: type[Exception] = ConfigError) -> float:
    """A number >= 0."""
    return number(where, name, v, 0, allow_inf=allow_inf, error=error)


def fraction(where: str, name: str, v: Any, *, error: type[Exception] = ConfigError) -> float:
    """A number in [0, 1]."""
    return number(where, name, v, 0, 1, error=error)


def integer(where: str, name: str, v: Any, lo: int | None = 1, hi: int | None = None, *,
            error: type[Exception] = ConfigError) -> int:
    """``v`` as an int if it is an integer (not a bool, not a float) in [lo, hi]; by
    default an integer >= 1 (counts, token budgets, windows)."""
    ok = type(v) is int or (not isinstance(v, bool) and isinstance(v, numbers.Integral))
    if ok and lo is not None:
        ok = v >= lo
    if ok and hi is not None:
        ok = v <= hi
    if not ok:
        fail(where, name, _interval(lo, hi, False, False, "an integer"), v, error)
    return int(v)


def one_of(where: str, name: str, v: Any, choices: Iterable[Any], *,
           error: type[Exception] = ConfigError) -> Any:
    """``v`` if it is one of ``choices``."""
    choices = tuple(choices)
    try:
        ok = v in choices
    except TypeError:   # unhashable against a set-like choice
        ok = False
    if not ok:
        fail(where, name, "one of " + ", ".join(str(c) for c in choices), v, error)
    return v


def boolean(where: str, name: str, v: Any, *, error: type[Exception] = ConfigError) -> bool:
    """``v`` if it is ``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(v, bool):
        fail(where, name, "true or false", v, error)
    return v


def text(where: str, name: str, v: Any, *, error: type[Exception] = ConfigError) -> str:
    """A non-empty string."""
    if not isinstance(v, str) or not v:
        fail(where, name, "a non-empty string", v, error)
    return v
