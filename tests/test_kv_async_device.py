"""The host staging buffers against an asynchronous device, simulated on CPU.

On an accelerator (CUDA, NPU, ...) a copy between pinned host memory and the
device is queued on a stream and runs later; a host buffer it reads or writes
may be reused only once an event recorded behind the copy has completed. Both
directions of the KV path depend on that, on any device type (the code goes
through ``torch.<device>``'s Stream/Event API, :func:`kvtransfer.common.device_api`):

* decode side (:func:`kvtransfer.kvcache._write_device`): received chunks are
  staged in a host buffer and copied to the cache; the buffer is released only
  after the copies' event (:func:`kvtransfer.kvcache._release_stage`);
* prefill side (:mod:`kvtransfer.pusher`): a layer's blocks are copied to host
  memory on a side stream; the sending thread waits for that copy's event before
  it reads the bytes.

Here a fake device defers every "device" copy until an event behind it is
synchronised, and a released stage is overwritten at once (its memory reused).
With the synchronisation in place the KV arrives exactly; each test also runs
the path with the synchronisation taken out and shows the corruption it causes,
so the test fails if the code stops synchronising.
"""
from __future__ import annotations

import contextlib
import time

import pytest

torch = pytest.importorskip("torch")

from proserve.kvtransfer import common, kvcache
from proserve.kvtransfer import pusher as P
from proserve.kvtransfer.kvcache import plan_load
from proserve.kvtransfer.receiver import KVReceiver
from proserve.kvtransfer.sender import KVSender

NB = 12


class FakeStream:
    def __init__(self):
        self.pending: list = []        # queued "device" work, in order
        self.done = 0                  # how much of it has run

    def run_until(self, mark: int) -> None:
        while self.done < mark:
            op = self.pending[self.done]
            self.done += 1
            op()

    def wait_event(self, event) -> None:   # device-side ordering: nothing for the host to do here
        pass


class FakeEvent:
    def __init__(self):
        self.stream, self.mark = None, 0

    def record(self, stream=None) -> None:
        self.stream = stream or FakeDevice.default
        self.mark = len(self.stream.pending)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.mark)

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.mark


class FakeDevice:
    """A ``torch.<device>``-like module whose copies are deferred to the stream."""
    default = FakeStream()
    current = default
    Stream = staticmethod(lambda device=None: FakeStream())
    Event = FakeEvent

    @staticmethod
    def current_stream(device=None):
        return FakeDevice.current

    @staticmethod
    @contextlib.contextmanager
    def stream(s):
        before, FakeDevice.current = FakeDevice.current, s
        try:
            yield
        finally:
            FakeDevice.current = before


@pytest.fixture
def fake_device(monkeypatch):
    FakeDevice.default = FakeDevice.current = FakeStream()
    monkeypatch.setattr(common, "device_api", lambda device: FakeDevice)
    return FakeDevice


def _cache(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, NB, 4, 8), generator=g).to(torch.bfloat16)      # CUDA's [2, blocks, ...]


# -- decode side: staging received KV, then the device copies ------------------------------

def _received(closing, src: list[torch.Tensor], blocks: list[int]):
    rx = KVReceiver()
    closing(rx)
    s = KVSender(rx.address, timeout=5, connect_timeout=5, chunk_bytes=256)   # several chunks per layer
    closing(s)
    for layer, c in enumerate(src):
        s.send_layer("x", layer, list(range(len(blocks))), c.index_select(1, torch.tensor(blocks)).movedim(1, 0))
    s.finish("x", digest="d" * 32)
    res = rx.wait("x", timeout=5)
    assert res is not None and res.ok
    return res


@pytest.mark.parametrize("synchronised", [True, False])
def test_the_stage_outlives_the_device_copies_that_read_it(synchronised, fake_device, monkeypatch, closing):
    src = [_cache(l) for l in range(2)]
    blocks, ids = [3, 0, 9], [5, 1, 10]
    res = _received(closing, src, blocks)
    dst = [torch.zeros_like(c) for c in src]
    copies = plan_load(res.pieces, dst, 1, ids, 0)
    assert len(copies) > 2                            # several chunks share the stage
    real_chunk = kvcache._write_chunk

    def deferred_chunk(c, src_view, cache, *a):       # the device runs it later, reading the stage then
        FakeDevice.current.pending.append(lambda: real_chunk(c, src_view, cache, *a))
        return 0
    monkeypatch.setattr(kvcache, "_write_chunk", deferred_chunk)
    real_release = kvcache._release_stage
    stream = FakeDevice.Stream()

    def release(done, stage):                         # once released, the memory is someone else's
        if synchronised:
            real_release(done, stage)
        stage.fill_(0xFF)
        stream.run_until(len(stream.pending))         # ...and the device catches up later
    monkeypatch.setattr(kvcache, "_release_stage", release)
    kvcache._write_device(copies, dst, 1, ids, 0, stream=stream)
    exact = all(torch.equal(dst[l][kv][b], src[l][kv][p]) for l in range(2) for kv in (0, 1)
                for p, b in zip(blocks, ids))
    assert exact is synchronised                      # without the wait, the copies read a reused stage


# -- prefill side: the device-to-host copy, then the sending thread ------------------------

@pytest.mark.parametrize("synchronised", [True, False])
def test_the_sender_reads_host_memory_only_after_the_copy_event(synchronised, monkeypatch, closing):
    rx = KVReceiver()
    closing(rx)
    p = P.KVPusher(lambda addr: KVSender(addr, timeout=5, connect_timeout=5))
    closing(p)
    cache = _cache(7)
    ids = [4, 11, 2]
    want = cache.index_select(1, torch.tensor(ids)).movedim(1, 0).contiguous()

    class LateCopy:
        """The copy into ``host`` happens when the event is waited for (an async device)."""
        def __init__(self, host):
            self.host = host

        def synchronize(self):
            if synchronised:
                self.host.copy_(want)

    def copy_to_host(kv_layer, block_dim, ids_, step):
        host = torch.full_like(want, -1.0)            # what the pinned buffer held before the copy
        return host, LateCopy(host)
    monkeypatch.setattr(p, "_copy_to_host", copy_to_host)

    class OnDevice:                                   # a layer on "the device": takes the copy path
        device = torch.device("cuda", 0)
    p.save_layer(0, OnDevice(), 1, [P.Save("x", rx.address, [0, 1, 2], 0)], 0)
    p.flush("x", rx.address)
    p.finish("x", rx.address, "d" * 32)
    deadline, seen = time.monotonic() + 10, {}
    while "x" not in seen:
        assert time.monotonic() < deadline
        seen.update(p.outcomes())
        time.sleep(0.005)
    res = rx.wait("x", timeout=5)
    assert res is not None and res.ok
    assert torch.equal(res.pieces[0, 0].tensor(), want) is synchronised
