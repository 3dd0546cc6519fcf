#!/usr/bin/env python3
"""Simulator fidelity: the same workloads through the real cluster and through the
simulator, side by side, per priority class, with the error of each figure.

    python scripts/bench_fidelity.py                       # real runs + simulation + table
    python scripts/bench_fidelity.py --sim-only            # re-simulate against saved real runs

For every deployment (``colocated``: one co-located worker; ``1p1d``: one prefill
and one decode worker, KV over ZeroMQ with CURVE), every local policy and every
rate, it

1. starts the cluster with ``scripts/launch_cluster.sh`` (the dispatcher in front,
   API key to the workers, GoRouting, the given latency model in every process),
   sends a few warm-up requests, then replays the workload at each rate through
   the dispatcher with :mod:`proserve.bench.loadgen` (streamed, every token
   timestamped at the client), waiting for the workers to drain between rates;
2. simulates the *same* request list (``make_workload``: same arrivals, lengths,
   classes and SLOs) with :func:`proserve.sim.cluster.simulate`, one instance or
   1P1D, the same policy, latency model, KV block count and block size;
3. prints one table: per deployment × policy × rate × class, TTFT and TPOT
   P50/P90/P99, TDG_Ratio and SLO attainment, real and simulated, and the
   relative error (latencies) or the difference (TDG_Ratio, SLO attainment).

The targets (issue 12): ≤ 10 % relative error on P50 and P90 latencies and
TDG_Ratio within 0.03. Rows that miss are marked. Run it on a quiet machine
(it measures time); it takes about 45 minutes with the defaults. Outputs go to
``--out`` (per run: requests.jsonl + summary.json of the real run, the
simulated records, worker logs and step records) and the table to ``--table``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from proserve.bench import loadgen as lg  # noqa: E402
from proserve.bench.engine_policies import parse_metrics, wait_idle  # noqa: E402
from proserve.bench.scaled_model import make_scaled_model  # noqa: E402
from proserve.bench.loadgen.report import load_records  # noqa: E402
from proserve.bench.loadgen.scoring import to_request  # noqa: E402
from proserve.profiler.modelfile import load as load_model  # noqa: E402
from proserve.scheduler.tdg import summarize  # noqa: E402
from proserve.sim.cluster import SimConfig, simulate  # noqa: E402

DEPLOYMENTS = ("colocated", "1p1d")
FIGURES = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99")
# one API key per class for the dispatcher (--keys) and the load generator (--api proserve)
CLASS_KEYS = {"high": "sk-fidelity-high-0001", "low": "sk-fidelity-low-00001"}
KEYS_FILE = Path("out/fidelity-keys.toml")
LAT_TOL = 0.10       # relative error on P50/P90 latencies
TDG_TOL = 0.03       # absolute difference on TDG_Ratio


# --- the real cluster ----------------------------------------------------------------------

class Cluster:
    """``scripts/launch_cluster.sh`` for one deployment and local policy; stopped on exit."""

    def __init__(self, deployment: str, policy: str, run_dir: Path, args, classes_file: Path, w_p: float,
                 dispatcher_args: tuple = (), policy_params: tuple = (), record_steps: bool = True):
        """``policy_params``: ``KEY=VALUE`` items for the prefill (co-located) worker's
        ``--policy-param``; ``record_steps=False``: no step records (writing them costs the
        plugin engine time, docs/results.md §4.1), as engine_policies' ``--no-record-steps``."""
        self.run_dir = run_dir
        self.url = f"http://127.0.0.1:{args.port}"
        self.worker_urls = [f"http://127.0.0.1:{args.port + 100}"]
        if run_dir.exists():
            subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "-d", str(run_dir)],
                           capture_output=True)
            # the step records stay (the workers append; runs are told apart by time), so that a
            # later invocation adding a rate keeps the earlier runs' steps for the served fit
            for f in run_dir.glob("*"):
                if f.is_file() and not f.name.startswith("steps-"):
                    f.unlink()
        run_dir.mkdir(parents=True, exist_ok=True)
        common = (f"--model {args.model} --load-format dummy --classes {classes_file} --w-p {w_p!r} "
                  f"--latency-model {args.latency_model} --block-size {args.block_size} "
                  f"--max-model-len {args.max_model_len}")
        pargs = f"--local-policy {policy} {common}" + "".join(f" --policy-param {p}" for p in policy_params)
        if record_steps:
            pargs += f" --record-steps {run_dir}/steps-prefill.jsonl"
        cmd = ["bash", str(ROOT / "scripts/launch_cluster.sh"), "-d", str(run_dir), "-p", str(args.port),
               "--keys", str(KEYS_FILE.resolve()),
               "--ports", f"{args.port + 100},{args.port + 200},{args.port + 300}", "-P", "1",
               "--timeout", "600"]
        if deployment == "colocated":
            cmd += ["--colocated"]
        else:
            # 'stock': vLLM's own decode scheduling (as 'off'), with its steps timed and recorded
            dargs = (f"{common} --local-policy stock"
                     + (f" --record-steps {run_dir}/steps-decode.jsonl" if record_steps else "")
                     + " -- --no-enable-prefix-caching")
            cmd += ["-D", "1", "--decode-args", dargs]
            self.worker_urls.append(f"http://127.0.0.1:{args.port + 200}")
        cmd += ["--prefill-args", pargs + " -- --no-enable-prefix-caching",
                "--", "--classes", str(classes_file), "--w-p", repr(w_p), "--latency-model", args.latency_model,
                *dispatcher_args]
        self.cmd = cmd
        self.key = None
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        self.key = (run_dir / "secrets" / "worker.key").read_text().strip()
        print(f"[{deployment}/{policy}] cluster up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    def busy(self) -> float:
        n = 0.0
        for url in self.worker_urls:
            req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {self.key}"})
            with urllib.request.urlopen(req, timeout=5) as r:
                m = parse_metrics(r.read().decode())
            n += m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        return n

    def drain(self, timeout: float = 300) -> float:
        return wait_idle(self.busy, timeout, "cluster")

    def kv_blocks(self) -> int:
        """KV blocks of the prefill (or co-located) worker, from vLLM's cache_config_info gauge."""
        import re
        req = urllib.request.Request(self.worker_urls[0] + "/metrics",
                                     headers={"Authorization": f"Bearer {self.key}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            m = re.search(r'vllm:cache_config_info\{[^}]*\bnum_gpu_blocks="(\d+)"', r.read().decode())
        if not m:
            raise RuntimeError("the worker's /metrics has no vllm:cache_config_info num_gpu_blocks")
        return int(m.group(1))

    def stop(self) -> None:
        subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "-d", str(self.run_dir)],
                       capture_output=True)


def workload(args, rate: float, classes, seed: int | None = None, n: int | None = None) -> list:
    n = n or max(10, math.ceil(rate * args.duration))
    return lg.make_workload("azure", rate, n, args.seed if seed is None else seed, classes, None,
                            args.prompt_div, args.output_div, None, args.max_model_len)


DELAYS = ("dispatch_delay", "handoff_delay", "stream_delay")


def _steps(path: Path, t_from: float) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        s = json.loads(line)
        if s["wall"] >= t_from:
            out.append(s)
    return out


def _lifecycle(steps: list[dict]) -> list[dict]:
    """Per request, in admission order: start of its first step, end of the step that
    completed its prefill (prompt_len tokens scheduled), end of its first step."""
    reqs: dict[str, dict] = {}
    for s in steps:
        start = s["wall"] - s["time"]
        for rid, _cls, prompt, _chunk in s.get("admitted", []):
            reqs.setdefault(rid, {"prompt": prompt, "done": 0, "first_start": start, "first_end": s["wall"]})
        for rid, n in s.get("scheduled", []):
            r = reqs.get(rid)
            if r is None or "prefill_end" in r:
                continue
            r["done"] += n
            if r["prompt"] is not None and r["done"] >= r["prompt"]:
                r["prefill_end"] = s["wall"]
    return list(reqs.values())


def _median(v: list[float]) -> float:
    v = sorted(v)
    return v[len(v) // 2] if v else 0.0


def calibrate(cl: Cluster, deployment: str, args, classes, out: Path) -> dict:
    """What the cluster adds around the engine steps, measured on an idle cluster: requests
    sent one at a time, each timed at the client and matched to the workers' step records.

    * dispatch_delay: client send → start of the request's first prefill step (the HTTP hops
      client → dispatcher → worker API server → engine core, and the dispatcher's work);
    * handoff_delay (1p1d): prefill end → start of the decode worker's first step for it,
      less the modelled KV transfer (the prefill leg's answer, the decode leg's HTTP hops);
    * stream_delay: end of the step that made the first token → the client has it.

    Medians over the probe requests; the simulator adds them as constants
    (``SimConfig.dispatch_delay/handoff_delay/stream_delay``)."""
    reqs = workload(args, 1.0, classes, seed=args.seed + 2000, n=args.calibration_requests)
    t_from = time.time()
    results = []
    for q in reqs:
        q.arrival = 0.0
        run = asyncio.run(lg.replay([q], lg.ClientConfig(cl.url, api="proserve", class_keys=CLASS_KEYS,
                                                         seed=args.seed + 2000, start_delay=0.05,
                                                         request_timeout=args.timeout)))
        r = run.results[0]
        if not r.ok:
            raise RuntimeError(f"calibration request failed: {r.error}")
        results.append((run.t0_unix + r.sent, run.t0_unix + r.token_times[0], q.prompt_len))
        time.sleep(0.2)
    cl.drain()
    pre = _lifecycle(_steps(cl.run_dir / "steps-prefill.jsonl", t_from))
    dec = _lifecycle(_steps(cl.run_dir / "steps-decode.jsonl", t_from)) if deployment == "1p1d" else []
    if len(pre) != len(results) or (dec and len(dec) != len(results)):
        raise RuntimeError(f"calibration: {len(results)} requests but {len(pre)} prefill / {len(dec)} decode "
                           "requests in the step records")
    model = load_model(args.latency_model)
    kv_bytes = model.metadata.get("kv_bytes_per_token", 0)
    rows = []
    for i, (sent, first, prompt) in enumerate(results):
        p = pre[i]
        row = {"prompt": prompt, "dispatch_delay": p["first_start"] - sent}
        if dec:
            d = dec[i]
            kv = (prompt - 1) * kv_bytes / args.kv_bandwidth
            row["handoff_delay"] = d["first_start"] - p["prefill_end"] - kv
            row["stream_delay"] = first - d["first_end"]
        else:
            row["stream_delay"] = first - p["prefill_end"]
        rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    delays = {k: max(0.0, _median([r[k] for r in rows if k in r])) for k in DELAYS}
    delays["requests"] = len(rows)
    return delays


def run_real(deployment: str, policy: str, rates: list[float], args, classes, classes_file: Path,
             gain) -> dict:
    """Replay every rate through one cluster; {rate: {"kv_blocks"}} and the run directories."""
    base = Path(args.out) / deployment / policy
    cl = Cluster(deployment, policy, base / "run", args, classes_file, gain.w_p)
    info = {}
    try:
        cfg = lg.ClientConfig(cl.url, api="proserve", class_keys=CLASS_KEYS, seed=args.seed,
                              request_timeout=args.timeout)
        warm = lg.ClientConfig(cl.url, api="proserve", class_keys=CLASS_KEYS, seed=args.seed + 1000,
                               request_timeout=args.timeout)
        asyncio.run(lg.replay(workload(args, 20.0, classes, seed=args.seed + 1000, n=12), warm))
        cl.drain()
        info["kv_blocks"] = cl.kv_blocks()
        info["delays"] = calibrate(cl, deployment, args, classes, base / "calibration")
        print(f"[{deployment}/{policy}] host delays: " + ", ".join(f"{k} {v * 1e3:.1f} ms"
              for k, v in info["delays"].items() if k in DELAYS), file=sys.stderr, flush=True)
        for rate in rates:
            reqs = workload(args, rate, classes)
            t0 = time.monotonic()
            run = asyncio.run(lg.replay(reqs, cfg))
            drained = cl.drain()
            summary = lg.summarize_run(reqs, run.results, gain, run.stalls)
            lg.write_outputs(base / f"rate{rate:g}" / "real", reqs, run, gain, summary,
                             {"deployment": deployment, "policy": policy, "rate": rate,
                              "kv_blocks": info["kv_blocks"], "cluster_cmd": cl.cmd})
            m = summary["metrics"]["all"]
            print(f"[{deployment}/{policy}] rate {rate:g}: {len(reqs)} reqs in {time.monotonic() - t0:.0f} s "
                  f"(drain {drained:.0f} s), TDG {m['tdg_ratio']:.3f}, SLO {m['slo_attainment']:.3f}, "
                  f"errors {m['errors']}, send lag p99 {summary['send_lag_s']['p99'] or 0:.3f} s",
                  file=sys.stderr, flush=True)
    finally:
        cl.stop()
    (base / "cluster.json").write_text(json.dumps(info) + "\n")
    return info


# --- the simulator -------------------------------------------------------------------------

VARIANTS = ("bare", "profile", "served")
VARIANT_TEXT = {
    "bare": "the simulator as it was: the profile's step times, first token at the prefill's end, no host delays",
    "profile": "the profile's step times (--truth-model if given) + the measured host delays + the decode "
               "worker's first token",
    "served": "as 'profile', but the simulated hardware steps as the served engines did: Eq. 5-7 fitted on "
              "the start-to-start step times the workers recorded while serving the OTHER policies' runs",
}
IDLE_GAP_S = 0.02    # a longer pause between two steps means the engine had nothing to run


def served_samples(path: Path, windows: list[tuple[float, float]]) -> list:
    """(prefills, decodes, start-to-start time) of every step a worker recorded inside the
    windows and followed by another step without an idle pause: the step's own time plus
    the engine core's work between steps, the time the next step really waited."""
    from proserve.scheduler.estimator import BatchSample
    steps = _steps(path, min(t0 for t0, _ in windows))
    out = []
    for a, b in zip(steps, steps[1:]):
        if not any(t0 <= a["wall"] <= t1 for t0, t1 in windows):
            continue
        if (b["wall"] - b["time"]) - a["wall"] > IDLE_GAP_S:
            continue
        start_a, start_b = a["wall"] - a["time"], b["wall"] - b["time"]
        out.append(BatchSample.of([tuple(p) for p in a["prefills"]], a["decodes"], start_b - start_a))
    return out


def _kind(sample) -> str:
    if sample.prefills and sample.decodes:
        return "mixed"
    return "prefill" if sample.prefills else "decode"


class KindModel:
    """The simulated hardware of the 'served' variant: Eq. 5-7 fitted separately on the
    served decode-only, prefill-only and mixed steps. The served engines deviate from the
    profile differently per kind (decode-only steps ran faster than profiled, mixed steps
    slower), which one (β, δ) cannot absorb; the simulated policies must meet the same
    deviations the engine plugin met."""

    def __init__(self, models: dict, fallback):
        self.models, self.fallback = models, fallback
        self.unit = models.get("decode", fallback).unit     # the simulator's decode macro-steps

    def batch_time(self, prefills, decodes) -> float:
        kind = "mixed" if prefills and decodes else ("prefill" if prefills else "decode")
        return self.models.get(kind, self.fallback).batch_time(prefills, decodes)

    def predict(self, sample) -> float:
        return self.batch_time(sample.prefills, sample.decodes)


def served_model(out: Path, deployment: str, policy: str, policies: list[str], rates: list[float],
                 role: str, base) -> tuple:
    """The 'served' truth, fitted on the served step times of the other policies' runs (held
    out by policy: the runs a simulated row is compared with do not enter its model)."""
    from proserve.scheduler.estimator import LatencyModel
    samples = []
    for other in policies:
        if other == policy and len(policies) > 1:
            continue
        for rate in rates:
            summ = json.loads((out / deployment / other / f"rate{rate:g}" / "real" / "summary.json").read_text())
            t0 = summ["t0_unix"]
            samples += served_samples(out / deployment / other / "run" / f"steps-{role}.jsonl",
                                      [(t0, t0 + summ["wall_s"])])
    # absolute error, so that the simulated engine is busy as long as the real one was
    fallback = LatencyModel.fit(samples, base.metadata, relative=False)
    models = {}
    for kind in ("decode", "prefill", "mixed"):
        these = [x for x in samples if _kind(x) == kind]
        if len(these) >= 20:
            models[kind] = LatencyModel.fit(these, base.metadata, relative=False)
    model = KindModel(models, fallback)
    ratios = [x.time / model.predict(x) for x in samples]
    mean = sum(ratios) / len(ratios)
    cv = (sum((r - mean) ** 2 for r in ratios) / len(ratios)) ** 0.5 / mean
    mape = sum(abs(r - 1) for r in ratios) / len(ratios)
    return model, mape, len(samples), cv


def sim_config(deployment: str, policy: str, args, kv_blocks: int | None, delays: dict, variant: str,
               truth: dict) -> SimConfig:
    if deployment == "colocated":
        cfg = SimConfig(deployment="colocated", instances=1)
    else:
        cfg = SimConfig(deployment="disaggregated", prefill_instances=1, decode_instances=1)
    cfg.local_policy = policy
    cfg.global_policy = "go_routing"
    cfg.block_size = args.block_size
    cfg.num_kv_blocks = kv_blocks
    cfg.kv_bandwidth = args.kv_bandwidth
    cfg.seed = args.seed
    if variant != "bare":
        cfg.first_token = "decode"
        for k in DELAYS:
            setattr(cfg, k, delays.get(k, 0.0))
    if variant == "profile" and args.truth_model:
        cfg.true_model = load_model(args.truth_model)
    if variant == "served":
        cfg.true_model = truth["prefill"]
        cfg.decode_true_model = truth.get("decode")
        cfg.noise_cv = truth["prefill_cv"]   # the served steps' spread around the model, as log-normal noise
    return cfg


def run_sim(deployment: str, policy: str, rate: float, args, classes, gain, kv_blocks, delays, variant: str,
            truth: dict) -> dict:
    reqs = workload(args, rate, classes)
    model = load_model(args.latency_model)
    cfg = sim_config(deployment, policy, args, kv_blocks, delays, variant, truth)
    res = simulate(copy.deepcopy(reqs), model, cfg, gain, classes)
    return {k: v.as_dict() for k, v in summarize(res.requests, gain).items()}


# --- the table -----------------------------------------------------------------------------

def real_metrics(path: Path, gain) -> dict:
    """Per class metrics of a real run, with its error count (429s, timeouts: requests the
    dispatcher ended that the simulator, which has no admission limits, keeps queued)."""
    reqs, results, _ = load_records(path / "requests.jsonl")
    by_id = {r.id: r for r in results}
    conv = [to_request(q, by_id[q.id]) for q in reqs]
    out = {k: v.as_dict() for k, v in summarize(conv, gain).items()}
    for k, m in out.items():
        m["errors"] = sum(1 for q in reqs if k in ("all", q.priority) and not by_id[q.id].ok)
    return out


def rel(sim: float, real: float) -> float:
    if real is None or sim is None or not math.isfinite(real) or not math.isfinite(sim) or real == 0:
        return float("nan")
    return (sim - real) / real


def compare(real: dict, sim: dict) -> dict:
    out = {}
    for cls in real:
        r, s = real[cls], sim.get(cls, {})
        row = {"requests": r["requests"], "errors": r.get("errors", 0)}
        for f in FIGURES:
            row[f] = (r[f], s.get(f, float("nan")), rel(s.get(f, float("nan")), r[f]))
        for f in ("tdg_ratio", "slo_attainment"):
            row[f] = (r[f], s.get(f, float("nan")), s.get(f, float("nan")) - r[f])
        row["pass"] = (all(abs(row[f][2]) <= LAT_TOL for f in FIGURES if f[-2:] in ("50", "90"))
                       and abs(row["tdg_ratio"][2]) <= TDG_TOL)
        out[cls] = row
    return out


def _cell(t, lat: bool) -> str:
    real, sim, err = t
    if lat:
        return f"{real * 1e3:7.1f} {sim * 1e3:7.1f} {err * 100:+5.0f}%"
    return f"{real:5.3f} {sim:5.3f} {err:+6.3f}"


def format_table(rows: list[dict]) -> str:
    head = (f"{'deploy':9} {'policy':14} {'rate':>5} {'class':5} {'n':>4} {'err':>4}  "
            + "  ".join(f"{f + ' ms real/sim/err':>23}" for f in FIGURES)
            + f"  {'TDG real/sim/diff':>19}  {'SLO real/sim/diff':>19}  ok")
    lines = [head, "-" * len(head)]
    for row in rows:
        for cls, c in row["classes"].items():
            lines.append(f"{row['deployment']:9} {row['policy']:14} {row['rate']:5g} {cls:5} {c['requests']:4d} "
                         f"{c['errors']:4d}  "
                         + "  ".join(f"{_cell(c[f], True):>23}" for f in FIGURES)
                         + f"  {_cell(c['tdg_ratio'], False):>19}  {_cell(c['slo_attainment'], False):>19}  "
                         + ("ERR" if c["errors"] else "yes" if c["pass"] else "NO"))
    return "\n".join(lines)


def summary_line(rows: list[dict]) -> str:
    errs = {f: [] for f in FIGURES}
    tdg = []
    for row in rows:
        for c in row["classes"].values():
            for f in FIGURES:
                if math.isfinite(c[f][2]):
                    errs[f].append(abs(c[f][2]))
            tdg.append(abs(c["tdg_ratio"][2]))
    parts = [f"{f} median |err| {sorted(v)[len(v) // 2] * 100:.0f}% max {max(v) * 100:.0f}%"
             for f, v in errs.items() if v]
    clean = [c for row in rows for c in row["classes"].values() if not c["errors"]]
    n_ok = sum(c["pass"] for c in clean)
    n_err = sum(len(row["classes"]) for row in rows) - len(clean)
    return (f"# {n_ok}/{len(clean)} rows within target (P50/P90 ≤ {LAT_TOL:.0%}, TDG_Ratio ± {TDG_TOL}; "
            f"{n_err} rows whose real run had errors not counted); "
            f"TDG |diff| median {sorted(tdg)[len(tdg) // 2]:.3f} max {max(tdg):.3f}\n# " + "; ".join(parts))


# --- main ----------------------------------------------------------------------------------

def add_cluster_args(ap: argparse.ArgumentParser, port: int, port_help: str) -> None:
    """The workload shaping, SLOs and cluster flags :class:`Cluster` and :func:`workload` read
    (shared with scripts/bench_admission_real.py)."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-div", type=float, default=4.0)
    ap.add_argument("--output-div", type=float, default=4.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--ttft-slo", type=float, default=0.5)
    ap.add_argument("--tpot-slo", type=float, default=0.05)
    ap.add_argument("--port", type=int, default=port, help=port_help)
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployments", default="colocated,1p1d", help="comma-separated: colocated, 1p1d")
    ap.add_argument("--policies", default="slide_batching,vllm_fcfs,sarathi_fcfs",
                    help="local policies (registry names) run in the real workers and the simulator")
    ap.add_argument("--rates-colocated", default="4,8,10,14",
                    help="req/s, light to overload (default: docs/fidelity.md's, for the scaled model here)")
    ap.add_argument("--rates-1p1d", default="6,14,20,28", help="req/s for 1P1D (default: docs/fidelity.md's)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of trace per rate")
    ap.add_argument("--model", default="scaled",
                    help="model directory every worker serves, or 'scaled' (default): the tiny Llama "
                         "scaled up (proserve.bench.scaled_model), written to OUT/model")
    ap.add_argument("--latency-model", default=None,
                    help="the profile every real worker, the dispatcher and the simulator use "
                         "(default OUT/model-cpu.json: run scripts/profile.sh on the model first)")
    ap.add_argument("--truth-model", default=None,
                    help="the profile the simulated hardware follows in the 'profile' variant (default: "
                         "--latency-model); profile it at the step budget the workers serve with "
                         "(scripts/profile.sh ... -- --max-num-batched-tokens 2048)")
    ap.add_argument("--kv-bandwidth", type=float, default=0.5e9,
                    help="simulated KV bandwidth, bytes/s (default: CURVE over loopback, docs/results.md §8.3)")
    add_cluster_args(ap, 8600, "dispatcher port; workers at +100, +200, KV at +300")
    ap.add_argument("--calibration-requests", type=int, default=20,
                    help="requests sent one at a time on the idle cluster to measure its delays (default 20)")
    ap.add_argument("--table-variant", choices=VARIANTS, default="served",
                    help="which simulation the full table shows (all three are summarised; default served)")
    ap.add_argument("--sim-only", action="store_true", help="no real runs: re-simulate against --out's saved runs")
    ap.add_argument("--out", default="out/fidelity")
    ap.add_argument("--table", default=None, help="also write the table here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.chdir(ROOT)
    if args.model == "scaled":
        args.model = str(make_scaled_model(Path(args.out) / "model"))
    if args.latency_model is None:
        args.latency_model = str(Path(args.out) / "model-cpu.json")
    if not Path(args.latency_model).is_file():
        raise SystemExit(f"bench_fidelity: no latency model at {args.latency_model}; profile the model first:\n"
                         f"  bash scripts/profile.sh {args.model} cpu {args.latency_model} -- "
                         f"--cpu-bind 0 --block-size {args.block_size} --load-format dummy")
    classes = lg.load_classes(None, args.ttft_slo, args.tpot_slo)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global KEYS_FILE
    KEYS_FILE = out / "keys.toml"
    KEYS_FILE.write_text("".join(f'[[keys]]\nkey = "{k}"\nclient = "bench_fidelity"\nclass = "{c}"\n\n'
                                 for c, k in CLASS_KEYS.items()))
    classes_file = out / "classes.json"
    classes_file.write_text(json.dumps([{"name": c.name, "weight": c.weight, "ttft_slo": c.ttft_slo,
                                         "tpot_slo": c.tpot_slo} for c in classes.values()]) + "\n")
    rates = {"colocated": [float(x) for x in args.rates_colocated.split(",")],
             "1p1d": [float(x) for x in args.rates_1p1d.split(",")]}
    deployments = args.deployments.split(",")
    policies = args.policies.split(",")
    for d in deployments:
        if d not in DEPLOYMENTS:
            raise SystemExit(f"bench_fidelity: --deployments: {d!r} is not one of {', '.join(DEPLOYMENTS)}")
    # one gain for every run: w_p from the heaviest workload (§5.1), as engine_policies does
    gain = lg.workload_gain(workload(args, max(max(rates[d]) for d in deployments), classes))
    if not args.sim_only:
        for d in deployments:
            for p in policies:
                run_real(d, p, rates[d], args, classes, classes_file, gain)
    base = load_model(args.latency_model)
    rows = {v: [] for v in VARIANTS}
    fits = []
    for d in deployments:
        for p in policies:
            info = json.loads((out / d / p / "cluster.json").read_text())
            kv_blocks, delays = info.get("kv_blocks"), info.get("delays", {})
            truth = {}
            for role in ("prefill", "decode") if d == "1p1d" else ("prefill",):
                truth[role], fit_mape, n, truth[role + "_cv"] = served_model(out, d, p, policies, rates[d], role,
                                                                             base)
                fits.append(f"# {d}/{p}: served {role} model from the other policies' runs: {n} steps, "
                            f"MAPE {fit_mape:.1%}, CV of measured/model {truth[role + '_cv']:.2f}")
            for rate in rates[d]:
                real = real_metrics(out / d / p / f"rate{rate:g}" / "real", gain)
                for v in VARIANTS:
                    sim = run_sim(d, p, rate, args, classes, gain, kv_blocks, delays, v, truth)
                    (out / d / p / f"rate{rate:g}" / f"sim-{v}.json").write_text(json.dumps(sim, indent=1) + "\n")
                    rows[v].append({"deployment": d, "policy": p, "rate": rate, "classes": compare(real, sim)})
    head = (f"# bench_fidelity: {' '.join(sys.argv[1:]) or '(defaults)'}\n"
            f"# model {args.model}, latency model {args.latency_model}; {args.duration:g} s of the Azure conv "
            f"trace per rate, prompt/{args.prompt_div:g}, output/{args.output_div:g}, SLO TTFT {args.ttft_slo:g} s, "
            f"TPOT {args.tpot_slo:g} s; w_p {gain.w_p:.3f}\n")
    delays_txt = "".join(f"# {d}/{p} host delays: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in json.loads((out / d / p / "cluster.json").read_text())["delays"].items()
        if k in DELAYS) + "\n" for d in deployments for p in policies)
    text = (head + delays_txt + "\n".join(fits) + "\n"
            + "".join(f"# {v}: {VARIANT_TEXT[v]}\n{summary_line(rows[v])}\n" for v in VARIANTS)
            + f"\n# full table: {args.table_variant}\n" + format_table(rows[args.table_variant]) + "\n")
    for v in VARIANTS:
        (out / f"table-{v}.txt").write_text(head + format_table(rows[v]) + "\n" + summary_line(rows[v]) + "\n")
    print(text)
    (out / "table.txt").write_text(text)
    (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
    if args.table:
        Path(args.table).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
