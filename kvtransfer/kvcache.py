"""Writing a received transfer straight into a paged KV cache (the decode side of
the vLLM connector), every check done before the first byte is written.

Layout. Each attention layer's cache is one tensor whose block axis is
``block_dim`` (0 on CPU, ``[blocks, ...]``; 1 for CUDA's ``[2, blocks, ...]``);
its *block shape* is that shape without the block axis. The producer sends,
per ``(step, layer)`` piece (see :mod:`proserve.kvtransfer.wire`), the KV of
consecutive *logical* block positions of the request, block-major: a piece
has shape ``(n, *block_shape)`` and carries the positions ``first ..
first+n-1`` as its block ids. The consumer writes position ``p`` into the
physical block ``block_ids[p]`` that vLLM allocated for the request, skipping
the first ``skip`` positions (computed locally from its prefix cache). Pieces
are applied in ``(step, layer)`` order, so a block that a later prefill step
sent again (it was partial before) ends up with the later bytes.

Copies. Each received chunk is a zero-copy view of a ZeroMQ frame; it is
copied once, into views of the cache tensor (``narrow`` over runs of
consecutive physical blocks, or single rows of a block when a block was
larger than a message). Nothing is assembled on the host first.

* CPU cache: a direct copy from the received buffer (:func:`write`).
* Accelerator cache (CUDA, NPU, ...): the transfer's chunks are copied into one
  pinned host buffer holding all of them (no slot is reused within a transfer),
  then to the device without blocking, on ``stream`` when one is given; the
  buffer is released only after an event recorded behind those copies has
  completed (:func:`_release_stage`). The caller (the connector's loader
  thread) runs this off the engine's step. This path has not been run on a
  GPU here (none was available to the sessions that wrote it);
  ``scripts/device_check_kv.py`` runs it on one.

A hostile or buggy transfer is refused whole (:class:`LoadRejected`) before
anything is written: wrong dtype or block shape, a layer index beyond the
cache, block positions that are not consecutive or lie beyond the request,
chunks that do not tile their piece, physical block ids outside the cache, or
a layer missing some of the request's blocks.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class LoadRejected(Exception):
    """A received transfer that must not be written (wrong request, wrong layout)."""


@dataclass(frozen=True)
class ChunkCopy:
    """One received chunk, checked, and where it goes.

    The piece it belongs to has shape ``(n, *block_shape)``; its rows are the
    sub-tensors of shape ``row_shape`` that index the piece's first ``k + 1``
    axes: ``k == 0`` means whole blocks, ``k >= 1`` rows of a block (a block
    larger than a message)."""
    layer: int                 # index into the caches
    data: memoryview           # the chunk's bytes (a view of the received frame)
    dtype: torch.dtype
    k: int
    row_shape: tuple[int, ...]
    first_row: int             # index of its first row among the piece's rows
    rows: int
    first_pos: int             # logical block position of the piece's block 0
    sub_rows: int              # rows per block (prod(block_shape[:k]); 1 when k == 0)

    @property
    def nbytes(self) -> int:
        return len(self.data)


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LoadRejected(f"dtype {name!r} has no torch equivalent here")
    return dt


def plan_load(pieces: dict, caches: Sequence[torch.Tensor], block_dim: int, block_ids: Sequence[int],
              skip: int) -> list[ChunkCopy]:
    """Check a received transfer against this request and this engine's cache.

    ``pieces``: ``TransferResult.pieces`` ({(step, layer): LayerData});
    ``caches``: the layers' cache tensors, in layer order; ``block_ids``: the
    request's physical blocks by logical position; ``skip``: leading positions
    not to write. Returns the chunk copies in the order to apply them; raises
    :class:`LoadRejected` if anything does not fit (nothing has been written)."""
    n_layers = len(caches)
    need = range(skip, len(block_ids))
    covered: list[set[int]] = [set() for _ in range(n_layers)]
    copies: list[ChunkCopy] = []
    for step, layer in sorted(pieces):                       # step order: later pieces win
        piece = pieces[step, layer]
        where = f"layer {layer} of step {step}"
        if layer >= n_layers:
            raise LoadRejected(f"{where}: this engine has {n_layers} layers")
        dst = caches[layer]
        dtype_name = str(dst.dtype).removeprefix("torch.")
        if piece.dtype != dtype_name:
            raise LoadRejected(f"{where}: dtype {piece.dtype} does not match this engine's {dtype_name}")
        block_shape = tuple(s for i, s in enumerate(dst.shape) if i != block_dim)
        lshape = tuple(piece.shape)
        if len(lshape) != len(block_shape) + 1 or lshape[1:] != block_shape:
            raise LoadRejected(f"{where}: block shape {list(lshape[1:])} does not match this engine's "
                               f"{list(block_shape)} (same model, block size and dtype on both sides?)")
        n = lshape[0]
        if n == 0:
            continue
        blocks = piece.blocks
        first = blocks[0] if blocks else 0
        if blocks != list(range(first, first + n)):
            raise LoadRejected(f"{where}: block positions {blocks[:8]} are not the {n} consecutive positions "
                               f"its data holds")
        if first + n > len(block_ids):
            raise LoadRejected(f"{where}: blocks {first}..{first + n - 1} lie beyond this request's "
                               f"{len(block_ids)} blocks")
        copies += _plan_chunks(piece, layer, where, lshape, first)
        covered[layer].update(range(first, first + n))
    for layer, got in enumerate(covered):
        missing = [b for b in need if b not in got]
        if missing:
            raise LoadRejected(f"layer {layer}: {len(missing)} of this request's blocks were not sent "
                               f"(first missing: {missing[0]})")
    n_blocks = min((c.shape[block_dim] for c in caches), default=0)
    bad = [b for b in block_ids[skip:] if not 0 <= b < n_blocks]
    if bad:
        raise LoadRejected(f"physical block ids {bad[:4]} lie outside the cache's {n_blocks} blocks")
    return copies


def _plan_chunks(piece, layer: int, where: str, lshape: tuple, first: int) -> list[ChunkCopy]:
    """The chunks of one piece, checked to tile it exactly, in whole rows."""
    dtype = torch_dtype(piece.dtype)
    isz = dtype.itemsize
    out = []
    pos = 0
    for i, c in enumerate(piece.chunks):
        shape = tuple(c.shape)
        k = len(lshape) - len(shape)
        if c.seq != i or c.offset != pos or not shape or k < 0 or shape[1:] != lshape[k + 1:]:
            raise LoadRejected(f"{where}: chunk {i} (seq {c.seq}, shape {list(shape)}, offset {c.offset}) does "
                               f"not continue the piece of shape {list(lshape)} in whole rows")
        row_shape = lshape[k + 1:]
        row_bytes = math.prod(row_shape) * isz
        nbytes = shape[0] * row_bytes
        if len(c.data) != nbytes or (row_bytes and c.offset % row_bytes):
            raise LoadRejected(f"{where}: chunk {i} holds {len(c.data)} bytes at offset {c.offset}, expected "
                               f"{nbytes} at a multiple of {row_bytes}")
        pos += nbytes
        if nbytes:
            out.append(ChunkCopy(layer, c.data, dtype, k, row_shape, c.offset // row_bytes, shape[0], first,
                                 math.prod(lshape[1:k + 1])))
    if pos != math.prod(lshape) * isz:
        raise LoadRejected(f"{where}: its chunks hold {pos} of its {math.prod(lshape) * isz} bytes")
    return out


def write(copies: list[ChunkCopy], caches: Sequence[torch.Tensor], block_dim: int, block_ids: Sequence[int],
          skip: int, stream=None, after=None) -> int:
    """Apply checked chunk copies (from :func:`plan_load`) to the caches; returns
    the number of block writes. CPU caches are written straight from the
    received buffers; an accelerator's through one pinned staging buffer, on
    ``stream`` (default: the current one), after the event ``after`` (the
    forward stream's work queued when the load was handed over: under async
    scheduling a step already queued may still write blocks vLLM has freed
    and given to this request since). Returns once the bytes are in the cache."""
    if not copies:
        return 0
    if caches[0].device.type == "cpu":
        return sum(_write_chunk(c, _host_view(c), caches[c.layer], block_dim, block_ids, skip, False)
                   for c in copies)
    return _write_device(copies, caches, block_dim, block_ids, skip, stream, after)


def _host_view(c: ChunkCopy) -> torch.Tensor:
    """The chunk's bytes as a tensor of rows, sharing memory with the received frame."""
    return torch.frombuffer(c.data, dtype=torch.uint8).view(c.dtype).view(c.rows, *c.row_shape)


def _write_chunk(c: ChunkCopy, src: torch.Tensor, dst: torch.Tensor, block_dim: int, block_ids: Sequence[int],
                 skip: int, non_blocking: bool) -> int:
    """Copy the rows of one chunk (``src``: shape ``(rows, *row_shape)``) into ``dst``."""
    end = len(block_ids)
    if c.k == 0:
        # whole blocks: row r is logical position first_pos + first_row + r; copy runs of
        # consecutive physical blocks with one narrow() view each
        p0 = c.first_pos + c.first_row
        lo, hi = max(p0, skip), min(p0 + c.rows, end)
        writes = 0
        i = lo
        while i < hi:
            j = i + 1
            while j < hi and block_ids[j] == block_ids[j - 1] + 1:
                j += 1
            dst.narrow(block_dim, block_ids[i], j - i).copy_(src[i - p0:j - p0].movedim(0, block_dim),
                                                             non_blocking=non_blocking)
            writes += j - i
            i = j
        return writes
    # rows of blocks (a block larger than a message): row r of the piece is row
    # r % sub_rows of its block r // sub_rows, indexed over block_shape[:k]
    inner = dst.shape[:block_dim] + dst.shape[block_dim + 1:]
    writes = 0
    for r in range(c.rows):
        row = c.first_row + r
        pos = c.first_pos + row // c.sub_rows
        if not skip <= pos < end:
            continue
        index = _unravel(row % c.sub_rows, inner[:c.k])
        dst.select(block_dim, block_ids[pos])[index].copy_(src[r], non_blocking=non_blocking)
        writes += 1
    return writes


def _unravel(i: int, dims: Sequence[int]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        out.append(i % d)
        i //= d
    return tuple(reversed(out))


def _write_device(copies: list[ChunkCopy], caches: Sequence[torch.Tensor], block_dim: int,
                  block_ids: Sequence[int], skip: int, stream=None, after=None) -> int:
    """Accelerator cache: every chunk into one pinned host buffer, each chunk to the
    device as it is (a contiguous copy, asynchronous from pinned memory), then
    into the cache's views by device-to-device copies (a strided view as the
    source of a host-to-device copy would make torch gather it on the host,
    into pageable memory, and block); the host buffer is released only once
    the copies reading it are done. (The pinned buffer is as large as the
    transfer; torch's pinned-memory cache keeps it for the next load.)"""
    from .common import device_api
    from .pusher import host_tensor
    device = caches[0].device
    api = device_api(device)
    total = sum(c.nbytes for c in copies)
    stage = host_tensor((total,), torch.uint8)
    non_blocking = stage.is_pinned()
    spans, pos = [], 0
    for c in copies:
        stage[pos:pos + c.nbytes].copy_(torch.frombuffer(c.data, dtype=torch.uint8))
        spans.append(pos)
        pos += c.nbytes
    stream = stream if stream is not None else api.current_stream(device)
    if after is not None:
        stream.wait_event(after)
    writes = 0
    with api.stream(stream):
        for c, at in zip(copies, spans):
            raw = stage[at:at + c.nbytes].to(device, non_blocking=non_blocking)
            src = raw.view(c.dtype).view(c.rows, *c.row_shape)
            writes += _write_chunk(c, src, caches[c.layer], block_dim, block_ids, skip, False)
        done = api.Event()
        done.record(stream)
    _release_stage(done, stage)
    return writes


def _release_stage(done, stage: torch.Tensor) -> None:
    """The staging buffer may be freed (and its memory reused) only after the copies
    reading it are done: wait for their event. (``scripts/device_check_kv.py`` swaps
    this for a version that overwrites the stage at once, to show its check catches
    the race.)"""
    done.synchronize()


def corrupt_first_block(copies: list[ChunkCopy], caches: Sequence[torch.Tensor], block_dim: int,
                        block_ids: Sequence[int], skip: int, how: str) -> None:
    """Test hook (``debug_corrupt``): after a load, negate every value of the first
    block written (``"flip"``), or swap it with the next one (``"swap"``)."""
    c = next((c for c in copies if c.first_pos + c.first_row // c.sub_rows >= skip), None)
    if c is None:
        return
    dst = caches[c.layer]
    pos = c.first_pos + c.first_row // c.sub_rows
    a = dst.select(block_dim, block_ids[pos])
    if how == "swap" and pos + 1 < len(block_ids):
        b = dst.select(block_dim, block_ids[pos + 1])
        tmp = a.clone()
        a.copy_(b)
        b.copy_(tmp)
    else:
        a.neg_()


__all__ = ["ChunkCopy", "LoadRejected", "corrupt_first_block", "plan_load", "torch_dtype", "write"]
