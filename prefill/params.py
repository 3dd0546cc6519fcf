"""Per-request scheduling parameters: priority class, weight, SLOs.

They travel with the request in vLLM's sampling-params extra args — the
``vllm_xargs`` object of an OpenAI-API request body::

    {"prompt": [...], "max_tokens": 64,
     "vllm_xargs": {"priority_class": "high", "ttft_slo": 0.5, "tpot_slo": 0.05}}

=================  ======================================================  =========
key                meaning                                                 default
=================  ======================================================  =========
priority_class     name of a configured class (``high``/``low`` unless     the
                   ``--classes`` says otherwise)                            default class
weight             w_{p(r)} (> 0)                                          the class's
ttft_slo           TTFT SLO in seconds (> 0)                               the class's
tpot_slo           TPOT SLO in seconds (> 0)                               the class's
arrival_time       when the request reached the system (Unix seconds),     engine arrival
                   e.g. the dispatcher's clock; deadlines count from it
=================  ======================================================  =========

:func:`parse` is the one place these are read and checked. The engine calls it
twice: in the API server, before the request is queued (through
:class:`ParamsValidator`, vLLM's hook for validating extra args: a
``ValueError`` there becomes an HTTP 400 naming the field), and in the
scheduler plugin when the request arrives.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from proserve.scheduler import validate
from proserve.scheduler.config import classes_from_dicts, default_classes
from proserve.scheduler.request import ConfigError, PriorityClass

KEYS = ("priority_class", "weight", "ttft_slo", "tpot_slo", "arrival_time")
#: environment variable through which the worker hands the class table to the
#: API-server process (the validator has no access to the engine config)
CLASSES_ENV = "PROSERVE_CLASSES"
DEFAULT_CLASS_ENV = "PROSERVE_DEFAULT_CLASS"


class ParamsError(ValueError):
    """A request's scheduling parameters are invalid; the message names the field."""


@dataclass(frozen=True)
class RequestParams:
    priority: str
    weight: float
    ttft_slo: float
    tpot_slo: float
    arrival_time: float | None = None


def _number(key: str, v: Any, positive: bool = True) -> float:
    """``vllm_xargs.<key>`` as a finite float (> 0 if ``positive``); a bad value raises
    :class:`ParamsError`, which the API server answers with HTTP 400."""
    if isinstance(v, str):
        # the OpenAI server passes vllm_xargs values through as JSON types; accept numeric strings too
        try:
            v = float(v)
        except ValueError:
            pass   # not a number: the check below names it
    name = f"vllm_xargs.{key}"
    if positive:
        return validate.positive("", name, v, error=ParamsError)
    return validate.number("", name, v, error=ParamsError)


def parse(extra_args: Mapping[str, Any] | None, classes: Mapping[str, PriorityClass],
          default_class: str) -> RequestParams:
    """Resolve a request's class, weight and SLOs; raise :class:`ParamsError` naming the bad field."""
    xa = extra_args or {}
    name = xa.get("priority_class", default_class)
    validate.one_of("", "vllm_xargs.priority_class", name, sorted(classes), error=ParamsError)
    pc = classes[name]
    weight = _number("weight", xa["weight"]) if "weight" in xa else pc.weight
    ttft = _number("ttft_slo", xa["ttft_slo"]) if "ttft_slo" in xa else pc.ttft_slo
    tpot = _number("tpot_slo", xa["tpot_slo"]) if "tpot_slo" in xa else pc.tpot_slo
    arrival = _number("arrival_time", xa["arrival_time"]) if "arrival_time" in xa else None
    return RequestParams(name, weight, ttft, tpot, arrival)


def classes_to_env(classes: Mapping[str, PriorityClass]) -> str:
    return json.dumps([{"name": c.name, "weight": c.weight, "ttft_slo": c.ttft_slo, "tpot_slo": c.tpot_slo}
                       for c in classes.values()])


def classes_from_env() -> tuple[dict[str, PriorityClass], str]:
    """The class table and default class the worker put in the environment (or the defaults)."""
    raw = os.environ.get(CLASSES_ENV)
    classes = classes_from_dicts(json.loads(raw), CLASSES_ENV) if raw else default_classes()
    default = os.environ.get(DEFAULT_CLASS_ENV) or default_class_of(classes)
    if default not in classes:
        raise ConfigError(f"{DEFAULT_CLASS_ENV}={default!r} is not a configured class")
    return classes, default


def default_class_of(classes: Mapping[str, PriorityClass]) -> str:
    """Requests that name no class get the lowest-weight one: an untagged client is
    never served ahead of one that paid for priority."""
    return min(classes.values(), key=lambda c: c.weight).name


def _processor_bases() -> tuple[type, ...]:
    """vLLM's logits-processor interfaces present here: the V1 model runner's
    (``vllm.v1.sample.logits_processor``) and Model Runner V2's
    (``vllm.v1.worker.gpu.sample.logits_processor``), which vLLM 0.32 uses by default on
    CUDA (where Triton is) and whose loader refuses any class not derived from its own
    interface. The validator derives from both, so either runner loads it."""
    bases = []
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessor as V1
        bases.append(V1)
    except Exception:  # pragma: no cover - vLLM absent, or a vLLM without the V1 interface
        pass
    try:
        from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2
        bases.append(V2)
    except Exception:  # pragma: no cover - a vLLM without Model Runner V2's interface
        pass
    return tuple(bases) or (object,)


class ParamsValidator(*_processor_bases()):
    """Rejects bad ``vllm_xargs`` in the API server, before the request is queued.

    vLLM calls ``validate_params`` of every registered logits processor while
    processing a request's input; a ``ValueError`` becomes HTTP 400 with the
    message. The processor itself never changes logits: ``apply`` returns them
    unchanged; to the V1 runner it declares itself argmax-invariant (skipped for
    greedy batches), to Model Runner V2 it takes no request (``add_request``).
    """

    _table: tuple[dict[str, PriorityClass], str] | None = None

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        if cls._table is None:
            cls._table = classes_from_env()
        parse(getattr(sampling_params, "extra_args", None), *cls._table)

    def __init__(self, *args, **kwargs):
        # V1: (vllm_config, device, is_pin_memory); V2: (vllm_config, req_states)
        pass

    def is_argmax_invariant(self) -> bool:           # V1
        return True

    def update_state(self, batch_update) -> None:    # V1
        pass

    def add_request(self, req_idx: int, sampling_params) -> bool:   # V2: modifies no request's logits
        return False

    def apply(self, logits, ctx=None):               # V1: (logits); V2: (logits, ctx)
        return logits
