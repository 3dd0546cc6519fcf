"""A real local cluster to attack and measure: what the chaos tests
(tests/test_chaos.py) and the soak benchmark (scripts/soak.py) drive.

:class:`Cluster` starts one with scripts/launch_cluster.sh (API key to the
workers and CURVE on the KV transport, the launcher's defaults), kills and
restarts its workers, and calls them directly with the cluster's secrets;
:class:`Dispatcher` puts a second dispatcher with other limits in front of
them; :class:`Proxy` is an HTTP proxy that delays chosen paths or drops
requests; plus process-group RSS, CPU hogs and small HTTP/metrics helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_used_ports: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768+), so that no socket
    vLLM opens for itself meanwhile can take it; never the same one twice."""
    import random
    for _ in range(1000):
        port = random.randint(20000, 32000)
        if port in _used_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _used_ports.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")

KEYS = """
[[keys]]
key = "sk-chaos-high-01"
client = "acme"
class = "high"
ttft_ms = [100, 600000]

[[keys]]
key = "sk-chaos-low-001"
client = "batchco"
class = "low"
"""
HIGH, LOW = "sk-chaos-high-01", "sk-chaos-low-001"


# -- HTTP ---------------------------------------------------------------------------------------
def http(method: str, url: str, body=None, key: str | None = None, timeout: float = 120,
         raw: bytes | None = None) -> tuple[int, dict | str, dict]:
    """(status, JSON body (or text), headers); never raises for an HTTP status."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text, hdrs = r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, text, hdrs = e.code, e.read().decode(), dict(e.headers)
    try:
        return status, json.loads(text), hdrs
    except ValueError:
        return status, text, hdrs


def stream(url: str, body: dict, key: str, timeout: float = 300) -> tuple[int, list]:
    """(status, events) of a streamed completion: parsed `data:` lines, '[DONE]' kept."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            events = []
            for line in r:
                line = line.decode().strip()
                if line.startswith("data:"):
                    data = line[5:].strip()
                    events.append(data if data == "[DONE]" else json.loads(data))
            return r.status, events
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(e.read().decode() or "{}")]


def stream_usage(events: list) -> int | None:
    """completion_tokens of a stream's usage chunk (ask for stream_options.include_usage)."""
    for e in reversed(events):
        if isinstance(e, dict) and e.get("usage"):
            return e["usage"]["completion_tokens"]
    return None


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                try:
                    out[k] = float(v)
                except ValueError:
                    pass
        return out


def metric_sum(m: dict[str, float], prefix: str, *must: str) -> float:
    """Sum of the samples of ``prefix`` whose labels contain every string in ``must``."""
    return sum(v for k, v in m.items() if k.split("{")[0] == prefix and all(s in k for s in must))


def wait_for(pred, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# -- processes ----------------------------------------------------------------------------------
def group_pids(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                pass
    return out


def group_rss_mb(pgid: int) -> float:
    total = 0
    for pid in group_pids(pgid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def group_alive(pgid: int) -> bool:
    """Whether group ``pgid`` has a live (not zombie) process."""
    for pid in group_pids(pgid):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        except OSError:
            pass
    return False


@contextlib.contextmanager
def cpu_hogs(n: int | None = None):
    """`yes > /dev/null` on each core (or n of them), killed by pid afterwards."""
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(n or os.cpu_count() or 1)]
    try:
        yield hogs
    finally:
        for h in hogs:
            h.kill()
            h.wait(10)


# -- the cluster --------------------------------------------------------------------------------
class Cluster:
    """scripts/launch_cluster.sh with secrets (API key to the workers, CURVE on KV)."""

    def __init__(self, tmp: Path, prefills: int = 1, decodes: int = 1, prefill_args: str = "",
                 decode_args: str = "", dispatcher_args: tuple[str, ...] = ()):
        self.tmp = tmp
        self.run = tmp / "run"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = tmp / "keys.toml"
        self.keys.write_text(KEYS)
        self.kv_base = free_port()
        ports = f"{free_port()},{free_port()},{self.kv_base}"
        cmd = ["bash", "scripts/launch_cluster.sh", "-d", str(self.run), "-p", str(self.port),
               "-P", str(prefills), "-D", str(decodes), "--ports", ports, "--keys", str(self.keys)]
        if prefill_args:
            cmd += ["--prefill-args", prefill_args]
        if decode_args:
            cmd += ["--decode-args", decode_args]
        if dispatcher_args:
            cmd += ["--", *dispatcher_args]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.run.glob("*.log")))
            raise RuntimeError(f"launch_cluster.sh failed:\n{p.stdout}\n{p.stderr}\n{logs}")
        self.secrets = self.run / "secrets"
        self.worker_key = (self.secrets / "worker.key").read_text().strip()
        self.kv_keys = self.secrets / "kv"

    @property
    def pids(self) -> list[list[str]]:
        return [line.split() for line in (self.run / "pids").read_text().splitlines()]

    def worker(self, role: str, i: int) -> tuple[int, str]:
        for pid, r, idx, port in self.pids:
            if r == role and int(idx) == i:
                return int(pid), f"http://127.0.0.1:{port}"
        raise KeyError((role, i))

    def kv_addr(self, i: int) -> str:
        """Where decode worker i receives KV (launch_cluster.sh: the KV base port + i)."""
        return f"tcp://127.0.0.1:{self.kv_base + i}"

    def model(self) -> str:
        _, url = self.worker("prefill", 0)
        return http("GET", url + "/v1/models", key=self.worker_key)[1]["data"][0]["id"]

    def kill(self, role: str, i: int, sig=signal.SIGKILL) -> tuple[list[str], dict]:
        """Kill a worker's whole process group; returns its command line and environment
        (the worker exec'd vLLM's server with both), for restart()."""
        pid, _ = self.worker(role, i)
        proc = Path(f"/proc/{pid}")
        argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
        env = dict(kv.decode().split("=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        os.killpg(pid, sig)
        if sig == signal.SIGKILL:
            wait_for(lambda: not group_alive(pid), 30, f"{role} {i} to die")
        return argv, env

    def restart(self, role: str, i: int, how: tuple[list[str], dict]) -> int:
        """Start a worker again as it was started (what kill() returned) and record it for
        stop_cluster.sh."""
        argv, env = how
        # a fresh multiprocess-metrics directory, as a fresh launch would have
        mp = env.get("PROMETHEUS_MULTIPROC_DIR")
        if mp and os.path.isdir(mp):
            for f in Path(mp).glob("*.db"):
                f.unlink()
        log = open(self.run / f"{role}-{i}.restart.log", "a")
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=p.wait, daemon=True).start()   # reaped when it ends: no zombie
        lines = [ln for ln in (self.run / "pids").read_text().splitlines()
                 if not (ln.split()[1] == role and ln.split()[2] == str(i))]
        port = argv[argv.index("--port") + 1]
        lines.append(f"{p.pid} {role} {i} {port}")
        (self.run / "pids").write_text("\n".join(lines) + "\n")
        return p.pid

    def kv_client(self, addr: str, authenticated: bool = True, linger_ms: int = 1000):
        """A raw ZeroMQ DEALER connected to a KV receiver, holding the cluster's CURVE
        client keys (an authenticated peer) or none (a stranger)."""
        import zmq
        import zmq.auth
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, linger_ms)
        if authenticated:
            pub, sec = zmq.auth.load_certificate(str(self.kv_keys / "client.key_secret"))
            srv, _ = zmq.auth.load_certificate(str(self.kv_keys / "server.key"))
            s.curve_publickey, s.curve_secretkey, s.curve_serverkey = pub, sec, srv
        s.connect(addr)
        return s

    def stop(self) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/stop_cluster.sh", "-d", str(self.run)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    def dispatcher_status(self, url: str | None = None) -> dict[str, dict]:
        st, body, _ = http("GET", (url or self.url) + "/health")
        return {w["name"]: w for w in body.get("instances", [])} if isinstance(body, dict) else {}

    # -- direct calls to the workers (what the dispatcher does), with the workers' key --
    def complete(self, url: str, prompt: list[int], max_tokens: int, kv: dict | None = None,
                 timeout: float = 120) -> dict:
        body = {"model": self.model(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        if kv is not None:
            body["kv_transfer_params"] = kv
        st, out, _ = http("POST", url + "/v1/completions", body, key=self.worker_key, timeout=timeout)
        assert st == 200, (st, out)
        return out


class Dispatcher:
    """A second `python -m proserve.dispatcher` in front of (some of) the cluster's workers, with its
    own flags; stopped on exit."""

    def __init__(self, c: Cluster, *flags: str, prefill: list[str] | None = None,
                 decode: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if prefill is None:
            prefill = [url for pid, r, i, port in c.pids if r == "prefill"
                       for url in [f"http://127.0.0.1:{port}"]]
        if decode is None:
            decode = [f"http://127.0.0.1:{port}={c.kv_addr(int(i))}" for pid, r, i, port in c.pids if r == "decode"]
        cmd = [sys.executable, "-m", "proserve.dispatcher", "--port", str(self.port), "--keys", str(c.keys),
               "--worker-key-file", str(c.secrets / "worker.key"), "--wait-ready", "30",
               "--health-interval", "0.5"]
        for u in prefill:
            cmd += ["--prefill", u]
        for d in decode:
            cmd += ["--decode", d]
        self.log_path = c.tmp / f"dispatcher-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*cmd, *flags], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        wait_for(self._healthy, 120, f"dispatcher on {self.port}")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"dispatcher exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            return http("GET", self.url + "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- a misbehaving HTTP proxy -------------------------------------------------------------------
class Proxy:
    """An HTTP reverse proxy in front of one worker, in a thread of its own: passes
    requests through (streamed responses chunk by chunk) except that ``delay[path]``
    seconds are added before answering that path, and the first ``drop_completions``
    POSTs to /v1/* get their connection closed without an answer -- before they
    reach the worker, or with ``drop_after_forward`` once the worker has answered
    them in full (the worker did the work; its client never hears of it)."""

    def __init__(self, target: str, delay: dict[str, float] | None = None, drop_completions: int = 0,
                 drop_after_forward: bool = False):
        self.target = target.rstrip("/")
        self.delay = dict(delay or {})
        self.drop_completions = drop_completions
        self.drop_after_forward = drop_after_forward
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[str] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("proxy did not start")

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._stop = asyncio.Event()

        async def handle(request: web.Request):
            path = request.path
            self.seen.append(path)
            body = await request.read()
            drop = request.method == "POST" and path.startswith("/v1/") and self.drop_completions > 0
            if drop:
                self.drop_completions -= 1
                if not self.drop_after_forward:
                    request.transport.close()
                    return web.Response(status=500)
            if path in self.delay:
                await asyncio.sleep(self.delay[path])
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            async with session.request(request.method, self.target + path, data=body or None,
                                       headers=headers) as up:
                if drop:
                    await up.read()
                    request.transport.close()
                    return web.Response(status=500)
                resp = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await session.close()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def raw_request(port: int, head: bytes, body: bytes = b"", read_timeout: float = 20) -> tuple[bytes, float]:
    """Send raw bytes to 127.0.0.1:port, then read until the server closes or answers;
    (what came back, seconds until it did)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=read_timeout)
    t0 = time.monotonic()
    try:
        s.sendall(head + body)
        chunks = []
        while True:
            try:
                b = s.recv(65536)
            except socket.timeout:
                break
            if not b:
                break
            chunks.append(b)
            if b"\r\n\r\n" in b"".join(chunks) and b"content-length" in b"".join(chunks).lower():
                data = b"".join(chunks)
                hdr, _, rest = data.partition(b"\r\n\r\n")
                n = next((int(line.split(b":")[1]) for line in hdr.split(b"\r\n")
                          if line.lower().startswith(b"content-length")), 0)
                if len(rest) >= n:
                    break
        return b"".join(chunks), time.monotonic() - t0
    finally:
        s.close()
