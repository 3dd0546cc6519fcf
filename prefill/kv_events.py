"""The worker's KV-cache event publisher (issue 14): vLLM's BlockStored / BlockRemoved /
AllBlocksCleared events, on a ZeroMQ PUB socket the dispatcher subscribes to
(:mod:`proserve.dispatcher.kv_events`), for its precise index of this worker's prefix cache.

``python -m proserve.prefill --kv-events-port PORT`` (default off) turns it on; the socket binds
the worker's ``--host`` (loopback by default) at PORT. With ``--kv-events-keys DIR`` (CURVE
server keys, the layout of ``python -m proserve.kvtransfer.keys DIR``: ``server.key_secret`` and
the admitted client public keys in ``DIR/clients/``) every subscriber is encrypted and
authenticated; without keys the worker refuses a non-loopback address (unless
``--kv-insecure``), as its KV transport does.

Why a ProServe publisher and not vLLM's own (``--kv-events-config`` with ``publisher = "zmq"``):
vLLM's :class:`~vllm.distributed.kv_events.ZmqEventPublisher` has no CURVE, binds only a
wildcard or ipc address (a host address makes it *connect*), and vLLM's config accepts only
the publishers ``null`` and ``zmq`` (a pydantic ``Literal``), so a publisher registered with
``EventPublisherFactory`` under another name cannot be selected. So the worker starts vLLM with
``kv_events_config = {"enable_kv_cache_events": true, "publisher": "null"}`` -- the block pool
collects the events, no vLLM socket is opened -- and the scheduler plugin
(:class:`~proserve.prefill.engine_scheduler.ProServeScheduler`, in the engine-core process)
replaces the scheduler's null publisher with :class:`CurveEventPublisher` (:func:`install`):
vLLM's own publisher thread and wire format (``[topic, seq as 8 bytes big-endian, msgpack
KVEventBatch]``), on a socket that binds where told, with CURVE server keys and a ZAP handler
admitting only the listed clients. Nothing unauthenticated is ever opened beyond loopback, and
no relay process is needed. The cost: it needs the plugin (``--local-policy`` other than
``off``; ``stock`` keeps vLLM's own scheduling decisions).

No replay endpoint: vLLM's ROUTER replay socket would be a second port to secure, and it cannot
help where gaps matter most (a restarted engine numbers from 0 again and its cache is empty).
The subscriber treats a sequence gap, a restart or a reconnection as "the index can no longer
be trusted" and starts it over (:mod:`proserve.dispatcher.kv_events`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import zmq

from proserve.scheduler.request import ConfigError

logger = logging.getLogger("proserve.prefill")

#: ``additional_config`` key of this publisher's settings (beside the plugin's ``"proserve"``)
CONFIG_KEY = "proserve_kv_events"
#: what ``--kv-events-port`` passes to vLLM: collect the events, open no socket of its own
VLLM_KV_EVENTS_CONFIG = {"enable_kv_cache_events": True, "publisher": "null"}
_KEYS = {"endpoint", "keys_dir", "insecure", "hwm", "buffer_steps"}


def endpoint_of(host: str, port: int) -> str:
    """``tcp://HOST:PORT`` (an IPv6 address in brackets)."""
    h = host.strip("[]")
    return f"tcp://[{h}]:{port}" if ":" in h else f"tcp://{h}:{port}"


def check_config(cfg: Any) -> dict:
    """The publisher's settings (``additional_config[CONFIG_KEY]``), checked: ConfigError naming
    the key otherwise; a non-loopback endpoint without keys needs ``insecure``."""
    from proserve.kvtransfer.auth import is_loopback
    where = f"additional_config.{CONFIG_KEY}"
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{where}: must be an object, got {type(cfg).__name__}")
    bad = sorted(set(map(str, cfg)) - _KEYS)
    if bad:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(bad)}; expected {', '.join(sorted(_KEYS))}")
    ep = cfg.get("endpoint")
    if not isinstance(ep, str) or not ep.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"{where}.endpoint: a ZeroMQ address like tcp://127.0.0.1:5557, got {ep!r}")
    keys = cfg.get("keys_dir")
    if keys is not None and (not isinstance(keys, str) or not keys):
        raise ConfigError(f"{where}.keys_dir: a directory, got {keys!r}")
    insecure = cfg.get("insecure", False)
    if not isinstance(insecure, bool):
        raise ConfigError(f"{where}.insecure: true or false, got {insecure!r}")
    for k, default in (("hwm", 100_000), ("buffer_steps", 1)):
        v = cfg.get(k, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{where}.{k}: an integer >= 1, got {v!r}")
    if keys is None and not insecure and not is_loopback(ep):
        raise ConfigError(f"{where}.endpoint {ep} is not a loopback address and no CURVE keys are given "
                          f"(keys_dir): anyone who can reach it could read this worker's prompts' token ids")
    return dict(cfg)


def _publisher_class():
    from proserve.kvtransfer.auth import ServerKeys
    from proserve.kvtransfer.common import Stats
    from proserve.kvtransfer.receiver import _ZapHandler  # the KV receiver's ZAP handler, reused

    from .vllm_shim import event_publisher_base
    ZmqEventPublisher = event_publisher_base()      # UnsupportedVLLM (a ConfigError) when it changed

    class CurveEventPublisher(ZmqEventPublisher):
        """vLLM's ZMQ publisher (its thread, queue, sequence numbers and encoding), on a PUB
        socket of its own context that always binds ``endpoint`` and, with ``keys_dir``, is a
        CURVE server admitting only the client keys in ``keys_dir/clients`` (ZAP, fail closed).
        No replay socket (see the module doc)."""

        def __init__(self, data_parallel_rank: int = 0, *, endpoint: str, keys_dir: str | None = None,
                     hwm: int = 100_000, buffer_steps: int = 1, **_: Any) -> None:
            self._curve = ServerKeys.load(keys_dir) if keys_dir else None   # KeysError names the file
            self._zap = None
            super().__init__(data_parallel_rank, endpoint=endpoint, replay_endpoint=None,
                             buffer_steps=buffer_steps, hwm=hwm)

        def _socket_setup(self) -> None:
            self._ctx = zmq.Context()           # ZAP is per context: not the process-wide instance
            if self._curve is not None:
                self._zap = _ZapHandler(self._ctx, self._curve.allowed_clients, Stats("auth_failures"),
                                        "kv-events")
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.set_hwm(self._hwm)
            if self._curve is not None:
                pub.curve_server = True
                pub.curve_publickey = self._curve.public
                pub.curve_secretkey = self._curve.secret
                pub.setsockopt(zmq.ZAP_DOMAIN, b"proserve-kv-events")
                pub.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            if "[" in self._endpoint:
                pub.setsockopt(zmq.IPV6, 1)
            try:
                pub.bind(self._endpoint)
            except zmq.ZMQError as e:
                pub.close(0)
                raise ConfigError(f"KV events: cannot bind {self._endpoint}: {e}") from None
            self._pub = pub

        def shutdown(self) -> None:
            super().shutdown()
            if self._zap is not None:
                self._zap.stop()
            self._ctx.destroy(linger=0)

    return CurveEventPublisher


def make_publisher(cfg: Mapping):
    """A :class:`CurveEventPublisher` for checked settings (:func:`check_config`)."""
    cfg = check_config(cfg)
    return _publisher_class()(0, endpoint=cfg["endpoint"], keys_dir=cfg.get("keys_dir"),
                              hwm=cfg.get("hwm", 100_000), buffer_steps=cfg.get("buffer_steps", 1))


def install(scheduler, cfg: Any) -> None:
    """In the engine-core process, after vLLM's ``Scheduler.__init__``: with settings ``cfg``
    (None: off), replace the scheduler's publisher (vLLM's null one) by a
    :class:`CurveEventPublisher`. ConfigError when vLLM does not collect KV events (the
    worker passes ``--kv-events-config``; see :data:`VLLM_KV_EVENTS_CONFIG`)."""
    if cfg is None:
        return
    cfg = check_config(cfg)
    from .vllm_shim import kv_events_enabled, swap_event_publisher
    if not kv_events_enabled(scheduler):
        raise ConfigError(f"additional_config.{CONFIG_KEY} is set but vLLM collects no KV cache events: "
                          f"start it with --kv-events-config '{{\"enable_kv_cache_events\": true, "
                          f"\"publisher\": \"null\"}}'")
    old = swap_event_publisher(scheduler, make_publisher(cfg))
    if old is not None:
        old.shutdown()
    logger.info("KV cache events published on %s (%s)", cfg["endpoint"],
                "CURVE" if cfg.get("keys_dir") else "no authentication: loopback only"
                if not cfg.get("insecure") else "no authentication (--kv-insecure)")
