"""End to end on real engines: scripts/launch_cluster.sh starts vLLM CPU workers
(tiny model) and the dispatcher; bench.loadgen replays priority-tagged traffic
through it with API keys; scripts/stop_cluster.sh stops it all.

* 1P1D: 100 mixed-priority requests, streamed and not, all complete; the
  load generator's report agrees with its per-request records and with the
  dispatcher's own records and metrics; the decode worker received every
  prompt's KV (it computed no prompt token itself); bad input gets the right
  4xx and the cluster keeps serving; the cluster stops cleanly.
* 1P2D: a decode worker killed (SIGKILL) during a run: its requests end with
  errors or are retried, later requests go to the survivor, nothing hangs.

Each test has its own cluster. The 1P2D one is launched in the background as soon as the
1P1D one is healthy (fixture `cluster_1p2d`), so that its start-up overlaps the 1P1D
test's run instead of following it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pd_helpers import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
KEYS = """
[[keys]]
key = "sk-e2e-high-0001"
client = "acme"
class = "high"
ttft_ms = [100, 60000]

[[keys]]
key = "sk-e2e-low-00001"
client = "batchco"
class = "low"
"""


class Cluster:
    def __init__(self, tmp: Path, decodes: int = 1):
        self.run = tmp / "run"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys = tmp / "keys.toml"
        self.keys.write_text(KEYS)
        ports = f"{free_port()},{free_port()},{free_port()}"
        p = subprocess.run(["bash", "scripts/launch_cluster.sh", "-d", str(self.run), "-p", str(self.port),
                            "-D", str(decodes), "--ports", ports, "--keys", str(self.keys)],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(self.run.glob("*.log")))
            raise RuntimeError(f"launch_cluster.sh failed:\n{p.stdout}\n{p.stderr}\n{logs}")
        self.pids = [line.split() for line in (self.run / "pids").read_text().splitlines()]

    def worker(self, role: str, i: int) -> tuple[int, str]:
        for pid, r, idx, port in self.pids:
            if r == role and int(idx) == i:
                return int(pid), f"http://127.0.0.1:{port}"
        raise KeyError((role, i))

    def stop(self) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/stop_cluster.sh", "-d", str(self.run)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)


class _Pending:
    """A cluster launched in a background thread (start()), waited for by get()."""

    def __init__(self, tmp: Path, decodes: int):
        self.tmp, self.decodes = tmp, decodes
        self.pool = ThreadPoolExecutor(1)
        self.future = None

    def start(self) -> None:
        if self.future is None:
            self.future = self.pool.submit(Cluster, self.tmp, self.decodes)

    def get(self) -> Cluster:
        self.start()
        return self.future.result(timeout=1200)


@pytest.fixture(scope="module")
def cluster_1p2d(request, tmp_path_factory):
    """The kill test's 1P2D cluster, launched early by the 1P1D test where both run. The
    test stops it; one still running at the end of the module is stopped here."""
    pending = _Pending(tmp_path_factory.mktemp("e2e_1p2d"), decodes=2)
    pending.wanted = any(item.originalname == "test_killed_decode_worker_fails_or_retries_its_requests_and_nothing_hangs"
                         for item in request.session.items)
    yield pending
    if pending.future is not None:
        try:
            c = pending.future.result(timeout=1200)
        except Exception:
            c = None                      # its launch failed: launch_cluster.sh stopped what it started
        if c is not None and (c.run / "pids").exists():
            c.stop()
    pending.pool.shutdown()


def post(url: str, body, key: str | None = "sk-e2e-high-0001", raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/completions", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out


def loadgen(c: Cluster, out: Path, n: int, rate: float, *extra: str, timeout: float = 900):
    return subprocess.run(
        [sys.executable, "-m", "proserve.bench.loadgen", "--url", c.url, "--api", "proserve", "--keys", str(c.keys),
         "--num-requests", str(n), "--rate", str(rate), "--prompt-div", "4", "--output-div", "4",
         "--max-prompt", "1024", "--ttft-slo", "2", "--tpot-slo", "0.2", "--out", str(out), "--quiet", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_cluster_serves_100_mixed_priority_requests_and_stops_cleanly(tmp_path, cluster_1p2d):
    c = Cluster(tmp_path)
    if cluster_1p2d.wanted:
        cluster_1p2d.start()              # the next test's cluster starts while this one serves
    stopped = False
    try:
        p = loadgen(c, tmp_path / "lg", 100, 4.0, "--stream-fraction", "0.5", "--no-plots")
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        from proserve.bench.loadgen import report_from_records
        from proserve.scheduler.tdg import GainConfig
        summary = json.loads((tmp_path / "lg" / "summary.json").read_text())
        recs = [json.loads(line) for line in (tmp_path / "lg" / "requests.jsonl").read_text().splitlines()]
        assert len(recs) == 100
        assert sum(1 for r in recs if r.get("error")) == 0, [r["error"] for r in recs if r.get("error")][:5]
        streamed = sum(1 for r in recs if r["stream"])
        assert 30 <= streamed <= 70
        # the report is what the records say
        again = report_from_records(tmp_path / "lg" / "requests.jsonl", GainConfig(**summary["gain"]))
        assert again["metrics"] == summary["metrics"]
        by_class = {k: v for k, v in summary["metrics"].items() if k != "all"}
        assert set(by_class) == {"high", "low"}
        assert sum(v["requests"] for v in by_class.values()) == 100
        # ...and what the dispatcher saw: one record per request, same classes, same token counts
        drec = [json.loads(line) for line in (c.run / "dispatcher-requests.jsonl").read_text().splitlines()]
        assert len(drec) == 100 and all(r["outcome"] == "ok" for r in drec)
        for cls in ("high", "low"):
            n_lg = sum(1 for r in recs if r["priority"] == cls)
            assert sum(1 for r in drec if r["priority"] == cls) == n_lg
            assert metrics(c.url)[f'proserve:dispatcher_requests_total{{outcome="ok",priority="{cls}"}}'] == n_lg
        assert sum(r["output_tokens"] for r in drec) == sum(r["output_len"] for r in recs)
        # the decode worker got every prompt's KV from the prefill worker: it computed none itself
        _, durl = c.worker("decode", 0)
        dm = metrics(durl)
        local = next(v for k, v in dm.items() if k.startswith("vllm:prompt_tokens_by_source_total")
                     and 'source="local_compute"' in k)
        external = next(v for k, v in dm.items() if k.startswith("vllm:prompt_tokens_by_source_total")
                        and 'source="external_kv_transfer"' in k)
        # (vLLM may still compute a prompt's last token itself: at most one per request)
        prompt_tokens = sum(r["prompt_tokens"] for r in drec)
        assert external + local == prompt_tokens and local <= len(drec), (local, external, prompt_tokens)

        # bad input: the right 4xx with a message, and the cluster keeps serving
        good = {"prompt": list(range(3, 40)), "max_tokens": 4}
        cases = [
            (dict(raw=b'{"prompt": [1, 2'), 400, "not valid JSON"),
            (dict(body={"max_tokens": 4}), 400, "missing field 'prompt'"),
            (dict(body={**good, "priority": "gold"}), 400, "unknown class 'gold'"),
            (dict(body={**good, "slo": {"ttft_ms": -1}}), 400, "positive number"),
            (dict(body={**good, "slo": {"tpot_ms": 1e15}}), 400, "over the limit"),
            (dict(body={"prompt": list(range(3, 2100)), "max_tokens": 4}), 400, "maximum context length"),
            (dict(body={**good, "temperature": -3}), 400, "temperature"),          # vLLM's own check
            (dict(body=good, key=None), 401, "missing API key"),
            (dict(body=good, key="sk-wrong-key-123"), 401, "invalid API key"),
            (dict(body={**good, "priority": "high"}, key="sk-e2e-low-00001"), 403, "above what this key allows"),
        ]
        for case, status, msg in cases:
            st, out = post(c.url, case.get("body"), key=case.get("key", "sk-e2e-high-0001"), raw=case.get("raw"))
            assert st == status and msg in out["error"]["message"], (case, st, out)
        st, out = post(c.url, good)
        assert st == 200 and out["usage"]["completion_tokens"] == 4
        # chat, streamed, with a text prompt (the tiny model has a tokenizer): every token
        # reaches the client and the dispatcher counts them
        req = urllib.request.Request(c.url + "/v1/chat/completions", data=json.dumps({
            "messages": [{"role": "user", "content": "Hello ProServe"}], "max_tokens": 6, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}).encode(),
            headers={"content-type": "application/json", "authorization": "Bearer sk-e2e-low-00001"})
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [line[5:].strip() for line in r.read().decode().splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        assert all("token_ids" not in ch["choices"][0] for ch in chunks if ch["choices"])
        last = json.loads((c.run / "dispatcher-requests.jsonl").read_text().splitlines()[-1])
        assert last["endpoint"] == "/v1/chat/completions" and last["output_tokens"] == 6
        assert last["priority"] == "low" and last["prompt_tokens"] > 3
    finally:
        r = c.stop()
        stopped = True
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (c.run / "pids").exists()
    for pid, *_ in c.pids:
        assert not _alive(int(pid)), f"pid {pid} still running after stop_cluster.sh"
    assert stopped


def _alive(pid: int) -> bool:
    """A live process (a zombie waiting to be reaped is not one)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_killed_decode_worker_fails_or_retries_its_requests_and_nothing_hangs(tmp_path, cluster_1p2d):
    c = cluster_1p2d.get()
    try:
        lg = subprocess.Popen(
            [sys.executable, "-m", "proserve.bench.loadgen", "--url", c.url, "--api", "proserve", "--keys", str(c.keys),
             "--num-requests", "80", "--rate", "4", "--prompt-div", "4", "--output-div", "2", "--max-prompt", "1024",
             "--out", str(tmp_path / "lg"), "--quiet", "--no-plots"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        pid, d0 = c.worker("decode", 0)
        # kill it while it serves: once it has a request running (bounded wait)
        deadline = time.monotonic() + 120
        while sum(v for k, v in metrics(d0).items() if k.startswith("vllm:num_requests_running")) < 1:
            assert time.monotonic() < deadline and lg.poll() is None, "no request reached decode worker 0"
            time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)       # the worker and its engine processes, no goodbye
        killed_at = time.time()
        out, _ = lg.communicate(timeout=600)  # nothing hangs: the run ends
        assert lg.returncode in (0, 1), out[-3000:]   # 1: the run had errors (counted below)
        recs = [json.loads(line) for line in (tmp_path / "lg" / "requests.jsonl").read_text().splitlines()]
        assert len(recs) == 80                # every request ended, with tokens or an error
        drec = {r["id"]: r for r in map(json.loads, (c.run / "dispatcher-requests.jsonl").read_text().splitlines())}
        assert len(drec) == 80
        failed = [r for r in drec.values() if r["outcome"] != "ok"]
        # a request that failed was on the killed worker, and it says why
        for r in failed:
            assert r["decode"] == "d0" and r["error"], r
        # requests that arrived after the kill was noticed went to the survivor and succeeded
        late = [r for r in drec.values() if r["arrival"] > killed_at + 5]
        assert late and all(r["decode"] == "d1" and r["outcome"] == "ok" for r in late), late[:3]
        m = metrics(c.url)
        assert m['proserve:dispatcher_instance_healthy{instance="d0",role="decode"}'] == 0
        assert sum(1 for r in recs if r.get("error")) == len(failed)
        assert lg.returncode == (1 if failed else 0)
    finally:
        c.stop()
