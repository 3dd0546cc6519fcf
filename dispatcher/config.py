"""The dispatcher's configuration: instances, priority classes, gain weights,
routing policy, and the API-key table.

Two files, both TOML (``.toml``) or JSON (``.json``):

* the **cluster config** (``--config``)::

      [dispatcher]
      host = "127.0.0.1"            # loopback unless you mean it: another address needs --keys
      allow_open_access = false     # ... unless this is true (no client keys: anyone who reaches it)
      port = 8000
      global_policy = "go_routing"  # go_routing | min_load | round_robin | random | ...
      deployment = "disaggregated"  # or "colocated" (no decode pool: whole requests on one instance)
      # limits on what clients may send (defaults shown)
      max_body_mb = 16.0            # larger request bodies: 413 (checked before reading them)
      header_timeout_s = 10.0       # a connection must send its request headers within this
      body_timeout_s = 30.0         # ... and the whole body within this after them (else 408)
      max_concurrent = 1024         # requests admitted at once, overall (else 429 + Retry-After)
      max_concurrent_per_key = 256  # ... and per client of the keys file
      # admission control (scheduler/admission.py): per instance, at most this many requests /
      # prompt tokens waiting for prefill; a request finding every instance full gets 429 (default: no cap)
      max_queued_requests = 64
      max_queued_tokens = 65536
      # timeouts towards the workers
      stream_idle_timeout_s = 60.0  # longest silence between two events of an upstream stream
      request_timeout_s = 600.0     # a whole request (unstreamed: the only limit on its answer)
      health_timeout_s = 5.0        # a worker's /health (and /metrics scrape) must answer within this
      stream_queue_events = 64      # events buffered per stream before the upstream read waits
      shutdown_timeout_s = 30.0     # on SIGINT/SIGTERM, requests in progress get this long to finish
      worker_api_key_file = "worker.key"  # optional: the key the workers demand (relative: to this file)
      admin_key_file = "admin.key"  # optional: turns on the admin API (/admin/workers); default off
      worker_hosts = ["10.0.0.0/8", "*.proserve.svc.cluster.local"]   # optional: where workers added
                                    # at run time (admin API, discovery) may be: IPs, networks, DNS
                                    # names, *.suffix; every address of theirs is checked (default: anywhere)
      latency_model = "models/x.json"   # optional: for prefill workers added at run time
      prefix_index = true           # keep an index of each prefill worker's prefix cache from the
                                    # prompts routed there (issue 14); false: route as if none caches
      kv_events_keys = "secrets/kv-events"   # CURVE client keys for the workers' kv_events (client.key_secret,
                                    # server.key); required for a non-loopback kv_events address ...
      kv_events_insecure = false    # ... unless this is true (unauthenticated, on a trusted network)
      # several dispatchers in front of the same workers (issue 15): each reads every prefill
      # worker's queue publication ([[prefill]] publish) and so sees the others' dispatches
      publication_keys = "secrets/pub"   # CURVE client keys (client.key_secret, server.key); required
                                    # for a non-loopback publish address ...
      publication_insecure = false  # ... unless this is true (unauthenticated, on a trusted network)
      publication_interval_s = 0.1  # the workers' --publish-interval
      publication_stale_intervals = 5   # no publication for this many intervals: own view again
      [global_params]               # keyword arguments of the policy, e.g. alpha = 0.9
      [gain]                        # TDG weights (Eq. 3): w_p, w_d; deadline = "fixed" | "ttft_anchored"
      w_p = 1.0
      [[classes]]                   # priority classes; default: high w=2 / low w=1, TTFT 1 s, TPOT 0.1 s
      name = "high"; weight = 2.0; ttft_slo = 1.0; tpot_slo = 0.1
      on_overload = "queue"         # when no instance can meet a request's TTFT SLO: queue (default),
                                    # reject (429 + Retry-After) or downgrade (serve it in the next class down)
      [[prefill]]                   # prefill (or co-located) instances
      url = "http://127.0.0.1:8100"
      latency_model = "profiler/models/tiny-llama-cpu.json"   # optional; default: the bundled profile
      local_policy = "slide_batching"   # optional: the worker's --local-policy (the worker's default
                                        # shown); GoRouting's estimate assumes the order it serves in
      kv_events = "tcp://127.0.0.1:5557"   # optional: where it publishes its KV-cache events (its
                                        # --kv-events-port): its prefix index is then driven by them
      publish = "tcp://127.0.0.1:15700"  # optional: where it publishes its queued prefill work (its
                                        # --publish-queue-port), for several dispatchers (issue 15)
      [[decode]]
      url = "http://127.0.0.1:8200"
      kv_addr = "tcp://127.0.0.1:15600"   # where this decode worker receives KV (its --kv-listen)
      [[discover]]                  # dynamic membership (issue 15): the workers are the A/AAAA records
      role = "decode"               # of a name (a Kubernetes headless service), re-resolved every
      host = "decode.proserve.svc.cluster.local"   # interval_s; new addresses join, vanished ones are
      port = 8200                   # drained, then removed once idle. A failed or empty resolution
      kv_port = 15600               # keeps the current set. decode: kv_port (KV at tcp://ADDR:kv_port);
      interval_s = 10.0             # prefill: local_policy, latency_model as in [[prefill]], and
                                    # kv_events_port, publish_port (tcp://ADDR:port);
      scheme = "http"               # optional: timeout_s (resolution, default 5), name_prefix

  With ``admin_key_file`` set (``--admin-key-file``), the admin API adds, drains and
  removes workers at run time (``/admin/workers``; see :mod:`proserve.dispatcher.membership`);
  without it the admin routes answer 403. With discovery or the admin API a pool may start
  empty (no [[prefill]]/[[decode]]).

  Instances on other hosts are just other URLs and KV addresses (the workers
  refuse a non-loopback address without their API key and CURVE keys; see the
  README's security model).

  The worker key (``worker_api_key_file``, ``--worker-key-file``, or else the
  environment variable ``PROSERVE_WORKER_API_KEY``) is sent as
  ``Authorization: Bearer <key>`` on every call to a worker; start the workers
  with the same key (their ``--api-key-file``).

* the **keys file** (``--keys``) maps each API key to a client, its priority
  class and the SLO range it may ask for::

      [[keys]]
      key = "sk-acme-0001"
      client = "acme"
      class = "high"
      ttft_ms = [200, 10000]        # optional: allowed range of a request's slo.ttft_ms
      tpot_ms = [20, 1000]

Every error names the file and the entry (``cluster.toml: prefill[1].url: ...``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

from proserve.scheduler import validate
from proserve.scheduler.admission import AdmissionConfig
from proserve.scheduler.config import classes_from_dicts, default_classes, overload_actions_from_dicts
from proserve.scheduler.registry import local_names
from proserve.scheduler.request import ConfigError, PriorityClass
from proserve.scheduler.routing.base import COLOCATED, DEPLOYMENTS, DISAGGREGATED
from proserve.scheduler.tdg import GainConfig

#: SLOs above this are absurd for an interactive service and rejected as input errors
MAX_SLO_MS = 3_600_000.0
#: environment variable holding the worker key when no key file is configured
WORKER_KEY_ENV = "PROSERVE_WORKER_API_KEY"
#: the admin key (admin_key_file) must be at least this long
MIN_ADMIN_KEY_LEN = 16


#: a worker's --local-policy values that are not scheduler policies: vLLM's own scheduling
LOCAL_POLICIES_OUTSIDE_REGISTRY = ("stock", "off")


@dataclass
class PrefillSpec:
    url: str
    latency_model: str | None = None
    name: str = ""
    local_policy: str = "slide_batching"   # what the worker runs (its --local-policy default)
    kv_events: str = ""                    # its KV-cache event address (--kv-events-port); "": none
    publish: str = ""                      # its queue publication address (--publish-queue-port); "": none


@dataclass
class DecodeSpec:
    url: str
    kv_addr: str
    name: str = ""


@dataclass
class DiscoverSpec:
    """A DNS name whose A/AAAA records are workers of ``role`` (``[[discover]]``)."""

    role: str                               # "prefill" (or co-located) | "decode"
    host: str                               # the name resolved, e.g. a headless service
    port: int                               # the workers' HTTP port
    scheme: str = "http"
    interval_s: float = 10.0                # re-resolved this often
    timeout_s: float = 5.0                  # one resolution may take this long (else: a failure)
    kv_port: int | None = None              # decode: KV at tcp://ADDR:kv_port (its --kv-listen port)
    local_policy: str = "slide_batching"    # prefill: the workers' --local-policy
    latency_model: str | None = None        # prefill: their latency model (default: dispatcher-wide)
    name_prefix: str = ""                   # worker names: PREFIX + address (default: "<host>-")
    kv_events_port: int | None = None       # prefill: KV-cache events at tcp://ADDR:port (--kv-events-port)
    publish_port: int | None = None         # prefill: queue publications at tcp://ADDR:port (--publish-queue-port)


@dataclass
class KeyEntry:
    key: str
    client: str
    cls: str
    ttft_ms: tuple[float, float] | None = None
    tpot_ms: tuple[float, float] | None = None


@dataclass
class DispatcherConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    global_policy: str = "go_routing"
    global_params: dict = field(default_factory=dict)
    deployment: str = DISAGGREGATED
    classes: dict[str, PriorityClass] = field(default_factory=default_classes)
    default_class: str | None = None
    gain: GainConfig = field(default_factory=GainConfig)
    prefill: list[PrefillSpec] = field(default_factory=list)
    decode: list[DecodeSpec] = field(default_factory=list)
    model: str | None = None               # served model name; default: what the workers report
    # without client keys (--keys) a non-loopback host is refused unless this is true (open access:
    # any client that reaches the port may use any class; check_open_access)
    allow_open_access: bool = False
    health_interval_s: float = 1.0
    health_failures: int = 3               # consecutive failed checks before an instance leaves the set
    health_timeout_s: float = 5.0          # /health and /metrics answer within this (progress excuses slow /health)
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0       # a whole request, first byte to last
    stream_idle_timeout_s: float = 60.0    # longest silence between two events of an upstream stream
    max_body_mb: float = 16.0              # request bodies above this: 413
    header_timeout_s: float = 10.0         # from connecting to the end of the request headers
    body_timeout_s: float = 30.0           # from the end of the headers to the end of the body: 408
    max_concurrent: int = 1024             # requests admitted at once, overall: 429 above
    max_concurrent_per_key: int = 256      # requests admitted at once per client (keys file): 429 above
    # admission control (proserve.scheduler.admission): per class, what a request no instance can
    # serve within its TTFT SLO gets (queue | reject | downgrade; a class not named queues), and
    # per-instance caps on what waits for prefill (None: no cap)
    on_overload: dict[str, str] = field(default_factory=dict)
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    stream_queue_events: int = 64          # per stream, events read from the worker but not yet sent
    shutdown_timeout_s: float = 30.0       # on shutdown, how long requests in progress may still run
    worker_api_key_file: str | None = None  # file holding the key the workers demand (else $PROSERVE_WORKER_API_KEY)
    admin_key_file: str | None = None      # file holding the admin API key; None: the admin API is off
    # where workers added at run time (admin API, discovery) may be: IP addresses, networks
    # (10.0.0.0/8), DNS names and *.suffix patterns, matched against the host of each of their
    # addresses as written (names are not resolved); empty: anywhere. Configured workers are not checked
    worker_hosts: list[str] = field(default_factory=list)
    latency_model: str | None = None       # latency model of prefill workers added at run time that name none
    discover: list[DiscoverSpec] = field(default_factory=list)   # DNS discovery ([[discover]])
    record_requests: str | None = None     # JSONL of per-request records
    # the router's approximate index of each prefill worker's prefix cache (issue 14): the prefix
    # blocks of the prompts routed there, as many as its KV memory holds (from its /metrics);
    # queued work is priced net of the prefix expected there (routing.base.expected_hit)
    prefix_index: bool = True
    # the precise index (issue 14, proserve.dispatcher.kv_events): CURVE client keys for the prefill
    # workers' KV-cache events (PrefillSpec.kv_events), and whether a non-loopback address may go without
    kv_events_keys: str | None = None
    kv_events_insecure: bool = False
    # several dispatchers (issue 15, proserve.dispatcher.publication): the prefill workers publish
    # their queued prefill work (PrefillSpec.publish); CURVE client keys for those subscriptions,
    # whether a non-loopback address may go without, the workers' publication interval, and after
    # how many intervals without one the dispatcher falls back to its own view of that worker
    publication_keys: str | None = None
    publication_insecure: bool = False
    publication_interval_s: float = 0.1
    publication_stale_intervals: int = 5
    seed: int = 0

    def validate(self, where: str = "config") -> None:
        validate.one_of(where, "dispatcher.deployment", self.deployment, DEPLOYMENTS)
        dynamic = {s.role for s in self.discover} | ({"prefill", "decode"} if self.admin_key_file else set())
        if not self.prefill and "prefill" not in dynamic:
            raise ConfigError(f"{where}: no prefill instances (add [[prefill]] url = ... or --prefill URL, "
                              f"a [[discover]] entry, or --admin-key-file to add them at run time)")
        if self.deployment == DISAGGREGATED and not self.decode and "decode" not in dynamic:
            raise ConfigError(f"{where}: the disaggregated deployment needs decode instances "
                              f"([[decode]] url/kv_addr or --decode URL=KV_ADDR); "
                              f"for whole requests on one instance set deployment = \"colocated\"")
        if self.deployment == COLOCATED and self.decode:
            raise ConfigError(f"{where}: deployment \"colocated\" takes no decode instances")
        validate.integer(where, "dispatcher.port", self.port, 1, 65535)
        for k in ("health_interval_s", "health_timeout_s", "connect_timeout_s", "request_timeout_s",
                  "stream_idle_timeout_s", "max_body_mb", "header_timeout_s", "body_timeout_s",
                  "shutdown_timeout_s"):
            validate.positive(where, f"dispatcher.{k}", getattr(self, k))
        for k in ("health_failures", "max_concurrent", "max_concurrent_per_key", "stream_queue_events"):
            validate.integer(where, f"dispatcher.{k}", getattr(self, k))
        validate.boolean(where, "dispatcher.prefix_index", self.prefix_index)
        for k in ("worker_api_key_file", "admin_key_file", "latency_model"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                validate.fail(where, f"dispatcher.{k}", "a file path", v)
        check_worker_hosts(self.worker_hosts, f"{where}: dispatcher.worker_hosts")
        for i, s in enumerate(self.discover):
            check_discover(s, self.deployment, f"{where}: discover[{i}]")
        if self.default_class is not None:
            validate.one_of(where, "dispatcher.default_class", self.default_class, self.classes)
        for k in ("max_queued_requests", "max_queued_tokens"):
            if getattr(self, k) is not None:
                validate.integer(where, f"dispatcher.{k}", getattr(self, k))
        self.admission.check(self.classes, f"{where}: classes")
        seen: set[str] = set()
        for kind, specs in (("prefill", self.prefill), ("decode", self.decode)):
            for i, s in enumerate(specs):
                check_url(s.url, f"{where}: {kind}[{i}].url")
                if s.url in seen:
                    raise ConfigError(f"{where}: {kind}[{i}].url {s.url!r} is listed twice")
                seen.add(s.url)
                if not s.name:
                    s.name = f"{kind[0]}{i}"
        for i, d in enumerate(self.decode):
            check_kv_addr(d.kv_addr, f"{where}: decode[{i}].kv_addr")
        validate.boolean(where, "dispatcher.kv_events_insecure", self.kv_events_insecure)
        validate.boolean(where, "dispatcher.allow_open_access", self.allow_open_access)
        if self.kv_events_keys is not None and (not isinstance(self.kv_events_keys, str) or not self.kv_events_keys):
            validate.fail(where, "dispatcher.kv_events_keys", "a directory", self.kv_events_keys)
        events: dict[str, int] = {}
        for i, s in enumerate(self.prefill):
            if s.kv_events:
                check_kv_events(s.kv_events, self, f"{where}: prefill[{i}].kv_events")
                if s.kv_events in events:   # two workers' indexes driven by one engine's cache
                    raise ConfigError(f"{where}: prefill[{i}].kv_events {s.kv_events!r} is also "
                                      f"prefill[{events[s.kv_events]}]'s")
                events[s.kv_events] = i
        check_publication(self, where)

    @property
    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(dict(self.on_overload), self.max_queued_requests, self.max_queued_tokens)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 1024 * 1024)

    def worker_api_key(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """The key to send the workers: ``worker_api_key_file``'s content (whitespace
        stripped), else ``$PROSERVE_WORKER_API_KEY``, else None (no key sent)."""
        if self.worker_api_key_file:
            p = Path(self.worker_api_key_file)
            try:
                key = p.read_text().strip()
            except OSError as e:
                raise ConfigError(f"worker key file {p}: cannot read ({e.strerror})") from None
            except UnicodeDecodeError:
                raise ConfigError(f"worker key file {p}: not a text file") from None
            where = f"worker key file {p}"
        else:
            key = (environ.get(WORKER_KEY_ENV) or "").strip()
            if not key:
                return None
            where = f"${WORKER_KEY_ENV}"
        if not key:
            raise ConfigError(f"{where}: is empty (it must hold one key)")
        if any(c.isspace() or not c.isprintable() or not c.isascii() for c in key):
            raise ConfigError(f"{where}: the key must be one word of printable ASCII (no spaces or line breaks "
                              f"inside)")
        return key

    def admin_key(self) -> str | None:
        """The admin API's key: ``admin_key_file``'s content (whitespace stripped), at least
        :data:`MIN_ADMIN_KEY_LEN` printable ASCII characters; None without the file (the
        admin API is then off)."""
        if not self.admin_key_file:
            return None
        p = Path(self.admin_key_file)
        try:
            key = p.read_text().strip()
        except OSError as e:
            raise ConfigError(f"admin key file {p}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"admin key file {p}: not a text file") from None
        if len(key) < MIN_ADMIN_KEY_LEN or any(c.isspace() or not c.isprintable() or not c.isascii() for c in key):
            raise ConfigError(f"admin key file {p}: must hold one key of at least {MIN_ADMIN_KEY_LEN} printable "
                              f"ASCII characters (no spaces or line breaks inside)")
        return key

    @property
    def resolved_default_class(self) -> str:
        if self.default_class:
            return self.default_class
        # untagged requests get the lowest-weight class: never ahead of paying clients
        return min(self.classes.values(), key=lambda c: c.weight).name


def _printable(addr: str) -> bool:
    """Printable ASCII only: no space or control character (a C string ends at NUL), nothing
    an address parser and the resolver could read differently."""
    return all("\x21" <= c <= "\x7e" for c in addr)


def check_url(url: Any, where: str) -> str:
    if not isinstance(url, str):
        raise ConfigError(f"{where}: must be a string like http://127.0.0.1:8100, got {url!r}")
    if not _printable(url):
        raise ConfigError(f"{where}: must be printable ASCII (no spaces or control characters), got {url!r:.200}")
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
        raise ConfigError(f"{where}: must be a base URL like http://127.0.0.1:8100, got {url!r}")
    try:
        u.port
    except ValueError:
        raise ConfigError(f"{where}: bad port in {url!r}") from None
    return url


#: a worker name given at run time (admin API, discovery): it appears in URLs and metric labels
WORKER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@\[\]-]{0,127}")
_HOST_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})?")


def check_discover(s: DiscoverSpec, deployment: str, where: str) -> None:
    validate.one_of(where, "role", s.role, ("prefill", "decode"))
    if deployment == COLOCATED and s.role == "decode":
        raise ConfigError(f"{where}: deployment \"colocated\" takes no decode instances")
    if not isinstance(s.host, str) or not _HOST_RE.fullmatch(s.host):
        validate.fail(where, "host", "a DNS name like decode.proserve.svc.cluster.local", s.host)
    validate.integer(where, "port", s.port, 1, 65535)
    validate.one_of(where, "scheme", s.scheme, ("http", "https"))
    validate.positive(where, "interval_s", s.interval_s)
    validate.positive(where, "timeout_s", s.timeout_s)
    if s.role == "decode":
        if s.kv_port is None:
            raise ConfigError(f"{where}: a decode entry needs kv_port (the workers' --kv-listen port)")
        validate.integer(where, "kv_port", s.kv_port, 1, 65535)
    check_local_policy(s.local_policy, f"{where}.local_policy")
    for k in ("kv_events_port", "publish_port"):
        if getattr(s, k) is not None:
            if s.role != "prefill":
                raise ConfigError(f"{where}: {k} is for prefill workers")
            validate.integer(where, k, getattr(s, k), 1, 65535)
    if s.latency_model is not None and (not isinstance(s.latency_model, str) or not s.latency_model):
        validate.fail(where, "latency_model", "a file path", s.latency_model)
    if not isinstance(s.name_prefix, str) or len(s.name_prefix) > 64 \
            or (s.name_prefix and not WORKER_NAME_RE.fullmatch(s.name_prefix)):
        validate.fail(where, "name_prefix", "at most 64 letters, digits and . _ : @ [ ] -", s.name_prefix)


def check_local_policy(name: Any, where: str) -> str:
    """A prefill worker's ``--local-policy``: a scheduler policy, or vLLM's own scheduling."""
    if not isinstance(name, str) or (name not in LOCAL_POLICIES_OUTSIDE_REGISTRY and name not in local_names()):
        raise ConfigError(f"{where}: expected one of "
                          f"{', '.join(local_names() + list(LOCAL_POLICIES_OUTSIDE_REGISTRY))}, got {name!r}")
    return name


def _check_side_channel(addr: Any, keys: Any, insecure: bool, where: str, worker_flag: str, keys_key: str,
                        worker_keys_flag: str, insecure_key: str, example: str) -> str:
    """A worker's ZeroMQ side-channel address (KV-cache events, queue publications): tcp:// or
    ipc://; beyond loopback only with CURVE client keys (``keys_key``) or ``insecure_key``."""
    from proserve.kvtransfer.auth import is_loopback
    if not isinstance(addr, str) or len(addr) > 1024 or not addr.startswith(("tcp://", "ipc://")) \
            or not _printable(addr):
        raise ConfigError(f"{where}: must be a ZeroMQ address like {example} (the worker's "
                          f"{worker_flag}), got {addr!r:.200}")
    if not keys and not insecure and not is_loopback(addr):
        raise ConfigError(f"{where}: {addr} is not a loopback address: set dispatcher.{keys_key} (CURVE "
                          f"client keys; the worker's {worker_keys_flag}), or {insecure_key} = true on a "
                          f"trusted network")
    return addr


def check_kv_events(addr: Any, cfg: DispatcherConfig, where: str) -> str:
    """A prefill worker's KV-cache event address (issue 14)."""
    return _check_side_channel(addr, cfg.kv_events_keys, cfg.kv_events_insecure, where, "--kv-events-port",
                               "kv_events_keys", "--kv-events-keys", "kv_events_insecure", "tcp://127.0.0.1:5557")


def check_publication(cfg: DispatcherConfig, where: str) -> None:
    """The queue-publication settings (issue 15): each [[prefill]] ``publish`` a ZeroMQ address,
    beyond loopback only with ``publication_keys`` or ``publication_insecure``."""
    validate.boolean(where, "dispatcher.publication_insecure", cfg.publication_insecure)
    validate.positive(where, "dispatcher.publication_interval_s", cfg.publication_interval_s)
    validate.integer(where, "dispatcher.publication_stale_intervals", cfg.publication_stale_intervals, 1)
    if cfg.publication_keys is not None and (not isinstance(cfg.publication_keys, str) or not cfg.publication_keys):
        validate.fail(where, "dispatcher.publication_keys", "a directory", cfg.publication_keys)
    for i, s in enumerate(cfg.prefill):
        if s.publish:
            check_publish(s.publish, cfg, f"{where}: prefill[{i}].publish")


def check_publish(addr: Any, cfg: DispatcherConfig, where: str) -> str:
    """A prefill worker's queue-publication address (issue 15)."""
    return _check_side_channel(addr, cfg.publication_keys, cfg.publication_insecure, where, "--publish-queue-port",
                               "publication_keys", "--publish-keys", "publication_insecure", "tcp://127.0.0.1:15700")


def check_kv_addr(addr: Any, where: str) -> str:
    if not isinstance(addr, str) or not (addr.startswith("tcp://") or addr.startswith("ipc://")) \
            or not _printable(addr):
        raise ConfigError(f"{where}: must be a ZeroMQ address like tcp://127.0.0.1:15600, got {addr!r:.200}")
    return addr


def check_worker_hosts(v: Any, where: str) -> list[str]:
    """``dispatcher.worker_hosts``: a list of IP addresses, networks (CIDR, host bits zero),
    DNS names and ``*.suffix`` patterns (lower-cased in place)."""
    if not isinstance(v, list) or len(v) > 1024:
        raise ConfigError(f"{where}: must be a list of hosts, networks or *.suffix patterns, got {v!r:.80}")
    for i, h in enumerate(v):
        if not isinstance(h, str) or not h or len(h) > 255:
            raise ConfigError(f"{where}[{i}]: expected a host, a network or *.suffix, got {h!r:.80}")
        if "/" in h:
            try:
                ipaddress.ip_network(h)
            except ValueError as e:
                raise ConfigError(f"{where}[{i}]: {h!r:.80} is not a network like 10.0.0.0/8 ({e})") from None
        elif not _strict_host(h.strip("[]")) and not _dns_name(h.removeprefix("*.")):
            raise ConfigError(f"{where}[{i}]: {h!r:.80} is not an IP address, a DNS name or *.suffix "
                              f"(a name's last label starts with a letter)")
        v[i] = h.lower()
    return v


_LABEL_RE = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")


def _dns_name(name: str) -> bool:
    """A DNS name as worker_hosts reads one: labels of letters, digits, ``-`` and ``_``, no
    trailing dot, the last label starting with a letter, so that nothing the resolver would
    read as an IPv4 address (``10.1``, ``2130706433``, ``0x7f000001``) passes for a name."""
    labels = name.lower().split(".")
    return (len(name) <= 253 and all(_LABEL_RE.fullmatch(x) for x in labels)
            and labels[-1][:1].isalpha())


def _strict_host(host: str) -> str:
    """``host`` (brackets already removed) as worker_hosts compares it: an IP address in its
    normal form (no IPv6 scope id), or a DNS name in lower case; "" for anything else."""
    ip = _ip(host) if "%" not in host else None
    if ip is not None:
        return str(ip)
    return host.lower() if _dns_name(host) else ""


def address_host(addr: str) -> str | None:
    """The host of a worker address, read strictly (what worker_hosts compares): an HTTP(S)
    URL's, or a ``tcp://HOST:PORT`` ZeroMQ address's, as :func:`_strict_host` gives it; None
    for ``ipc://`` and ``inproc://`` (this host's own sockets); "" when it cannot be read
    unambiguously (so no allow-list admits it): characters outside printable ASCII or a
    backslash anywhere (a C string ends at NUL), an IPv6 scope id (libzmq cuts a "zone" at
    ``%`` even from a name), libzmq's ``source;destination`` form."""
    if not _printable(addr) or "\\" in addr:
        return ""
    if addr.startswith(("ipc://", "inproc://")):
        return None
    if addr.startswith("tcp://"):
        rest = addr[len("tcp://"):]
        host, sep, port = rest.rpartition(":")
        if ";" in rest or not sep or not port.isdigit():
            return ""
        if host.startswith("[") and host.endswith("]"):
            ip = _ip(host[1:-1]) if "%" not in host else None
            return str(ip) if ip is not None and ip.version == 6 else ""
        return _strict_host(host) if ":" not in host else ""
    try:
        u = urlparse(addr)
        host = u.hostname or ""
    except ValueError:
        return ""
    if "%" in u.netloc:
        return ""
    return _strict_host(host)


def _ip(host: str):
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_allowed(host: str, allowed: list[str]) -> bool:
    """Is ``host`` (:func:`address_host`'s reading: an IP address or a name, not resolved)
    among ``allowed`` (:func:`check_worker_hosts`'s patterns)? An IP matches an equal
    address or a network holding it; a name matches itself or a ``*.suffix`` it ends with."""
    host = _strict_host(host.strip("[]"))
    if not host:
        return False
    ip = _ip(host)
    for pat in allowed:
        if ip is not None:
            if "/" in pat:
                net = ipaddress.ip_network(pat)
                if ip.version == net.version and ip in net:
                    return True
            elif _ip(pat.strip("[]")) == ip:
                return True
        elif pat.startswith("*."):
            if host.endswith(pat[1:]) and len(host) > len(pat) - 1:
                return True
        elif host == pat:
            return True
    return False


def read_file(path: str | Path, allow_list: bool = False) -> dict | list:
    """Parse a TOML or JSON file into a dict (or, with ``allow_list``, a JSON list);
    errors name the file and the line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    if not isinstance(data, dict) and not (allow_list and isinstance(data, list)):
        raise ConfigError(f"{p}: the top level must be a table/object")
    return data


def check_open_access(cfg: DispatcherConfig, has_keys: bool, where: str = "dispatcher config") -> None:
    """Secure by default: without client API keys every client may use every priority class,
    so a dispatcher that would listen beyond loopback without ``--keys`` is refused at start-up
    unless ``allow_open_access`` says it is meant (a trusted network). Loopback stays open for
    local use, with the warning the dispatcher logs."""
    from proserve.kvtransfer.auth import is_loopback_host
    if has_keys or cfg.allow_open_access or is_loopback_host(cfg.host):
        return
    raise ConfigError(f"{where}: host {cfg.host!r} is not a loopback address and no client API keys are set: "
                      f"pass --keys FILE (scripts/make_keys.sh makes one), or --allow-open-access "
                      f"(config: allow_open_access = true) on a trusted network")


_DISPATCHER_KEYS = {"host", "port", "allow_open_access", "global_policy", "deployment", "default_class", "model",
                    "health_interval_s", "health_failures", "health_timeout_s", "connect_timeout_s",
                    "request_timeout_s", "stream_idle_timeout_s", "max_body_mb", "header_timeout_s",
                    "body_timeout_s", "max_concurrent", "max_concurrent_per_key", "stream_queue_events",
                    "max_queued_requests", "max_queued_tokens",
                    "shutdown_timeout_s", "worker_api_key_file", "record_requests", "seed", "prefix_index",
                    "admin_key_file", "latency_model", "kv_events_keys", "kv_events_insecure",
                    "worker_hosts", "publication_keys", "publication_insecure", "publication_interval_s",
                    "publication_stale_intervals"}
#: keys renamed since: a config file using the old name gets an error naming the new one
_RENAMED = {"idle_timeout_s": "stream_idle_timeout_s"}
_TOP_KEYS = {"dispatcher", "global_params", "gain", "classes", "prefill", "decode", "discover"}
_DISCOVER_KEYS = {"role", "host", "port", "scheme", "interval_s", "timeout_s", "kv_port", "local_policy",
                  "latency_model", "name_prefix", "kv_events_port", "publish_port"}


def _table(data: Mapping, key: str, where: str) -> dict:
    v = data.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: {key} must be a table/object, got {type(v).__name__}")
    return v


def _list(data: Mapping, key: str, where: str) -> list:
    v = data.get(key, [])
    if not isinstance(v, list):
        raise ConfigError(f"{where}: {key} must be a list ([[{key}]] in TOML), got {type(v).__name__}")
    return v


def config_from_dict(data: Mapping, where: str = "config", base: Path | None = None) -> DispatcherConfig:
    """Build a :class:`DispatcherConfig`; relative latency-model paths are resolved against ``base``."""
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}; "
                          f"expected {', '.join(sorted(_TOP_KEYS))}")
    cfg = DispatcherConfig()
    d = _table(data, "dispatcher", where)
    for old, new in _RENAMED.items():
        if old in d:
            raise ConfigError(f"{where}: dispatcher.{old} is now called {new}")
    unknown = set(d) - _DISPATCHER_KEYS
    if unknown:
        raise ConfigError(f"{where}: dispatcher: unknown key(s) {', '.join(sorted(unknown))}")
    for k, v in d.items():
        setattr(cfg, k, v)
    if isinstance(cfg.kv_events_keys, str) and cfg.kv_events_keys and base is not None \
            and not Path(cfg.kv_events_keys).is_absolute():
        cfg.kv_events_keys = str((base / cfg.kv_events_keys).resolve())
    if isinstance(cfg.publication_keys, str) and cfg.publication_keys and base is not None \
            and not Path(cfg.publication_keys).is_absolute():
        cfg.publication_keys = str((base / cfg.publication_keys).resolve())
    for k in ("worker_api_key_file", "admin_key_file", "latency_model"):
        v = getattr(cfg, k)
        if isinstance(v, str) and v and base is not None and not Path(v).is_absolute():
            setattr(cfg, k, str((base / v).resolve()))
    cfg.global_params = _table(data, "global_params", where)
    gain = _table(data, "gain", where)
    try:
        cfg.gain = GainConfig(**gain)
    except TypeError as e:
        raise ConfigError(f"{where}: gain: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if "classes" in data:
        items = _list(data, "classes", where)
        cfg.classes = classes_from_dicts(items, f"{where}: classes")
        cfg.on_overload = overload_actions_from_dicts(items, f"{where}: classes")
    for i, p in enumerate(_list(data, "prefill", where)):
        if not isinstance(p, dict) or "url" not in p:
            raise ConfigError(f"{where}: prefill[{i}] needs a url")
        unknown = set(p) - {"url", "latency_model", "name", "local_policy", "kv_events", "publish"}
        if unknown:
            raise ConfigError(f"{where}: prefill[{i}]: unknown key(s) {', '.join(sorted(unknown))}")
        lm = p.get("latency_model")
        if lm is not None and base is not None and not Path(lm).is_absolute():
            lm = str((base / lm).resolve())
        lp = check_local_policy(p.get("local_policy", PrefillSpec.local_policy), f"{where}: prefill[{i}].local_policy")
        cfg.prefill.append(PrefillSpec(p["url"], lm, str(p.get("name", "")), lp, p.get("kv_events", "")))
        cfg.prefill[-1].publish = p.get("publish", "")   # issue 15: its queue publication address
    for i, x in enumerate(_list(data, "decode", where)):
        if not isinstance(x, dict) or "url" not in x or "kv_addr" not in x:
            raise ConfigError(f"{where}: decode[{i}] needs url and kv_addr")
        unknown = set(x) - {"url", "kv_addr", "name"}
        if unknown:
            raise ConfigError(f"{where}: decode[{i}]: unknown key(s) {', '.join(sorted(unknown))}")
        cfg.decode.append(DecodeSpec(x["url"], x["kv_addr"], str(x.get("name", ""))))
    for i, x in enumerate(_list(data, "discover", where)):
        if not isinstance(x, dict) or not {"role", "host", "port"} <= set(x):
            raise ConfigError(f"{where}: discover[{i}] needs role, host and port")
        unknown = set(x) - _DISCOVER_KEYS
        if unknown:
            raise ConfigError(f"{where}: discover[{i}]: unknown key(s) {', '.join(sorted(unknown))}")
        lm = x.get("latency_model")
        if isinstance(lm, str) and lm and base is not None and not Path(lm).is_absolute():
            x = {**x, "latency_model": str((base / lm).resolve())}
        cfg.discover.append(DiscoverSpec(**x))
    return cfg


def load_config(path: str | Path) -> DispatcherConfig:
    p = Path(path)
    cfg = config_from_dict(read_file(p), str(p), base=p.resolve().parent)
    return cfg


# -- API keys -----------------------------------------------------------------------------
def _range(v: Any, where: str, name: str) -> tuple[float, float]:
    """``[min, max]`` milliseconds with 0 < min <= max <= MAX_SLO_MS."""
    if not isinstance(v, list) or len(v) != 2:
        validate.fail(where, name, "[min, max] in milliseconds", v)
    lo = validate.number(where, f"{name}[0] (min)", v[0], 0, MAX_SLO_MS, lo_open=True)
    hi = validate.number(where, f"{name}[1] (max)", v[1], lo, MAX_SLO_MS)
    return lo, hi


def keys_from_dict(data: Mapping, classes: Mapping[str, PriorityClass], where: str = "keys") -> dict[str, KeyEntry]:
    items = data.get("keys")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}: needs a non-empty list 'keys' ([[keys]] in TOML)")
    out: dict[str, KeyEntry] = {}
    for i, k in enumerate(items):
        w = f"{where}: keys[{i}]"
        if not isinstance(k, dict):
            raise ConfigError(f"{w}: must be a table/object")
        unknown = set(k) - {"key", "client", "class", "ttft_ms", "tpot_ms"}
        if unknown:
            raise ConfigError(f"{w}: unknown key(s) {', '.join(sorted(unknown))}")
        key = k.get("key")
        if not isinstance(key, str) or len(key) < 8:
            raise ConfigError(f"{w}.key: must be a string of at least 8 characters")
        if key in out:
            raise ConfigError(f"{w}.key: duplicate key (client {out[key].client!r} has it too)")
        client = validate.text(where, f"keys[{i}].client", k.get("client"))
        cls = validate.one_of(where, f"keys[{i}].class", k.get("class"), classes)
        out[key] = KeyEntry(key, client, cls,
                            _range(k["ttft_ms"], where, f"keys[{i}].ttft_ms") if "ttft_ms" in k else None,
                            _range(k["tpot_ms"], where, f"keys[{i}].tpot_ms") if "tpot_ms" in k else None)
    return out


def load_keys(path: str | Path, classes: Mapping[str, PriorityClass]) -> dict[str, KeyEntry]:
    p = Path(path)
    return keys_from_dict(read_file(p), classes, str(p))
