"""SLOs-Serve's metrics (Chen et al.): per-request SLO attainment, attainment
rate, and serving capacity at a target attainment ("attainment at 90 %").

Per-request attainment. §3.2.1: "a request's SLO is attained if and only if
the SLO for every stage is satisfied". The stages' SLOs as the paper models
them (§3.2, Fig. 5): the prefill must be done by its deadline
``pDDL = arrival + TTFT_SLO`` and decoding must keep up with the line that
starts there with slope ``1/TPOT_SLO``, i.e. token ``k`` is out by
``arrival + TTFT_SLO + (k-1)·TPOT_SLO`` (``mode="line"``, the default; the
same deadlines as this project's TDG, Eq. 3). §6 measures the decode SLO as
a maximum TPOT "every 10 tokens" instead (``mode="window"``): the first token
within the TTFT SLO, and the mean inter-token time of every run of
``window`` tokens after it (the last run may be shorter) at most the TPOT SLO.
Both compare with ``≤`` (an SLO is a maximum). A request that failed or did not
finish is not attained. (:func:`proserve.scheduler.tdg.slo_attained` is the PROSERVE
paper's version: TTFT and the *mean* TPOT strictly below the SLOs.)

Serving capacity (§2.1, §6 "Metric"): "the maximum request load per GPU while
maintaining 90 % SLO attainment", i.e. the highest rate with less than 10 % SLO
violations; multi-GPU rates are divided by the number of GPUs.
:func:`capacity` reads it off a load sweep.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from ... import validate
from ...request import ConfigError, Request

MODES = ("line", "window")


def _check(mode: str, window: int) -> None:
    validate.one_of("slos_serve metric", "mode", mode, MODES)
    validate.integer("slos_serve metric", "window", window)


def request_attained(req: Request, mode: str = "line", window: int = 10) -> bool:
    """Whether ``req`` attained its SLOs (see the module docstring for ``mode``)."""
    _check(mode, window)
    return _attained(req, mode, window)


def _attained(req: Request, mode: str, window: int) -> bool:
    if req.error is not None or not req.finished or not req.token_times:
        return False
    t = req.token_times
    slack = 1e-9 * max(1.0, abs(req.arrival) + req.ttft_slo)   # float noise at exact equality
    if t[0] - req.arrival > req.ttft_slo + slack:
        return False
    if mode == "line":
        d0 = req.arrival + req.ttft_slo
        tp = req.tpot_slo
        return all(tk <= d0 + k * tp + slack for k, tk in enumerate(t))
    n = len(t)
    for start in range(0, n - 1, window):
        end = min(start + window, n - 1)
        if (t[end] - t[start]) / (end - start) > req.tpot_slo + slack:
            return False
    return True


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def attainment(reqs: Iterable[Request], mode: str = "line", window: int = 10) -> float:
    """Share of ``reqs`` that attained their SLOs (NaN for no requests)."""
    return attainment_by_class(reqs, mode, window)["all"]


def attainment_by_class(reqs: Iterable[Request], mode: str = "line", window: int = 10) -> dict[str, float]:
    """Attainment overall (key ``"all"``) and per priority class."""
    return _by_class(list(reqs), mode, window)[0]


def _by_class(reqs: list[Request], mode: str, window: int) -> tuple[dict[str, float], int]:
    """(attainment overall and per class, number attained), each request judged once."""
    if reqs:
        _check(mode, window)
    ok = [_attained(r, mode, window) for r in reqs]
    groups: dict[str, list[bool]] = {}
    for r, a in zip(reqs, ok):
        groups.setdefault(r.priority, []).append(a)
    out = {"all": _share(ok)}
    for cls in sorted(groups):
        out[cls] = _share(groups[cls])
    return out, sum(ok)


def capacity(points: Sequence[tuple[float, float]], target: float = 0.9, num_gpus: int = 1,
             interpolate: bool = True) -> float:
    """Serving capacity from ``(request rate, attainment)`` points of a load sweep.

    The highest rate whose attainment is at least ``target`` with every lower
    rate also at least ``target`` (a sweep that dips and recovers is cut at the
    first dip); with ``interpolate`` the rate where attainment crosses
    ``target`` between that point and the next (failing) one, linearly. Divided
    by ``num_gpus`` (§6: per-GPU load). 0.0 if even the lowest rate misses the
    target; the highest rate swept if none does (then a lower bound).
    """
    validate.number("slos_serve capacity", "target", target, 0, 1, lo_open=True)
    validate.integer("slos_serve capacity", "num_gpus", num_gpus)
    pts = sorted((float(r), float(a)) for r, a in points)
    if not pts:
        raise ConfigError("slos_serve capacity: no (rate, attainment) points")
    for r, a in pts:
        if not (math.isfinite(r) and r >= 0 and 0 <= a <= 1):
            raise ConfigError(f"slos_serve capacity: bad point (rate={r!r}, attainment={a!r})")
    best = 0.0
    for i, (r, a) in enumerate(pts):
        if a < target:
            if interpolate and i > 0:
                r0, a0 = pts[i - 1]
                best = r0 + (a0 - target) * (r - r0) / (a0 - a)
            break
        best = r
    return best / num_gpus


def summary(reqs: Iterable[Request], mode: str = "line", window: int = 10) -> dict:
    """The per-run numbers: attainment overall and per class, and the count attained."""
    reqs = list(reqs)
    by, attained = _by_class(reqs, mode, window)
    return {"mode": mode, "window": window if mode == "window" else None, "requests": len(reqs),
            "attained": attained, "attainment": by}
