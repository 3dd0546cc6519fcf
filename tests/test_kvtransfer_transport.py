"""ZeroMQ KV transport (kvtransfer.transport): wire format, roundtrips, failure
handling, flow control. Every wait is bounded; each test is also guarded by a
watchdog that dumps stacks and exits if it ever hangs."""
from __future__ import annotations

import ast
import faulthandler
import multiprocessing as mp
import pathlib
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from proserve.kvtransfer import transport as T
from proserve.kvtransfer import wire
from proserve.kvtransfer.transport import (
    KVReceiver,
    KVSender,
    TransferError,
    TransferTimeout,
    WireError,
    free_port,
    plan_chunks,
)

PKG = pathlib.Path(T.__file__).resolve().parent
TRANSPORT_MODULES = ["transport.py", "wire.py", "common.py", "sender.py", "receiver.py"]


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _addr(kind: str, tmp_path) -> str:
    return f"tcp://127.0.0.1:{free_port()}" if kind == "tcp" else f"ipc://{tmp_path}/kv.sock"


def _raw_dealer(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(address)
    return s


def _kv_header(xfer="x", layer=0, seq=0, blocks=(), dtype="float32", shape=(4,), nbytes=None, offset=0,
               lshape=None, step=0, **extra):
    """A 'kv' header with one part (``extra`` goes into the header, not the part)."""
    part = {"step": step, "layer": layer, "seq": seq, "blocks": list(blocks), "dtype": dtype, "shape": list(shape),
            "offset": offset, "lshape": list(shape if lshape is None else lshape)}
    h = {"v": wire.VERSION, "kind": "kv", "xfer": xfer, "nbytes": 16 if nbytes is None else nbytes, "parts": [part]}
    h.update(extra)
    return h


def _until(pred, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _layers():
    rng = np.random.default_rng(0)
    return {
        0: rng.standard_normal((8, 2, 16, 4, 32)).astype(np.float16),              # block axis first
        1: rng.standard_normal((64, 1024)).astype(np.float32),                     # 256 KiB -> chunked
        2: rng.integers(-128, 127, (3, 5, 7), dtype=np.int8),
        3: np.asfortranarray(rng.standard_normal((40, 33))).astype(np.float64),    # non-contiguous
        4: rng.standard_normal((16, 64)).astype(np.float32)[:, ::2],               # strided view
        5: np.arange(12, dtype=np.uint8).reshape(3, 4),
        6: np.zeros((0, 4), np.float32),                                           # empty layer
    }


# ---------------------------------------------------------------- roundtrips


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_roundtrip_several_layers(kind, tmp_path, closing):
    rx = KVReceiver(_addr(kind, tmp_path))
    closing(rx)
    tx = KVSender(rx.address, chunk_bytes=64 << 10, timeout=10)
    closing(tx)
    layers = _layers()
    blocks = {l: list(range(100 + l, 100 + l + (a.shape[0] if a.ndim else 0))) for l, a in layers.items()}
    nchunks = {l: tx.send_layer("req-1", l, blocks[l], a) for l, a in layers.items()}
    assert nchunks[1] == 4 and nchunks[0] == 1
    sent = tx.finish("req-1", timeout=10)
    assert sent.layers == len(layers) and sent.chunks == sum(nchunks.values())
    res = rx.wait("req-1", timeout=10)
    assert res.ok, res.error
    assert set(res.pieces) == {(0, l) for l in layers}
    for l, a in layers.items():
        got = res.layer_array(l)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert got.tobytes() == np.ascontiguousarray(a).tobytes()
        assert res.pieces[0, l].blocks == blocks[l]
    # the 256 KiB layer came in 4 chunks, each with its own rows' block ids
    assert [c.blocks for c in res.pieces[0, 1].chunks] == [blocks[1][i:i + 16] for i in range(0, 64, 16)]
    assert tx.stats.snapshot()["contiguous_copies"] == 2
    st = rx.stats.snapshot()
    assert st["transfers_completed"] == 1 and st["rejected_total"] == 0
    assert st["bytes_received"] == sum(a.nbytes for a in layers.values())


def test_default_bind_is_loopback_and_ephemeral(closing):
    rx = KVReceiver()
    closing(rx)
    assert rx.address.startswith("tcp://127.0.0.1:")
    assert int(rx.address.rsplit(":", 1)[1]) > 0
    rx2 = KVReceiver(port=free_port())
    closing(rx2)
    assert rx2.address.startswith("tcp://127.0.0.1:")


def test_no_pickle_anywhere():
    """No module of the transport imports a pickler or uses pyzmq's pickling calls."""
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
    for name in TRANSPORT_MODULES:
        src = (PKG / name).read_text()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned, (name, ast.dump(node))
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned, (name, node.module)
            elif isinstance(node, ast.Attribute):
                assert node.attr not in ("send_pyobj", "recv_pyobj", "loads", "load"), (name, node.attr)
        assert "allow_pickle" not in src and "__import__" not in src, name


def test_bytes_like_payload_and_argument_errors(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    payload = bytearray(range(256)) * 4
    tx.send_layer("b", 0, [7], payload, dtype="uint8", shape=[1, 1024])
    tx.send_layer("b", 1, [7], memoryview(bytes(48)), dtype="float32", shape=(3, 4))
    with pytest.raises(ValueError, match="dtype and shape are required"):
        tx.send_layer("b", 2, [], b"abcd")
    with pytest.raises(ValueError, match="needs 16"):
        tx.send_layer("b", 2, [], b"abcd", dtype="float32", shape=[4])
    with pytest.raises(ValueError, match="unsupported dtype"):
        tx.send_layer("b", 2, [], b"abcd", dtype="complex64", shape=[1])
    with pytest.raises(ValueError, match="already sent"):
        tx.send_layer("b", 0, [7], payload, dtype="uint8", shape=[1, 1024])
    with pytest.raises(ValueError, match="dtype='float16' given"):
        tx.send_layer("b", 3, [], np.zeros(4, np.float32), dtype="float16")
    tx.finish("b", timeout=5)
    res = rx.wait("b", timeout=5)
    assert res.ok and res.layer_bytes(0) == bytes(payload) and res.layer_bytes(1) == bytes(48)


def test_empty_transfer_and_finish_async(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    tx.begin("empty")
    assert tx.finish("empty", timeout=5).chunks == 0
    assert rx.wait("empty", timeout=5).ok
    for i in range(3):
        tx.send_layer(f"a{i}", 0, [i], np.full(10, i, np.int32))
        tx.finish_async(f"a{i}", timeout=5)
    done = {}
    deadline = time.monotonic() + 5
    while len(done) < 3 and time.monotonic() < deadline:
        done.update(tx.poll_finished())
        time.sleep(0.01)
    assert sorted(done) == ["a0", "a1", "a2"] and all(isinstance(v, T.SendResult) for v in done.values())
    for i in range(3):
        assert rx.wait(f"a{i}", timeout=5).layer_array(0).tolist() == [i] * 10


def test_a_sender_whose_layout_does_not_fit_is_refused_at_the_first_contact(closing):
    """The receiver judges each connection's hello layout: a sender it cannot take is refused
    with the receiver's reason (every transfer fails with it, the destination's breaker opens),
    before any KV travels; a sender whose layout fits is served on the same receiver."""
    seen = []

    def check(layout: str):
        seen.append(layout)
        return None if layout == "tp=2 rank=1" else f"this receiver takes tp=2 rank=1, not {layout!r}"

    rx = KVReceiver(check_layout=check)
    closing(rx)
    bad = KVSender(rx.address, timeout=5, connect_timeout=5, layout="tp=1 rank=0")
    closing(bad)
    with pytest.raises(TransferError, match="refuses this sender: this receiver takes tp=2 rank=1, not 'tp=1 rank=0'"):
        bad.send_layer("x1", 0, [0], np.zeros(16, np.float32))
    st = bad.destinations()[rx.address]
    assert st["state"] == "open" and "tp=2 rank=1" in st["last_error"]
    with pytest.raises(T.DestinationUnavailable, match="tp=2 rank=1"):   # later transfers fail at once
        bad.send_layer("x2", 0, [0], np.zeros(16, np.float32))
    assert bad.stats.snapshot()["refusals"] == 1
    good = KVSender(rx.address, timeout=5, layout="tp=2 rank=1")
    closing(good)
    good.send_layer("y", 0, [0], np.arange(16, dtype=np.float32))
    good.finish("y", timeout=5)
    assert rx.wait("y", timeout=5).layer_array(0).tolist() == list(range(16))
    assert "x1" not in rx.completed() and rx.stats.snapshot()["senders_refused"] == 1
    assert seen == ["tp=1 rank=0", "tp=2 rank=1"]


def test_a_layout_check_that_raises_refuses_and_says_so(closing):
    def check(layout: str):
        raise KeyError("tp")

    rx = KVReceiver(check_layout=check)
    closing(rx)
    tx = KVSender(rx.address, timeout=5, layout="{}")
    closing(tx)
    with pytest.raises(TransferError, match="could not be checked .KeyError"):
        tx.send_layer("x", 0, [0], np.zeros(4, np.float32))
    assert rx.alive


def test_sender_layout_is_bounded():
    with pytest.raises(ValueError, match="layout"):
        KVSender("tcp://127.0.0.1:1", layout="x" * (wire.MAX_REASON_LEN + 1))


def test_two_senders_interleave(closing):
    rx = KVReceiver()
    closing(rx)
    errors = []

    def run(name: str, seed: int):
        try:
            tx = KVSender(rx.address, chunk_bytes=32 << 10, timeout=10)
            rng = np.random.default_rng(seed)
            for r in range(4):
                data = {l: rng.standard_normal((16, 512)).astype(np.float32) for l in range(3)}
                for l, a in data.items():
                    tx.send_layer(f"{name}-{r}", l, list(range(16)), a)
                    time.sleep(0.001)  # let the other sender's chunks interleave
                tx.finish(f"{name}-{r}", timeout=10)
                out[f"{name}-{r}"] = data
            tx.close()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    out: dict = {}
    threads = [threading.Thread(target=run, args=(n, s)) for n, s in (("A", 1), ("B", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(out) == 8
    for x, data in out.items():
        res = rx.wait(x, timeout=5)
        assert res.ok, res.error
        for l, a in data.items():
            assert np.array_equal(res.layer_array(l), a)


def test_one_sender_shared_by_threads(closing):
    """Sender methods are thread-safe: one thread streams layers while others
    block in finish() for earlier transfers."""
    rx = KVReceiver(credit_bytes=1 << 20)
    closing(rx)
    tx = KVSender(rx.address, chunk_bytes=64 << 10, timeout=10)
    closing(tx)
    data = {f"s{i}": np.random.default_rng(i).standard_normal((4, 64, 256)).astype(np.float32) for i in range(6)}
    finished, errors = [], []

    def finisher(x):
        try:
            finished.append(tx.finish(x, timeout=10).xfer_id)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = []
    for x, a in data.items():
        for l in range(a.shape[0]):
            tx.send_layer(x, l, list(range(64)), a[l])
        th = threading.Thread(target=finisher, args=(x,))
        th.start()
        threads.append(th)
    for th in threads:
        th.join(20)
    assert not errors, errors
    assert sorted(finished) == sorted(data)
    for x, a in data.items():
        res = rx.wait(x, timeout=5)
        assert res.ok and all(np.array_equal(res.layer_array(l), a[l]) for l in range(4))


def test_finish_async_reports_timeout(closing):
    tx = KVSender(f"tcp://127.0.0.1:{free_port()}", timeout=5)
    closing(tx)
    tx.begin("lonely")
    tx.finish_async("lonely", timeout=0.2)
    assert tx.poll_finished() == {}
    time.sleep(0.3)
    out = tx.poll_finished()
    assert list(out) == ["lonely"] and isinstance(out["lonely"], TransferTimeout)
    assert tx.pending() == [] and tx.poll_finished() == {}


def test_on_chunk_writes_into_destination(closing):
    dest = np.zeros((4, 64, 256), np.float32)  # [layer, block, elems]

    def on_chunk(xfer, layer, seq, blocks, buf, dtype, shape, offset=None, layer_shape=None):
        assert dtype == "float32" and layer_shape == (16, 256) and shape[0] == len(blocks)
        dest[layer, blocks] = np.frombuffer(buf, np.float32).reshape(shape)

    rx = KVReceiver(on_chunk=on_chunk)
    closing(rx)
    tx = KVSender(rx.address, chunk_bytes=4096, timeout=5)
    closing(tx)
    src = np.random.default_rng(3).standard_normal((4, 16, 256)).astype(np.float32)
    ids = [5, 9, 1, 60, 33, 2, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17]
    for l in range(4):
        tx.send_layer("dst", l, ids, src[l])
    tx.finish("dst", timeout=5)
    res = rx.wait("dst", timeout=5)
    assert res.ok and res.pieces == {} and res.chunks == 16
    assert np.array_equal(dest[:, ids], src)


def test_on_chunk_failure_fails_transfer_and_sender_learns(closing):
    def on_chunk(xfer, layer, seq, blocks, buf, dtype, shape):
        raise RuntimeError("no free blocks")

    rx = KVReceiver(on_chunk=on_chunk)
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    tx.send_layer("f", 0, [1], np.zeros(8, np.float32))
    with pytest.raises(TransferError, match="no free blocks"):
        tx.finish("f", timeout=5)
    res = rx.wait("f", timeout=5)
    assert not res.ok and "no free blocks" in res.error


# ------------------------------------------------------------------------ packing


def test_small_layers_of_several_steps_travel_in_one_message(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    rng = np.random.default_rng(5)
    src = {(s, l): rng.standard_normal((2, 64)).astype(np.float16) for s in range(2) for l in range(32)}
    for (s, l), a in src.items():
        assert tx.send_layer("p", l, [2 * s, 2 * s + 1], a, step=s) == 1
    assert rx.stats.snapshot()["messages_received"] <= 1   # nothing sent yet (but the hello)
    sent = tx.finish("p", timeout=5)
    st = tx.stats.snapshot()
    assert st["messages_sent"] == 1 and st["layers_packed"] == 64 and sent.chunks == sent.layers == 64
    res = rx.wait("p", timeout=5)
    assert res.ok and sorted(res.pieces) == sorted(src)
    for (s, l), a in src.items():
        assert np.array_equal(res.layer_array(l, step=s), a) and res.pieces[s, l].blocks == [2 * s, 2 * s + 1]


def test_flush_sends_the_pack_and_packs_respect_the_receivers_message_limit(closing):
    rx = KVReceiver(max_message_bytes=16 << 10)
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    a = np.arange(1024, dtype=np.uint8)
    tx.send_layer("f", 0, [], a)
    tx.flush("f")
    _until(lambda: rx.stats.snapshot()["chunks_received"] == 1, "the flushed layer")
    tx.flush("f")   # nothing packed: nothing sent
    tx.flush("never-started")
    for l in range(1, 40):   # 39 KiB of 1 KiB layers, messages of at most 16 KiB
        tx.send_layer("f", l, [], a)
    tx.finish("f", timeout=5)
    res = rx.wait("f", timeout=5)
    assert res.ok and len(res.pieces) == 40 and rx.stats.snapshot()["rejected_total"] == 0
    assert tx.stats.snapshot()["messages_sent"] >= 4


def test_small_and_large_layers_keep_their_order_and_bytes(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, chunk_bytes=64 << 10, timeout=5)
    closing(tx)
    rng = np.random.default_rng(6)
    sizes = [100, 200_000, 10, 32 << 10, 64 << 10, 5]
    src = {l: rng.integers(0, 255, n, dtype=np.uint8) for l, n in enumerate(sizes)}
    parts = [tx.send_layer("m", l, [], a) for l, a in src.items()]
    assert parts == [1, 4, 1, 1, 1, 1]
    tx.finish("m", timeout=5)
    res = rx.wait("m", timeout=5)
    assert res.ok and all(res.layer_bytes(l) == a.tobytes() for l, a in src.items())
    assert tx.stats.snapshot()["layers_packed"] == 4   # 100, 10, 32 KiB and 5 bytes


def test_a_pack_with_one_bad_part_fails_its_transfer_only(closing):
    rx = KVReceiver()
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        good = _kv_header("bad-pack", layer=0)["parts"][0]
        dup = dict(good)                                     # the same piece and seq again: out of order
        raw.send_multipart([msgpack.packb({"v": wire.VERSION, "kind": "kv", "xfer": "bad-pack", "nbytes": 32,
                                           "parts": [good, dup]}), bytes(32)])
        res = rx.wait("bad-pack", timeout=5)
        assert not res.ok and "bad_seq" in res.error
        tx = KVSender(rx.address, timeout=5)
        closing(tx)
        tx.send_layer("fine", 0, [], np.arange(8, dtype=np.uint8))
        tx.finish("fine", timeout=5)
        assert rx.wait("fine", timeout=5).layer_bytes(0) == bytes(range(8))
        with rx._cond:
            assert rx._held == 0
    finally:
        raw.close(0)


def test_abort_drops_an_unsent_pack(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    tx.send_layer("gone", 0, [], np.arange(8, dtype=np.uint8))
    tx.abort("gone", "request cancelled")
    res = rx.wait("gone", timeout=5)
    assert not res.ok and "request cancelled" in res.error
    assert rx.stats.snapshot()["chunks_received"] == 0 and tx.stats.snapshot()["messages_sent"] == 0


def test_torch_cpu_roundtrip(closing):
    torch = pytest.importorskip("torch", reason="torch is not importable here")
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, chunk_bytes=16 << 10, timeout=5)
    closing(tx)
    g = torch.Generator().manual_seed(0)
    layers = {
        0: torch.randn(8, 2, 16, 4, 16, generator=g, dtype=torch.float32).to(torch.bfloat16),
        1: torch.randn(32, 256, generator=g).to(torch.float16),
        2: torch.randn(64, 32, generator=g).t(),  # non-contiguous
    }
    for l, t in layers.items():
        tx.send_layer("t", l, list(range(t.shape[0])), t)
    tx.finish("t", timeout=5)
    assert tx.stats.snapshot()["contiguous_copies"] == 1  # only the transposed one
    res = rx.wait("t", timeout=5)
    assert res.ok, res.error
    for l, t in layers.items():
        got = res.pieces[0, l].tensor()
        assert got.dtype == t.dtype and tuple(got.shape) == tuple(t.shape)
        assert torch.equal(got, t)


def test_device_staging_path_with_host_tensor():
    """The accelerator path (chunk -> reusable host slot -> tracked zero-copy frame),
    driven with a CPU tensor so it runs without an accelerator."""
    torch = pytest.importorskip("torch", reason="torch is not importable here")
    from proserve.kvtransfer.sender import _DeviceSource, _Stager
    t = torch.randn(10, 3, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    stager = _Stager(2)
    src = _DeviceSource(t, stager)
    specs = plan_chunks(t.shape, 2, 3 * 8 * 2 * 3, list(range(10)))
    assert [s.shape for s in specs] == [(3, 3, 8), (3, 3, 8), (3, 3, 8), (1, 3, 8)]
    raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    for s in specs:
        frame = src.chunk(s, time.monotonic() + 5)
        assert frame.bytes == raw[s.offset:s.offset + s.nbytes]
        del frame
    assert stager.pinned is not None


def test_plan_chunks_geometry():
    # fits: one chunk, whole layer
    (c,) = plan_chunks((4, 8), 4, 1 << 20, [1, 2, 3, 4])
    assert c.shape == (4, 8) and c.blocks == [1, 2, 3, 4] and c.rows is None
    # split along the block axis
    cs = plan_chunks((10, 8), 4, 3 * 32, list(range(10, 20)))
    assert [c.shape for c in cs] == [(3, 8)] * 3 + [(1, 8)]
    assert [c.blocks for c in cs] == [[10, 11, 12], [13, 14, 15], [16, 17, 18], [19]]
    assert [c.offset for c in cs] == [0, 96, 192, 288]
    # one row bigger than a chunk: split further in, every chunk carries all ids
    cs = plan_chunks((2, 4, 16), 2, 64, [7, 8])
    assert [c.shape for c in cs] == [(2, 16)] * 4 and all(c.blocks == [7, 8] for c in cs)
    assert sum(c.nbytes for c in cs) == 2 * 4 * 16 * 2


# ------------------------------------------------------------- wire validation


def _part0(h: dict) -> dict:
    return h["parts"][0]


@pytest.mark.parametrize("mutate, reason, field", [
    (lambda h: _part0(h).update(layer="3"), "bad_field", "layer"),
    (lambda h: _part0(h).update(layer=True), "bad_field", "layer"),
    (lambda h: _part0(h).update(seq=-1), "bad_field", "seq"),
    (lambda h: _part0(h).update(blocks=[1, "2"]), "bad_field", "blocks"),
    (lambda h: _part0(h).update(dtype="complex128"), "bad_dtype", "dtype"),
    (lambda h: _part0(h).update(offset=8), "bad_offset", "offset"),
    (lambda h: _part0(h).update(shape=[2]), "nbytes_mismatch", "nbytes"),
    (lambda h: _part0(h).update(extra=1), "unknown_field", "extra"),
    # the step has its own field (version 2), validated like every other
    (lambda h: _part0(h).pop("step"), "missing_field", "step"),
    (lambda h: _part0(h).update(step=-1), "bad_field", "step"),
    (lambda h: _part0(h).update(step=True), "bad_field", "step"),
    (lambda h: _part0(h).update(step=1.0), "bad_field", "step"),
    (lambda h: _part0(h).update(step="0"), "bad_field", "step"),
    (lambda h: _part0(h).update(step=wire.MAX_INDEX + 1), "bad_field", "step"),
    (lambda h: _part0(h).update(layer=2 ** 63), "bad_field", "layer"),
    (lambda h: h.update(parts=[]), "bad_field", "parts"),
    (lambda h: h.update(parts={"0": 1}), "bad_field", "parts"),
    (lambda h: h.update(parts=[1]), "bad_field", "parts[0]"),
    (lambda h: h.update(parts=h["parts"] * (wire.MAX_PARTS + 1)), "bad_field", "parts"),
    (lambda h: h.update(nbytes=12), "nbytes_mismatch", "nbytes"),
    (lambda h: h.pop("xfer"), "missing_field", "xfer"),
    (lambda h: h.update(extra=1), "unknown_field", "extra"),
    # a version-1 header (the step folded into 'layer', one chunk per message)
    (lambda h: h.update(v=1, layer=0, seq=0), "bad_version", "v"),
    (lambda h: h.update(v=2), "bad_version", "v"),    # a version-2 peer (no hello layout, no refuse)
    (lambda h: h.update(v=4), "bad_version", "v"),
    (lambda h: h.update(kind="ack"), "bad_kind", "kind"),
])
def test_decode_rejects_bad_headers(mutate, reason, field):
    h = _kv_header()
    mutate(h)
    with pytest.raises(WireError) as ei:
        wire.decode([msgpack.packb(h), bytes(16)], wire.SENDER_KINDS)
    assert ei.value.reason == reason
    assert repr(field) in str(ei.value)


def test_an_old_version_is_refused_with_a_clear_error(closing):
    """A sender still speaking wire version 1 is told (nack) that the versions differ."""
    with pytest.raises(WireError, match="wire version 3, the peer sent 1"):
        wire.decode([msgpack.packb({"v": 1, "kind": "hello"})], wire.SENDER_KINDS)
    rx = KVReceiver()
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        old = {"v": 1, "kind": "kv", "xfer": "old", "layer": 0, "seq": 0, "blocks": [], "dtype": "float32",
               "shape": [4], "nbytes": 16, "offset": 0, "lshape": [4]}
        raw.send_multipart([msgpack.packb(old), bytes(16)])
        reply = msgpack.unpackb(raw.recv())
        assert reply["kind"] == "nack" and reply["xfer"] == "old" and "bad_version" in reply["reason"]
        assert rx.stats.snapshot()["rejected"] == {"bad_version": 1}
    finally:
        raw.close(0)


def test_several_parts_in_one_message_and_their_sizes():
    parts = [dict(_part0(_kv_header(layer=l, step=s)), shape=[2 + l], lshape=[2 + l]) for s, l in ((0, 0), (3, 1))]
    h = {"v": wire.VERSION, "kind": "kv", "xfer": "x", "nbytes": 4 * (2 + 3), "parts": parts}
    m = wire.decode([msgpack.packb(h), bytes(20)], wire.SENDER_KINDS)
    assert m.sizes == [8, 12] and [p["step"] for p in m.header["parts"]] == [0, 3]
    with pytest.raises(WireError, match="nbytes_mismatch"):
        wire.decode([msgpack.packb(dict(h, nbytes=16)), bytes(16)], wire.SENDER_KINDS)


def test_decode_rejects_framing():
    good = msgpack.packb(_kv_header())
    with pytest.raises(WireError, match="bad_msgpack"):
        wire.decode([b"\xc1\x00garbage", bytes(16)], wire.SENDER_KINDS)
    with pytest.raises(WireError, match="header must be a map"):
        wire.decode([msgpack.packb([1, 2]), bytes(16)], wire.SENDER_KINDS)
    with pytest.raises(WireError, match="payload frame"):
        wire.decode([good], wire.SENDER_KINDS)
    with pytest.raises(WireError, match="payload frame"):
        wire.decode([good, bytes(8), bytes(8)], wire.SENDER_KINDS)
    with pytest.raises(WireError, match="payload frame has 15"):
        wire.decode([good, bytes(15)], wire.SENDER_KINDS)
    with pytest.raises(WireError, match="too_large"):
        wire.decode([good, bytes(16)], wire.SENDER_KINDS, max_message_bytes=64)
    assert wire.decode([good, bytes(16)], wire.SENDER_KINDS).kind == "kv"


def test_receiver_rejects_malformed_and_keeps_serving(closing):
    rx = KVReceiver(max_message_bytes=1 << 16)
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        raw.send_multipart([msgpack.packb(_kv_header("bad-nbytes", nbytes=16)), bytes(12)])   # frame too short
        raw.send_multipart([b"\x93\x01\x02", bytes(16)])                                          # bad msgpack
        raw.send_multipart([msgpack.packb(_kv_header("bad-type", layer="0")), bytes(16)])        # wrong type
        raw.send_multipart([msgpack.packb(_kv_header("bad-dtype", dtype="int128")), bytes(16)])  # unknown dtype
        big = 1 << 17
        raw.send_multipart([msgpack.packb(_kv_header("too-big", dtype="uint8", shape=[big], nbytes=big)),
                            bytes(big)])                                                           # too large
        raw.send_multipart([msgpack.packb(_kv_header("frames")), bytes(8), bytes(8)])            # frame count
        raw.send_multipart([msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": "d", "chunks": -1, "layers": 0,
                                           "nbytes": 0, "digest": ""})])
        tx = KVSender(rx.address, timeout=5)
        closing(tx)
        a = np.arange(1000, dtype=np.float32)
        tx.send_layer("good", 0, [0], a)
        tx.finish("good", timeout=5)
        res = rx.wait("good", timeout=5)
        assert res.ok and np.array_equal(res.layer_array(0), a)
        # the bad messages came on another connection: ZeroMQ does not order them
        # against the good transfer, so wait (bounded) until all seven were handled
        deadline = time.monotonic() + 5
        while rx.stats.snapshot()["rejected_total"] < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
        rej = rx.stats.snapshot()["rejected"]
        assert rej == {"nbytes_mismatch": 1, "bad_msgpack": 1, "bad_field": 2, "bad_dtype": 1, "too_large": 1,
                       "frame_count": 1}
        # transfers named by a rejected chunk fail at once (no waiting for a timeout)
        for x in ("bad-nbytes", "bad-type", "bad-dtype", "too-big", "frames"):
            r = rx.wait(x, timeout=2)
            assert not r.ok and "rejected" in r.error
        # and their sender is told
        nacked, deadline = set(), time.monotonic() + 10
        while not nacked >= {"bad-nbytes", "bad-type", "bad-dtype", "too-big"} and time.monotonic() < deadline:
            if raw.poll(100):
                r = msgpack.unpackb(raw.recv_multipart()[0])
                if r["kind"] == "nack":
                    nacked.add(r["xfer"])
        assert nacked >= {"bad-nbytes", "bad-type", "bad-dtype", "too-big"}
    finally:
        raw.close(0)


# ------------------------------------------------------ incomplete transfers


def test_truncated_transfer_is_an_error(closing):
    rx = KVReceiver()
    closing(rx)
    raw = _raw_dealer(rx.address)
    try:
        for seq in range(2):
            raw.send_multipart([msgpack.packb(_kv_header("trunc", seq=seq, shape=[4], lshape=[12], offset=16 * seq)),
                                bytes(16)])
        raw.send(msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": "trunc", "chunks": 3, "layers": 1,
                                "nbytes": 48, "digest": ""}))
        res = rx.wait("trunc", timeout=5)
        assert not res.ok and "truncated" in res.error and res.pieces == {}
        while True:  # the sender gets a nack (after any credit returns)
            msg = msgpack.unpackb(raw.recv_multipart()[0])
            if msg["kind"] != "credit":
                break
        assert msg["kind"] == "nack" and msg["xfer"] == "trunc" and "truncated" in msg["reason"]
        # chunk counts match but a layer is short
        raw.send_multipart([msgpack.packb(_kv_header("short", shape=[4], lshape=[8])), bytes(16)])
        raw.send(msgpack.packb({"v": wire.VERSION, "kind": "done", "xfer": "short", "chunks": 1, "layers": 1,
                                "nbytes": 16, "digest": ""}))
        res = rx.wait("short", timeout=5)
        assert not res.ok and "truncated: layer 0 of step 0 has 16 of 32 bytes" in res.error
    finally:
        raw.close(0)


def test_abort_drops_partial_data_and_rejects_late_chunks(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    tx.send_layer("ab", 0, [0], np.zeros(100, np.float32))
    tx.abort("ab", reason="request cancelled")
    res = rx.wait("ab", timeout=5)
    assert not res.ok and "request cancelled" in res.error and res.pieces == {}
    raw = _raw_dealer(rx.address)
    try:
        # another connection cannot touch "ab" (it belongs to tx's connection) ...
        raw.send_multipart([msgpack.packb(_kv_header("ab")), bytes(16)])
        # ... and a late chunk of a transfer its own sender aborted is refused
        raw.send_multipart([msgpack.packb(_kv_header("ab2")), bytes(16)])
        raw.send(msgpack.packb({"v": wire.VERSION, "kind": "abort", "xfer": "ab2", "reason": "cancelled"}))
        raw.send_multipart([msgpack.packb(_kv_header("ab2", seq=1)), bytes(16)])
        deadline = time.monotonic() + 5
        while rx.stats.snapshot()["rejected"] != {"peer_mismatch": 1, "aborted_xfer": 1}:
            assert time.monotonic() < deadline, rx.stats.snapshot()["rejected"]
            time.sleep(0.01)
    finally:
        raw.close(0)
    assert rx.stats.snapshot()["transfers_aborted"] == 2


def test_wait_times_out_and_receiver_keeps_serving(closing):
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    tx.send_layer("never-done", 0, [0], np.zeros(10, np.float32))
    tx.flush("never-done")   # a small layer waits in the pack until flushed (or 'done')
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="never-done.*within 0.3 s.*1 chunks"):
        rx.wait("never-done", timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 2
    with pytest.raises(TransferTimeout, match="nothing received"):
        rx.wait("unknown", timeout=0.1)
    # still serving
    tx.send_layer("next", 0, [0], np.ones(10, np.float32))
    tx.finish("next", timeout=5)
    assert rx.wait("next", timeout=5).ok
    # give up for good: the sender's later finish is refused
    with pytest.raises(TransferTimeout):
        rx.wait("never-done", timeout=0.1, drop_on_timeout=True)
    with pytest.raises(TransferError, match="gave up"):
        tx.finish("never-done", timeout=5)


def _receiver_proc(address: str, q) -> None:
    rx = KVReceiver(address, on_chunk=lambda *a: time.sleep(0.2))  # slow, so the kill lands mid-transfer
    q.put(rx.address)
    time.sleep(60)


@pytest.mark.parametrize("same_address", [False, True])
def test_sender_times_out_when_receiver_dies(same_address, tmp_path, closing):
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    address = f"ipc://{tmp_path}/dying.sock"
    p = spawn.Process(target=_receiver_proc, args=(address, q), daemon=True)
    p.start()
    try:
        assert q.get(timeout=60) == address
        tx = KVSender(address, chunk_bytes=64 << 10, timeout=5)
        closing(tx)
        tx.send_layer("doomed", 0, list(range(16)), np.zeros((16, 8192), np.float32))  # 8 chunks
        p.kill()
        p.join(10)
        t0 = time.monotonic()
        # the connection reset is seen at once (or, at the latest, no ack in time)
        with pytest.raises(TransferError, match="no ack|reset"):
            tx.finish("doomed", timeout=1.0)
        assert time.monotonic() - t0 < 3
    finally:
        if p.is_alive():
            p.kill()
    # a new receiver: on a new address, or restarted on the same one (once the
    # sender's circuit breaker for that address lets a transfer through again)
    new = address if same_address else f"tcp://127.0.0.1:{free_port()}"
    rx = KVReceiver(new)
    closing(rx)
    deadline = time.monotonic() + 10
    while not tx.destination_ok(new):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    a = np.arange(4096, dtype=np.float32)
    tx.send_layer("fresh", 0, [0], a, dest=None if same_address else new)
    tx.finish("fresh", timeout=5)
    res = rx.wait("fresh", timeout=5)
    assert res.ok and np.array_equal(res.layer_array(0), a)


# --------------------------------------------------------------- flow control


def test_stalled_receiver_blocks_sender_then_times_out(closing):
    stall = threading.Event()
    entered = threading.Event()

    def on_chunk(*args):
        entered.set()
        stall.wait(20)

    window = 1 << 20
    rx = KVReceiver(on_chunk=on_chunk, credit_bytes=window)
    closing(rx)
    tx = KVSender(rx.address, chunk_bytes=128 << 10, timeout=5)
    closing(tx)
    big = np.zeros((64, 64 << 10), np.uint8)  # 4 MiB = 32 chunks, 4x the window
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="out of flow-control credit"):
        tx.send_layer("stuck", 0, list(range(64)), big, timeout=0.5)
    assert 0.45 < time.monotonic() - t0 < 3
    assert entered.is_set()
    st = tx.stats.snapshot()
    assert st["max_inflight_bytes"] <= window and st["chunks_sent"] <= 8 and st["credit_waits"] >= 1
    stall.set()
    # the receiver recovers and serves a new sender
    tx2 = KVSender(rx.address, timeout=5)
    closing(tx2)
    tx2.send_layer("after", 0, [0], np.ones(10, np.float32))
    tx2.finish("after", timeout=5)
    res = rx.wait("after", timeout=5)
    assert res.ok and res.nbytes == 40


def test_receiver_that_never_reads_bounds_sender(closing):
    """A peer that grants credit once and then never reads (or answers): the sender
    stops after one window and times out; nothing is buffered beyond it."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        tx = KVSender(f"tcp://127.0.0.1:{port}", chunk_bytes=64 << 10, timeout=5)
        closing(tx)
        tx.connect()
        assert router.poll(5000)
        hello = router.recv_multipart()
        assert msgpack.unpackb(hello[1])["kind"] == "hello"
        router.send_multipart([hello[0], wire.encode("credit", bytes=512 << 10, init=True, max_message=1 << 20)])
        with pytest.raises(TransferTimeout):
            tx.send_layer("mute", 0, [], np.zeros(4 << 20, np.uint8), timeout=0.5)
        assert tx.stats.snapshot()["max_inflight_bytes"] <= 512 << 10
    finally:
        router.close(0)


def test_sender_times_out_without_receiver(closing):
    tx = KVSender(f"tcp://127.0.0.1:{free_port()}", timeout=5)
    closing(tx)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="no credit grant"):
        tx.send_layer("nobody", 0, [], np.zeros(16, np.float32), timeout=0.3)
    assert time.monotonic() - t0 < 2


def test_receiver_memory_bound(closing):
    rx = KVReceiver(max_held_bytes=1 << 16)
    closing(rx)
    tx = KVSender(rx.address, timeout=5)
    closing(tx)
    tx.send_layer("fat", 0, [], np.zeros(1 << 15, np.float32))  # 128 KiB > 64 KiB
    with pytest.raises(TransferError, match="receiver_full|holding"):
        tx.finish("fat", timeout=5)
    assert rx.stats.snapshot()["rejected"] == {"receiver_full": 1}
    tx.send_layer("thin", 0, [], np.zeros(1 << 10, np.float32))
    tx.finish("thin", timeout=5)
    assert rx.wait("thin", timeout=5).ok
