"""Is the starvation bound met below saturation? (issue 13)

SlideBatching's aging rule (``scheduler/local/slide_batching.py``, ``age_limit = k``)
promises a bound on a request's wait for its first token *while the system is not
past saturation*: a request that has waited ``k·TTFT_SLO`` runs before the sliding
order. Past saturation no scheduler can bound the wait (the queue grows for as
long as the overload lasts) and the dispatcher's admission control is the remedy.
A run's average load says little about that: the engine benchmarks replay a real
trace whose arrivals come in bursts (at "0.7× capacity" the last 9 s of the Azure
excerpt arrive at about 1.1× capacity), so the requests waiting during a burst
meet an overload whatever the average.

This module checks the bound request by request. The offered load at time ``t``
is the number of arrivals in ``(t − W, t]`` divided by ``W`` (the window), in
requests per second, against the capacity the benchmark's load levels are
multiples of (``--capacity``: stock FCFS's saturation throughput on the same
workload). A request is **clear of overload** when the offered load stays below
the capacity from its arrival until its bound has passed (``[a, a + B]``; the
window reaches back ``W`` before ``a``, so a burst just before it counts too).
Whether a request is clear depends on the arrivals alone, not on how long it
waited, so a scheduler that starves a request in a quiet period is caught. For
every request clear of overload the bound must hold: a first token within
``B = k·TTFT_SLO`` of arrival (``k`` = ``--age-limit``, SlideBatching's default 8;
the rule's own guarantee adds the prefill of the aged requests ahead at share ρ,
so this bound is the stricter one). A request clear of overload that got no first
token at all (an error, a refusal) is counted apart.

``python -m proserve.bench.starvation RUN_DIR... --capacity 6.5`` walks the run
directories for ``requests.jsonl`` files (``bench.engine_policies`` and
``scripts/bench_product_path.py`` write one per run and load) and prints, per
configuration and load (the path's parts), the requests clear of overload, the
largest first-token wait among them per class, and the bound's violations.
Exit status 1 if any request clear of overload missed the bound.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RUN_DIR = re.compile(r"run\d+")


@dataclass
class ClassCheck:
    """The check of one priority class in one run."""

    n: int = 0                        # requests of the class
    clear: int = 0                    # of them, clear of overload until their bound
    max_ttft_clear: float = 0.0       # largest first-token wait among those (s)
    violations: list[str] = field(default_factory=list)   # clear, first token after the bound
    no_token: list[str] = field(default_factory=list)     # clear, no first token at all
    max_ttft_all: float = 0.0         # largest first-token wait of the class (s), for reference


def peak_load(arrivals: Sequence[float], start: float, end: float, window: float) -> float:
    """The highest offered load (arrivals in ``(t − window, t]`` per second) over
    ``t ∈ [start, end]``; ``arrivals`` sorted. Exact: the count only rises at an
    arrival, so its maximum is at ``start`` or at an arrival inside ``(start, end]``."""
    def count(t: float) -> int:
        return bisect.bisect_right(arrivals, t) - bisect.bisect_right(arrivals, t - window)
    best = count(start)
    lo, hi = bisect.bisect_right(arrivals, start), bisect.bisect_right(arrivals, end)
    for a in arrivals[lo:hi]:
        best = max(best, count(a))
    return best / window


def check_run(records: Iterable[Mapping], capacity: float, age_limit: float = 8.0,
              window: float = 3.0) -> dict[str, ClassCheck]:
    """Per class, the starvation check of one run's request records (``arrival``,
    ``ttft`` or None, ``priority``, ``ttft_slo``, ``id``; seconds from the run's start)."""
    if not capacity > 0 or not window > 0 or not age_limit > 0:
        raise ValueError("capacity, window and age_limit must be positive")
    recs = list(records)
    arrivals = sorted(float(r["arrival"]) for r in recs)
    out: dict[str, ClassCheck] = {}
    for r in recs:
        c = out.setdefault(str(r["priority"]), ClassCheck())
        c.n += 1
        ttft = r.get("ttft")
        if ttft is not None:
            c.max_ttft_all = max(c.max_ttft_all, float(ttft))
        a, bound = float(r["arrival"]), age_limit * float(r["ttft_slo"])
        if peak_load(arrivals, a, a + bound, window) >= capacity:
            continue
        c.clear += 1
        if ttft is None:
            c.no_token.append(str(r.get("id")))
            continue
        c.max_ttft_clear = max(c.max_ttft_clear, float(ttft))
        if ttft > bound:
            c.violations.append(str(r.get("id")))
    return out


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Every ``requests.jsonl`` under the given directories (or the files themselves)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(p.rglob("requests.jsonl")))
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return found


def read_records(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m proserve.bench.starvation",
        description="Check the starvation bound below saturation: every request whose "
                    "arrivals-based offered load stays below CAPACITY from its arrival until "
                    "AGE_LIMIT x its TTFT SLO must get its first token within that bound. "
                    "Reads the requests.jsonl files of engine_policies / bench_product_path "
                    "runs. Exit 1 if a request clear of overload missed the bound.")
    ap.add_argument("runs", nargs="+", help="run directories (searched for requests.jsonl) or files")
    ap.add_argument("--capacity", type=float, required=True,
                    help="saturation throughput, req/s (the benchmark's --capacity)")
    ap.add_argument("--age-limit", type=float, default=8.0,
                    help="the bound in TTFT SLOs (SlideBatching's age_limit; default 8)")
    ap.add_argument("--window", type=float, default=3.0,
                    help="seconds of arrivals the offered load is counted over (default 3)")
    ap.add_argument("--per-run", action="store_true",
                    help="one row per run (default: the runs of a configuration and load pooled)")
    args = ap.parse_args(argv)
    files = find_runs(args.runs)
    if not files:
        print("no requests.jsonl found", file=sys.stderr)
        return 2
    # name each run by its path below the runs' common directory (configuration/run/load);
    # without --per-run the runs of one configuration and load (paths equal but for runN) pool
    common = Path(os.path.commonpath([f.parent for f in files]))
    if len(files) == 1:
        common = common.parent
    groups: dict[str, list[dict[str, ClassCheck]]] = {}
    for f in files:
        parts = f.parent.relative_to(common).parts
        if not args.per_run:
            parts = tuple(x for x in parts if not RUN_DIR.fullmatch(x))
        groups.setdefault("/".join(parts), []).append(
            check_run(read_records(f), args.capacity, args.age_limit, args.window))
    print(f"# bound: first token within {args.age_limit:g} x TTFT SLO for every request whose "
          f"offered load ({args.window:g} s windows) stays below {args.capacity:g} req/s until then")
    print(f"{'runs':>4s} {'class':5s} {'n':>5s} {'clear':>5s} {'max TTFT clear':>14s} "
          f"{'max TTFT all':>12s} {'over bound':>10s} {'no token':>8s}  configuration/load")
    bad = 0
    for name, checks in groups.items():
        for cls in sorted({c for chk in checks for c in chk}):
            cs = [chk[cls] for chk in checks if cls in chk]
            over = [v for c in cs for v in c.violations]
            bad += len(over)
            print(f"{len(cs):4d} {cls:5s} {sum(c.n for c in cs):5d} {sum(c.clear for c in cs):5d} "
                  f"{max(c.max_ttft_clear for c in cs):14.2f} {max(c.max_ttft_all for c in cs):12.2f} "
                  f"{len(over):10d} {sum(len(c.no_token) for c in cs):8d}  {name}"
                  + (f"  over: {' '.join(over[:5])}" if over else ""))
    print(f"# {len(files)} runs; requests clear of overload over the bound: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
