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
"""

from __future__ import annotations

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
