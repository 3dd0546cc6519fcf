"""The workload: the simulator's trace pipeline with length shaping
(:func:`make_workload`, :func:`shape_lengths`), multi-turn conversations
(:func:`make_conversation_workload`), its TDG weights (:func:`workload_gain`),
send offsets, seeded prompt tokens (:func:`request_prompts`: random per request,
or made of shared blocks), the seeded choice of unstreamed requests, and the
constants these share.

Prompts with prefix structure (issue 14): a request with prefix blocks (a
Mooncake record's ``hash_ids``) or a multi-turn request (its
:class:`~proserve.bench.workloads.TurnLink`) gets a prompt made of blocks whose
tokens are a function of (``seed``, block id) only (:func:`block_token_ids`), so
equal block ids are equal token blocks and a real engine's prefix cache sees the
sharing the trace names. A block the prompt covers only in part contributes its
first tokens (so a repeated partial block is repeated too: in the Mooncake
synthetic trace, 407 requests repeat another's last, partial block id, always
with the same length); prompt tokens past the named blocks are the request's own
(:func:`prompt_tokens`)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from proserve.scheduler import validate
from proserve.scheduler.request import ConfigError, PriorityClass, Request
from proserve.scheduler.tdg import GainConfig

from ..traces import Conversation, TraceRecord, load_trace
from ..workloads import (
    CONVERSATION_BLOCK_TOKENS,
    LengthDist,
    TurnLink,
    conversation_requests,
    load_conversations,
    poisson_arrivals,
    scale_to_rate,
    synthetic,
    tag_priorities,
)

BUNDLED_TRACE = Path(__file__).resolve().parent.parent / "data" / "azure_conv_2023.csv"
DEFAULT_VOCAB = 1024      # the bundled tiny Llama
DEFAULT_TOKEN_LOW = 3     # skip ids 0-2 (pad/bos/eos of Llama-style vocabularies)
_SALT_PROMPT = 0x9807     # seed salt of the prompt token streams
_SALT_STREAM = 0x57E4     # seed salt of the streamed/unstreamed choice
_SALT_BLOCK = 0xB10C      # seed salt of the prefix-block token streams
ARRIVAL_MODES = ("trace", "poisson")


# --- workload ---------------------------------------------------------------------

def shape_lengths(records: Sequence[TraceRecord], prompt_div: float = 1.0, output_div: float = 1.0,
                  max_prompt: int | None = None, block_tokens: int | None = None) -> list[TraceRecord]:
    """Scale a trace's token counts to an engine: ``prompt / prompt_div`` and
    ``output / output_div`` (rounded, at least 1), prompts clipped to
    ``max_prompt``. Arrivals are untouched. Identity with the defaults.

    A record with prefix blocks (``hash_ids``) is scaled by whole blocks, so its blocks
    stay blocks: each block of ``b`` tokens becomes ``B`` tokens, ``B = block_tokens``
    if given (``--prefix-block-tokens``; then ``prompt_div`` must be 1), else
    ``round(b / prompt_div)`` (at least 1), and the prompt ``prompt · B // b`` tokens
    (at least 1; a partial last block stays partial). ``hash_ids`` past the clipped
    prompt are dropped."""
    validate.positive("shape_lengths", "prompt_div", prompt_div)
    validate.positive("shape_lengths", "output_div", output_div)
    if max_prompt is not None:
        validate.integer("shape_lengths", "max_prompt", max_prompt)
    if block_tokens is not None:
        validate.integer("shape_lengths", "block_tokens", block_tokens)
        if prompt_div != 1:
            raise ConfigError("--prefix-block-tokens and --prompt-div both scale prompts: pass one of them")
    out = []
    for r in records:
        o = max(1, int(round(r.output_len / output_div)))
        if r.hash_ids:
            b = r.block_tokens
            B = block_tokens if block_tokens is not None else max(1, round(b / prompt_div))
            p = max(1, r.prompt_len * B // b)
            if max_prompt is not None:
                p = min(p, max_prompt)
            out.append(replace(r, prompt_len=p, output_len=o, block_tokens=B, hash_ids=r.hash_ids[:-(-p // B)]))
            continue
        p = max(1, int(round(r.prompt_len / prompt_div)))
        if max_prompt is not None:
            p = min(p, max_prompt)
        out.append(replace(r, prompt_len=p, output_len=o))
    return out


def shape_conversations(convs: Sequence[Conversation], prompt_div: float = 1.0,
                        output_div: float = 1.0) -> list[Conversation]:
    """:func:`shape_lengths` for conversations: every user message divided by
    ``prompt_div``, every answer by ``output_div`` (an answer is an output and then part
    of the next prompt), rounded, at least 1."""
    validate.positive("shape_conversations", "prompt_div", prompt_div)
    validate.positive("shape_conversations", "output_div", output_div)
    return [replace(c, turns=tuple((max(1, round(m / prompt_div)), max(1, round(a / output_div)))
                                   for m, a in c.turns)) for c in convs]


def make_workload(trace: str = "azure", rate: float | None = None, num_requests: int | None = None,
                  seed: int = 0, classes: Mapping[str, PriorityClass] | None = None,
                  fmt: str | None = None, prompt_div: float = 1.0, output_div: float = 1.0,
                  max_prompt: int | None = None, max_model_len: int | None = None,
                  arrivals: str = "trace", block_tokens: int | None = None) -> list[Request]:
    """The simulator's pipeline (:func:`proserve.bench.workloads.build_workload`) with
    :func:`shape_lengths` between rate scaling and priority tagging.

    ``trace``: ``"azure"`` (bundled), ``"synthetic"`` (default lengths, Poisson
    at ``rate``), or a trace file. ``arrivals``: ``"trace"`` scales the
    trace's timestamps to ``rate`` (if given); ``"poisson"`` replaces them by
    seeded Poisson arrivals at ``rate`` (required), keeping the rows' order
    and lengths. The priorities depend only on ``seed`` and the request's
    position, not on the rate or the arrivals. ``block_tokens``: the prefix-block size
    of a trace with ``hash_ids`` (see :func:`shape_lengths`).
    """
    validate.one_of("", "arrivals", arrivals, ARRIVAL_MODES)
    if arrivals == "poisson" and rate is None:
        raise ConfigError("--arrivals poisson needs --rate (the mean arrival rate, req/s)")
    if trace == "synthetic":
        records = synthetic(num_requests or 1000, rate or 1.0, seed=seed)
    else:
        path = BUNDLED_TRACE if trace == "azure" else trace
        records = load_trace(path, "azure" if trace == "azure" else fmt, limit=num_requests)
        if rate is not None and arrivals == "trace":
            records = scale_to_rate(records, rate, seed)
    if arrivals == "poisson":
        records = poisson_arrivals(records, rate, seed)
    if block_tokens is not None and not any(r.hash_ids for r in records):
        raise ConfigError(f"--prefix-block-tokens: trace {trace!r} has no prefix blocks (Mooncake hash_ids)")
    records = shape_lengths(records, prompt_div, output_div, max_prompt, block_tokens)
    return tag_priorities(records, classes, None, seed, max_model_len)


def make_conversation_workload(trace: str = "synthetic", rate: float | None = None,
                               num_conversations: int | None = None, seed: int = 0,
                               classes: Mapping[str, PriorityClass] | None = None,
                               prompt_div: float = 1.0, output_div: float = 1.0,
                               max_prompt: int | None = None, max_model_len: int | None = None,
                               think_time: float = 0.0, block_tokens: int | None = None,
                               turns: LengthDist | None = None, message: LengthDist | None = None,
                               answer: LengthDist | None = None) -> tuple[list[Request], list[TurnLink]]:
    """A multi-turn workload: conversations (``"synthetic"`` or a ShareGPT file;
    :func:`proserve.bench.workloads.load_conversations`, ``rate`` = new conversations
    per second), :func:`shape_conversations`, then
    :func:`proserve.bench.workloads.conversation_requests` (prefix blocks of
    ``block_tokens`` tokens, default 16). Returns the requests and their turn links
    (for :func:`proserve.bench.loadgen.client.replay`)."""
    convs = load_conversations(trace, num_conversations, rate, seed, think_time=think_time,
                               turns=turns, message=message, answer=answer)
    convs = shape_conversations(convs, prompt_div, output_div)
    return conversation_requests(convs, classes, None, seed,
                                 block_tokens=CONVERSATION_BLOCK_TOKENS if block_tokens is None else block_tokens,
                                 max_model_len=max_model_len, max_prompt=max_prompt)


def workload_gain(reqs: Sequence[Request], w_p: float | None = None, w_d: float = 1.0) -> GainConfig:
    """TDG weights as the simulator picks them: w_p/w_d = mean prompt / mean output (§5.1) unless given."""
    if w_p is None:
        g = GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs])
        return GainConfig(g.w_p * w_d, w_d)
    return GainConfig(w_p, w_d)


def send_offsets(reqs: Sequence[Request]) -> list[float]:
    """When each request is sent, in seconds from the run start: its arrival
    minus the earliest arrival (so a workload need not start at 0)."""
    if not reqs:
        return []
    first = min(r.arrival for r in reqs)
    return [r.arrival - first for r in reqs]


def prompt_tokens(seed: int, index: int, length: int, vocab: int = DEFAULT_VOCAB,
                  low: int = DEFAULT_TOKEN_LOW) -> list[int]:
    """``length`` random token ids in ``[low, vocab)``, a function of (seed, index) only."""
    validate.integer("prompt tokens", "vocab", vocab)
    validate.integer("prompt tokens", "token_low", low, 0, vocab - 1)   # below vocab
    rng = np.random.default_rng([int(seed), _SALT_PROMPT, int(index)])
    return rng.integers(low, vocab, size=int(length)).tolist()


def block_token_ids(seed: int, block: int, n: int, vocab: int = DEFAULT_VOCAB,
                    low: int = DEFAULT_TOKEN_LOW) -> list[int]:
    """The ``n`` tokens of prefix block ``block``: random ids in ``[low, vocab)``, a function
    of (seed, block id) only — not of the request or the block's position."""
    validate.integer("prompt tokens", "vocab", vocab)
    validate.integer("prompt tokens", "token_low", low, 0, vocab - 1)
    rng = np.random.default_rng([int(seed), _SALT_BLOCK, int(block)])
    return rng.integers(low, vocab, size=int(n)).tolist()


def blocks_prompt(seed: int, index: int, length: int, blocks: Sequence[int], block_tokens: int,
                  vocab: int = DEFAULT_VOCAB, low: int = DEFAULT_TOKEN_LOW,
                  cache: dict | None = None) -> list[int]:
    """A prompt of ``length`` tokens: the tokens of ``blocks`` (ids of ``block_tokens``
    tokens each, first to last, the last cut where the prompt ends), then, past the
    named blocks, the request's own tokens (:func:`prompt_tokens` of ``index``).
    ``cache`` (block id → tokens) saves redrawing repeated blocks."""
    validate.integer("prompt tokens", "block_tokens", block_tokens)
    out: list[int] = []
    for b in blocks:
        if len(out) >= length:
            break
        toks = cache.get(b) if cache is not None else None
        if toks is None:
            toks = block_token_ids(seed, b, block_tokens, vocab, low)
            if cache is not None:
                cache[b] = toks
        out.extend(toks[:length - len(out)])
    if len(out) < length:
        out.extend(prompt_tokens(seed, index, length, vocab, low)[len(out):])
    return out


def request_prompts(reqs: Sequence[Request], seed: int = 0, vocab: int = DEFAULT_VOCAB,
                    low: int = DEFAULT_TOKEN_LOW,
                    links: Sequence[TurnLink | None] | None = None) -> list[list[int]]:
    """Every request's prompt token ids: a multi-turn request's from its link's blocks
    (its conversation's token stream), a request with ``prefix_blocks`` from those
    (:func:`blocks_prompt`), any other random (:func:`prompt_tokens`); the index is the
    one in the request's id (:func:`request_index`)."""
    if links is not None and len(links) != len(reqs):
        raise ConfigError(f"{len(links)} turn links for {len(reqs)} requests")
    cache: dict[int, list[int]] = {}
    out = []
    for i, q in enumerate(reqs):
        link = links[i] if links is not None else None
        idx = request_index(q, i)
        if link is not None:
            out.append(blocks_prompt(seed, idx, q.prompt_len, link.blocks, link.block_tokens, vocab, low, cache))
        elif q.prefix_blocks:
            out.append(blocks_prompt(seed, idx, q.prompt_len, q.prefix_blocks, q.prefix_block_tokens,
                                     vocab, low, cache))
        else:
            out.append(prompt_tokens(seed, idx, q.prompt_len, vocab, low))
    return out


def stream_flags(n: int, fraction: float = 1.0, seed: int = 0) -> list[bool]:
    """Which of ``n`` requests are streamed: exactly ``round(fraction · n)`` of
    them, chosen by a seeded permutation (a function of ``seed`` and ``n`` only)."""
    validate.fraction("", "stream_fraction", fraction)
    k = int(math.floor(fraction * n + 0.5))
    if k >= n:
        return [True] * n
    flags = [False] * n
    for i in np.random.default_rng([int(seed), _SALT_STREAM]).permutation(n)[:k]:
        flags[int(i)] = True
    return flags


def request_index(req: Request, default: int) -> int:
    """The position encoded in the workload's ids (``r17`` → 17), else ``default``."""
    rid = req.id
    if rid.startswith("r") and rid[1:].isdigit():
        return int(rid[1:])
    return default
