"""Workloads: synthetic traces, arrival scaling (§5.1) and priority tagging.

The pipeline the simulator CLI runs is :func:`build_workload`::

    load_trace / synthetic  →  scale_to_rate  →  tag_priorities  →  list[Request]

Multi-turn conversations (issue 14) have their own two steps,
:func:`load_conversations` (ShareGPT's conversations, or
:func:`synthetic_conversations`) and :func:`conversation_requests`, which gives
the requests together with their :class:`TurnLink` s (which turn follows which,
for the load generator).

Prefix blocks: a record's ``hash_ids`` (Mooncake) become ``Request.prefix_blocks``
with ``prefix_block_tokens = TraceRecord.block_tokens``, cut to the blocks the
(possibly shortened) prompt still covers; a conversation's turns name the full
blocks of the conversation's token stream that their prompt covers, so the turns
of one conversation share their leading blocks.

Randomness is seeded; each step salts the seed with its own constant so that
the streams are independent (e.g. the priority drawn for a request does not
depend on the rate its arrivals were scaled to).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from proserve.scheduler import validate
from proserve.scheduler.config import default_classes
from proserve.scheduler.request import ConfigError, PriorityClass, Request

from .traces import Conversation, TraceRecord, load_sharegpt_conversations, load_trace

log = logging.getLogger(__name__)

ARRIVALS = ("poisson", "gamma", "constant")
LENGTH_KINDS = ("fixed", "uniform", "lognormal")

# build_workload("synthetic") defaults
SYNTHETIC_N = 1000
SYNTHETIC_RATE = 1.0  # req/s

# per-purpose seed salts (arbitrary, fixed: changing them changes every workload)
_SALT_SYNTHETIC = 0x5E1
_SALT_ARRIVALS = 0xA77
_SALT_PRIORITY = 0x9A1
_SALT_CONVERSATIONS = 0xC07
_SALT_THINK = 0x7417


# --- seeds ----------------------------------------------------------------------

def _entropy(seed: int | None, salt: int) -> list[int] | None:
    """Seed material for numpy: ``[seed, salt]``, or None (fresh entropy) for ``seed=None``."""
    if seed is None:
        return None
    return [validate.integer("", "seed", seed, 0), salt]


def _rng(seed: int | None, salt: int) -> np.random.Generator:
    return np.random.default_rng(_entropy(seed, salt))


# --- length distributions ------------------------------------------------------

@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution for synthetic workloads.

    * ``fixed``: always ``value``;
    * ``uniform``: integers in ``[lo, hi]`` inclusive;
    * ``lognormal``: mean ``mean`` tokens (of the unclamped distribution),
      log-space standard deviation ``sigma``, rounded and clamped to
      ``[lo, hi]`` (``hi=None``: no upper bound).

    Build with :meth:`fixed`, :meth:`uniform`, :meth:`lognormal` or
    :meth:`parse` (``"fixed:128"``, ``"uniform:64:512"``,
    ``"lognormal:1024:0.8[:lo[:hi]]"``).
    """

    kind: str
    value: int | None = None
    lo: int = 1
    hi: int | None = None
    mean: float | None = None
    sigma: float | None = None

    @classmethod
    def fixed(cls, value: int) -> "LengthDist":
        return cls("fixed", value=value)

    @classmethod
    def uniform(cls, lo: int, hi: int) -> "LengthDist":
        return cls("uniform", lo=lo, hi=hi)

    @classmethod
    def lognormal(cls, mean: float, sigma: float, lo: int = 1, hi: int | None = None) -> "LengthDist":
        return cls("lognormal", mean=mean, sigma=sigma, lo=lo, hi=hi)

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        """``kind:arg:...`` as in the class docstring."""
        kind, *args = text.strip().split(":")
        want = {"fixed": (1, 1), "uniform": (2, 2), "lognormal": (2, 4)}
        if kind not in want:
            raise ConfigError(f"length distribution {text!r}: unknown kind {kind!r} "
                              f"(choose from {', '.join(LENGTH_KINDS)})")
        lo_n, hi_n = want[kind]
        if not lo_n <= len(args) <= hi_n:
            raise ConfigError(f"length distribution {text!r}: {kind} takes {lo_n}..{hi_n} arguments")
        try:
            if kind == "fixed":
                return cls.fixed(int(args[0]))
            if kind == "uniform":
                return cls.uniform(int(args[0]), int(args[1]))
            extra = [int(a) for a in args[2:]]
            return cls.lognormal(float(args[0]), float(args[1]), *extra)
        except ValueError as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"length distribution {text!r}: {e}") from None

    def __post_init__(self) -> None:
        where = f"LengthDist({self.kind})"
        if self.kind not in LENGTH_KINDS:
            raise ConfigError(f"LengthDist: unknown kind {self.kind!r} "
                              f"(choose from {', '.join(LENGTH_KINDS)})")
        if self.kind == "fixed":
            validate.integer(where, "value", self.value)
            return
        validate.integer(where, "lo", self.lo)
        if self.kind == "uniform" or self.hi is not None:
            validate.integer(where, "hi", self.hi)
            if self.hi < self.lo:
                raise ConfigError(f"{where}: hi must be >= lo, got lo={self.lo!r}, hi={self.hi!r}")
        if self.kind == "lognormal":
            validate.positive(where, "mean", self.mean)
            validate.non_negative(where, "sigma", self.sigma)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` integer lengths (int64 array)."""
        if self.kind == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # E[X] = exp(mu + sigma^2/2) = mean
        x = np.rint(rng.lognormal(mu, self.sigma, size=n))
        return np.clip(x, self.lo, self.hi if self.hi is not None else np.inf).astype(np.int64)


DEFAULT_PROMPT = LengthDist.lognormal(1024, 0.8, lo=1, hi=8192)
DEFAULT_OUTPUT = LengthDist.lognormal(256, 0.8, lo=1, hi=2048)


# --- arrivals --------------------------------------------------------------------

def _arrival_times(n: int, rate: float, arrival: str, cv: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` arrival times starting at 0 with mean gap ``1/rate``."""
    if arrival not in ARRIVALS:
        raise ConfigError(f"unknown arrival process {arrival!r} (choose from {', '.join(ARRIVALS)})")
    validate.positive("arrivals", "cv", cv)
    if arrival != "gamma" and cv != 1.0:
        raise ConfigError(f"arrivals: cv={cv!r} applies only to arrival='gamma' (got {arrival!r})")
    m = n - 1
    if arrival == "poisson":
        gaps = rng.exponential(1.0 / rate, size=m)
    elif arrival == "gamma":
        shape = 1.0 / cv ** 2  # CV of Gamma(k, θ) is 1/sqrt(k)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=m)
    else:
        gaps = np.full(m, 1.0 / rate)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def synthetic(n: int, rate: float, arrival: str = "poisson", cv: float = 1.0,
              prompt: LengthDist | None = None, output: LengthDist | None = None,
              seed: int | None = 0) -> list[TraceRecord]:
    """``n`` synthetic records at mean rate ``rate`` req/s, first arrival 0.

    ``arrival``: ``poisson`` (exponential gaps), ``gamma`` (gaps with
    coefficient of variation ``cv``; shape ``1/cv²``; ``cv=1`` is Poisson,
    ``cv>1`` burstier) or ``constant`` (evenly spaced). Lengths default to
    :data:`DEFAULT_PROMPT` / :data:`DEFAULT_OUTPUT`.
    """
    n = validate.integer("synthetic", "n", n)
    rate = validate.positive("synthetic", "rate", rate)
    prompt = DEFAULT_PROMPT if prompt is None else prompt
    output = DEFAULT_OUTPUT if output is None else output
    for name, d in (("prompt", prompt), ("output", output)):
        if not isinstance(d, LengthDist):
            raise ConfigError(f"synthetic: {name} must be a LengthDist, got {d!r}")
    r_arr, r_p, r_o = (np.random.default_rng(s)
                       for s in np.random.SeedSequence(_entropy(seed, _SALT_SYNTHETIC)).spawn(3))
    t = _arrival_times(n, rate, arrival, cv, r_arr)
    p = prompt.sample(n, r_p)
    o = output.sample(n, r_o)
    return [TraceRecord(float(t[i]), int(p[i]), int(o[i])) for i in range(n)]


def assign_arrivals(records: Sequence[TraceRecord], rate: float, arrival: str = "poisson",
                    cv: float = 1.0, seed: int | None = 0) -> list[TraceRecord]:
    """Replace arrivals by a fresh ``arrival`` process at ``rate`` (record order kept)."""
    rate = validate.positive("assign_arrivals", "rate", rate)
    if not records:
        return []
    t = _arrival_times(len(records), rate, arrival, cv, _rng(seed, _SALT_ARRIVALS))
    return [replace(rec, arrival=float(ti)) for rec, ti in zip(records, t)]


def poisson_arrivals(records: Sequence[TraceRecord], rate: float, seed: int | None = 0) -> list[TraceRecord]:
    """Replace arrivals by Poisson arrivals at ``rate`` req/s, first at 0 (record order kept)."""
    return assign_arrivals(records, rate, "poisson", 1.0, seed)


def scale_to_rate(records: Sequence[TraceRecord], rate: float, seed: int | None = 0,
                  arrival: str = "poisson", cv: float = 1.0) -> list[TraceRecord]:
    """§5.1 scaling: stretch or compress the timestamps so that the overall mean
    rate ``(n-1) / (last - first)`` equals ``rate`` req/s, keeping the relative gaps.

    ``new = (t - first) * orig_rate / rate`` with ``orig_rate = (n-1) / (last - first)``.
    Records come back sorted by arrival, first at 0. A trace without timestamps
    (all arrivals equal, e.g. ShareGPT) gets :func:`assign_arrivals` instead
    (Poisson by default, as the paper does for ShareGPT); ``arrival``/``cv``
    apply only then.
    """
    rate = validate.positive("scale_to_rate", "rate", rate)
    recs = sorted(records, key=lambda r: r.arrival)
    if len(recs) <= 1:
        return [replace(r, arrival=0.0) for r in recs]
    first, last = recs[0].arrival, recs[-1].arrival
    if last == first:
        return assign_arrivals(recs, rate, arrival, cv, seed)
    orig_rate = (len(recs) - 1) / (last - first)
    k = orig_rate / rate
    return [replace(r, arrival=(r.arrival - first) * k) for r in recs]


def repeat_arrivals(records: Sequence[TraceRecord], duration: float) -> Iterator[TraceRecord]:
    """The trace played back to back for ``duration`` seconds of arrivals, lazily.

    Copy ``k`` of the records (sorted by arrival, first at 0) is shifted by
    ``k · period`` with ``period = span + span / (n - 1)``: the trace's span plus
    its mean gap, so the seam between copies looks like an ordinary gap and the
    mean rate stays ``(n - 1) / span``. Records arriving at or after
    ``duration`` are not yielded. A generator, so a day of arrivals need not be in
    memory (:func:`iter_tagged`, ``proserve.sim.stream``). Scale first
    (:func:`scale_to_rate`) to set the rate, then repeat.
    """
    duration = validate.positive("repeat_arrivals", "duration", duration)
    recs = sorted(records, key=lambda r: r.arrival)
    if len(recs) < 2 or recs[-1].arrival == recs[0].arrival:
        raise ConfigError("repeat_arrivals: needs at least two records with different arrivals "
                          "(a trace without timestamps has no arrival process to repeat)")
    first = recs[0].arrival
    span = recs[-1].arrival - first
    period = span + span / (len(recs) - 1)
    k = 0
    while k * period < duration:
        shift = k * period - first
        for r in recs:
            t = r.arrival + shift
            if t >= duration:
                return
            yield replace(r, arrival=t)
        k += 1


# --- context fitting and priority tagging ----------------------------------------

def fit_to_context(records: Sequence[TraceRecord], max_model_len: int) -> tuple[list[TraceRecord], int]:
    """Make every ``prompt_len + output_len <= max_model_len``; return (records, number changed).

    The output is cut first (down to 1 token); if the prompt alone leaves no
    room, it is cut to ``max_model_len - 1`` and the output is 1 token.
    """
    L = validate.integer("fit_to_context", "max_model_len", max_model_len)
    if L < 2:
        raise ConfigError(f"fit_to_context: max_model_len must be >= 2, got {max_model_len!r}")
    out: list[TraceRecord] = []
    changed = 0
    for r in records:
        if r.prompt_len + r.output_len <= L:
            out.append(r)
            continue
        changed += 1
        p = min(r.prompt_len, L - 1)
        out.append(replace(r, prompt_len=p, output_len=L - p))
    return out, changed


def _check_classes(classes: Mapping[str, PriorityClass]) -> dict[str, PriorityClass]:
    if not isinstance(classes, Mapping) or not classes:
        raise ConfigError(f"classes must be a non-empty mapping name -> PriorityClass, got {classes!r}")
    for name, pc in classes.items():
        if not isinstance(pc, PriorityClass):
            raise ConfigError(f"classes[{name!r}] must be a PriorityClass, got {pc!r}")
        if pc.name != name:
            raise ConfigError(f"classes[{name!r}] is named {pc.name!r}; keys must match class names")
    return dict(classes)


def _normalise_shares(shares: Mapping[str, float] | None, names: list[str]) -> np.ndarray:
    if shares is None:
        return np.full(len(names), 1.0 / len(names))
    if not isinstance(shares, Mapping):
        raise ConfigError(f"shares must be a mapping class name -> share, got {shares!r}")
    for name, s in shares.items():
        if name not in names:
            raise ConfigError(f"shares: unknown class {name!r} (classes: {', '.join(names)})")
        validate.non_negative("", f"shares[{name!r}]", s)
    p = np.array([float(shares.get(n, 0.0)) for n in names])
    if p.sum() <= 0:
        raise ConfigError(f"shares must not all be 0, got {dict(shares)!r}")
    return p / p.sum()


def tag_priorities(records: Sequence[TraceRecord], classes: Mapping[str, PriorityClass] | None = None,
                   shares: Mapping[str, float] | None = None, seed: int | None = 0,
                   max_model_len: int | None = None, start: float = 0.0) -> list[Request]:
    """Turn records into :class:`Request` s ``r0, r1, ...`` (record order kept).

    Each request gets a class drawn independently with probabilities
    ``shares`` (normalised; classes not named get 0; default: equal shares, i.e.
    the paper's 50/50 high/low with :func:`proserve.scheduler.config.default_classes`),
    and that class's weight and SLOs. ``max_model_len`` applies
    :func:`fit_to_context` (the number changed is logged). ``start`` is added
    to every arrival.
    """
    classes = _check_classes(default_classes() if classes is None else classes)
    names = list(classes)
    probs = _normalise_shares(shares, names)
    validate.number("", "start", start)
    if max_model_len is not None:
        records, changed = fit_to_context(records, max_model_len)
        if changed:
            log.warning("%d of %d requests exceeded max_model_len=%d and were truncated",
                        changed, len(records), max_model_len)
    rng = _rng(seed, _SALT_PRIORITY)
    picks = rng.choice(len(names), size=len(records), p=probs) if len(records) else []
    out = []
    for i, (rec, k) in enumerate(zip(records, picks)):
        pc = classes[names[k]]
        out.append(Request(id=f"r{i}", priority=pc.name, weight=pc.weight, ttft_slo=pc.ttft_slo,
                           tpot_slo=pc.tpot_slo, arrival=start + rec.arrival,
                           prompt_len=rec.prompt_len, output_len=rec.output_len, **_prefix(rec)))
    return out


def _prefix(rec: TraceRecord) -> dict:
    """A record's prefix blocks as Request fields: its ``hash_ids`` cut to the blocks its
    prompt covers (a prompt shortened by fit_to_context or clipping names fewer)."""
    if not rec.hash_ids:
        return {}
    if rec.block_tokens < 1:
        raise ConfigError(f"trace record with hash_ids needs block_tokens >= 1, got {rec.block_tokens!r}")
    return {"prefix_blocks": rec.hash_ids[:-(-rec.prompt_len // rec.block_tokens)],
            "prefix_block_tokens": rec.block_tokens}


def iter_tagged(records: Iterable[TraceRecord], classes: Mapping[str, PriorityClass] | None = None,
                shares: Mapping[str, float] | None = None, seed: int | None = 0,
                chunk: int = 65536) -> Iterator[Request]:
    """:func:`tag_priorities` for a stream of records (e.g. :func:`repeat_arrivals`):
    the same requests ``r0, r1, ...`` with the same classes, made lazily.

    The classes are drawn ``chunk`` at a time from the same seeded stream, which
    gives the draws of one call for all of them (numpy's ``choice`` with ``p``
    maps one uniform per draw), so for a list the result equals
    ``tag_priorities(records, classes, shares, seed)``.
    """
    classes = _check_classes(default_classes() if classes is None else classes)
    names = list(classes)
    probs = _normalise_shares(shares, names)
    chunk = validate.integer("iter_tagged", "chunk", chunk)
    rng = _rng(seed, _SALT_PRIORITY)
    it = iter(records)
    i = 0
    while True:
        block = list(itertools.islice(it, chunk))
        if not block:
            return
        picks = rng.choice(len(names), size=len(block), p=probs)
        for rec, k in zip(block, picks):
            pc = classes[names[k]]
            yield Request(id=f"r{i}", priority=pc.name, weight=pc.weight, ttft_slo=pc.ttft_slo,
                          tpot_slo=pc.tpot_slo, arrival=rec.arrival, prompt_len=rec.prompt_len,
                          output_len=rec.output_len, **_prefix(rec))
            i += 1


# --- multi-turn conversations ------------------------------------------------------

#: tokens per prefix block of a conversation's requests (vLLM's default KV block size)
CONVERSATION_BLOCK_TOKENS = 16
SYNTHETIC_CONVERSATIONS = 100   # load_conversations("synthetic") default count
DEFAULT_TURNS = LengthDist.uniform(2, 6)
DEFAULT_MESSAGE = LengthDist.lognormal(96, 0.8, lo=4, hi=1024)
DEFAULT_ANSWER = LengthDist.lognormal(192, 0.6, lo=4, hi=1024)


def _think_times(rng: np.random.Generator, n: int, mean: float) -> tuple[float, ...]:
    """``n`` think times, exponential of mean ``mean`` seconds (0: all 0)."""
    if n <= 0:
        return ()
    if mean == 0:
        return (0.0,) * n
    return tuple(float(x) for x in rng.exponential(mean, size=n))


def synthetic_conversations(n: int, rate: float = 1.0, turns: LengthDist | None = None,
                            message: LengthDist | None = None, answer: LengthDist | None = None,
                            think_time: float = 0.0, seed: int | None = 0) -> list[Conversation]:
    """``n`` synthetic conversations ``c0, c1, ...`` starting as a Poisson process of
    ``rate`` conversations/s (first at 0). Each has ``turns`` turns (at least 1), its
    messages and answers ``message`` / ``answer`` tokens long (at least 1; defaults
    :data:`DEFAULT_TURNS`, :data:`DEFAULT_MESSAGE`, :data:`DEFAULT_ANSWER`), and a
    think time before every turn after the first, exponential of mean ``think_time`` s
    (0: none). A function of the arguments and ``seed`` only."""
    n = validate.integer("synthetic_conversations", "n", n)
    rate = validate.positive("synthetic_conversations", "rate", rate)
    think_time = validate.non_negative("synthetic_conversations", "think_time", think_time)
    dists = {"turns": DEFAULT_TURNS if turns is None else turns,
             "message": DEFAULT_MESSAGE if message is None else message,
             "answer": DEFAULT_ANSWER if answer is None else answer}
    for name, d in dists.items():
        if not isinstance(d, LengthDist):
            raise ConfigError(f"synthetic_conversations: {name} must be a LengthDist, got {d!r}")
    r_arr, r_turns, r_msg, r_ans, r_think = (
        np.random.default_rng(s) for s in np.random.SeedSequence(_entropy(seed, _SALT_CONVERSATIONS)).spawn(5))
    starts = _arrival_times(n, rate, "poisson", 1.0, r_arr)
    k = np.maximum(dists["turns"].sample(n, r_turns), 1)
    msg = np.maximum(dists["message"].sample(int(k.sum()), r_msg), 1)
    ans = np.maximum(dists["answer"].sample(int(k.sum()), r_ans), 1)
    out, pos = [], 0
    for i in range(n):
        ki = int(k[i])
        turns_i = tuple((int(msg[pos + j]), int(ans[pos + j])) for j in range(ki))
        pos += ki
        out.append(Conversation(f"c{i}", turns_i, float(starts[i]), _think_times(r_think, ki - 1, think_time)))
    return out


def with_think_times(convs: Sequence[Conversation], think_time: float, seed: int | None = 0) -> list[Conversation]:
    """Every conversation's think times replaced by fresh ones, exponential of mean
    ``think_time`` seconds (0: none), seeded (a trace's conversations have none)."""
    think_time = validate.non_negative("with_think_times", "think_time", think_time)
    rng = _rng(seed, _SALT_THINK)
    return [replace(c, think_s=_think_times(rng, len(c.turns) - 1, think_time)) for c in convs]


def load_conversations(source: str | os.PathLike, num_conversations: int | None = None,
                       rate: float | None = None, seed: int | None = 0, *, think_time: float = 0.0,
                       turns: LengthDist | None = None, message: LengthDist | None = None,
                       answer: LengthDist | None = None, tokenizer=None) -> list[Conversation]:
    """Multi-turn conversations: ``"synthetic"`` (:func:`synthetic_conversations`:
    ``num_conversations``, default 100, starting at ``rate`` conversations/s, default 1)
    or a ShareGPT JSON file (:func:`proserve.bench.traces.load_sharegpt_conversations`,
    its first ``num_conversations``; with ``rate``, Poisson starts at that many
    conversations/s, else all start at 0). Think times: exponential of mean
    ``think_time`` s in both."""
    if num_conversations is not None:
        validate.integer("load_conversations", "num_conversations", num_conversations)
    if str(source) == "synthetic":
        if tokenizer is not None:
            raise ConfigError("load_conversations: tokenizer applies to a ShareGPT file, not 'synthetic'")
        return synthetic_conversations(num_conversations or SYNTHETIC_CONVERSATIONS,
                                       SYNTHETIC_RATE if rate is None else rate,
                                       turns, message, answer, think_time, seed)
    if turns is not None or message is not None or answer is not None:
        raise ConfigError("load_conversations: turns/message/answer distributions apply only to 'synthetic'")
    convs = load_sharegpt_conversations(source, num_conversations, tokenizer)
    if rate is not None:
        rate = validate.positive("load_conversations", "rate", rate)
        t = _arrival_times(len(convs), rate, "poisson", 1.0, _rng(seed, _SALT_ARRIVALS))
        convs = [replace(c, arrival=float(ti)) for c, ti in zip(convs, t)]
    return with_think_times(convs, think_time, seed)


@dataclass(frozen=True, slots=True)
class TurnLink:
    """A multi-turn request's place in its conversation, for the load generator: it is
    sent ``think_s`` after the answer of request ``prev`` (the previous turn) arrives, and
    its prompt is the conversation's token stream cut to ``prompt_len``, made of the
    blocks ``blocks`` (``block_tokens`` tokens each, first to last; the last may be cut)."""

    conversation: str
    turn: int                    # 0-based
    prev: int | None             # workload index of the previous turn; None for a first turn
    think_s: float
    blocks: tuple[int, ...]
    block_tokens: int


def conversation_requests(convs: Sequence[Conversation], classes: Mapping[str, PriorityClass] | None = None,
                          shares: Mapping[str, float] | None = None, seed: int | None = 0, *,
                          block_tokens: int = CONVERSATION_BLOCK_TOKENS, max_model_len: int | None = None,
                          max_prompt: int | None = None, start: float = 0.0,
                          ) -> tuple[list[Request], list[TurnLink]]:
    """Every turn of every conversation as a :class:`Request` ``r0, r1, ...`` (sorted by
    arrival), with its :class:`TurnLink`.

    * Prompt of turn ``k``: turn ``k-1``'s prompt + its answer + message ``k``; output:
      answer ``k``. The answer is a fixed block of the conversation's token stream (the
      load generator sends the same tokens whatever the engine answered), so the prefix
      structure is known in advance and the simulator runs the same workload.
    * Prefix blocks: a conversation's token stream is cut into ``block_tokens``-token
      blocks with ids unique to it; a turn names the *full* blocks its prompt covers, so
      turn ``k+1``'s ``prefix_blocks`` start with all of turn ``k``'s.
    * Class: one per conversation (a conversation is one client's), drawn as
      :func:`tag_priorities` draws one per record.
    * Arrival (the simulator's; open loop): turn 0 at ``start + arrival``; turn ``k`` at
      turn ``k-1``'s arrival + the time its answer takes at its class's SLOs
      (``ttft_slo + (answer - 1) · tpot_slo``) + the think time. The load generator
      instead sends turn ``k`` when turn ``k-1``'s answer has arrived (+ think time).
    * ``max_prompt`` / ``max_model_len``: a later turn that does not fit ends its
      conversation (it and the rest are dropped, counted in a warning); a first turn
      that does not fit is cut as :func:`fit_to_context` cuts.
    """
    classes = _check_classes(default_classes() if classes is None else classes)
    names = list(classes)
    probs = _normalise_shares(shares, names)
    B = validate.integer("conversation_requests", "block_tokens", block_tokens, 1)
    if max_model_len is not None and validate.integer("conversation_requests", "max_model_len",
                                                      max_model_len) < 2:
        raise ConfigError(f"conversation_requests: max_model_len must be >= 2, got {max_model_len!r}")
    if max_prompt is not None:
        validate.integer("conversation_requests", "max_prompt", max_prompt, 1)
    validate.number("", "start", start)
    picks = _rng(seed, _SALT_PRIORITY).choice(len(names), size=len(convs), p=probs) if len(convs) else []
    rows = []   # (arrival, conversation index, turn, prompt, output, think, blocks, class)
    base = dropped = 0
    for ci, (conv, pick) in enumerate(zip(convs, picks)):
        _check_conversation(conv, ci)
        pc = classes[names[pick]]
        ctx, t, last_out, span_max = 0, start + conv.arrival, 0, 0
        for k, (m, a) in enumerate(conv.turns):
            p, o = ctx + m, a
            too_long = (max_prompt is not None and p > max_prompt) or \
                (max_model_len is not None and p + o > max_model_len)
            if k and too_long:
                dropped += len(conv.turns) - k
                break
            if max_prompt is not None:
                p = min(p, max_prompt)
            if max_model_len is not None and p + o > max_model_len:   # a first turn: cut to fit
                p = min(p, max_model_len - 1)
                o = max_model_len - p
            think = conv.think_s[k - 1] if k and conv.think_s else 0.0
            if k:
                t += pc.ttft_slo + (last_out - 1) * pc.tpot_slo + think
            span = -(-p // B)
            rows.append((t, ci, k, p, o, think, tuple(range(base, base + span)), pc))
            span_max = max(span_max, span)
            ctx, last_out = p + o, o
        base += span_max
    if dropped:
        log.warning("%d turns of %d conversations did not fit max_prompt/max_model_len and were dropped",
                    dropped, len(convs))
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    where: dict[tuple[int, int], int] = {}
    reqs, links = [], []
    for i, (t, ci, k, p, o, think, blocks, pc) in enumerate(rows):
        where[ci, k] = i
        full = blocks[:p // B]
        reqs.append(Request(id=f"r{i}", priority=pc.name, weight=pc.weight, ttft_slo=pc.ttft_slo,
                            tpot_slo=pc.tpot_slo, arrival=t, prompt_len=p, output_len=o,
                            prefix_blocks=full, prefix_block_tokens=B if full else 0))
        links.append(TurnLink(convs[ci].id, k, where[ci, k - 1] if k else None, think, blocks, B))
    return reqs, links


def _check_conversation(conv, i: int) -> None:
    where = f"conversation {i}"
    if not isinstance(conv, Conversation):
        raise ConfigError(f"{where}: expected a Conversation, got {type(conv).__name__}")
    where = f"conversation {i} ({conv.id!r})"
    if not conv.turns:
        raise ConfigError(f"{where}: has no turns")
    for k, turn in enumerate(conv.turns):
        if not (isinstance(turn, tuple) and len(turn) == 2):
            raise ConfigError(f"{where}: turn {k} must be (message tokens, answer tokens), got {turn!r}")
        validate.integer(where, f"turn {k} message tokens", turn[0], 1)
        validate.integer(where, f"turn {k} answer tokens", turn[1], 1)
    if conv.think_s and len(conv.think_s) != len(conv.turns) - 1:
        raise ConfigError(f"{where}: {len(conv.think_s)} think times for {len(conv.turns)} turns "
                          f"(one before each turn after the first)")
    for x in conv.think_s:
        validate.non_negative(where, "think time", x)
    validate.number(where, "arrival", conv.arrival)


# --- the whole pipeline -----------------------------------------------------------

def build_workload(source: str | os.PathLike, rate: float | None = None, num_requests: int | None = None,
                   seed: int | None = 0, classes: Mapping[str, PriorityClass] | None = None,
                   shares: Mapping[str, float] | None = None, start: float = 0.0, *,
                   fmt: str | None = None, max_model_len: int | None = None,
                   arrival: str = "poisson", cv: float = 1.0,
                   prompt: LengthDist | None = None, output: LengthDist | None = None,
                   **load_options) -> list[Request]:
    """Load (or synthesise), cut, scale and tag a workload; what the simulator CLI calls.

    * ``source == "synthetic"``: :func:`synthetic` with ``num_requests``
      (default 1000) at ``rate`` (default 1 req/s), ``arrival``/``cv`` and
      ``prompt``/``output`` lengths;
    * otherwise a trace file (``fmt`` or sniffed; ``load_options`` such as
      ``model=``/``tokenizer=`` go to the loader), cut to its first
      ``num_requests`` rows and, if ``rate`` is given, scaled to it with
      :func:`scale_to_rate`. Without ``rate`` the trace's own timing is kept
      (a ShareGPT trace then arrives all at once, at ``start``).
    """
    if num_requests is not None:
        validate.integer("build_workload", "num_requests", num_requests)
    if str(source) == "synthetic":
        if load_options or fmt is not None:
            raise ConfigError("build_workload: fmt/loader options do not apply to source 'synthetic'")
        records = synthetic(num_requests or SYNTHETIC_N, SYNTHETIC_RATE if rate is None else rate,
                            arrival, cv, prompt, output, seed)
    else:
        if prompt is not None or output is not None:
            raise ConfigError("build_workload: prompt/output distributions apply only to source 'synthetic'")
        records = load_trace(source, fmt, limit=num_requests, **load_options)
        if rate is not None:
            records = scale_to_rate(records, rate, seed, arrival, cv)
    return tag_priorities(records, classes, shares, seed, max_model_len, start)
