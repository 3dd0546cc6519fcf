"""Prefix blocks and an LRU cache of them (issue 14): what an instance's prefix cache holds.

A request may carry the ids of its prompt's blocks (``Request.prefix_blocks``, each of
``Request.prefix_block_tokens`` tokens, first to last; equal ids mean equal token
prefixes, as in the Mooncake traces' ``hash_ids``). An instance keeps the blocks of the
prompts it prefilled, least recently used evicted first, as vLLM's prefix cache keeps
computed KV blocks in its free pool and reuses the oldest free ones first. A new request
finds the longest run of its leading blocks there (a block is only reusable after every
block before it, vLLM's hash chain) and skips their prefill: Eq. 5's ``l_q`` shrinks and
``l_kv`` grows by that many tokens.

Pure data structure: the simulator applies it, the router's cache index reuses it.
:func:`block_ids` computes a prompt's block ids from its token ids (the dispatcher's);
:func:`extend_block_id` extends a chain by one block (the dispatcher's KV-event index maps
an engine's stored blocks to the same ids with it), :meth:`BlockLRU.remove` and
:meth:`BlockLRU.clear` follow the engine's evictions.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from . import validate


class BlockLRU:
    """A bounded set of block ids, least recently used evicted first.

    ``capacity`` counts blocks; :meth:`match` and :meth:`insert` both refresh what they touch.
    """

    __slots__ = ("_blocks", "capacity", "evictions")

    def __init__(self, capacity: int):
        self.capacity = validate.integer("prefix cache", "capacity", capacity, 0)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def peek(self, blocks: Sequence[int]) -> int:
        """:meth:`match` without refreshing anything (for estimates)."""
        n = 0
        held = self._blocks
        for b in blocks:
            if b not in held:
                break
            n += 1
        return n

    def match(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks``, from the first, are held (the longest cached prefix);
        those are refreshed."""
        n = self.peek(blocks)
        for b in blocks[:n]:
            self._blocks.move_to_end(b)
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        """Hold ``blocks`` (the most recently used now), evicting the least recently used
        beyond the capacity. With more blocks than the capacity, the last ones stay."""
        held = self._blocks
        for b in blocks:
            if b in held:
                held.move_to_end(b)
            else:
                held[b] = None
        while len(held) > self.capacity:
            held.popitem(last=False)
            self.evictions += 1

    def remove(self, block: int) -> bool:
        """Forget ``block`` (the instance evicted it); True if it was held."""
        return self._blocks.pop(block, False) is None

    def clear(self) -> None:
        """Forget every block (the instance's cache was emptied, or can no longer be trusted)."""
        self._blocks.clear()


def cached_tokens(req, held_blocks: int, block_size: int) -> int:
    """Tokens of ``req``'s prompt a cache hit of ``held_blocks`` leading prefix blocks saves:
    whole KV blocks only, and never the last prompt token (vLLM recomputes at least one,
    to sample from)."""
    hit = held_blocks * req.prefix_block_tokens
    most = (req.prompt_len - 1) // block_size * block_size
    return max(0, min(hit, most) // block_size * block_size)


_ID_MASK = (1 << 63) - 1
_PERSON = b"proserve-prefix"    # blake2b personalisation: these ids are ours, not vLLM's


def _pack(token_ids: Sequence[int], where: str) -> memoryview:
    """``token_ids`` as little-endian uint64 bytes (the hash input), each checked to be an int
    in [0, 2**64) (ValueError otherwise)."""
    try:
        packed = array("Q", token_ids)   # checks each id: an int in [0, 2**64)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"{where}: token ids must be integers in [0, 2**64): {e}") from None
    if packed.itemsize != 8:   # 'Q' is 8 bytes on every platform CPython supports; be sure
        raise RuntimeError("array('Q') is not 64-bit here")
    if sys.byteorder == "big":
        packed.byteswap()      # the ids must not depend on the host's byte order
    return memoryview(packed).cast("B")


def _chain(parent: int | None, block: memoryview) -> int:
    """THE formula of a prefix block id (one implementation: :func:`block_ids` and
    :func:`extend_block_id` both call it): BLAKE2b-64 (personalised) over the parent block's
    id as 8 little-endian bytes (nothing for a first block) and the block's packed tokens,
    truncated to 63 bits."""
    h = hashlib.blake2b(b"" if parent is None else parent.to_bytes(8, "little"), digest_size=8, person=_PERSON)
    h.update(block)
    return int.from_bytes(h.digest(), "little") & _ID_MASK


def extend_block_id(parent: int | None, tokens: Sequence[int]) -> int:
    """The id of the block holding ``tokens`` (one whole block) after the block whose id is
    ``parent`` (None: the prompt's first block): ``block_ids(p + tokens, len(tokens))[-1]`` for
    any prompt ``p`` of whole blocks whose last id is ``parent``. The dispatcher's KV-event index
    (:mod:`proserve.dispatcher.kv_events`) maps an engine's stored blocks to these ids with it.

    ``parent`` must be an id (an int in [0, 2**63)), ``tokens`` non-empty ints in [0, 2**64)
    (ValueError otherwise)."""
    if parent is not None and (isinstance(parent, bool) or not isinstance(parent, int)
                               or not 0 <= parent <= _ID_MASK):
        raise ValueError(f"extend_block_id: parent must be a block id in [0, 2**63), got {parent!r}")
    if not tokens:
        raise ValueError("extend_block_id: a block needs at least one token")
    return _chain(parent, _pack(tokens, "extend_block_id"))


def block_ids(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The prefix block ids of a prompt (``Request.prefix_blocks``), as vLLM's prefix cache
    hashes blocks (``vllm.v1.core.kv_cache_utils.hash_block_tokens``): one id per FULL block of
    ``block_size`` tokens (a partial last block has none), each a hash of its parent block's id
    and its own token ids, so equal ids mean equal token prefixes. The hash is BLAKE2b over the
    parent's id (8 bytes, little-endian) and the tokens packed as little-endian uint64, truncated
    to a 63-bit int (:func:`_chain`; :func:`extend_block_id` extends a chain by one block with
    the same formula): stable across processes and runs (not Python's randomised ``hash``). The
    ids are not vLLM's own (those depend on its hash function, seed and extra keys).

    ``token_ids`` must be ints in [0, 2**64) (ValueError otherwise)."""
    block_size = validate.integer("block_ids", "block_size", block_size, 1)
    n = len(token_ids) // block_size
    if n == 0:
        return ()
    data = _pack(token_ids[:n * block_size], "block_ids")
    step = block_size * 8
    parent = None
    out = []
    for i in range(n):
        parent = _chain(parent, data[i * step:(i + 1) * step])
        out.append(parent)
    return tuple(out)
