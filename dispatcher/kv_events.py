"""The precise prefix-cache index (issue 14): each prefill worker's index driven by its
engine's KV-cache events instead of by the prompts routed there.

A prefill worker started with ``--kv-events-port PORT`` publishes vLLM's events
(:mod:`proserve.prefill.kv_events`): ``BlockStored`` (full blocks entered its prefix cache:
their vLLM hashes, the parent block's hash, their token ids, the block size),
``BlockRemoved`` (blocks evicted) and ``AllBlocksCleared``, in batches numbered 0, 1, 2, ...
Its ``[[prefill]]`` entry names the address (``kv_events = "tcp://HOST:PORT"``; the admin API's
add body takes the same field, ``[[discover]]`` a ``kv_events_port``), and the dispatcher keeps
a ZeroMQ SUB socket on it (:class:`Subscriber`, an asyncio task per worker, started when the
worker's health check passes, stopped when it is marked down or removed -- its index goes with
it, as the approximate index does), a CURVE client with ``dispatcher.kv_events_keys`` (a
non-loopback address without keys is refused unless ``kv_events_insecure = true``).

Each stored block is mapped from vLLM's hash to the dispatcher's own block id
(:func:`proserve.scheduler.prefix.extend_block_id` from the parent's id and the block's tokens),
so the ids equal what :func:`~proserve.scheduler.prefix.block_ids` gives for a prompt with those
tokens, and inserted into the worker's :class:`~proserve.scheduler.prefix.BlockLRU`
(``PrefillInstance.prefix``, what GoRouting and the cache-aware baselines read); a removed block
leaves it, a clear empties it. The dispatcher hashes prompts in ``prefix_block_tokens`` tokens
per block (the gcd of the indexed workers' block sizes); a worker's block of a multiple of that
is inserted as its sub-blocks. Blocks the dispatcher's ids cannot describe are ignored (counted):
LoRA or extra-key blocks (cache salt, multimodal), another medium than the engine's own pool
("GPU", also on CPU), a KV-cache group other than 0, a block whose parent it never saw (stored
before it subscribed), events before the worker's cache size is known.

Trust: the index is kept only while it follows every event. A sequence gap (the PUB socket
dropped batches: a slow dispatcher over ZeroMQ's high-water mark), a restart (the numbers go
back: a new engine, its cache empty), a reconnection, or a batch or event that cannot be
decoded or applied clears it (``proserve:dispatcher_kv_event_resets{reason}``) and it
relearns from the next events. vLLM's replay socket is not used (see
:mod:`proserve.prefill.kv_events`). A frame that is not an event batch at all (wrong frame
count, a sequence number of the wrong size) is dropped and counted as malformed without a
reset (the next number shows whether a batch was lost).

Defensive decoding: every frame is bounded (ZeroMQ ``MAXMSGSIZE``, msgpack length limits, at most
:data:`MAX_EVENTS` events a batch, :data:`MAX_BLOCKS` blocks an event, block sizes up to
:data:`MAX_BLOCK_SIZE`), every field is type- and range-checked before anything changes, and
nothing a publisher sends can end the loop: bad input is counted
(``proserve:dispatcher_kv_events{result="malformed"}``) and dropped. The hash map is bounded too
(twice the index's capacity, plus slack; beyond that its oldest entries go, with their blocks).

Dispatches still insert their prompt's blocks at once (``PrefillQueueMap.add``, as without
events): a block is stored only when the engine schedules the request's prefill, after its queue
wait, and a burst of requests sharing a new prefix should meet at the worker that will hold it,
not spread because the first one's blocks are not stored yet. Those provisional blocks are
confirmed (refreshed) by their ``BlockStored``; one whose request never ran stays until the LRU
bound or a reset drops it (see README, "prefix_index"). With events the index also learns what
the dispatcher did not route (other dispatchers' requests, issue 15) and forgets what the
engine evicted.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from proserve.scheduler.prefix import BlockLRU, extend_block_id

logger = logging.getLogger("proserve.dispatcher")

#: largest frame accepted (libzmq drops a publisher sending more; msgpack refuses more too)
MAX_MESSAGE_BYTES = 16 << 20
#: at most this many events in one batch, blocks in one event, tokens in one block
MAX_EVENTS = 65536
MAX_BLOCKS = 65536
MAX_BLOCK_SIZE = 1 << 16
#: a block hash: vLLM's are 32 bytes (sha256) or 64-bit ints
MAX_HASH_BYTES = 64
#: frames of a message kept (vLLM sends 3: topic, sequence number, payload)
_MAX_FRAMES = 4
_U64 = 1 << 64
#: the medium of the engine's own KV pool in vLLM's events (CPU backend included)
OWN_MEDIUM = "GPU"
#: messages handled per wake-up before yielding to the event loop
_BURST = 64
#: pause before a new subscription socket; it doubles up to the second while none gets through
_RETRY_S, _RETRY_MAX_S = 0.2, 5.0


class BadEvent(ValueError):
    """A frame, batch or event that is not what vLLM sends (the message says what)."""


def _hash(v: Any, what: str):
    if isinstance(v, bytes) and 0 < len(v) <= MAX_HASH_BYTES:
        return v
    if type(v) is int and -(1 << 63) <= v < _U64:
        return v
    raise BadEvent(f"{what}: a block hash is 1-{MAX_HASH_BYTES} bytes or a 64-bit int, got {type(v).__name__}")


def _hashes(v: Any, what: str) -> list:
    if not isinstance(v, list) or not v or len(v) > MAX_BLOCKS:
        raise BadEvent(f"{what}: a list of 1-{MAX_BLOCKS} block hashes")
    return [_hash(h, what) for h in v]


def decode_batch(payload: bytes) -> list[dict]:
    """The events of one ``KVEventBatch`` payload (vLLM's msgpack: ``[ts, [event, ...], dp_rank]``,
    each event a map with its ``type``), checked down to the event level (each event's own
    fields are checked as it is applied). BadEvent otherwise."""
    if not isinstance(payload, bytes) or len(payload) > MAX_MESSAGE_BYTES:
        raise BadEvent("payload: not bytes, or too large")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True,
                                # strings and bins only up to the frame's own bound: a client's long
                                # request field (vLLM passes e.g. session_id into BlockStored) must
                                # not make the step's whole batch undecodable; hashes are checked
                                # for their length where they are read (_hash)
                                max_str_len=MAX_MESSAGE_BYTES, max_bin_len=MAX_MESSAGE_BYTES,
                                max_array_len=1 << 20,
                                max_map_len=64, max_ext_len=0)
    except Exception as e:  # noqa: BLE001 -- FormatError, StackError, ExtraData, ValueError, UnicodeDecodeError...
        raise BadEvent(f"payload: not msgpack ({type(e).__name__})") from None
    if not isinstance(batch, list) or len(batch) < 2:
        raise BadEvent("payload: not an event batch [ts, events, ...]")
    ts, events = batch[0], batch[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise BadEvent("payload: the batch time is not a number")
    if not isinstance(events, list) or len(events) > MAX_EVENTS:
        raise BadEvent(f"payload: events is not a list of at most {MAX_EVENTS}")
    return events


class EventIndex:
    """One prefill worker's event-driven prefix index: applies its event batches to its
    ``PrefillInstance.prefix``. No I/O (:class:`Subscriber` feeds it), so tests drive it
    directly too.

    ``unit``: the dispatcher's tokens per prefix block now (``Registry.prefix_block_tokens``);
    ``metrics``: the dispatcher's :class:`~proserve.dispatcher.metrics.Metrics` (or None)."""

    def __init__(self, name: str, state, unit: Callable[[], int], metrics=None):
        self.name = name
        self.state = state                  # PrefillInstance
        self.unit = unit
        self.metrics = metrics
        self.last_seq: int | None = None
        self.counts: dict[str, int] = {}    # results and resets, as counted (also without metrics)
        self._map: OrderedDict[Any, tuple[int, ...]] = OrderedDict()   # vLLM hash -> our (sub-)block ids
        self._lru: BlockLRU | None = None
        self._unit = 0

    def __len__(self) -> int:
        return len(self._map)

    # -- counting --------------------------------------------------------------------------
    def _count(self, result: str, n: int = 1) -> None:
        if n:
            self.counts[result] = self.counts.get(result, 0) + n
            if self.metrics is not None:
                self.metrics.kv_events.labels(self.name, result).inc(n)

    def reset(self, reason: str) -> None:
        """The index can no longer be trusted: clear it (and the hash map); counted by reason."""
        key = f"reset_{reason}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.kv_event_resets.labels(self.name, reason).inc()
        logger.info("prefill worker %s: KV-event prefix index cleared (%s)", self.name, reason)
        self._map.clear()
        if self._lru is not None:
            self._lru.clear()

    def disconnected(self) -> None:
        """The subscription broke: what was published meanwhile is lost."""
        self.last_seq = None
        self.reset("reconnect")

    # -- input -----------------------------------------------------------------------------
    def receive(self, frames: list[bytes]) -> None:
        """One message ``[topic, seq, payload]`` as vLLM publishes it. Never raises for bad input."""
        if len(frames) != 3 or not isinstance(frames[1], bytes) or len(frames[1]) != 8:
            self._count("malformed")      # not a batch: no sequence number consumed
            return
        seq = int.from_bytes(frames[1], "big")
        last, self.last_seq = self.last_seq, seq
        if last is not None and seq != last + 1:
            self.reset("gap" if seq > last else "restart")
        try:
            events = decode_batch(frames[2])
        except BadEvent as e:
            logger.debug("prefill worker %s: dropped a KV-event batch: %s", self.name, e)
            self._count("malformed")
            self.reset("lost")             # its events are lost: so is the index's precision
            return
        for ev in events:
            try:
                result = self._apply(ev)
            except BadEvent as e:
                logger.debug("prefill worker %s: dropped a KV event: %s", self.name, e)
                self._count("malformed")
                self.reset("malformed")
                continue
            self._count(result)

    # -- the index -------------------------------------------------------------------------
    def _index(self) -> BlockLRU | None:
        """The worker's BlockLRU as the events see it: a dropped or replaced index (marked
        down, its cache size changed), or a new hashing unit, starts the hash map over; made
        when the cache size is known and none exists."""
        p, unit = self.state, self.unit()
        if p.prefix is not self._lru:       # dropped or replaced: what it held is someone else's now
            self._map.clear()
            self._lru = p.prefix
        if unit != self._unit:              # ids of another block length: none would match any more
            if self._unit and self._lru is not None:
                # a fresh index sized in the new unit (clearing would keep the old capacity)
                p.prefix = self._lru = BlockLRU(p.cache_tokens // unit) if p.cache_tokens and unit else None
            self._map.clear()
            self._unit = unit
        if self._lru is None and p.cache_tokens and unit:
            p.prefix = self._lru = BlockLRU(p.cache_tokens // unit)
        return self._lru

    def _apply(self, ev: Any) -> str:
        if not isinstance(ev, dict):
            raise BadEvent("event: not a map")
        kind = ev.get("type")
        if kind == "BlockStored":
            return self._stored(ev)
        if kind == "BlockRemoved":
            hashes = _hashes(ev.get("block_hashes"), "BlockRemoved.block_hashes")
            if not _own(ev):
                return "ignored"
            lru = self._index()
            for h in hashes:
                ids = self._map.pop(h, None)
                if ids is not None and lru is not None:
                    for b in ids:
                        lru.remove(b)
            return "applied"
        if kind == "AllBlocksCleared":
            lru = self._index()
            self._map.clear()
            if lru is not None:
                lru.clear()
            return "applied"
        if not isinstance(kind, str):
            raise BadEvent("event: no type")
        return "ignored"       # an event type of a later vLLM

    def _stored(self, ev: dict) -> str:
        hashes = _hashes(ev.get("block_hashes"), "BlockStored.block_hashes")
        for k in ("lora_id", "lora_name", "medium", "group_idx"):
            v = ev.get(k)
            if v is not None and not isinstance(v, (int, str)) or isinstance(v, bool):
                raise BadEvent(f"BlockStored.{k}: of the wrong type")
        extra = ev.get("extra_keys")
        if extra is not None and not isinstance(extra, list):
            raise BadEvent("BlockStored.extra_keys: not a list")
        # first what is not ours to index, whatever its other fields hold (vLLM's CPU offload
        # tier stores blocks with no tokens and block_size 0): ignored, not a reset
        if ev.get("lora_id") is not None or ev.get("lora_name") is not None or not _own(ev) \
                or (extra and any(x is not None for x in extra)):
            return "ignored"       # blocks whose vLLM hash holds more than the tokens
        parent = ev.get("parent_block_hash")
        if parent is not None:
            parent = _hash(parent, "BlockStored.parent_block_hash")
        bs = ev.get("block_size")
        if type(bs) is not int or not 1 <= bs <= MAX_BLOCK_SIZE:
            raise BadEvent(f"BlockStored.block_size: an int in [1, {MAX_BLOCK_SIZE}]")
        tokens = ev.get("token_ids")
        if not isinstance(tokens, list) or len(tokens) != len(hashes) * bs:
            raise BadEvent("BlockStored.token_ids: not block_size tokens per block hash")
        for t in tokens:
            if type(t) is not int or not 0 <= t < _U64:
                raise BadEvent("BlockStored.token_ids: token ids are ints in [0, 2**64)")
        lru = self._index()
        unit = self._unit
        if lru is None or not unit or bs % unit:
            return "ignored"       # no index yet, or blocks the dispatcher's unit cannot split
        if parent is None:
            prev = None
        else:
            known = self._map.get(parent)
            if known is None:
                return "ignored"   # stored before we listened (or not indexable): the chain is unknown
            prev = known[-1]
        new: list[int] = []
        per = bs // unit
        for i, h in enumerate(hashes):
            ids = []
            for k in range(per):
                at = i * bs + k * unit
                prev = extend_block_id(prev, tokens[at:at + unit])
                ids.append(prev)
            self._map[h] = tuple(ids)
            self._map.move_to_end(h)
            new.extend(ids)
        lru.insert(new)
        bound = 2 * lru.capacity + 1024
        while len(self._map) > bound:
            _, ids = self._map.popitem(last=False)
            for b in ids:
                lru.remove(b)
        return "applied"


def _own(ev: dict) -> bool:
    """The event is about the engine's own KV pool (medium "GPU" or unnamed, group 0)."""
    medium, group = ev.get("medium"), ev.get("group_idx")
    if medium is not None and not isinstance(medium, str) or group is not None and type(group) is not int:
        raise BadEvent("medium / group_idx: of the wrong type")
    return medium in (None, OWN_MEDIUM) and group in (None, 0)


_MONITORED = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
              | zmq.EVENT_HANDSHAKE_SUCCEEDED)
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Subscriber:
    """The SUB socket on one worker's event address and the task reading it into an
    :class:`EventIndex`. ``keys``: :class:`~proserve.kvtransfer.auth.ClientKeys` (CURVE client;
    the publisher's server key is checked) or None. :meth:`stop` ends it (sockets closed)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, index: EventIndex, keys=None):
        self.ctx, self.endpoint, self.index, self.keys = ctx, endpoint, index, keys
        self.connected = False
        self.last_error = ""
        self._task: asyncio.Task | None = None
        self._lost = self._opened = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> Subscriber:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.index.name}")
        return self

    def stop(self) -> asyncio.Task | None:
        """Cancel the task (its sockets close as it ends); the task, to await if wanted."""
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
        self.connected = False
        return t

    async def _run(self) -> None:
        """Sessions, one socket each: a lost connection ends one and a new socket starts the
        next (libzmq does not reconnect after every error, e.g. a frame over MAXMSGSIZE), after
        a pause that grows (to 5 s) while no session gets through its handshake."""
        delay = _RETRY_S
        while True:
            try:
                opened = await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                opened = False
                if not self.last_error.startswith(type(e).__name__):
                    logger.exception("prefill worker %s: KV-event subscription to %s failed; retrying",
                                     self.index.name, self.endpoint)
                self.last_error = f"{type(e).__name__}: {e}"
            delay = _RETRY_S if opened else min(_RETRY_MAX_S, 2 * delay)
            await asyncio.sleep(delay)

    async def _session(self) -> bool:
        """One socket until its connection is lost (True if its handshake succeeded)."""
        sock = self.ctx.socket(zmq.SUB)
        mon = None
        self._lost = self._opened = False
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 10_000)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.RECONNECT_IVL, 200)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
            if self.keys is not None:
                sock.curve_publickey = self.keys.public
                sock.curve_secretkey = self.keys.secret
                sock.curve_serverkey = self.keys.server_public
            if "[" in self.endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            mon = sock.get_monitor_socket(_MONITORED)
            sock.connect(self.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(mon, zmq.POLLIN)
            while True:
                ready = dict(await poller.poll())
                if mon in ready:
                    while await mon.poll(0):
                        self._monitor(await mon.recv_multipart())
                    if self._lost:
                        return self._opened
                if sock in ready:
                    for _ in range(_BURST):
                        if not await sock.poll(0):
                            break
                        frames = await self._recv(sock)
                        try:
                            self.index.receive(frames)
                        except Exception:   # a bug, not bad input: keep listening, say so
                            logger.exception("prefill worker %s: applying a KV-event batch", self.index.name)
                            self.index._count("malformed")
                            self.index.reset("malformed")
                    await asyncio.sleep(0)
        finally:
            self.connected = False
            if mon is not None:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                mon.close(0)
            sock.close(0)

    @staticmethod
    async def _recv(sock) -> list[bytes]:
        """One message, at most :data:`_MAX_FRAMES` of its frames kept (the rest read and dropped)."""
        frames = [await sock.recv()]
        while sock.getsockopt(zmq.RCVMORE):
            f = await sock.recv()
            if len(frames) < _MAX_FRAMES:
                frames.append(f)
        return frames

    def _monitor(self, msg: list[bytes]) -> None:
        try:
            event = parse_monitor_message(msg)["event"]
        except Exception:  # noqa: BLE001 -- a monitor frame we cannot read is no event
            return
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:    # (NULL mechanism too): the stream is open
            if not self.connected:
                logger.info("prefill worker %s: subscribed to its KV events at %s", self.index.name, self.endpoint)
            self.connected, self.last_error, self._opened = True, "", True
        elif event == zmq.EVENT_DISCONNECTED:
            if self.connected:
                logger.warning("prefill worker %s: KV-event connection to %s lost; its index starts over",
                               self.index.name, self.endpoint)
                self.index.disconnected()
            self.connected, self._lost = False, True
        elif event & _HANDSHAKE_FAILED:
            if not self.last_error:
                logger.warning("prefill worker %s: KV-event handshake with %s failed (CURVE keys: the dispatcher's "
                               "kv_events_keys must hold the worker's server.key, and the worker's "
                               "--kv-events-keys DIR/clients this dispatcher's client key)",
                               self.index.name, self.endpoint)
            self.last_error = "handshake failed"


class KVEventHub:
    """The dispatcher's subscribers, one per prefill worker with a ``kv_events`` address
    (``PrefillWorker.kv_events``); :meth:`ensure` on a passed health check, :meth:`drop`
    when the worker is marked down or removed (``PrefillWorker.events``)."""

    def __init__(self, dispatcher):
        self.d = dispatcher
        cfg = dispatcher.cfg
        self.keys = None
        if cfg.kv_events_keys:
            from proserve.kvtransfer.auth import ClientKeys, KeysError
            from proserve.scheduler.request import ConfigError
            try:
                self.keys = ClientKeys.load(cfg.kv_events_keys)
            except KeysError as e:
                raise ConfigError(f"dispatcher.kv_events_keys: {e}") from None
        self._ctx: zmq.asyncio.Context | None = None

    def ensure(self, w) -> None:
        """``w``'s subscriber runs (started now unless it does); nothing without an address or
        with ``prefix_index = false``."""
        if not getattr(w, "kv_events", "") or not self.d.cfg.prefix_index or w.removed:
            return
        sub = w.events
        if sub is not None and sub.running:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        index = EventIndex(w.name, w.state, self.d.registry.prefix_block_tokens, self.d.metrics)
        w.events = Subscriber(self._ctx, w.kv_events, index, self.keys).start()

    @staticmethod
    def drop(w) -> asyncio.Task | None:
        sub = getattr(w, "events", None)
        if sub is not None:
            w.events = None
            return sub.stop()
        return None

    async def close(self) -> None:
        tasks = [t for t in (self.drop(w) for w in list(self.d.registry.prefill)) if t is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5)   # they close their sockets as they end
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
