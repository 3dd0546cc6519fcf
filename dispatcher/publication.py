"""Several dispatchers (issue 15): each reads the prefill workers' queue publications.

Each dispatcher keeps its own PrefillQueueMap; with N dispatchers behind one address each
would route blind to the others' dispatches. A prefill worker started with
``--publish-queue-port`` publishes what waits for prefill in its engine every
``--publish-interval`` (:mod:`proserve.prefill.queue_publisher`, which documents the wire
format), and a dispatcher whose ``[[prefill]]`` entry names that address (``publish =
"tcp://HOST:PORT"``; ``--prefill URL,publish=ADDR``) keeps a ZeroMQ SUB socket on it
(:class:`Subscriber`, one asyncio task per worker) and hands every publication to
:meth:`proserve.scheduler.host.RouterHost.published`: its view of the worker becomes the
publication plus its own dispatches the publication does not list yet, as the simulator's
``dispatcher_sync = "publish"`` does. Its own requests keep moving the map by their events as
before.

What becomes of a published entry (:meth:`Publications.apply`): one of this dispatcher's own
requests queued there is its own :class:`~proserve.scheduler.request.Request` (the published
``l_q``/``l_kv`` become its recorded work); one of its own that it no longer has queued there
(the publication is older than the completion signal it already heard; the dispatcher remembers
the ids of its last :data:`MAX_OWN_IDS` dispatches) is left out; any other
is another dispatcher's, a request built from the entry (its arrival: now less the age it
has waited at the worker, so the hosts' clocks need not agree), counted once in
``proserve:dispatcher_publication_foreign_requests{instance}``. The publication's state is as
of ``now - age`` (``ts``: timestamp lag compensation counts the progress since).

Trust and failure: every frame is checked before anything changes (two frames, the topic,
at most :data:`MAX_MESSAGE_BYTES`, msgpack with bounded lengths, version, every field's type
and range, a known class, no repeated id, at most ``MAX_ENTRIES`` entries); a bad one is
dropped and counted (``proserve:dispatcher_publications{result="malformed"}``), never ending
the loop. A worker silent for ``publication_stale_intervals`` intervals (or whose frames are
all bad) is *stale*: the dispatcher's view of it falls back to its own dispatches
(``RouterHost.published`` with nothing published: only its own queued requests stay, with
the work last recorded for them), ``proserve:dispatcher_publication_fresh{instance}`` is 0,
until the next good publication. With ``publication_keys`` the socket is a CURVE client that
checks the worker's server key (the worker's ``--publish-keys`` admits this dispatcher's
client key); a non-loopback address without keys needs ``publication_insecure = true``.

A worker's address comes from its ``[[prefill]]`` entry (or ``--prefill``), the admin API's add
body (``"publish"``) or a ``[[discover]]`` entry's ``publish_port``; the supervisor
(:meth:`Publications.tick`, every interval) subscribes to every current worker that has one
and drops those of workers removed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from proserve.prefill.queue_publisher import MAX_CLASS, MAX_ENTRIES, MAX_ID, TOPIC, VERSION
from proserve.scheduler.request import Phase, Request

logger = logging.getLogger("proserve.dispatcher")

#: largest frame accepted (libzmq drops a publisher sending more, msgpack refuses more too)
MAX_MESSAGE_BYTES = 2 << 20
#: bounds of the published numbers
MAX_TOKENS = 1 << 24
MAX_AGE_S = 60.0
MAX_WAITED_S = 86400.0
MAX_SLO_S = 3600.0
MAX_WEIGHT = 1e6
MAX_DECODES = 1 << 20
_ENTRY_LEN = 9
_KEYS = {"v", "seq", "age", "q", "more", "nd", "dkv"}
#: this dispatcher's own request ids remembered (to tell its requests from the others' in a
#: publication older than their completion here)
MAX_OWN_IDS = 65536
_RETRY_S = 0.2
_RETRY_MAX_S = 5.0


class BadPublication(ValueError):
    """A frame that is not a well-formed publication (the message says what is wrong)."""


@dataclass
class Publication:
    seq: int
    age: float
    entries: list[tuple]      # (id, class, weight, ttft_slo, tpot_slo, waited, l_q, l_kv, prompt_len)
    more: int = 0
    n_decode: int | None = None
    decode_kv: float | None = None


def _num(v: Any, what: str, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadPublication(f"{what}: not a number")
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise BadPublication(f"{what}: {v!r} out of range")
    return v


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadPublication(f"{what}: not an integer in [{lo}, {hi}]")
    return v


def _str(v: Any, what: str, n: int) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= n:
        raise BadPublication(f"{what}: not a string of 1-{n} characters")
    return v


def decode(frames: list[bytes], classes: Mapping[str, Any]) -> Publication:
    """Check and decode one message; :class:`BadPublication` if anything is off."""
    if len(frames) != 2 or frames[0] != TOPIC:
        raise BadPublication("not a queue publication (frames or topic)")
    payload = frames[1]
    if len(payload) > MAX_MESSAGE_BYTES:
        raise BadPublication("too large")
    try:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True,
                              max_str_len=4096, max_bin_len=0,
                              max_array_len=MAX_ENTRIES + 16, max_map_len=len(_KEYS) + 8, max_ext_len=0)
    except (ValueError, TypeError, RecursionError, msgpack.exceptions.UnpackException) as e:   # ExtraData, ...
        raise BadPublication(f"not msgpack ({type(e).__name__})") from None
    if not isinstance(msg, dict):
        raise BadPublication("not a map")
    if msg.get("v") != VERSION:
        raise BadPublication(f"version {msg.get('v')!r:.20}, expected {VERSION}")
    seq = _int(msg.get("seq"), "seq", 0, (1 << 63) - 1)
    age = _num(msg.get("age"), "age", 0.0, MAX_AGE_S)
    q = msg.get("q")
    if not isinstance(q, list) or len(q) > MAX_ENTRIES:
        raise BadPublication(f"q: not a list of at most {MAX_ENTRIES} entries")
    more = _int(msg.get("more", 0), "more", 0, MAX_TOKENS)
    entries, seen = [], set()
    for i, e in enumerate(q):
        w = f"q[{i}]"
        if not isinstance(e, list) or len(e) != _ENTRY_LEN:
            raise BadPublication(f"{w}: not a list of {_ENTRY_LEN} fields")
        rid = _str(e[0], f"{w}.id", MAX_ID)
        if rid in seen:
            raise BadPublication(f"{w}.id: repeated")
        seen.add(rid)
        cls = _str(e[1], f"{w}.class", MAX_CLASS)
        if cls not in classes:
            raise BadPublication(f"{w}.class: {cls!r:.70} is not a class of this dispatcher")
        weight = _num(e[2], f"{w}.weight", 0.0, MAX_WEIGHT, lo_open=True)
        ttft = _num(e[3], f"{w}.ttft_slo", 0.0, MAX_SLO_S, lo_open=True)
        tpot = _num(e[4], f"{w}.tpot_slo", 0.0, MAX_SLO_S, lo_open=True)
        waited = _num(e[5], f"{w}.waited", 0.0, MAX_WAITED_S)
        l_q = _int(e[6], f"{w}.l_q", 0, MAX_TOKENS)
        l_kv = _int(e[7], f"{w}.l_kv", 0, MAX_TOKENS)
        prompt_len = _int(e[8], f"{w}.prompt_len", 1, MAX_TOKENS)
        entries.append((rid, cls, weight, ttft, tpot, waited, l_q, l_kv, prompt_len))
    n_d = kv = None
    if "nd" in msg or "dkv" in msg:
        n_d = _int(msg.get("nd"), "nd", 0, MAX_DECODES)
        kv = _num(msg.get("dkv"), "dkv", 0.0, float(MAX_DECODES) * MAX_TOKENS)
    return Publication(seq, age, entries, more, n_d, kv)


class Subscriber:
    """The SUB socket on one worker's publication address and the task reading it."""

    def __init__(self, hub: Publications, worker, endpoint: str):
        self.hub, self.worker, self.endpoint = hub, worker, endpoint
        self.last: float | None = None        # time.time() of the last good publication
        self.fresh = False
        self.foreign: set[str] = set()        # other dispatchers' requests in the last publication
        self.last_seq: int | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> Subscriber:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"publication-{self.worker.name}")
        return self

    def stop(self) -> asyncio.Task | None:
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
        return t

    async def _run(self) -> None:
        delay = _RETRY_S
        while True:
            try:
                await self._session()
                delay = _RETRY_S
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("prefill worker %s: queue subscription to %s failed; retrying",
                                 self.worker.name, self.endpoint)
                delay = min(_RETRY_MAX_S, 2 * delay)
            await asyncio.sleep(delay)

    async def _session(self) -> None:
        sock = self.hub.ctx().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 64)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 1024)
            sock.setsockopt(zmq.RECONNECT_IVL, 200)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            keys = self.hub.keys
            if keys is not None:
                sock.curve_publickey = keys.public
                sock.curve_secretkey = keys.secret
                sock.curve_serverkey = keys.server_public
            if "[" in self.endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
            sock.connect(self.endpoint)
            while True:
                frames = [await sock.recv()]
                while sock.getsockopt(zmq.RCVMORE):
                    f = await sock.recv()
                    if len(frames) < 3:        # more than 2 frames is malformed anyway: keep 3 to say so
                        frames.append(f)
                self.hub.receive(self, frames)
        finally:
            sock.close(0)


class Publications:
    """The dispatcher's subscriptions to its prefill workers' queue publications."""

    def __init__(self, dispatcher):
        self.d = dispatcher
        cfg = dispatcher.cfg
        self.interval_s = float(cfg.publication_interval_s)
        self.stale_after_s = self.interval_s * cfg.publication_stale_intervals
        self.keys = None
        if cfg.publication_keys:
            from proserve.kvtransfer.auth import ClientKeys, KeysError
            from proserve.scheduler.request import ConfigError
            try:
                self.keys = ClientKeys.load(cfg.publication_keys)
            except KeysError as e:
                raise ConfigError(f"dispatcher.publication_keys: {e}") from None
        self.subs: dict[str, Subscriber] = {}   # worker name -> its subscriber
        self.own: OrderedDict[str, None] = OrderedDict()   # ids this dispatcher dispatched, latest last
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None

    def dispatched(self, rid: str) -> None:
        """This dispatcher sent request ``rid`` to a prefill worker (remembered, bounded)."""
        self.own[rid] = None
        self.own.move_to_end(rid)
        if len(self.own) > MAX_OWN_IDS:
            self.own.popitem(last=False)

    def ctx(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:   # workers with an address may also join later (admin API, discovery)
            self.tick(time.time())
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="publications")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick(time.time())
            except Exception:   # never let the supervisor die: say so and go on
                logger.exception("queue publications: supervisor step failed")

    def tick(self, now: float) -> None:
        """A subscriber for every current prefill worker with an address, none for the others;
        a worker silent for too long falls back to this dispatcher's own view."""
        current = {}
        for w in self.d.registry.prefill:
            addr = w.publish
            if addr and not w.removed:
                current[w.name] = (w, addr)
        for name in list(self.subs):
            if name not in current or self.subs[name].worker is not current[name][0]:
                self._drop(name)
        for name, (w, addr) in current.items():
            if name not in self.subs:
                self.subs[name] = Subscriber(self, w, addr).start()
                self.d.metrics.publication_fresh.labels(name).set(0)
        self.check_stale(now)

    def check_stale(self, now: float) -> None:
        """Every worker silent for longer than ``publication_stale_intervals`` falls back."""
        for sub in self.subs.values():
            if sub.fresh and (sub.last is None or now - sub.last > self.stale_after_s):
                self.fall_back(sub)

    def _drop(self, name: str) -> None:
        sub = self.subs.pop(name)
        sub.stop()
        m = self.d.metrics
        for metric, labels in ((m.publication_fresh, [(name,)]), (m.publication_foreign, [(name,)]),
                               (m.publications, [(name, r) for r in ("ok", "malformed", "stale")])):
            for lab in labels:
                try:
                    metric.remove(*lab)
                except KeyError:
                    pass

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        tasks = [t for t in (s.stop() for s in self.subs.values()) if t is not None]
        self.subs.clear()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- one publication ---------------------------------------------------------------------
    def receive(self, sub: Subscriber, frames: list[bytes], now: float | None = None) -> bool:
        """Check ``frames`` and apply them to ``sub``'s worker; False (counted) if dropped."""
        now = time.time() if now is None else now
        name = sub.worker.name
        try:
            pub = decode(frames, self.d.cfg.classes)
        except BadPublication as e:
            self.d.metrics.publications.labels(name, "malformed").inc()
            logger.debug("prefill worker %s: dropped a queue publication: %s", name, e)
            return False
        w = sub.worker
        if w.removed or not any(x is w for x in self.d.registry.prefill):
            return False
        try:
            self.apply(sub, pub, now)
        except Exception:   # a bug, not bad input: keep listening, say so
            logger.exception("prefill worker %s: applying a queue publication", name)
            self.d.metrics.publications.labels(name, "malformed").inc()
            return False
        if not sub.fresh:
            logger.info("prefill worker %s: its queue publications arrive (%s)", name, sub.endpoint)
        sub.last, sub.fresh, sub.last_seq = now, True, pub.seq
        self.d.metrics.publications.labels(name, "ok").inc()
        self.d.metrics.publication_fresh.labels(name).set(1)
        return True

    def apply(self, sub: Subscriber, pub: Publication, now: float) -> None:
        """``RouterHost.published`` with what ``pub`` lists (see the module's docstring)."""
        rh = self.d.router_host
        inst = sub.worker.state.id
        p = rh.qmap[inst]
        known = {r.id: r for r in p.queue}
        queued, foreign = [], set()
        for rid, cls, weight, ttft, tpot, waited, l_q, l_kv, prompt_len in pub.entries:
            own = rh.placed(rid) or rid in self.own
            r = known.get(rid)
            if r is None:
                if own:
                    continue   # ours, no longer queued there as far as we know: the publication is older
                r = Request(id=rid, priority=cls, weight=weight, ttft_slo=ttft, tpot_slo=tpot, arrival=now - waited,
                            prompt_len=prompt_len, prefill_len=max(1, l_q + l_kv), prefilled=l_kv, kv_len=l_kv,
                            phase=Phase.PREFILLING if l_kv else Phase.WAITING, instance=inst)
            elif not own:      # another dispatcher's, seen before: its progress
                r.prefill_len, r.prefilled, r.kv_len = max(1, l_q + l_kv), l_kv, l_kv
            if not own:
                foreign.add(rid)
            queued.append((r, l_q, l_kv))
        new = len(foreign - sub.foreign)
        sub.foreign = foreign
        if new:
            self.d.metrics.publication_foreign.labels(sub.worker.name).inc(new)
        n_d = kv = None
        if self.d.colocated and pub.n_decode is not None:
            n_d, kv = pub.n_decode, pub.decode_kv
        rh.published(inst, queued, now - pub.age, n_d, kv)

    def fall_back(self, sub: Subscriber) -> None:
        """``sub``'s worker went silent: the view of it is this dispatcher's own again."""
        rh = self.d.router_host
        name = sub.worker.name
        sub.fresh, sub.foreign = False, set()
        if not sub.worker.removed and any(x is sub.worker for x in self.d.registry.prefill):
            inst = sub.worker.state.id
            # co-located: n_d from this dispatcher's own decodes there, not the last publication's
            n_d, kv = rh.own_decodes(inst) if self.d.colocated else (None, None)
            rh.published(inst, [], rh.qmap[inst].ts, n_d, kv)
        self.d.metrics.publications.labels(name, "stale").inc()
        self.d.metrics.publication_fresh.labels(name).set(0)
        logger.warning("prefill worker %s: no queue publication for %.2f s; routing on this dispatcher's own view "
                       "of it until the next", name, self.stale_after_s)


__all__ = ["BadPublication", "Publication", "Publications", "Subscriber", "decode"]
