"""Dynamic membership (issue 15): workers join and leave while the dispatcher runs.

Two ways in:

* **the admin API**, on when the dispatcher has an admin key (``--admin-key-file`` /
  ``dispatcher.admin_key_file``; without one every admin route answers 403). Every
  call carries ``Authorization: Bearer <admin key>`` (else 401); the client API keys
  and the worker key are not admin keys. Errors are OpenAI-style JSON objects.

  ================================================  ==========================================
  ``GET /admin/workers``                            every worker: state, in-flight requests
  ``POST /admin/workers``                           add one (201); body below
  ``POST /admin/workers/{name}/drain``              no new requests; its own finish
  ``POST /admin/workers/{name}/resume``             undo a drain
  ``DELETE /admin/workers/{name}[?force=true]``     remove it (409 while requests run on it)
  ================================================  ==========================================

  The add body: ``{"role": "prefill" | "decode", "url": "http://10.0.0.7:8100",
  "kv_addr": "tcp://10.0.0.7:15600" (decode only, required), "local_policy":
  "slide_batching" (prefill only, optional), "name": "p7" (optional; default the next
  ``p<id>`` / ``d<id>``), "kv_events": "tcp://10.0.0.7:5557" (prefill only, optional: where it
  publishes its KV-cache events, :mod:`proserve.dispatcher.kv_events`), "publish":
  "tcp://10.0.0.7:15700" (prefill only, optional: where it publishes its queue,
  :mod:`proserve.dispatcher.publication`)}``. A bad field is a 400; a name, URL, KV,
  KV-event or publication address already in use is a 409. With ``worker_hosts``
  (``--worker-hosts``) every address of the worker must be on an allowed host, else 403
  (discovery logs such an address and leaves it out). A worker added is checked at once
  and takes requests once healthy.

  A worker's ``state``: ``healthy`` (takes requests), ``down`` (failed its checks),
  ``draining`` (takes no new requests; ``requests`` counts the ones still on it: they
  run to their end) and ``removed`` (out of the pool, listed only while requests it
  held still run). ``requests`` counts the requests with an attempt on the worker:
  for a decode worker from the moment it is chosen (its prefill leg pushes the KV there).

  **Removal** refuses (409) while requests run on the worker, unless ``force=true``:
  then the worker leaves the pool at once (no checks, no new requests) and the requests
  on it *run to their end there*, as on a draining worker -- none is cancelled; if the
  worker dies under them they fail over as on any dying worker (retried elsewhere while
  nothing was sent). Nothing is lost as long as the worker process lives until
  ``GET /admin/workers`` no longer lists it. The safe sequence is drain, wait for
  ``requests`` to reach 0, delete, then stop the worker.

* **DNS discovery** (``[[discover]]`` in the config): every ``interval_s`` each entry's
  name is resolved (``loop.getaddrinfo``, bounded by ``timeout_s``); a new address
  becomes a worker (``<role>-<addr>:<port>``, or ``name_prefix`` + ``<addr>:<port>``),
  an address gone is drained, and removed once its requests are over; an address
  back before that is resumed. A resolution that fails, times out or finds no address
  keeps the current set (logged, ``proserve:dispatcher_discovery_errors``): a DNS
  hiccup never empties the pool. Tests replace :attr:`Membership.resolver`.

Router state stays consistent: new router ids are never a removed worker's
(:class:`~proserve.dispatcher.instances.Registry`); a draining worker is marked not
routable (``healthy = False`` in the router's view, so no policy picks it) while its
queued entries stay in ``PrefillQueueMap`` until they finish; a removed prefill
worker stays in the queue map until its last request is released.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlparse

from fastapi import Request
from fastapi.responses import JSONResponse

from proserve.scheduler.request import ConfigError
from proserve.scheduler.routing.base import PrefillQueueMap

from .auth import bearer_key
from .config import (
    WORKER_NAME_RE,
    DiscoverSpec,
    address_host,
    check_kv_addr,
    check_kv_events,
    check_local_policy,
    check_publish,
    check_url,
    host_allowed,
)
from .errors import ApiError
from .instances import PrefillWorker, Worker

logger = logging.getLogger("proserve.dispatcher")

#: largest admin request body
MAX_ADMIN_BODY_BYTES = 64 * 1024
#: a name resolving to more addresses than this is a bad answer (kept out, as a failure)
MAX_DISCOVERED = 1024
_ADD_FIELDS = {"role", "url", "name", "kv_addr", "local_policy", "kv_events", "publish"}
_MAX_URL = 2048

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses (A and AAAA records) ``host`` resolves to, through the event loop's
    resolver (``getaddrinfo``: /etc/hosts, DNS, as the system is set up)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    # a dual-stack pod has an A and an AAAA record: one engine, so one address family (IPv4
    # where the name has any, else IPv6), not a worker per address
    v4 = {str(i[4][0]) for i in infos if i[0] == socket.AF_INET}
    return sorted(v4 or {str(i[4][0]) for i in infos})


def _host_part(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


class Membership:
    """Adds, drains and removes the dispatcher's workers (admin API and discovery)."""

    def __init__(self, dispatcher):
        self.d = dispatcher
        self.resolver: Resolver = resolve      # tests replace it
        self._retired: list[Worker] = []       # removed, with requests still on them
        self._drained_by_discovery: set[str] = set()
        self._refused: set[str] = set()         # discovered URLs that could not be added (logged once)
        self._tasks: list[asyncio.Task] = []

    @property
    def registry(self):
        return self.d.registry

    def _everyone(self) -> list[Worker]:
        return [*self.registry.workers, *self._retired]

    # -- the operations ----------------------------------------------------------------------
    def list(self) -> list[dict]:
        return self.registry.status(self._everyone())

    def add(self, body: Any, source: str = "admin") -> Worker:
        """Check an add request's body (ApiError 400/409) and add the worker."""
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
        unknown = set(body) - _ADD_FIELDS
        if unknown:
            raise ApiError(400, f"unknown field(s) {', '.join(sorted(map(str, unknown)))}; expected "
                                f"{', '.join(sorted(_ADD_FIELDS))}", param=min(map(str, unknown)))
        role = body.get("role")
        if role not in ("prefill", "decode"):
            raise ApiError(400, f"role must be \"prefill\" or \"decode\", got {role!r:.80}", param="role")
        if role == "decode" and self.d.colocated:
            raise ApiError(400, "the co-located deployment takes no decode workers", param="role")
        url = body.get("url")
        try:
            if not isinstance(url, str) or len(url) > _MAX_URL:
                raise ConfigError("url: must be a base URL like http://10.0.0.7:8100")
            check_url(url, "url")
            u = urlparse(url)
            if u.username is not None or u.password is not None or u.query or u.fragment:
                raise ConfigError("url: must be a base URL like http://10.0.0.7:8100 (no user, query or fragment)")
        except ConfigError as e:
            raise ApiError(400, str(e), param="url") from None
        url = url.rstrip("/")
        kv_addr, local_policy, kv_events, publish = "", "slide_batching", "", ""
        if role == "decode":
            if "local_policy" in body:
                raise ApiError(400, "local_policy is for prefill workers", param="local_policy")
            kv_addr = body.get("kv_addr")
            try:
                if not isinstance(kv_addr, str) or len(kv_addr) > _MAX_URL:
                    raise ConfigError("kv_addr: a decode worker needs one, like tcp://10.0.0.7:15600")
                check_kv_addr(kv_addr, "kv_addr")
            except ConfigError as e:
                raise ApiError(400, str(e), param="kv_addr") from None
        else:
            if "kv_addr" in body:
                raise ApiError(400, "kv_addr is for decode workers", param="kv_addr")
            try:
                local_policy = check_local_policy(body.get("local_policy", local_policy), "local_policy")
            except ConfigError as e:
                raise ApiError(400, str(e), param="local_policy") from None
            if body.get("kv_events") is not None:    # its KV-cache events (issue 14)
                try:
                    kv_events = check_kv_events(body["kv_events"], self.d.cfg, "kv_events")
                except ConfigError as e:
                    raise ApiError(400, str(e), param="kv_events") from None
            if body.get("publish") is not None:      # its queue publications (issue 15)
                try:
                    publish = check_publish(body["publish"], self.d.cfg, "publish")
                except ConfigError as e:
                    raise ApiError(400, str(e), param="publish") from None
        for k in ("kv_events", "publish"):
            if role == "decode" and k in body:
                raise ApiError(400, f"{k} is for prefill workers", param=k)
        allowed = self.d.cfg.worker_hosts
        for param, addr in (("url", url), ("kv_addr", kv_addr), ("kv_events", kv_events), ("publish", publish)):
            host = address_host(addr) if addr and allowed else None
            if host is not None and not host_allowed(host, allowed):   # the worker key goes there
                # (the list itself is not told: it would map what a leaked admin key may reach)
                raise ApiError(403, f"{param}: {addr!r:.120} is not on a host the dispatcher's worker_hosts "
                                    f"allows" + ("" if host else " (its host cannot be read unambiguously)"),
                               param=param)
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or not WORKER_NAME_RE.fullmatch(name)):
            raise ApiError(400, f"name must be 1-128 letters, digits and . _ : @ [ ] - (starting with a letter "
                                f"or digit), got {name!r:.80}", param="name")
        everyone = self._everyone()
        if name is not None and any(w.name == name for w in everyone):
            raise ApiError(409, f"a worker named {name!r} exists", type="conflict", param="name")
        clash = next((w for w in everyone if w.url == url), None)
        if clash is not None:
            raise ApiError(409, f"{url} is already worker {clash.name!r}", type="conflict", param="url")
        clash = next((w for w in everyone if getattr(w, "kv_addr", None) == kv_addr and kv_addr), None)
        if clash is not None:
            raise ApiError(409, f"{kv_addr} is already the KV address of worker {clash.name!r}", type="conflict",
                           param="kv_addr")
        clash = next((w for w in everyone if getattr(w, "kv_events", None) == kv_events and kv_events), None)
        if clash is not None:      # its index would be driven by another engine's cache
            raise ApiError(409, f"{kv_events} is already the KV-event address of worker {clash.name!r}",
                           type="conflict", param="kv_events")
        clash = next((w for w in everyone if getattr(w, "publish", None) == publish and publish), None)
        if clash is not None:      # its view would be another engine's queue
            raise ApiError(409, f"{publish} is already the queue-publication address of worker {clash.name!r}",
                           type="conflict", param="publish")
        if name is None:
            name = self._free_name(role)
        w = self.registry.add(role, name, url, kv_addr=kv_addr, local_policy=local_policy,
                              latency_model=self._latency_model(source), source=source, kv_events=kv_events,
                              publish=publish)
        if isinstance(w, PrefillWorker):
            self._rebuild_queue_map()
        self.d.metrics.membership.labels(role, "added", source.partition(":")[0]).inc()
        return w

    def drain(self, name: str, on: bool = True, source: str = "admin") -> Worker:
        w = self._find(name)
        if w.draining != on:
            self.d.metrics.membership.labels(w.role, "drained" if on else "resumed", source.partition(":")[0]).inc()
        self.registry.drain(w, on)
        if source == "admin" or not on:
            self._drained_by_discovery.discard(w.name)
        return w

    def remove(self, name: str, force: bool = False, source: str = "admin") -> Worker:
        w = self._find(name)
        if source == "admin" and w.source.startswith("discover:"):
            # the next resolution would add it back under a new id: its address decides
            raise ApiError(409, f"worker {name!r} was discovered from {w.source.partition(':')[2]!r}: it leaves "
                                f"when its address leaves that name's records; drain it "
                                f"(POST /admin/workers/{name}/drain) to route nothing new there meanwhile",
                           type="conflict", code="worker_discovered")
        if w.active and not force:
            raise ApiError(409, f"worker {name!r} has {w.active} request(s) in flight: drain it and wait until "
                                f"GET /admin/workers shows 0 requests, or remove it with ?force=true (its "
                                f"requests then run to their end there, none cancelled)",
                           type="conflict", code="worker_busy")
        self.registry.remove(w)
        self._drained_by_discovery.discard(w.name)
        if w.active:
            self._retired.append(w)
        else:
            self.d.metrics.forget(w)
        if isinstance(w, PrefillWorker):
            self._rebuild_queue_map()
        self.d.metrics.membership.labels(w.role, "removed", source.partition(":")[0]).inc()
        return w

    def retired(self, w: Worker) -> None:
        """The last request on removed worker ``w`` ended: forget it."""
        if w in self._retired:
            self._retired.remove(w)
            self.d.metrics.forget(w)
            if isinstance(w, PrefillWorker):
                self._rebuild_queue_map()

    def idle(self, w: Worker) -> None:
        """A draining worker's last request ended: one discovery drained (its address is
        gone) leaves now."""
        if w.name in self._drained_by_discovery and not w.removed and not w.active:
            self.remove(w.name, source="discover")

    def _find(self, name: str) -> Worker:
        w = self.registry.find(name)
        if w is None:
            raise ApiError(404, f"no worker named {name!r:.140}", param="name")
        return w

    def _free_name(self, role: str) -> str:
        taken = {w.name for w in self._everyone()}
        base = f"{role[0]}{self.registry._next_id[role]}"
        name, k = base, 1
        while name in taken:
            name, k = f"{base}-{k}", k + 1
        return name

    def _latency_model(self, source: str) -> str | None:
        if source.startswith("discover:"):
            host = source.partition(":")[2]
            for s in self.d.cfg.discover:
                if s.host == host and s.role == "prefill" and s.latency_model:
                    return s.latency_model
        return None   # the dispatcher-wide one (cfg.latency_model), else the bundled profile

    def _rebuild_queue_map(self) -> None:
        """PrefillQueueMap over the registry's prefill workers and the removed ones whose
        requests are still released there (their ids stay valid until then)."""
        states = [w.state for w in self.registry.prefill]
        states += [w.state for w in self._retired if isinstance(w, PrefillWorker)]
        self.d.router_host.qmap = self.d.qmap = PrefillQueueMap(states)

    # -- discovery ---------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop(s)) for s in self.d.cfg.discover]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._tasks = []

    async def discover_all(self) -> None:
        await asyncio.gather(*(self.discover(s) for s in self.d.cfg.discover))

    async def _loop(self, spec: DiscoverSpec) -> None:
        while True:
            await asyncio.sleep(spec.interval_s)
            await self.discover(spec)

    def _error(self, spec: DiscoverSpec, reason: str, why: str) -> bool:
        self.d.metrics.discovery_errors.labels(spec.host, reason).inc()
        logger.warning("discovery of %s workers at %s failed (%s); keeping the current %s workers",
                       spec.role, spec.host, why, spec.role)
        return False

    async def discover(self, spec: DiscoverSpec) -> bool:
        """One resolution of ``spec.host`` and the changes it calls for; True if it resolved.
        Never raises: a failure keeps the current set."""
        try:
            async with asyncio.timeout(spec.timeout_s):
                got = await self.resolver(spec.host, spec.port)
            addrs = sorted({str(ipaddress.ip_address(a)) for a in got})
        except TimeoutError:
            return self._error(spec, "timeout", f"no answer within {spec.timeout_s:g} s")
        except (OSError, ValueError, TypeError) as e:
            return self._error(spec, "error", f"{type(e).__name__}: {e}")
        except Exception as e:
            logger.exception("discovery of %s", spec.host)
            return self._error(spec, "error", f"{type(e).__name__}: {e}")
        if not addrs:
            return self._error(spec, "empty", "no addresses")
        if len(addrs) > MAX_DISCOVERED:
            return self._error(spec, "too_many", f"{len(addrs)} addresses (at most {MAX_DISCOVERED})")
        try:
            self._apply(spec, addrs)
        except Exception:
            logger.exception("discovery of %s: applying the changes", spec.host)
        return True

    def _apply(self, spec: DiscoverSpec, addrs: list[str]) -> None:
        source = f"discover:{spec.host}"
        mine = {w.url: w for w in self.registry.workers if w.source == source and w.role == spec.role}
        want = {f"{spec.scheme}://{_host_part(a)}:{spec.port}": a for a in addrs}
        for url, a in want.items():
            w = mine.get(url)
            if w is None:
                body: dict = {"role": spec.role, "url": url,
                              "name": (spec.name_prefix or f"{spec.role}-") + f"{_host_part(a)}:{spec.port}"}
                if spec.role == "decode":
                    body["kv_addr"] = f"tcp://{_host_part(a)}:{spec.kv_port}"
                else:
                    body["local_policy"] = spec.local_policy
                    if spec.kv_events_port is not None:
                        body["kv_events"] = f"tcp://{_host_part(a)}:{spec.kv_events_port}"
                    if spec.publish_port is not None:
                        body["publish"] = f"tcp://{_host_part(a)}:{spec.publish_port}"
                try:
                    self.add(body, source=source)
                    self._refused.discard(url)
                except ApiError as e:   # e.g. the URL of a configured worker: said once, then at debug level
                    level = logging.DEBUG if url in self._refused else logging.WARNING
                    self._refused.add(url)
                    logger.log(level, "discovery of %s: cannot add %s: %s", spec.host, url, e.message)
            elif w.name in self._drained_by_discovery:
                self.drain(w.name, on=False, source=source)     # back before it left
        for url, w in mine.items():
            if url in want:
                continue
            if not w.draining:
                self.drain(w.name, source=source)
            self._drained_by_discovery.add(w.name)     # its address is gone: it leaves once idle
            if not w.active:
                self.remove(w.name, source=source)


# -- the admin routes --------------------------------------------------------------------------------
def add_admin_routes(app, D, read_body, parse_json, error) -> None:
    """``/admin/workers`` on ``app`` (see the module's docstring)."""
    M = D.metrics
    members: Membership = D.membership

    def authorize(request: Request) -> None:
        if D.admin_key is None:
            M.rejected.labels("admin_auth").inc()
            raise ApiError(403, "the admin API is off: start the dispatcher with --admin-key-file "
                                "(dispatcher.admin_key_file)", code="admin_api_off")
        key = bearer_key(request.headers)
        if not key:
            M.rejected.labels("admin_auth").inc()
            raise ApiError(401, "missing admin key: send 'Authorization: Bearer <admin key>'",
                           type="authentication_error", code="missing_api_key")
        if not hmac.compare_digest(key.encode("utf-8", "replace"), D.admin_key.encode()):
            M.rejected.labels("admin_auth").inc()
            raise ApiError(401, "invalid admin key", type="authentication_error", code="invalid_api_key")

    async def call(request: Request, op, status: int = 200):
        try:
            authorize(request)
            return JSONResponse(await op(), status_code=status)
        except ApiError as e:
            return error(e)

    def one(w: Worker) -> dict:
        return members.registry.status([w])[0]

    @app.get("/admin/workers")
    async def list_workers(request: Request):
        async def op():
            return {"object": "list", "data": members.list()}
        return await call(request, op)

    @app.post("/admin/workers")
    async def add_worker(request: Request):
        async def op():
            raw = await read_body(request)
            if len(raw) > MAX_ADMIN_BODY_BYTES:
                raise ApiError(413, f"an admin request body is at most {MAX_ADMIN_BODY_BYTES} bytes")
            return one(members.add(parse_json(raw)))
        return await call(request, op, 201)

    @app.post("/admin/workers/{name}/drain")
    async def drain_worker(request: Request, name: str):
        async def op():
            return one(members.drain(name))
        return await call(request, op)

    @app.post("/admin/workers/{name}/resume")
    async def resume_worker(request: Request, name: str):
        async def op():
            return one(members.drain(name, on=False))
        return await call(request, op)

    @app.delete("/admin/workers/{name}")
    async def remove_worker(request: Request, name: str):
        async def op():
            force = request.query_params.get("force", "false").lower()
            if force not in ("true", "false", "1", "0"):
                raise ApiError(400, f"force must be true or false, got {force!r:.40}", param="force")
            return one(members.remove(name, force=force in ("true", "1")))
        return await call(request, op)


__all__ = ["Membership", "add_admin_routes", "resolve"]
