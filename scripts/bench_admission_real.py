#!/usr/bin/env python3
"""Admission control at 1.5x capacity on a real cluster (issue 13).

The dispatcher (GoRouting, API keys per class) in front of one real co-located
vLLM CPU worker (``scripts/launch_cluster.sh --colocated``, the local policy of
``--policy``), serving the scaled model (:mod:`proserve.bench.scaled_model`) with a
latency model profiled on this host. The same workload is replayed through it once
per ``--modes`` entry: ``queue`` (every class queues, the default) and ``reject``
(``--on-overload low=reject``: a low request that GoRouting's estimate says no
instance can serve within its TTFT SLO gets HTTP 429 at once).

Workload: the bundled Azure conversation trace, lengths / 4, TTFT SLO 0.5 s and
TPOT SLO 0.05 s for both classes, 50/50 high (w=2) / low (w=1), streamed, at
``--load`` x ``--capacity`` req/s (the capacity is bench.engine_policies' probe
of stock FCFS on the same engine and workload: 15.95 req/s on this host).

Per mode and class it prints TDG_Ratio and SLO attainment (a 429 scores as the
load generator scores it: zero gain, SLO missed), the 429s and how long each
took from send to status line (P50 / P99 / max, and how many over 50 ms), and,
of the requests that were admitted and served, how far their first token came
after their TTFT SLO (the overrun ``TTFT - TTFT_SLO``: P50 / P99 / max, and how
many were late at all). Figures are measured, not asserted (the exit status is
non-zero only when the cluster does not start or a request ends without an HTTP
status).

    flock /tmp/proserve-engine.lock python scripts/bench_admission_real.py --out out/admission_real
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_fidelity as bf  # noqa: E402
from proserve.bench import loadgen as lg  # noqa: E402
from proserve.bench.scaled_model import make_scaled_model  # noqa: E402

MODES = {"queue": (), "reject": ("--on-overload", "low=reject")}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def class_report(records: list[dict], summary: dict) -> dict:
    """Per class: TDG/SLO, 429 count and latency, and the TTFT overrun of admitted requests."""
    out = {}
    for cls in sorted({r["priority"] for r in records}):
        rs = [r for r in records if r["priority"] == cls]
        n_rej = sum(1 for r in rs if r["status"] == 429)
        # records written before Result.responded existed have no such key: count, no latency
        rej = [r["responded"] - r["sent"] for r in rs
               if r["status"] == 429 and r.get("responded") is not None and r.get("sent") is not None]
        served = [r for r in rs if r["status"] == 200 and r["ttft"] is not None]
        over = [max(0.0, r["ttft"] - r["ttft_slo"]) for r in served]
        m = summary["metrics"].get(cls, {})
        out[cls] = {"requests": len(rs), "served": len(served), "rejected": n_rej,
                    "other_errors": sum(1 for r in rs if r["status"] not in (200, 429)),
                    "tdg_ratio": m.get("tdg_ratio"), "slo_attainment": m.get("slo_attainment"),
                    "reject_s": {"p50": _pct(rej, 0.5), "p99": _pct(rej, 0.99), "max": max(rej, default=None),
                                 "over_50ms": sum(1 for x in rej if x > 0.05)},
                    "ttft_overrun_s": {"late": sum(1 for x in over if x > 0), "p50": _pct(over, 0.5),
                                       "p99": _pct(over, 0.99), "max": max(over, default=None),
                                       "mean_ttft": statistics.fmean(r["ttft"] for r in served) if served else None}}
    return out


def fmt(v, f="{:.3f}") -> str:
    return "-" if v is None else f.format(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/bench_admission_real.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--modes", default="queue,reject", help="comma-separated: queue, reject")
    ap.add_argument("--policy", default="slide_batching", help="the worker's local policy")
    ap.add_argument("--capacity", type=float, default=15.95, help="req/s (bench.engine_policies --probe-only)")
    ap.add_argument("--load", type=float, default=1.5, help="offered load as a multiple of --capacity")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of trace")
    ap.add_argument("--model", default="scaled", help="model directory, or 'scaled' (written to OUT/model)")
    ap.add_argument("--latency-model", default=str(ROOT / "docs/results/engine_tuned/scaled-llama-cpu.json"))
    bf.add_cluster_args(ap, 8700, "dispatcher port; the worker at +100")
    ap.add_argument("--out", default="out/admission_real")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"error: --modes: unknown {bad or 'empty'} (choose from {', '.join(MODES)})", file=sys.stderr)
        return 2
    if not (args.load > 0 and args.capacity > 0 and round(args.load * args.capacity, 2) > 0
            and math.isfinite(args.load * args.capacity)):
        print(f"error: --load x --capacity must be a finite rate >= 0.01 req/s, got {args.load:g} x {args.capacity:g}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model == "scaled":
        args.model = str(make_scaled_model(out / "model"))
    bf.KEYS_FILE = out / "keys.toml"
    bf.KEYS_FILE.write_text("".join(f'[[keys]]\nkey = "{k}"\nclient = "bench_admission_real"\nclass = "{c}"\n\n'
                                    for c, k in bf.CLASS_KEYS.items()))
    classes = lg.load_classes(None, args.ttft_slo, args.tpot_slo)
    classes_file = out / "classes.json"
    classes_file.write_text(json.dumps([{"name": c.name, "weight": c.weight, "ttft_slo": c.ttft_slo,
                                         "tpot_slo": c.tpot_slo} for c in classes.values()]) + "\n")
    rate = round(args.load * args.capacity, 2)
    reqs = bf.workload(args, rate, classes)
    gain = lg.workload_gain(reqs)
    doc = {"argv": sys.argv[1:] if argv is None else argv, "rate": rate, "requests": len(reqs),
           "gain": {"w_p": gain.w_p, "w_d": gain.w_d}, "modes": {}}
    failed = False
    for mode in modes:
        run_dir = out / mode
        cl = bf.Cluster("colocated", args.policy, run_dir / "run", args, classes_file, gain.w_p, MODES[mode])
        try:
            warm = lg.ClientConfig(cl.url, api="proserve", class_keys=bf.CLASS_KEYS, seed=args.seed + 1000,
                                   request_timeout=args.timeout)
            asyncio.run(lg.replay(bf.workload(args, 4.0, classes, seed=args.seed + 1000, n=12), warm))
            cl.drain()
            cfg = lg.ClientConfig(cl.url, api="proserve", class_keys=bf.CLASS_KEYS, seed=args.seed,
                                  request_timeout=args.timeout)
            t0 = time.monotonic()
            run = asyncio.run(lg.replay(reqs, cfg))
            cl.drain()
            summary = lg.summarize_run(reqs, run.results, gain, run.stalls)
            records = lg.write_outputs(run_dir, reqs, run, gain, summary, {"mode": mode, "rate": rate,
                                                                           "cluster_cmd": cl.cmd})
        finally:
            cl.stop()
        rep = class_report(records, summary)
        doc["modes"][mode] = {"wall_s": time.monotonic() - t0, "classes": rep,
                              "all": {k: summary["metrics"]["all"][k] for k in ("tdg_ratio", "slo_attainment")}}
        failed |= any(c["other_errors"] for c in rep.values())
        print(f"[{mode}] {len(reqs)} requests at {rate:g} req/s in {time.monotonic() - t0:.0f} s", file=sys.stderr,
              flush=True)
    head = (f"# bench_admission_real: {args.policy}, 1 co-located worker, {rate:g} req/s "
            f"({args.load:g} x {args.capacity:g}), {len(reqs)} requests, TTFT SLO {args.ttft_slo:g} s, "
            f"TPOT SLO {args.tpot_slo:g} s, w_p {gain.w_p:.3f}\n")
    lines = ["mode    class  reqs  served  429  TDG    SLO    429_p50_ms  429_p99_ms  429_max_ms  429>50ms  "
             "late  overrun_p50  overrun_p99  overrun_max"]
    for mode, m in doc["modes"].items():
        for cls, c in m["classes"].items():
            r, o = c["reject_s"], c["ttft_overrun_s"]
            ms = lambda v: fmt(None if v is None else v * 1e3, "{:.1f}")
            lines.append(f"{mode:<7} {cls:<5} {c['requests']:>5} {c['served']:>7} {c['rejected']:>4}  "
                         f"{fmt(c['tdg_ratio'])}  {fmt(c['slo_attainment'])}  {ms(r['p50']):>10}  {ms(r['p99']):>10}  "
                         f"{ms(r['max']):>10}  {r['over_50ms']:>8}  {o['late']:>4}  {fmt(o['p50']):>11}  "
                         f"{fmt(o['p99']):>11}  {fmt(o['max']):>11}")
        lines.append(f"{mode:<7} all                              {fmt(m['all']['tdg_ratio'])}  "
                     f"{fmt(m['all']['slo_attainment'])}")
    text = head + "\n".join(lines)
    print(text)
    (out / "table.txt").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(lg.clean_json(doc), indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
