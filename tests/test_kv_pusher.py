"""The producer's worker side off the forward pass (kvtransfer.pusher.KVPusher): the
forward thread stages each layer and returns; a thread of its own sends, in order, and
alone waits for the network. Every wait is bounded; a watchdog dumps stacks if a test
hangs."""
from __future__ import annotations

import faulthandler
import time

import numpy as np
import pytest
import zmq

torch = pytest.importorskip("torch")

from proserve.kvtransfer import pusher as P
from proserve.kvtransfer.receiver import KVReceiver
from proserve.kvtransfer.sender import KVSender
from proserve.kvtransfer.transport import free_port

NB = 12


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _cache(block_dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (NB, 2, 4, 8) if block_dim == 0 else (2, NB, 4, 8)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _gather(cache: torch.Tensor, block_dim: int, ids: list[int]) -> torch.Tensor:
    out = cache.index_select(block_dim, torch.tensor(ids))
    return out.movedim(block_dim, 0).contiguous() if block_dim else out


def _outcome(p: P.KVPusher, xfer: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    got = p.__dict__.setdefault("_outcomes_seen", {})   # outcomes() reports each once
    while xfer not in got:
        assert time.monotonic() < deadline, f"no outcome for {xfer}"
        got.update(p.outcomes())
        time.sleep(0.005)
    return got[xfer]


def _pusher(sender_timeout: float = 5.0, **kw) -> P.KVPusher:
    return P.KVPusher(lambda addr: KVSender(addr, timeout=sender_timeout, connect_timeout=sender_timeout), **kw)


@pytest.mark.parametrize("block_dim", [0, 1])
def test_staged_layers_arrive_in_order_and_done_is_acked(block_dim, closing):
    """Two requests' blocks of two steps and two layers: each piece arrives as the
    gather of its blocks, 'done' goes after its layers, and the ack comes back as the
    outcome None."""
    rx = KVReceiver()
    closing(rx)
    p = _pusher()
    closing(p)
    caches = [_cache(block_dim, seed=l) for l in range(2)]
    a = P.Save("a", rx.address, [3, 7], 0)
    b = P.Save("b", rx.address, [1], 0)
    for step, saves in ((0, [a, b]), (1, [P.Save("a", rx.address, [9], 2)])):
        for layer, c in enumerate(caches):
            p.save_layer(layer, c, block_dim, saves, step)
        for s in saves:
            p.flush(s.xfer, s.addr)
    p.finish("a", rx.address, "ab")
    p.finish("b", rx.address, "cd")
    assert _outcome(p, "a") is None and _outcome(p, "b") is None
    ra, rb = rx.wait("a", timeout=5), rx.wait("b", timeout=5)
    assert ra.ok and rb.ok and ra.digest == "ab" and sorted(ra.pieces) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for layer, c in enumerate(caches):
        assert torch.equal(ra.pieces[0, layer].tensor(), _gather(c, block_dim, [3, 7]))
        assert ra.pieces[1, layer].blocks == [2]
        assert torch.equal(ra.pieces[1, layer].tensor(), _gather(c, block_dim, [9]))
        assert torch.equal(rb.pieces[0, layer].tensor(), _gather(c, block_dim, [1]))
    assert p.failures() == {}


def test_the_forward_thread_does_not_wait_for_a_stalled_receiver(closing):
    """A receiver that never grants credit: save_layer still returns at once (the sender
    thread is the one that waits) until the staging bound is reached; then the next save
    waits at most the transfer timeout and fails that transfer, reported once."""
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)        # accepts connections, answers nothing
    silent.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(addr)
    try:
        layer = _cache(0)
        one = layer[0:1].numel() * layer.element_size()
        p = _pusher(timeout_s=1.0, max_staged_bytes=3 * one)
        closing(p)
        save = [P.Save("x", addr, [0], 0)]
        for step in range(3):                                    # within the bound: no wait at all
            p.save_layer(0, layer, 0, save, step)
        assert not p.is_failed("x")
        p.save_layer(0, layer, 0, save, 3)                       # past it: waits, then gives up
        assert p.is_failed("x")
        fails = p.failures()
        assert list(fails) == ["x"] and "staged" in fails["x"][1] and p.failures() == {}
        assert p.stats["staging_waits"] == 1
        p.save_layer(0, layer, 0, save, 4)                       # a failed transfer stages nothing more
        p.finish("x", addr, "")
        assert "staged" in _outcome(p, "x")
    finally:
        silent.close(0)


def test_a_refused_destination_fails_the_transfer_and_its_later_layers_are_dropped(closing):
    rx = KVReceiver(check_layout=lambda layout: "wrong tensor-parallel size")
    closing(rx)
    p = _pusher()
    closing(p)
    c = _cache(0)
    p.save_layer(0, c, 0, [P.Save("x", rx.address, [0, 1], 0)], 0)
    deadline = time.monotonic() + 10
    while not p.is_failed("x"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.save_layer(1, c, 0, [P.Save("x", rx.address, [0, 1], 0)], 0)
    p.finish("x", rx.address, "")
    assert "wrong tensor-parallel size" in _outcome(p, "x")
    assert "wrong tensor-parallel size" in p.failures()["x"][1]
    assert p.destinations() == {} or p.destinations()[rx.address]["state"] == "open"


@pytest.mark.parametrize("block_dim", [0, 1])
def test_the_accelerator_copy_path_gathers_what_the_cpu_path_gathers(block_dim):
    """The side-stream path (events, one index per step, copy to host), run here through
    torch.cpu's stream API on CPU tensors: same bytes as the CPU path, the step's index
    reused by its layers, and the forward stream told to wait for the copies."""
    p = P.KVPusher(lambda addr: None)
    try:
        caches = [_cache(block_dim, seed=l) for l in range(3)]
        ids = [4, 0, 11, 5]
        hosts = []
        for layer, c in enumerate(caches):
            host, done = p._copy_to_host(c, block_dim, ids, step=7)
            done.synchronize()
            hosts.append(host)
            assert torch.equal(host, _gather(c, block_dim, ids))
        assert p._index[0] == 7
        index = p._index[1]
        p._copy_to_host(caches[0], block_dim, ids, step=7)
        assert p._index[1] is index                          # one index per step
        p._copy_to_host(caches[0], block_dim, [1, 2], step=8)
        assert p._index[0] == 8 and p._index[1].tolist() == [1, 2]
        assert p._last_copy is not None
        p.order_forward_after_copies()
        assert p._last_copy is None
    finally:
        p.close()


def test_fp8_layers_are_gathered_as_bytes():
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("no float8 in this torch")
    p = P.KVPusher(lambda addr: None)
    try:
        c = (torch.randn(NB, 2, 4, 8) * 3).to(fp8)
        host, done = p._copy_to_host(c, 0, [2, 3], step=0)
        done.synchronize()
        assert host.dtype == fp8 and torch.equal(host.view(torch.uint8), c[2:4].view(torch.uint8))
    finally:
        p.close()


def test_a_lane_survives_an_internal_error(closing, monkeypatch):
    """An unexpected error while sending fails that transfer (reported) and the lane goes
    on serving the others."""
    rx = KVReceiver()
    closing(rx)
    p = _pusher()
    closing(p)
    c = _cache(0)
    with p._lock:
        lane = p._lane(rx.address)
    real = lane.sender.send_layer
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(*a, **kw)
    monkeypatch.setattr(lane.sender, "send_layer", flaky)
    p.save_layer(0, c, 0, [P.Save("bad", rx.address, [0], 0)], 0)
    p.finish("bad", rx.address, "")
    assert "boom" in _outcome(p, "bad")
    p.save_layer(0, c, 0, [P.Save("good", rx.address, [1], 0)], 0)
    p.finish("good", rx.address, "")
    assert _outcome(p, "good") is None
    assert np.array_equal(rx.wait("good", timeout=5).pieces[0, 0].tensor().float().numpy(),
                          c[1:2].float().numpy())


def test_a_stalled_destination_holds_up_only_its_own_lane(closing):
    """One decode worker stops granting credit (a stalled engine): its transfer waits in
    its own lane while a transfer to a healthy receiver, queued after it, goes through at
    once, and the forward thread never waited."""
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)        # accepts connections, answers nothing
    silent.setsockopt(zmq.LINGER, 0)
    stalled = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(stalled)
    rx = KVReceiver()
    closing(rx)
    try:
        p = _pusher(sender_timeout=30.0, timeout_s=30.0)
        closing(p)
        c = _cache(0)
        t0 = time.monotonic()
        p.save_layer(0, c, 0, [P.Save("slow", stalled, [0, 1], 0)], 0)
        p.finish("slow", stalled, "")
        p.save_layer(0, c, 0, [P.Save("fast", rx.address, [2], 0)], 0)
        p.finish("fast", rx.address, "")
        forward = time.monotonic() - t0
        assert _outcome(p, "fast") is None                  # while "slow" still waits for its credit
        assert "slow" not in p.__dict__["_outcomes_seen"] and p.busy()
        assert rx.wait("fast", timeout=5).ok
        assert forward < 5.0                                 # (bounded far below the 30 s timeout)
    finally:
        silent.close(0)


def test_an_abort_while_finishing_still_reports_an_outcome(closing):
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(addr)
    try:
        p = _pusher(sender_timeout=30.0)
        closing(p)
        with p._lock:
            lane = p._lane(addr)
        lane.sender.begin("x")             # a transfer with no layers (all cached): only 'done' to send
        p.finish("x", addr, "")            # 'done' is sent; its ack never comes from a silent receiver
        deadline = time.monotonic() + 10
        while "x" not in lane.finishing:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        p.abort("x", addr, "the request was cancelled")
        assert _outcome(p, "x") == "aborted: the request was cancelled"
    finally:
        silent.close(0)


def test_after_close_nothing_waits_for_ever(closing):
    p = _pusher()
    p.close()
    c = _cache(0)
    p.save_layer(0, c, 0, [P.Save("late", "tcp://127.0.0.1:1", [0], 0)], 0)
    assert p.is_failed("late")
    p.finish("late", "tcp://127.0.0.1:1", "")
    assert _outcome(p, "late") is not None and not p.busy()


def test_the_waits_an_idle_step_uses_return_on_progress(closing):
    """receiver.wait_any returns True as soon as one of the ids is final (False at the
    timeout); pusher.wait_progress returns when the sender thread reports an outcome."""
    rx = KVReceiver()
    closing(rx)
    assert rx.wait_any(["nope"], 0.05) is False
    p = _pusher()
    closing(p)
    p.save_layer(0, _cache(0), 0, [P.Save("w", rx.address, [0], 0)], 0)
    p.finish("w", rx.address, "")
    assert rx.wait_any(["other", "w"], 10.0) is True
    deadline = time.monotonic() + 10
    while p.busy():
        assert time.monotonic() < deadline
        p.wait_progress(0.5)
    assert _outcome(p, "w") is None


def test_a_closing_loader_reports_the_loads_still_queued():
    """Loads queued when the loader closes are reported failed (their requests recompute),
    not dropped (they would wait for ever)."""
    from proserve.kvtransfer.loader import KVLoader
    ld = KVLoader([_cache(0)], 0)
    with ld._cv:                       # queued and closing at once: the thread cannot take the jobs first
        ld._jobs.append(("r1", "x1", "ab", [0], 0, None, None))
        ld._jobs.append(("r2", "x2", "ab", [1], 0, None, None))
        ld._closing = True
        ld._cv.notify_all()
    ld._thread.join(5)
    done = ld.done()
    assert sorted(done) == ["r1", "r2"] and all(e and "closed" in e for e, _, _ in done.values())
