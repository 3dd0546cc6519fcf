"""Adversarial tests of the KV transport: what a hostile or broken peer found
(each test names the problem), plus fuzzing of the wire decoder and of a live
receiver that must keep its invariants whatever arrives.

Tests marked xfail (strict) document problems that are not fixed: the reason
says why. Every wait is bounded; nothing depends on this host's speed."""
from __future__ import annotations

import faulthandler
import random
import socket
import struct
import subprocess
import sys
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
import zmq

from proserve.kvtransfer import wire
from proserve.kvtransfer.transport import KVReceiver, KVSender


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _until(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _raw_dealer(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def _kv_header(xfer, layer=0, seq=0, n=0, blocks=(), lbytes=None) -> bytes:
    part = wire.part(0, layer, seq, list(blocks), "uint8", [n], 0, [n if lbytes is None else lbytes])
    return msgpack.packb({"v": wire.VERSION, "kind": "kv", "xfer": xfer, "nbytes": n, "parts": [part]})


def _held_consistent(rx: KVReceiver) -> None:
    """The receiver's held-bytes books balance: total == open + stored == per peer."""
    with rx._cond:
        stored = sum(v.held for v in rx._results.values())
        open_held = sum(t.held for t in rx._open.values())
        assert rx._held == stored + open_held, (rx._held, stored, open_held)
        assert rx._held == sum(rx._peer_held.values())


def _legit_transfer_works(rx: KVReceiver, xfer="legit") -> None:
    tx = KVSender(rx.address, timeout=5)
    try:
        tx.send_layer(xfer, 0, [1, 2], np.arange(8, dtype=np.uint8).reshape(2, 4))
        tx.finish(xfer, digest="ab")
    finally:
        tx.close()
    r = rx.wait(xfer, timeout=5)
    assert r.ok and r.digest == "ab" and r.layer_bytes(0) == bytes(range(8))


# ---------------------------------------------------------------- fixed problems


def test_oversized_message_header_is_not_unpacked_past_the_header_limits():
    """Problem: for a message over max_message_bytes, wire.decode unpacked frame 0
    (up to ZMQ_MAXMSGSIZE, 65 MiB by default) without msgpack limits to name its
    transfer in the nack: 4 MB of one-byte empty arrays built ~280 MB of Python
    lists (~70x) and took ~1 s of the receiver thread; a 64 MB frame ~4.5 GB."""
    n = 2_000_000
    head = b"\xdd" + struct.pack(">I", n) + b"\x90" * n     # array32 of n empty arrays
    tracemalloc.start()
    try:
        with pytest.raises(wire.WireError) as e:
            wire.decode([head, b"x"], wire.SENDER_KINDS, max_message_bytes=len(head))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.reason == "too_large"
    assert peak < 16 << 20, f"decoding a {len(head)}-byte header allocated {peak} bytes"
    # a header of a size decode accepts still names its transfer
    small = _kv_header("named", n=8)
    with pytest.raises(wire.WireError) as e:
        wire.decode([small, bytes(8)], wire.SENDER_KINDS, max_message_bytes=len(small))
    assert e.value.xfer == "named"


def test_chunks_without_payload_count_against_the_memory_caps(closing):
    """Problem: only payload bytes counted against max_held_bytes / max_peer_bytes.
    A peer sending kv messages with no payload (nbytes 0, a new layer each) and
    long block-id lists kept them all in its open transfer: 300 such messages of
    20000 block ids grew the receiver by ~230 MB with max_held_bytes at 1 MB and
    held_bytes reported as 0. Now each kept chunk counts its bookkeeping too."""
    rx = KVReceiver(max_held_bytes=4 << 20, max_peer_bytes=1 << 20)
    closing(rx)
    hostile = _raw_dealer(rx.address)
    try:
        blocks = list(range(1000, 3000))
        n = 200   # 200 x (2 KiB + 2000 x 40 B) ~ 16 MiB of bookkeeping > 1 MiB
        for i in range(n):
            hostile.send_multipart([_kv_header("flood", layer=i, blocks=blocks), b""])
        _until(lambda: rx.stats.snapshot()["messages_received"] >= n, what="flood handled")
        st = rx.stats.snapshot()
        assert st["rejected"].get("peer_full") == 1, st["rejected"]
        assert st["held_bytes_max"] <= 1 << 20
        assert rx.wait("flood", timeout=5).error.startswith("chunk rejected (peer_full")
        _held_consistent(rx)
        # the same flood with no block ids at all is bounded too
        for i in range(1000):
            hostile.send_multipart([_kv_header("flood2", layer=i), b""])
        _until(lambda: rx.stats.snapshot()["messages_received"] >= n + 1000, what="second flood handled")
        assert rx.stats.snapshot()["rejected"].get("peer_full") == 2
        assert not rx.wait("flood2", timeout=5).ok
        _held_consistent(rx)
        _legit_transfer_works(rx)
        with rx._cond:
            assert rx._held == 0
    finally:
        hostile.close(0)


def test_on_chunk_receiver_bounds_its_bookkeeping_too(closing):
    """The same flood against a receiver that writes chunks through on_chunk (and
    keeps no payload): its per-chunk records are bounded by the caps as well."""
    seen = []
    rx = KVReceiver(on_chunk=lambda *a: seen.append(a[0]), max_held_bytes=1 << 20, max_peer_bytes=256 << 10)
    closing(rx)
    hostile = _raw_dealer(rx.address)
    try:
        for i in range(500):   # 500 x 2 KiB > 256 KiB
            hostile.send_multipart([_kv_header("flood", layer=i, n=4), bytes(4)])
        _until(lambda: rx.stats.snapshot()["messages_received"] >= 500, what="flood handled")
        assert rx.stats.snapshot()["rejected"].get("peer_full") == 1
        assert len(seen) < 500
        assert not rx.wait("flood", timeout=5).ok
        _held_consistent(rx)
        with rx._cond:
            assert rx._held == 0
    finally:
        hostile.close(0)


# ------------------------------------------------------------------------ fuzzing


def test_wire_decode_fuzz():
    """Any header shape / frame count / raw bytes: decode returns a message that
    satisfies the documented invariants, or raises WireError (never anything else)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2 ** 63, max_value=2 ** 64 - 1),
                     st.floats(allow_nan=True), st.text(max_size=12),
                     st.sampled_from(["kv", "done", "abort", "hello", "credit", "ack", "nack", "uint8", "x"]))
    values = st.recursive(leaf, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=6), c,
                                                                                      max_size=5), max_leaves=20)
    good = {"int": 4, "index": 0, "ints": [1, 2], "shape": [4], "xfer": "x", "digest": "", "dtype": "uint8",
            "bool": True, "str": "r"}
    # step/layer/seq: around the edges of an index (0..MAX_INDEX), and not ints at all
    indexes = st.one_of(st.integers(-2, 3), st.sampled_from([wire.MAX_INDEX, wire.MAX_INDEX + 1, 2 ** 64 - 1]),
                        st.booleans(), st.floats(allow_nan=True), st.text(max_size=3))

    def fields(draw, spec: dict) -> dict:
        h = {}
        for name, tag in spec.items():
            if tag == "parts":
                h[name] = draw(st.lists(part(), max_size=3)) if draw(st.integers(0, 6)) else draw(values)
            elif draw(st.integers(0, 4)) == 0:
                h[name] = draw(indexes if tag == "index" else values)
            else:
                h[name] = good[tag]
        if draw(st.integers(0, 4)) == 0:
            h[draw(st.text(max_size=4))] = draw(values)
        if h and draw(st.integers(0, 4)) == 0:
            h.pop(draw(st.sampled_from(list(h))), None)
        return h

    @st.composite
    def part(draw):
        return fields(draw, wire.PART_FIELDS) if draw(st.integers(0, 9)) else draw(values)

    @st.composite
    def headers(draw):
        kind = draw(st.sampled_from(list(wire._FIELDS)))
        h = {"v": draw(st.sampled_from([2, 2, 2, 1, 3, True, "2"])), "kind": kind}
        h.update(fields(draw, wire._FIELDS[kind]))
        return h

    def check(frames):
        try:
            m = wire.decode(frames, wire.SENDER_KINDS + wire.RECEIVER_KINDS)
        except wire.WireError as e:
            assert e.xfer is None or wire.valid_xfer(e.xfer)
            return
        assert set(m.header) == set(wire._FIELDS[m.kind]) | {"v", "kind"}
        assert type(m.header["v"]) is int
        if m.kind == "kv":
            h = m.header
            assert m.header["v"] == wire.VERSION
            assert len(m.payload) == 1 and m.payload[0].nbytes == h["nbytes"] == sum(m.sizes)
            assert 0 < len(h["parts"]) <= wire.MAX_PARTS and len(m.sizes) == len(h["parts"])
            for p, n in zip(h["parts"], m.sizes):
                assert set(p) == set(wire.PART_FIELDS)
                for name in ("step", "layer", "seq"):
                    assert type(p[name]) is int and 0 <= p[name] <= wire.MAX_INDEX
                assert n == wire.prod(p["shape"]) * wire.DTYPES[p["dtype"]]
                assert p["offset"] + n <= wire.prod(p["lshape"]) * wire.DTYPES[p["dtype"]]
        else:
            assert m.payload == ()

    settings = hypothesis.settings(max_examples=400, deadline=None, derandomize=True,
                                   suppress_health_check=list(hypothesis.HealthCheck))

    @settings
    @hypothesis.given(headers(), st.integers(0, 3), st.one_of(st.binary(max_size=32), st.sampled_from([bytes(4),
                                                                                                     bytes(8)])))
    def structured(h, nframes, payload):
        frames = [msgpack.packb(h, use_bin_type=True)] + [payload] * nframes
        check(frames)
        check([zmq.Frame(f) for f in frames])

    @settings
    @hypothesis.given(st.lists(st.binary(max_size=100), max_size=4))
    def raw(frames):
        check(frames)

    structured()
    raw()


def _random_message(rng: random.Random, xfers: list[str]) -> list[bytes]:
    x = rng.choice(xfers)
    k = rng.random()
    if k < 0.5:
        parts, total = [], 0
        for _ in range(rng.choice([1, 1, 2, 3])):    # a chunk, or several parts packed together
            lb = rng.choice([0, 8, 16, 64])
            n = rng.choice([0, 8, 16, lb])
            dtype = rng.choice(["uint8", "uint8", "float16"])
            parts.append(wire.part(rng.choice([0, 0, 1, 5]), rng.randrange(3), rng.randrange(3),
                                   rng.sample(range(50), rng.randrange(4)), dtype,
                                   [n // 2 if dtype == "float16" else n], rng.choice([0, 8, 16, 48]), [lb]))
            total += n
        h = {"v": wire.VERSION, "kind": "kv", "xfer": x, "nbytes": total, "parts": parts}
        frames = [msgpack.packb(h), bytes(total)]
        if rng.random() < 0.1:
            frames.append(b"extra")
        if rng.random() < 0.05:
            frames = frames[:1]
        return frames
    if k < 0.7:
        return [msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": x, "chunks": rng.randrange(4),
                               "layers": rng.randrange(3), "nbytes": rng.choice([0, 8, 16, 32]),
                               "digest": rng.choice(["", "ab"])})]
    if k < 0.8:
        return [msgpack.packb({"v": wire.VERSION, "kind": "abort", "xfer": x, "reason": "r"})]
    if k < 0.85:
        return [msgpack.packb({"v": wire.VERSION, "kind": "hello", "layout": ""})]
    if k < 0.9:
        return [rng.randbytes(rng.randrange(20))]
    return [msgpack.packb({"v": wire.VERSION, "kind": rng.choice(["credit", "ack", "nack", "kv"]), "xfer": x})]


@pytest.mark.parametrize("seed", range(4))
def test_live_receiver_fuzz_keeps_its_invariants(closing, seed):
    """Random sequences of valid, invalid and conflicting messages from three peers
    (plus discards and collections from the consumer side): the thread survives
    with no internal error, the held-bytes books balance, and afterwards a legit
    transfer works and nothing stays held."""
    rng = random.Random(seed)
    rx = KVReceiver(max_open_transfers=rng.choice([4, 16]), max_held_bytes=rng.choice([1 << 14, 1 << 20]),
                    max_peer_bytes=rng.choice([1 << 13, 1 << 20]), stale_after_s=rng.choice([0.2, 5]),
                    result_ttl_s=rng.choice([0.3, 5]))
    closing(rx)
    peers = [_raw_dealer(rx.address) for _ in range(3)]
    xfers = [f"x{i}" for i in range(8)]
    n = 300
    try:
        for _ in range(n):
            rng.choice(peers).send_multipart(_random_message(rng, xfers))
            if rng.random() < 0.05:
                x = rng.choice(xfers)
                if rng.random() < 0.5:
                    rx.discard(x)
                elif rx.ready(x):
                    rx.wait(x, timeout=0)
            if rng.random() < 0.02:
                time.sleep(0.3)
        _until(lambda: rx.stats.snapshot()["messages_received"] >= n, what="all messages handled")
        assert rx.alive
        assert rx.stats.snapshot()["internal_errors"] == 0
        _held_consistent(rx)
        for x in rx.completed():
            rx.wait(x, timeout=0)
        for x in xfers:
            rx.discard(x)
        _legit_transfer_works(rx)
        _until(lambda: rx.stats.snapshot()["messages_received"] >= n + 2, what="legit transfer handled")
        with rx._cond:
            assert rx._held == sum(t.held for t in rx._open.values())
    finally:
        for p in peers:
            p.close(0)


# ------------------------------------------------------------- unfixed problems


@pytest.mark.xfail(strict=True, reason=(
    "max_open_transfers is one pool for all peers: a peer that aborts (or starts) transfers with "
    "ids of its own fills it (an abort of an unseen id stores a failed result for result_ttl_s, "
    "120 s in the connector), and every other peer's transfers are refused as too_many_transfers "
    "meanwhile. Needs a per-peer share or results that cost no slot; a design decision."))
def test_one_peer_cannot_lock_other_peers_out_of_transfer_slots(closing):
    rx = KVReceiver(max_open_transfers=64)
    closing(rx)
    hostile = _raw_dealer(rx.address)
    try:
        for i in range(100):
            hostile.send(msgpack.packb({"v": wire.VERSION, "kind": "abort", "xfer": f"junk{i}", "reason": "x"}))
        _until(lambda: rx.stats.snapshot()["messages_received"] >= 100, what="aborts handled")
        _legit_transfer_works(rx)
    finally:
        hostile.close(0)


def _zmtp_connect(host: str, port: int, identity: bytes = b"") -> socket.socket:
    """A raw ZMTP 3.0 (NULL mechanism) DEALER that sends the routing id it likes."""
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\0" * 16 + b"\x00" + b"\0" * 31)
    got = b""
    while len(got) < 64:
        c = s.recv(64 - len(got))
        assert c, "closed during the greeting"
        got += c

    def prop(k: bytes, v: bytes) -> bytes:
        return bytes([len(k)]) + k + struct.pack(">I", len(v)) + v
    body = b"\x05READY" + prop(b"Socket-Type", b"DEALER") + prop(b"Identity", identity)
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    return s


def _zmtp_send(s: socket.socket, data: bytes) -> None:
    assert len(data) < 256
    s.sendall(b"\x00" + bytes([len(data)]) + data)


_RECEIVER_PROC = r'''
import sys
from proserve.kvtransfer.transport import KVReceiver
rx = KVReceiver()
print(rx.address, flush=True)
for line in sys.stdin:   # each line: print the routing ids of the peers seen so far
    print(",".join(p.hex() for p in rx._peers), flush=True)
'''


@pytest.mark.xfail(strict=True, reason=(
    "libzmq (4.3.5) aborts the process (Assertion failed: ok, socket_base.cpp) when a ROUTER "
    "auto-generates a routing id (0x00 + counter, for a peer that sends none) that a peer already "
    "claimed by sending it as its own Identity. Without CURVE anyone who can reach the KV port can "
    "crash the decode worker: the counter starts at a rand() value of a never-seeded rand(), so "
    "planting the first ~64 candidate values and connecting once more works blind. Not fixable in "
    "ProServe; CURVE (the handshake precedes the routing id) is the mitigation."))
def test_a_peer_choosing_a_zero_prefixed_routing_id_cannot_kill_the_receiver(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", _RECEIVER_PROC], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, cwd=str(tmp_path),
                         env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"})
    socks = []
    try:
        host, port = p.stdout.readline().strip()[len("tcp://"):].rsplit(":", 1)
        hello = msgpack.packb({"v": wire.VERSION, "kind": "hello", "layout": ""})
        first = _zmtp_connect(host, int(port))          # anonymous: the ROUTER picks its id
        _zmtp_send(first, hello)
        socks.append(first)
        deadline = time.monotonic() + 10
        ids = ""
        while not ids:
            assert time.monotonic() < deadline, "the receiver never saw the first peer"
            p.stdin.write("?\n")
            p.stdin.flush()
            ids = p.stdout.readline().strip()
        (counter,) = struct.unpack(">I", bytes.fromhex(ids)[1:])
        planted = _zmtp_connect(host, int(port), b"\x00" + struct.pack(">I", counter + 1))
        _zmtp_send(planted, hello)
        socks.append(planted)
        time.sleep(0.3)
        second = _zmtp_connect(host, int(port))         # anonymous again: gets counter + 1
        _zmtp_send(second, hello)
        socks.append(second)
        time.sleep(1.0)
        assert p.poll() is None, f"the receiver process died (exit code {p.returncode})"
    finally:
        for s in socks:
            s.close()
        p.kill()
        p.wait(timeout=10)


# -------------------------------------------------------------------------- sender


def test_breaker_probe_that_cannot_make_its_socket_does_not_stick_half_open(closing, monkeypatch):
    """Problem: when the breaker let a probe through (open -> half_open) and making its
    socket failed (e.g. EMFILE), the breaker stayed half_open with no connection, so
    every later transfer to that destination was refused ('being probed') forever,
    even once the receiver was up."""
    import errno

    from proserve.kvtransfer.transport import DestinationUnavailable, TransferError, free_port

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    tx = KVSender(address, timeout=1.0, connect_timeout=0.2, breaker_cooldown_s=0.1, breaker_max_cooldown_s=0.1)
    closing(tx)
    with pytest.raises(TransferError):
        tx.send_layer("nobody-home", 0, [], np.zeros(4, np.float32))
    assert tx.destinations()[address]["state"] == "open"
    time.sleep(0.15)   # past the cooldown: the next transfer is the probe

    class NoSockets:
        def socket(self, *a, **kw):
            raise zmq.ZMQError(errno.EMFILE)
    real_ctx = tx._ctx
    monkeypatch.setattr(tx, "_ctx", NoSockets())
    with pytest.raises(zmq.ZMQError):
        tx.begin("probe")
    monkeypatch.setattr(tx, "_ctx", real_ctx)
    assert tx.destinations()[address]["state"] == "open"   # not half_open without a probe

    rx = KVReceiver(address)
    closing(rx)
    deadline = time.monotonic() + 10
    while True:
        try:
            tx.send_layer("after", 0, [], np.zeros(4, np.float32))
            tx.finish("after")
            break
        except DestinationUnavailable:
            tx.abort("after")
            assert time.monotonic() < deadline, f"destination never usable again: {tx.destinations()[address]}"
            time.sleep(0.05)
    assert rx.wait("after", timeout=5).ok


def test_hostile_receiver_cannot_stall_a_sender_past_its_budget(closing):
    """A receiver that grants a small window, sends junk (malformed headers, acks and
    nacks for unknown ids, an absurd credit grant) and then stops answering: the
    transfer fails within its one budget (not per layer), the junk is counted, and
    the breaker opens."""
    import threading

    from proserve.kvtransfer.transport import TransferTimeout

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if not router.poll(50):
                continue
            peer, head, *_ = router.recv_multipart()
            if msgpack.unpackb(head)["kind"] != "hello":
                continue      # chunks, done: never answered
            for d in ({"v": wire.VERSION, "kind": "credit", "bytes": 1 << 14, "init": True, "max_message": 1 << 20},
                      {"v": wire.VERSION, "kind": "ack", "xfer": "nobody", "chunks": 0, "nbytes": 0},
                      {"v": wire.VERSION, "kind": "nack", "xfer": "nobody", "reason": "x"},
                      {"v": wire.VERSION, "kind": "credit", "bytes": 2 ** 64 - 1, "init": False, "max_message": 1}):
                router.send_multipart([peer, msgpack.packb(d)])
            router.send_multipart([peer, b"\xc1junk"])
            router.send_multipart([peer, msgpack.packb({"v": wire.VERSION, "kind": "credit"}), b"extra"])

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    tx = KVSender(f"tcp://127.0.0.1:{port}", timeout=1.5, connect_timeout=0.5, chunk_bytes=4096)
    closing(tx)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            for layer in range(20):   # far more than the window: the sender runs out of credit
                tx.send_layer("stalled", layer, [], np.zeros(8 << 10, np.uint8))
            tx.finish("stalled")
        spent = time.monotonic() - t0
        assert spent < 1.5 + 5, spent   # its one budget (plus slack for a busy host), not 20 x 1.5 s
        st = tx.stats.snapshot()
        assert st["rejected"] == {"bad_msgpack": 1, "missing_field": 1}
        assert tx.destinations()[tx.address]["state"] == "open"
    finally:
        stop.set()
        th.join(timeout=5)
        router.close(0)


def test_a_receivers_tiny_max_message_fails_the_transfer_instead_of_stalling_the_sender(closing):
    """Problem: a receiver announcing the smallest max_message (4096 bytes) made a
    layer whose header carries many block ids go out in chunks of one item (a 200 KB
    layer with 400 block ids: 102400 messages, 4 s of CPU against a 1 s budget, which
    counts only waits; a real layer of 26 MB: hours, the forward pass stalled). Now
    such a layer fails its transfer at once, naming the receiver's limit."""
    import threading

    from proserve.kvtransfer.transport import TransferError

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop, received = threading.Event(), []

    def serve():
        while not stop.is_set():
            if router.poll(50):
                frames = router.recv_multipart()
                received.append(len(frames))
                if msgpack.unpackb(frames[1])["kind"] == "hello":
                    router.send_multipart([frames[0], msgpack.packb(
                        {"v": wire.VERSION, "kind": "credit", "bytes": 1 << 40, "init": True, "max_message": 4096})])

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    tx = KVSender(f"tcp://127.0.0.1:{port}", timeout=1.0)
    closing(tx)
    try:
        with pytest.raises(TransferError, match="max_message"):
            tx.send_layer("x", 0, list(range(400)), np.zeros((400, 256), np.float16))
        with pytest.raises(TransferError):   # the transfer is failed, not half sent
            tx.finish("x")
        assert tx.stats.snapshot()["chunks_sent"] == 0
        # a layer whose header leaves room goes out in chunks of ~max_message
        n = tx.send_layer("y", 0, [0, 1], np.zeros((2, 4096), np.float16))
        assert n <= 16 * 1024 // (4096 - 1024 - 60) + 1
    finally:
        stop.set()
        th.join(timeout=5)
        router.close(0)


def test_a_flooding_receiver_cannot_hold_the_sender_in_one_call(closing):
    """Problem: the sender read replies for as long as any were queued, holding the engine's
    thread (and the sender's lock) while a receiver kept sending. Now one call reads at
    most PUMP_MAX_MESSAGES; the rest are read by later calls."""
    import threading

    from proserve.kvtransfer import sender as sender_mod

    N = 5000
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)                  # (a ROUTER drops what is past its HWM)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop, flooded = threading.Event(), threading.Event()

    def serve():
        while not stop.is_set():
            if router.poll(50):
                frames = router.recv_multipart()
                if msgpack.unpackb(frames[1])["kind"] == "hello":
                    router.send_multipart([frames[0], msgpack.packb(
                        {"v": wire.VERSION, "kind": "credit", "bytes": 1 << 30, "init": True, "max_message": 1 << 20})])
                    for _ in range(N):
                        router.send_multipart([frames[0], b"\xc1junk"])
                    flooded.set()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    tx = KVSender(f"tcp://127.0.0.1:{port}", timeout=5.0)
    closing(tx)

    def read():
        return tx.stats.snapshot()["rejected"].get("bad_msgpack", 0)

    try:
        tx.send_layer("x", 0, [0], np.zeros(16, np.uint8))
        assert flooded.wait(10)
        time.sleep(0.5)                               # all of it queued at the sender by now
        before = read()
        assert N - before > sender_mod.PUMP_MAX_MESSAGES
        tx.destination_ok()                           # one call: one bounded read
        assert read() - before == sender_mod.PUMP_MAX_MESSAGES
        for _ in range(N):
            if read() == N:
                break
            tx.destination_ok()
        assert read() == N
    finally:
        stop.set()
        th.join(timeout=5)
        router.close(0)
