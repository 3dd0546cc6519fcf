"""Token-level Deadline-aware Gain (TDG, §2 Eq. 3) and the system metrics of §5.1.

    f_TDG(r)        = Σ_i w_r(i) · 1[t_{r,i} < deadline_{r,i}]
    deadline_{r,i}  = TTFT_SLO + (i-1)·TPOT_SLO                 (from arrival)
    w_r(1)          = w_p · w_{p(r)},   w_r(i>1) = w_d · w_{p(r)}

Footnote 2 variant (``deadline="ttft_anchored"``), for front ends that cannot
buffer the first token: ``deadline_{r,i} = min(TTFT_r, TTFT_SLO) + (i-1)·TPOT_SLO``.

Metrics (overall and per priority class): TDG_Ratio = Σ f_TDG / Ideal_Gain,
Miss_TDG_Ratio = 1 - TDG_Ratio, SLO attainment (TTFT and TPOT both *strictly*
below their SLOs), TTFT/TPOT P50/P90/P99, throughput.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import validate
from .request import ConfigError, Request

DEADLINE_VARIANTS = ("fixed", "ttft_anchored")


@dataclass(frozen=True)
class GainConfig:
    """Weights of the first token (``w_p``) and of each decode token (``w_d``).

    Default ``w_p = w_d = 1``. The paper (§5.1) sets the ratio w_p/w_d to the
    workload's mean input/output length ratio, so that the first token, which
    costs a whole prefill, is worth about as much as the prompt it stands for;
    :meth:`from_workload` does that, and the simulator and benchmark use it
    unless ``--w-p``/``--w-d`` are given.
    """

    w_p: float = 1.0
    w_d: float = 1.0
    deadline: str = "fixed"

    def __post_init__(self) -> None:
        validate.non_negative("gain", "w_p", self.w_p)
        validate.non_negative("gain", "w_d", self.w_d)
        if self.w_p == 0 and self.w_d == 0:
            raise ConfigError("gain: w_p and w_d cannot both be 0")
        validate.one_of("gain", "deadline", self.deadline, DEADLINE_VARIANTS)

    @classmethod
    def from_workload(cls, prompt_lens: Sequence[int], output_lens: Sequence[int],
                      deadline: str = "fixed") -> "GainConfig":
        """w_d = 1 and w_p = mean(prompt) / mean(output) (§5.1)."""
        if len(prompt_lens) == 0:
            raise ConfigError("gain: cannot derive w_p from an empty workload")
        return cls(w_p=float(np.mean(prompt_lens)) / float(np.mean(output_lens)), w_d=1.0,
                   deadline=deadline)

    # -- Eq. 3 -----------------------------------------------------------------
    def token_weight(self, req: Request, i: int) -> float:
        """w_r(i) for the 1-based token index ``i``."""
        return (self.w_p if i == 1 else self.w_d) * req.weight

    def token_deadline(self, req: Request, i: int) -> float:
        """Absolute deadline of token ``i`` (1-based) on the caller's clock."""
        return req.arrival + self._ttft_anchor(req) + (i - 1) * req.tpot_slo

    def late_decode_gain(self, weight: float, tpot_slo: float, late: float, step: float, n_out: float) -> float:
        """The decode-token gain a request of priority weight ``weight`` and TPOT SLO
        ``tpot_slo`` loses when its first token comes ``late`` seconds past its deadline and
        each later token ``step`` seconds after the one before, out of ``n_out`` decode
        tokens: with fixed deadlines token i ≥ 2 meets deadline_{r,i} iff
        late + (i−1)·step < (i−1)·TPOT_SLO, so the first ``late / (TPOT_SLO − step)`` miss
        (all ``n_out`` when ``step ≥ TPOT_SLO``), each worth w_d·w_prio (Eq. 3); with
        ``ttft_anchored`` deadlines a late first token moves the later deadlines with it, and
        nothing more is lost."""
        if late <= 0.0 or self.deadline == "ttft_anchored":
            return 0.0
        slack = tpot_slo - step
        lost = n_out if slack <= 0.0 else min(n_out, late / slack)
        return self.w_d * weight * lost

    def _ttft_anchor(self, req: Request) -> float:
        if self.deadline == "ttft_anchored" and req.token_times:
            return min(req.token_times[0] - req.arrival, req.ttft_slo)
        return req.ttft_slo

    def next_token_deadline(self, req: Request) -> float:
        """deadline_{r, output_len+1}: the deadline of the next token to emit."""
        return self.token_deadline(req, len(req.token_times) + 1)

    def next_token_weight(self, req: Request) -> float:
        """w_r(output_len + 1), the numerator of density (Alg. 1 line 5)."""
        return self.token_weight(req, req.num_emitted + 1)

    def tdg(self, req: Request) -> float:
        """f_TDG(r) over the tokens emitted so far."""
        n = req.num_emitted
        if n == 0:
            return 0.0
        times = np.asarray(req.token_times)
        deadlines = req.arrival + self._ttft_anchor(req) + np.arange(n) * req.tpot_slo
        met = times < deadlines
        gain = self.w_d * float(np.count_nonzero(met[1:])) + (self.w_p if met[0] else 0.0)
        return gain * req.weight

    def ideal_gain(self, req: Request) -> float:
        """Gain if all ``output_len`` tokens met their deadlines."""
        return (self.w_p + (req.output_len - 1) * self.w_d) * req.weight


def slo_attained(req: Request) -> bool:
    """TTFT and TPOT both strictly below the SLOs (§5.1); unfinished requests fail."""
    if not req.finished or req.ttft is None:
        return False
    return req.ttft < req.ttft_slo and req.tpot < req.tpot_slo


@dataclass
class ClassMetrics:
    name: str
    requests: int
    finished: int
    tdg: float
    ideal_gain: float
    tdg_ratio: float
    miss_tdg_ratio: float
    first_token_tdg_ratio: float
    slo_attainment: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    throughput_tokens_s: float
    throughput_req_s: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


class ClassSums:
    """Running sums of one class's metrics, one request at a time: what
    :func:`class_metrics` computes over a list and ``proserve.sim.report.MetricsAccumulator``
    over a stream of requests it then drops. The TTFT and TPOT values for the
    percentiles are kept by the caller (:meth:`add` returns them)."""

    __slots__ = ("finished", "first_got", "first_ideal", "ideal", "requests", "slo_met", "tdg", "tokens")

    def __init__(self) -> None:
        self.requests = self.finished = self.slo_met = self.tokens = 0
        self.tdg = self.ideal = self.first_ideal = self.first_got = 0.0

    @staticmethod
    def terms(r: Request, gain: GainConfig) -> tuple:
        """One request's contributions: (TDG, ideal gain, first-token ideal, first-token gain, SLO met)."""
        first = gain.w_p * r.weight
        got = first if r.token_times and r.token_times[0] < gain.token_deadline(r, 1) else 0.0
        return gain.tdg(r), gain.ideal_gain(r), first, got, slo_attained(r)

    def add(self, r: Request, terms: tuple) -> None:
        tdg, ideal, first, got, met = terms
        self.requests += 1
        self.finished += r.finished
        self.tdg += tdg
        self.ideal += ideal
        self.first_ideal += first
        self.first_got += got
        self.slo_met += met
        self.tokens += r.num_emitted

    def metrics(self, name: str, ttfts, tpots, duration: float) -> ClassMetrics:
        """The class's :class:`ClassMetrics`, given its TTFT and TPOT values."""
        ratio = self.tdg / self.ideal if self.ideal > 0 else float("nan")
        return ClassMetrics(
            name=name, requests=self.requests, finished=self.finished, tdg=self.tdg, ideal_gain=self.ideal,
            tdg_ratio=ratio, miss_tdg_ratio=1.0 - ratio if self.ideal > 0 else float("nan"),
            first_token_tdg_ratio=self.first_got / self.first_ideal if self.first_ideal > 0 else float("nan"),
            slo_attainment=self.slo_met / self.requests if self.requests else float("nan"),
            ttft_p50=_pct(ttfts, 50), ttft_p90=_pct(ttfts, 90), ttft_p99=_pct(ttfts, 99),
            tpot_p50=_pct(tpots, 50), tpot_p90=_pct(tpots, 90), tpot_p99=_pct(tpots, 99),
            throughput_tokens_s=self.tokens / duration if duration > 0 else float("nan"),
            throughput_req_s=self.finished / duration if duration > 0 else float("nan"),
        )


def request_latencies(r: Request) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) as the percentiles count them: TPOT only for finished multi-token requests."""
    return r.ttft, (r.tpot if r.finished and r.num_emitted > 1 else None)


def class_metrics(name: str, reqs: Sequence[Request], gain: GainConfig, duration: float) -> ClassMetrics:
    sums = ClassSums()
    ttfts, tpots = [], []
    for r in reqs:
        sums.add(r, ClassSums.terms(r, gain))
        ttft, tpot = request_latencies(r)
        if ttft is not None:
            ttfts.append(ttft)
        if tpot is not None:
            tpots.append(tpot)
    return sums.metrics(name, ttfts, tpots, duration)


def run_duration(reqs: Sequence[Request]) -> float:
    """First arrival → last emitted token (0 if none was emitted): the default ``duration``
    of the rates here and in the alternatives' ``metrics`` modules (:mod:`proserve.scheduler.alternatives`)."""
    ends = [r.token_times[-1] for r in reqs if r.token_times]
    return (max(ends) - min(r.arrival for r in reqs)) if ends else 0.0


def class_groups(reqs: Sequence[Request]) -> Iterator[tuple[str, Sequence[Request]]]:
    """``("all", reqs)``, then each priority class (sorted by name) with its requests."""
    yield "all", reqs
    for cls in sorted({r.priority for r in reqs}):
        yield cls, [r for r in reqs if r.priority == cls]


def summarize(reqs: Iterable[Request], gain: GainConfig, duration: float | None = None) -> dict[str, ClassMetrics]:
    """Metrics overall (key ``"all"``) and per priority class.

    ``duration`` defaults to first arrival → last token.
    """
    reqs = list(reqs)
    if duration is None:
        duration = run_duration(reqs)
    return {name: class_metrics(name, g, gain, duration) for name, g in class_groups(reqs)}
