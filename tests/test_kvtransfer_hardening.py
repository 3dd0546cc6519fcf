"""Hardening of the ZeroMQ KV transport: a receiver no message can wedge, bounded
receiver memory, transfer ownership, CURVE authentication, and a sender that
fails fast (one deadline per transfer, a circuit breaker per destination).

Every wait is bounded; time bounds are generous and compared with the timeout
they replace, never with how fast this host is."""
from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import pathlib
import signal
import stat
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
import zmq.auth

from proserve.kvtransfer import wire
from proserve.kvtransfer.auth import ClientKeys, KeysError, ServerKeys, generate_keys, is_loopback
from proserve.kvtransfer.transport import (
    DestinationUnavailable,
    KVReceiver,
    KVSender,
    TransferError,
    TransferTimeout,
    WireError,
    free_port,
)


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _raw_dealer(address: str, ctx: zmq.Context | None = None) -> zmq.Socket:
    s = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(address)
    return s


def _kv(xfer, layer=0, seq=0, n=16, offset=0, lbytes=None):
    """A valid kv message of n uint8 bytes (layer of lbytes bytes)."""
    part = wire.part(0, layer, seq, [], "uint8", [n], offset, [n if lbytes is None else lbytes])
    return [msgpack.packb({"v": wire.VERSION, "kind": "kv", "xfer": xfer, "nbytes": n, "parts": [part]}), bytes(n)]


def _done(xfer, chunks=0, layers=0, nbytes=0, digest=""):
    return msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": xfer, "chunks": chunks, "layers": layers,
                          "nbytes": nbytes, "digest": digest})


def _abort(xfer, reason="x"):
    return msgpack.packb({"v": wire.VERSION, "kind": "abort", "xfer": xfer, "reason": reason})


def _until(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _replies(sock: zmq.Socket, kind: str, n: int, timeout=5.0) -> list[dict]:
    """The next n replies of a kind (others skipped) on a raw dealer."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        if sock.poll(50):
            m = msgpack.unpackb(sock.recv_multipart()[0])
            if m["kind"] == kind:
                out.append(m)
    return out


def _legit_roundtrip(address: str, xfer: str, **kw) -> None:
    tx = KVSender(address, timeout=10, **kw)
    try:
        a = np.arange(1000, dtype=np.float32)
        tx.send_layer(xfer, 0, [0], a)
        tx.finish(xfer, timeout=10)
    finally:
        tx.close()


# ------------------------------------------------- finding 1: nothing wedges the receiver


def test_wire_error_only_carries_valid_transfer_ids():
    assert WireError("r", "d", xfer="").xfer is None
    assert WireError("r", "d", xfer="x" * (wire.MAX_XFER_LEN + 1)).xfer is None
    assert WireError("r", "d", xfer=5).xfer is None
    assert WireError("r", "d", xfer="ok").xfer == "ok"
    for bad in ({"v": wire.VERSION, "kind": "done", "xfer": ""},
                {"v": wire.VERSION, "kind": "done", "xfer": "y" * 600, "chunks": 0},
                {"v": wire.VERSION, "kind": "abort", "xfer": "", "reason": "r"}):
        with pytest.raises(WireError) as ei:
            wire.decode([msgpack.packb(bad)], wire.SENDER_KINDS)
        assert ei.value.xfer is None


def test_empty_transfer_id_does_not_kill_the_receiver(closing):
    """Was: one 24-byte message ended the receiver thread (the nack for xfer ''
    failed to encode); every later transfer then waited out its timeout."""
    rx = KVReceiver()
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        raw.send(msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": ""}))
        raw.send(msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": "z" * 600, "chunks": 0}))
        raw.send_multipart([msgpack.packb({"v": wire.VERSION, "kind": "kv", "xfer": ""}), bytes(4)])
        _until(lambda: rx.stats.snapshot()["rejected_total"] >= 3, what="3 rejects")
        assert rx.alive
        _legit_roundtrip(rx.address, "after")
        assert rx.wait("after", timeout=5).ok
        st = rx.stats.snapshot()
        assert st["internal_errors"] == 0 and st["rejected"] == {"bad_field": 3}
    finally:
        raw.close(0)


def test_unexpected_handler_error_is_counted_and_dropped(closing):
    rx = KVReceiver()
    closing(rx)

    def boom(peer, h):
        raise RuntimeError("bug in a handler")

    rx._on_abort = boom  # any handler bug: the thread must survive it
    raw = _raw_dealer(rx.address)
    try:
        for i in range(3):
            raw.send(_abort(f"a{i}"))
        _until(lambda: rx.stats.snapshot()["internal_errors"] == 3, what="3 internal errors")
        assert rx.alive
        _legit_roundtrip(rx.address, "still-works")
        assert rx.wait("still-works", timeout=5).ok
    finally:
        raw.close(0)


def test_many_frames_are_dropped_as_read_and_rejected(closing):
    rx = KVReceiver()
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        raw.send_multipart(_kv("frames") + [b"x"] * 1000)
        _until(lambda: rx.stats.snapshot()["rejected"].get("frame_count") == 1, what="frame_count reject")
        r = rx.wait("frames", timeout=5)
        assert not r.ok and "frame" in r.error
        assert rx.alive and rx.stats.snapshot()["internal_errors"] == 0
    finally:
        raw.close(0)


def test_heartbeat_alive_and_heartbeat_file(tmp_path, closing):
    path = tmp_path / "rx.json"
    rx = KVReceiver(heartbeat_path=path)
    closing(rx)
    assert rx.alive
    _until(path.exists, what="heartbeat file")
    h1 = rx.heartbeat
    _until(lambda: rx.heartbeat > h1 + 0.15, what="heartbeat to advance while idle")
    data = json.loads(path.read_text())
    assert data["pid"] == os.getpid() and data["address"] == rx.address and data["closed"] is False
    assert abs(data["time"] - time.time()) < 60 and "transfers_completed" in data["stats"]
    _legit_roundtrip(rx.address, "hb")
    # rewritten about once a second, with current stats
    _until(lambda: json.loads(path.read_text())["stats"]["transfers_completed"] == 1, what="stats in file")
    assert not list(tmp_path.glob("*.tmp"))
    rx.close()
    assert not rx.alive
    assert json.loads(path.read_text())["closed"] is True


# ------------------------------------------------------------ finding 2: bounded memory


def test_max_open_transfers(closing):
    rx = KVReceiver(max_open_transfers=4)
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        for i in range(3):  # 3 open transfers (a chunk each, no done yet)
            raw.send_multipart(_kv(f"open{i}"))
        raw.send(_done("empty"))  # a transfer with no layers: stored, counts too
        raw.send_multipart(_kv("one-too-many"))
        raw.send(_done("empty-too-many"))
        nacks = _replies(raw, "nack", 2)
        assert {m["xfer"] for m in nacks} == {"one-too-many", "empty-too-many"}
        assert all("limit 4" in m["reason"] for m in nacks)
        assert rx.stats.snapshot()["rejected"] == {"too_many_transfers": 2}
        assert rx.wait("empty", timeout=5).ok  # collected: room for one more
        raw.send(_done("open0", chunks=1, layers=1, nbytes=16))  # the existing ones keep working
        assert rx.wait("open0", timeout=5).ok
        raw.send_multipart(_kv("later"))
        raw.send(_done("later", chunks=1, layers=1, nbytes=16))
        assert rx.wait("later", timeout=5).ok
    finally:
        raw.close(0)


def test_max_held_and_per_peer_bytes(closing):
    K = 1024
    rx = KVReceiver(max_held_bytes=100 * K, max_peer_bytes=60 * K)
    closing(rx)
    a, b = _raw_dealer(rx.address), _raw_dealer(rx.address)
    try:
        def transfer(sock, x, n):
            sock.send_multipart(_kv(x, n=n))
            sock.send(_done(x, chunks=1, layers=1, nbytes=n))

        transfer(a, "a1", 40 * K)
        _until(lambda: rx.ready("a1"), what="a1")
        transfer(a, "a2", 40 * K)            # peer a would hold 80 K > 60 K
        _until(lambda: rx.ready("a2"), what="a2")
        transfer(b, "b1", 40 * K)            # another peer: fine (80 K in all)
        transfer(b, "b2", 30 * K)            # 110 K in all > 100 K
        _until(lambda: rx.ready("b2"), what="b2")  # (collecting b1 earlier would make room)
        assert "peer_full" in (rx.wait("a2", timeout=5).error or "")
        assert rx.wait("b1", timeout=5).ok
        assert "receiver_full" in (rx.wait("b2", timeout=5).error or "")
        assert rx.stats.snapshot()["rejected"] == {"peer_full": 1, "receiver_full": 1}
        assert rx.wait("a1", timeout=5).ok   # collected: a's bytes are free again
        transfer(a, "a3", 40 * K)
        r = rx.wait("a3", timeout=5)
        assert r.ok and r.nbytes == 40 * K
    finally:
        a.close(0)
        b.close(0)


def test_stale_transfers_and_expired_results(closing):
    rx = KVReceiver(stale_after_s=0.3, result_ttl_s=0.3)
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        raw.send_multipart(_kv("stale", n=4096, lbytes=8192))  # half a layer, never finished
        raw.send(_done("uncollected"))
        r = rx.wait("stale", timeout=10)
        assert not r.ok and "stale" in r.error
        _until(lambda: "uncollected" not in rx.completed(), what="result expiry")
        st = rx.stats.snapshot()
        assert st["transfers_stale"] == 1 and st["results_expired"] >= 1
        _until(lambda: rx.stats.snapshot()["held_bytes"] == 0, what="held bytes released")
    finally:
        raw.close(0)
    # idle connections are forgotten too
    _until(lambda: rx.stats.snapshot()["peers"] == 0, what="idle peer records dropped")


def test_zeromq_limits_derive_from_the_caps(closing):
    rx = KVReceiver(credit_bytes=1 << 20, max_message_bytes=256 << 10, max_open_transfers=8)
    closing(rx)
    assert rx.max_frame_bytes == (256 << 10) + wire.MAX_HEADER_BYTES
    assert rx.rcvhwm == (1 << 20) // 1024 + 2 * 8 + 64
    assert rx.sndhwm == 4 * 8 + 64
    # a frame over MAXMSGSIZE never reaches Python: libzmq drops that connection
    raw = _raw_dealer(rx.address)
    try:
        big = rx.max_frame_bytes + 1
        raw.send_multipart(_kv("huge", n=big))
        time.sleep(0.5)
        _legit_roundtrip(rx.address, "fine")
        assert rx.wait("fine", timeout=5).ok
        st = rx.stats.snapshot()
        assert st["rejected"] == {} and "huge" not in rx.completed()
    finally:
        raw.close(0)


def test_closed_id_bookkeeping_is_bounded(closing):
    rx = KVReceiver(max_open_transfers=16)
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        n = rx._closed_keep + 2000
        for i in range(n):
            raw.send(_abort(f"gone-{i}"))
        _until(lambda: rx.stats.snapshot()["transfers_aborted"] == n, timeout=60, what="all aborts handled")
        assert len(rx._closed_ids) == rx._closed_keep
        assert len(rx.completed()) <= 16
    finally:
        raw.close(0)


def _rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _receiver_main(address: str, kwargs: dict, q) -> None:
    rx = KVReceiver(address, **kwargs)
    q.put(rx.address)
    time.sleep(600)


def _spawn_receiver(address: str, **kwargs):
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    p = spawn.Process(target=_receiver_main, args=(address, kwargs, q), daemon=True)
    p.start()
    assert q.get(timeout=60) == address
    return p


def _stats_from(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())["stats"]
    except (OSError, ValueError, KeyError):
        return {}


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs /proc")
def test_hostile_flood_memory_stays_bounded(tmp_path):
    """Was: large chunks that are never finished were all held (8 GiB allowed), and
    200k tiny 'done' messages for distinct ids added 344 MB (each left a stored
    result for 600 s). Now: at most max_peer_bytes held per connection, at most
    max_open_transfers results; the receiver (in its own process, RSS measured)
    still serves others."""
    hb = tmp_path / "hb.json"
    address = f"tcp://127.0.0.1:{free_port()}"
    p = _spawn_receiver(address, heartbeat_path=str(hb), max_peer_bytes=64 << 20, result_ttl_s=5.0)
    ctx = zmq.Context()
    try:
        _legit_roundtrip(address, "warm")
        _until(lambda: _stats_from(hb).get("transfers_completed") == 1, what="warm-up")
        base = _rss_bytes(p.pid)
        hostile = _raw_dealer(address, ctx)  # never reads its replies
        # 8 x 24 MiB chunks of transfers it never finishes: 2 fit its 64 MiB, 6 are refused
        for i in range(8):
            hostile.send_multipart(_kv(f"junk-{i}", n=24 << 20))
        _until(lambda: _stats_from(hb).get("rejected", {}).get("peer_full", 0) == 6, timeout=120,
               what="per-peer cap")
        after_junk = _rss_bytes(p.pid)
        assert after_junk - base < (48 + 96) << 20, \
            f"RSS grew by {(after_junk - base) >> 20} MiB (48 MiB held + transient)"
        n = 200_000
        for i in range(n):
            hostile.send(_done(f"flood-{i}"))
        total = 3 + 8 + n  # warm-up (hello, kv, done), junk, flood
        _until(lambda: _stats_from(hb).get("messages_received", 0) == total, timeout=180, what="flood handled")
        grew = _rss_bytes(p.pid) - after_junk
        assert grew < 64 << 20, f"RSS grew by {grew >> 20} MiB for {n} tiny messages"
        st = _stats_from(hb)
        # each 'done' was either stored (an empty transfer) or refused: the table was full
        assert st["rejected"]["too_many_transfers"] + st["transfers_completed"] - 1 == n
        assert st["rejected"]["too_many_transfers"] > n // 2 and st["stored_results"] <= 1024
        assert st["internal_errors"] == 0
        # others are still served once the flood's results expired (result_ttl_s)
        _until(lambda: _stats_from(hb).get("stored_results", 1) == 0, timeout=30, what="results to expire")
        _legit_roundtrip(address, "after-flood")
        hostile.close(0)
    finally:
        p.kill()
        p.join(10)
        ctx.destroy(0)


# ----------------------------------------------------------- finding 3: ownership


def test_other_peers_cannot_touch_a_transfer_or_its_result(closing):
    rx = KVReceiver()
    closing(rx)
    owner, intruder = _raw_dealer(rx.address), _raw_dealer(rx.address)
    try:
        # an open transfer: the intruder's chunk, done and abort are refused
        owner.send_multipart(_kv("mine", n=16, lbytes=32))
        _until(lambda: rx.stats.snapshot()["chunks_received"] == 1, what="owner's first chunk")
        intruder.send_multipart(_kv("mine", seq=1, n=16, offset=16, lbytes=32))
        intruder.send(_done("mine", chunks=2, layers=1, nbytes=32))
        intruder.send(_abort("mine"))
        assert len(_replies(intruder, "nack", 3)) == 3
        owner.send_multipart(_kv("mine", seq=1, n=16, offset=16, lbytes=32))
        owner.send(_done("mine", chunks=2, layers=1, nbytes=32, digest="ab12"))
        assert _replies(owner, "ack", 1)[0]["xfer"] == "mine"
        # a complete, uncollected result: the intruder can neither withdraw nor replace it
        intruder.send(_abort("mine"))
        intruder.send(_done("mine"))
        intruder.send_multipart(_kv("mine"))
        assert len(_replies(intruder, "nack", 3)) == 3
        assert rx.stats.snapshot()["rejected"] == {"peer_mismatch": 6}
        r = rx.wait("mine", timeout=5)
        assert r.ok and r.nbytes == 32 and r.digest == "ab12"
        # the owner itself may still withdraw a result it has not seen collected
        owner.send(_done("mine2"))
        _until(lambda: rx.ready("mine2"), what="mine2")
        owner.send(_abort("mine2", "changed my mind"))
        _until(lambda: not rx.stats.snapshot()["transfers_aborted"] == 0, what="abort")
        r = rx.wait("mine2", timeout=5)
        assert not r.ok and "changed my mind" in r.error
    finally:
        owner.close(0)
        intruder.close(0)


def test_digest_roundtrip_and_validation(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    d = "0123456789abcdef" * 8  # 128 chars
    tx.begin("dg")
    tx.finish("dg", digest=d)
    assert rx.wait("dg", timeout=5).digest == d
    tx.begin("nodg")
    tx.finish("nodg")
    assert rx.wait("nodg", timeout=5).digest == ""
    for bad in ("ABC", "xyz", d + "0", 5):
        with pytest.raises(ValueError, match="digest"):
            tx.finish("dg", digest=bad)
        with pytest.raises(WireError, match="digest"):
            wire.decode([msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": "x", "chunks": 0, "layers": 0,
                                        "nbytes": 0, "digest": bad})], wire.SENDER_KINDS)


# ------------------------------------------------------------------- CURVE


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    generate_keys(d)
    return d


def test_generate_keys_layout_and_permissions(keys, tmp_path):
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret", "clients/client.key"):
        assert stat.S_IMODE((keys / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys / "clients").stat().st_mode) == 0o700
    # pyzmq's own reader understands them
    pub, sec = zmq.auth.load_certificate(keys / "server.key_secret")
    s, c = ServerKeys.load(keys), ClientKeys.load(keys)
    assert s.public == pub and s.secret == sec and c.server_public == pub
    assert s.allowed_clients == {c.public}
    assert "secret" not in repr(s).replace("secret=", "") and s.secret.decode() not in repr(s)
    with pytest.raises(KeysError, match="refusing to overwrite"):
        generate_keys(keys)
    generate_keys(keys, overwrite=True)
    assert ServerKeys.load(keys).public != pub
    # clear errors naming the file
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KeysError, match="server.key_secret"):
        ServerKeys.load(empty)
    with pytest.raises(KeysError, match="client.key_secret"):
        ClientKeys.load(empty)
    (keys / "clients" / "client.key").unlink()
    with pytest.raises(KeysError, match="clients"):
        ServerKeys.load(keys)
    (keys / "server.key").write_text("garbage\n")
    with pytest.raises(KeysError, match="server.key"):
        ClientKeys.load(keys)


def test_keys_cli(tmp_path, capsys):
    from proserve.kvtransfer import keys as keys_cli
    d = tmp_path / "k"
    assert keys_cli.main([str(d)]) == 0
    out = capsys.readouterr().out
    assert "server.key_secret" in out and "client.key_secret" in out and "decode hosts" in out
    assert keys_cli.main([str(d)]) == 1  # no overwrite
    assert keys_cli.main([str(d), "--overwrite"]) == 0


def test_is_loopback():
    yes = ["tcp://127.0.0.1:5", "tcp://127.3.2.1:5", "tcp://localhost:5", "tcp://[::1]:5", "ipc:///tmp/x",
           "inproc://x"]
    no = ["tcp://10.0.0.1:5", "tcp://*:5", "tcp://0.0.0.0:5", "tcp://eth0:5", "tcp://example.com:5",
          "tcp://[::]:5", "udp://127.0.0.1:5", "", None]
    assert all(is_loopback(a) for a in yes)
    assert not any(is_loopback(a) for a in no)


def test_curve_roundtrip_and_unauthorised_senders(keys, tmp_path, closing):
    rx = KVReceiver(f"tcp://127.0.0.1:{free_port()}", curve=ServerKeys.load(keys))
    closing(rx)
    good = KVSender(rx.address, curve=ClientKeys.load(keys), timeout=10)
    closing(good)
    a = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    good.send_layer("enc", 0, list(range(8)), a)
    good.finish("enc", digest="beef")
    r = rx.wait("enc", timeout=5)
    assert r.ok and np.array_equal(r.layer_array(0), a) and r.digest == "beef"

    other = tmp_path / "other"
    generate_keys(other)                   # a wrong server key (and an unknown client key)
    unlisted = tmp_path / "unlisted"       # the right server key, a client key not in clients/
    generate_keys(unlisted)
    for f in ("server.key", "server.key_secret"):
        (unlisted / f).write_bytes((keys / f).read_bytes())
    intruders = {"no-keys": KVSender(rx.address, timeout=30),
                 "wrong-keys": KVSender(rx.address, curve=ClientKeys.load(other), timeout=30),
                 "unlisted-key": KVSender(rx.address, curve=ClientKeys.load(unlisted), timeout=30)}
    for name, tx in intruders.items():
        closing(tx)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            tx.send_layer(name, 0, [0], np.ones(16, np.float32))
        assert time.monotonic() - t0 < 10  # failed fast (handshake refused or connect bound), not 30 s
        assert not tx.destination_ok(rx.address)
    assert "refused this sender's CURVE client key" in intruders["unlisted-key"].destinations()[rx.address]["last_error"]
    # nothing of theirs reached the receiver; the legit sender still works
    good.send_layer("enc2", 0, [0], np.ones(4, np.float32))
    good.finish("enc2")
    assert rx.wait("enc2", timeout=5).ok
    assert rx.completed() == []
    st = rx.stats.snapshot()
    assert st["chunks_received"] == 2 and st["rejected_total"] == 0
    _until(lambda: rx.stats.snapshot()["auth_failures"] >= 1 and rx.stats.snapshot()["handshake_failures"] >= 2,
           what="auth/handshake failures counted")


def test_curve_fails_closed_without_its_zap_handler(keys, closing):
    """libzmq admits any client that knows the server key when no ZAP handler
    answers, unless the domain is enforced: the receiver enforces it."""
    rx = KVReceiver(curve=ServerKeys.load(keys))
    closing(rx)
    assert rx._auth.stop()  # the allow-list is gone
    tx = KVSender(rx.address, curve=ClientKeys.load(keys), timeout=30, connect_timeout=1.0)
    closing(tx)
    with pytest.raises(TransferError):
        tx.send_layer("x", 0, [0], np.ones(4, np.float32))
    assert rx.stats.snapshot()["chunks_received"] == 0 and rx.completed() == []


def test_a_receiver_whose_zap_handler_died_is_not_alive(keys, tmp_path, closing):
    """Without its ZAP handler a CURVE receiver refuses every connection: it stops
    counting as alive and its heartbeat file says why (the worker's /health answers
    503 at once, not once the file has aged)."""
    from proserve.prefill.worker_http import receiver_problem
    hb = tmp_path / "rx.json"
    rx = KVReceiver(curve=ServerKeys.load(keys), heartbeat_path=hb)
    closing(rx)
    _until(hb.exists, what="heartbeat file")
    assert rx.alive and receiver_problem(str(hb), 3600) is None
    assert rx._auth.stop()
    assert not rx.alive

    def stopped():
        try:
            return json.loads(hb.read_text()).get("stopped")
        except ValueError:      # (replaced atomically; never half-written, but be safe)
            return None
    _until(stopped, what="the heartbeat file to say the receiver stopped")
    assert "ZAP" in stopped()
    assert "ZAP" in receiver_problem(str(hb), 3600)


def test_a_receiver_whose_thread_ended_says_so_in_its_heartbeat(tmp_path, closing):
    """A socket error ends the receiver's thread: the heartbeat file says so (the
    worker's /health answers 503 with the reason at once) instead of only ageing."""
    from proserve.prefill.worker_http import receiver_problem
    hb = tmp_path / "rx.json"
    rx = KVReceiver(heartbeat_path=hb)
    closing(rx)
    _until(hb.exists, what="heartbeat file")

    def broken(sock):
        raise zmq.ZMQError(zmq.ENOTSOCK, "socket gone")
    rx._recv = broken                     # the loop looks it up on every round
    _until(lambda: not rx.alive, what="the thread to end")
    why = receiver_problem(str(hb), 3600)
    assert why is not None and "receiver thread ended" in why and "socket gone" in why, why


def test_take_collects_a_result_without_blocking_or_raising(closing):
    """The connector polls on the engine's thread: take() is the atomic ready-and-collect."""
    rx = KVReceiver()
    closing(rx)
    assert rx.take("nothing") is None
    _legit_roundtrip(rx.address, "t1")
    _until(lambda: rx.ready("t1"), what="result")
    got = rx.take("t1")
    assert got is not None and got.ok and got.nbytes == 4000
    assert rx.take("t1") is None and not rx.ready("t1")


def test_curve_receiver_needs_its_own_context(keys):
    with pytest.raises(ValueError, match="own zmq.Context"):
        KVReceiver(curve=ServerKeys.load(keys), ctx=zmq.Context.instance())


def test_non_loopback_needs_keys_or_explicit_opt_in(closing):
    with pytest.raises(ValueError, match="without CURVE keys"):
        KVReceiver("tcp://0.0.0.0:*")
    rx = KVReceiver("tcp://0.0.0.0:*", allow_insecure=True)
    closing(rx)
    tx = KVSender("tcp://10.255.255.1:1", timeout=30)
    closing(tx)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="refusing to send KV unencrypted to a non-loopback address"):
        tx.send_layer("x", 0, [0], np.ones(4, np.float32))
    with pytest.raises(TransferError, match="non-loopback"):
        tx.begin("y")
    assert time.monotonic() - t0 < 1
    assert not tx.destination_ok()
    ok = KVSender("tcp://10.255.255.1:1", timeout=30, allow_insecure_remote=True)
    closing(ok)
    ok.begin("z")  # let through (it would then wait for the connection, bounded)
    assert ok.pending() == ["z"]


# ------------------------------------------------------- finding 4: the sender fails fast


def test_dead_destination_fails_fast_then_recovers(closing):
    """Was: a dead receiver cost the full timeout once per layer (the vLLM connector
    calls send_layer per layer inside the forward pass)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    tx = KVSender(address, timeout=30)  # connect_timeout 2 s, breaker cooldown 2 s (defaults)
    closing(tx)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="no credit grant"):
        tx.send_layer("r1", 0, [0], np.ones(64, np.float32))
    assert time.monotonic() - t0 < 10  # ~connect_timeout, not the 30 s timeout
    t1 = time.monotonic()
    with pytest.raises(TransferTimeout, match="no credit grant"):  # the stored error, at once
        tx.send_layer("r1", 1, [0], np.ones(64, np.float32))
    assert time.monotonic() - t1 < 1
    assert "r1" in tx.pending()
    with pytest.raises(TransferTimeout):
        tx.finish("r1")
    assert tx.pending() == []
    t2 = time.monotonic()
    with pytest.raises(DestinationUnavailable, match="unavailable"):
        tx.send_layer("r2", 0, [0], np.ones(64, np.float32))
    with pytest.raises(DestinationUnavailable):  # and later calls for r2 too
        tx.send_layer("r2", 1, [0], np.ones(64, np.float32))
    assert time.monotonic() - t2 < 1
    st = tx.destinations()[address]
    assert st["state"] == "open" and st["failures"] == 1 and "no credit grant" in st["last_error"]
    assert not tx.destination_ok()
    assert tx.stats.snapshot()["transfers_refused"] == 1
    tx.abort("r2")
    # the receiver comes up: after the cooldown a transfer goes through and closes the breaker
    rx = KVReceiver(address)
    closing(rx)
    _until(tx.destination_ok, timeout=15, what="cooldown")
    a = np.arange(64, dtype=np.float32)
    tx.send_layer("r3", 0, [0], a)
    tx.finish("r3", timeout=10)
    assert np.array_equal(rx.wait("r3", timeout=5).layer_array(0), a)
    st = tx.destinations()[address]
    assert st["state"] == "closed" and st["failures"] == 0


def test_half_open_probe_and_doubling_cooldown(closing):
    address = f"tcp://127.0.0.1:{free_port()}"
    tx = KVSender(address, timeout=30, connect_timeout=0.5, breaker_cooldown_s=0.3, breaker_max_cooldown_s=0.5)
    closing(tx)
    with pytest.raises(TransferTimeout):
        tx.send_layer("p1", 0, [0], np.ones(4, np.float32))
    assert tx.destinations()[address]["failures"] == 1
    _until(tx.destination_ok, what="first cooldown")
    tx.begin("probe")                       # let through: the half-open probe
    assert tx.destinations()[address]["state"] == "half_open"
    with pytest.raises(DestinationUnavailable, match="probed"):
        tx.begin("meanwhile")                # only one at a time
    with pytest.raises(TransferTimeout):
        tx.send_layer("probe", 0, [0], np.ones(4, np.float32))
    st = tx.destinations()[address]
    assert st["state"] == "open" and st["failures"] == 2
    assert 0.3 < st["open_until"] - time.monotonic() <= 0.5  # doubled (0.6), capped at 0.5
    rx = KVReceiver(address)
    closing(rx)
    _until(tx.destination_ok, what="second cooldown")
    tx.begin("p2")
    tx.finish("p2", timeout=10)
    assert rx.wait("p2", timeout=5).ok and tx.destinations()[address]["state"] == "closed"


def test_finish_waits_only_what_is_left_of_the_wait_budget(closing):
    """A receiver that grants credit late and then never acks: the time the first
    call spent waiting for the grant comes off the transfer's budget, so finish()
    gives up when the rest of it is spent, not after another full timeout."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def grant():
        while not stop.is_set():
            if router.poll(50):
                f = router.recv_multipart()
                if msgpack.unpackb(f[1])["kind"] == "hello":
                    time.sleep(3)   # the grant comes 3 s late
                    router.send_multipart([f[0], wire.encode("credit", bytes=1 << 20, init=True,
                                                             max_message=1 << 20)])

    th = threading.Thread(target=grant, daemon=True)
    th.start()
    try:
        tx = KVSender(f"tcp://127.0.0.1:{port}", timeout=6, connect_timeout=10)
        closing(tx)
        t0 = time.monotonic()
        tx.send_layer("late", 0, [0], np.ones(16, np.float32))  # waits ~3 s for the grant
        waited = time.monotonic() - t0
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout, match="no ack"):
            tx.finish("late")
        assert time.monotonic() - t0 < 6 - waited + 2  # the rest of the 6 s budget, not another 6 s
    finally:
        stop.set()
        th.join(5)
        router.close(0)


def test_rejected_transfer_fails_at_once_afterwards(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=30)
    closing(tx)
    tx.send_layer("dropped", 0, [0], np.ones(16, np.float32))
    tx.flush("dropped")
    rx.discard("dropped")
    layer, deadline = 1, time.monotonic() + 10
    while True:  # until the sender has heard the nack (one of these calls raises it)
        try:
            tx.send_layer("dropped", layer, [0], np.ones(16, np.float32))
            tx.flush("dropped")   # small layers are packed: send each one now
        except TransferError as e:
            first = str(e)
            break
        assert time.monotonic() < deadline
        layer += 1
        time.sleep(0.01)
    assert "abandoned" in first or "gave up" in first
    t0 = time.monotonic()
    for more in range(layer + 1, layer + 4):
        with pytest.raises(TransferError) as ei:
            tx.send_layer("dropped", more, [0], np.ones(16, np.float32))
        assert str(ei.value) == first  # the stored error, at once
    with pytest.raises(TransferError) as ei:
        tx.finish("dropped")
    assert str(ei.value) == first
    assert time.monotonic() - t0 < 1
    assert tx.pending() == [] and tx.destination_ok()  # a nack is not the destination's fault


def _sleepy_receiver_main(address: str, q) -> None:
    rx = KVReceiver(address, credit_bytes=1 << 20)
    q.put(rx.address)
    time.sleep(600)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_stopped_receiver_fails_the_transfer_by_its_deadline(closing):
    """A SIGSTOP'd receiver mid-transfer: one call waits until the transfer's
    deadline, every later one fails at once (was: every layer waited its own
    timeout)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    p = spawn.Process(target=_sleepy_receiver_main, args=(address, q), daemon=True)
    p.start()
    try:
        assert q.get(timeout=60) == address
        timeout = 4.0
        tx = KVSender(address, timeout=timeout)
        closing(tx)
        tx.begin("warm")
        tx.finish("warm", timeout=10)   # connected, credit granted
        layer = np.zeros(256 << 10, np.uint8)  # a quarter of the 1 MiB window per layer
        os.kill(p.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            durations, errors = [], []
            for l in range(12):
                t0 = time.monotonic()
                try:
                    tx.send_layer("stuck", l, [0], layer)
                except TransferError as e:
                    errors.append(e)
                durations.append(time.monotonic() - t0)
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                tx.finish("stuck")
            durations.append(time.monotonic() - t0)
            total = time.monotonic() - start
        finally:
            os.kill(p.pid, signal.SIGCONT)
        assert errors and isinstance(errors[0], TransferTimeout)
        assert sum(d > 1 for d in durations) == 1  # one wait, until the deadline
        assert timeout - 0.5 < total < timeout + 4   # old code: one timeout per blocked layer (>= 8 x 4 s)
        assert all(str(e) == str(errors[0]) for e in errors[1:])
        assert tx.destinations()[address]["state"] == "open"  # nothing heard for > connect_timeout
    finally:
        p.kill()
        p.join(10)


def test_time_between_calls_does_not_count_only_waiting_does(closing):
    """The budget bounds waiting on the receiver, not the transfer's age: a
    chunked prefill whose chunks come seconds apart still completes."""
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=0.5)
    closing(tx)
    tx.send_layer("slow", 0, [0], np.ones(16, np.float32))
    time.sleep(0.7)              # the engine computes the next chunk meanwhile
    tx.send_layer("slow", 1, [0], np.ones(16, np.float32))
    tx.finish("slow")
    assert rx.wait("slow", timeout=5).ok
