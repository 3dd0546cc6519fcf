"""What a prefill and a decode engine must agree on to exchange KV, per rank.

Ranks. An engine with tensor parallelism t runs t worker processes, each
holding its shard of the KV heads (vLLM's layout; an MLA cache is replicated
on every rank instead, and every rank still sends its own copy). ProServe
moves each shard between the ranks of the same index, as vLLM's
P2pNcclConnector did (an endpoint per rank) rather than remapping shards
between different tensor-parallel sizes as NixlConnector's ``tp_mapping``
does: rank r of a prefill engine sends to rank r of the decode engine, whose
receiver listens on :func:`rank_address` ``(listen, r)``. The caller (the
dispatcher) knows one KV address per decode engine, rank 0's; the others
follow from it. vLLM reports a request's transfer done only once every rank
reported it (``KVOutputAggregator``), so a transfer completes when every
shard has arrived, and any rank's failure fails the request's load.

Layout check. Each rank describes its cache (:func:`describe`): the
tensor-parallel size and rank, the block size in tokens, the number of
layers, the dtype and the block shape of one layer. The producer sends it in
the transport's ``hello``; the consumer's receiver answers ``refuse`` with
:func:`mismatch`'s reason when the two cannot exchange KV (a different
tensor-parallel size, block size, model or cache dtype), so the prefill
worker's response names the cause at once instead of the decode worker
silently recomputing every prompt.

Cache tensors. vLLM hands the connector one tensor per layer: ``[blocks, ...]``
(CPU, FlashInfer, MLA) or ``[2, blocks, ...]`` (FlashAttention, K and V fused).
vllm-ascend hands over a tuple per layer instead, ``(k_cache, v_cache)`` (for
MLA ``(nope, rope)``, of different shapes), each ``[blocks, ...]``.
:func:`flatten_caches` lists every cache tensor in layer order, the parts of a
layer one after the other; the wire's layer index is an index into that list,
so both sides must split their layers alike (the layout's ``parts``).

Sizes. :func:`receiver_caps` sizes the consumer's memory caps from its own
cache: one peer may hold the KV of the longest prompt the engine accepts
(``max_model_len`` tokens of this rank's KV), all peers together that of
:data:`EXPECTED_PREFILL_PEERS` such prompts; explicit settings override.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

#: prefill engines whose longest prompts a decode rank holds at once by default
EXPECTED_PREFILL_PEERS = 4
#: the receiver's defaults, which the derived caps never go below (MiB)
MIN_PEER_MIB = 1024.0
MIN_HELD_MIB = 2048.0
#: room for the bookkeeping a held chunk is charged (its header and block ids,
#: ``receiver.chunk_held_bytes``) on top of the payload
CAP_MARGIN = 1.05
CAP_MARGIN_MIB = 64.0

_TCP = re.compile(r"^(tcp://.+):(\d{1,5})$")
#: a dtype name as torch prints it (the peer's string ends up in the refusal and in the logs)
_DTYPE = re.compile(r"[A-Za-z0-9_]{1,32}")


def rank_address(address: str, rank: int) -> str:
    """The KV address of ``rank``, given rank 0's: the tcp port + rank, or the
    ipc path with ``.r<rank>`` appended (rank 0 keeps the address itself)."""
    if rank == 0:
        return address
    m = _TCP.match(address)
    if m is not None:
        port = int(m.group(2)) + rank
        if port > 65535:
            raise ValueError(f"KV address {address}: rank {rank} would listen on port {port}, past 65535")
        return f"{m.group(1)}:{port}"
    if address.startswith("ipc://"):
        return f"{address}.r{rank}"
    raise ValueError(f"KV address {address!r}: expected tcp://host:port or ipc://path")


def rank_path(path: str, rank: int) -> str:
    """A per-rank file next to ``path`` (rank 0: ``path`` itself), e.g. the receiver's heartbeat."""
    return path if rank == 0 else f"{path}.r{rank}"


@dataclass(frozen=True)
class CacheTable:
    """An engine's KV cache tensors as the transfer sees them (:func:`flatten_caches`)."""
    tensors: list            # every cache tensor, in layer order (a layer's parts in a row)
    first: dict              # layer name -> index of its first tensor in ``tensors``
    parts: int               # tensors per layer: 1 (one tensor), 2 (vllm-ascend's (k, v))
    block_dim: int           # the block axis of every tensor


def cache_parts(kv_layer) -> tuple:
    """One layer's cache tensors: ``(t,)`` for a tensor, the tuple's tensors for a tuple."""
    return tuple(kv_layer) if isinstance(kv_layer, (tuple, list)) else (kv_layer,)


def flatten_caches(kv_caches: Mapping, num_blocks: int | None) -> CacheTable:
    """The cache tensors of ``kv_caches`` (layer name -> a tensor, or a tuple of tensors
    as vllm-ascend passes), with their block axis: 0 for ``[blocks, ...]``, 1 for
    ``[2, blocks, ...]`` (a tensor whose first axis is not ``num_blocks``; tuples hold
    ``[blocks, ...]`` tensors). ValueError when the layers disagree on that."""
    if not kv_caches:
        raise ValueError("ProServeConnector: the engine registered no KV cache")
    tensors: list = []
    first: dict = {}
    parts = None
    for name, kv in kv_caches.items():
        layer = cache_parts(kv)
        if not layer or any(not hasattr(t, "shape") or len(t.shape) < 2 for t in layer):
            raise ValueError(f"ProServeConnector: layer {name}'s KV cache is not a tensor or a tuple of tensors")
        if parts is None:
            parts = len(layer)
        elif len(layer) != parts:
            raise ValueError(f"ProServeConnector: layer {name} has {len(layer)} KV cache tensors, the first "
                             f"layer {parts}: every layer must be split alike")
        first[name] = len(tensors)
        tensors.extend(layer)
    if parts > 1:
        block_dim = 0
        if num_blocks is not None:
            bad = [tuple(t.shape) for t in tensors if int(t.shape[0]) != num_blocks]
            if bad:
                raise ValueError(f"ProServeConnector: a tuple of KV cache tensors per layer is read as "
                                 f"[blocks, ...] each, but a tensor of shape {list(bad[0])} does not start "
                                 f"with the engine's {num_blocks} blocks")
    else:
        block_dim = 0 if num_blocks is None or int(tensors[0].shape[0]) == num_blocks else 1
    return CacheTable(tensors, first, parts, block_dim)


@dataclass(frozen=True)
class Layout:
    tp_size: int
    tp_rank: int
    block_size: int
    layers: int                 # cache tensors, ``parts`` per model layer
    dtype: str
    block_shape: tuple[int, ...]
    parts: int = 1

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @staticmethod
    def decode(text: str) -> "Layout":
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("a layout is a JSON object")
        ints = ("tp_size", "tp_rank", "block_size", "layers", "parts")
        d.setdefault("parts", 1)
        if any(type(d.get(k)) is not int for k in ints) or not isinstance(d.get("dtype"), str) \
                or not _DTYPE.fullmatch(d["dtype"]) \
                or not isinstance(d.get("block_shape"), list) \
                or not all(type(x) is int for x in d["block_shape"]):
            raise ValueError(f"a layout needs ints {', '.join(ints)}, a str dtype and a list block_shape")
        return Layout(d["tp_size"], d["tp_rank"], d["block_size"], d["layers"], d["dtype"],
                      tuple(d["block_shape"]), d["parts"])


def describe(caches: Sequence, block_dim: int, block_size: int, tp_size: int, tp_rank: int,
             parts: int = 1) -> Layout:
    """This rank's layout, from its KV cache tensors (:attr:`CacheTable.tensors`; the
    first one's block shape and dtype stand for the model's)."""
    first = caches[0]
    shape = tuple(int(s) for i, s in enumerate(first.shape) if i != block_dim)
    dtype = str(first.dtype).removeprefix("torch.")
    return Layout(tp_size, tp_rank, block_size, len(caches), dtype, shape, parts)


def mismatch(sender: Layout, receiver: Layout) -> str | None:
    """Why a prefill rank of layout ``sender`` cannot send KV to a decode rank of layout
    ``receiver`` (None when it can), worded for the operator who must fix the deployment."""
    if sender.tp_size != receiver.tp_size:
        return (f"the prefill engine runs tensor-parallel size {sender.tp_size}, this decode engine "
                f"{receiver.tp_size}: ProServe moves each rank's KV shard to the same rank, so both pools "
                f"need the same --tensor-parallel-size")
    if sender.tp_rank != receiver.tp_rank:
        return (f"KV of tensor-parallel rank {sender.tp_rank} reached the receiver of rank {receiver.tp_rank}: "
                f"the decode engine's ranks listen on consecutive ports from its --kv-listen address; is another "
                f"process on this port?")
    if sender.block_size != receiver.block_size:
        return (f"the prefill engine's KV blocks hold {sender.block_size} tokens, this decode engine's "
                f"{receiver.block_size}: give both the same --block-size")
    if sender.parts != receiver.parts:
        return (f"the prefill engine keeps {_parts(sender.parts)} per layer, this decode engine "
                f"{_parts(receiver.parts)} per layer: both pools must run the same platform (vllm-ascend passes a (k, v) "
                f"tuple, vLLM one tensor)")
    if (sender.layers, sender.dtype, sender.block_shape) != (receiver.layers, receiver.dtype, receiver.block_shape):
        return (f"the prefill engine's KV cache ({sender.layers} layers of {sender.dtype} blocks "
                f"{list(sender.block_shape)}) does not match this decode engine's ({receiver.layers} layers of "
                f"{receiver.dtype} blocks {list(receiver.block_shape)}): same model, dtype and --kv-cache-dtype "
                f"on both sides?")
    return None


def _parts(n: int) -> str:
    return "one KV cache tensor" if n == 1 else f"{n} KV cache tensors"


def check_sender(receiver: Layout):
    """A receiver's ``check_layout``: the reason to refuse a sender's encoded layout, or None."""
    def check(text: str) -> str | None:
        if not text:
            return "the sender described no KV layout (an older ProServe, or not the vLLM connector?)"
        try:
            sender = Layout.decode(text)
        except ValueError as e:
            return f"the sender's KV layout cannot be read ({str(e)[:200]})"
        return mismatch(sender, receiver)
    return check


def bytes_per_token(caches: Sequence, block_dim: int, block_size: int) -> float:
    """KV bytes one token takes on this rank, all layers together."""
    total = 0
    for c in caches:
        blocks = int(c.shape[block_dim])
        total += math.prod(int(s) for s in c.shape) * c.element_size() // max(1, blocks)
    return total / max(1, block_size)


def receiver_caps(per_token: float, max_model_len: int, given: Mapping[str, float | None],
                  peers: int = EXPECTED_PREFILL_PEERS) -> dict[str, float]:
    """``max_peer_mib`` and ``max_held_mib`` for a receiver of this rank: the values in
    ``given`` where set, else room for the longest prompt per peer and for ``peers``
    of them in all (never below the receiver's fixed defaults)."""
    for key in ("max_peer_mib", "max_held_mib"):
        v = given.get(key)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"kv_connector_extra_config.{key}: expected a positive number of MiB, got {v!r}")
    peers = max(1, int(peers))
    longest_mib = per_token * max_model_len / (1 << 20)
    need = longest_mib * CAP_MARGIN + CAP_MARGIN_MIB   # one longest prompt, its bookkeeping included
    peer = given.get("max_peer_mib")
    if peer is None:
        peer = max(MIN_PEER_MIB, need)
    held = given.get("max_held_mib")
    if held is None:
        held = max(MIN_HELD_MIB, peers * need)
    return {"max_peer_mib": float(peer), "max_held_mib": float(held), "longest_prompt_mib": longest_mib}


__all__ = ["EXPECTED_PREFILL_PEERS", "CacheTable", "Layout", "bytes_per_token", "cache_parts", "check_sender",
           "describe", "flatten_caches", "mismatch",
           "rank_address", "rank_path", "receiver_caps"]
