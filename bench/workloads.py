"""Workloads: synthetic traces, arrival scaling (§5.1) and priority tagging.

The pipeline the simulator CLI runs is :func:`build_workload`::

    load_trace / synthetic  →  scale_to_rate  →  tag_priorities  →  list[Request]

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

from .traces import MOONCAKE_BLOCK_TOKENS, TraceRecord, load_trace

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
                           prompt_len=rec.prompt_len, output_len=rec.output_len,
                           prefix_blocks=rec.hash_ids,
                           prefix_block_tokens=MOONCAKE_BLOCK_TOKENS if rec.hash_ids else 0))
    return out


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
                          output_len=rec.output_len)
            i += 1


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
