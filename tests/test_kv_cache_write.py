"""Received KV written straight into a paged cache (kvtransfer.kvcache), end to end
over the real transport: pieces of several prefill steps, packed small layers,
chunked large ones, blocks larger than a message (written row by row), both
block layouts, scattered and consecutive destination blocks, a prefix already
cached locally; the device path's staging (run here on CPU tensors); and what
must be refused before anything is written."""
from __future__ import annotations

import faulthandler

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from proserve.kvtransfer import kvcache
from proserve.kvtransfer.kvcache import LoadRejected, plan_load, write
from proserve.kvtransfer.transport import KVReceiver, KVSender

NB = 16           # blocks in each cache
INNER = (2, 4, 8)  # the cache's shape without its block axis: a block of float16 is 128 bytes


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _cache(block_dim: int, fill: float | None = None, seed: int = 0) -> torch.Tensor:
    shape = (NB, *INNER) if block_dim == 0 else (INNER[0], NB, *INNER[1:])
    if fill is not None:
        return torch.full(shape, fill, dtype=torch.float16)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def _blocks(cache: torch.Tensor, block_dim: int, ids: list[int]) -> torch.Tensor:
    """Block-major copy of the given blocks: what the producer sends."""
    return cache.index_select(block_dim, torch.tensor(ids)).movedim(block_dim, 0).contiguous()


def _transfer(pieces: dict, closing, **sender_kw):
    """Send {(step, layer): (first position, data)} through a real sender and receiver."""
    rx = KVReceiver()
    closing(rx)
    tx = KVSender(rx.address, timeout=10, **sender_kw)
    closing(tx)
    for (step, layer), (first, data) in pieces.items():
        tx.send_layer("x", layer, list(range(first, first + data.shape[0])), data, step=step)
    tx.finish("x", digest="ab")
    res = rx.wait("x", timeout=10)
    assert res.ok, res.error
    return res, tx.stats.snapshot()


@pytest.mark.parametrize("block_dim", [0, 1])
@pytest.mark.parametrize("sender_kw, packed", [
    ({}, True),                                        # small layers: packed, one message per step
    ({"pack_bytes": 0, "chunk_bytes": 256}, False),    # chunks of two blocks
    ({"pack_bytes": 0, "chunk_bytes": 48}, False),     # a block (128 B) larger than a message: rows
])
def test_received_kv_lands_in_the_requests_blocks(block_dim, sender_kw, packed, closing):
    n_layers = 3
    src = [_cache(block_dim, seed=l) for l in range(n_layers)]      # the prefill engine's cache
    src_ids = [9, 2, 3, 4, 11, 5]                                   # its blocks for the request
    # step 0 computed positions 0..2 (position 2 half filled), step 1 positions 2..5
    early = {l: _blocks(src[l], block_dim, src_ids[:3]).clone() for l in range(n_layers)}
    for l in range(n_layers):
        early[l][2] = -1                                            # not yet final in step 0
    pieces = {}
    for l in range(n_layers):
        pieces[0, l] = (0, early[l])
        pieces[1, l] = (2, _blocks(src[l], block_dim, src_ids[2:]))
    res, st = _transfer(pieces, closing, **sender_kw)
    assert sorted(res.pieces) == sorted(pieces)
    assert (st["layers_packed"] > 0) == packed

    dst = [_cache(block_dim, fill=7.0) for _ in range(n_layers)]   # the decode engine's cache
    dst_ids = [14, 0, 6, 7, 8, 3]            # scattered, with a run of three consecutive blocks
    skip = 1                                 # position 0 came from its own prefix cache
    copies = plan_load(res.pieces, dst, block_dim, dst_ids, skip)
    assert any(c.k > 0 for c in copies) == (sender_kw.get("chunk_bytes") == 48)   # rows of a block
    writes = write(copies, dst, block_dim, dst_ids, skip)
    assert writes > 0
    for l in range(n_layers):
        for pos, (s, d) in enumerate(zip(src_ids, dst_ids)):
            got = dst[l].select(block_dim, d)
            if pos < skip:
                assert bool((got == 7).all()), (l, pos)
            else:   # the later step's bytes won
                assert torch.equal(got, src[l].select(block_dim, s)), (l, pos)
        others = [b for b in range(NB) if b not in dst_ids[skip:]]
        assert bool((dst[l].index_select(block_dim, torch.tensor(others)) == 7).all())


@pytest.mark.parametrize("block_dim", [0, 1])
def test_the_device_path_stages_through_one_buffer_and_writes_the_same(block_dim, closing, monkeypatch):
    """The device path (pinned staging, copies on a stream, the stage released after their
    event; run here on CPU tensors with torch.cpu's streams: pinning falls back to pageable
    memory without a GPU) writes what the CPU path writes, staging all the transfer's
    chunks in one buffer (no part of it reused within the transfer)."""
    src = [_cache(block_dim, seed=l) for l in range(2)]
    pieces = {(0, l): (0, _blocks(src[l], block_dim, [1, 2, 3, 4])) for l in range(2)}
    res, _ = _transfer(pieces, closing, pack_bytes=0, chunk_bytes=256)
    ids = [5, 9, 10, 2]
    cpu = [_cache(block_dim, fill=0.0) for _ in range(2)]
    staged = [_cache(block_dim, fill=0.0) for _ in range(2)]
    copies = plan_load(res.pieces, cpu, block_dim, ids, 0)
    write(copies, cpu, block_dim, ids, 0)
    allocs = []
    real_empty = torch.empty

    def counting_empty(*a, **kw):
        if kw.get("pin_memory"):
            allocs.append(a)
        return real_empty(*a, **kw)
    monkeypatch.setattr(kvcache.torch, "empty", counting_empty)
    released = []
    monkeypatch.setattr(kvcache, "_release_stage", lambda done, stage: released.append(stage.numel()))
    kvcache._write_device(copies, staged, block_dim, ids, 0)
    total = sum(c.nbytes for c in copies)
    assert len(allocs) == 1 and allocs[0][0] == (total,) and max(c.nbytes for c in copies) == 256 < total
    assert released == [total]
    assert all(torch.equal(a, b) for a, b in zip(cpu, staged))


def _piece_result(block_dim: int, closing, first: int = 0, n: int = 2, layer: int = 0, **kw):
    src = _cache(block_dim)
    data = _blocks(src, block_dim, list(range(n)))
    res, _ = _transfer({(0, layer): (first, data)}, closing, **kw)
    return res


@pytest.mark.parametrize("case, match", [
    ("beyond_request", "lie beyond this request"),
    ("layer_beyond_cache", "this engine has 1 layers"),
    ("block_id_out_of_cache", "outside the cache"),
    ("missing_blocks", "were not sent"),
    ("dtype", "does not match this engine"),
    ("misplaced_chunk", "does not continue the piece"),
])
def test_what_does_not_fit_is_refused_before_anything_is_written(case, match, closing):
    dst = [_cache(0, fill=3.0)]
    ids, skip = [4, 5], 0
    if case == "beyond_request":
        res = _piece_result(0, closing, first=1)
    elif case == "layer_beyond_cache":
        res = _piece_result(0, closing, layer=1)
    elif case == "block_id_out_of_cache":
        res = _piece_result(0, closing)
        ids = [4, NB]
    elif case == "missing_blocks":
        res = _piece_result(0, closing, n=1)
    elif case == "dtype":
        res = _piece_result(0, closing)
        dst = [_cache(0, fill=3.0).float()]
    else:
        res = _piece_result(0, closing, pack_bytes=0, chunk_bytes=128)
        res.pieces[0, 0].chunks[1].offset += 2
    before = [t.clone() for t in dst]
    with pytest.raises(LoadRejected, match=match):
        plan_load(res.pieces, dst, 0, ids, skip)
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


def test_a_received_chunk_is_copied_once_from_the_frame():
    """The CPU path reads the received bytes in place (no host copy first): a chunk's
    source tensor shares memory with the received buffer."""
    buf = bytearray(np.arange(64, dtype=np.float16).tobytes())
    c = kvcache.ChunkCopy(0, memoryview(buf), torch.float16, 0, (32,), 0, 2, 0, 1)
    view = kvcache._host_view(c)
    buf[0:2] = np.float16(-5).tobytes()
    assert view[0, 0].item() == -5
