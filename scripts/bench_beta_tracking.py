#!/usr/bin/env python3
"""Does the online correction (§4.1) track a slowdown, in a real engine and in the simulator?

A corrected step time is β·T_pd + δ (``scale_offset``, the default) or β·T_pd
(``scale``, the paper's β alone); see :class:`proserve.scheduler.estimator.OnlineCorrector`.
This runs both side by side (``--correction both``, the default) against two
kinds of slowdown: a multiplicative one (every step takes longer in proportion)
and an additive one (a fixed cost per step, however small the step).

**Engine** (the default). One vLLM CPU engine with the ProServe scheduler plugin
(SlideBatching, co-located) serves a steady stream of requests. Some seconds
in, the engine is deliberately slowed down: its process is put under a cgroup
CPU quota of half a core (``--slowdown cgroup``, where the cgroup v1 cpu
controller is writable), or a second process spins on the engine's core
(``--slowdown hog``; ``--hog-duty``: half of every millisecond by default).
Each correction runs in its own engine process, one after the other, with the
same latency model. From the plugin's step records this prints:

* per phase (before / after the slowdown starts): the slowdown itself
  (Σ T_real / Σ T_pd over the *uncorrected* profiled estimate), β and δ, and
  the estimate's error, corrected and uncorrected (T_pd);
* a timeline, per block of 10 consecutive steps, of measured / estimated time
  for both estimates;
* how many steps after the slowdown the corrected estimate is back within
  10 % of the measured time *to stay* (the median error of the next five
  blocks under 10 %), and the same for the uncorrected one.

The corrected estimate of each step (the one the step was planned with) is
recomputed by replaying the engine's correction over its step records (same
measured times, model times and clocks, so the same β and δ: the replay is
checked against the β each record holds).

Errors compare sums over blocks of 10 consecutive steps: on a time-shared core
single step times are bimodal (a step either is or is not cut by the other
process's time slice), and the scheduler budgets with the expected time.

The latency model must describe *this* machine: ``--profile`` first runs
``python -m proserve.profiler`` on the full grid (about 2 minutes) and uses the model it
writes; the bundled profile was measured on another CPU and β would then start
from that model's error, not from ~1. The engine runs compiled (as the workers
serve and the profiler measures) unless ``--enforce-eager``; eager is the steadier
choice here, because compiled mode compiles for each new batch shape it meets and
those steps take seconds.

**Simulator** (``--sim``). ``python -m proserve.sim``'s ``--true-latency-model`` mode: the
simulated hardware follows a true model that differs from the profile the
estimator starts from, (a) the profile with every coefficient × ``--factor``
(1.5) and (b) the profile plus ``--fixed-ms`` (10 ms) per step (t_c + δ). One
co-located SlideBatching instance serves ``--sim-requests`` requests shaped like
the engine's (prompts 128-1024, outputs 32-160 tokens) arriving at ``--rate``
per second; every step is simulated on its own (no fast-forwarded decode runs),
so each is an observation. The slowdown is there from the first step; the
report is the same, counted from the first step, plus the share of single steps
off by 10 % or more after that (no time-sharing noise in the simulator, unless
``--noise-cv``).

Usage::

    python scripts/bench_beta_tracking.py --profile --enforce-eager [--slowdown hog|cgroup]
        [--correction both|scale|scale_offset] [--window 1.0] [--theta 0.8] [--core 0]
        [--slowdown-after 15] [--duration 35] [--hog-duty 0.5] [--latency-model MODEL.json]
    python scripts/bench_beta_tracking.py --sim [--factor 1.5] [--fixed-ms 10] [--rate 3]
        [--sim-requests 300] [--noise-cv 0] [--latency-model MODEL.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
TOL = 0.10   # "within 10 %"
MODES = ("scale", "scale_offset")
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--correction", choices=["both", *MODES], default="both",
                    help="online correction(s) to run: scale (the paper's beta), scale_offset (beta and a "
                         "per-step offset delta, the default of the plugin and the simulator), or both, side by "
                         "side (default)")
    ap.add_argument("--window", type=float, default=1.0, help="correction window in seconds (default 1.0)")
    ap.add_argument("--theta", type=float, default=0.8, help="correction momentum theta (default 0.8)")
    ap.add_argument("--latency-model", default=None, help="latency-model JSON (default: the bundled CPU profile)")
    ap.add_argument("--json", default=None, help="also write the summary rows to this JSON file")
    eng = ap.add_argument_group("engine")
    eng.add_argument("--core", default="0", help="CPU core of the engine's compute thread; the hog spins there")
    eng.add_argument("--slowdown-after", type=float, default=15.0, help="seconds before the slowdown starts")
    eng.add_argument("--duration", type=float, default=35.0, help="seconds of load in all")
    eng.add_argument("--profile", action="store_true",
                     help="profile this machine first (python -m proserve.profiler) and use that model")
    eng.add_argument("--profile-grid", default="full", help="grid of --profile: quick (~1 min) or full (~2 min)")
    eng.add_argument("--enforce-eager", action="store_true", help="run the engine eager (default: compiled)")
    eng.add_argument("--max-seqs", type=int, default=128,
                     help="engine max_num_seqs; each wave sends twice as many requests (default 128: decode "
                          "steps of tens of ms, well above the OS's millisecond jitter)")
    eng.add_argument("--slowdown", choices=["cgroup", "hog"], default=None,
                     help="cgroup: cap the engine's CPU share with a cgroup quota (default where "
                          "/sys/fs/cgroup/cpu is writable); hog: a second busy process on the engine's core")
    eng.add_argument("--hog-duty", type=float, default=0.5,
                     help="CPU share taken from the engine: the quota left is 1 - this (cgroup), or the share "
                          "of each millisecond the busy process spins (hog; 1 = spin always). Default 0.5")
    eng.add_argument("--record", default=None,
                     help="keep the step records here (one correction; default: a temp file)")
    sim = ap.add_argument_group("simulator")
    sim.add_argument("--sim", action="store_true", help="run the simulator's true-latency-model mode instead")
    sim.add_argument("--factor", type=float, default=1.5, help="(a): the true model is the profile x this")
    sim.add_argument("--fixed-ms", type=float, default=10.0,
                     help="(b): the true model is the profile + this many ms per step")
    sim.add_argument("--rate", type=float, default=3.0, help="requests per second (default 3)")
    sim.add_argument("--sim-requests", type=int, default=300, help="requests (default 300)")
    sim.add_argument("--noise-cv", type=float, default=0.0,
                     help="log-normal step-time noise of the simulator (coefficient of variation; default 0)")
    sim.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# -- the report, shared by the engine and the simulator ----------------------------------------------
def ratio(rows, key="raw"):
    """Σ measured / Σ estimate."""
    return sum(r["time"] for r in rows) / sum(r[key] for r in rows)


def block_err(rows, key):
    """|Σ estimate − Σ measured| / Σ measured over a run of steps: the scheduler budgets
    with the expected time, and on a time-shared core single steps are bimodal."""
    real = sum(r["time"] for r in rows)
    return abs(sum(r[key] for r in rows) - real) / real


def blocks(rows, run=BLOCK):
    return [rows[i:i + run] for i in range(0, len(rows) - run + 1, run)]


def settle(rows, key, tol=TOL, ahead=5):
    """Steps after which the estimate is within ``tol`` to stay: the first block from
    which the median error of the next ``ahead`` blocks is under ``tol``."""
    errs = [block_err(b, key) for b in blocks(rows)]
    for k in range(len(errs) - ahead + 1):
        if statistics.median(errs[k:k + ahead]) < tol:
            return k * BLOCK
    return None


def settle_all(rows, key, tol=TOL):
    """The strict form: steps after which every later block is within ``tol``."""
    errs = [block_err(b, key) for b in blocks(rows)]
    bad = [k for k, e in enumerate(errs) if e >= tol]
    if not bad:
        return 0
    return (bad[-1] + 1) * BLOCK if bad[-1] + 1 < len(errs) else None


def phase_err(rows, key):
    errs = [block_err(b, key) for b in blocks(rows)]
    return statistics.median(errs) if errs else float("nan")


def step_errs(rows, key):
    return [abs(r[key] - r["time"]) / r["time"] for r in rows]


def report(label: str, before: list[dict], after: list[dict], t0: float) -> dict:
    """Print one run's phases, timeline and settling; return its summary row."""
    print(f"error = |sum of estimates - sum of measured| / sum of measured, per block of {BLOCK} steps (median)")
    print(f"{'phase':<8}{'mean step ms':>14}{'sum T_real/sum T_pd':>21}{'beta (median)':>15}"
          f"{'delta ms (median)':>19}{'err corrected':>15}{'err T_pd':>10}")
    for name, rs in (("before", before), ("after", after)):
        if not rs:
            continue
        print(f"{name:<8}{1000 * statistics.mean(r['time'] for r in rs):>14.2f}{ratio(rs):>21.3f}"
              f"{statistics.median(r['beta'] for r in rs):>15.3f}"
              f"{1000 * statistics.median(r['delta'] for r in rs):>19.3f}{phase_err(rs, 'est'):>15.1%}"
              f"{phase_err(rs, 'raw'):>10.1%}")
    if before:
        print(f"measured slowdown: x{ratio(after) / ratio(before):.2f}")
    print(f"timeline (blocks of {BLOCK} steps; measured / estimate; 1.00 = exact; t from the slowdown):")
    print(f"{'t (s)':>7}{'beta':>7}{'delta ms':>10}{'corrected':>11}{'uncorrected':>13}")
    for b in blocks(before)[-3:] + blocks(after)[:12]:
        print(f"{b[-1]['wall'] - t0:>7.2f}{b[-1]['beta']:>7.2f}{1000 * b[-1]['delta']:>10.2f}"
              f"{ratio(b, 'est'):>11.2f}{ratio(b, 'raw'):>13.2f}")
    i, j, k = settle(after, "est"), settle(after, "raw"), settle_all(after, "est")
    row = {"label": label, "steps_after": len(after), "real_over_model": ratio(after),
           "slowdown": ratio(after) / ratio(before) if before else None,
           "settle_steps": i, "settle_s": after[i]["wall"] - t0 if i is not None else None,
           "settle_all_steps": k, "settle_steps_uncorrected": j, "err_after": phase_err(after, "est"),
           "err_after_uncorrected": phase_err(after, "raw"), "single_steps_off": None,
           "beta_end": after[-1]["beta"], "delta_end_ms": 1000 * after[-1]["delta"]}
    if i is None:
        print("corrected estimate: never within 10 % to stay after the slowdown")
    else:
        print(f"corrected estimate within 10 % to stay: {i} steps ({row['settle_s']:.2f} s) after the slowdown")
        late = step_errs(after[i:], "est")
        row["single_steps_off"] = sum(e >= TOL for e in late) / len(late)
        print(f"  after that, single steps off by >= 10 %: {row['single_steps_off']:.1%}")
    print("  every later block within 10 %: " + ("never" if k is None else f"from step {k}"))
    print("uncorrected estimate: " + ("never within 10 % to stay after the slowdown" if j is None
                                       else f"within 10 % to stay after {j} steps"))
    return row


def side_by_side(rows: list[dict]) -> None:
    print(f"\nsummary ('-': never; blocks of {BLOCK} steps):")
    print("  real/model: sum of measured / sum of the uncorrected estimate after the slowdown")
    print("  settle: steps until the corrected estimate is within 10 % to stay (median of the next 5 blocks);"
          " all: until every later block is")
    print("  err: median block error after the slowdown; off: single steps off by >= 10 % after settling")
    print("  other: the other correction replayed over the same step records (open loop): settle, err")
    print(f"{'run':<34}{'real/model':>11}{'settle':>8}{'s':>7}{'all':>6}{'err':>7}{'off':>7}"
          f"{'beta end':>9}{'delta ms':>9}{'other':>14}")

    def opt(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        o = r.get("other")
        other = f"{opt(o['settle_steps'], 'd')}, {o['err_after']:.1%}" if o else ""
        print(f"{r['label']:<34}{r['real_over_model']:>11.2f}{opt(r['settle_steps'], 'd'):>8}"
              f"{opt(r['settle_s'], '.2f'):>7}{opt(r['settle_all_steps'], 'd'):>6}{r['err_after']:>7.1%}"
              f"{opt(r['single_steps_off'], '.1%'):>7}{r['beta_end']:>9.2f}{r['delta_end_ms']:>9.2f}{other:>14}")


# -- the correction over a record, as the engine ran it ----------------------------------------------
def replay(model, rows: list[dict], mode: str, theta: float, window: float, key: str = "est") -> None:
    """Add ``raw`` (T_pd), ``key`` (the corrected estimate the step was planned with) and, for
    the engine's own correction (``key="est"``), ``delta`` to each step record, by running the
    correction over the records again (checked against the β each record holds). Another key
    replays another correction over the same measured steps (open loop: the plans were made
    with the engine's own)."""
    from proserve.scheduler.estimator import Estimator, OnlineCorrector

    est = Estimator(model, OnlineCorrector(theta, window, mode=mode))
    for r in rows:
        raw = model.batch_time([tuple(p) for p in r["prefills"]], r["decodes"])
        r["raw"], r[key] = raw, est.corrected(raw)
        beta = est.observe_time(r["time"], raw, r["wall"])
        if key != "est":
            continue
        r["delta"] = est.delta
        if abs(beta - r["beta"]) > 1e-9 * max(1.0, beta):
            raise SystemExit(f"error: replaying the correction gives beta {beta} at step {r['step']}, the engine "
                             f"recorded {r['beta']}: not the engine's correction or latency model")


# -- the engine ------------------------------------------------------------------------------------
def run_engine(args, record: str) -> tuple[float, float]:
    """Serve load for --duration seconds; return (slowdown start, stop) wall times."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.core
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = {"local_policy": "slide_batching", "mode": "colocated", "record_steps": record,
           "theta": args.theta, "window_s": args.window, "correction": args.correction}
    if args.latency_model:
        cfg["latency_model"] = str(Path(args.latency_model).resolve())
    llm = LLM(model=str(ROOT / "prefill" / "models" / "tiny-llama"), load_format="dummy",
              skip_tokenizer_init=True, max_model_len=2048, block_size=32, dtype="bfloat16",
              enforce_eager=args.enforce_eager, max_num_seqs=args.max_seqs, max_num_batched_tokens=4096,
              scheduler_cls="proserve.prefill.engine_scheduler.ProServeScheduler",
              additional_config={"proserve": cfg})
    rng = random.Random(0)
    hog: dict = {}

    def start_hog():
        time.sleep(args.slowdown_after)
        hog["start"] = time.time()
        if args.slowdown == "cgroup":
            # the engine (in this process) gets 1 - args.hog_duty of a core from now on,
            # enforced by the kernel every 10 ms
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


def profile_here(args) -> str:
    out = Path(tempfile.mkdtemp(prefix="beta-profile-")) / "model.json"
    # the same core binding and block size as the engine below
    cmd = [sys.executable, "-m", "proserve.profiler", "--grid", args.profile_grid, "--out", str(out), "--cpu-bind", args.core,
           "--block-size", "32"]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    print("+ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise SystemExit(f"error: profiling failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    print(p.stdout.strip().splitlines()[-1], flush=True)
    return str(out)


def engine_one(args) -> dict:
    """One engine run with one correction: its report and summary row."""
    record = args.record or tempfile.mktemp(suffix=".jsonl", prefix=f"beta-{args.correction}-")
    t_slow, t_stop = run_engine(args, record)
    from proserve.profiler import modelfile
    model = modelfile.load(args.latency_model or modelfile.CPU_TINY)
    with open(record) as f:
        rows = [json.loads(line) for line in f]
    replay(model, rows, args.correction, args.theta, args.window)
    other = next(m for m in MODES if m != args.correction)
    replay(model, rows, other, args.theta, args.window, key="est_other")
    # the first steps include warm-up; skip two seconds
    start = rows[0]["wall"] + 2.0
    before = [r for r in rows if start <= r["wall"] < t_slow]
    after = [r for r in rows if t_slow <= r["wall"] < t_stop]
    if not before or not after:
        raise SystemExit("error: no steps before or after the slowdown; lengthen --duration")
    print(f"latency model: {args.latency_model or modelfile.CPU_TINY}")
    print(f"correction: {args.correction}; slowdown: {args.slowdown} ({args.hog_duty:.0%} of the core taken "
          f"from the engine)")
    print(f"steps: {len(before)} before the slowdown, {len(after)} after (window {args.window} s, theta "
          f"{args.theta}, engine core {args.core}, {'eager' if args.enforce_eager else 'compiled'})")
    row = report(f"engine {args.slowdown} {args.correction}", before, after, t_slow)
    i = settle(after, "est_other")
    row["other"] = {"correction": other, "settle_steps": i, "err_after": phase_err(after, "est_other")}
    print(f"the same steps with the {other} correction (replayed over the records, open loop): "
          f"{'never' if i is None else i} steps to within 10 % to stay, median block error after "
          f"{row['other']['err_after']:.1%}")
    print(f"step records: {record}", flush=True)
    return row


def engine(args) -> list[dict]:
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
    if args.correction != "both":
        return [engine_one(args)]
    # one engine process per correction, one after the other, with the same model
    rows = []
    for mode in MODES:
        out = tempfile.mktemp(suffix=".json", prefix=f"beta-{mode}-")
        cmd = [sys.executable, __file__, "--correction", mode, "--window", str(args.window),
               "--theta", str(args.theta), "--core", args.core, "--slowdown-after", str(args.slowdown_after),
               "--duration", str(args.duration), "--max-seqs", str(args.max_seqs), "--slowdown", args.slowdown,
               "--hog-duty", str(args.hog_duty), "--json", out]
        if args.latency_model:
            cmd += ["--latency-model", args.latency_model]
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        print(f"\n=== {mode} ===\n+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        rows += json.loads(Path(out).read_text())
    return rows


# -- the simulator ---------------------------------------------------------------------------------
def sim(args) -> list[dict]:
    from proserve.profiler import modelfile
    from proserve.scheduler import LatencyModel, Request
    from proserve.scheduler.estimator import COEFFS, OnlineCorrector
    from proserve.sim.cluster import SimConfig, Simulator

    class Recorder(OnlineCorrector):
        """The correction, noting each step's measured time and the estimate it was planned with."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.rows: list[dict] = []

        def observe(self, t_real, t_est, now, steps=1):
            row = {"time": t_real, "raw": t_est, "est": self.beta * t_est + self.delta * steps, "wall": now}
            beta = super().observe(t_real, t_est, now, steps)
            self.rows.append({**row, "beta": beta, "delta": self.delta})
            return beta

    model = modelfile.load(args.latency_model or modelfile.CPU_TINY)
    c = {k: getattr(model, k) for k in COEFFS}
    truths = {f"x{args.factor:g}": LatencyModel(**{k: v * args.factor for k, v in c.items()}),
              f"+{args.fixed_ms:g} ms/step": LatencyModel(**{**c, "t_c": c["t_c"] + args.fixed_ms / 1000})}
    rng = random.Random(args.seed)
    t, reqs = 0.0, []
    for i in range(args.sim_requests):
        t += rng.expovariate(args.rate)
        prio = rng.choice(["high", "low"])
        reqs.append((f"r{i}", prio, 2.0 if prio == "high" else 1.0, t, rng.randint(128, 1024), rng.randint(32, 160)))
    modes = MODES if args.correction == "both" else (args.correction,)
    print(f"latency model: {args.latency_model or modelfile.CPU_TINY}; {args.sim_requests} requests at "
          f"{args.rate:g}/s, one co-located SlideBatching instance; noise cv {args.noise_cv:g}")
    rows = []
    for name, truth in truths.items():
        for mode in modes:
            cfg = SimConfig(local_policy="slide_batching", global_policy="round_robin", true_model=truth,
                            fast_forward=False, noise_cv=args.noise_cv, theta=args.theta, window_s=args.window,
                            seed=args.seed)
            s = Simulator(model, cfg)
            rec = s.p_states[0].estimator.corrector = Recorder(args.theta, args.window, mode=mode)
            s.run([Request(rid, p, w, 1.0, 0.1, a, pl, ol) for rid, p, w, a, pl, ol in reqs])
            print(f"\n=== true model: profile {name}; correction {mode}; {len(rec.rows)} steps ===")
            rows.append(report(f"sim {name} {mode}", [], rec.rows, rec.rows[0]["wall"] - rec.rows[0]["time"]))
    return rows


def main(argv=None):
    args = parse_args(argv)
    rows = sim(args) if args.sim else engine(args)
    if len(rows) > 1:
        side_by_side(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
