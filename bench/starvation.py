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
token is over the bound too (it waited, and the client gave up or the run ended),
unless it was answered with an error status (a refusal, a failure: counted apart).

``--strict`` reads the premise more narrowly: only the load up to a request's own
arrival may excuse it, so a burst that arrives while it waits does not. A scheduler
that lets later arrivals go first is then held to its bound through their burst;
for FCFS, which never does, later arrivals change nothing. docs/results.md §4.5 reports both readings.

``python -m proserve.bench.starvation RUN_DIR... --capacity 6.5`` walks the run
directories for ``requests.jsonl`` files (``bench.engine_policies`` and
``scripts/bench_product_path.py`` write one per run and load) and prints, per
configuration and load (the path's parts), the requests clear of overload, the
largest first-token wait among them per class, and the bound's violations.
Exit status 1 if any request clear of overload missed the bound, 2 if a file or
record cannot be read (named in the message).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
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
    violations: list[str] = field(default_factory=list)   # clear, first token after the bound (or none)
    refused: list[str] = field(default_factory=list)      # clear, answered with an error, no token
    max_ttft_all: float = 0.0         # largest first-token wait of the class (s), for reference


class RecordError(ValueError):
    """A request record the check cannot read."""


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


def _seconds(r: Mapping, key: str, optional: bool = False, positive: bool = False) -> float | None:
    v = r.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < 0 or (positive and v == 0):
        raise RecordError(f"request {r.get('id')!r}: {key} must be a finite number "
                          f"{'> 0' if positive else '>= 0'}{' or null' if optional else ''}, got {v!r}")
    return float(v)


def check_run(records: Iterable[Mapping], capacity: float, age_limit: float = 8.0,
              window: float = 3.0, strict: bool = False) -> dict[str, ClassCheck]:
    """Per class, the starvation check of one run's request records (``arrival``,
    ``ttft`` or None, ``priority``, ``ttft_slo``, ``id``, ``status``; seconds from the
    run's start). ``strict``: only the load up to a request's own arrival can excuse it
    (a burst arriving while it waits does not). RecordError for a record it cannot read."""
    if not capacity > 0 or not window > 0 or not age_limit > 0:
        raise ValueError("capacity, window and age_limit must be positive")
    recs = list(records)
    for r in recs:
        if not isinstance(r, Mapping):
            raise RecordError(f"a record is a JSON {type(r).__name__}, not an object")
        if not isinstance(r.get("priority"), str):
            raise RecordError(f"request {r.get('id')!r}: priority must be a string, got {r.get('priority')!r}")
    arrivals = sorted(_seconds(r, "arrival") for r in recs)
    out: dict[str, ClassCheck] = {}
    for r in recs:
        c = out.setdefault(r["priority"], ClassCheck())
        c.n += 1
        ttft = _seconds(r, "ttft", optional=True)
        if ttft is not None:
            c.max_ttft_all = max(c.max_ttft_all, ttft)
        a, bound = _seconds(r, "arrival"), age_limit * _seconds(r, "ttft_slo", positive=True)
        if peak_load(arrivals, a, a if strict else a + bound, window) >= capacity:
            continue
        c.clear += 1
        rid = str(r.get("id"))
        if ttft is None:
            # answered with an error (a refusal, a failure): not a wait; else it never got a
            # token (the client gave up, the run ended): the worst wait of all
            (c.refused if r.get("status") not in (None, 200) else c.violations).append(rid)
            continue
        c.max_ttft_clear = max(c.max_ttft_clear, ttft)
        if ttft > bound:
            c.violations.append(rid)
    return out


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """Every ``requests.jsonl`` under the given directories (or the files themselves),
    each once, as absolute paths."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p.resolve())
        elif p.is_dir():
            found.extend(f.resolve() for f in sorted(p.rglob("requests.jsonl")))
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return list(dict.fromkeys(found))


def read_records(path: Path) -> list[dict]:
    """The records of one ``requests.jsonl``; RecordError naming the file and line."""
    out = []
    with path.open() as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise RecordError(f"{path}:{k}: not JSON ({e})") from None
    if not out:
        raise RecordError(f"{path}: no records")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m proserve.bench.starvation",
        description="Check the starvation bound below saturation: every request whose "
                    "arrivals-based offered load stays below CAPACITY from its arrival until "
                    "AGE_LIMIT x its TTFT SLO must get its first token within that bound. "
                    "Reads the requests.jsonl files of engine_policies / bench_product_path "
                    "runs. Exit 1 if a request clear of overload missed the bound (or never "
                    "got a token), 2 if a file cannot be read.")
    ap.add_argument("runs", nargs="+", help="run directories (searched for requests.jsonl) or files")
    ap.add_argument("--capacity", type=float, required=True,
                    help="saturation throughput, req/s (the benchmark's --capacity)")
    ap.add_argument("--age-limit", type=float, default=8.0,
                    help="the bound in TTFT SLOs (SlideBatching's age_limit; default 8)")
    ap.add_argument("--window", type=float, default=3.0,
                    help="seconds of arrivals the offered load is counted over (default 3)")
    ap.add_argument("--strict", action="store_true",
                    help="only the load up to a request's own arrival excuses it: a burst that "
                         "arrives while it waits does not (default: any overload before its bound)")
    ap.add_argument("--per-run", action="store_true",
                    help="one row per run (default: the runs of a configuration and load pooled)")
    args = ap.parse_args(argv)
    try:
        files = find_runs(args.runs)
        if not files:
            raise RecordError("no requests.jsonl found")
        # each run named by its path below the parent of the runs' common directory
        # (configuration/run/load); without --per-run the runs of one configuration and
        # load (paths equal but for runN) pool
        base = Path(os.path.commonpath([f.parent for f in files])).parent
        groups: dict[str, list[dict[str, ClassCheck]]] = {}
        for f in files:
            records = read_records(f)                       # its errors name the file
            try:
                checks = check_run(records, args.capacity, args.age_limit, args.window, args.strict)
            except RecordError as e:
                raise RecordError(f"{f}: {e}") from None
            parts = f.parent.relative_to(base).parts
            if not args.per_run:
                parts = tuple(x for x in parts if not RUN_DIR.fullmatch(x))
            groups.setdefault("/".join(parts), []).append(checks)
    except (RecordError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# bound: first token within {args.age_limit:g} x TTFT SLO for every request whose "
          f"offered load ({args.window:g} s windows) stays below {args.capacity:g} req/s "
          + ("up to its arrival" if args.strict else "until then"))
    print(f"{'runs':>4s} {'class':5s} {'n':>5s} {'clear':>5s} {'max TTFT clear':>14s} "
          f"{'max TTFT all':>12s} {'over bound':>10s} {'refused':>7s}  configuration/load")
    bad = 0
    for name, checks in groups.items():
        for cls in sorted({c for chk in checks for c in chk}):
            cs = [chk[cls] for chk in checks if cls in chk]
            over = [v for c in cs for v in c.violations]
            refused = [v for c in cs for v in c.refused]
            bad += len(over)
            print(f"{len(cs):4d} {cls:5s} {sum(c.n for c in cs):5d} {sum(c.clear for c in cs):5d} "
                  f"{max(c.max_ttft_clear for c in cs):14.2f} {max(c.max_ttft_all for c in cs):12.2f} "
                  f"{len(over):10d} {len(refused):7d}  {name}"
                  + (f"  over: {' '.join(over[:5])}" if over else "")
                  + (f"  refused: {' '.join(refused[:5])}" if refused else ""))
    print(f"# {len(files)} runs; requests clear of overload over the bound: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
