"""Scoring: how each request ended (:class:`Result`), results as
:class:`proserve.scheduler.request.Request` objects for :func:`proserve.scheduler.tdg.summarize`
(:func:`to_request`), error counts, the run's summary (:func:`summarize_run`) and
the per-request records of ``requests.jsonl`` (:func:`result_records`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

from proserve.scheduler.request import Phase, Request
from proserve.scheduler.tdg import GainConfig, slo_attained, summarize

#: an event-loop stall longer than this is recorded: the client itself was late, so
#: send times and token timestamps around it are the client's, not the server's
STALL_S = 0.05


# --- results ---------------------------------------------------------------------------

@dataclass
class Result:
    """How one request ended. Times are seconds on the run clock (0 = run start)."""

    id: str
    priority: str
    arrival: float                      # scheduled send time
    expected_tokens: int
    sent: float | None = None           # actual send time
    token_times: list[float] = field(default_factory=list)
    status: int | None = None           # HTTP status (None: no response)
    responded: float | None = None      # when the status line arrived (a 429's latency: responded - sent)
    error: str | None = None
    finish_reason: str | None = None
    usage_tokens: int | None = None
    malformed: int = 0                  # SSE data payloads (or an unstreamed body) that could not be read
    done: bool = False                  # saw [DONE] (unstreamed: read the whole response)
    stream: bool = True                 # sent with "stream": true

    @property
    def ok(self) -> bool:
        return self.error is None

    def finish(self) -> "Result":
        """Decide whether the stream delivered what was asked; set ``error`` if not."""
        if self.error is not None:
            return self
        n = len(self.token_times)
        if self.status != 200:
            self.error = f"HTTP {self.status}"
        elif self.usage_tokens is not None and self.usage_tokens != n:
            self.error = f"usage reports {self.usage_tokens} tokens, the stream carried {n}"
        elif n != self.expected_tokens:
            self.error = f"got {n} of {self.expected_tokens} tokens (finish_reason={self.finish_reason})"
        elif not self.done:
            self.error = "stream ended without [DONE]"
        return self


def to_request(req: Request, res: Result) -> Request:
    """The workload request with the measured token times, for :func:`proserve.scheduler.tdg.summarize`.

    Arrival is the scheduled send time on the run clock. A request that ended
    in an error keeps the tokens it got but is not finished (it fails its SLO
    and stays out of the TPOT percentiles).
    """
    if res.id != req.id:
        raise ValueError(f"result {res.id} does not belong to request {req.id}")
    if res.error is None:
        phase = Phase.DONE
    else:
        phase = Phase.DECODING if res.token_times else Phase.WAITING
    return Request(id=req.id, priority=req.priority, weight=req.weight, ttft_slo=req.ttft_slo,
                   tpot_slo=req.tpot_slo, arrival=res.arrival, prompt_len=req.prompt_len,
                   output_len=req.output_len, phase=phase, token_times=list(res.token_times),
                   error=res.error)


def error_counts(results: Iterable[Result]) -> dict[str, dict]:
    """Per class (and ``all``): requests, errors, and errors by message."""
    out: dict[str, dict] = {}
    for r in results:
        for key in ("all", r.priority):
            c = out.setdefault(key, {"requests": 0, "errors": 0, "by_error": {}})
            c["requests"] += 1
            if r.error is not None:
                c["errors"] += 1
                kind = r.error if len(r.error) <= 120 else r.error[:117] + "..."
                c["by_error"][kind] = c["by_error"].get(kind, 0) + 1
    return out


def summarize_run(reqs: Sequence[Request], results: Sequence[Result], gain: GainConfig,
                  stalls: Sequence[float] = ()) -> dict:
    """Metrics per class (``summarize``), error counts, send lag, malformed chunks and the
    client's own event-loop stalls (``Run.stalls``)."""
    by_id = {r.id: r for r in results}
    missing = [q.id for q in reqs if q.id not in by_id]
    if missing:
        raise ValueError(f"{len(missing)} requests have no result (first: {missing[0]})")
    converted = [to_request(q, by_id[q.id]) for q in reqs]
    metrics = {k: v.as_dict() for k, v in summarize(converted, gain).items()}
    errs = error_counts(by_id[q.id] for q in reqs)
    unstreamed: dict[str, int] = {}
    for q in reqs:
        if not by_id[q.id].stream:
            for key in ("all", q.priority):
                unstreamed[key] = unstreamed.get(key, 0) + 1
    for k, m in metrics.items():
        m["errors"] = errs.get(k, {}).get("errors", 0)
        m["unstreamed"] = unstreamed.get(k, 0)
    lags = [r.sent - r.arrival for r in results if r.sent is not None]
    return {
        "metrics": metrics, "errors": errs,
        "gain": {"w_p": gain.w_p, "w_d": gain.w_d, "deadline": gain.deadline},
        "send_lag_s": {"p50": _pct(lags, 50), "p99": _pct(lags, 99), "max": max(lags) if lags else None},
        "malformed_chunks": sum(r.malformed for r in results),
        "client_stalls": {"count": len(stalls), "max_s": max(stalls) if stalls else 0.0,
                          "over_s": STALL_S},
    }


def _pct(v: list[float], q: float) -> float | None:
    return float(np.percentile(v, q)) if v else None


def result_records(reqs: Sequence[Request], results: Sequence[Result], gain: GainConfig) -> list[dict]:
    """One JSON-able dict per request (what ``requests.jsonl`` holds)."""
    by_id = {r.id: r for r in results}
    out = []
    for q in reqs:
        res = by_id[q.id]
        r = to_request(q, res)
        rec = {"id": q.id, "priority": q.priority, "weight": q.weight, "ttft_slo": q.ttft_slo,
               "tpot_slo": q.tpot_slo, "prompt_len": q.prompt_len, "output_len": q.output_len}
        rec.update({k: v for k, v in asdict(res).items() if k not in ("id", "priority")})
        rec.update({"tokens": r.num_emitted, "ttft": r.ttft, "tpot": r.tpot, "tdg": gain.tdg(r),
                    "ideal_gain": gain.ideal_gain(r), "slo_met": slo_attained(r)})
        out.append(rec)
    return out
