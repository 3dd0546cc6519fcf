"""UniBoost's headline metric: P99 TTLT, overall and per priority class.

Li et al. ("Beyond Prediction: Tail-Aware Scheduling for LLM Inference") judge schedulers by tail
*Time-To-Last-Token* (§2.1: "tail completion time — TTLT at P95/P99 —
directly captures user-perceived responsiveness"); TTLT is the response time
of §3, ``T_i = C_i - a_i``: the time of a request's last token minus its
arrival. Table 2 reports it as "End-to-End Latency" mean / P95 / P99, so
:func:`ttlt_stats` returns those too (and P50).

Percentiles use the paper's own definition (§3.4, under Eq. 9):
``t_p = inf{t : F̄(t) ≤ (100-p)/100}``, the empirical survival function's
inverse — the ``⌈n·p/100⌉``-th smallest sample, no interpolation (numpy's
default interpolates, which reads P99 of 100 samples between the two largest).

Only completed requests have a TTLT: requests that failed (``error`` set) or
did not finish are left out of the percentiles and counted in ``unfinished``,
so that a policy cannot look better by not finishing its slowest requests
without that showing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ...request import Request
from ...tdg import class_groups
from .bins import empirical_quantile


def ttlt(req: Request) -> float | None:
    """``C_i - a_i``: last token time minus arrival; None if the request did not complete."""
    if not req.finished or req.error is not None or not req.token_times:
        return None
    return req.token_times[-1] - req.arrival


@dataclass(frozen=True)
class TTLTStats:
    requests: int        # requests of the group
    completed: int       # with a TTLT
    unfinished: int      # failed or not finished: no TTLT
    mean: float          # seconds; NaN without completed requests
    p50: float
    p95: float
    p99: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _stats(reqs: Sequence[Request]) -> TTLTStats:
    xs = sorted(t for t in (ttlt(r) for r in reqs) if t is not None)
    n = len(xs)
    nan = float("nan")
    return TTLTStats(
        requests=len(reqs), completed=n, unfinished=len(reqs) - n,
        mean=sum(xs) / n if n else nan,
        p50=empirical_quantile(xs, 50), p95=empirical_quantile(xs, 95), p99=empirical_quantile(xs, 99))


def ttlt_stats(reqs: Iterable[Request]) -> dict[str, TTLTStats]:
    """TTLT mean/P50/P95/P99 overall (key ``"all"``) and per priority class."""
    return {name: _stats(g) for name, g in class_groups(list(reqs))}


def p99_ttlt(reqs: Iterable[Request]) -> dict[str, float]:
    """The headline: P99 TTLT in seconds, overall (``"all"``) and per class."""
    return {name: s.p99 for name, s in ttlt_stats(reqs).items()}
