"""JITServe's service goodput (Zhang, Wu et al., NSDI 2026, §3 "Design Space", §6.2;
Wu's 2025 MS thesis ch. 3).

JITServe maximises *service goodput*, "the number of tokens that meet request
SLOs". The requests of this system carry a TTFT and a TPOT SLO, i.e. they are
JITServe's **latency-sensitive** requests, whose goodput is defined as:

    "measured as the number of tokens delivered within the expected timeline.
     Specifically, token i counts toward goodput if it finishes by
     TTFT_SLO + i × TBT_SLO."

Read with ``i`` counted from 0 at the first token (the first token is due at
the TTFT SLO — with ``i`` from 1 it would be due at TTFT + TBT, which is not a
TTFT SLO), times measured from arrival, TBT = this system's TPOT:

    token i (1-based) counts  iff  t_{r,i} − arrival ≤ TTFT_SLO + (i−1)·TPOT_SLO

This is PROSERVE's token deadline (Eq. 3, ``deadline="fixed"``) with every
token worth 1 and "finishes by" read as ≤ (TDG counts strictly before the
deadline; the two differ only on exact ties). Unlike TDG it ignores the
priority weights and the first-token weight ``w_p``.

Reported, overall (``"all"``) and per priority class:

* ``goodput_tokens``: tokens that met their deadline; ``output_tokens``: the
  tokens the requests were to produce (``max(output_len, emitted)``; a post-run
  metric may read ``output_len``); ``token_goodput_ratio`` their quotient;
  ``token_goodput_per_s``: goodput tokens per second of ``duration`` — the
  paper's "service goodput" plots (Fig. 11, 13, 15) are this rate;
* request-level goodput (§6.2, Fig. 12: "the number of requests that meet
  their SLOs"): a request counts iff it finished without error and every one of
  its tokens met its deadline (for a latency-sensitive request that is meeting
  its SLO); ``request_goodput``, ``request_goodput_ratio``,
  ``request_goodput_per_s``.

``duration`` defaults, as in :func:`proserve.scheduler.tdg.summarize`, to first arrival
→ last emitted token.

Not applicable here: the deadline-sensitive and compound goodputs (all input +
output tokens of a request that completes by its end-to-end deadline), since
requests in this system carry no end-to-end deadline.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ...request import Request
from ...tdg import class_groups, run_duration


def on_time_tokens(r: Request) -> int:
    """Tokens of ``r`` emitted by TTFT_SLO + (i−1)·TPOT_SLO after arrival (i = 1, 2, …)."""
    base = r.arrival + r.ttft_slo
    tpot = r.tpot_slo
    return sum(1 for i, t in enumerate(r.token_times) if t <= base + i * tpot)


def _block(reqs: Sequence[Request], duration: float) -> dict:
    good = 0
    total = 0
    met = 0
    for r in reqs:
        g = on_time_tokens(r)
        n = r.num_emitted
        good += g
        total += max(r.output_len, n)
        if r.error is None and r.finished and n >= 1 and g == n:
            met += 1
    nan = float("nan")
    return {
        "requests": len(reqs),
        "output_tokens": total,
        "goodput_tokens": good,
        "token_goodput_ratio": good / total if total else nan,
        "token_goodput_per_s": good / duration if duration > 0 else nan,
        "request_goodput": met,
        "request_goodput_ratio": met / len(reqs) if reqs else nan,
        "request_goodput_per_s": met / duration if duration > 0 else nan,
    }


def token_goodput(requests: Iterable[Request], duration: float | None = None) -> dict[str, dict]:
    """JITServe's token and request goodput, overall (``"all"``) and per priority class."""
    reqs = list(requests)
    if duration is None:
        duration = run_duration(reqs)
    return {name: _block(g, duration) for name, g in class_groups(reqs)}
