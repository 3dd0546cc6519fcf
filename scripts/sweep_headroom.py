#!/usr/bin/env python3
"""SlideBatching's TPOT headroom and aging, swept in the simulator (issue 13).

For each ``headroom`` h (SlideBatching's latency budget ``max(min remain − h·η, (1 − h)·η)``)
and each rate, the bundled Azure trace on one co-located instance, several seeds: TDG_Ratio
and *strict* SLO attainment (TTFT and mean TPOT both below the SLOs, §5.1), overall and per
class, and the low class's TTFT P99 and worst wait. The same runs for the baselines named by
``--baselines`` give the figures to hold them against, measured in the same invocation.

The simulated hardware steps with log-normal noise (``--noise-cv``; default 0.1) around the
latency model, as a real engine does around its estimate; without noise every step lasts
exactly what the policy planned, and headroom has nothing to protect.

    python scripts/sweep_headroom.py --out docs/results/headroom        # ~5 min, 2 cores

Prints one table per metric (rows: series, columns: rates) and writes ``sweep.json``,
``table.txt`` and ``tradeoff.png`` (TDG_Ratio against SLO attainment, one line per rate,
one point per headroom) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from proserve.scheduler.config import default_classes
from proserve.sim.__main__ import RunSpec, run_spec
from proserve.sim.cluster import SimConfig
from proserve.sim.report import lookup

METRICS = (("tdg_ratio", "TDG_Ratio"), ("slo_attainment", "SLO attainment"),
           ("tdg_ratio@high", "TDG_Ratio high"), ("slo_attainment@high", "SLO attainment high"),
           ("slo_attainment@low", "SLO attainment low"), ("ttft_p99@low", "TTFT P99 low (s)"),
           ("tpot_p50", "TPOT P50 (s)"))


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _series(args) -> list[tuple[str, str, dict]]:
    """(label, local policy, its parameters) for every line of the comparison."""
    out = []
    for age in args.age_limits.split(","):
        for h in _floats(args.headrooms):
            params = {"headroom": h}
            label = f"slide h={h:g}"
            if age != "default":
                params["age_limit"] = None if age == "none" else float(age)
                label += f" age={age}"
            if args.age_share is not None and age != "none":
                params["age_share"] = args.age_share
                label += f"/{args.age_share:g}"
            out.append((label, "slide_batching", params))
    for b in [x for x in args.baselines.split(",") if x]:
        out.append((b, b, {}))
    return out


def _one(job):
    label, spec = job
    r = run_spec(spec)
    return label, spec.rate, spec.seed, r["metrics"], r["wall_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/sweep_headroom.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headrooms", default="0,0.05,0.1,0.15,0.2,0.3", help="SlideBatching headroom values h")
    p.add_argument("--age-limits", default="default",
                   help="comma-separated SlideBatching age_limit values (multiples of the TTFT SLO), each "
                        "run with every headroom: 'none' (no aging), 'default' (the policy's), or a number")
    p.add_argument("--age-share", type=float, default=None,
                   help="SlideBatching age_share for every aging series (default: the policy's)")
    p.add_argument("--baselines", default="sarathi_priority,sarathi_fcfs,vllm_fcfs,sjf",
                   help="other local policies run on the same workloads")
    p.add_argument("--rates", default="2,3,3.5,4,5,6")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--noise-cv", type=float, default=0.1, help="log-normal step-time noise of the simulated engine")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    classes = default_classes()
    jobs = []
    for label, local, params in _series(args):
        for rate in _floats(args.rates):
            for seed in (int(s) for s in _floats(args.seeds)):
                sim = SimConfig(local_policy=local, local_params=params, noise_cv=args.noise_cv, seed=seed)
                jobs.append((label, RunSpec(rate=rate, num_requests=args.num_requests, seed=seed,
                                            classes=classes, sim=replace(sim))))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max(1, args.jobs)) as ex:
        results = []
        for i, res in enumerate(ex.map(_one, jobs)):
            results.append(res)
            print(f"\r[{i + 1}/{len(jobs)}]", end="", file=sys.stderr, flush=True)
    print(f"\r{len(jobs)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    labels = list(dict.fromkeys(r[0] for r in results))
    rates = sorted({r[1] for r in results})
    table: dict[str, dict[str, dict[float, tuple[float, float]]]] = {}
    lines = [(f"# colocated, 1 instance, bundled Azure trace, {args.num_requests} requests, "
              f"seeds {args.seeds}, noise CV {args.noise_cv}; mean ± sd over seeds")]
    for key, title in METRICS:
        table[key] = {}
        lines.append(f"\n## {title}\n")
        lines.append("| series | " + " | ".join(f"{r:g} req/s" for r in rates) + " |")
        lines.append("|---|" + "---:|" * len(rates))
        for lab in labels:
            cells = []
            table[key][lab] = {}
            for rate in rates:
                vals = np.array([lookup(m, key) for la, ra, _, m, _ in results if la == lab and ra == rate])
                mu, sd = float(np.nanmean(vals)), float(np.nanstd(vals))
                table[key][lab][rate] = (mu, sd)
                cells.append(f"{mu:.3f} ± {sd:.3f}")
            lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "table.txt").write_text(text + "\n")
        (out / "sweep.json").write_text(json.dumps(
            {"args": vars(args), "runs": [{"series": la, "rate": ra, "seed": se, "metrics": m, "wall_s": w}
                                          for la, ra, se, m, w in results]}, default=str))
        _plot(table, labels, rates, out / "tradeoff.png")
        print(f"wrote {out}/table.txt, sweep.json, tradeoff.png")
    return 0


def _plot(table, labels, rates, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[plot]')", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    # one line per rate over the headrooms of the first age_limit series
    first_age = labels[0].split(" age=")[1:]
    slide = [lab for lab in labels if lab.startswith("slide") and lab.split(" age=")[1:] == first_age]
    for rate in rates:
        xs = [table["slo_attainment"][lab][rate][0] for lab in slide]
        ys = [table["tdg_ratio"][lab][rate][0] for lab in slide]
        line, = ax.plot(xs, ys, "o-", label=f"SlideBatching {rate:g} req/s")
        for lab, x, y in zip(slide, xs, ys):
            ax.annotate(lab.split("=")[1].split()[0], (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        for lab in labels:
            if lab in slide:
                continue
            ax.plot(table["slo_attainment"][lab][rate][0], table["tdg_ratio"][lab][rate][0], "x",
                    color=line.get_color())
    ax.set_xlabel("SLO attainment (strict)")
    ax.set_ylabel("TDG_Ratio")
    ax.set_title("SlideBatching headroom h (labels): TDG against SLO attainment\n"
                 "x: baselines at the same rate (colour)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
