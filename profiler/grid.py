"""The profiling grid: which batches the profiler makes the engine run.

A grid is a list of :class:`Point` s, each one batch shape submitted ``repeats``
times:

``prefill``  one step that prefills the requests ``prefills = ((l_q, l_kv), ...)``
             and nothing else. ``l_kv > 0`` comes from the prefix cache: a prompt
             of ``l_kv`` tokens (a multiple of the block size) is run first, then
             that prompt plus ``l_q`` new tokens, so the step computes ``l_q``
             tokens attending to ``l_kv`` cached ones.
``decode``   ``batch`` requests with ``prompt``-token prompts and ``tokens``
             output tokens each: one prefill step of ``batch × (prompt, 0)``,
             then ``tokens - 1`` decode steps of ``batch`` requests at KV length
             ``prompt, prompt + 1, ...``.
``mixed``    ``batch`` requests decoding (prompts of ``prompt`` tokens) when the
             ``prefills`` arrive: one step holds both (Eq. 7's sum over B_p and B_d).

The built-in grids (``quick``, ``full``) are written for a 2048-token context
and scaled to ``max_model_len``; prefix lengths are rounded down to the block
size. A grid file (JSON) lists points in absolute tokens::

    {"prefill": [[[512, 0]], [[64, 1024], [256, 0]]],
     "decode":  [{"batch": 8, "prompt": 256, "tokens": 8}],
     "mixed":   [{"batch": 4, "prompt": 256, "prefills": [[64, 0]]}]}

This module is pure: no engine, no I/O except reading a grid file.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from proserve.scheduler import validate as check  # this module has a validate() of its own

KINDS = ("prefill", "decode", "mixed")
BUILTIN = ("quick", "full")
BASE_LEN = 2048           # the built-in grids are written for this context length
MIXED_TOKENS = 16         # output tokens of the decoding requests of a mixed point
MIXED_AFTER = 2           # the prefills arrive once every decoding request has this many tokens


class GridError(ValueError):
    """A grid that cannot run under the given engine settings."""


@dataclass(frozen=True)
class Point:
    id: str
    kind: str
    prefills: tuple[tuple[int, int], ...] = ()
    batch: int = 0        # decode / mixed: number of decoding requests
    prompt: int = 0       # decode / mixed: their prompt length
    tokens: int = 0       # decode / mixed: their output tokens (max_tokens)

    def describe(self) -> str:
        pf = "+".join(f"{q}" if k == 0 else f"{q}@{k}" for q, k in self.prefills)
        if self.kind == "prefill":
            return f"prefill {pf}"
        if self.kind == "decode":
            return f"decode {self.batch}x{self.prompt}+{self.tokens}"
        return f"mixed {self.batch}x{self.prompt} + {pf}"

    @property
    def max_request_len(self) -> int:
        """Longest request (prompt + output tokens) this point submits."""
        lens = [q + k + 1 for q, k in self.prefills]
        if self.batch:
            lens.append(self.prompt + self.tokens)
        return max(lens)

    @property
    def step_tokens(self) -> int:
        """Most tokens one step of this point schedules (vLLM's max_num_batched_tokens must hold it)."""
        pf = sum(q for q, _ in self.prefills)
        if self.kind == "decode":
            return self.batch * self.prompt
        if self.kind == "mixed":
            return max(self.batch * self.prompt, pf + self.batch)
        return pf

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + self.batch

    @property
    def cost(self) -> int:
        """Rough work of one repeat in prefill tokens (for progress estimates)."""
        return (sum(q + k for q, k in self.prefills) + self.batch * self.prompt
                + self.batch * self.tokens // 8)


def validate(points: list[Point], max_model_len: int, block_size: int) -> None:
    """Raise :class:`GridError` naming the first point that cannot run."""
    if not points:
        raise GridError("the grid is empty")
    seen = set()
    for p in points:
        if p.id in seen:
            raise GridError(f"grid point {p.id}: duplicate id")
        seen.add(p.id)
        check.one_of(f"grid point {p.id}", "kind", p.kind, KINDS, error=GridError)
        where = f"grid point {p.id} ({p.describe()})"
        for q, k in p.prefills:
            check.integer(where, "l_q", q, error=GridError)
            check.integer(where, "l_kv", k, 0, error=GridError)
            if k % block_size:
                raise GridError(f"grid point {p.id} ({p.describe()}): l_kv={k} is not a multiple of the block "
                                f"size {block_size} (the prefix cache only reuses whole blocks)")
        if p.kind in ("prefill", "mixed") and not p.prefills:
            raise GridError(f"grid point {p.id}: a {p.kind} point needs prefills")
        if p.kind in ("decode", "mixed"):
            check.integer(where, "batch", p.batch, error=GridError)
            check.integer(where, "prompt", p.prompt, error=GridError)
            # a decode point needs 2 tokens to get one decode step; a mixed point's prefills
            # arrive once its requests hold MIXED_AFTER tokens, and it needs more than MIXED_AFTER + 2
            low = 2 if p.kind == "decode" else MIXED_AFTER + 3
            check.integer(where, "tokens", p.tokens, low, error=GridError)
        if p.kind == "decode" and p.prefills:
            raise GridError(f"grid point {p.id}: a decode point has no prefills")
        if p.max_request_len > max_model_len:
            raise GridError(f"grid point {p.id} ({p.describe()}) needs requests of {p.max_request_len} tokens "
                            f"(prompt + output), longer than --max-model-len {max_model_len}")


# -- built-in grids ------------------------------------------------------------------
# Values for a 2048-token context. Prefill l_q spans 16..1920 tokens; cached
# prefixes 0..1536; decode batches 1..64 at KV lengths 64..1536, capped at 16k
# prompt tokens per batch (each decode point first prefills its whole batch).
_FULL = dict(
    l_q=(16, 64, 128, 256, 512, 1024, 1920),
    l_kv=(0, 256, 512, 1024, 1536),
    homogeneous=[(n, q) for n in (2, 4, 8) for q in (32, 256, 512)],
    mixes=12,
    decode=[(b, L) for L in (64, 512, 1536) for b in (1, 2, 4, 8, 16, 32, 64) if b * L <= 16384],
    decode_tokens=8,
    mixed=[(b, 256, pf) for b in (4, 16) for pf in ((64, 0), (512, 0), (128, 1024))],
)
_QUICK = dict(
    l_q=(16, 128, 512, 1024),
    l_kv=(0, 512, 1024),
    homogeneous=[(4, 256), (8, 64)],
    mixes=3,
    # two large batches (16k KV tokens each) so that the per-token and per-request decode
    # costs stand out of the step-time noise on a fast CPU (without them an AVX-512 host's
    # quick profile fitted a_d = b_d = 0: every decode step cost t_c)
    decode=[(1, 64), (16, 64), (8, 256), (32, 256), (64, 256), (4, 1024), (16, 1024)],
    decode_tokens=6,
    mixed=[(8, 256, (256, 0)), (4, 256, (64, 1024))],
)


def build(name: str, max_model_len: int = BASE_LEN, block_size: int = 128, seed: int = 0) -> list[Point]:
    """A built-in grid scaled to ``max_model_len`` (``quick`` or ``full``), or a grid file."""
    if name not in BUILTIN:
        return load(name, max_model_len, block_size)
    check.integer("the built-in grids", "--max-model-len", max_model_len, 256, error=GridError)
    check.integer("", "block size", block_size, error=GridError)
    spec = _FULL if name == "full" else _QUICK
    s = max_model_len / BASE_LEN

    def q_(v: int) -> int:
        return max(1, round(v * s))

    def kv_(v: int) -> int:
        return int(v * s) // block_size * block_size

    def fits(q: int, k: int) -> bool:
        return q + k + 1 <= max_model_len

    points: list[Point] = []

    def add(kind: str, **kw) -> None:
        points.append(Point(id=f"{kind[0]}{sum(p.kind == kind for p in points):02d}", kind=kind, **kw))

    singles = []
    for kv in dict.fromkeys(kv_(k) for k in spec["l_kv"]):
        for q in dict.fromkeys(q_(v) for v in spec["l_q"]):
            if fits(q, kv):
                singles.append((q, kv))
    for pf in singles:
        add("prefill", prefills=(pf,))
    for n, q in spec["homogeneous"]:
        add("prefill", prefills=((q_(q), 0),) * n)
    # random mixes of lengths and cached prefixes (seeded): batches that are not on any axis
    rng = random.Random(seed)
    cap = q_(4096)
    l_qs = [q_(v) for v in spec["l_q"] if v <= 1024]
    l_kvs = [kv_(k) for k in spec["l_kv"]]
    for _ in range(spec["mixes"]):
        batch: list[tuple[int, int]] = []
        for _ in range(rng.randint(2, 6)):
            q, k = rng.choice(l_qs), rng.choice(l_kvs)
            if fits(q, k) and sum(x for x, _ in batch) + q <= cap:
                batch.append((q, k))
        if len(batch) < 2:
            batch = [(l_qs[0], 0), (l_qs[-1], 0)]
        add("prefill", prefills=tuple(sorted(batch, reverse=True)))
    for b, L in spec["decode"]:
        L = q_(L)
        if L + spec["decode_tokens"] <= max_model_len:
            add("decode", batch=b, prompt=L, tokens=spec["decode_tokens"])
    for b, L, (q, k) in spec["mixed"]:
        L, q, k = q_(L), q_(q), kv_(k)
        if fits(q, k) and L + MIXED_TOKENS <= max_model_len:
            add("mixed", batch=b, prompt=L, tokens=MIXED_TOKENS, prefills=((q, k),))
    validate(points, max_model_len, block_size)
    return points


def load(path: str | Path, max_model_len: int, block_size: int) -> list[Point]:
    """Read a grid file (see the module docstring); errors name the file and the entry."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise GridError(f"--grid {p}: not 'quick', 'full' or a readable grid file ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise GridError(f"grid file {p}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    if not isinstance(d, dict) or not set(d) <= set(KINDS):
        raise GridError(f"grid file {p}: expected an object with keys among {', '.join(KINDS)}")
    points: list[Point] = []
    try:
        for i, batch in enumerate(d.get("prefill", [])):
            points.append(Point(f"p{i:02d}", "prefill", prefills=_pairs(batch)))
        for i, e in enumerate(d.get("decode", [])):
            points.append(Point(f"d{i:02d}", "decode", batch=int(e["batch"]), prompt=int(e["prompt"]),
                                tokens=int(e.get("tokens", 8))))
        for i, e in enumerate(d.get("mixed", [])):
            points.append(Point(f"m{i:02d}", "mixed", batch=int(e["batch"]), prompt=int(e["prompt"]),
                                tokens=int(e.get("tokens", MIXED_TOKENS)), prefills=_pairs(e["prefills"])))
    except (KeyError, TypeError, ValueError) as e:
        raise GridError(f"grid file {p}: entry {len(points)} of its points is malformed ({e!r})") from None
    try:
        validate(points, max_model_len, block_size)
    except GridError as e:
        raise GridError(f"grid file {p}: {e}") from None
    return points


def _pairs(batch) -> tuple[tuple[int, int], ...]:
    out = []
    for pair in batch:
        q, k = pair
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (q, k)):
            check.fail("", "(l_q, l_kv)", "a pair of integers", pair, error=ValueError)
        out.append((q, k))
    return tuple(out)


def within_budget(points: list[Point], max_num_batched_tokens: int) -> tuple[list[Point], list[Point]]:
    """(points whose steps fit ``max_num_batched_tokens``, the others)."""
    keep = [p for p in points if p.step_tokens <= max_num_batched_tokens]
    if not keep:
        raise GridError(f"no grid point fits a step of {max_num_batched_tokens} tokens")
    return keep, [p for p in points if p.step_tokens > max_num_batched_tokens]


def engine_limits(points: list[Point], max_model_len: int,
                  max_num_batched_tokens: int | None = None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that let every point run as one step:
    room for the largest batch plus the blocker request of multi-request submissions.
    A given ``max_num_batched_tokens`` is used as is (the points must fit it: ``within_budget``)."""
    if max_num_batched_tokens is not None:
        return max_num_batched_tokens, max(8, max(p.num_seqs for p in points) + 1)
    tokens = max([max_model_len] + [p.step_tokens for p in points])
    seqs = max(8, max(p.num_seqs for p in points) + 1)
    return tokens, seqs
