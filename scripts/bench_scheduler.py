#!/usr/bin/env python3
"""Decision-time and simulator-speed benchmark for the policy core.

Prints, each next to its target and to a baseline measured in the same run:

* SlideBatching decision time (one ``schedule()``) for queues of 10 / 100 /
  1,000 / 10,000 requests (target ≤ 1 ms at 1,000), beside Sarathi-FCFS;
* GoRouting decision time (one ``route()``) at 8 / 32 / 128 prefill instances
  with 64 queued requests each (target ≤ 1 ms at 32), beside Min-Load;
* simulator wall time on the whole one-hour Azure conversation trace
  (19,366 requests, original timestamps) on 8 co-located instances with
  SlideBatching + GoRouting (target < 60 s).

    python scripts/bench_scheduler.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.workloads import build_workload  # noqa: E402
from profiler.modelfile import BUNDLED, load  # noqa: E402
from scheduler import Estimator, GainConfig, Request, make_global, make_local  # noqa: E402
from scheduler.local.base import InstanceView  # noqa: E402
from scheduler.routing.base import PrefillInstance, PrefillQueueMap  # noqa: E402

TRACE = ROOT / "bench" / "data" / "azure_conv_2023.csv"
MODEL = load(BUNDLED)
GAIN = GainConfig(w_p=5.5, w_d=1.0)


def _median_time(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _queue(n: int, now: float, rng: random.Random) -> tuple[list[Request], list[Request]]:
    """n requests: 80 % waiting (arrived in the last 5 s), 20 % decoding."""
    waiting, decoding = [], []
    for i in range(n):
        w = 2.0 if rng.random() < 0.5 else 1.0
        r = Request(f"q{i}", "high" if w > 1 else "low", w, 1.0, 0.1, now - rng.uniform(0, 5),
                    rng.randint(16, 4096), rng.randint(1, 600))
        if rng.random() < 0.2:
            r.prefilled = r.prefill_len
            r.kv_len = r.prompt_len + rng.randint(0, 200)
            r.token_times = [r.arrival + 0.5] * rng.randint(1, 5)
            r.output_len = max(r.output_len, r.num_emitted + 1)
            r.phase = r.phase.DECODING
            decoding.append(r)
        else:
            waiting.append(r)
    return waiting, decoding


def bench_local(sizes, repeat: int) -> None:
    print("SlideBatching decision time per step (median), target <= 1 ms at 1,000 queued")
    print(f"{'queued':>8} {'slide_batching':>15} {'sarathi_fcfs':>13} {'ratio':>6}")
    rng = random.Random(0)
    for n in sizes:
        waiting, decoding = _queue(n, 100.0, rng)
        view = InstanceView(100.0, waiting, decoding, free_blocks=1 << 30, block_size=16)
        times = {}
        for name in ("slide_batching", "sarathi_fcfs"):
            pol = make_local(name, Estimator(MODEL), GAIN)
            times[name] = _median_time(lambda: pol.schedule(view), repeat if n < 10000 else max(5, repeat // 10))
        s, b = times["slide_batching"], times["sarathi_fcfs"]
        mark = "  <- target" if n == 1000 else ""
        print(f"{n:>8} {s * 1e3:>12.3f} ms {b * 1e3:>10.3f} ms {s / b:>6.1f}{mark}"
              + ("  PASS" if n == 1000 and s <= 1e-3 else "  FAIL" if n == 1000 else ""))


def bench_global(sizes, per_queue: int, routes: int) -> None:
    print(f"\nGoRouting decision time per request (median of {routes} routes, one queue add per route), "
          f"{per_queue} queued per instance, target <= 1 ms at 32 instances")
    print(f"{'instances':>9} {'go_routing':>12} {'min_load':>10} {'ratio':>6}")
    for n_inst in sizes:
        times = {}
        for name in ("go_routing", "min_load"):
            rng = random.Random(1)
            now = 1000.0
            insts = [PrefillInstance(i, Estimator(MODEL)) for i in range(n_inst)]
            qmap = PrefillQueueMap(insts)
            for p in insts:
                for k in range(per_queue):
                    w = 2.0 if rng.random() < 0.5 else 1.0
                    qmap.add(p.id, Request(f"p{p.id}-{k}", "x", w, 1.0, 0.1, now - rng.uniform(0, 2),
                                           rng.randint(16, 4096), 100), now - rng.uniform(0, 0.1))
            pol = make_global(name, gain=GAIN)
            ts = []
            for j in range(routes):
                w = 2.0 if rng.random() < 0.5 else 1.0
                req = Request(f"n{j}", "x", w, 1.0, 0.1, now, rng.randint(16, 4096), 100)
                t0 = time.perf_counter()
                p, _ = pol.route(req, insts, (), now)
                ts.append(time.perf_counter() - t0)
                qmap.add(p.id, req, now)       # the queue changes as in a real run
                qmap.remove(p.id, p.queue[0], now)
                now += 0.01
            times[name] = statistics.median(ts)
        g, m = times["go_routing"], times["min_load"]
        verdict = ("  PASS" if g <= 1e-3 else "  FAIL") if n_inst == 32 else ""
        print(f"{n_inst:>9} {g * 1e3:>9.3f} ms {m * 1e3:>7.3f} ms {g / m:>6.1f}{verdict}")


def bench_sim(instances: int, num_requests: int | None) -> None:
    from sim.cluster import SimConfig, simulate

    reqs = build_workload(str(TRACE), rate=None, num_requests=num_requests, seed=0, fmt="azure")
    span = reqs[-1].arrival - reqs[0].arrival
    gain = GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs])
    print(f"\nSimulator: {len(reqs)} requests ({span / 60:.1f} min of Azure trace, original timestamps), "
          f"{instances} co-located instances, slide_batching + go_routing; target < 60 s wall")
    for ff in (True, False) if num_requests else (True,):
        t0 = time.perf_counter()
        res = simulate(reqs if ff else build_workload(str(TRACE), num_requests=num_requests, seed=0, fmt="azure"),
                       MODEL, SimConfig(instances=instances, local_policy="slide_batching",
                                        global_policy="go_routing", fast_forward=ff), gain)
        wall = time.perf_counter() - t0
        label = "macro-steps" if ff else "exact steps"
        verdict = "  PASS" if wall < 60 else "  FAIL"
        print(f"  {label}: {wall:.1f} s wall for {res.duration:.0f} s simulated, {res.steps} engine steps, "
              f"{res.steps / wall / 1e3:.0f}k steps/s{verdict if ff else ''}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, first 3,000 requests for the simulator")
    args = ap.parse_args()
    bench_local([10, 100, 1000, 10000], repeat=30 if args.quick else 200)
    bench_global([8, 32, 128], per_queue=64, routes=100 if args.quick else 400)
    bench_sim(8, 3000 if args.quick else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
