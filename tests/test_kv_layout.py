"""What a prefill and a decode rank must agree on (kvtransfer.layout): per-rank KV
addresses, the layout check a decode rank's receiver applies to each prefill rank's
hello, and the receiver's memory caps sized from the engine's own cache."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from proserve.kvtransfer import layout as L


def test_rank_addresses_follow_rank_zeros():
    assert L.rank_address("tcp://10.0.0.5:15600", 0) == "tcp://10.0.0.5:15600"
    assert L.rank_address("tcp://10.0.0.5:15600", 3) == "tcp://10.0.0.5:15603"
    assert L.rank_address("tcp://[::1]:15600", 1) == "tcp://[::1]:15601"
    assert L.rank_address("ipc:///run/kv.sock", 0) == "ipc:///run/kv.sock"
    assert L.rank_address("ipc:///run/kv.sock", 2) == "ipc:///run/kv.sock.r2"
    with pytest.raises(ValueError, match="past 65535"):
        L.rank_address("tcp://h:65535", 1)
    with pytest.raises(ValueError, match="tcp://host:port"):
        L.rank_address("udp://h:1", 1)
    assert L.rank_path("/tmp/hb", 0) == "/tmp/hb" and L.rank_path("/tmp/hb", 1) == "/tmp/hb.r1"


def _layout(**kw) -> L.Layout:
    d = dict(tp_size=2, tp_rank=1, block_size=16, layers=32, dtype="bfloat16", block_shape=(2, 16, 4, 128))
    d.update(kw)
    return L.Layout(**d)


def test_layouts_roundtrip_and_garbage_is_refused_with_a_reason():
    lay = _layout()
    assert L.Layout.decode(lay.encode()) == lay
    check = L.check_sender(lay)
    assert check(lay.encode()) is None
    assert "no KV layout" in check("")
    for junk in ("not json", "[1, 2]", '{"tp_size": "2"}', '{"tp_size": 2, "tp_rank": 1, "block_size": 16, '
                 '"layers": 32, "dtype": "bfloat16", "block_shape": ["x"]}'):
        assert "cannot be read" in check(junk), junk
    # the tensors-per-layer count a peer claims (vllm-ascend's (k, v) tuples): an int or refused
    body = lay.encode()[:-1]
    for parts in ('"2"', "2.0", "null", "[2]", "true"):
        assert "cannot be read" in check(body + f',"parts":{parts}}}'), parts


@pytest.mark.parametrize("field, value, words", [
    ("tp_size", 1, "tensor-parallel size 1, this decode engine 2"),
    ("tp_rank", 0, "rank 0 reached the receiver of rank 1"),
    ("block_size", 32, "hold 32 tokens, this decode engine's 16"),
    ("layers", 16, "16 layers"),
    ("dtype", "float8_e4m3fn", "float8_e4m3fn"),
    ("block_shape", (2, 16, 8, 128), "[2, 16, 8, 128]"),
])
def test_each_mismatch_is_named(field, value, words):
    why = L.check_sender(_layout())(_layout(**{field: value}).encode())
    assert why is not None and words in why


@pytest.mark.parametrize("block_dim", [0, 1])
def test_describe_and_bytes_per_token_read_the_cache(block_dim):
    shape = (10, 2, 16, 2, 64) if block_dim == 0 else (2, 10, 16, 2, 64)
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(3)]
    lay = L.describe(caches, block_dim, 16, tp_size=2, tp_rank=0)
    assert lay.layers == 3 and lay.dtype == "bfloat16" and lay.block_shape == (2, 16, 2, 64)
    # per token per layer: K and V, 2 heads of 64 bf16 values = 512 bytes
    assert L.bytes_per_token(caches, block_dim, 16) == 3 * 2 * 2 * 64 * 2


def test_receiver_caps_hold_the_longest_prompt_per_peer():
    """Llama-3-8B, one rank: 32 layers x K,V x 8 heads x 128 x 2 bytes = 128 KiB per token;
    an 8k prompt is 1 GiB, more than the fixed 1 GiB default per peer once the chunks'
    bookkeeping is counted. Derived: the longest prompt (and a margin) per peer, four
    peers' worth in all; never below the fixed defaults; explicit values win."""
    per_token = 32 * 2 * 8 * 128 * 2
    caps = L.receiver_caps(per_token, 8192, {})
    assert caps["longest_prompt_mib"] == 1024
    assert 1024 < caps["max_peer_mib"] < 1200 and caps["max_held_mib"] == 4 * caps["max_peer_mib"]
    small = L.receiver_caps(512, 2048, {})
    assert small["max_peer_mib"] == L.MIN_PEER_MIB and small["max_held_mib"] == L.MIN_HELD_MIB
    given = L.receiver_caps(per_token, 8192, {"max_peer_mib": 300.0, "max_held_mib": None}, peers=2)
    assert given["max_peer_mib"] == 300.0 and given["max_held_mib"] == pytest.approx(2 * (1024 * 1.05 + 64))


def test_receiver_caps_refuse_what_is_not_a_size():
    for bad in (float("nan"), float("inf"), 0.0, -5.0):
        with pytest.raises(ValueError, match="positive number of MiB"):
            L.receiver_caps(1024, 2048, {"max_peer_mib": bad})
    assert L.receiver_caps(1 << 20, 4096, {}, peers=0)["max_held_mib"] >= L.receiver_caps(1 << 20, 4096, {})[
        "max_peer_mib"]
    with pytest.raises(ValueError):
        L.Layout.decode('{"tp_size": 1, "tp_rank": 0, "block_size": 16, "layers": 2, '
                        '"dtype": "bf16\\nFAKE LOG LINE", "block_shape": [2]}')
