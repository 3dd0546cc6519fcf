"""The scheduler plugin's configuration (``additional_config["proserve"]``),
checked and turned into policy objects without importing vLLM, so the worker
launcher can reject a bad flag before starting an engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from proserve.scheduler import registry, validate
from proserve.scheduler.config import classes_from_dicts, default_classes
from proserve.scheduler.estimator import SCALE_OFFSET, Estimator, LatencyModel, OnlineCorrector
from proserve.scheduler.local.base import MODES, PREFILL_ONLY, LocalPolicy
from proserve.scheduler.request import ConfigError, PriorityClass
from proserve.scheduler.tdg import GainConfig

from .params import default_class_of

STOCK = "stock"


@dataclass
class EngineConfig:
    """``additional_config["proserve"]`` of the engine.

    local_policy    a name from ``scheduler.registry.local_names()``, or "stock"
    mode            "prefill_only" (disaggregated prefill instance, φ_p) or
                    "colocated" (prefill chunks and decodes share batches)
    latency_model   path of a latency-model JSON (``python -m proserve.profiler``'s output)
    policy_params   keyword arguments of the policy, e.g. {"gamma": 1.0, "phi": "c"}
    classes         [{"name", "weight", "ttft_slo", "tpot_slo"}, ...] (default high/low)
    default_class   class of requests that name none (default: the lowest weight)
    w_p, w_d        TDG token weights (Eq. 3); deadline "fixed" | "ttft_anchored"
    theta, window_s online correction (β) momentum and window
    correction      "scale_offset" (default: β and a per-step offset δ) or "scale"
                    (the paper's β alone); see scheduler.estimator.OnlineCorrector
    record_steps    path of a JSONL file that gets one line per step (profiling, benchmarks)
    publish_queue   ZeroMQ address on which to publish the queued prefill work for several
                    dispatchers (issue 15, :mod:`proserve.prefill.queue_publisher`); None: off
    publish_interval_s, publish_keys, publish_insecure
                    its interval, CURVE key directory, and leave to go without keys beyond loopback
    """

    local_policy: str = "slide_batching"
    mode: str = PREFILL_ONLY
    latency_model: str | None = None
    policy_params: dict = field(default_factory=dict)
    classes: list | None = None
    default_class: str | None = None
    w_p: float = 1.0
    w_d: float = 1.0
    deadline: str = "fixed"
    theta: float = 0.8
    window_s: float = 1.0
    correction: str = SCALE_OFFSET
    record_steps: str | None = None
    publish_queue: str | None = None
    publish_interval_s: float = 0.1
    publish_keys: str | None = None
    publish_insecure: bool = False

    @classmethod
    def from_dict(cls, d: dict | None) -> "EngineConfig":
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"additional_config.proserve: unknown key(s) {', '.join(bad)}; "
                              f"known: {', '.join(sorted(known))}")
        cfg = cls(**d)
        where = "additional_config.proserve"
        validate.one_of(where, "mode", cfg.mode, MODES)
        if cfg.local_policy != STOCK:
            registry.local_policy(cfg.local_policy)  # raises ConfigError listing the names
            if registry.is_clairvoyant(cfg.local_policy):
                validate.fail(where, "local_policy", "a policy an engine can run (clairvoyant ones read the "
                              "true output length, which only the simulator knows)", cfg.local_policy)
        if not isinstance(cfg.policy_params, dict):
            validate.fail(where, "policy_params", "an object", cfg.policy_params)
        if cfg.publish_queue is not None:
            from .queue_publisher import check_address
            validate.positive(where, "publish_interval_s", cfg.publish_interval_s)
            try:
                check_address(cfg.publish_queue, cfg.publish_keys, bool(cfg.publish_insecure))
            except ValueError as e:
                raise ConfigError(f"{where}: publish_queue: {e}") from None
        return cfg


@dataclass
class Parts:
    classes: dict[str, PriorityClass]
    default_class: str
    estimator: Estimator
    gain: GainConfig
    policy: LocalPolicy | None     # None: vLLM's own decisions ("stock")


def load_model(path: str | None) -> LatencyModel:
    from proserve.profiler import modelfile  # file I/O stays out of scheduler/
    return modelfile.load(path or modelfile.CPU_TINY)


def build(cfg: EngineConfig, model: LatencyModel | None = None) -> Parts:
    """The objects the plugin runs; bad values raise ConfigError naming them."""
    where = "additional_config.proserve"
    classes = classes_from_dicts(cfg.classes, f"{where}.classes") if cfg.classes else default_classes()
    default = validate.one_of(where, "default_class", cfg.default_class or default_class_of(classes), classes)
    est = Estimator(model or load_model(cfg.latency_model),
                    OnlineCorrector(cfg.theta, cfg.window_s, mode=cfg.correction))
    gain = GainConfig(w_p=cfg.w_p, w_d=cfg.w_d, deadline=cfg.deadline)
    policy = None if cfg.local_policy == STOCK else registry.make_local(
        cfg.local_policy, est, gain, classes, **cfg.policy_params)
    return Parts(classes, default, est, gain, policy)


def check(cfg: Mapping, classes: Mapping[str, PriorityClass] | None = None) -> None:
    """Raise ConfigError if the engine would reject ``cfg`` (used by the launcher before exec)."""
    c = EngineConfig.from_dict(dict(cfg))
    # a stand-in model: only the policy's own parameter checks matter here, the
    # latency-model file is loaded (and its errors reported) by the launcher
    build(c, model=LatencyModel(1e-9, 1e-9, 1e-6, 1e-7, 1e-4, 1e-3))
