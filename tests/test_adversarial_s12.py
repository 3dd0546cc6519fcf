"""Adversarial review (session 12) of the precise prefix index from vLLM's KV-cache events
(dispatcher/kv_events.py, prefill/kv_events.py, scheduler/prefix.py) and of the decode-block
promises (DecodeInstance.reserved/room, RouterHost.dispatched/prefill_finished/released).

Tests marked ``xfail(strict=True)`` expose a real bug (the reason says which); the others are
attacks that held up and stay as regression tests. Events are built as vLLM 0.32 encodes them
(msgspec ``tag=True`` structs: a map with its ``type``), with vLLM's own classes where a field
only vLLM's class shows is the point.
"""

from __future__ import annotations

import asyncio
import hashlib
import random

import msgpack
import pytest

from proserve.dispatcher.kv_events import EventIndex
from proserve.scheduler import Estimator, LatencyModel
from proserve.scheduler.prefix import block_ids
from proserve.scheduler.routing.base import PrefillInstance

BS = 16


# -- helpers ---------------------------------------------------------------------------------------
def instance(cache_tokens=BS * 1000, block_size=BS) -> PrefillInstance:
    p = PrefillInstance(0, Estimator(LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=0.01)))
    p.cache_tokens, p.block_size = cache_tokens, block_size
    return p


def held(p) -> set:
    return set(p.prefix._blocks) if p.prefix is not None else set()


def _hashes(tokens, parent=None, bs=BS, salt=b""):
    out, h = [], parent or b""
    for i in range(0, len(tokens), bs):
        h = hashlib.sha256(salt + h + repr(tokens[i:i + bs]).encode()).digest()
        out.append(h)
    return out


def stored(tokens, parent=None, bs=BS, **kw) -> dict:
    """A BlockStored map as vLLM's msgspec encoder writes it."""
    ev = {"type": "BlockStored", "block_hashes": _hashes(tokens, parent, bs), "parent_block_hash": parent,
          "token_ids": list(tokens), "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None,
          "group_idx": 0}
    ev.update(kw)
    return ev


def frames(seq, *events) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgpack.packb([1.0, list(events)], use_bin_type=True)]


@pytest.fixture(scope="module")
def V():
    """vLLM's own event classes and encoder (the wire format under test is vLLM's)."""
    ev = pytest.importorskip("vllm.distributed.kv_events", reason="needs vllm for vLLM's event classes")
    import msgspec

    class _V:
        mod = ev
        enc = msgspec.msgpack.Encoder()

        @classmethod
        def frames(cls, seq, *events):
            return [b"", seq.to_bytes(8, "big"), cls.enc.encode(ev.KVEventBatch(ts=1.0, events=list(events)))]

        @staticmethod
        def stored(tokens, parent=None, bs=BS, **kw):
            return ev.BlockStored(block_hashes=_hashes(tokens, parent, bs), parent_block_hash=parent,
                                  token_ids=list(tokens), block_size=bs, lora_id=None, medium="GPU",
                                  lora_name=None, group_idx=0, **kw)
    return _V


# == 1. the event index: findings ==================================================================
# Was a strict xfail until fixed in session 12:
# BUG: decode_batch unpacks with max_str_len=4096, but vLLM 0.32's BlockStored carries the
# request's session_id, a client-chosen string of any length (body field 'session_id', forwarded
# by the dispatcher, or the session header). One request with a 5,000-character session_id makes
# its worker's whole batch undecodable -> reset('lost'): the worker's index is wiped and every
# other block stored in that engine step is lost. A client can keep any worker's index empty.
def test_a_long_session_id_does_not_wipe_the_index(V):
    p = instance()
    idx = EventIndex("p0", p, lambda: BS)
    mine = list(range(100, 100 + 4 * BS))
    idx.receive(V.frames(0, V.stored(mine)))
    assert held(p) == set(block_ids(mine, BS))
    # the same engine step: another client's request with a long session id, and a third prompt
    theirs = list(range(500, 500 + 2 * BS))
    other = list(range(900, 900 + 2 * BS))
    idx.receive(V.frames(1, V.stored(theirs, session_id="s" * 5000), V.stored(other)))
    assert not any(k.startswith("reset") for k in idx.counts), idx.counts
    assert held(p) >= set(block_ids(mine, BS)) | set(block_ids(other, BS))


# Was a strict xfail until fixed in session 12:
# BUG: EventIndex._stored validates block_size/token_ids before it filters on medium, so a
# BlockStored of another tier that vLLM itself emits with empty metadata (vllm/v1/simple_kv_offload/
# manager.py: medium CPU, token_ids=[] and block_size 0 when the block's metadata is missing or
# sized with another g_block_size) is 'malformed' and resets the GPU index. With CPU offloading on,
# every such event wipes the worker's index, although the README says offload tiers are just left out.
def test_an_offload_tier_event_with_empty_metadata_does_not_reset_the_gpu_index(V):
    p = instance()
    idx = EventIndex("p0", p, lambda: BS)
    prompt = list(range(3 * BS))
    ev = V.mod
    cpu = ev.BlockStored(block_hashes=[b"\x07" * 32], parent_block_hash=None, token_ids=[], block_size=0,
                         lora_id=None, medium="CPU", lora_name=None, group_idx=0, locality="LOCAL")
    idx.receive(V.frames(0, V.stored(prompt), cpu))
    assert "malformed" not in idx.counts and not any(k.startswith("reset") for k in idx.counts), idx.counts
    assert held(p) == set(block_ids(prompt, BS))


# Was a strict xfail until fixed in session 12:
# BUG: when the dispatcher's hashing unit changes at run time (a prefill worker of another block
# size joins: prefix_block_tokens is a gcd), EventIndex._index clears the worker's BlockLRU but
# keeps its capacity, cache_tokens // OLD unit. From 16 to 8 the index holds half the worker's
# cache (in tokens) and evicts blocks the engine still holds; it should be rebuilt with
# cache_tokens // new unit.
def test_a_new_hashing_unit_resizes_the_event_index():
    unit = [BS]
    p = instance(cache_tokens=BS * 100)
    idx = EventIndex("p0", p, lambda: unit[0])
    idx.receive(frames(0, stored(list(range(BS)))))
    assert p.prefix.capacity == 100
    unit[0] = BS // 2                              # a worker with 8-token blocks joined: gcd(16, 8)
    prompt = list(range(1000, 1000 + 80 * BS))     # 80 engine blocks: 80 % of the worker's cache
    idx.receive(frames(1, stored(prompt)))
    assert p.prefix.capacity == BS * 100 // (BS // 2)
    assert held(p) == set(block_ids(prompt, BS // 2))   # everything the engine holds


_DUP = ("BUG: nothing refuses two prefill workers with the same kv_events address (the admin API checks "
        "name, URL and kv_addr for clashes, not kv_events; config.validate neither). Both subscribe to the "
        "same engine's PUB socket, so the second worker's index is driven by the first worker's cache: "
        "GoRouting sends prefix hits to a worker that holds none of them.")


# Was a strict xfail until fixed in session 12:
def test_a_kv_events_address_listed_twice_in_the_config_is_refused():
    from proserve.dispatcher.config import config_from_dict
    from proserve.scheduler.request import ConfigError
    cfg = config_from_dict({"dispatcher": {"deployment": "colocated"}, "prefill": [
        {"url": "http://127.0.0.1:8101", "kv_events": "tcp://127.0.0.1:5557"},
        {"url": "http://127.0.0.1:8102", "kv_events": "tcp://127.0.0.1:5557"}]})
    with pytest.raises(ConfigError, match="is also prefill"):
        cfg.validate()                 # as the CLI and the Dispatcher do before starting


# Was a strict xfail until fixed in session 12:
def test_a_kv_events_address_already_in_use_is_refused_by_the_admin_api():
    from dispatcher_helpers import harness

    from proserve.dispatcher.errors import ApiError

    async def go():
        async with harness(n_prefill=1, colocated=True, keys=None) as h:
            m = h.d.membership
            m.add({"role": "prefill", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:5999"})
            with pytest.raises(ApiError) as e:
                m.add({"role": "prefill", "url": "http://127.0.0.1:2", "kv_events": "tcp://127.0.0.1:5999"})
            assert e.value.status == 409
    asyncio.run(go())


# == 2. the event index: attacks that held up ======================================================
def test_ids_from_events_equal_block_ids_across_events_parents_and_units():
    """A prompt stored over three events (parent chain), engine blocks of 32, dispatcher unit 8:
    the ids equal block_ids(prompt, 8) for its whole blocks; a partial tail has none; a block
    whose parent is unknown starts nothing."""
    p = instance(cache_tokens=8 * 10_000)
    idx = EventIndex("p0", p, lambda: 8)
    prompt = list(range(7 * 32))
    e1 = stored(prompt[:2 * 32], bs=32)
    e2 = stored(prompt[2 * 32:5 * 32], parent=e1["block_hashes"][-1], bs=32)
    e3 = stored(prompt[5 * 32:], parent=e2["block_hashes"][-1], bs=32)
    idx.receive(frames(0, e1, e2, e3))
    assert held(p) == set(block_ids(prompt + [1, 2, 3], 8))
    orphan = stored(list(range(5000, 5032)), parent=b"\x99" * 32, bs=32)
    idx.receive(frames(1, orphan))
    assert held(p) == set(block_ids(prompt, 8)) and idx.counts.get("ignored") == 1
    # removing the middle event's blocks takes out exactly their sub-blocks
    idx.receive(frames(2, {"type": "BlockRemoved", "block_hashes": e2["block_hashes"], "medium": "GPU"}))
    ids = block_ids(prompt, 8)
    assert held(p) == set(ids[:8]) | set(ids[20:])


def test_hostile_frames_for_one_worker_never_touch_another_workers_index():
    rng = random.Random(12)
    pa, pb = instance(), instance()
    ia, ib = EventIndex("a", pa, lambda: BS), EventIndex("b", pb, lambda: BS)
    good = list(range(3 * BS))
    ib.receive(frames(0, stored(good)))
    before = held(pb)
    hostile = [
        [b"", (0).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5]}]])],
        [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [stored(good, parent=b"x" * 32)] * 3])],
        [b"", (2).to_bytes(8, "big"), msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [True]}]])],
        [b"", (3).to_bytes(8, "big"), msgpack.packb([[[[[[[[[]]]]]]]]])],
        [b"", (4).to_bytes(8, "big"), b"\xdd\xff\xff\xff\xff"],          # an array32 of 4G entries
        [b"", (5).to_bytes(8, "big"), msgpack.packb([1.0, [stored(good, block_size=1 << 20)]])],
        [b"x"] * 100,
    ]
    for _ in range(200):
        hostile.append([rng.randbytes(rng.randint(0, 12)) for _ in range(rng.randint(0, 5))])
    for f in hostile:
        ia.receive(f)
    assert held(pb) == before and ib.counts == {"applied": 1}


def test_hash_map_and_index_stay_bounded_under_a_flood_of_stored_blocks():
    p = instance(cache_tokens=BS * 50)
    idx = EventIndex("p0", p, lambda: 1)            # unit 1: 16 ids per engine block
    for seq in range(40):
        evs = [stored([seq * 100_000 + k * BS + j for j in range(BS)]) for k in range(100)]
        idx.receive(frames(seq, *evs))
    cap = p.prefix.capacity
    assert cap == BS * 50
    assert len(p.prefix) <= cap and len(idx) <= 2 * cap + 1024
    assert not any(k.startswith("reset") for k in idx.counts)


def test_restart_reconnect_and_removal_leave_no_stale_index():
    p = instance()
    idx = EventIndex("p0", p, lambda: BS)
    idx.receive(frames(7, stored(list(range(2 * BS)))))
    idx.receive(frames(0, stored(list(range(50, 50 + BS)))))        # a new engine numbers from 0
    assert held(p) == set(block_ids(list(range(50, 50 + BS)), BS)) and idx.counts["reset_restart"] == 1
    idx.disconnected()
    assert held(p) == set() and idx.last_seq is None
    # the worker was marked down (its index dropped) and a new one made by a dispatch: the events
    # never write into the old object again, and their hash map starts over
    old = p.prefix
    p.prefix = None
    idx.receive(frames(0, {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU"}))
    assert p.prefix is not old and len(idx) == 0


def test_subscriber_tasks_do_not_leak_across_add_remove_and_down_marks():
    """Workers with kv_events added and removed through the admin API, and marked down, over
    and over: no kv-events task outlives its worker's subscription."""
    import zmq
    import zmq.asyncio
    from dispatcher_helpers import harness, until

    from proserve.bench.fake_worker import FakeWorker

    def kv_tasks():
        return [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events-") and not t.done()]

    async def go():
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        extra = await FakeWorker(num_blocks=100, block_size=BS).start()
        try:
            async with harness(n_prefill=1, colocated=True, keys=None,
                               worker_kw={"num_blocks": 100, "block_size": BS}) as h:
                m = h.d.membership
                for i in range(4):
                    w = m.add({"role": "prefill", "url": extra.url, "name": f"x{i}",
                               "kv_events": f"tcp://127.0.0.1:{port}"})
                    await until(lambda w=w: w.events is not None and w.events.running, what="a subscription")
                    h.d.registry.failed(w, "test")            # down: its subscription ends at once
                    assert w.events is None and w.state.prefix is None
                    await until(lambda w=w: w.events is not None and w.events.running, what="resubscribed")
                    m.remove(w.name, force=True)
                    assert w.events is None
                    await asyncio.sleep(0.05)
                    assert kv_tasks() == [], kv_tasks()
        finally:
            await extra.stop()
            pub.close(0)
            ctx.destroy(0)
    asyncio.run(go())


def test_non_loopback_event_addresses_need_keys_everywhere():
    from proserve.dispatcher.config import DispatcherConfig, check_kv_events
    from proserve.kvtransfer.auth import is_loopback
    from proserve.prefill.kv_events import check_config
    from proserve.scheduler.request import ConfigError
    cfg = DispatcherConfig()
    for addr in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://10.0.0.1:5557", "tcp://127.0.0.1;10.0.0.1:5557",
                 "tcp://[::ffff:10.0.0.1]:5557", "tcp://localhost.evil.example:5557", "tcp://eth0:5557",
                 "tcp://127.0.0.1.nip.io:5557"):
        assert not is_loopback(addr), addr
        with pytest.raises(ConfigError):
            check_kv_events(addr, cfg, "x")
        with pytest.raises(ConfigError):
            check_config({"endpoint": addr})


# == 3. decode-block promises ========================================================================
def _body(**kw):
    return {"prompt": "a b c d e f g h i j", "max_tokens": 5, **kw}


def _no_promises(h) -> None:
    ds = [w.state for w in h.d.registry.decode]
    assert all(d.reserved == {} for d in ds), [d.reserved for d in ds]
    assert h.d.router_host._decode == {} and h.d.router_host._at == {}


def test_promises_end_on_every_dispatcher_path():
    """success, prefill failure then retry elsewhere, KV-push fallback to another decode worker,
    a client that goes away while its prefill is held: no promise and no map entry outlives
    the request (promise_s made huge so a lapse cannot hide a leak)."""
    from dispatcher_helpers import harness, until

    async def go():
        async with harness(n_prefill=2, n_decode=2) as h:
            h.d.router_host.promise_s = 3600.0
            await asyncio.sleep(0.3)
            # success, streamed and not
            for stream in (False, True):
                r = await (h.stream("/v1/completions", _body()) if stream else h.post("/v1/completions", _body()))
                assert (r[0] if stream else r.status_code) == 200
            _no_promises(h)
            # a prefill failure: retried on the other prefill worker
            h.prefills[0].fail = "500"
            h.prefills[0].fail_if = lambda b: True
            for _ in range(4):
                r = await h.post("/v1/completions", _body())
                assert r.status_code == 200, r.text
            _no_promises(h)
            h.prefills[0].fail = h.prefills[0].fail_if = None
            # the KV push to the chosen decode worker fails: the decode leg goes to another
            for w in h.prefills:
                w.kv_error, w.kv_failed_dest = "push failed", h.d.registry.decode[0].kv_addr
            for _ in range(4):
                r = await h.post("/v1/completions", _body())
                assert r.status_code == 200, r.text
            _no_promises(h)
            for w in h.prefills:
                w.kv_error = w.kv_failed_dest = None
            # the client leaves while the prefill is held
            hold = asyncio.Event()
            for w in h.prefills:
                w.hold = hold
            tasks = [asyncio.create_task(h.post("/v1/completions", _body())) for _ in range(4)]
            await until(lambda: sum(len(d.state.reserved) for d in h.d.registry.decode) == 4, what="promises")
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await until(lambda: not h.d.router_host._decode, what="the promises to end with the requests")
            hold.set()
            await asyncio.sleep(0.2)
            _no_promises(h)
    asyncio.run(go())


def test_room_does_not_drift_over_many_promises():
    from proserve.scheduler.host import RouterHost
    from proserve.scheduler.registry import make_global
    from proserve.scheduler.request import Request
    from proserve.scheduler.routing.base import DecodeInstance

    ps = [instance()]
    ps[0].id = 0
    ds = [DecodeInstance(0, 1000), DecodeInstance(1, 1000)]
    host = RouterHost(make_global("round_robin"), ps)
    rng = random.Random(3)
    now = 0.0
    live = []
    for i in range(3000):
        now += rng.random() * 0.05
        r = Request(f"r{i}", "high", 1.0, 1.0, 0.1, now, 64, 16)
        _, d = host.route(r, ps, ds, now)
        host.dispatched(r, 0, now, d, 5)
        if rng.random() < 0.3:
            host.dispatched(r, 0, now, ds[1 - ds.index(d)], 5)     # retried: promised elsewhere
        live.append(r)
        while live and rng.random() < 0.6:
            x = live.pop(rng.randrange(len(live)))
            (host.prefill_finished if rng.random() < 0.5 else host.released)(x, now)
            host.released(x, now)                                  # repeated events are no-ops
    for x in live:
        host.finished(x, now)
    assert all(d.reserved == {} and d.room(now) == d.free_blocks for d in ds)
    assert host._decode == {} and host._at == {}


@pytest.mark.parametrize("sync", ["publish", "blind", "shared"])
def test_simulator_promises_end_on_the_dispatcher_that_made_them(sync):
    from proserve.profiler.modelfile import BUNDLED, load
    from proserve.scheduler import GainConfig
    from proserve.scheduler.request import Request
    from proserve.sim.cluster import SimConfig, Simulator

    reqs = [Request(f"r{i}", "high", 2.0, 5.0, 0.1, 0.002 * i, 256 if i % 7 else 10 ** 7, 8) for i in range(60)]
    cfg = SimConfig(deployment="disaggregated", prefill_instances=2, decode_instances=3,
                    global_policy="round_robin", dispatchers=3, dispatcher_sync=sync)
    gain = GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs])
    sim = Simulator(load(BUNDLED), cfg, gain)
    sim.run(reqs)
    for disp in sim.dispatchers:
        assert disp.host._decode == {} and disp.host._at == {}
        assert all(d.reserved == {} for d in disp.d_states), [d.reserved for d in disp.d_states]
