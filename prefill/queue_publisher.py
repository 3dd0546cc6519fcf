"""A prefill worker publishes its queued prefill work (issue 15: several dispatchers).

With N dispatchers in front of the same workers, each keeps its own PrefillQueueMap and
routes blind to the others' dispatches. A worker started with ``--publish-queue ADDR``
therefore publishes, every ``--publish-interval`` seconds, what waits for prefill in its
engine, on a ZeroMQ PUB socket bound at ADDR; each dispatcher configured with that
address (``publish = ADDR`` in its ``[[prefill]]`` entry) subscribes
(:mod:`proserve.dispatcher.publication`) and feeds it to
:meth:`proserve.scheduler.host.RouterHost.published`, which merges it with its own
dispatches the publication does not list yet -- what the simulator's ``dispatcher_sync =
"publish"`` does (``sim/cluster.py``).

The queue lives in the scheduler plugin (:mod:`proserve.prefill.engine_scheduler`), in
vLLM's engine-core process: the plugin hands this publisher a snapshot of its queue at the
start of every step and after it (:meth:`QueuePublisher.snapshot`), and a thread of the
publisher sends the latest snapshot every interval, whether or not the engine steps (an
idle engine keeps saying "nothing queued"; a dispatcher that hears nothing for a few
intervals falls back to its own view).

**Wire format** (version 1): two frames, the topic :data:`TOPIC` and a msgpack map::

    {"v": 1, "seq": n,              # 0, 1, 2, ... per publisher (restarts from 0)
     "age": s,                      # seconds since the snapshot was taken (its state is as of then)
     "q": [[id, class, weight, ttft_slo, tpot_slo, waited, l_q, l_kv, prompt_len], ...],
     "more": k,                     # requests left out beyond MAX_ENTRIES (0 normally)
     "nd": n_d, "dkv": kv}          # co-located only: its decodes and their KV tokens (prompts)

one entry per request waiting for prefill, in the engine's queue order: ``id`` the
dispatcher's request id (``vllm_xargs.dispatch_id``; the engine's own id for a request that
came without one), its class, weight and SLOs (seconds), ``waited`` seconds since it reached
the engine (an age, not a timestamp: the hosts' clocks need not agree), ``l_q`` prefill
tokens still to compute, ``l_kv`` tokens already in its KV, ``prompt_len`` its prompt.

**Security.** Without keys the address must be loopback (``tcp://127.0.0.1:PORT``,
``ipc://``; the default), unless ``insecure``. With ``--publish-keys DIR`` (the layout of
:mod:`proserve.kvtransfer.auth`: ``server.key_secret`` and ``clients/*.key`` on the worker,
``client.key_secret`` and ``server.key`` on the dispatchers; ``python -m
proserve.kvtransfer.keys DIR`` makes a set) the socket is a CURVE server and admits only
the listed client keys (ZAP, failing closed), as the KV receiver does.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

log = logging.getLogger("proserve.prefill.queue_publisher")

TOPIC = b"proserve.queue.v1"
VERSION = 1
#: at most this many requests per publication (the rest are counted in "more")
MAX_ENTRIES = 4096
#: longest request id / class name published (longer ones are cut)
MAX_ID = 256
MAX_CLASS = 64
#: default publication interval, seconds
DEFAULT_INTERVAL_S = 0.1
#: xargs key carrying the dispatcher's request id (proserve.dispatcher.requests.Job.xargs)
DISPATCH_ID_KEY = "dispatch_id"

Entry = tuple   # (id, class, weight, ttft_slo, tpot_slo, t_arrived_monotonic, l_q, l_kv, prompt_len)


class _Stats:
    """What the ZAP handler counts (kvtransfer.receiver's handler wants an ``add``)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


def check_address(address: str, keys_dir: str | None, insecure: bool) -> None:
    """ValueError unless ``address`` may be bound with these settings."""
    from proserve.kvtransfer.auth import is_loopback
    if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
        raise ValueError(f"publish address must be a ZeroMQ address like tcp://127.0.0.1:15700, got {address!r}")
    if not keys_dir and not insecure and not is_loopback(address):
        raise ValueError(f"publish address {address} is not a loopback address: give CURVE keys (--publish-keys "
                         f"DIR) or, on a trusted network, --publish-insecure")


def encode(seq: int, age: float, entries: Sequence[Sequence], now: float, more: int = 0,
           n_decode: int | None = None, decode_kv: float | None = None) -> list[bytes]:
    """The frames of one publication; ``entries`` as :data:`Entry`, ``now`` on their clock."""
    q = []
    for rid, cls, weight, ttft, tpot, t_in, l_q, l_kv, prompt_len in entries[:MAX_ENTRIES]:
        q.append([str(rid)[:MAX_ID], str(cls)[:MAX_CLASS], float(weight), float(ttft), float(tpot),
                  max(0.0, float(now - t_in)), int(max(0, l_q)), int(max(0, l_kv)), int(max(1, prompt_len))])
    msg: dict[str, Any] = {"v": VERSION, "seq": int(seq), "age": max(0.0, float(age)), "q": q,
                           "more": int(more) + max(0, len(entries) - MAX_ENTRIES)}
    if n_decode is not None:
        msg["nd"] = int(n_decode)
        msg["dkv"] = float(decode_kv or 0.0)
    return [TOPIC, msgpack.packb(msg, use_bin_type=True)]


class QueuePublisher:
    """The PUB socket and the thread that sends the latest snapshot every ``interval_s``."""

    def __init__(self, address: str, interval_s: float = DEFAULT_INTERVAL_S, keys_dir: str | None = None,
                 insecure: bool = False, clock: Callable[[], float] = time.monotonic):
        check_address(address, keys_dir, insecure)
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and 0.001 <= interval_s <= 60):
            raise ValueError(f"publish interval must be between 0.001 and 60 s, got {interval_s!r}")
        self.address, self.interval_s, self.clock = address, float(interval_s), clock
        self.stats = _Stats()
        self.seq = 0
        self._snap: tuple = (clock(), (), None, None)   # (taken at, entries, n_decode, decode_kv)
        self._arrived: dict[str, tuple[str, float]] = {}   # engine id -> (dispatcher id, when it arrived)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._auth = None
        sock = self._ctx.socket(zmq.PUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)      # a slow subscriber loses old snapshots, never blocks us
            if keys_dir:
                from proserve.kvtransfer.auth import ServerKeys
                from proserve.kvtransfer.receiver import _ZapHandler
                keys = ServerKeys.load(keys_dir)
                self._auth = _ZapHandler(self._ctx, keys.allowed_clients, self.stats, "queue-publisher")
                sock.curve_server = True
                sock.curve_publickey = keys.public
                sock.curve_secretkey = keys.secret
                sock.setsockopt(zmq.ZAP_DOMAIN, b"proserve-queue")
                sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)   # fail closed
            if "[" in address:
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(address)
        except Exception:
            sock.close(0)
            self._close_ctx()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="proserve-queue-publisher", daemon=True)
        self._thread.start()
        log.info("publishing the prefill queue on %s every %.3f s%s", address, self.interval_s,
                 " (CURVE)" if keys_dir else "")

    # -- what the scheduler plugin calls -----------------------------------------------------
    def arrived(self, engine_id: str, dispatch_id: str | None) -> None:
        """A request reached the engine (its dispatcher's id, if it came with one)."""
        self._arrived[engine_id] = (dispatch_id or engine_id, self.clock())

    def forget(self, engine_id: str) -> None:
        self._arrived.pop(engine_id, None)

    def prune(self, alive: Callable[[str], bool]) -> None:
        """Forget the engine requests for which ``alive`` is false (ended)."""
        for rid in [r for r in self._arrived if not alive(r)]:
            del self._arrived[rid]

    def identity(self, engine_id: str) -> tuple[str, float]:
        """(published id, arrival time on this publisher's clock) of an engine request."""
        got = self._arrived.get(engine_id)
        if got is None:
            got = self._arrived[engine_id] = (engine_id, self.clock())
        return got

    def snapshot(self, entries: Sequence[Entry], n_decode: int | None = None,
                 decode_kv: float | None = None) -> None:
        """The queue as of now (replaces the previous snapshot; the thread sends it)."""
        self._snap = (self.clock(), tuple(entries), n_decode, decode_kv)

    # -- the thread ------------------------------------------------------------------------------
    def publish_once(self) -> None:
        taken, entries, n_d, kv = self._snap
        now = self.clock()
        frames = encode(self.seq, now - taken, entries, now, 0, n_d, kv)
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.seq += 1

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    self.publish_once()
                except zmq.ZMQError as e:
                    if self._stop.is_set():
                        break
                    log.warning("queue publication failed: %s", e)
        finally:
            self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._close_ctx()

    def _close_ctx(self) -> None:
        if self._auth is not None:
            if not self._auth.stop():
                return   # term() would wait for its socket
            self._auth = None
        t = threading.Thread(target=self._ctx.term, daemon=True)
        t.start()
        t.join(timeout=5)


def from_config(cfg) -> QueuePublisher | None:
    """The publisher an :class:`~proserve.prefill.engine_config.EngineConfig` asks for, or None."""
    addr = getattr(cfg, "publish_queue", None)
    if not addr:
        return None
    return QueuePublisher(addr, cfg.publish_interval_s, cfg.publish_keys, cfg.publish_insecure)


__all__ = ["DISPATCH_ID_KEY", "MAX_ENTRIES", "TOPIC", "VERSION", "QueuePublisher", "check_address", "encode",
           "from_config"]
