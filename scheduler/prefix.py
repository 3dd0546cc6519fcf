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
:func:`block_ids` computes a prompt's block ids from its token ids (the dispatcher's).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from typing import Sequence

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


def cached_tokens(req, held_blocks: int, block_size: int) -> int:
    """Tokens of ``req``'s prompt a cache hit of ``held_blocks`` leading prefix blocks saves:
    whole KV blocks only, and never the last prompt token (vLLM recomputes at least one,
    to sample from)."""
    hit = held_blocks * req.prefix_block_tokens
    most = (req.prompt_len - 1) // block_size * block_size
    return max(0, min(hit, most) // block_size * block_size)


_ID_MASK = (1 << 63) - 1
_PERSON = b"proserve-prefix"    # blake2b personalisation: these ids are ours, not vLLM's


def block_ids(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The prefix block ids of a prompt (``Request.prefix_blocks``), as vLLM's prefix cache
    hashes blocks (``vllm.v1.core.kv_cache_utils.hash_block_tokens``): one id per FULL block of
    ``block_size`` tokens (a partial last block has none), each a hash of its parent block's id
    and its own token ids, so equal ids mean equal token prefixes. The hash is BLAKE2b over the
    parent's 8-byte digest and the tokens packed as little-endian uint64, truncated to a 63-bit
    int: stable across processes and runs (not Python's randomised ``hash``). The ids are not
    vLLM's own (those depend on its hash function, seed and extra keys).

    ``token_ids`` must be ints in [0, 2**64) (ValueError otherwise)."""
    block_size = validate.integer("block_ids", "block_size", block_size, 1)
    n = len(token_ids) // block_size
    if n == 0:
        return ()
    try:
        packed = array("Q", token_ids[:n * block_size])   # checks each id: an int in [0, 2**64)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"block_ids: token ids must be integers in [0, 2**64): {e}") from None
    if packed.itemsize != 8:   # 'Q' is 8 bytes on every platform CPython supports; be sure
        raise RuntimeError("array('Q') is not 64-bit here")
    if sys.byteorder == "big":
        packed.byteswap()      # the ids must not depend on the host's byte order
    data = memoryview(packed).cast("B")
    step = block_size * 8
    parent = b""
    out = []
    for i in range(n):
        h = hashlib.blake2b(parent, digest_size=8, person=_PERSON)
        h.update(data[i * step:(i + 1) * step])
        parent = h.digest()
        out.append(int.from_bytes(parent, "little") & _ID_MASK)
    return tuple(out)
