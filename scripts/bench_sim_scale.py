#!/usr/bin/env python3
"""The simulator at the PROSERVE paper's large scale: 32 instances, 24 hours of arrivals.

Workload: the Azure 2023 conversation trace bundled as ``bench/data/azure_conv_2023.csv``
(byte-identical to ``../shared/data/AzureLLMInferenceTrace_conv.csv``): its timestamps
scaled to the offered rate (§5.1), then its arrival process — gaps and lengths — played
back to back until ``--hours`` of arrivals (``proserve.bench.workloads.repeat_arrivals``), tagged
50/50 high/low. Requests are made lazily and dropped when they end
(``proserve.sim.stream.simulate_stream``: metrics only, no per-token timelines kept), so memory
stays flat whatever the number of requests.

Offered rate (near capacity by default): ``--load`` × instances × the per-instance
capacity. The capacity is what the planner's highest-rate mode finds for one
co-located instance (``python -m proserve.sim plan --deployment colocated:1``) under
``--capacity-target`` (default: the high class keeps TDG_Ratio >= 0.95 and SLO
attainment >= 0.9), 2,000 requests; or give it with ``--per-instance-rate``, or give
the total with ``--rate`` (``--rate trace``: the trace's own mean rate, 5.5 req/s).

Each deployment (co-located N, disaggregated P:D, SlideBatching + GoRouting by
default) runs in its own process; the table gives per run the simulated requests,
simulated hours, wall time of the simulation, simulated requests per second of wall
time, engine steps, the process's peak RSS and the headline metrics. Exit status 1 if a
run took longer than ``--limit`` seconds (default 300, the 5-minute target).

    python scripts/bench_sim_scale.py                           # 32 instances, 24 h, near capacity
    python scripts/bench_sim_scale.py --hours 1 --deployments colocated
    python scripts/bench_sim_scale.py --rate trace              # the trace's own rate, 24 h
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proserve.bench.traces import load_trace
from proserve.bench.workloads import iter_tagged, repeat_arrivals, scale_to_rate
from proserve.profiler.modelfile import BUNDLED, load
from proserve.scheduler import GainConfig
from proserve.scheduler.request import ConfigError
from proserve.sim.cluster import SimConfig
from proserve.sim.stream import simulate_stream

TRACE = ROOT / "bench" / "data" / "azure_conv_2023.csv"
DEFAULT_TARGET = "high:tdg>=0.95,slo>=0.9"


def measure_capacity(target: str, model_path: str | None, local: str, glob: str, jobs: int) -> float:
    """One co-located instance's highest sustained rate, by the planner's highest-rate mode."""
    from proserve.sim import plan as pl
    from proserve.sim.__main__ import RunSpec, run_spec
    targets = pl.parse_targets([target], ("high", "low"))
    base = RunSpec(trace="azure", num_requests=2000, latency_model=model_path,
                   sim=SimConfig(local_policy=local, global_policy=glob))
    with pl.Planner(base, run_spec, targets, seeds=[0], jobs=jobs) as planner:
        res = planner.highest_rate(pl.colocated(1), start=2.0, tol=0.02)
    print(pl.format_trials(res, targets), file=sys.stderr)
    if res.answer is None:
        raise SystemExit(f"one co-located instance meets {target} at no rate tried")
    return res.answer.rate


def _run(deployment: str, n: int, p: int, d: int, rate: float, hours: float, local: str, glob: str,
         model_path: str | None, progress_s: float, out: mp.Queue) -> None:
    model = load(model_path or BUNDLED)
    base = load_trace(TRACE, "azure")
    recs = scale_to_rate(base, rate) if rate > 0 else base
    rate = (len(recs) - 1) / (recs[-1].arrival - recs[0].arrival)   # the mean rate offered (§5.1)
    # the gain weights of the trace (§5.1 w_p = mean prompt / mean output): the same for every copy
    gain = GainConfig.from_workload([r.prompt_len for r in recs], [r.output_len for r in recs])
    cfg = SimConfig(deployment=deployment, instances=n, prefill_instances=p, decode_instances=d,
                    local_policy=local, global_policy=glob)
    t0 = time.perf_counter()
    last = [t0]

    def tick(r) -> None:
        now = time.perf_counter()
        if now - last[0] >= progress_s:
            last[0] = now
            t = r.token_times[-1] if r.token_times else r.arrival
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"  [{deployment}] {t / 3600:6.2f} h simulated, {now - t0:7.0f} s wall, peak RSS {rss:.0f} MB",
                  file=sys.stderr, flush=True)

    reqs = iter_tagged(repeat_arrivals(recs, hours * 3600.0), seed=0)
    res = simulate_stream(reqs, model, cfg, gain, on_end=tick if progress_s > 0 else None)
    wall = time.perf_counter() - t0
    m = {k: v.as_dict() for k, v in res.metrics.items()}
    out.put({"deployment": deployment, "instances": n if deployment == "colocated" else p + d,
             "split": f"{p}:{d}" if deployment != "colocated" else None, "rate": rate, "hours": hours,
             "requests": res.requests, "unended": res.unended, "sim_s": res.duration, "wall_s": wall,
             "req_per_wall_s": res.requests / wall, "steps": res.steps, "preemptions": res.preemptions,
             "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "metrics": {c: {k: m[c][k] for k in ("requests", "finished", "tdg_ratio", "slo_attainment",
                                                  "ttft_p99", "tpot_p99")} for c in m}})


def run_in_child(*args) -> dict:
    """One run in a fresh process: its peak RSS is its own."""
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_run, args=(*args, q))
    proc.start()
    try:
        while True:
            try:
                return q.get(timeout=5)
            except queue.Empty:   # keep waiting while the child lives
                if not proc.is_alive():
                    raise SystemExit(f"the simulation process died (exit code {proc.exitcode})") from None
    finally:
        proc.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--hours", type=float, default=24.0, help="hours of arrivals (default 24)")
    ap.add_argument("--instances", type=int, default=32, help="co-located instances (default 32)")
    ap.add_argument("--split", default="12:20",
                    help="disaggregated P:D (default 12:20: at ~108 req/s the prefill side has ~9 instances "
                         "of work (mean prompt 1,155 tokens, ~85 ms each on the bundled model); 8:24, the "
                         "1:3 ratio the planner finds cheapest at 12 req/s over 2,000 requests, falls "
                         "behind over an hour)")
    ap.add_argument("--deployments", default="colocated,disaggregated")
    ap.add_argument("--rate", help="total offered rate in req/s, or 'trace' for the trace's own "
                                   "(default: --load × instances × per-instance capacity)")
    ap.add_argument("--per-instance-rate", type=float, help="per-instance capacity in req/s (default: measured)")
    ap.add_argument("--load", type=float, default=1.0, help="offered load as a fraction of the capacity (default 1)")
    ap.add_argument("--capacity-target", default=DEFAULT_TARGET,
                    help=f"what the per-instance capacity must meet (default {DEFAULT_TARGET!r})")
    ap.add_argument("--local", default="slide_batching")
    ap.add_argument("--global", dest="glob", default="go_routing")
    ap.add_argument("--latency-model", help="latency-model JSON (default: the bundled 7B/A100 sketch)")
    ap.add_argument("--limit", type=float, default=300.0, help="wall-time target per run, s (default 300)")
    ap.add_argument("--progress", type=float, default=60.0,
                    help="print the simulated time reached every this many wall seconds (0: never)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel simulations while measuring the capacity")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    deps = [x.strip() for x in args.deployments.split(",") if x.strip()]
    try:
        if not deps or any(x not in ("colocated", "disaggregated") for x in deps):
            raise ConfigError(f"--deployments: colocated and/or disaggregated, got {args.deployments!r}")
        p, d = (int(x) for x in args.split.split(":"))
        if p < 1 or d < 1 or args.instances < 1 or not args.hours > 0 or not args.load > 0:
            raise ConfigError("--split P:D, --instances, --hours and --load must be positive")
    except (ValueError, ConfigError) as e:
        ap.error(str(e))

    per_instance = None
    if args.rate == "trace":
        rate, how = 0.0, "the trace's own timestamps"
    elif args.rate is not None:
        rate, how = float(args.rate), "--rate"
    else:
        per_instance = args.per_instance_rate
        how = "--per-instance-rate"
        if per_instance is None:
            t0 = time.perf_counter()
            per_instance = measure_capacity(args.capacity_target, args.latency_model, args.local, args.glob,
                                            args.jobs)
            how = (f"planner: colocated:1 sustains {per_instance:g} req/s under {args.capacity_target} "
                   f"(2,000 requests, {time.perf_counter() - t0:.0f} s)")
        rate = args.load * args.instances * per_instance
    n_trace = len(load_trace(TRACE, "azure"))
    print(f"# trace {TRACE.relative_to(ROOT)} ({n_trace} requests, one hour) repeated for {args.hours:g} h; "
          f"{args.local} + {args.glob}; latency model {args.latency_model or 'bundled'}")
    print("# offered rate: " + (f"{rate:g} req/s = {args.load:g} x {args.instances} x {per_instance:g} "
                                 f"req/s per instance ({how})" if per_instance else
                                 f"{rate:g} req/s ({how})" if rate else f"the trace's own ({how})"))
    print("# wall times on a shared 2-core machine (other work running): pessimistic")
    hdr = (f"{'deployment':<16} {'rate':>7} {'requests':>10} {'sim_h':>6} {'wall_s':>8} {'req/s wall':>10} "
           f"{'steps':>11} {'RSS_MB':>7} {'TDG':>6} {'TDG_hi':>6} {'SLO_hi':>6}")
    print(hdr)
    print("-" * len(hdr))
    rows, over = [], 0
    for dep in deps:
        n = args.instances
        name = f"colocated:{n}" if dep == "colocated" else f"disagg:{p}:{d}"
        r = run_in_child(dep, n, p, d, rate, args.hours, args.local, args.glob, args.latency_model,
                         args.progress)
        rows.append(r)
        over += r["wall_s"] > args.limit
        m = r["metrics"]
        print(f"{name:<16} {r['rate']:>7.4g} {r['requests']:>10} {r['sim_s'] / 3600:>6.2f} "
              f"{r['wall_s']:>8.1f} {r['req_per_wall_s']:>10.0f} {r['steps']:>11} {r['peak_rss_mb']:>7.0f} "
              f"{m['all']['tdg_ratio']:>6.3f} {m['high']['tdg_ratio']:>6.3f} {m['high']['slo_attainment']:>6.3f}"
              + ("" if r["wall_s"] <= args.limit else f"  over {args.limit:g} s")
              + ("" if not r["unended"] else f"  {r['unended']} requests never ended"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rate": rate, "per_instance_rate": per_instance, "how": how,
                                               "args": vars(args), "rows": rows}, indent=1))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
