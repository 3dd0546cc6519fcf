"""Queue publication for several dispatchers (issue 15): the prefill worker's publisher
(prefill/queue_publisher.py) over a real ZeroMQ PUB socket, CURVE included, the dispatcher's
defensive decoding (dispatcher/publication.py), and the dispatcher's view after a publication:
what RouterHost.published gives, nothing more (the merge is scheduler/host.py's)."""

from __future__ import annotations

import asyncio
import math
import random
import socket
import time
from types import SimpleNamespace

import msgpack
import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("fastapi")

from proserve.dispatcher.metrics import Metrics
from proserve.dispatcher.publication import BadPublication, Publications, Subscriber, decode
from proserve.kvtransfer.auth import ClientKeys, generate_keys
from proserve.prefill.queue_publisher import MAX_ENTRIES, TOPIC, QueuePublisher, check_address, encode
from proserve.profiler.modelfile import BUNDLED, load
from proserve.scheduler import Estimator
from proserve.scheduler.config import default_classes
from proserve.scheduler.host import RouterHost
from proserve.scheduler.registry import make_global
from proserve.scheduler.request import ConfigError, Request
from proserve.scheduler.routing.base import COLOCATED, DISAGGREGATED, PrefillInstance

CLASSES = default_classes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def entry(rid: str, cls: str = "high", t_in: float = 0.0, l_q: int = 100, l_kv: int = 0, prompt: int = 100):
    c = CLASSES[cls]
    return (rid, cls, c.weight, c.ttft_slo, c.tpot_slo, t_in, l_q, l_kv, prompt)


def recv(sock, timeout_s: float = 10.0) -> list[bytes] | None:
    if sock.poll(int(timeout_s * 1000)):
        return sock.recv_multipart()
    return None


# -- the publisher, over a real PUB socket -------------------------------------------------------
def test_publisher_sends_the_latest_snapshot_every_interval():
    addr = f"tcp://127.0.0.1:{free_port()}"
    pub = QueuePublisher(addr, interval_s=0.02)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(addr)
    try:
        pub.arrived("eng-1", "proserve-a")
        pub.arrived("eng-2", None)
        rid1, t1 = pub.identity("eng-1")
        rid2, t2 = pub.identity("eng-2")
        assert (rid1, rid2) == ("proserve-a", "eng-2")   # no dispatcher id: the engine's own
        pub.snapshot([entry(rid1, "high", t1, 80, 20, 100), entry(rid2, "low", t2, 50, 0, 50)])
        got = None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            frames = recv(sub)
            assert frames is not None, "no publication within 10 s"
            got = decode(frames, CLASSES)
            if got.entries:
                break
        assert got is not None and [e[0] for e in got.entries] == ["proserve-a", "eng-2"]
        e = got.entries[0]
        assert e[1] == "high" and e[2] == CLASSES["high"].weight and e[6:] == (80, 20, 100)
        assert 0 <= e[5] < 30 and 0 <= got.age < 30 and got.n_decode is None
        # publications keep coming without new snapshots (an idle engine), numbered, ages growing
        later = decode(recv(sub), CLASSES)
        assert later.seq > got.seq and later.entries[0][5] >= e[5]
        # co-located: its decodes too
        pub.snapshot([], 3, 600.0)
        for _ in range(200):
            p = decode(recv(sub), CLASSES)
            if p.n_decode is not None:
                break
        assert (p.n_decode, p.decode_kv, p.entries) == (3, 600.0, [])
        pub.prune(lambda rid: rid == "eng-1")
        assert pub.identity("eng-1")[0] == "proserve-a"
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


def test_publisher_refuses_a_non_loopback_address_without_keys(tmp_path):
    with pytest.raises(ValueError, match="not a loopback"):
        check_address("tcp://10.1.2.3:15700", None, False)
    check_address("tcp://10.1.2.3:15700", str(tmp_path), False)
    check_address("tcp://10.1.2.3:15700", None, True)
    check_address("tcp://127.0.0.1:15700", None, False)
    with pytest.raises(ValueError, match="ZeroMQ address"):
        check_address("http://127.0.0.1:1", None, False)
    with pytest.raises(ValueError, match="interval"):
        QueuePublisher(f"tcp://127.0.0.1:{free_port()}", interval_s=0)


def test_engine_config_checks_the_publication_settings():
    from proserve.prefill.engine_config import EngineConfig
    from proserve.scheduler.request import ConfigError
    c = EngineConfig.from_dict({"publish_queue": "tcp://127.0.0.1:15700", "publish_interval_s": 0.05})
    assert c.publish_queue == "tcp://127.0.0.1:15700" and c.publish_interval_s == 0.05
    with pytest.raises(ConfigError, match="publish_queue"):
        EngineConfig.from_dict({"publish_queue": "tcp://10.0.0.1:15700"})
    with pytest.raises(ConfigError, match="publish_interval_s"):
        EngineConfig.from_dict({"publish_queue": "tcp://127.0.0.1:15700", "publish_interval_s": -1})


def test_worker_flags_become_the_engine_config(tmp_path):
    from proserve.prefill import worker
    args = worker.build_parser("prefill").parse_args(["--publish-queue-port", "15700", "--publish-interval", "0.05"])
    worker.check_publish(args)
    cfg, _ = worker.scheduling_config("prefill", args)
    assert cfg["publish_queue"] == "tcp://127.0.0.1:15700" and cfg["publish_interval_s"] == 0.05
    args = worker.build_parser("prefill").parse_args(["--host", "10.0.0.5", "--publish-queue-port", "15700"])
    with pytest.raises(SystemExit, match="publish-keys"):
        worker.check_publish(args)
    args = worker.build_parser("prefill").parse_args(["--publish-queue-port", "15700", "--local-policy", "off"])
    with pytest.raises(SystemExit, match="scheduler plugin"):
        worker.check_publish(args)
    with pytest.raises(SystemExit, match="without --publish-queue-port"):
        worker.check_publish(worker.build_parser("prefill").parse_args(["--publish-keys", str(tmp_path)]))


def test_curve_admits_only_the_listed_dispatcher_keys(tmp_path):
    keys = tmp_path / "pub"
    generate_keys(keys)
    addr = f"tcp://127.0.0.1:{free_port()}"
    pub = QueuePublisher(addr, interval_s=0.02, keys_dir=str(keys))
    pub.snapshot([entry("r1", t_in=time.monotonic())])
    ctx = zmq.Context()
    socks = {}
    try:
        good = ClientKeys.load(keys)
        for name in ("admitted", "unknown_key", "no_curve"):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            if name == "admitted":
                s.curve_publickey, s.curve_secretkey, s.curve_serverkey = good.public, good.secret, good.server_public
            elif name == "unknown_key":
                s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
                s.curve_serverkey = good.server_public
            s.connect(addr)
            socks[name] = s
        frames = recv(socks["admitted"])
        assert frames is not None and [e[0] for e in decode(frames, CLASSES).entries] == ["r1"]
        # the others get nothing, however long they wait for it
        assert recv(socks["unknown_key"], 1.5) is None
        assert recv(socks["no_curve"], 0.5) is None
        deadline = time.monotonic() + 10
        while pub.stats.counts.get("auth_failures", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pub.stats.counts.get("auth_failures", 0) >= 1   # the unknown key, refused by ZAP
    finally:
        for s in socks.values():
            s.close(0)
        ctx.term()
        pub.close()


# -- decoding: everything checked, nothing but BadPublication escapes --------------------------------
def good_frames(n: int = 3, **over) -> list[bytes]:
    now = 1000.0
    frames = encode(7, 0.01, [entry(f"r{i}", "high" if i % 2 else "low", now - i, 10 * i, i, 10 * i + i + 1)
                              for i in range(n)], now)
    if over:
        msg = msgpack.unpackb(frames[1])
        msg.update(over)
        frames[1] = msgpack.packb(msg)
    return frames


def test_decode_accepts_a_good_frame():
    p = decode(good_frames(), CLASSES)
    assert p.seq == 7 and len(p.entries) == 3 and p.entries[1][:2] == ("r1", "high")
    assert p.entries[2][5] == pytest.approx(2.0) and p.entries[2][6:] == (20, 2, 23)


@pytest.mark.parametrize("frames", [
    [TOPIC],
    [b"other.topic", good_frames()[1]],
    [TOPIC, good_frames()[1], b"extra"],
    [TOPIC, b"\xc1junk"],
    [TOPIC, msgpack.packb([1, 2, 3])],
    [TOPIC, msgpack.packb({"v": 2, "seq": 0, "age": 0, "q": []})],
    [TOPIC, msgpack.packb({"v": 1, "seq": -1, "age": 0, "q": []})],
    [TOPIC, msgpack.packb({"v": 1, "seq": True, "age": 0, "q": []})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": math.nan, "q": []})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 1e9, "q": []})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": {}})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "high", 2.0, 1.0, 0.1, 0.0, 1, 0]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "gold", 2.0, 1.0, 0.1, 0.0, 1, 0, 1]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "high", 0.0, 1.0, 0.1, 0.0, 1, 0, 1]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "high", 2.0, 1.0, 0.1, -1.0, 1, 0, 1]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "high", 2.0, 1.0, 0.1, 0.0, -1, 0, 1]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "high", 2.0, 1.0, 0.1, 0.0, 1.5, 0, 1]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "high", 2.0, 1.0, 0.1, 0.0, 1, 0, 0]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["", "high", 2.0, 1.0, 0.1, 0.0, 1, 0, 1]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "high", 2.0, 1.0, 0.1, 0.0, 1, 0, 1]] * 2})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [[b"r", "high", 2.0, 1.0, 0.1, 0.0, 1, 0, 1]]})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [], "nd": -1, "dkv": 0})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [], "nd": 1, "dkv": math.inf})],
    [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "high", 2.0, 1.0, 0.1, 0.0, 1, 0, 1]]
                           * (MAX_ENTRIES + 1)})],
    [TOPIC, b"\x00" * (3 << 20)],
])
def test_decode_refuses_bad_frames(frames):
    with pytest.raises(BadPublication):
        decode(frames, CLASSES)


def test_decode_fuzzed_frames_raise_only_bad_publication():
    rng = random.Random(15)
    base = good_frames(5)[1]
    accepted = 0
    for _ in range(3000):
        b = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            i = rng.randrange(len(b))
            if op < 0.5:
                b[i] = rng.randrange(256)
            elif op < 0.75:
                del b[i]
            else:
                b.insert(i, rng.randrange(256))
        try:
            p = decode([TOPIC, bytes(b)], CLASSES)
        except BadPublication:
            continue
        accepted += 1
        for e in p.entries:   # whatever got through is in range
            assert e[1] in CLASSES and e[2] > 0 and e[6] >= 0 and e[7] >= 0 and e[8] >= 1
            assert all(math.isfinite(x) for x in e[2:6])
    for _ in range(500):   # random bytes and random msgpack objects
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        with pytest.raises(BadPublication):
            decode([TOPIC, junk if rng.random() < 0.5 else msgpack.packb(list(junk))], CLASSES)


# -- the dispatcher's view after a publication -----------------------------------------------------
def make_dispatcher(deployment: str = DISAGGREGATED, n: int = 2):
    policy = make_global("go_routing", classes=CLASSES, deployment=deployment)
    states = [PrefillInstance(i, Estimator(load(BUNDLED))) for i in range(n)]
    workers = [SimpleNamespace(name=f"p{i}", url=f"http://127.0.0.1:{8100 + i}", state=s, removed=False,
                               publish=f"tcp://127.0.0.1:{1 + i}") for i, s in enumerate(states)]
    rh = RouterHost(policy, states)
    cfg = SimpleNamespace(classes=CLASSES, prefill=[SimpleNamespace(url=w.url, publish=f"tcp://127.0.0.1:{1 + i}")
                                                    for i, w in enumerate(workers)],
                          publication_interval_s=0.05, publication_stale_intervals=3, publication_keys=None)
    return SimpleNamespace(cfg=cfg, registry=SimpleNamespace(prefill=workers), router_host=rh,
                           metrics=Metrics(), colocated=deployment == COLOCATED)


def req(rid: str, t: float, prompt: int = 100, cls: str = "high") -> Request:
    c = CLASSES[cls]
    return Request(rid, cls, c.weight, c.ttft_slo, c.tpot_slo, t, prompt)


def metric(d, name: str, **labels) -> float:
    v = d.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


@pytest.mark.parametrize("deployment", [DISAGGREGATED, COLOCATED])
def test_view_after_a_publication_is_what_router_host_published_gives(deployment):
    now = 5000.0
    d = make_dispatcher(deployment)
    ref = make_dispatcher(deployment)
    hub = Publications(d)
    sub = Subscriber(hub, d.registry.prefill[0], "tcp://127.0.0.1:1")
    # this dispatcher's own requests: a, b queued on p0 (b not yet at the worker), c on p1
    own = {r: req(r, now - 1) for r in ("a", "b", "c")}
    refown = {r: req(r, now - 1) for r in ("a", "b", "c")}
    for host, reqs in ((d.router_host, own), (ref.router_host, refown)):
        host.dispatched(reqs["a"], 0, now - 1)
        host.dispatched(reqs["b"], 0, now - 0.5)
        host.dispatched(reqs["c"], 1, now - 0.5)
    for r in own:
        hub.dispatched(r)   # as Dispatcher._route tells it
    # p0 publishes: x (another dispatcher's, ahead), a (ours, half done), y (another's)
    t_pub = 100.0   # the worker's own monotonic clock: only ages cross hosts
    entries = [entry("x", "low", t_pub - 2.0, 300, 0, 300), entry("a", "high", t_pub - 1.0, 40, 60, 100),
               entry("y", "high", t_pub - 0.5, 120, 0, 120)]
    frames = encode(0, 0.25, entries, t_pub, 0, 2 if deployment == COLOCATED else None, 400.0)
    assert hub.receive(sub, frames, now)
    # the reference: RouterHost.published given the same requests, built from the same entries
    x = req("x", now - 2.0, 300, "low")
    y = req("y", now - 0.5, 120, "high")
    ref.router_host.published(0, [(x, 300, 0), (refown["a"], 40, 60), (y, 120, 0)], now - 0.25,
                              2 if deployment == COLOCATED else None, 400.0 if deployment == COLOCATED else None)
    for i in (0, 1):
        got, want = d.router_host.qmap[i], ref.router_host.qmap[i]
        assert [r.id for r in got.queue] == [r.id for r in want.queue]
        assert got.dispatched == want.dispatched and got.ts == want.ts
        assert (got.n_decode, got.decode_kv) == (want.n_decode, want.decode_kv)
        for g, w in zip(got.queue, want.queue):
            assert (g.priority, g.weight, g.ttft_slo, g.tpot_slo, g.prompt_len, g.remaining_prefill) == \
                   (w.priority, w.weight, w.ttft_slo, w.tpot_slo, w.prompt_len, w.remaining_prefill)
            assert g.arrival == pytest.approx(w.arrival)
    assert [r.id for r in d.router_host.qmap[0].queue] == ["x", "a", "y", "b"]   # b: ours, on its way
    assert d.router_host.qmap[0].queue[1] is own["a"]                         # our own object
    assert metric(d, "proserve:dispatcher_publication_foreign_requests_total", instance="p0") == 2
    assert metric(d, "proserve:dispatcher_publications_total", instance="p0", result="ok") == 1
    assert metric(d, "proserve:dispatcher_publication_fresh", instance="p0") == 1
    # the next publication: x gone (prefilled), y progressed, z new; b arrived; a finished here
    d.router_host.prefill_finished(own["a"], now + 0.1)
    entries = [entry("y", "high", t_pub - 0.5, 60, 60, 120), entry("b", "high", t_pub - 0.2, 100, 0, 100),
               entry("a", "high", t_pub - 1.0, 40, 60, 100), entry("z", "low", t_pub, 10, 0, 10)]
    assert hub.receive(sub, encode(1, 0.0, entries, t_pub + 0.3), now + 0.3)
    q = d.router_host.qmap[0]
    assert [r.id for r in q.queue] == ["y", "b", "z"]   # a: the publication is older than what we know
    assert q.dispatched["y"] == (60, 60) and q.queue[1] is own["b"]
    assert metric(d, "proserve:dispatcher_publication_foreign_requests_total", instance="p0") == 3   # + z
    # silent for longer than publication_stale_intervals: our own view again
    hub.subs["p0"] = sub
    hub.check_stale(now + 0.3 + 10)
    assert [r.id for r in q.queue] == ["b"] and sub.fresh is False
    if deployment == COLOCATED:   # n_d from our own decodes there (a), not the last publication's
        assert (q.n_decode, q.decode_kv) == (1, 100.0)
    assert metric(d, "proserve:dispatcher_publication_fresh", instance="p0") == 0
    assert metric(d, "proserve:dispatcher_publications_total", instance="p0", result="stale") == 1
    # a bad frame changes nothing and is counted
    before = ([r.id for r in q.queue], dict(q.dispatched))
    assert not hub.receive(sub, [TOPIC, b"junk"], now + 11)
    assert ([r.id for r in q.queue], dict(q.dispatched)) == before
    assert metric(d, "proserve:dispatcher_publications_total", instance="p0", result="malformed") == 1


def test_subscriptions_over_zmq_survive_junk_and_fall_back_when_silent():
    """The hub's tasks on real sockets: a raw PUB sends junk, then good publications, then
    stops: the junk is counted, the good ones applied, the silence noticed."""
    async def go():
        d = make_dispatcher(n=1)
        port = free_port()
        d.registry.prefill[0].publish = f"tcp://127.0.0.1:{port}"
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{port}")
        hub = Publications(d)
        hub.start()
        try:
            rng = random.Random(3)
            deadline = time.monotonic() + 30
            applied = 0.0
            while time.monotonic() < deadline and applied == 0:
                for _ in range(5):
                    junk = [[TOPIC, bytes(rng.randrange(256) for _ in range(20))], [TOPIC], [b"x", b"y", b"z"],
                            [TOPIC, msgpack.packb({"v": 1, "seq": 0, "age": 0, "q": [["r", "gold", 1, 1, 1, 0, 1,
                                                                                         0, 1]]})]]
                    pub.send_multipart(rng.choice(junk))
                pub.send_multipart(encode(0, 0.0, [entry("other-1", "low", 0.0, 50, 0, 50)], 0.0))
                await asyncio.sleep(0.1)
                applied = metric(d, "proserve:dispatcher_publications_total", instance="p0", result="ok")
            assert applied >= 1
            assert metric(d, "proserve:dispatcher_publications_total", instance="p0", result="malformed") >= 1
            assert [r.id for r in d.router_host.qmap[0].queue] == ["other-1"]
            assert metric(d, "proserve:dispatcher_publication_fresh", instance="p0") == 1
            # silence: after stale_intervals x interval (0.15 s) the view falls back
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and d.router_host.qmap[0].queue:
                await asyncio.sleep(0.05)
            assert d.router_host.qmap[0].queue == []
            assert metric(d, "proserve:dispatcher_publication_fresh", instance="p0") == 0
            # a worker that leaves: its subscription and series go
            d.registry.prefill[0].removed = True
            hub.tick(time.time())
            assert not hub.subs
        finally:
            await hub.close()
            pub.close(0)
            ctx.term()
    asyncio.run(go())


def test_dispatcher_config_takes_the_publication_keys(tmp_path):
    from proserve.dispatcher.config import ConfigError, config_from_dict
    base = {"dispatcher": {"deployment": "colocated"},
            "prefill": [{"url": "http://10.0.0.1:8100", "publish": "tcp://10.0.0.1:15700"}]}
    with pytest.raises(ConfigError, match="publication_keys"):
        config_from_dict(base).validate()
    c = config_from_dict({**base, "dispatcher": {"deployment": "colocated", "publication_keys": "pub",
                                                 "publication_interval_s": 0.2,
                                                 "publication_stale_intervals": 4}}, base=tmp_path)
    c.validate()
    assert c.prefill[0].publish == "tcp://10.0.0.1:15700" and c.publication_keys == str(tmp_path / "pub")
    assert (c.publication_interval_s, c.publication_stale_intervals) == (0.2, 4)
    with pytest.raises(ConfigError, match="publish"):
        config_from_dict({"dispatcher": {"deployment": "colocated"},
                          "prefill": [{"url": "http://127.0.0.1:8100", "publish": "http://x"}]}).validate()
    with pytest.raises(ConfigError, match="publication_stale_intervals"):
        config_from_dict({**base, "dispatcher": {"deployment": "colocated", "publication_insecure": True,
                                                 "publication_stale_intervals": 0}}).validate()
    from proserve.dispatcher.cli import build_parser, config_from_args
    args = build_parser().parse_args(["--prefill", "http://127.0.0.1:8100,publish=tcp://127.0.0.1:15700",
                                      "--deployment", "colocated", "--publication-interval", "0.3"])
    c = config_from_args(args)
    assert c.prefill[0].publish == "tcp://127.0.0.1:15700" and c.publication_interval_s == 0.3


def test_workers_added_at_run_time_publish_too():
    """A prefill worker added through the admin API with a ``publish`` address (or found by a
    ``[[discover]]`` entry with ``publish_port``) is subscribed to by the next tick; the same
    address twice is a 409, a decode worker's is a 400, and a removed worker's subscription goes."""
    from dispatcher_helpers import harness

    from proserve.dispatcher.config import DiscoverSpec, check_discover
    from proserve.dispatcher.errors import ApiError

    async def go():
        async with harness(n_prefill=1, colocated=True, keys=None) as h:
            m, hub = h.d.membership, h.d.publications
            w = m.add({"role": "prefill", "url": "http://127.0.0.1:1", "publish": "tcp://127.0.0.1:15799"})
            assert w.publish == "tcp://127.0.0.1:15799"
            hub.tick(time.time())
            assert w.name in hub.subs and hub.subs[w.name].endpoint == "tcp://127.0.0.1:15799"
            assert h.d.registry.prefill[0].name not in hub.subs          # configured without one
            with pytest.raises(ApiError) as e:
                m.add({"role": "prefill", "url": "http://127.0.0.1:2", "publish": "tcp://127.0.0.1:15799"})
            assert e.value.status == 409
            with pytest.raises(ApiError) as e:
                m.add({"role": "prefill", "url": "http://127.0.0.1:3", "publish": "tcp://10.9.9.9:15799"})
            assert e.value.status == 400 and "publication_keys" in e.value.message
            m.remove(w.name)
            hub.tick(time.time())
            assert w.name not in hub.subs
    asyncio.run(go())
    check_discover(DiscoverSpec(role="prefill", host="p.example", port=8100, publish_port=15700), "colocated", "d")
    with pytest.raises(ConfigError, match="publish_port is for prefill"):
        check_discover(DiscoverSpec(role="decode", host="d.example", port=8200, kv_port=15600, publish_port=15700),
                       "disaggregated", "d")
