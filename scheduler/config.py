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

from . import validate
from .request import ConfigError, PriorityClass

DEFAULT_TTFT_SLO = 1.0
DEFAULT_TPOT_SLO = 0.1


def default_classes() -> dict[str, PriorityClass]:
    return {
        "high": PriorityClass("high", 2.0, DEFAULT_TTFT_SLO, DEFAULT_TPOT_SLO),
        "low": PriorityClass("low", 1.0, DEFAULT_TTFT_SLO, DEFAULT_TPOT_SLO),
    }


def classes_from_dicts(items: Iterable[Mapping], where: str = "priority classes") -> dict[str, PriorityClass]:
    """Build classes from ``[{"name", "weight", "ttft_slo", "tpot_slo"}, ...]`` (an entry's
    optional ``on_overload`` is read by :func:`overload_actions_from_dicts`)."""
    out: dict[str, PriorityClass] = {}
    for i, d in enumerate(items):
        try:
            pc = PriorityClass(str(d["name"]), d["weight"], d["ttft_slo"], d["tpot_slo"])
        except KeyError as e:
            raise ConfigError(f"{where}[{i}]: missing field {e.args[0]!r}") from None
        except TypeError:   # not a mapping
            validate.fail("", f"{where}[{i}]", "an object with name, weight, ttft_slo and tpot_slo", d)
        except ConfigError as e:
            raise ConfigError(f"{where}[{i}]: {e}") from None
        if pc.name in out:
            raise ConfigError(f"{where}[{i}]: duplicate class name {pc.name!r}")
        out[pc.name] = pc
    if not out:
        raise ConfigError(f"{where}: no classes defined")
    return out


def overload_actions_from_dicts(items: Iterable[Mapping], where: str = "priority classes") -> dict[str, str]:
    """The ``on_overload`` action (queue | reject | downgrade, see
    :mod:`proserve.scheduler.admission`) of each class entry that names one; checked
    against the classes by ``AdmissionConfig.check``."""
    from .admission import ACTIONS
    out: dict[str, str] = {}
    for i, d in enumerate(items):
        if isinstance(d, Mapping) and d.get("on_overload") is not None:
            out[str(d.get("name"))] = validate.one_of("", f"{where}[{i}].on_overload", d["on_overload"], ACTIONS)
    return out


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
