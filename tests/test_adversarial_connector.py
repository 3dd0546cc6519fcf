"""Adversarial test of the decode side's check and direct write of a received
transfer (:func:`proserve.kvtransfer.loader.inject`, :mod:`proserve.kvtransfer.kvcache`): random
transfers -- wrong and right digests, dtypes, block shapes, block positions
(gaps, shifted, beyond the request), layer indices beyond the cache, chunked
layers carrying per-chunk or whole-layer block lists, chunks that do not tile
their piece, pieces of several prefill steps -- against a fake paged cache
(both block layouts: CPU ``[blocks, ...]`` and CUDA ``[2, blocks, ...]``).

Held up (no fix needed): a transfer is either rejected with nothing written, or
written only into the blocks vLLM allocated to this request beyond its
prefix-cached ones -- all of them, in every layer -- never elsewhere, and never
an exception other than LoadRejected."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
connector = pytest.importorskip("proserve.kvtransfer.connector")

from proserve.kvtransfer import loader, pusher
from proserve.kvtransfer.receiver import ChunkData, LayerData, TransferResult

NBLOCKS = 20


def _connector(n_layers: int, block_dim: int):
    c = connector.ProServeConnector.__new__(connector.ProServeConnector)   # no vLLM config needed
    shape = (NBLOCKS, 2, 4, 2) if block_dim == 0 else (2, NBLOCKS, 4, 2)
    c._kv_caches = {f"layer{i}": torch.full(shape, -7, dtype=torch.float16) for i in range(n_layers)}
    c._block_dim = block_dim
    c.debug_dir = c.debug_corrupt = None
    return c


def _layer(step: int, layer: int, arr: np.ndarray, chunks: list[tuple[int, list[int]]]) -> LayerData:
    """A received piece of ``arr``, in chunks of (rows, block ids carried)."""
    raw, row = bytearray(arr.tobytes()), int(np.prod(arr.shape[1:])) * arr.itemsize   # writable, like a frame
    out, off = [], 0
    for seq, (rows, blocks) in enumerate(chunks):
        out.append(ChunkData(seq, off, (rows, *arr.shape[1:]), blocks, memoryview(raw[off:off + rows * row])))
        off += rows * row
    return LayerData(layer, str(arr.dtype), tuple(arr.shape), out, len(raw), step=step)


def _random_case(rng: random.Random):
    n_layers, block_dim = rng.choice([1, 2, 3]), rng.choice([0, 1])
    c = _connector(n_layers, block_dim)
    req_blocks = rng.sample(range(NBLOCKS), rng.randrange(1, 8))
    skip = rng.randrange(0, len(req_blocks) + 1)
    digest = connector.prompt_digest([1, 2, 3])
    ld = connector.LoadSpec("req", "xfer", req_blocks, skip, digest)
    layers = {}
    for _ in range(rng.randrange(0, 2 * n_layers + 2)):
        step = rng.randrange(0, 3)
        layer = rng.randrange(0, n_layers + (1 if rng.random() < 0.05 else 0))   # sometimes beyond the cache
        first = rng.choice([0, skip, rng.randrange(0, 10)])
        n = rng.randrange(0, len(req_blocks) + 3)
        inner = (2, 4, 2) if rng.random() < 0.9 else (2, 4, 3)
        dtype = np.float16 if rng.random() < 0.95 else np.float32
        arr = np.full((n, *inner), 10 * step + layer + 1, dtype)
        blocks = list(range(first, first + n))
        if blocks and rng.random() < 0.1:
            blocks[-1] += 1                      # a gap
        if n >= 2 and rng.random() < 0.5:
            k = rng.randrange(1, n)
            spec = ([(k, blocks[:k]), (n - k, blocks[k:])] if rng.random() < 0.7
                    else [(k, blocks), (n - k, blocks)])
        else:
            spec = [(n, blocks)]
        piece = _layer(step, layer, arr, spec)
        if piece.chunks and rng.random() < 0.03:       # a chunk that does not continue its piece
            piece.chunks[-1].offset += 2
        layers[step, layer] = piece
    result = TransferResult("xfer", True, None, 0, 0, layers, 0.0, digest if rng.random() < 0.95 else "00" * 16)
    return c, ld, result, block_dim


@pytest.mark.parametrize("seed0", range(0, 600, 150))
def test_a_received_transfer_is_rejected_or_written_only_into_its_requests_blocks(seed0):
    outcomes = set()
    for seed in range(seed0, seed0 + 150):
        c, ld, result, block_dim = _random_case(random.Random(seed))
        before = {k: v.clone() for k, v in c._kv_caches.items()}
        allowed = set(ld.block_ids[ld.skip_blocks:])
        try:
            loader.inject(ld.xfer, ld.digest, ld.block_ids, ld.skip_blocks, result, list(c._kv_caches.values()),
                          block_dim)
            ok = True
        except loader.LoadRejected:
            ok = False
        outcomes.add(ok)
        for name, t in c._kv_caches.items():
            for blk in range(NBLOCKS):
                changed = not torch.equal(t.select(block_dim, blk), before[name].select(block_dim, blk))
                if changed:
                    assert ok, (seed, "rejected, but block", blk, "was written")
                    assert blk in allowed, (seed, "wrote block", blk, "outside the request's", allowed)
                elif ok:
                    assert blk not in allowed, (seed, name, "block", blk, "of the request was not written")
        if ok:   # ...and each block holds what the last piece covering it sent
            for layer, name in enumerate(c._kv_caches):
                for pos in range(ld.skip_blocks, len(ld.block_ids)):
                    want = _last_value(result.pieces, layer, pos)
                    got = c._kv_caches[name].select(block_dim, ld.block_ids[pos])
                    assert bool((got == want).all()), (seed, layer, pos, want)
    assert outcomes == {True, False}   # both kinds of case were exercised


def _last_value(pieces: dict, layer: int, pos: int) -> float:
    """The value the last (step-ordered) piece of ``layer`` covering position ``pos`` carries."""
    want = None
    for (step, l), piece in sorted(pieces.items()):
        if l == layer and piece.shape[0] and piece.blocks[0] <= pos < piece.blocks[0] + piece.shape[0]:
            want = 10 * step + layer + 1
    return want


def test_a_transfer_id_serves_one_request_per_engine():
    """A transfer id already used on this engine is refused, in use or not: the
    producer's worker remembers failed ids and skips their layers, so a reused one
    would be sent nowhere while its decode leg waited out --kv-timeout."""
    from types import SimpleNamespace

    c = connector.ProServeConnector.__new__(connector.ProServeConnector)   # scheduler side only
    c.is_producer, c._params, c._xfers, c._dest_open = True, {}, {}, {}
    c._used_xfers = __import__("collections").OrderedDict()

    def new(rid: str, xfer: str):
        c.on_new_request(SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2, 3], kv_transfer_params={
            "do_remote_decode": True, "remote_addr": "tcp://127.0.0.1:5555", "xfer_id": xfer}))
        return c._params[rid]

    assert new("r1", "x1").role == "produce"
    assert new("r2", "x1").role == "invalid"                         # in use
    c._release_xfer("x1", "r1")
    bad = new("r3", "x1")                                             # used before: refused all the same
    assert bad.role == "invalid" and "earlier request" in bad.error
    for k in range(connector.USED_XFERS_KEPT):                        # the memory is bounded...
        new(f"q{k}", f"y{k}")
        c._release_xfer(f"y{k}", f"q{k}")
    assert len(c._used_xfers) == connector.USED_XFERS_KEPT > pusher.FAILED_KEPT
    assert new("r4", "x1").role == "produce"                       # ...and an id long gone is usable again


def test_every_breaker_opening_reaches_the_scheduler_side():
    """The worker tells the scheduler side when a destination's breaker opens, closes
    and opens again after a failed half-open probe (a new open_until): otherwise the
    scheduler's "do not even try" entry expired after the first cooldown."""
    import time as _time
    from types import SimpleNamespace
    state = {"state": "closed", "open_until": 0.0, "last_error": None}
    told = []
    c = connector.ProServeConnector.__new__(connector.ProServeConnector)   # producer worker side only
    c.is_producer, c._meta_failed, c._dest_reported, c.tp_size, c.tp_rank = True, {}, {}, 1, 0
    c._pusher = SimpleNamespace(destinations=lambda: {"tcp://d:1": dict(state)})
    c.metrics = SimpleNamespace(destination=lambda addr, ok: told.append(ok))

    def step():
        m = c.build_connector_worker_meta()
        return None if m is None else m.dests["tcp://d:1"][0]

    assert step() is None                                               # usable from the start: nothing to say
    now = _time.monotonic()
    state.update(state="open", open_until=now + 0.3, last_error="refused")
    # opened: told at every step while it is open (vLLM merges only the ranks that report
    # in a step: a rank that recovers must never be alone about a destination)
    assert 0 < step() <= 0.3 and 0 < step() <= 0.3
    _time.sleep(0.35)
    assert step() is None                                               # cooldown over: nothing new
    state.update(state="half_open")
    assert step() is None                                               # the probe under way: nothing new
    now = _time.monotonic()
    state.update(state="open", open_until=now + 4)
    assert 3 < step() <= 4                                              # re-opened: told again
    state.update(state="closed")
    assert step() == 0.0 and step() is None and told == [False, False, True]


def test_kv_destinations_are_bounded(monkeypatch):
    """A request names where its KV goes: a producer keeps at most MAX_DESTINATIONS
    lanes (a thread, sockets, a breaker each), retiring the least recently used idle
    one; with all of them busy a new destination fails its transfer instead of opening
    more."""
    monkeypatch.setattr(pusher, "MAX_DESTINATIONS", 3)
    p = pusher.KVPusher(lambda addr: connector.KVSender(addr, timeout=1.0, connect_timeout=0.5))
    addrs = [f"tcp://127.0.0.1:{20000 + i}" for i in range(5)]
    try:
        with p._lock:
            first = [p._lane(a) for a in addrs[:3]]
            assert p._lane(addrs[0]) is first[0]                   # reused, and now the most recent
            p._lane(addrs[3])                                       # addrs[1] was the least recent: retired
            assert [a for a, x in p._lanes.items() if not x.stop] == [addrs[2], addrs[0], addrs[3]]
            for a in list(p._lanes):
                p._lanes[a].sender.begin("busy-" + a[-5:])          # every one has a transfer in flight
            err = p._lane(addrs[4])
        assert isinstance(err, pusher.TransferError) and "no room" in str(err)
        assert first[1].stop and not first[1].thread.join(5) and not first[1].thread.is_alive()
    finally:
        p.close()


def test_the_ranks_worker_metadata_keeps_every_ranks_reason():
    """vLLM merges the tensor-parallel ranks' worker metadata with aggregate(): a transfer
    refused by rank 0's receiver and timed out on rank 1's keeps both reasons, and the
    destination stays out for the longer cool-down."""
    M = connector.ProServeWorkerMetadata
    r0 = M(failed={"x": ("tcp://d:1", "rank 0: refuses this sender: tensor-parallel size 2")},
           dests={"tcp://d:1": (4.0, "rank 0: refused")})
    r1 = M(failed={"x": ("tcp://d:1", "rank 1: no credit grant"), "y": ("tcp://e:1", "rank 1: reset")},
           dests={"tcp://d:1": (2.0, "rank 1: no credit grant")})
    m = r0.aggregate(r1)
    assert m.failed["x"] == ("tcp://d:1", "rank 0: refuses this sender: tensor-parallel size 2; rank 1: no credit grant")
    assert m.failed["y"] == ("tcp://e:1", "rank 1: reset")
    assert m.dests["tcp://d:1"] == (4.0, "rank 0: refused; rank 1: no credit grant")
    assert r0.aggregate(M(failed={"x": ("tcp://d:1", "rank 1: no credit grant")})).failed["x"][1].count("rank 1") == 1


def test_only_a_step_with_nothing_to_compute_waits_for_the_connectors_threads():
    """An idle step (the engine steps only to move KV) blocks, the interpreter released,
    until the pusher, loader or receiver made progress (at most IDLE_WAIT_S): otherwise
    vLLM's busy wait between steps starves those threads of the interpreter. A step with
    work never waits."""
    from types import SimpleNamespace
    calls = []
    c = connector.ProServeConnector.__new__(connector.ProServeConnector)
    c._pusher = SimpleNamespace(busy=lambda: True, wait_progress=lambda t: calls.append(("pusher", t)))
    c._loader, c._loading, c._receiver, c._loads = None, {}, None, {}
    c._connector_metadata = connector.ProServeConnectorMetadata(idle=False)
    c._let_threads_run()
    assert calls == []
    c._connector_metadata = connector.ProServeConnectorMetadata(idle=True)
    c._let_threads_run()
    assert calls == [("pusher", connector.IDLE_WAIT_S)]
    calls.clear()
    c._pusher = None                                       # a consumer waiting for a transfer to arrive
    ld = connector.LoadSpec("r", "x1", [0], 0, "ab")
    c._loads = {"r": (ld, 0.0)}
    c._receiver = SimpleNamespace(wait_any=lambda xs, t: calls.append(("receiver", xs, t)))
    c._let_threads_run()
    assert calls == [("receiver", ["x1"], connector.IDLE_WAIT_S)]
    calls.clear()
    c._loading = {"r": ld}                                  # ... or for its load to be written
    c._loader = SimpleNamespace(wait_any=lambda t: calls.append(("loader", t)))
    c._let_threads_run()
    assert calls == [("loader", connector.IDLE_WAIT_S)]


@pytest.mark.parametrize("local_hit_blocks", [0, 2])
def test_a_load_skips_the_blocks_found_in_the_local_prefix_cache(local_hit_blocks, monkeypatch):
    """vLLM calls update_state_after_alloc before it sets request.num_computed_tokens (its
    waiting loop), so the local prefix-cache hit is read from num_external_tokens: those
    leading blocks may be shared with running requests and are neither written by the
    load nor reported if it fails (vLLM 0.23/0.27 would rewind every request sharing them)."""
    from types import SimpleNamespace
    bs = 4
    c = connector.ProServeConnector.__new__(connector.ProServeConnector)   # scheduler side only
    c.block_size, c._pending_load = bs, []
    prompt = list(range(5 * bs + 1))                       # 6 blocks, the last one partial
    c._params = {"r": connector.RequestKV("consume", xfer="x")}
    req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, num_computed_tokens=0)   # as vLLM has it
    ids = [9, 3, 7, 1, 5, 2]
    blocks = SimpleNamespace(get_block_ids=lambda: (ids,))
    external = len(prompt) - local_hit_blocks * bs
    assert c.get_num_new_matched_tokens(req, local_hit_blocks * bs) == (external, True)
    c.update_state_after_alloc(req, blocks, external)
    [ld] = c._pending_load
    assert ld.block_ids == ids and ld.skip_blocks == local_hit_blocks
    # a failed load, where vLLM has no failed_recving: only the blocks the load owns are reported
    monkeypatch.setattr(connector, "REPORTS_FAILED_RECVING", False)
    c._error_blocks, c._kv_transfer_config = set(), SimpleNamespace(kv_load_failure_policy="recompute")
    c.metrics = SimpleNamespace(load_failed=lambda reason: None)
    failed = set()
    c._load_failed(ld, "test", "timeout", failed)
    assert failed == {"r"}
    assert c.get_block_ids_with_load_errors() == set(ids[local_hit_blocks:])
    assert c.get_block_ids_with_load_errors() == set()     # reported once
