#!/usr/bin/env python3
"""Does the online correction (β, §4.1) track a deliberate slowdown of a real engine?

One vLLM CPU engine with the ProServe scheduler plugin (SlideBatching,
co-located) serves a steady stream of requests. Some seconds in, the engine is
deliberately slowed down, so every step takes longer: by default its process
is put under a cgroup CPU quota of half a core (``--slowdown cgroup``, where
the cgroup v1 cpu controller is writable), or a second process spins on the
engine's core (``--slowdown hog``; ``--hog-duty``: half of every millisecond by
default). From the plugin's step records this prints:

* per phase (before / after the slowdown starts): the slowdown itself
  (Σ T_real / Σ T_pd over the *uncorrected* profiled estimate), β, and the
  estimate's error, corrected (β·T_pd) and uncorrected (T_pd);
* a timeline, per block of 10 consecutive steps, of measured / estimated time
  for both estimates;
* how many steps after the slowdown the corrected estimate is back within
  10 % of the measured time *to stay* (the median error of the next five
  blocks under 10 %), and the same for the uncorrected one.

Errors compare sums over blocks of 10 consecutive steps: on a time-shared core
single step times are bimodal (a step either is or is not cut by the other
process's time slice), and the scheduler budgets with the expected time.

The latency model must describe *this* machine: ``--profile`` first runs
``python -m profiler`` on the full grid (about 2 minutes) and uses the model it
writes; the bundled profile was measured on another CPU and β would then start
from that model's error, not from ~1. The engine runs compiled (as the workers
serve and the profiler measures) unless ``--enforce-eager``; eager is the steadier
choice here, because compiled mode compiles for each new batch shape it meets and
those steps take seconds.

Usage::

    python scripts/bench_beta_tracking.py --profile --enforce-eager [--window 1.0] [--theta 0.8]
        [--core 0] [--slowdown-after 15] [--duration 35] [--hog-duty 0.5] [--latency-model MODEL.json]
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
CGROUP = Path("/sys/fs/cgroup/cpu/proserve-beta-bench")   # cgroup v1 cpu controller
BLOCK = 10   # steps per block when comparing summed estimate and measured time
sys.path.insert(0, str(ROOT))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=1.0, help="β window in seconds (plugin default 1.0)")
    ap.add_argument("--theta", type=float, default=0.8, help="β momentum θ (plugin default 0.8)")
    ap.add_argument("--core", default="0", help="CPU core of the engine's compute thread; the hog spins there")
    ap.add_argument("--slowdown-after", type=float, default=15.0, help="seconds before the slowdown starts")
    ap.add_argument("--duration", type=float, default=35.0, help="seconds of load in all")
    ap.add_argument("--latency-model", default=None, help="latency-model JSON (default: the bundled CPU profile)")
    ap.add_argument("--profile", action="store_true",
                    help="profile this machine first (python -m profiler) and use that model")
    ap.add_argument("--profile-grid", default="full", help="grid of --profile: quick (~1 min) or full (~2 min)")
    ap.add_argument("--enforce-eager", action="store_true", help="run the engine eager (default: compiled)")
    ap.add_argument("--max-seqs", type=int, default=128,
                    help="engine max_num_seqs; each wave sends twice as many requests (default 128: decode "
                         "steps of tens of ms, well above the OS's millisecond jitter)")
    ap.add_argument("--slowdown", choices=["cgroup", "hog"], default=None,
                    help="cgroup: cap the engine's CPU share with a cgroup quota (default where "
                         "/sys/fs/cgroup/cpu is writable); hog: a second busy process on the engine's core")
    ap.add_argument("--hog-duty", type=float, default=0.5,
                    help="CPU share taken from the engine: the quota left is 1 - this (cgroup), or the share "
                         "of each millisecond the busy process spins (hog; 1 = spin always). Default 0.5")
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
              enforce_eager=args.enforce_eager, max_num_seqs=args.max_seqs, max_num_batched_tokens=4096,
              scheduler_cls="prefill.engine_scheduler.ProServeScheduler",
              additional_config={"proserve": cfg})
    import random
    rng = random.Random(0)
    hog: dict = {}

    def start_hog():
        time.sleep(args.slowdown_after)
        hog["start"] = time.time()
        if args.slowdown == "cgroup":
            # the engine (in this process) gets args.hog_duty of a core from now on, enforced
            # by the kernel every 10 ms: a steady, multiplicative slowdown
            (CGROUP / "cpu.cfs_period_us").write_text("10000")
            (CGROUP / "cpu.cfs_quota_us").write_text(str(int(10000 * (1 - args.hog_duty))))
            return
        if args.hog_duty >= 1:
            code = "while True: pass"
        else:
            # busy for duty x 1 ms, then sleep: a steady share of the core rather than
            # whole scheduler time slices, which an engine step of a few ms either gets
            # cut by or not (a 100 % spinner made steps 2x-50x slower at random here)
            busy, idle = args.hog_duty * 1e-3, (1 - args.hog_duty) * 1e-3
            code = ("import time\nc = time.perf_counter\nwhile True:\n    t = c()\n"
                    f"    while c() - t < {busy!r}: pass\n    time.sleep({idle!r})")
        hog["proc"] = subprocess.Popen(["taskset", "-c", args.core, sys.executable, "-c", code])

    if args.slowdown == "cgroup":
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "cpu.cfs_quota_us").write_text("-1")
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    t0 = time.time()
    threading.Thread(target=start_hog, daemon=True).start()
    try:
        while time.time() - t0 < args.duration:
            n = 2 * args.max_seqs
            prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, 1000) for _ in range(rng.randint(128, 1024))])
                       for _ in range(n)]
            params = [SamplingParams(max_tokens=rng.randint(32, 160), ignore_eos=True,
                                     extra_args={"priority_class": rng.choice(["high", "low"])})
                      for _ in range(n)]
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        if args.slowdown == "cgroup":
            (CGROUP / "cpu.cfs_quota_us").write_text("-1")
            (CGROUP.parent / "cgroup.procs").write_text(str(os.getpid()))
            CGROUP.rmdir()
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


def blocks(rows, run=BLOCK):
    return [rows[i:i + run] for i in range(0, len(rows) - run + 1, run)]


def settle(rows, key, tol=0.10, ahead=5):
    """Steps after which the estimate is within ``tol`` to stay: the first block from
    which the median error of the next ``ahead`` blocks is under ``tol``."""
    errs = [block_err(b, key) for b in blocks(rows)]
    for k in range(len(errs) - ahead + 1):
        if statistics.median(errs[k:k + ahead]) < tol:
            return k * BLOCK
    return None


def phase_err(rows, key):
    errs = [block_err(b, key) for b in blocks(rows)]
    return statistics.median(errs) if errs else float("nan")


def profile_here(args) -> str:
    out = Path(tempfile.mkdtemp(prefix="beta-profile-")) / "model.json"
    # the same core binding and block size as the engine below
    cmd = [sys.executable, "-m", "profiler", "--grid", args.profile_grid, "--out", str(out), "--cpu-bind", args.core,
           "--block-size", "32"]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    print("+ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"error: profiling failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    print(p.stdout.strip().splitlines()[-1], flush=True)
    return str(out)


def main():
    args = parse_args()
    if not 0 < args.hog_duty <= 1:
        raise SystemExit(f"error: --hog-duty must be in (0, 1], got {args.hog_duty}")
    if args.slowdown is None:
        args.slowdown = "cgroup" if os.access(CGROUP.parent, os.W_OK) else "hog"
    if args.slowdown == "cgroup" and not os.access(CGROUP.parent, os.W_OK):
        raise SystemExit(f"error: --slowdown cgroup needs a writable {CGROUP.parent} (cgroup v1 cpu controller)")
    if args.slowdown == "cgroup" and args.hog_duty >= 1:
        raise SystemExit("error: --hog-duty 1 with --slowdown cgroup would leave the engine no CPU")
    if args.profile:
        args.latency_model = profile_here(args)
    record = args.record or tempfile.mktemp(suffix=".jsonl", prefix="beta-")
    t_hog, t_stop = run_engine(args, record)
    from profiler import modelfile
    model = modelfile.load(args.latency_model or modelfile.CPU_TINY)
    rows = []
    for line in open(record):
        r = json.loads(line)
        raw = model.batch_time([tuple(p) for p in r["prefills"]], r["decodes"])
        rows.append({**r, "raw": raw})
    # the first steps include warm-up; skip two seconds
    start = rows[0]["wall"] + 2.0
    before = [r for r in rows if start <= r["wall"] < t_hog]
    after = [r for r in rows if t_hog <= r["wall"] < t_stop]
    if not before or not after:
        raise SystemExit("error: no steps before or after the slowdown; lengthen --duration")

    def ratio(rs, key="raw"):
        return sum(r["time"] for r in rs) / sum(r[key] for r in rs)

    print(f"latency model: {args.latency_model or modelfile.CPU_TINY}")
    print(f"slowdown: {args.slowdown} ({args.hog_duty:.0%} of the core taken from the engine)")
    print(f"steps: {len(before)} before the slowdown, {len(after)} after "
          f"(window {args.window} s, theta {args.theta}, engine core {args.core}, "
          f"{'eager' if args.enforce_eager else 'compiled'})")
    print(f"error = |sum of estimates - sum of measured| / sum of measured, per block of {BLOCK} steps (median)")
    print(f"{'phase':<8}{'mean step ms':>14}{'sum T_real/sum T_pd':>21}{'beta (median)':>15}"
          f"{'err beta*T_pd':>15}{'err T_pd':>10}")
    for name, rs in (("before", before), ("after", after)):
        print(f"{name:<8}{1000 * statistics.mean(r['time'] for r in rs):>14.2f}{ratio(rs):>21.3f}"
              f"{statistics.median(r['beta'] for r in rs):>15.3f}{phase_err(rs, 'est'):>15.1%}"
              f"{phase_err(rs, 'raw'):>10.1%}")
    print(f"measured slowdown: x{ratio(after) / ratio(before):.2f}")
    print("timeline (blocks of 10 steps; measured / estimate; 1.00 = exact):")
    print(f"{'t (s)':>7}{'beta':>7}{'corrected':>11}{'uncorrected':>13}")
    for b in blocks(before)[-3:] + blocks(after)[:12]:
        t = b[-1]["wall"] - t_hog
        print(f"{t:>7.2f}{b[-1]['beta']:>7.2f}{ratio(b, 'est'):>11.2f}{ratio(b, 'raw'):>13.2f}")
    i, j = settle(after, "est"), settle(after, "raw")
    if i is None:
        print("beta-corrected estimate: never within 10 % to stay after the slowdown")
    else:
        print(f"beta-corrected estimate within 10 % to stay: {i} steps "
              f"({after[i]['wall'] - t_hog:.2f} s) after the slowdown started")
    print("uncorrected estimate: " + ("never within 10 % to stay after the slowdown" if j is None
                                       else f"within 10 % to stay after {j} steps"))
    print(f"step records: {record}")


if __name__ == "__main__":
    main()
