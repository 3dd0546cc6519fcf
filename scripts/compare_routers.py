#!/usr/bin/env python3
"""GoRouting with its schedule-aware estimate against the paper's estimate, Min-Load and
round-robin, in the simulator (issue 14; docs/results.md §2.1); also GoRouting with
``choose=scorers`` (llm-d's score among the instances lines 2-11 allow, §2.3) and with
``fallback=catch_up`` (line 19 by the decode-token gain lost to lateness, §2.3).

For each local policy (SlideBatching, Sarathi-FCFS) and deployment (disaggregated 4
prefill + 8 decode instances, rates 30-50 req/s; co-located 8 instances, rates 20-35
req/s), the first 3,000 requests of the bundled Azure conversation trace, 3 seeds each:
runs ``python -m proserve.sim sweep`` for every router (a sweep whose JSON is already
under ``--out`` is kept unless ``--rerun``), and prints per rate the mean ± sd over seeds of the headline metric
(first-token TDG_Ratio disaggregated, as §2; TDG_Ratio co-located) with SLO attainment,
then the schedule-aware GoRouting's difference to every other router, and draws
``routers.png``.

    python scripts/compare_routers.py --out docs/results/routing_schedule     # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROUTERS = (  # label, sweep arguments, local policies it runs with
    ("GoRouting (schedule-aware)", ["--global", "go_routing"], None),
    ("GoRouting (paper's estimate)", ["--global", "go_routing", "--global-param", "order=deadline"], None),
    ("Min-Load", ["--global", "min_load"], None),
    ("round-robin", ["--global", "round_robin"], None),
    # Sarathi-FCFS keeps the paper's estimate by default; the arrival order it serves in, forced:
    ("GoRouting (order=fcfs)", ["--global", "go_routing", "--global-param", "order=fcfs"], ("sarathi_fcfs",)),
    ("GoRouting (fallback=min_load)", ["--global", "go_routing", "--global-param", "fallback=min_load"], None),
    # appended (the directories are numbered by position): llm-d's score among the instances
    # lines 2-11 allow (docs/results.md §2.3)
    ("GoRouting (choose=scorers)", ["--global", "go_routing", "--global-param", "choose=scorers"], None),
    # line 19 by the decode tokens lost to lateness, in TDG's currency (docs/results.md §2.3)
    ("GoRouting (fallback=catch_up)", ["--global", "go_routing", "--global-param", "fallback=catch_up"], None),
)
DEPLOYMENTS = {
    "disaggregated": (["--deployment", "disaggregated", "--prefill-instances", "4", "--decode-instances", "8"],
                      "30,35,40,45,50", "first_token_tdg_ratio"),
    "colocated": (["--deployment", "colocated", "--instances", "8"], "20,26,29,32,35", "tdg_ratio"),
}
LOCALS = ("slide_batching", "sarathi_fcfs")


def run(out: Path, seeds: str, num: int, jobs: int, rerun: bool) -> None:
    for dep, (dargs, rates, _) in DEPLOYMENTS.items():
        for local in LOCALS:
            for i, (label, rargs, only) in enumerate(ROUTERS):
                d = out / f"{dep}-{local}-{i}"
                if (only and local not in only) or (not rerun and (d / "sweep.json").exists()):
                    continue
                cmd = [sys.executable, "-m", "proserve.sim", "sweep", *dargs, "--num-requests", str(num),
                       "--local", local, "--rates", rates, "--seeds", seeds, "--jobs", str(jobs), "--no-plot",
                       *rargs, "--out", str(d)]
                print(f"# {dep} {local} {label}: {' '.join(cmd[1:])}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def report(out: Path) -> None:
    panels = []
    for dep, (_, _, metric) in DEPLOYMENTS.items():
        for local in LOCALS:
            rows: dict[str, dict[float, list[tuple[float, float]]]] = {}
            for i, (label, _, _) in enumerate(ROUTERS):
                f = out / f"{dep}-{local}-{i}" / "sweep.json"
                if not f.exists():
                    continue
                for r in json.loads(f.read_text())["runs"]:
                    m = r["metrics"]["all"]
                    rows.setdefault(label, {}).setdefault(r["rate"], []).append((m[metric], m["slo_attainment"]))
            if not rows:
                continue
            rates = sorted(next(iter(rows.values())))
            print(f"\n### {dep}, {local}: {metric} (mean ± sd over seeds; SLO attainment)")
            print("| router | " + " | ".join(f"{r:g} req/s" for r in rates) + " |")
            print("|---|" + "---|" * len(rates))
            mean = {lab: [statistics.mean(x[0] for x in d[r]) for r in rates] for lab, d in rows.items()}
            for lab, d in rows.items():
                cells = [f"{statistics.mean(v[0] for v in d[r]):.4f} ± "
                         f"{statistics.stdev([v[0] for v in d[r]]) if len(d[r]) > 1 else 0.0:.4f} "
                         f"({statistics.mean(v[1] for v in d[r]):.3f})" for r in rates]
                print(f"| {lab} | " + " | ".join(cells) + " |")
            me = ROUTERS[0][0]
            for lab, ys in mean.items():
                if lab != me and me in mean:
                    print(f"  {me} minus {lab}: " + " ".join(f"{a - b:+.4f}" for a, b in zip(mean[me], ys)))
            panels.append((f"{dep}, {local}", metric, rates, mean))
    _plot(out / "routers.png", panels)


def _plot(path: Path, panels) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, metric, rates, mean) in zip(axes[0], panels):
        for lab, ys in mean.items():
            ax.plot(rates, ys, marker="o", label=lab)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/compare_routers", help="directory for the sweeps' JSON and the plot")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--num-requests", type=int, default=3000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report-only", action="store_true", help="only summarise sweeps already in --out")
    ap.add_argument("--rerun", action="store_true", help="run sweeps whose JSON is already in --out again")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run(out, args.seeds, args.num_requests, args.jobs, args.rerun)
    report(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
