#!/usr/bin/env python3
"""Dispatcher overhead: routing decision time, per-request proxy overhead, and
the request rate the dispatcher alone sustains.

Parts (``--parts``, default all but ``vllm`` and ``cluster``, which start engines):

* ``route`` — the dispatcher's whole routing step (``Dispatcher._route``:
  GoRouting over the live instances, PrefillQueueMap update, decode pick) at
  8 / 32 / 128 prefill instances with 64 requests queued on each, next to the
  policy's ``route()`` alone. Target: under 1 ms at 32 instances.
* ``overhead`` — the same streamed requests sent one at a time, alternately
  straight to a fake worker (bench.fake_worker: HTTP only, no compute) and
  through the dispatcher in front of it (co-located: one leg; disaggregated:
  prefill leg + decode leg on two fake workers). The difference of medians is
  what the dispatcher adds to a request.
* ``throughput`` — the dispatcher (its own process) in front of 32 fake
  prefill + 4 fake decode workers (another process); a closed-loop client
  (this process) at several concurrencies. Prints requests/s and the
  dispatcher's CPU time per request (from /proc: robust on a shared machine;
  1 / that is what one core sustains).
* ``vllm`` — like ``overhead`` against a real co-located vLLM CPU worker
  (``python -m proserve.prefill --colocated``): TTFT and latency, direct vs dispatcher.
* ``cluster`` — a real 1P1D cluster (scripts/launch_cluster.sh) saturated by a
  burst; its throughput, and the dispatcher's CPU use meanwhile (the share of
  one core it needed: far below 1 means it is not the bottleneck).

    python scripts/bench_dispatcher.py [--parts route,overhead,throughput,vllm,cluster] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its children that were waited for (clock ticks → s)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- route -----------------------------------------------------------------------------------------
def part_route(args) -> None:
    from proserve.dispatcher.auth import Grant
    from proserve.dispatcher.config import DecodeSpec, DispatcherConfig, PrefillSpec
    from proserve.dispatcher.requests import Job, scheduler_request
    from proserve.dispatcher.server import Dispatcher
    from proserve.scheduler.config import default_classes

    classes = default_classes()
    rng = random.Random(0)
    print("routing decision time per request (median / P99 of 400), 64 queued per prefill instance, "
          "target < 1 ms at 32")
    print(f"{'instances':>9} {'dispatcher _route':>20} {'policy.route alone':>20}")
    for n in (8, 32, 128):
        cfg = DispatcherConfig(prefill=[PrefillSpec(f"http://127.0.0.1:{10000 + i}") for i in range(n)],
                               decode=[DecodeSpec(f"http://127.0.0.1:{20000 + j}", f"tcp://127.0.0.1:{30000 + j}")
                                       for j in range(8)])
        d = Dispatcher(cfg)
        for w in d.registry.workers:
            w.healthy = True
            w.state.healthy = True
        for w in d.registry.decode:
            w.state.free_blocks = 100000
        now = time.time()

        def job(i, t):
            pc = classes["high" if i % 2 else "low"]
            g = Grant("bench", pc, pc.ttft_slo, pc.tpot_slo)
            j = Job(id=f"r{i}", path="/v1/completions", body={}, grant=g, arrival=t, stream=True,
                    max_tokens=rng.randint(16, 256), prompt_ids=None, want_token_ids=False, want_usage=False,
                    prompt_len=rng.randint(64, 2048))
            j.sreq = scheduler_request(j)
            return j
        for w in d.registry.prefill:
            for k in range(64):
                d.qmap.add(w.state.id, job(k, now - rng.uniform(0, 0.5)).sreq, now)
        # both loops leave the queues as they found them (add, then the completion signal),
        # so both pay the same re-sort of the touched instance's queue on the next call
        full, alone = [], []
        for i in range(400):
            j = job(10_000 + i, time.time())
            t0 = time.perf_counter()
            d._route(j, set())
            full.append(time.perf_counter() - t0)
            d._prefill_done(j)
        ps = [w.state for w in d.registry.prefill]
        ds = [w.state for w in d.registry.decode]
        for i in range(400):
            j = job(20_000 + i, time.time())
            t0 = time.perf_counter()
            p_state, _ = d.policy.route(j.sreq, ps, ds, time.time())
            alone.append(time.perf_counter() - t0)
            d.qmap.add(p_state.id, j.sreq, time.time())
            d.qmap.remove(p_state.id, j.sreq, time.time())
        mark = "  PASS" if n == 32 and statistics.median(full) < 1e-3 else ("  FAIL" if n == 32 else "")
        print(f"{n:>9} {1e3 * statistics.median(full):>9.3f} / {1e3 * pct(full, 0.99):.3f} ms "
              f"{1e3 * statistics.median(alone):>9.3f} / {1e3 * pct(alone, 0.99):.3f} ms{mark}")


# -- processes -------------------------------------------------------------------------------------
class Proc:
    def __init__(self, argv, log: Path, env=None):
        self.log = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, **(env or {})})

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


async def wait_http(url: str, timeout: float = 300) -> None:
    import aiohttp
    t0 = time.monotonic()
    async with session() as c:
        while time.monotonic() - t0 < timeout:
            try:
                async with c.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not healthy in {timeout} s")


def start_fakes(port: int, count: int, tmp: Path, **kw) -> Proc:
    argv = [sys.executable, "-m", "proserve.bench.fake_worker", "--port", str(port), "--count", str(count)]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return Proc(argv, tmp / f"fake-{port}.log")


def start_dispatcher(tmp: Path, port: int, prefills: list[str], decodes: list[tuple[str, str]], *extra) -> Proc:
    argv = [sys.executable, "-m", "proserve.dispatcher", "--port", str(port), "--log-level", "warning", "--wait-ready", "30"]
    for u in prefills:
        argv += ["--prefill", u]
    for u, kv in decodes:
        argv += ["--decode", f"{u}={kv}"]
    if not decodes:
        argv += ["--deployment", "colocated"]
    return Proc([*argv, *extra], tmp / f"dispatcher-{port}.log")


async def one(client, url: str, body: dict) -> tuple[float, float]:
    """(TTFT, total) of one streamed request (aiohttp: the cheapest client at hand, so
    that the client's own CPU use disturbs the measurement least)."""
    t0 = time.perf_counter()
    ttft = None
    async with client.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:300]!r}")
        async for line in r.content:
            if ttft is None and line.startswith(b"data:") and b"choices" in line:
                ttft = time.perf_counter() - t0
    return ttft or float("nan"), time.perf_counter() - t0


def session(limit: int = 0):
    import aiohttp
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=600))


async def compare(direct: str, via: str, n: int, body_fn) -> dict:
    res = {"direct": ([], []), "dispatcher": ([], [])}
    async with session() as c:
        for url in (direct, via):               # warm both paths
            for _ in range(3):
                await one(c, url, body_fn(0))
        for i in range(n):
            order = [("direct", direct), ("dispatcher", via)]
            if i % 2:
                order.reverse()
            for name, url in order:
                ttft, tot = await one(c, url, body_fn(i))
                res[name][0].append(ttft)
                res[name][1].append(tot)
    return res


def print_compare(title: str, res: dict) -> None:
    print(title)
    print(f"{'':>12} {'TTFT P50':>10} {'latency P50':>12} {'latency P90':>12}")
    for name, (ttft, tot) in res.items():
        print(f"{name:>12} {1e3 * statistics.median(ttft):>8.2f}ms {1e3 * statistics.median(tot):>10.2f}ms "
              f"{1e3 * pct(tot, 0.9):>10.2f}ms")
    dt = statistics.median(res["dispatcher"][1]) - statistics.median(res["direct"][1])
    d1 = statistics.median(res["dispatcher"][0]) - statistics.median(res["direct"][0])
    ratio = statistics.median(res["dispatcher"][1]) / statistics.median(res["direct"][1])
    print(f"  dispatcher adds {1e3 * d1:.2f} ms to TTFT and {1e3 * dt:.2f} ms to the request "
          f"(latency ratio {ratio:.3f})")


def part_overhead(args, tmp: Path) -> None:
    n = 60 if args.quick else 200
    body = lambda i: {"prompt": list(range(1, 65)), "max_tokens": 16, "stream": True}   # noqa: E731
    fp = free_port()
    fakes = start_fakes(fp, 2, tmp)
    dc, dd = free_port(), free_port()
    disp_c = start_dispatcher(tmp, dc, [f"http://127.0.0.1:{fp}"], [])
    disp_d = start_dispatcher(tmp, dd, [f"http://127.0.0.1:{fp}"], [(f"http://127.0.0.1:{fp + 1}",
                                                                     "tcp://127.0.0.1:1")])
    try:
        async def go():
            for u in (f"http://127.0.0.1:{fp}", f"http://127.0.0.1:{dc}", f"http://127.0.0.1:{dd}"):
                await wait_http(u, 60)
            rc = await compare(f"http://127.0.0.1:{fp}", f"http://127.0.0.1:{dc}", n, body)
            rd = await compare(f"http://127.0.0.1:{fp}", f"http://127.0.0.1:{dd}", n, body)
            return rc, rd
        rc, rd = asyncio.run(go())
        print_compare(f"\nper-request overhead, fake worker (no compute), {n} sequential streamed requests "
                      f"(64-token prompt, 16 tokens), co-located (one leg)", rc)
        print_compare("same, disaggregated (prefill leg + decode leg: two upstream calls)", rd)
    finally:
        for p in (disp_c, disp_d, fakes):
            p.stop()


def part_throughput(args, tmp: Path) -> None:
    n_p, n_d = 32, 4
    fp = 9600   # 36 consecutive ports
    fakes = start_fakes(fp, n_p + n_d, tmp)
    dport = free_port()
    disp = start_dispatcher(tmp, dport, [f"http://127.0.0.1:{fp + i}" for i in range(n_p)],
                            [(f"http://127.0.0.1:{fp + n_p + j}", f"tcp://127.0.0.1:{17000 + j}") for j in range(n_d)])
    url = f"http://127.0.0.1:{dport}"
    secs = 5 if args.quick else 10
    try:
        async def go():
            await wait_http(url, 60)
            rows = []
            async with session() as c:
                for conc in (8, 32, 64):
                    body = {"prompt": list(range(1, 257)), "max_tokens": 16, "stream": True}
                    for _ in range(20):
                        await one(c, url, body)
                    done, errors = 0, 0
                    stop = time.perf_counter() + secs
                    cpu0, t0 = cpu_seconds(disp.p.pid), time.perf_counter()

                    async def loop():
                        nonlocal done, errors
                        while time.perf_counter() < stop:
                            try:
                                await one(c, url, body)
                                done += 1
                            except Exception:
                                errors += 1
                    await asyncio.gather(*(loop() for _ in range(conc)))
                    wall, cpu = time.perf_counter() - t0, cpu_seconds(disp.p.pid) - cpu0
                    rows.append((conc, done / wall, 1e3 * cpu / max(done, 1), cpu / wall, errors))
            return rows
        rows = asyncio.run(go())
        print(f"\ndispatcher alone: {n_p} fake prefill + {n_d} fake decode workers (HTTP only), GoRouting, "
              f"streamed requests (256-token prompt, 16 tokens), closed loop, {secs} s per level; "
              f"client, fakes and dispatcher share this machine's {os.cpu_count()} cores")
        print(f"{'concurrency':>11} {'req/s':>8} {'disp CPU ms/req':>16} {'disp CPU share':>15} {'errors':>7}")
        for conc, rps, ms, share, err in rows:
            print(f"{conc:>11} {rps:>8.1f} {ms:>16.2f} {share:>15.2f} {err:>7}")
        best = min(r[2] for r in rows)
        print(f"  one core of dispatcher CPU sustains about {1e3 / best:.0f} req/s of this shape")
    finally:
        disp.stop()
        fakes.stop()


def part_vllm(args, tmp: Path) -> None:
    n = 40 if args.quick else 100
    wp, dport = free_port(), free_port()
    worker = Proc([sys.executable, "-m", "proserve.prefill", "--colocated", "--port", str(wp), "--cpu-bind", "0"],
                  tmp / "vllm-worker.log")
    disp = start_dispatcher(tmp, dport, [f"http://127.0.0.1:{wp}"], [])
    rng = random.Random(0)
    body = lambda i: {"prompt": [rng.randrange(3, 1000) for _ in range(128)], "max_tokens": 32,   # noqa: E731
                      "ignore_eos": True, "stream": True}
    try:
        async def go():
            await wait_http(f"http://127.0.0.1:{wp}", 600)
            await wait_http(f"http://127.0.0.1:{dport}", 60)
            return await compare(f"http://127.0.0.1:{wp}", f"http://127.0.0.1:{dport}", n, body)
        res = asyncio.run(go())
        print_compare(f"\nper-request overhead on a real vLLM CPU worker (tiny model, co-located), {n} sequential "
                      f"streamed requests (128-token prompt, 32 tokens)", res)
    finally:
        disp.stop()
        worker.stop()


def part_cluster(args, tmp: Path) -> None:
    run = tmp / "cluster"
    port = free_port()
    ports = f"{free_port()},{free_port()},{free_port()}"
    subprocess.run(["bash", str(ROOT / "scripts" / "launch_cluster.sh"), "-d", str(run), "-p", str(port),
                    "--ports", ports], check=True, cwd=ROOT)
    try:
        pid = int(next(line.split()[0] for line in (run / "pids").read_text().splitlines()
                       if line.split()[1] == "dispatcher"))
        url = f"http://127.0.0.1:{port}"
        rng = random.Random(1)
        n = 64 if args.quick else 160

        async def go():
            async with session() as c:
                for _ in range(3):
                    await one(c, url, {"prompt": list(range(3, 67)), "max_tokens": 8, "stream": True})
                cpu0, t0 = cpu_seconds(pid), time.perf_counter()
                res = await asyncio.gather(*(one(c, url, {
                    "prompt": [rng.randrange(3, 1000) for _ in range(rng.randint(64, 512))],
                    "max_tokens": rng.randint(16, 64), "ignore_eos": True, "stream": True}) for _ in range(n)),
                    return_exceptions=True)
                return res, time.perf_counter() - t0, cpu_seconds(pid) - cpu0
        res, wall, cpu = asyncio.run(go())
        ok = [r for r in res if not isinstance(r, Exception)]
        print(f"\nreal 1P1D CPU cluster saturated by a burst of {n} streamed requests (prompts 64-512, 16-64 tokens):")
        print(f"  {len(ok)}/{n} completed in {wall:.1f} s: {len(ok) / wall:.2f} req/s; dispatcher CPU "
              f"{cpu:.2f} s = {cpu / wall:.3f} of one core ({1e3 * cpu / max(1, len(ok)):.2f} ms/request)")
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / "stop_cluster.sh"), "-d", str(run)], cwd=ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="route,overhead,throughput",
                    help="comma-separated: route, overhead, throughput, vllm, cluster")
    ap.add_argument("--quick", action="store_true", help="fewer requests per part")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    known = {"route", "overhead", "throughput", "vllm", "cluster"}
    bad = set(parts) - known
    if bad:
        raise SystemExit(f"error: --parts: unknown part(s) {', '.join(sorted(bad))}; choose from {', '.join(sorted(known))}")
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix="bench-dispatcher-"))
    print(f"# python scripts/bench_dispatcher.py --parts {','.join(parts)}{' --quick' if args.quick else ''}  "
          f"({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; logs in {tmp})")
    for p in parts:
        if p == "route":
            part_route(args)
        else:
            globals()[f"part_{p}"](args, tmp)


if __name__ == "__main__":
    main()
