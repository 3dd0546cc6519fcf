#!/usr/bin/env python3
"""Prefix-aware GoRouting against the cache-aware routers users would pick instead, in the
simulator on the Mooncake synthetic trace (issue 14; docs/results.md §2.3).

Co-located SlideBatching instances with prefix caching (the simulator's default), 8
instances at 1-3.5 req/s and 32 at 4-14 req/s, all 3,993 requests, 3 seeds. Routers:
GoRouting (schedule-aware, with its prefix index; with ``fallback=most_room``; with
``choose=scorers``, llm-d's score among the instances GoRouting allows; with
``fallback=catch_up``, line 19 by the decode-token gain lost to lateness; and the paper's
estimate), Min-Load,
round-robin, and the three cache-aware baselines as their users tune them
(``scheduler/baselines/``: SGLang's cache_aware at its defaults, llm-d's scorers at their
published weights 3/2/2, Dynamo's KV router at ``overlap_weight=4``, the best of 0.5-4 in a
sweep at 1.5 and 2.5 req/s on 8 instances; see the doc; disaggregated, llm-d also without
its KV scorer, ``kv=0``, which is better there). A sweep whose JSON is already
under ``--out`` is kept unless ``--rerun``. Prints per rate the mean ± sd over seeds of
TDG_Ratio, first-token TDG_Ratio and the prefix-cache hit rate, then the difference of
GoRouting, GoRouting (choose=scorers) and GoRouting (fallback=catch_up) to every other router, paired by seed (mean ±
standard error, and in how many seeds it is ahead), and draws ``cache_routers.png``.

    python scripts/compare_cache_routers.py --out docs/results/routing_prefix     # ~25 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_routers import _plot

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
ROUTERS = (  # label, sweep arguments
    ("GoRouting", ["--global", "go_routing"]),
    ("GoRouting (paper's estimate)", ["--global", "go_routing", "--global-param", "order=deadline"]),
    ("GoRouting (fallback=most_room)", ["--global", "go_routing", "--global-param", "fallback=most_room"]),
    ("Min-Load", ["--global", "min_load"]),
    ("round-robin", ["--global", "round_robin"]),
    ("SGLang cache_aware", ["--global", "sglang_cache_aware"]),
    ("llm-d scorers", ["--global", "llmd_scorers"]),
    ("Dynamo KV (w=4)", ["--global", "dynamo_kv", "--global-param", "overlap_weight=4"]),
    # appended (issue 14): the directories are numbered by position, so new rows go last
    ("GoRouting (choose=scorers)", ["--global", "go_routing", "--global-param", "choose=scorers"]),
    # llm-d tuned for prefill-only instances (disaggregated): without its KV-utilisation scorer, whose
    # usage there is prefill in flight on its way to the decode side (docs/results.md §2.3)
    ("llm-d scorers (kv=0)", ["--global", "llmd_scorers", "--global-param", "kv=0"]),
    ("GoRouting (fallback=catch_up)", ["--global", "go_routing", "--global-param", "fallback=catch_up"]),
)
# the rows whose differences to every other row are printed
REFERENCES = ("GoRouting", "GoRouting (choose=scorers)", "GoRouting (fallback=catch_up)")
SETUPS = {  # name: sweep arguments, rates
    "colocated-8": (["--deployment", "colocated", "--instances", "8"], "1.0,1.5,2.0,2.5,3.5"),
    "colocated-32": (["--deployment", "colocated", "--instances", "32"], "4,6,8,10,14"),
    # prefill-only instances, the decode side picked by free KV blocks (Alg. 2 line 20): not in
    # the default set (--setups disaggregated-4p4d,disaggregated-16p16d)
    "disaggregated-4p4d": (["--deployment", "disaggregated", "--prefill-instances", "4", "--decode-instances", "4"],
                           "0.5,1.0,1.5,2.0,3.0"),
    "disaggregated-16p16d": (["--deployment", "disaggregated", "--prefill-instances", "16",
                              "--decode-instances", "16"], "2,4,6,8,12"),
}
DEFAULT_SETUPS = ("colocated-8", "colocated-32")
METRICS = (("tdg_ratio", "TDG_Ratio"), ("first_token_tdg_ratio", "first-token TDG_Ratio"), ("hit", "hit rate"))


def run(out: Path, trace: Path, seeds: str, jobs: int, rerun: bool, setups, routers) -> None:
    for name in setups:
        sargs, rates = SETUPS[name]
        for i, (label, rargs) in enumerate(ROUTERS):
            if i not in routers:
                continue
            d = out / f"{name}-{i}"
            if not rerun and (d / "sweep.json").exists():
                continue
            cmd = [sys.executable, "-m", "proserve.sim", "sweep", *sargs, "--trace", str(trace),
                   "--format", "mooncake", "--num-requests", "0", "--local", "slide_batching",
                   "--rates", rates, "--seeds", seeds, "--jobs", str(jobs), "--no-plot", *rargs, "--out", str(d)]
            print(f"# {name} {label}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _value(r: dict, key: str) -> float:
    if key == "hit":
        return r.get("prefix_cache", {}).get("hit_rate", 0.0)
    return r["metrics"]["all"][key]


def _paired(mine: list[dict], theirs: list[dict], key: str) -> str:
    """The difference of two routers' values at one rate, paired by seed: mean ± standard
    error (k/n: the seeds where the first is ahead); the bare mean when fewer than two seeds
    are shared."""
    a = {r["seed"]: _value(r, key) for r in mine}
    b = {r["seed"]: _value(r, key) for r in theirs}
    d = [a[s] - b[s] for s in sorted(a.keys() & b.keys())]
    if len(d) < 2:
        return f"{d[0]:+.4f}" if d else "-"
    se = statistics.stdev(d) / len(d) ** 0.5
    return f"{statistics.mean(d):+.4f}±{se:.4f}({sum(x > 0 for x in d)}/{len(d)})"


def report(out: Path, setups) -> None:
    panels = []
    for name in setups:
        rows: dict[str, dict[float, list[dict]]] = {}
        for i, (label, _) in enumerate(ROUTERS):
            f = out / f"{name}-{i}" / "sweep.json"
            if f.exists():
                for r in json.loads(f.read_text())["runs"]:
                    rows.setdefault(label, {}).setdefault(r["rate"], []).append(r)
        if not rows:
            continue
        rates = sorted(next(iter(rows.values())))
        for key, title in METRICS:
            print(f"\n### {name}: {title} (mean ± sd over seeds)")
            print("| router | " + " | ".join(f"{r:g} req/s" for r in rates) + " |")
            print("|---|" + "---|" * len(rates))
            mean = {}
            for lab, d in rows.items():
                vals = [[_value(x, key) for x in d.get(r, [])] for r in rates]
                mean[lab] = [statistics.mean(v) if v else float("nan") for v in vals]
                cells = [f"{statistics.mean(v):.4f} ± {statistics.stdev(v) if len(v) > 1 else 0.0:.4f}"
                         if v else "-" for v in vals]
                print(f"| {lab} | " + " | ".join(cells) + " |")
            for me in (m for m in REFERENCES if m in mean):
                for lab in mean:
                    if lab != me:
                        print(f"  {me} minus {lab}: " + " ".join(
                            _paired(rows[me].get(r, []), rows[lab].get(r, []), key) for r in rates))
            if key != "hit":
                panels.append((f"{name}", title, rates, mean))
    if panels:
        _plot(out / "cache_routers.png", panels)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/compare_cache_routers", help="directory for the sweeps' JSON and the plot")
    ap.add_argument("--trace", type=Path, default=TRACE, help="the Mooncake trace (default: %(default)s)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--setups", default=",".join(DEFAULT_SETUPS),
                    help="comma-separated, of: " + ", ".join(SETUPS) + " (default: %(default)s)")
    ap.add_argument("--report-only", action="store_true", help="only summarise sweeps already in --out")
    ap.add_argument("--rerun", action="store_true", help="run sweeps whose JSON is already in --out again")
    ap.add_argument("--routers", default=None,
                    help="comma-separated indices of the routers to run (default: all): "
                         + ", ".join(f"{i} {lab}" for i, (lab, _) in enumerate(ROUTERS)))
    args = ap.parse_args()
    try:
        routers = set(range(len(ROUTERS))) if args.routers is None else {int(x) for x in args.routers.split(",")}
    except ValueError:
        ap.error(f"--routers takes comma-separated indices, got {args.routers!r}")
    if not routers or not routers <= set(range(len(ROUTERS))):
        ap.error(f"--routers: indices 0-{len(ROUTERS) - 1}, got {args.routers!r}")
    setups = [s for s in args.setups.split(",") if s]
    bad = [s for s in setups if s not in SETUPS]
    if bad:
        ap.error(f"unknown setup(s) {', '.join(bad)}; choose from {', '.join(SETUPS)}")
    if not args.report_only and not args.trace.exists():
        ap.error(f"no trace at {args.trace} (pass --trace)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run(out, args.trace, args.seeds, args.jobs, args.rerun, setups, routers)
    report(out, setups)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
