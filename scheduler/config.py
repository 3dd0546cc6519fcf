"""Default priority classes and the tunables the paper leaves open.

The paper gives no values for γ, η, θ, α, μ, λ, w_p/w_d or the SLOs. The
choices below are documented where they are defined (``SlideBatching``,
``GoRouting``, ``OnlineCorrector``, ``GainConfig``); the per-class SLOs are
here:

* two classes as in §5.1: ``high`` (weight 2) and ``low`` (weight 1), each
  request tagged at random 50/50;
* the same SLOs for both classes, so that only the weight differs (that is the
  paper's set-up: "each request ... randomly designated as high or low
  priority", with per-request SLOs not tied to the class);
* TTFT SLO 1.0 s: on the bundled 7B-class latency model a median Azure
  conversation prompt (1,020 tokens) prefills in ~0.1 s and the P99 prompt
  (4,142 tokens) in ~0.35 s, so 1 s is met without queueing and missed under
  contention — the regime the schedulers are about;
* TPOT SLO 0.1 s: a reading pace of ~10 tokens/s and the usual chat TPOT
  target in the SLO-scheduling literature (DistServe, SLOs-Serve use 0.1 s).
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from .request import ConfigError, PriorityClass

DEFAULT_TTFT_SLO = 1.0
DEFAULT_TPOT_SLO = 0.1


def default_classes() -> dict[str, PriorityClass]:
    return {
        "high": PriorityClass("high", 2.0, DEFAULT_TTFT_SLO, DEFAULT_TPOT_SLO),
        "low": PriorityClass("low", 1.0, DEFAULT_TTFT_SLO, DEFAULT_TPOT_SLO),
    }


def classes_from_dicts(items: Iterable[Mapping], where: str = "priority classes") -> dict[str, PriorityClass]:
    """Build classes from ``[{"name", "weight", "ttft_slo", "tpot_slo"}, ...]``."""
    out: dict[str, PriorityClass] = {}
    for i, d in enumerate(items):
        try:
            pc = PriorityClass(str(d["name"]), float(d["weight"]), float(d["ttft_slo"]), float(d["tpot_slo"]))
        except KeyError as e:
            raise ConfigError(f"{where}[{i}]: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}[{i}]: {e}") from None
        if pc.name in out:
            raise ConfigError(f"{where}[{i}]: duplicate class name {pc.name!r}")
        out[pc.name] = pc
    if not out:
        raise ConfigError(f"{where}: no classes defined")
    return out


def check_positive(where: str, **values: float) -> None:
    """Raise ConfigError naming the first value that is not > 0."""
    for k, v in values.items():
        if not isinstance(v, (int, float)) or v != v or v <= 0:
            raise ConfigError(f"{where}: {k} must be > 0, got {v!r}")


def check_in_range(where: str, name: str, v, lo: float, hi: float, lo_open: bool, hi_open: bool) -> float:
    """``v`` as a float if it is a number in the interval (lo/hi open or closed), else a
    ConfigError naming ``where``, ``name`` and the interval."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and v == v
    if ok:
        ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ConfigError(f"{where}: {name} must be a number in {rng}, got {v!r}")
    return float(v)


def parse_key_values(items, what: str) -> dict:
    """``["k=v", ...]`` from a repeatable command-line flag (``--global-param``,
    ``--local-param``, ``--policy-param``) as a dict; each value is read as JSON when
    it parses (numbers, booleans, lists), else kept as a string."""
    out = {}
    for it in items or []:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ConfigError(f"{what} expects KEY=VALUE, got {it!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out
