#!/usr/bin/env python3
"""GoRouting behind several dispatchers, in the simulator (issue 15).

N dispatchers share one pool of instances, a load balancer spreading the arrivals over
them round-robin. Each routes with its own GoRouting object and its own view of the
instances (``SimConfig.dispatchers`` / ``dispatcher_sync``, sim/cluster.py):

* ``blind``: a dispatcher sees only its own dispatches (N dispatchers as they were
  before issue 15: each its own PrefillQueueMap);
* ``publish``: every ``--publish-interval`` s each instance publishes its queued prefill
  work (and, co-located, its decodes); a dispatcher's view of it is the last publication
  plus its own dispatches since (``RouterHost.published``);
* ``shared``: one map for all, every dispatch seen at once (the upper bound; it differs
  from one dispatcher only by each dispatcher's own random fallback).

Configuration: 32 co-located instances (default; ``--deployment disaggregated`` runs
16 prefill + 16 decode), SlideBatching on the instances, GoRouting, the first 3,000
requests of the bundled Azure conversation trace, seeds 0, 1, 2, at rates around the
pool's capacity (co-located 32: about 230 req/s, the highest rate with SLO attainment
>= 0.9 in a quick sweep at 130-400 req/s; 16P+16D: about 155 req/s by the same rule; the
default rates are 0.7x, 0.9x, 1.0x and 1.1x of it). Runs ``python -m proserve.sim sweep`` once per (dispatchers, mode), keeps a
sweep whose JSON is already under ``--out`` unless ``--rerun``, and prints per
(dispatchers, mode, rate) the mean ± sd over seeds of TDG_Ratio and first-token TDG_Ratio
and their difference to one dispatcher (mean ± sd of the per-seed differences), then
whether every "publish" row stays within ``--tolerance`` (0.01) of one dispatcher.
Deterministic per seed (the sweep's runs are).

    python scripts/bench_dispatchers.py --out docs/results/dispatchers      # 84 runs, ~6 min on 2 cores
    python scripts/bench_dispatchers.py --rates 230 --seeds 0 --out /tmp/d  # one rate, one seed: ~40 s

(5.6 min measured on 2 cores, 2026-11-27; 10 min while other simulator sweeps shared them.)
``--deployment disaggregated`` (16P+16D) is the same size. Why co-located is the default:
a co-located instance's whole load (queued prefill and its decodes, n_d·b_d) is in
GoRouting's view, and the pool saturates as a whole; 16P+16D saturates on its decode
side first (TDG_Ratio < 0.99 from ~130 req/s while first-token TDG stays 1.000 to 140),
where routing reads live free KV blocks that every dispatcher sees alike, so at rates
around its capacity the prefill queues GoRouting reads are short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

DEPLOYMENTS = {
    "colocated": (["--deployment", "colocated", "--instances", "32"], "160,205,230,255"),
    "disaggregated": (["--deployment", "disaggregated", "--prefill-instances", "16", "--decode-instances", "16"],
                      "110,140,155,170"),
}
METRICS = (("TDG", "tdg_ratio"), ("TDG1", "first_token_tdg_ratio"))


def _sweep(args, n: int, mode: str, out: Path) -> list[dict]:
    path = out / f"d{n}_{mode}" / "sweep.json"
    if path.exists() and not args.rerun:
        return json.loads(path.read_text())["runs"]
    dep_args, _ = DEPLOYMENTS[args.deployment]
    cmd = [sys.executable, "-m", "proserve.sim", "sweep", *dep_args, "--local", "slide_batching",
           "--global", "go_routing", "--rates", args.rates, "--seeds", args.seeds,
           "--num-requests", str(args.num_requests), "--jobs", str(args.jobs), "--no-plot",
           "--dispatchers", str(n), "--publish-interval", str(args.publish_interval),
           "--out", str(path.parent)]
    if mode != "one":
        cmd += ["--dispatcher-sync", mode]
    print(f"# {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())["runs"]


def _ms(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployment", choices=sorted(DEPLOYMENTS), default="colocated",
                    help="colocated: 32 instances (default); disaggregated: 16 prefill + 16 decode")
    ap.add_argument("--rates", help="comma-separated request rates, req/s (default: 0.7x, 0.9x, 1.0x, 1.1x "
                                    "capacity: 160,205,230,255 co-located, 110,140,155,170 disaggregated)")
    ap.add_argument("--dispatchers", default="1,2,4", help="comma-separated dispatcher counts (default 1,2,4)")
    ap.add_argument("--modes", default="blind,publish,shared",
                    help="comma-separated modes for more than one dispatcher (default blind,publish,shared)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--num-requests", type=int, default=3000, help="first N requests of the trace (default 3000)")
    ap.add_argument("--publish-interval", type=float, default=0.05,
                    help="seconds between the instances' publications (default 0.05)")
    ap.add_argument("--tolerance", type=float, default=0.01,
                    help="largest TDG_Ratio loss of 'publish' against one dispatcher that passes (default 0.01)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel runs per sweep (default 2)")
    ap.add_argument("--baseline", choices=["one", "publish"], default="one",
                    help="what the differences are taken against: 'one' (default: one dispatcher as before "
                         "issue 15, its own dispatches only) or 'publish' (one dispatcher that also reads the "
                         "instances' publications: separates what N dispatchers cost from what the published "
                         "view itself changes)")
    ap.add_argument("--rerun", action="store_true", help="rerun sweeps whose JSON is already under --out")
    ap.add_argument("--out", required=True, help="output directory (one sweep per folder, summary.json)")
    args = ap.parse_args(argv)
    if args.rates is None:
        args.rates = DEPLOYMENTS[args.deployment][1]
    counts = sorted({int(x) for x in args.dispatchers.split(",") if x.strip()})
    modes = [m for m in args.modes.split(",") if m.strip()]
    if 1 not in counts:
        counts = [1, *counts]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[tuple[int, str], list[dict]] = {(1, "one"): _sweep(args, 1, "one", out)}
    if "publish" in modes or args.baseline == "publish":   # one dispatcher reading publications too
        runs[1, "publish"] = _sweep(args, 1, "publish", out)
    for n in counts:
        if n > 1:
            for m in modes:
                runs[n, m] = _sweep(args, n, m, out)

    def by(rs):  # (rate, seed) -> metrics["all"]
        return {(r["rate"], r["seed"]): r["metrics"]["all"] for r in rs}

    base = by(runs[1, args.baseline])
    rates = sorted({k[0] for k in base})
    rows, ok = [], True
    hdr = (f"{'disp':>4}  {'mode':<7}  {'rate':>6}  {'TDG mean ± sd':>17}  {'Δ TDG vs 1 ± sd':>18}  "
           f"{'TDG1 mean ± sd':>17}  {'Δ TDG1 vs 1 ± sd':>18}")
    lines = [hdr, "-" * len(hdr)]
    for (n, m), rs in runs.items():
        got = by(rs)
        for rate in rates:
            keys = sorted(k for k in got if k[0] == rate)
            if not keys:    # a rate this sweep did not run (the one-dispatcher sweep reused from a wider one)
                continue
            row = {"dispatchers": n, "mode": m, "rate": rate, "seeds": [k[1] for k in keys]}
            cells = []
            for label, key in METRICS:
                vals = [got[k][key] for k in keys]
                diffs = [got[k][key] - base[k][key] for k in keys]
                mean, sd = _ms(vals)
                dmean, dsd = _ms(diffs)
                row[key] = {"mean": mean, "sd": sd, "diff_mean": dmean, "diff_sd": dsd,
                            "diff_min": min(diffs), "values": vals}
                cells.append(f"{mean:8.4f} ± {sd:.4f}  {dmean:+9.4f} ± {dsd:.4f}")
            if m == "publish" and n > 1 and row["tdg_ratio"]["diff_mean"] < -args.tolerance:
                ok = False
            rows.append(row)
            lines.append(f"{n:>4}  {m:<7}  {rate:>6g}  " + "  ".join(cells))
    table = "\n".join(lines)
    title = (f"# {args.deployment} ({' '.join(DEPLOYMENTS[args.deployment][0][1:])}), slide_batching + "
             f"go_routing, azure, {args.num_requests} requests, seeds {args.seeds}, publish interval "
             f"{args.publish_interval} s; TDG = TDG_Ratio, TDG1 = first-token TDG_Ratio; Δ = mean over seeds of "
             f"(N dispatchers − 1 dispatcher{' reading publications' if args.baseline == 'publish' else ''}), "
             f"same seed")
    verdict = (f"publish, N > 1: TDG_Ratio within {args.tolerance} of the baseline ({args.baseline}) at every rate: "
               f"{'yes' if ok else 'NO'}")
    print(title)
    print(table)
    print(verdict)
    (out / "table.txt").write_text(title + "\n" + table + "\n" + verdict + "\n")
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "rows": rows, "publish_within_tolerance": ok},
                                                 indent=1) + "\n")
    print(f"wrote {out}/table.txt, summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
