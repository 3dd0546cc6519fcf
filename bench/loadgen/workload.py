"""The workload: the simulator's trace pipeline with length shaping
(:func:`make_workload`, :func:`shape_lengths`), its TDG weights
(:func:`workload_gain`), send offsets, seeded prompt tokens, the seeded choice of
unstreamed requests, and the constants these share."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from proserve.scheduler import validate
from proserve.scheduler.request import ConfigError, PriorityClass, Request
from proserve.scheduler.tdg import GainConfig

from ..traces import TraceRecord, load_trace
from ..workloads import poisson_arrivals, scale_to_rate, synthetic, tag_priorities

BUNDLED_TRACE = Path(__file__).resolve().parent.parent / "data" / "azure_conv_2023.csv"
DEFAULT_VOCAB = 1024      # the bundled tiny Llama
DEFAULT_TOKEN_LOW = 3     # skip ids 0-2 (pad/bos/eos of Llama-style vocabularies)
_SALT_PROMPT = 0x9807     # seed salt of the prompt token streams
_SALT_STREAM = 0x57E4     # seed salt of the streamed/unstreamed choice
ARRIVAL_MODES = ("trace", "poisson")


# --- workload ---------------------------------------------------------------------

def shape_lengths(records: Sequence[TraceRecord], prompt_div: float = 1.0, output_div: float = 1.0,
                  max_prompt: int | None = None) -> list[TraceRecord]:
    """Scale a trace's token counts to an engine: ``prompt / prompt_div`` and
    ``output / output_div`` (rounded, at least 1), prompts clipped to
    ``max_prompt``. Arrivals are untouched. Identity with the defaults."""
    validate.positive("shape_lengths", "prompt_div", prompt_div)
    validate.positive("shape_lengths", "output_div", output_div)
    if max_prompt is not None:
        validate.integer("shape_lengths", "max_prompt", max_prompt)
    out = []
    for r in records:
        p = max(1, int(round(r.prompt_len / prompt_div)))
        if max_prompt is not None:
            p = min(p, max_prompt)
        o = max(1, int(round(r.output_len / output_div)))
        out.append(replace(r, prompt_len=p, output_len=o))
    return out


def make_workload(trace: str = "azure", rate: float | None = None, num_requests: int | None = None,
                  seed: int = 0, classes: Mapping[str, PriorityClass] | None = None,
                  fmt: str | None = None, prompt_div: float = 1.0, output_div: float = 1.0,
                  max_prompt: int | None = None, max_model_len: int | None = None,
                  arrivals: str = "trace") -> list[Request]:
    """The simulator's pipeline (:func:`proserve.bench.workloads.build_workload`) with
    :func:`shape_lengths` between rate scaling and priority tagging.

    ``trace``: ``"azure"`` (bundled), ``"synthetic"`` (default lengths, Poisson
    at ``rate``), or a trace file. ``arrivals``: ``"trace"`` scales the
    trace's timestamps to ``rate`` (if given); ``"poisson"`` replaces them by
    seeded Poisson arrivals at ``rate`` (required), keeping the rows' order
    and lengths. The priorities depend only on ``seed`` and the request's
    position, not on the rate or the arrivals.
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
    records = shape_lengths(records, prompt_div, output_div, max_prompt)
    return tag_priorities(records, classes, None, seed, max_model_len)


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
