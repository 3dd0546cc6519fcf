#!/usr/bin/env python3
"""Decision-time and simulator-speed benchmark for the policy core.

Prints, each next to its target and to a baseline measured in the same run:

* SlideBatching decision time (one ``schedule()``) for queues of 10 / 100 /
  1,000 / 10,000 requests (target ≤ 1 ms at 1,000), beside Sarathi-FCFS;
* GoRouting decision time (one ``route()``) at 8 / 32 / 128 prefill instances
  with 64 queued requests each (target ≤ 1 ms at 32), beside Min-Load;
* simulator wall time on the whole one-hour Azure conversation trace
  (19,366 requests, original timestamps) on 8 co-located instances with
  SlideBatching + GoRouting (target < 60 s);
* every registered local policy's ``schedule()`` time at 1,000 queued requests
  (one queue, built as above, the same for every policy), median and P90,
  each as a multiple of SlideBatching's in the same run, after warm-up calls
  (stateful policies: SLOs-Serve decides admission for at most ``max_new`` new
  requests per call, GMAX re-decides its group every ``frame_steps`` calls;
  those heavier calls are reported on their own lines);
* every registered global policy's ``route()`` time at 32 instances × 64
  queued (the same queues as the GoRouting part for every policy, after
  warm-up routes), median and P90, as a multiple of GoRouting's.

    python scripts/bench_scheduler.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proserve.bench.workloads import build_workload  # noqa: E402
from proserve.profiler.modelfile import BUNDLED, load  # noqa: E402
from proserve.scheduler import Estimator, GainConfig, Request, make_global, make_local, registry  # noqa: E402
from proserve.scheduler.local.base import InstanceView  # noqa: E402
from proserve.scheduler.routing.base import PrefillInstance, PrefillQueueMap  # noqa: E402

TRACE = ROOT / "bench" / "data" / "azure_conv_2023.csv"
MODEL = load(BUNDLED)
GAIN = GainConfig(w_p=5.5, w_d=1.0)
ROUNDS = 5   # the per-policy tables time each policy in this many blocks, the policies taking turns


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
            times[name] = _median_time(lambda pol=pol, view=view: pol.schedule(view), repeat if n < 10000 else max(5, repeat // 10))
        s, b = times["slide_batching"], times["sarathi_fcfs"]
        mark = "  <- target" if n == 1000 else ""
        print(f"{n:>8} {s * 1e3:>12.3f} ms {b * 1e3:>10.3f} ms {s / b:>6.1f}{mark}"
              + ("  PASS" if n == 1000 and s <= 1e-3 else "  FAIL" if n == 1000 else ""))


def bench_global(sizes, per_queue: int, routes: int) -> None:
    print(f"\nGoRouting decision time per request (median of {routes} routes, one queue add per route), "
          f"{per_queue} queued per instance, target <= 1 ms at 32 instances; instances running SlideBatching "
          "(GoRouting's schedule-aware estimate, the default) beside the paper's estimate (order=deadline), "
          "and with a prefix index (every request 24 blocks of 512 tokens from 200 conversations), "
          "also with choose=scorers and with fallback=catch_up (which only line 19 reads: the last two columns "
          "route requests with a 1 ms TTFT SLO, which no instance meets, so every route takes line 19)")
    print(f"{'instances':>9} {'go_routing':>12} {'paper est.':>10} {'min_load':>10} {'ratio':>6} {'+ index':>10}"
          f" {'+ scorers':>10} {'l.19 random':>12} {'l.19 catch_up':>14}")
    runs = (("go_routing", "slide", {}), ("paper", "deadline", {"order": "deadline"}), ("min_load", "slide", {}),
            ("index", "slide", {}), ("scorers", "slide", {"choose": "scorers"}),
            ("late_random", "slide", {}), ("late_catch_up", "slide", {"fallback": "catch_up"}))
    for n_inst in sizes:
        times = {}
        for label, order, params in runs:
            name = "min_load" if label == "min_load" else "go_routing"
            rng = random.Random(1)
            now = 1000.0
            indexed = label in ("index", "scorers", "late_random", "late_catch_up")
            ttft = 0.001 if label.startswith("late") else 1.0
            cache = 107_200 if indexed else 0                # the bundled model's KV memory, in tokens

            def blocks(indexed=indexed, rng=rng):      # bound now: used in this iteration only
                if not indexed:
                    return {}
                conv = rng.randrange(200)
                return {"prefix_blocks": tuple(conv * 100 + j for j in range(24)), "prefix_block_tokens": 512}
            insts = [PrefillInstance(i, Estimator(MODEL), order=order, cache_tokens=cache) for i in range(n_inst)]
            qmap = PrefillQueueMap(insts)
            for p in insts:
                for k in range(per_queue):
                    w = 2.0 if rng.random() < 0.5 else 1.0
                    qmap.add(p.id, Request(f"p{p.id}-{k}", "x", w, 1.0, 0.1, now - rng.uniform(0, 2),
                                           rng.randint(16, 4096), 100, **blocks()), now - rng.uniform(0, 0.1))
            pol = make_global(name, gain=GAIN, **params)
            ts = []
            for j in range(routes):
                w = 2.0 if rng.random() < 0.5 else 1.0
                req = Request(f"n{j}", "x", w, ttft, 0.1, now, rng.randint(16, 4096), 100, **blocks())
                t0 = time.perf_counter()
                p, _ = pol.route(req, insts, (), now)
                ts.append(time.perf_counter() - t0)
                qmap.add(p.id, req, now)       # the queue changes as in a real run
                qmap.remove(p.id, p.queue[0], now)
                now += 0.01
            times[label] = statistics.median(ts)
        g, a, m, x, c, r, u = (times[k] for k in ("go_routing", "paper", "min_load", "index", "scorers",
                                                  "late_random", "late_catch_up"))
        verdict = ("  PASS" if max(g, x, c, r, u) <= 1e-3 else "  FAIL") if n_inst == 32 else ""
        print(f"{n_inst:>9} {g * 1e3:>9.3f} ms {a * 1e3:>7.3f} ms {m * 1e3:>7.3f} ms {g / m:>6.1f} "
              f"{x * 1e3:>7.3f} ms {c * 1e3:>7.3f} ms {r * 1e3:>9.3f} ms {u * 1e3:>11.3f} ms{verdict}")


def _pct(xs: list[float], q: float) -> float:
    """The ⌈q·n⌉-th smallest of ``xs`` (q in (0, 1])."""
    ys = sorted(xs)
    return ys[max(0, min(len(ys) - 1, math.ceil(q * len(ys)) - 1))]


def _ordered(names: list[str], first: str) -> list[str]:
    return [first] + [n for n in names if n != first]


def _turns(names: list[str], untimed: int, repeat: int) -> list[tuple[str, int, bool]]:
    """(policy, calls, timed) blocks: ``untimed`` calls per policy, then ROUNDS timed blocks of
    ``repeat // ROUNDS`` calls per policy (each block starting with one more, untimed call),
    the policies taking turns block by block."""
    per = max(1, repeat // ROUNDS)
    return [(name, untimed, False) for name in names] + \
        [(name, per + 1, True) for _ in range(ROUNDS) for name in names]


def _heavy_call(name: str, pol) -> str | None:
    """For stateful policies: what extra work the call just made did, if any."""
    if name == "slos_serve" and pol.last is not None and (pol.last.admitted or pol.last.declined):
        return f"made an admission DP over up to {pol.max_new} new requests"
    if name == "jitserve_gmax" and pol._frame_pos == 0:
        return "were a frame boundary (group re-decided)"
    return None


def bench_local_all(n: int, warmup: int, repeat: int) -> None:
    """Every registered local policy on one queue of ``n`` requests. The timed calls come in
    ROUNDS blocks per policy, the policies taking turns, so that load from other processes on
    the machine falls on every policy alike while each block runs with warm caches."""
    names = _ordered(registry.local_names(), "slide_batching")
    print(f"\nLocal policies: schedule() time at {n:,} queued (one queue, the same for every policy: "
          f"{int(0.8 * n)} waiting / {n - int(0.8 * n)} decoding as drawn), "
          f"first call on a fresh policy, then {warmup} warm-up calls, then median / P90 of {repeat} "
          f"(in {ROUNDS} blocks per policy, the policies taking turns)")
    print(f"{'policy':>18} {'first call':>11} {'median':>10} {'P90':>10} {'x slide_batching':>17}")
    state = {}
    for name in names:
        waiting, decoding = _queue(n, 100.0, random.Random(7))   # rebuilt identically for each policy
        view = InstanceView(100.0, waiting, decoding, free_blocks=1 << 30, block_size=16)
        pol = make_local(name, Estimator(MODEL), GAIN)
        state[name] = {"pol": pol, "view": view, "ts": [], "heavy": {}, "first": 0.0}
    # first call and warm-up per policy, then the timed calls
    calls = {name: 0 for name in names}
    for name, count, timed in _turns(names, 1 + warmup, repeat):
        st = state[name]
        pol, view = st["pol"], st["view"]
        for c in range(count):
            t0 = time.perf_counter()
            pol.schedule(view)
            dt = time.perf_counter() - t0
            label = _heavy_call(name, pol)
            if label and calls[name] > 0:
                st["heavy"].setdefault(label, []).append(dt)
            if calls[name] == 0:
                st["first"] = dt
            elif timed and c > 0:
                st["ts"].append(dt)
            calls[name] += 1
    base = statistics.median(state[names[0]]["ts"])
    heavy_lines = []
    for name in names:
        st = state[name]
        ts = st["ts"]
        med = statistics.median(ts)
        print(f"{name:>18} {st['first'] * 1e3:>8.3f} ms {med * 1e3:>7.3f} ms {_pct(ts, 0.9) * 1e3:>7.3f} ms "
              f"{med / base:>17.1f}")
        for label, xs in st["heavy"].items():
            heavy_lines.append(f"  {name}: {len(xs)} calls after the first {label}: "
                               f"median {statistics.median(xs) * 1e3:.3f} ms, max {max(xs) * 1e3:.3f} ms")
    if heavy_lines:
        print("Heavier calls of stateful policies (counted in the median / P90 above only if after warm-up):")
        print("\n".join(heavy_lines))
    # On that queue SLOs-Serve declines every waiting request before its DP (none could meet its
    # TTFT beside the 200 running decodes), so time the DP on its own: the same requests, all
    # waiting and just arrived, a fresh policy each time; its first two calls both run the DP
    # over max_new (32) new requests (the rest are pending, then declined as infeasible).
    waiting, decoding = _queue(n, 100.0, random.Random(7))
    fresh = waiting + decoding
    for r in fresh:
        r.arrival, r.prefilled, r.kv_len, r.token_times, r.phase = 100.0, 0, 0, [], r.phase.WAITING
    view = InstanceView(100.0, fresh, [], free_blocks=1 << 30, block_size=16)
    ts, dps = [], 0
    for _ in range(max(3, repeat // 20)):
        pol = make_local("slos_serve", Estimator(MODEL), GAIN)
        for _ in range(2):
            t0 = time.perf_counter()
            pol.schedule(view)
            ts.append(time.perf_counter() - t0)
            dps += bool(pol.last.admitted or pol.last.declined)
    print(f"  slos_serve, {n:,} requests all waiting and just arrived (first two calls of a fresh policy, "
          f"{dps} of {len(ts)} ran the admission DP): median {statistics.median(ts) * 1e3:.3f} ms, "
          f"P90 {_pct(ts, 0.9) * 1e3:.3f} ms")


def bench_global_all(n_inst: int, per_queue: int, warmup: int, routes: int) -> None:
    """Every registered global policy over ``n_inst`` instances with ``per_queue`` queued each
    on average; timed routes in ROUNDS blocks per policy, the policies taking turns."""
    names = _ordered(registry.global_names(), "go_routing")
    names.insert(names.index("jitserve_power_of_k") + 1, "jitserve_power_of_k:k=2")   # power of two choices
    print(f"\nGlobal policies: route() time at {n_inst} instances x {per_queue} queued on average "
          f"(the same {n_inst * per_queue} queued requests for every policy, each placed by the policy "
          f"itself so that stateful routers know them), {warmup} warm-up routes, then median / P90 of "
          f"{routes} (in {ROUNDS} blocks per policy, the policies taking turns; one queue add and one head "
          f"removal per route)")
    print(f"{'policy':>23} {'median':>10} {'P90':>10} {'x go_routing':>13}  note")
    state = {}
    for name in names:
        rng = random.Random(1)
        now = 1000.0
        insts = [PrefillInstance(i, Estimator(MODEL)) for i in range(n_inst)]
        qmap = PrefillQueueMap(insts)
        base_name, _, param = name.partition(":k=")
        pol = make_global(base_name, gain=GAIN, **({"k": int(param)} if param else {}))
        for k in range(n_inst * per_queue):      # the queues, filled by the policy itself
            w = 2.0 if rng.random() < 0.5 else 1.0
            req = Request(f"q{k}", "high" if w > 1 else "low", w, 1.0, 0.1, now - rng.uniform(0, 2),
                          rng.randint(16, 4096), 100)
            p, _ = pol.route(req, insts, (), now)
            qmap.add(p.id, req, now - rng.uniform(0, 0.1))
        state[name] = {"pol": pol, "base": base_name, "insts": insts, "qmap": qmap, "now": now,
                       "rng": random.Random(2), "ts": [], "admitted": 0, "hops": 0,
                       "lens": [len(p.queue) for p in insts]}
    for name, count, timed in _turns(names, warmup, routes):
        st = state[name]
        pol, insts, qmap, rng = st["pol"], st["insts"], st["qmap"], st["rng"]
        for c in range(count):
            now = st["now"]
            w = 2.0 if rng.random() < 0.5 else 1.0
            req = Request(f"n{now:.2f}", "high" if w > 1 else "low", w, 1.0, 0.1, now,
                          rng.randint(16, 4096), 100)
            t0 = time.perf_counter()
            p, _ = pol.route(req, insts, (), now)
            dt = time.perf_counter() - t0
            if timed and c > 0:
                st["ts"].append(dt)
                dec = getattr(pol, "last_decision", None)
                if st["base"] == "slos_serve_routing" and dec is not None:
                    st["admitted"] += dec.admitted
                    st["hops"] += len(dec.tried)
            qmap.add(p.id, req, now)       # the queue changes as in a real run
            head = p.queue[0]
            qmap.remove(p.id, head, now)
            pol.on_request_finished(head, now)
            st["now"] = now + 0.01
    base = statistics.median(state[names[0]]["ts"])
    for name in names:
        st = state[name]
        ts, lens = st["ts"], st["lens"]
        med = statistics.median(ts)
        note = f"queues {min(lens)}-{max(lens)}"
        if st["base"] == "slos_serve_routing":
            note += (f"; admitted {st['admitted']}/{len(ts)}, {st['hops'] / len(ts):.1f} replicas checked "
                     f"per route")
        elif st["base"] == "jitserve_power_of_k":
            note += f"; K = {st['pol'].k or f'M = {n_inst}'}"
        print(f"{name:>23} {med * 1e3:>7.3f} ms {_pct(ts, 0.9) * 1e3:>7.3f} ms {med / base:>13.1f}  {note}")


def bench_sim(instances: int, num_requests: int | None) -> None:
    from proserve.sim.cluster import SimConfig, simulate

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
    bench_local_all(1000, warmup=30, repeat=30 if args.quick else 200)
    bench_global_all(32, per_queue=64, warmup=50 if args.quick else 200, routes=100 if args.quick else 400)
    return 0


if __name__ == "__main__":
    sys.exit(main())
