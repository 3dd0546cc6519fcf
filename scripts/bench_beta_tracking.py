#!/usr/bin/env python3
"""Does the online correction (β, §4.1) track a deliberate slowdown of a real engine?

One vLLM CPU engine with the ProServe scheduler plugin (SlideBatching,
co-located) serves a steady stream of requests. Some seconds in, a second
process that spins on the engine's compute core is started, so every step gets
slower. From the plugin's step records this prints, per phase:

* the slowdown itself: Σ T_real / Σ T_pd (measured over the *uncorrected*
  profiled estimate) before and after the busy process starts;
* the estimate's error, corrected (β·T_pd) and uncorrected (T_pd);
* how many steps (and seconds) after the slowdown the corrected estimate is back
  within 10 % of the measured time, and the same for the uncorrected estimate.

Errors compare sums over blocks of 10 consecutive steps: on a time-shared core
single step times are bimodal (a step either is or is not cut by the other
process's time slice), and the scheduler budgets with the expected time.

Usage::

    python scripts/bench_beta_tracking.py [--window 1.0] [--theta 0.8] [--core 0]
        [--slowdown-after 6] [--duration 16] [--latency-model profiler/models/tiny-llama-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 10   # steps per block when comparing summed estimate and measured time
sys.path.insert(0, str(ROOT))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=1.0, help="β window in seconds (plugin default 1.0)")
    ap.add_argument("--theta", type=float, default=0.8, help="β momentum θ (plugin default 0.8)")
    ap.add_argument("--core", default="0", help="CPU core of the engine's compute thread; the hog spins there")
    ap.add_argument("--slowdown-after", type=float, default=6.0, help="seconds before the busy process starts")
    ap.add_argument("--duration", type=float, default=16.0, help="seconds of load in all")
    ap.add_argument("--latency-model", default=None, help="latency-model JSON (default: the bundled CPU profile)")
    ap.add_argument("--record", default=None, help="keep the step records here (default: a temp file)")
    return ap.parse_args()


def run_engine(args, record: str) -> tuple[float, float]:
    """Serve load for --duration seconds; return (hog start, hog stop) wall times."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.core
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = {"local_policy": "slide_batching", "mode": "colocated", "record_steps": record,
           "theta": args.theta, "window_s": args.window}
    if args.latency_model:
        cfg["latency_model"] = str(Path(args.latency_model).resolve())
    llm = LLM(model=str(ROOT / "prefill" / "models" / "tiny-llama"), load_format="dummy",
              skip_tokenizer_init=True, max_model_len=2048, block_size=32, dtype="bfloat16",
              enforce_eager=True, max_num_seqs=32, max_num_batched_tokens=4096,
              scheduler_cls="prefill.engine_scheduler.ProServeScheduler",
              additional_config={"proserve": cfg})
    import random
    rng = random.Random(0)
    hog: dict = {}

    def start_hog():
        time.sleep(args.slowdown_after)
        hog["start"] = time.time()
        hog["proc"] = subprocess.Popen(["taskset", "-c", args.core, sys.executable, "-c", "while True: pass"])

    t0 = time.time()
    threading.Thread(target=start_hog, daemon=True).start()
    try:
        while time.time() - t0 < args.duration:
            n = 64
            prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, 1000) for _ in range(rng.randint(64, 512))])
                       for _ in range(n)]
            params = [SamplingParams(max_tokens=rng.randint(16, 96), ignore_eos=True,
                                     extra_args={"priority_class": rng.choice(["high", "low"])})
                      for _ in range(n)]
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        if "proc" in hog:
            hog["proc"].kill()
            hog["proc"].wait()
        hog["stop"] = time.time()
    return hog.get("start", float("inf")), hog["stop"]


def block_err(rows, key):
    """|Σ estimate − Σ measured| / Σ measured over a run of steps: the scheduler budgets
    with the expected time, and on a time-shared core single steps are bimodal."""
    real = sum(r["time"] for r in rows)
    return abs(sum(r[key] for r in rows) - real) / real


def settle(rows, key, tol=0.10, run=BLOCK):
    """Index of the first step from which the next ``run`` steps' summed estimate is within ``tol``."""
    for i in range(len(rows) - run + 1):
        if block_err(rows[i:i + run], key) < tol:
            return i
    return None


def phase_err(rows, key, run=BLOCK):
    errs = [block_err(rows[i:i + run], key) for i in range(0, len(rows) - run + 1, run)]
    return statistics.median(errs) if errs else float("nan")


def main():
    args = parse_args()
    record = args.record or tempfile.mktemp(suffix=".jsonl", prefix="beta-")
    t_hog, t_stop = run_engine(args, record)
    from profiler import modelfile
    model = modelfile.load(args.latency_model or modelfile.CPU_TINY)
    rows = []
    for line in open(record):
        r = json.loads(line)
        raw = model.batch_time([tuple(p) for p in r["prefills"]], r["decodes"])
        rows.append({**r, "raw": raw})
    # the first steps include warm-up; skip one second
    start = rows[0]["wall"] + 1.0
    before = [r for r in rows if start <= r["wall"] < t_hog]
    after = [r for r in rows if t_hog <= r["wall"] < t_stop]
    if not before or not after:
        raise SystemExit("error: no steps before or after the slowdown; lengthen --duration")

    def med(rs, f):
        return statistics.median(f(r) for r in rs)

    print(f"steps: {len(before)} before the busy process, {len(after)} after "
          f"(window {args.window} s, theta {args.theta}, engine core {args.core})")
    print(f"error = |sum of estimates - sum of measured| / sum of measured, per block of {BLOCK} steps (median)")
    print(f"{'phase':<8}{'mean step ms':>14}{'sum T_real/sum T_pd':>21}{'beta (median)':>15}"
          f"{'err beta*T_pd':>15}{'err T_pd':>10}")
    for name, rs in (("before", before), ("after", after)):
        ratio = sum(r["time"] for r in rs) / sum(r["raw"] for r in rs)
        print(f"{name:<8}{1000 * statistics.mean(r['time'] for r in rs):>14.2f}{ratio:>21.3f}"
              f"{med(rs, lambda r: r['beta']):>15.3f}{phase_err(rs, 'est'):>15.1%}{phase_err(rs, 'raw'):>10.1%}")

    def ratio(rs):
        return sum(r["time"] for r in rs) / sum(r["raw"] for r in rs)
    slow = ratio(after) / ratio(before)
    print(f"slowdown from the busy process: x{slow:.2f}")
    i = settle(after, "est")
    j = settle(after, "raw")
    if i is None:
        print(f"beta-corrected estimate: never back within 10 % ({BLOCK}-step sums) after the slowdown")
    else:
        print(f"beta-corrected estimate back within 10 % of measured ({BLOCK}-step sums): {i} steps "
              f"({after[i]['wall'] - t_hog:.2f} s) after the busy process started")
    print("uncorrected estimate: " + ("never within 10 % after the slowdown" if j is None
                                       else f"within 10 % after {j} steps"))
    print(f"step records: {record}")


if __name__ == "__main__":
    main()
