#!/usr/bin/env python3
"""Simulator speed on a long-prompt trace: every registered local policy, below, at and
above saturation.

The trace's *saturation rate* is measured first: the throughput (finished requests per
simulated second) of a reference policy (``--saturation-policy``, default
``sarathi_fcfs``) offered far more load than it can serve. Then every registered
local policy (or ``--policies``) runs ``--num-requests`` requests of the trace at each
multiple of that rate in ``--loads`` (default 0.5×, 1×, 2×), each run in its own
process and stopped at ``--limit`` seconds of wall time (default 30). The table shows
per run the wall time, the simulated steps, the recompute preemptions, the simulated
duration and the simulated requests per second of wall time; the exit status is 1 if
any run went over the limit.

    python scripts/bench_sim_speed.py                                  # mooncake, 2,000 requests
    python scripts/bench_sim_speed.py --trace path/to/trace.jsonl --loads 1,4 --policies edf,sjf

The default trace, ``../shared/data/mooncake_synthetic_trace.jsonl`` beside the
repository, has long prompts (mean ≈ 15k tokens), the shape that used to make the
simulator crawl (docs/results.md §3.1).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proserve.bench.workloads import build_workload
from proserve.profiler.modelfile import BUNDLED, load
from proserve.scheduler import GainConfig, registry
from proserve.scheduler.request import ConfigError
from proserve.sim.cluster import SimConfig, simulate

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
OVERLOAD_RATE = 50.0   # req/s offered to measure saturation: far above what one instance serves


def _run(trace: str, policy: str, rate: float, n: int, model_path: str | None, deployment: str,
         out: mp.Queue) -> None:
    model = load(model_path or BUNDLED)
    reqs = build_workload(trace, rate=rate, num_requests=n, seed=0)
    gain = GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs])
    cfg = SimConfig(deployment=deployment, local_policy=policy)
    t0 = time.perf_counter()
    res = simulate(reqs, model, cfg, gain)
    wall = time.perf_counter() - t0
    done = sum(1 for r in res.requests if r.error is None)
    out.put({"policy": policy, "rate": rate, "wall_s": wall, "steps": res.steps,
             "preemptions": res.preemptions, "sim_s": res.duration, "finished": done,
             "failed": len(res.requests) - done})


def run_limited(limit: float, *args) -> dict | None:
    """One simulation in a child process; None if it ran past ``limit`` seconds."""
    q: mp.Queue = mp.get_context("fork").Queue()
    p = mp.get_context("fork").Process(target=_run, args=(*args, q), daemon=True)
    p.start()
    try:
        return q.get(timeout=limit + 5)   # + trace loading; the run's own wall time is checked by the caller
    except queue.Empty:
        return None
    finally:
        p.kill()
        p.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace file (any supported format)")
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--loads", default="0.5,1,2", help="multiples of the saturation rate (default 0.5,1,2)")
    ap.add_argument("--policies", help="comma-separated local policies (default: every registered one)")
    ap.add_argument("--saturation-policy", default="sarathi_fcfs")
    ap.add_argument("--deployment", default="colocated", choices=["colocated", "disaggregated"])
    ap.add_argument("--latency-model", help="latency-model JSON (default: the bundled one)")
    ap.add_argument("--limit", type=float, default=30.0, help="wall-time limit per run in seconds (default 30)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    if not Path(args.trace).exists():
        ap.error(f"trace {args.trace} not found (pass --trace)")
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        ap.error(f"--loads: expected comma-separated numbers, got {args.loads!r}")
    policies = args.policies.split(",") if args.policies else registry.local_names()
    for p in policies + [args.saturation_policy]:
        try:
            registry.local_policy(p)
        except ConfigError as e:
            ap.error(str(e))
    common = (args.num_requests, args.latency_model, args.deployment)

    sat = run_limited(10 * args.limit, args.trace, args.saturation_policy, OVERLOAD_RATE, *common)
    if sat is None:
        print(f"saturation run ({args.saturation_policy} at {OVERLOAD_RATE} req/s) did not finish", file=sys.stderr)
        return 1
    rate_sat = sat["finished"] / sat["sim_s"]
    print(f"# trace {args.trace}, {args.num_requests} requests, {args.deployment}")
    print(f"# saturation: {args.saturation_policy} offered {OVERLOAD_RATE:g} req/s finished "
          f"{rate_sat:.4f} req/s (simulated {sat['sim_s']:.0f} s in {sat['wall_s']:.1f} s wall)")
    rows, over = [], 0
    hdr = f"{'policy':<18} {'load':>5} {'rate':>7} {'wall_s':>7} {'steps':>8} {'preempt':>7} " \
          f"{'sim_s':>8} {'req/s wall':>10}"
    print(hdr)
    print("-" * len(hdr))
    for pol in policies:
        for x in loads:
            rate = x * rate_sat
            r = run_limited(args.limit, args.trace, pol, rate, *common)
            if r is None or r["wall_s"] > args.limit:
                over += 1
                shown = f"> {args.limit:g}" if r is None else f"{r['wall_s']:.2f}"
                print(f"{pol:<18} {x:>5g} {rate:>7.4f} {shown:>7}  OVER THE LIMIT", flush=True)
                rows.append({"policy": pol, "load": x, "rate": rate, "over_limit": True, **(r or {})})
                continue
            print(f"{pol:<18} {x:>5g} {rate:>7.4f} {r['wall_s']:>7.2f} {r['steps']:>8} {r['preemptions']:>7} "
                  f"{r['sim_s']:>8.0f} {args.num_requests / r['wall_s']:>10.0f}", flush=True)
            rows.append({"load": x, **r})
    walls = [r["wall_s"] for r in rows if "wall_s" in r]
    print(f"# {len(rows)} runs, {over} over {args.limit:g} s; slowest {max(walls, default=float('nan')):.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"saturation_rate": rate_sat, "saturation_run": sat,
                                               "rows": rows}, indent=2))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
