"""vllm-ascend's KV cache layout: a ``(k_cache, v_cache)`` tuple per layer, each
``[blocks, block_size, heads, head_size]``, where vLLM passes one tensor per layer
(``[2, blocks, ...]`` with FlashAttention). The connector registers, sends and
loads either: the tuple's tensors are numbered one after the other on the wire
(:func:`proserve.kvtransfer.layout.flatten_caches`). Checked here through the real
connector hooks (``register_kv_caches``, ``save_kv_layer``), pusher, receiver and
loader, bit-exact against the fused layout carrying the same K and V."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
connector = pytest.importorskip("proserve.kvtransfer.connector")

from proserve.kvtransfer import layout as L
from proserve.kvtransfer.loader import inject
from proserve.kvtransfer.pusher import KVPusher
from proserve.kvtransfer.receiver import KVReceiver
from proserve.kvtransfer.sender import KVSender

NB, BS, HEADS, HD, LAYERS = 10, 4, 2, 8, 3


def _fused(seed: int) -> dict:
    """FlashAttention's layout: per layer [2, blocks, block_size, heads, head_size]."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn(2, NB, BS, HEADS, HD, generator=g).to(torch.bfloat16)
            for i in range(LAYERS)}


def _tuples(fused: dict) -> dict:
    """The same K and V as vllm-ascend holds them: a (k, v) tuple of [blocks, ...] tensors."""
    return {name: (t[0].clone(), t[1].clone()) for name, t in fused.items()}


def _zeros_like(caches: dict) -> dict:
    return {n: tuple(torch.zeros_like(t) for t in L.cache_parts(c)) if isinstance(c, tuple)
            else torch.zeros_like(c) for n, c in caches.items()}


def _connector(kv_caches: dict, producer: bool, monkeypatch, rx: KVReceiver | None = None):
    """A connector (no vLLM config: its worker-side fields set by hand) after
    register_kv_caches; the producer gets a real pusher to ``rx``."""
    c = connector.ProServeConnector.__new__(connector.ProServeConnector)
    c._kv_cache_config = SimpleNamespace(num_blocks=NB)
    c.block_size, c.tp_size, c.is_producer = BS, 1, producer
    c._step, c.debug_dir, c.debug_corrupt = 0, None, None
    started = {}
    if producer:
        monkeypatch.setattr(c, "_start_pusher", lambda: started.setdefault(
            "pusher", KVPusher(lambda addr: KVSender(addr, timeout=5, connect_timeout=5))))
    else:
        c._receiver = None
        monkeypatch.setattr(c, "_start_receiver", lambda caches: started.setdefault("caches", caches))
    c.register_kv_caches(kv_caches)
    c._pusher = started.get("pusher")
    return c, started


def _send(c, kv_caches: dict, rx: KVReceiver, xfer: str, block_ids: list[int]):
    """One prefill step writing ``block_ids`` (logical 0..) through the connector's hooks."""
    c._connector_metadata = connector.ProServeConnectorMetadata(
        saves=[connector.SaveSpec("r", xfer, rx.address, block_ids, 0)])
    for name, kv in kv_caches.items():
        c.save_kv_layer(name, kv, None)
    c._pusher.flush(xfer, rx.address)
    c._pusher.finish(xfer, rx.address, "d" * 32)
    deadline = time.monotonic() + 10
    seen = {}
    while xfer not in seen:
        assert time.monotonic() < deadline, "no outcome"
        seen.update(c._pusher.outcomes())
        time.sleep(0.005)
    assert seen[xfer] is None
    res = rx.wait(xfer, timeout=5)
    assert res is not None and res.ok
    return res


def test_flatten_numbers_a_tuples_tensors_one_after_the_other():
    fused = _fused(0)
    t = L.flatten_caches(fused, NB)
    assert (t.parts, t.block_dim, len(t.tensors)) == (1, 1, LAYERS)
    assert L.flatten_caches({n: c[0] for n, c in fused.items()}, NB).block_dim == 0   # [blocks, ...]
    tup = _tuples(fused)
    t = L.flatten_caches(tup, NB)
    assert (t.parts, t.block_dim, len(t.tensors)) == (2, 0, 2 * LAYERS)
    names = list(tup)
    assert [t.first[n] for n in names] == [0, 2, 4]
    assert t.tensors[2] is tup[names[1]][0] and t.tensors[5] is tup[names[2]][1]
    # MLA on vllm-ascend: (nope, rope) of different widths is two tensors per layer all the same
    mla = {f"l{i}": (torch.zeros(NB, BS, 1, 16), torch.zeros(NB, BS, 1, 4)) for i in range(2)}
    assert L.flatten_caches(mla, NB).parts == 2


@pytest.mark.parametrize("caches, match", [
    ({"a": (torch.zeros(NB, 2), torch.zeros(NB, 2)), "b": torch.zeros(NB, 2)}, "split alike"),
    ({"a": (torch.zeros(2, NB, 3), torch.zeros(2, NB, 3))}, "does not start with the engine's 10 blocks"),
    ({"a": "junk"}, "not a tensor"),
    ({}, "no KV cache"),
])
def test_flatten_refuses_what_it_cannot_read(caches, match):
    with pytest.raises(ValueError, match=match):
        L.flatten_caches(caches, NB)


def test_a_tuple_layout_and_a_fused_one_are_refused_with_the_reason():
    fused = L.flatten_caches(_fused(0), NB)
    tup = L.flatten_caches(_tuples(_fused(0)), NB)
    a = L.describe(fused.tensors, fused.block_dim, BS, 1, 0, fused.parts)
    b = L.describe(tup.tensors, tup.block_dim, BS, 1, 0, tup.parts)
    assert (a.parts, b.parts) == (1, 2)
    assert "2 KV cache tensors per layer" in L.check_sender(b)(a.encode())
    assert L.check_sender(b)(b.encode()) is None
    # a layout from a sender that predates the field reads as one tensor per layer
    old = a.encode().replace(',"parts":1', "")
    assert '"parts"' not in old and L.Layout.decode(old) == a


@pytest.mark.parametrize("layout", ["tuple", "fused"])
def test_tuple_caches_send_and_load_bit_exact_against_the_fused_layout(layout, monkeypatch, closing):
    """The same K/V in both layouts, sent through the connector's hooks and loaded
    into a cache of the same layout at other block ids: each block holds its source's
    K and V exactly, and the tuple layout moves exactly the bytes of the fused one."""
    src_fused = _fused(1)
    src = _tuples(src_fused) if layout == "tuple" else src_fused
    rx = KVReceiver()
    closing(rx)
    prod, started = _connector(src, True, monkeypatch)
    closing(started["pusher"])
    logical = [7, 2, 5]                                   # the prefill engine's blocks 0..2
    res = _send(prod, src, rx, f"x-{layout}", logical)

    dst = _zeros_like(src)
    cons, seen = _connector(dst, False, monkeypatch)
    assert cons.layout == prod.layout and cons.layout.parts == (2 if layout == "tuple" else 1)
    allocated = [1, 8, 4]                                 # the decode engine's blocks for them
    inject(f"x-{layout}", "d" * 32, allocated, 0, res, seen["caches"], cons._block_dim)
    for name in src_fused:
        for kv in (0, 1):
            want = src_fused[name][kv]
            got = dst[name][kv]                       # the tuple's tensor, or the fused one's half
            for p, b in zip(logical, allocated):
                assert torch.equal(got[b], want[p]), (name, kv, p, b)
            untouched = [b for b in range(NB) if b not in allocated]
            assert not got[untouched].any()
    payload = sum(piece.tensor().numel() * piece.tensor().element_size() for piece in res.pieces.values())
    assert payload == LAYERS * 2 * len(logical) * BS * HEADS * HD * 2    # K and V, bf16: nothing more
