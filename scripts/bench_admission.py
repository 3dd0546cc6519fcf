#!/usr/bin/env python3
"""Admission control under overload: how fast a refused request gets its 429.

Issue 13 asks that, at 1.5x capacity with ``on_overload low=reject``, rejected
requests get HTTP 429 within 50 ms of arrival. This measures it end to end:

* the dispatcher (``python -m proserve.dispatcher``, its own process, loopback,
  disaggregated) with two classes from a keys file, ``high`` (on_overload
  queue) and ``low`` (``--on-overload low=reject``);
* in front of fake workers (another process): ``--instances`` prefill workers
  that prefill ONE request at a time, earliest first-token deadline first, each
  taking exactly what the dispatcher's latency model predicts (``c_p * prompt
  tokens + t_c``, scheduler/cost.py): a prefill instance with a real capacity,
  run as GoRouting's estimate assumes (so the estimate is right; with equal TTFT
  SLOs that order is arrival order: these fakes do not put high before low, as
  a priority-aware engine would); plus one fake decode worker (tokens every
  ``--decode-ms``, any number at once: the prefill pool is the bottleneck);
* this process sends an open-loop Poisson load at ``--load`` times the prefill
  pool's capacity, mixed: each request ``high`` or ``low`` (``--high-share``),
  a text prompt (the dispatcher must call a worker's /tokenize before it can
  decide) or token ids, streamed or not.

For every response it records the class, status, and the time from send to the
status line (a 429) or to the first token (a served, streamed request; for an
unstreamed one, to the whole answer). It prints, per class and prompt kind, the
requests, served, 429s, the 429 latency P50/P99/max and how many 429s took over
50 ms, next to references measured in the same run: the dispatcher's /health
round trip and a direct /tokenize round trip to a fake worker (idle, and every
0.1 s during the load), and what the dispatcher adds to a routed request on the
idle cluster (TTFT minus the fake prefill time). Each 429 over 50 ms is listed
with the slowest probe of the same second and how late the client sent it, so a
stall of the whole host (which the probes see too) can be told from a slow
refusal. Also the high class's served count, TTFT and TTFT-SLO attainment (it
must keep being served), and the dispatcher's own admission counters.

Speed is measured, not asserted: the exit status is non-zero only when the run
is no measurement (a process does not start, or a request ends without an HTTP
status or with one other than 200 and 429, e.g. a 503 when a host stall made
the dispatcher's connection to a fake worker time out).

    python scripts/bench_admission.py                       # 20 s at 1.5x capacity
    python scripts/bench_admission.py --duration 60 --json out/bench_admission.json
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench_dispatcher's helpers
from bench_dispatcher import Proc, cpu_seconds, free_port, pct, session, start_dispatcher, wait_http

HIGH_KEY, LOW_KEY = "sk-bench-high-0001", "sk-bench-low-00001"
KEYS = f"""
[[keys]]
key = "{HIGH_KEY}"
client = "high-client"
class = "high"

[[keys]]
key = "{LOW_KEY}"
client = "low-client"
class = "low"
"""
LIMIT_MS = 50.0   # issue 13: "rejected requests get 429 within 50 ms of arrival"
IDLE_PROMPT = 40  # tokens of the idle-cluster reference requests


# -- the fake workers (their own process) --------------------------------------------------------
def serve_fakes(args) -> None:
    """``--serve-fakes``: prefill workers that prefill one request at a time, and one
    decode worker; runs until interrupted."""
    from proserve.bench.fake_worker import FakeWorker
    from proserve.profiler.modelfile import load

    model = load(args.model_file)

    class SerialPrefill(FakeWorker):
        """A fake prefill worker with a capacity: one prefill at a time, each taking the
        latency model's c_p·l_q + t_c, earliest first-token deadline first (arrival_time +
        ttft_slo from the dispatcher's vllm_xargs; ties in arrival order): the order
        GoRouting's estimate assumes of a prefill instance (φ_p, scheduler/routing/estimates.py)."""

        busy = False
        waiting: list | None = None     # heap of (deadline, seq, future)
        seq = 0

        async def _generate_inner(self, request, chat):
            body = await request.json()        # aiohttp keeps the body: the base class reads it again
            prompt = body.get("prompt")
            n = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
            xa = body.get("vllm_xargs") or {}
            deadline = float(xa.get("arrival_time", time.time())) + float(xa.get("ttft_slo", 1e9))
            await self._turn(deadline)
            try:
                await asyncio.sleep(model.prefill_time(n, 0) + model.t_c)   # Eq. 5 + t_c (scheduler/cost.py)
            finally:
                self._next()
            return await super()._generate_inner(request, chat)

        async def _turn(self, deadline: float) -> None:
            if not self.busy:
                self.busy = True
                return
            fut = asyncio.get_running_loop().create_future()
            self.waiting = self.waiting or []
            self.seq += 1
            heapq.heappush(self.waiting, (deadline, self.seq, fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._next()               # handed the turn but cancelled meanwhile: pass it on
                raise

        def _next(self) -> None:
            while self.waiting:
                fut = heapq.heappop(self.waiting)[2]
                if not fut.done():
                    fut.set_result(None)       # the turn goes to the earliest deadline
                    return
            self.busy = False

    async def go():
        prefill_ports = [int(p) for p in args.prefill_ports.split(",")]
        ws = [await SerialPrefill(port=p, keep_bodies=False).start() for p in prefill_ports]
        ws.append(await FakeWorker(port=args.decode_port, decode_s=args.decode_ms / 1e3, keep_bodies=False).start())
        print(f"{len(prefill_ports)} serial fake prefill workers + 1 fake decode worker up", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass


# -- the load ------------------------------------------------------------------------------------
def prompt(rng: random.Random, kind: str, n: int):
    """A prompt of ``n`` tokens: token ids, or ``n`` words (the fake /tokenize counts words)."""
    if kind == "ids":
        return [rng.randrange(3, 1000) for _ in range(n)]
    return " ".join(f"w{rng.randrange(1000)}" for _ in range(n))


async def send(c, url: str, key: str, body: dict) -> dict:
    """One request: status, and seconds from send to the status line / the first token."""
    t0 = time.perf_counter()
    out: dict = {}
    try:
        async with c.post(url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}) as r:
            out["status"] = r.status
            out["t_status"] = time.perf_counter() - t0
            if r.status != 200:
                raw = await r.read()
                try:
                    out["code"] = json.loads(raw)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    out["code"] = raw[:200].decode(errors="replace")
                out["retry_after"] = r.headers.get("retry-after")
            elif body.get("stream"):
                async for line in r.content:
                    if "t_first" not in out and line.startswith(b"data:") and b'"choices"' in line:
                        out["t_first"] = time.perf_counter() - t0
            else:
                await r.read()
                out["t_first"] = time.perf_counter() - t0
    except Exception as e:   # noqa: BLE001 - reported: a request that ended without an HTTP status
        out["status"] = None
        out["error"] = f"{type(e).__name__}: {e}"
    return out


async def health_rtt(c, url: str) -> float:
    t0 = time.perf_counter()
    async with c.get(url + "/health") as r:
        await r.read()
    return time.perf_counter() - t0


async def tokenize_rtt(c, worker_url: str) -> float:
    """A /tokenize round trip straight to a fake prefill worker (what the dispatcher
    does first for a text prompt)."""
    t0 = time.perf_counter()
    async with c.post(worker_url + "/tokenize", json={"prompt": "w1 " * 100}) as r:
        await r.read()
    return time.perf_counter() - t0


async def idle_reference(c, url: str, worker_url: str, rng: random.Random, n: int, prefill_s: float) -> dict:
    """On the idle cluster: /health and /tokenize round trips, and the TTFT of sequential streamed
    requests of IDLE_PROMPT tokens per prompt kind, less the fake prefill time."""
    out = {"health": [await health_rtt(c, url) for _ in range(n)]}
    out["tokenize"] = [await tokenize_rtt(c, worker_url) for _ in range(n)]
    for kind in ("ids", "text"):
        xs = []
        for _ in range(n):
            r = await send(c, url, HIGH_KEY, {"prompt": prompt(rng, kind, IDLE_PROMPT), "max_tokens": 2,
                                              "stream": True})
            if r.get("status") != 200:
                raise RuntimeError(f"idle reference request failed: {r}")
            xs.append(r["t_first"] - prefill_s)
        out[f"overhead_{kind}"] = xs
    return out


async def drive(args, url: str, worker_url: str, capacity: float, disp_pid: int) -> dict:
    rng = random.Random(args.seed)
    rate = args.load * capacity
    records: list[dict] = []
    probes: list[tuple[float, float, float]] = []    # (time in the run, /health, /tokenize)
    async with session() as c:
        # warm the connections and the dispatcher's paths (not counted)
        for kind in ("ids", "text"):
            await send(c, url, HIGH_KEY, {"prompt": prompt(rng, kind, IDLE_PROMPT), "max_tokens": 2, "stream": True})
        idle = await idle_reference(c, url, worker_url, rng, args.idle_samples, args.model.prefill_time(IDLE_PROMPT, 0)
                                    + args.model.t_c)

        async def one(t_sched: float, rec: dict, body: dict) -> None:
            rec["at"] = t_sched - t0
            rec["late"] = time.perf_counter() - t_sched     # the client's own lag behind the schedule
            rec.update(await send(c, url, HIGH_KEY if rec["cls"] == "high" else LOW_KEY, body))
            records.append(rec)

        async def probe(stop: float) -> None:
            while time.perf_counter() < stop:
                at = time.perf_counter() - t0
                probes.append((at, await health_rtt(c, url), await tokenize_rtt(c, worker_url)))
                await asyncio.sleep(0.1)

        tasks = []
        load0 = os.getloadavg()[0]
        cpu0, t0 = cpu_seconds(disp_pid), time.perf_counter()
        stop = t0 + args.duration
        prober = asyncio.create_task(probe(stop))
        t = t0
        while True:
            t += rng.expovariate(rate)                        # open loop: Poisson arrivals
            if t >= stop:
                break
            rec = {"cls": "high" if rng.random() < args.high_share else "low",
                   "kind": "text" if rng.random() < args.text_share else "ids",
                   "stream": rng.random() < args.stream_share}
            body = {"prompt": prompt(rng, rec["kind"], rng.randint(args.min_prompt, args.max_prompt)),
                    "max_tokens": rng.randint(4, 16), "stream": rec["stream"]}
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(t, rec, body)))
        await prober
        load_s = time.perf_counter() - t0
        cpu_load = cpu_seconds(disp_pid) - cpu0
        _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout) if tasks else (set(), set())
        for p in pending:
            p.cancel()
        async with c.get(url + "/metrics") as r:
            metrics_text = await r.text()
    return {"records": records, "unfinished": len(pending), "probes": probes, "idle": idle,
            "rate": rate, "load_s": load_s, "disp_cpu_share": cpu_load / load_s, "metrics": metrics_text,
            "loadavg": (load0, os.getloadavg()[0]), "warmup_requests": 2 + 2 * args.idle_samples}


# -- the report ----------------------------------------------------------------------------------
def ms(xs, q=None) -> str:
    if not xs:
        return "-"
    v = max(xs) if q == "max" else statistics.median(xs) if q is None else pct(xs, q)
    return f"{1e3 * v:.2f}"


def admission_counts(metrics_text: str) -> dict[str, int]:
    """{"<class> <decision> <reason>": count} from the dispatcher's /metrics."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("proserve:dispatcher_admission_total{"):
            head, _, v = line.rpartition(" ")
            labels = dict(kv.split("=", 1) for kv in head.split("{", 1)[1].rstrip("}").split(","))
            key = " ".join(labels.get(k, '"?"').strip('"') for k in ("priority", "decision", "reason"))
            out[key] = int(float(v))
    return out


def report(args, res: dict, capacity: float) -> tuple[dict, int]:
    recs = res["records"]
    lines = []
    p = lines.append
    p(f"offered {res['rate']:.2f} req/s = {args.load:g} x the prefill pool's capacity ({capacity:.2f} req/s: "
      f"{args.instances} serial fake prefill worker(s), mean {1e3 * args.instances / capacity:.0f} ms per prompt of "
      f"{args.min_prompt}-{args.max_prompt} tokens), Poisson, {res['load_s']:.1f} s; high share {args.high_share:.2f}, "
      f"TTFT SLO high {args.high_ttft:g} s (queue) / low {args.low_ttft:g} s (reject)")
    late = [r["late"] for r in recs]
    p(f"client lag behind the arrival schedule: P50 {ms(late)} ms, max {ms(late, 'max')} ms; dispatcher CPU "
      f"{res['disp_cpu_share']:.2f} of one core during the load; {os.cpu_count()} cores shared by client, "
      f"dispatcher and fakes (and whatever else runs: 1-min load average {res['loadavg'][0]:.2f} before, "
      f"{res['loadavg'][1]:.2f} after)")
    idle = res["idle"]
    p("")
    p("reference, same run (ms)                            P50      P99      max")
    for name, xs in (("dispatcher /health round trip, idle", idle["health"]),
                     ("dispatcher /health round trip, during load", [x for _, x, _ in res["probes"]]),
                     ("fake worker /tokenize round trip, idle", idle["tokenize"]),
                     ("fake worker /tokenize round trip, during load", [x for _, _, x in res["probes"]]),
                     ("added to a routed request, idle, token ids", idle["overhead_ids"]),
                     ("added to a routed request, idle, text", idle["overhead_text"])):
        p(f"  {name:<48} {ms(xs):>7} {ms(xs, 0.99):>8} {ms(xs, 'max'):>8}")
    p("  (added = TTFT of a streamed request on the idle cluster minus the fake prefill time: dispatcher, "
      "/tokenize for text, two legs)")
    p("")
    p(f"{'class':<5} {'prompt':<6} {'requests':>8} {'served':>7} {'429':>5} {'other':>5} "
      f"{'429 ms P50':>10} {'P99':>7} {'max':>7} {'>50ms':>6} {'TTFT ms P50':>12} {'P99':>8}")
    summary: dict = {"rate": res["rate"], "capacity": capacity, "load": args.load, "duration_s": res["load_s"],
                     "classes": {}}
    bad = 0
    for cls in ("high", "low"):
        for kind in ("ids", "text", "all"):
            rs = [r for r in recs if r["cls"] == cls and (kind == "all" or r["kind"] == kind)]
            served = [r for r in rs if r.get("status") == 200]
            rej = [r["t_status"] for r in rs if r.get("status") == 429]
            other = [r for r in rs if r.get("status") not in (200, 429)]
            ttft = [r["t_first"] for r in served if r["stream"] and "t_first" in r]
            over = sum(1 for x in rej if 1e3 * x > LIMIT_MS)
            p(f"{cls:<5} {kind:<6} {len(rs):>8} {len(served):>7} {len(rej):>5} {len(other):>5} "
              f"{ms(rej):>10} {ms(rej, 0.99):>7} {ms(rej, 'max'):>7} {over:>6} {ms(ttft):>12} {ms(ttft, 0.99):>8}")
            summary["classes"].setdefault(cls, {})[kind] = {
                "requests": len(rs), "served": len(served), "rejected_429": len(rej), "other": len(other),
                "429_ms": {"p50": 1e3 * statistics.median(rej), "p99": 1e3 * pct(rej, 0.99),
                           "max": 1e3 * max(rej)} if rej else None,
                "429_over_50ms": over,
                "served_streamed_ttft_ms": {"p50": 1e3 * statistics.median(ttft), "p99": 1e3 * pct(ttft, 0.99)}
                if ttft else None}
            if kind == "all":
                bad += len(other)
    p("  (429 ms: send to status line; TTFT: send to first token of the served, streamed requests; other: any "
      "other outcome)")
    high = [r for r in recs if r["cls"] == "high" and r.get("status") == 200 and r["stream"] and "t_first" in r]
    met = sum(1 for r in high if r["t_first"] <= args.high_ttft)
    p(f"high class: {sum(1 for r in recs if r['cls'] == 'high' and r.get('status') == 200)} served; "
      f"{met}/{len(high)} streamed within its TTFT SLO of {args.high_ttft:g} s")
    rej_all = [r["t_status"] for r in recs if r.get("status") == 429]
    p(f"429s over {LIMIT_MS:g} ms: {sum(1 for x in rej_all if 1e3 * x > LIMIT_MS)} of {len(rej_all)}")
    slow = sorted((r for r in recs if r.get("status") == 429 and 1e3 * r["t_status"] > LIMIT_MS),
                  key=lambda r: r["at"])
    for r in slow[:10]:
        near = [(h, t) for at, h, t in res["probes"] if abs(at - r["at"]) <= 1.0]
        how = "streamed" if r["stream"] else "not streamed"
        p(f"  at {r['at']:.2f} s: {1e3 * r['t_status']:.1f} ms ({r['kind']}, {how}; sent {1e3 * r['late']:.1f} ms "
          f"behind schedule; slowest probe within 1 s: /health {ms([h for h, _ in near], 'max')} ms, "
          f"/tokenize {ms([t for _, t in near], 'max')} ms)")
    if len(slow) > 10:
        p(f"  ... and {len(slow) - 10} more (all in --json)")
    codes = sorted({str(r.get("code")) for r in recs if r.get("status") == 429})
    p(f"429 error codes: {', '.join(codes) or '-'}")
    counts = admission_counts(res["metrics"])
    p("dispatcher /metrics admission decisions: " + (", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
                                                      or "none")
      + f" (these include the {res['warmup_requests']} warm-up and idle-reference requests, all high)")
    errors = [r for r in recs if r.get("status") not in (200, 429)]
    for r in errors[:5]:
        p(f"  not 200/429: {r}")
    if res["unfinished"]:
        p(f"  {res['unfinished']} requests unfinished after --drain-timeout {args.drain_timeout:g} s")
    print("\n".join(lines), flush=True)
    summary.update(over_50ms=sum(1 for x in rej_all if 1e3 * x > LIMIT_MS), high_within_slo=[met, len(high)],
                   admission=counts, errors=len(errors), unfinished=res["unfinished"], requests=recs,
                   idle_samples_ms={k: [1e3 * x for x in v] for k, v in idle.items()},
                   probes_during_load_ms=[[at, 1e3 * h, 1e3 * t] for at, h, t in res["probes"]],
                   reference_ms={"health_idle_p50": 1e3 * statistics.median(idle["health"]),
                                 "health_load_p50": 1e3 * statistics.median(x for _, x, _ in res["probes"])
                                 if res["probes"] else None,
                                 "added_idle_ids_p50": 1e3 * statistics.median(idle["overhead_ids"]),
                                 "added_idle_text_p50": 1e3 * statistics.median(idle["overhead_text"])})
    return summary, bad + res["unfinished"]


# -- main ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    ap.add_argument("--load", type=float, default=1.5,
                    help="offered load as a multiple of the prefill pool's capacity (default 1.5)")
    ap.add_argument("--instances", type=int, default=1, help="fake prefill workers (default 1)")
    ap.add_argument("--high-share", type=float, default=1 / 3, help="share of high requests (default 1/3)")
    ap.add_argument("--text-share", type=float, default=0.5, help="share of text prompts (default 0.5; the "
                                                                  "rest token ids)")
    ap.add_argument("--stream-share", type=float, default=0.5, help="share of streamed requests (default 0.5)")
    ap.add_argument("--min-prompt", type=int, default=40, help="shortest prompt, tokens (default 40)")
    ap.add_argument("--max-prompt", type=int, default=160, help="longest prompt, tokens (default 160)")
    ap.add_argument("--ms-per-token", type=float, default=1.0,
                    help="prefill cost per prompt token, c_p in ms (default 1; the fakes sleep it, the "
                         "dispatcher's latency model says it)")
    ap.add_argument("--t-c-ms", type=float, default=10.0, help="per-batch overhead t_c in ms (default 10)")
    ap.add_argument("--decode-ms", type=float, default=2.0, help="fake decode worker: ms per token (default 2)")
    ap.add_argument("--high-ttft", type=float, default=1.0, help="high class TTFT SLO, s (default 1)")
    ap.add_argument("--low-ttft", type=float, default=1.0, help="low class TTFT SLO, s (default 1)")
    ap.add_argument("--idle-samples", type=int, default=20,
                    help="sequential requests (and /health calls) of the idle reference (default 20)")
    ap.add_argument("--drain-timeout", type=float, default=60.0,
                    help="after the load, how long queued requests may take to finish (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    # internal: this script re-runs itself to host the fake workers in their own process
    ap.add_argument("--serve-fakes", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prefill-ports", help=argparse.SUPPRESS)
    ap.add_argument("--decode-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-file", help=argparse.SUPPRESS)
    return ap


def check_args(ap, args) -> None:
    for name in ("duration", "load", "ms_per_token", "high_ttft", "low_ttft"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("high_share", "text_share", "stream_share"):
        if not 0 <= getattr(args, name) <= 1:
            ap.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.instances < 1 or args.idle_samples < 1:
        ap.error("--instances and --idle-samples must be >= 1")
    if not 1 <= args.min_prompt <= args.max_prompt:
        ap.error("need 1 <= --min-prompt <= --max-prompt")
    if args.t_c_ms < 0 or args.decode_ms < 0:
        ap.error("--t-c-ms and --decode-ms must be >= 0")


def main() -> int:
    ap = build_parser()
    args = ap.parse_args()
    if args.serve_fakes:
        serve_fakes(args)
        return 0
    check_args(ap, args)
    from proserve.scheduler.estimator import LatencyModel

    # the dispatcher's latency model, which the fake prefill workers also follow
    args.model = LatencyModel(a_p=0.0, b_p=0.0, c_p=args.ms_per_token / 1e3, a_d=0.0, b_d=args.decode_ms / 1e3,
                              t_c=args.t_c_ms / 1e3, metadata={"note": "scripts/bench_admission.py"})
    mean_s = statistics.fmean(args.model.prefill_time(n, 0) + args.model.t_c
                              for n in range(args.min_prompt, args.max_prompt + 1))
    capacity = args.instances / mean_s

    tmp = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    model_file = tmp / "latency-model.json"
    model_file.write_text(args.model.dumps() + "\n")
    (tmp / "keys.toml").write_text(KEYS)
    (tmp / "classes.json").write_text(json.dumps([
        {"name": "high", "weight": 2.0, "ttft_slo": args.high_ttft, "tpot_slo": 0.1, "on_overload": "queue"},
        {"name": "low", "weight": 1.0, "ttft_slo": args.low_ttft, "tpot_slo": 0.1}]))
    print(f"# python scripts/bench_admission.py {' '.join(sys.argv[1:])}  ({time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} cores; logs in {tmp})", flush=True)

    prefill_ports = [free_port() for _ in range(args.instances)]
    decode_port, dport = free_port(), free_port()
    fakes = Proc([sys.executable, str(Path(__file__).resolve()), "--serve-fakes", "--model-file", str(model_file),
                  "--prefill-ports", ",".join(map(str, prefill_ports)), "--decode-port", str(decode_port),
                  "--decode-ms", str(args.decode_ms)], tmp / "fakes.log")
    disp = None
    url = f"http://127.0.0.1:{dport}"
    try:
        async def ready():
            for port in [*prefill_ports, decode_port]:
                await wait_http(f"http://127.0.0.1:{port}", 60)
        asyncio.run(ready())
        disp = start_dispatcher(tmp, dport, [f"http://127.0.0.1:{p}" for p in prefill_ports],
                                [(f"http://127.0.0.1:{decode_port}", "tcp://127.0.0.1:1")],
                                "--host", "127.0.0.1", "--keys", str(tmp / "keys.toml"),
                                "--classes", str(tmp / "classes.json"), "--latency-model", str(model_file),
                                "--on-overload", "low=reject")
        asyncio.run(wait_http(url, 60))
        res = asyncio.run(drive(args, url, f"http://127.0.0.1:{prefill_ports[0]}", capacity, disp.p.pid))
    except Exception as e:   # noqa: BLE001 - the harness failed: say where to look
        print(f"error: {type(e).__name__}: {e} (logs in {tmp})", file=sys.stderr)
        return 1
    finally:
        if disp is not None:
            disp.stop()
        fakes.stop()
    summary, bad = report(args, res, capacity)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if bad:
        print(f"error: {bad} request(s) ended without a 200 or a 429 (see above; logs in {tmp})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
