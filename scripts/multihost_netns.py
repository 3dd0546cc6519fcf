#!/usr/bin/env python3
"""A real multi-host ProServe cluster on one machine, in Linux network namespaces.

Six namespaces stand in for hosts on a private subnet (default 10.77.0.0/24):

    <tag>-sw    a switch: the bridge every host's veth link is attached to
    <tag>-disp  the dispatcher                       10.77.0.10:8000
    <tag>-p0    prefill worker 0                     10.77.0.11:8100
    <tag>-p1    prefill worker 1                     10.77.0.12:8100
    <tag>-d0    decode worker 0, KV receiver on      10.77.0.21:8200, tcp://10.77.0.21:15600
    <tag>-cli   the client (load generator, probes)  10.77.0.30

(<tag> is psmh<pid>, unique per run). Nothing is added to the root namespace:
the bridge lives in its own namespace, so the host's firewall and routes are
neither used nor touched. Every host has only its loopback and its one link,
and a default route via .1 as a real host has (nothing answers there; it makes
programs that look up "their" address, like vLLM's get_ip(), find the 10.x one).

The cluster runs secured as the README's multi-host section says: fresh
secrets (scripts/make_keys.sh), each host given only what its role needs
(dispatcher: worker.key; prefill: worker.key, kv/client.key_secret,
kv/server.key; decode: worker.key, kv/server.key_secret, kv/clients/), the
workers with --api-key-file and --kv-keys (CURVE on KV) bound to their own
address, the dispatcher from a generated TOML config naming the workers by
their 10.x addresses, clients with API keys (one per priority class).

The engines start one after another (decode, then the prefill workers; a vLLM
CPU engine takes 30-90 s on 2 cores), each waited for with a bound. Then the
load generator replays a short priority-tagged slice of the bundled Azure trace
through the dispatcher from the client host, and the script checks:

  requests     every request answered 200 with the token count it asked for,
               both classes present; the dispatcher's own records agree
  kv_bytes     KV payload bytes sent by the prefill workers (sum of their
               proserve:kv_sent_bytes_total) == bytes received by the decode
               worker (proserve:kv_received_bytes_total) > 0, one transfer per
               request, no KV send or load failure, the decode engine computed
               no prompt itself (at most a prompt's last token)
  kv_tcp       the decode host's KV port carried the bytes over TCP from the
               prefill hosts' addresses (ss's per-connection byte counters)
  listeners    `ss -ltun` in every namespace: no listener on a wildcard address
               (0.0.0.0, ::, *) and none on the host's 10.x address but the
               intended ones (HTTP of every worker and the dispatcher, the KV
               port of the decode worker); everything else on loopback only
  auth         a worker asked without the API key (or with a wrong one) answers
               401 (/v1/models, /v1/completions, /tokenize) and 200 with it;
               /health stays open; the dispatcher's /v1/completions without a
               client key (or with a wrong one) answers 401, with one 200
  kv_curve     two strangers dial the decode host's KV port from the client
               host, one without CURVE and one with a key pair the receiver does
               not admit: both fail the handshake (the receiver's
               handshake_failures counter), deliver nothing, and the decode
               worker stays healthy

With --membership (issue 15: workers join and leave at run time) a seventh namespace
holds a second decode worker d1, started with the others but not in the dispatcher's
config, and the dispatcher gets an admin key. The replay then comes in two halves: while
the first runs the script, over the admin API (/admin/workers), adds d1 once a tenth of
the requests are routed; once a sixth are, drains the prefill worker that took most of
them and drains d0 (so that the new decode worker surely serves: with both idle, the
decode pick's tie goes to d0); then starts the second half, removes the drained prefill
worker once it holds no request, and resumes d0 once every request is routed. So the
second half is routed between the drains and the resume however slow the admin calls are
on a loaded host (pacing the steps by the replay alone left that window empty in CI).
A further check:

  membership   every admin call answered as it should (201, 200, DELETE 200 once the
               worker showed 0 requests, and it is gone from the list); no request that
               reached the dispatcher after the drain was routed to the drained prefill
               worker, none decoded on d0 while it was drained (the dispatcher's
               per-request records, --record-requests), d1 served some of the requests
               (records and its KV counters), and every request still ended 200 with
               its tokens

With --dispatchers 2 (issue 15: several dispatchers) an eighth namespace holds a second
dispatcher (10.77.0.14:8000) with the same config, workers and admin key; each prefill
worker publishes its queued prefill work (--publish-queue-port 15700, CURVE keys of their
own: the workers hold the server secret and the admitted client keys, the dispatchers the
client secret) and both dispatchers read it; the replay is split over the two (a load
generator each, half the rate), and the membership steps go to both. A further check:

  dispatchers  each dispatcher answered its share, applied publications of the workers
               (proserve:dispatcher_publications_total{result="ok"} > 0, none malformed)
               and saw in them requests the other dispatcher had sent
               (proserve:dispatcher_publication_foreign_requests_total > 0)

Everything is torn down on exit, failure, Ctrl-C or SIGTERM: process groups
get SIGTERM then SIGKILL, anything left in the namespaces is killed, the
namespaces (and with them the links and the bridge) are deleted, and so are
the run's throwaway secrets (logs, configs and records stay in --out). Namespaces
left by an earlier run whose process is gone (psmh<pid>-*, pid dead) are
removed at start.

Exit status: 0 every check passed; 1 a check failed or the cluster did not
come up; 2 bad usage; 3 this machine cannot run it (not root, no iproute2/ss,
network namespaces cannot be made, no vLLM): the reason is printed.

    sudo python3 scripts/multihost_netns.py                 # the whole run (2.5-5 min on 2 cores)
    python3 scripts/multihost_netns.py --probe              # can namespaces be made here? (exit 0 or 3)
    python3 scripts/multihost_netns.py --json out.json --out DIR --requests 30
    sudo python3 scripts/multihost_netns.py --membership    # + workers added, drained, removed mid-run
    sudo python3 scripts/multihost_netns.py --membership --dispatchers 2   # what CI runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "psmh"
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_CANNOT = 0, 1, 2, 3

KEYS_TOML = """# client API keys -> priority class (generated by scripts/multihost_netns.py)
[[keys]]
key = "sk-mh-high-0000000001"
client = "interactive"
class = "high"

[[keys]]
key = "sk-mh-low-00000000001"
client = "batch"
class = "low"
"""
HIGH_KEY = "sk-mh-high-0000000001"
#: --dispatchers 2: the prefill workers publish their queues every this many seconds (often: a
#: request of the tiny model waits for its prefill for a few tens of ms), on this port; a
#: dispatcher falls back to its own view after this many intervals without one
PUBLISH_INTERVAL_S = 0.01
PUBLISH_STALE_INTERVALS = 50
PUBLISH_PORT = 15700


class Failed(Exception):
    """The cluster did not come up or a step failed (exit 1)."""


class _Stop(BaseException):
    """SIGTERM/SIGHUP received: unwind through the teardown."""


def log(msg: str) -> None:
    print(f"[multihost {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[str], timeout: float = 30, check: bool = True,
       input: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, input=input)
    if check and p.returncode != 0:
        raise Failed(f"`{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


# -- namespaces ---------------------------------------------------------------------------------
def netns_list() -> list[str]:
    p = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    p = sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def kill_ns_processes(ns: str, grace: float = 10.0) -> int:
    """SIGTERM then SIGKILL every process inside namespace ``ns`` (only ever ours: the
    namespace was made by this script); how many there were."""
    pids = ns_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10)
        while time.monotonic() < deadline and ns_pids(ns):
            time.sleep(0.2)
        if not ns_pids(ns):
            break
    return len(pids)


def delete_ns(ns: str) -> None:
    kill_ns_processes(ns)
    sh(["ip", "netns", "del", ns], check=False)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def cleanup_stale() -> list[str]:
    """Delete namespaces psmh<pid>-* whose creating process is gone (an earlier run killed hard)."""
    gone = []
    for ns in netns_list():
        if not ns.startswith(PREFIX):
            continue
        tag = ns.split("-", 1)[0][len(PREFIX):]
        if tag.isdigit() and int(tag) != os.getpid() and not pid_alive(int(tag)):
            delete_ns(ns)
            gone.append(ns)
    return gone


def probe() -> str | None:
    """None when this machine can run the set-up, else why not."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    for tool in ("ip", "ss", "curl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 and curl are needed)"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        p = sh(["ip", "netns", "add", name], check=False)
        if p.returncode != 0:
            return f"`ip netns add` failed: {p.stderr.strip()}"
        p = sh(["ip", "-n", name, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"], check=False)
        if p.returncode != 0:
            return f"veth links cannot be made in a namespace: {p.stderr.strip()}"
        p = sh(["ip", "-n", name, "link", "add", "probebr", "type", "bridge"], check=False)
        if p.returncode != 0:
            return f"a bridge cannot be made in a namespace: {p.stderr.strip()}"
    finally:
        sh(["ip", "netns", "del", name], check=False)
    return None


class Net:
    """The namespaces, links and bridge of one run."""

    def __init__(self, tag: str, subnet: str):
        self.tag, self.subnet = tag, subnet
        self.sw = f"{tag}-sw"
        self.made: list[str] = []
        self.hosts: dict[str, str] = {}   # role -> address

    def ns(self, role: str) -> str:
        return f"{self.tag}-{role}"

    def up(self, hosts: dict[str, int]) -> None:
        """hosts: role -> last octet of its address."""
        for name in [self.sw] + [self.ns(r) for r in hosts]:
            sh(["ip", "netns", "add", name])
            self.made.append(name)
            sh(["ip", "-n", name, "link", "set", "lo", "up"])
        sh(["ip", "-n", self.sw, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", self.sw, "link", "set", "br0", "up"])
        for role, octet in hosts.items():
            ns, addr = self.ns(role), f"{self.subnet}.{octet}"
            # the pair is made in the host's namespace (eth0 there), its peer moved to the switch
            sh(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"v-{role}", "netns", self.sw])
            sh(["ip", "-n", self.sw, "link", "set", f"v-{role}", "master", "br0"])
            sh(["ip", "-n", self.sw, "link", "set", f"v-{role}", "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            # a default route, as a real host has (nothing answers at .1, and nothing is sent off the
            # subnet): programs that find "their" address by routing towards the internet (vLLM's
            # get_ip()) then find the 10.x one, as they would on a real host
            sh(["ip", "-n", ns, "route", "add", "default", "via", f"{self.subnet}.1"])
            self.hosts[role] = addr

    def exec(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(role)]

    def down(self) -> list[str]:
        left = []
        for name in reversed(self.made):
            delete_ns(name)
        existing = set(netns_list())
        left = [n for n in self.made if n in existing]
        self.made = left
        return left


# -- processes ----------------------------------------------------------------------------------
class Proc:
    def __init__(self, name: str, cmd: list[str], logfile: Path, env: dict | None = None):
        self.name, self.cmd, self.logfile = name, cmd, logfile
        self._log = open(logfile, "w")
        self.p = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 3000) -> str:
        try:
            return self.logfile.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace: float = 20) -> str:
        """SIGTERM to the process group, SIGKILL after ``grace`` s."""
        how = "not running"
        try:
            os.killpg(self.p.pid, signal.SIGTERM)
            how = "stopped"
        except ProcessLookupError:
            pass
        try:
            self.p.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            how = f"killed after {grace:g} s"
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                how = "would not die"
        # the rest of the group (vLLM's engine core), if it outlived its leader
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        return how


# -- the run ------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def metric_sum(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] == name)


def parse_listeners(ss_out: str) -> list[dict]:
    """`ss -H -ltunp` lines -> [{proto, addr, port, process}]."""
    out = []
    for line in ss_out.splitlines():
        f = line.split()
        if len(f) < 5:
            continue
        local = f[4]
        addr, _, port = local.rpartition(":")
        addr = addr.strip("[]")
        if "%" in addr:   # 0.0.0.0%lo style: bound to a device; keep the address
            addr = addr.split("%", 1)[0]
        proc = " ".join(f[6:]) if len(f) > 6 else ""
        out.append({"proto": f[0], "addr": addr, "port": int(port) if port.isdigit() else port, "process": proc})
    return out


WILDCARD = {"0.0.0.0", "*", "::", ""}


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "localhost")


class Run:
    def __init__(self, args):
        self.a = args
        self.tag = args.tag or f"{PREFIX}{os.getpid()}"
        self.net = Net(self.tag, args.subnet)
        self.out = Path(args.out or f"/tmp/{self.tag}").resolve()
        self.procs: list[Proc] = []
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.checks: dict[str, dict] = {}
        self.info: dict = {}
        self.py = sys.executable
        self.http_port = {"disp": 8000, "p0": 8100, "p1": 8100, "d0": 8200, "d1": 8200}
        self.prefills = ["p0", "p1"]
        # decode workers: d0 in the dispatcher's config; --membership: d1 added at run time
        self.decodes = ["d0", "d1"] if args.membership else ["d0"]
        self.admin_key: str | None = None
        # --dispatchers 2: a second dispatcher in its own namespace; the prefill workers publish
        # their queued work (issue 15) and both dispatchers read it
        self.disps = ["disp", "disp2"][:args.dispatchers]
        self.publish = args.dispatchers > 1
        self.publish_port = PUBLISH_PORT
        self.kv_port = 15600

    # helpers running in the client's namespace ----------------------------------------------
    def curl(self, url: str, *extra: str, timeout: float = 10, role: str = "cli") -> tuple[int, str]:
        p = sh([*self.net.exec(role), "curl", "-s", "-m", str(timeout), "-o", "-", "-w", "\n%{http_code}",
                *extra, url], timeout=timeout + 10, check=False)
        body, _, code = p.stdout.rpartition("\n")
        return (int(code) if code.isdigit() else 0), body

    def wait_healthy(self, proc: Proc, url: str, timeout: float) -> float:
        t0 = time.monotonic()
        while True:
            if not proc.alive():
                raise Failed(f"{proc.name} exited ({proc.p.returncode}) before it was healthy; "
                             f"log tail:\n{proc.tail()}")
            code, _ = self.curl(url + "/health", timeout=3)
            if code == 200:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise Failed(f"{proc.name} not healthy after {timeout:g} s; log tail:\n{proc.tail()}")
            time.sleep(1)

    def mark(self, what: str, since: float) -> None:
        self.timings[what] = round(time.monotonic() - since, 1)

    # set-up -----------------------------------------------------------------------------------
    def secrets(self) -> dict[str, Path]:
        """Fresh secrets; one directory per host with only what its role needs."""
        allsec = self.out / "secrets-all"
        sh(["bash", str(ROOT / "scripts" / "make_keys.sh"), str(allsec), "--overwrite"], timeout=120)
        need = {"disp": ["worker.key"],
                "p0": ["worker.key", "kv/client.key_secret", "kv/server.key"],
                "p1": ["worker.key", "kv/client.key_secret", "kv/server.key"],
                "d0": ["worker.key", "kv/server.key_secret", "kv/clients"],
                "d1": ["worker.key", "kv/server.key_secret", "kv/clients"],
                "disp2": ["worker.key"]}
        if self.publish:   # the queue publications' CURVE keys: workers serve, dispatchers subscribe
            sh([self.py, "-m", "proserve.kvtransfer.keys", str(allsec / "pub"), "--overwrite"], timeout=60)
            for r in self.disps:
                need[r] = need[r] + ["pub/client.key_secret", "pub/server.key"]
            for r in self.prefills:
                need[r] = need[r] + ["pub/server.key_secret", "pub/clients"]
        need = {r: f for r, f in need.items() if r in (*self.disps, *self.prefills, *self.decodes)}
        dirs = {}
        for role, files in need.items():
            d = self.out / "hosts" / role / "secrets"
            (d / "kv").mkdir(parents=True, mode=0o700, exist_ok=True)
            (d / "pub").mkdir(parents=True, mode=0o700, exist_ok=True)
            for f in files:
                src, dst = allsec / f, d / f
                if src.is_dir():
                    shutil.copytree(src, dst, dirs_exist_ok=True)
                else:
                    shutil.copy2(src, dst)
            dirs[role] = d
        self.worker_key = (allsec / "worker.key").read_text().strip()
        if self.a.membership:   # the admin API's key: on the dispatcher's host only
            self.admin_key = os.urandom(24).hex()
            for r in self.disps:
                (dirs[r] / "admin.key").write_text(self.admin_key + "\n")
                os.chmod(dirs[r] / "admin.key", 0o600)
        return dirs

    def cpu_binds(self) -> dict[str, str | None]:
        n = os.cpu_count() or 1
        if n >= 4:
            return {"p0": "0", "p1": "1", "d0": "2", "d1": str(3 % n)}
        if n >= 2:   # as launch_cluster.sh: prefill engines on core 0, decode on core 1
            return {"p0": "0", "p1": "0", "d0": "1", "d1": "1"}
        return {"p0": None, "p1": None, "d0": None, "d1": None}

    def start_worker(self, role: str, sec: Path, bind: str | None, wait: bool = True) -> Proc:
        kind = "decode" if role.startswith("d") else "prefill"
        addr, port = self.net.hosts[role], self.http_port[role]
        cmd = [*self.net.exec(role), self.py, "-m", f"proserve.{kind}", "--host", addr, "--port", str(port),
               "--api-key-file", str(sec / "worker.key"), "--kv-keys", str(sec / "kv"), "--block-size", "32"]
        if kind == "decode":
            cmd += ["--kv-listen", f"tcp://{addr}:{self.kv_port}"]
        elif self.publish:   # its queued prefill work, for both dispatchers (issue 15), CURVE
            cmd += ["--publish-queue-port", str(self.publish_port), "--publish-interval", str(PUBLISH_INTERVAL_S),
                    "--publish-keys", str(sec / "pub")]
        if bind is not None:
            cmd += ["--cpu-bind", bind]
        # prefix caching off: every request's prompt KV is computed on a prefill host and sent in
        # full, so the checks (bytes sent == received, the decode host computes no prompt token)
        # do not depend on what earlier requests left cached
        cmd += ["--", "--no-enable-prefix-caching"]
        p = Proc(f"{kind} worker {role}", cmd, self.out / f"{role}.log")
        p.t0 = time.monotonic()
        self.procs.append(p)
        log(f"starting {p.name} in {self.net.ns(role)} on http://{addr}:{port}"
            + (f", KV on tcp://{addr}:{self.kv_port}" if kind == "decode" else ""))
        if wait:
            self.wait_worker(role, p)
        return p

    def wait_worker(self, role: str, p: Proc) -> None:
        addr, port = self.net.hosts[role], self.http_port[role]
        took = self.wait_healthy(p, f"http://{addr}:{port}", self.a.start_timeout)
        self.timings[f"start {role}"] = round(time.monotonic() - p.t0, 1)
        log(f"{p.name} healthy after {took:.0f} s ({time.monotonic() - p.t0:.0f} s since its start)")

    def start_dispatcher(self, secs: dict[str, Path]) -> None:
        """The dispatchers (one, or with --dispatchers 2 a second in its own namespace: the same
        workers, both reading the prefill workers' queue publications), one after the other."""
        h = self.net.hosts
        self.keys = self.out / "hosts" / "disp" / "keys.toml"
        self.keys.write_text(KEYS_TOML)
        self.disp_urls, self.records_of = [], {}
        for role in self.disps:
            sec = secs[role]
            pub_cfg = ""
            if self.publish:
                pub_cfg = (f'publication_keys = "{sec / "pub"}"\n'
                           f"publication_interval_s = {PUBLISH_INTERVAL_S}\n"
                           f"publication_stale_intervals = {PUBLISH_STALE_INTERVALS}\n")
            prefills = "".join(
                f'\n[[prefill]]\nurl = "http://{h[r]}:{self.http_port[r]}"\n'
                + (f'publish = "tcp://{h[r]}:{self.publish_port}"\n' if self.publish else "")
                for r in self.prefills)
            cfg = f"""# generated by scripts/multihost_netns.py: workers named by their addresses on the private subnet
[dispatcher]
host = "{h[role]}"
port = {self.http_port['disp']}
global_policy = "go_routing"
worker_api_key_file = "{sec / 'worker.key'}"
health_interval_s = 0.5
{pub_cfg}{prefills}
[[decode]]
url = "http://{h['d0']}:{self.http_port['d0']}"
kv_addr = "tcp://{h['d0']}:{self.kv_port}"
"""
            conf = self.out / "hosts" / role / "cluster.toml"
            conf.write_text(cfg)
            records = self.out / ("dispatcher-requests.jsonl" if role == "disp" else f"{role}-requests.jsonl")
            cmd = [*self.net.exec(role), self.py, "-m", "proserve.dispatcher", "--config", str(conf),
                   "--keys", str(self.keys), "--record-requests", str(records), "--wait-ready", "60"]
            if self.admin_key:
                cmd += ["--admin-key-file", str(sec / "admin.key")]
            t0 = time.monotonic()
            name = "dispatcher" if role == "disp" else f"dispatcher {role}"
            p = Proc(name, cmd, self.out / ("dispatcher.log" if role == "disp" else f"{role}.log"))
            self.procs.append(p)
            url = f"http://{h[role]}:{self.http_port['disp']}"
            self.disp_urls.append(url)
            self.records_of[url] = records
            log(f"starting {name} in {self.net.ns(role)} on {url}")
            self.wait_healthy(p, url, 120)
            # every instance in service, as the dispatcher sees them
            deadline = time.monotonic() + 60
            while True:
                code, body = self.curl(url + "/health", timeout=5)
                try:
                    inst = json.loads(body).get("instances", [])
                except (ValueError, AttributeError):
                    inst = []
                healthy = [i for i in inst if i.get("healthy") is True]
                if code == 200 and len(inst) == 3 and len(healthy) == 3:
                    break
                if time.monotonic() > deadline:
                    raise Failed(f"{name} does not see 3 healthy instances after 60 s: {body[:2000]}")
                time.sleep(0.5)
            self.info.setdefault("dispatcher_instances", {})[role] = inst
            self.timings[f"start {role}"] = round(time.monotonic() - t0, 1)
            log(f"{name} healthy, all 3 instances in service")
        self.disp_url = self.disp_urls[0]
        self.records = self.records_of[self.disp_url]

    # workload and checks ----------------------------------------------------------------------
    def workload(self) -> None:
        n, k = self.a.requests, len(self.disp_urls)
        # --membership: two halves, the second started by the scenario once the drains are answered
        halves = [n - n // 2, n // 2] if self.a.membership else [n]
        procs, outs = [], []
        log(f"replaying {n} priority-tagged requests (Azure trace at {self.a.rate} req/s, two classes, half "
            f"streamed) from {self.net.ns('cli')} through {', '.join(self.disp_urls)}"
            + (f", in two parts of {halves[0]} and {halves[1]}" if len(halves) > 1 else ""))
        t0 = time.monotonic()
        deadline = t0 + self.a.workload_timeout

        def start(part: int) -> None:
            """A load generator per dispatcher for this part of the replay, at the whole rate."""
            size = halves[part]
            shares = [size // k + (1 if i < size % k else 0) for i in range(k)]   # split over the dispatchers
            for i, (url, m) in enumerate(zip(self.disp_urls, shares)):
                if m == 0:
                    continue
                sfx = ("" if i == 0 else str(i + 1)) + ("" if part == 0 else f"-part{part + 1}")
                lg = self.out / f"loadgen{sfx}"
                cmd = [*self.net.exec("cli"), self.py, "-m", "proserve.bench.loadgen", "--url", url,
                       "--api", "proserve", "--keys", str(self.keys), "--num-requests", str(m),
                       "--rate", str(self.a.rate * m / size), "--prompt-div", "4", "--output-div", "8",
                       "--max-prompt", "512", "--stream-fraction", "0.5", "--seed", str(15 + i + 100 * part),
                       "--out", str(lg), "--quiet", "--no-plots", "--timeout", "300"]
                # its output to files (nothing to drain while the membership steps run beside it)
                with open(self.out / f"loadgen{sfx}.log", "w") as err, open(self.out / f"loadgen{sfx}.out", "w") as o:
                    procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=err, text=True))
                outs.append((lg, self.out / f"loadgen{sfx}.out"))

        try:
            start(0)
            if self.a.membership:
                self.membership_scenario(lambda: all(p.poll() is not None for p in procs), deadline,
                                         lambda: start(1))
            for p in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise Failed(f"the load generator did not finish in {self.a.workload_timeout:g} s")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self.mark("workload", t0)
        rc = max(p.returncode for p in procs)
        self.info["loadgen_rc"] = rc
        self.info["loadgen_table"] = []
        recs = []
        for lg, out in outs:
            self.info["loadgen_table"] += out.read_text(errors="replace").strip().splitlines()[-12:]
            if (lg / "requests.jsonl").is_file():
                recs += [json.loads(line) for line in (lg / "requests.jsonl").read_text().splitlines()
                         if line.strip()]
        bad = [{"id": r["id"], "status": r.get("status"), "tokens": r.get("tokens"),
                "expected": r.get("expected_tokens"), "error": r.get("error")}
               for r in recs if r.get("status") != 200 or r.get("error") is not None
               or r.get("tokens") != r.get("expected_tokens") or not r.get("expected_tokens")]
        classes: dict[str, int] = {}
        for r in recs:
            classes[r["priority"]] = classes.get(r["priority"], 0) + 1
        drecs, per_disp = [], {}
        for url, path in self.records_of.items():
            got = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
                if path.is_file() else []
            per_disp[url] = len(got)
            drecs += got
        self.info["records_per_dispatcher"] = per_disp
        routed: dict[str, int] = {}
        for r in drecs:
            routed[r.get("prefill") or "?"] = routed.get(r.get("prefill") or "?", 0) + 1
        dbad = [r.get("id") for r in drecs if r.get("outcome") != "ok"]
        self.n_requests = len(recs)
        self.routed = routed
        ok = (len(recs) == self.a.requests and not bad and rc == 0 and set(classes) == {"high", "low"}
              and len(drecs) == self.a.requests and not dbad and all(per_disp.values()))
        self.checks["requests"] = {
            "ok": ok, "sent": self.a.requests, "answered": len(recs), "bad": bad[:10], "by_class": classes,
            "tokens": sum(r.get("tokens") or 0 for r in recs), "loadgen_rc": rc,
            "dispatcher_records": len(drecs), "dispatcher_not_ok": dbad[:10], "prefill_routed": routed,
            "streamed": sum(1 for r in recs if r.get("stream"))}
        if self.a.membership:
            self.membership_check()

    # membership (issue 15): a decode worker added, a prefill worker drained and removed mid-run ----
    def admin(self, method: str, path: str, body: dict | None = None, url: str | None = None) -> tuple[int, object]:
        extra = ["-X", method, "-H", f"Authorization: Bearer {self.admin_key}"]
        if body is not None:
            extra += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        code, text = self.curl((url or self.disp_url) + path, *extra, timeout=15)
        try:
            return code, json.loads(text)
        except ValueError:
            return code, text

    def workers(self, url: str | None = None) -> list[dict]:
        code, data = self.admin("GET", "/admin/workers", url=url)
        if code != 200 or not isinstance(data, dict):
            raise Failed(f"GET /admin/workers: HTTP {code}: {str(data)[:500]}")
        return data.get("data", [])

    def routed(self) -> dict[str, float]:
        """Prefill routing decisions per worker name, summed over the dispatchers (each counter
        at the most it has shown: a removed worker's series leave the dispatcher's page)."""
        seen = self.__dict__.setdefault("_routed_seen", {})
        for url in self.disp_urls:
            code, body = self.curl(url + "/metrics", timeout=10)
            for k, v in (parse_metrics(body) if code == 200 else {}).items():
                if k.startswith("proserve:dispatcher_routed_total{") and 'role="prefill"' in k:
                    name = k.split('instance="', 1)[1].split('"', 1)[0] if 'instance="' in k else "?"
                    seen[url, name] = max(seen.get((url, name), 0.0), v)
        out: dict[str, float] = {}
        for (_, name), v in seen.items():
            out[name] = out.get(name, 0.0) + v
        return out

    def membership_scenario(self, finished, deadline: float, second_half) -> None:
        """While the first half of the replay runs, through the admin API of every dispatcher:
        add decode worker d1 once a tenth of the requests are routed; once a sixth are, drain
        the prefill worker that took most of them and drain d0 (the new decode worker replaces
        it for a while, so that d1 surely serves requests: with both idle the decode pick's tie
        goes to d0); then start the second half (``second_half()``), remove the drained prefill
        worker once it holds no request, and resume d0 once every request is routed. The second
        half is sent after both drains were answered and routed before the resume is sent, so
        the checks below have requests to look at whatever the timing."""
        h, n = self.net.hosts, self.a.requests
        res = self.membership = {"steps": []}

        def step(what: str, code: int, ok: bool) -> None:
            res["steps"].append({"what": what, "status": code, "ok": ok,
                                 "at": round(time.monotonic() - self.t0, 1)})
            log(f"membership: {what}: HTTP {code}")

        def wait_routed(k: int, why: str) -> dict[str, float]:
            while True:
                r = self.routed()
                if sum(r.values()) >= k:
                    return r
                if finished() or time.monotonic() > deadline:
                    raise Failed(f"membership: the workload ended (or timed out) before {k} requests were "
                                 f"routed, {why}")
                time.sleep(0.25)

        def on_all(what: str, method: str, path: str, want: int, body: dict | None = None) -> dict:
            """The call at every dispatcher; per dispatcher [sent, answered] (time.time())."""
            at = {}
            for url in self.disp_urls:
                t = time.time()
                code, data = self.admin(method, path, body, url=url)
                at[url] = [t, time.time()]
                ok = code == want
                step(f"{what} ({url})", code, ok)
                if not ok:
                    raise Failed(f"membership: {what} at {url}: HTTP {code}: {str(data)[:500]}")
            return at

        wait_routed(max(1, n // 10), "to add the decode worker")
        res["added_at"] = on_all("add decode worker d1", "POST", "/admin/workers", 201, {
            "role": "decode", "name": "d1", "url": f"http://{h['d1']}:{self.http_port['d1']}",
            "kv_addr": f"tcp://{h['d1']}:{self.kv_port}"})
        routed = wait_routed(max(2, n // 6), "to drain a prefill worker")
        names = {w.get("url"): w.get("name") for w in self.workers()}
        prefill_names = [names[f"http://{h[r]}:{self.http_port[r]}"] for r in self.prefills]
        name = max(prefill_names, key=lambda x: routed.get(x, 0.0))   # the busiest: its drain matters
        res["drained"], res["routed_before_drain"] = name, routed
        # requests routed from here on never go to `name`, nor decode on d0 (until its resume)
        res["drained_at"] = on_all(f"drain {name}", "POST", f"/admin/workers/{name}/drain", 200)
        res["d0_drained_at"] = on_all("drain d0", "POST", "/admin/workers/d0/drain", 200)
        res["routed_when_d0_drained"] = sum(self.routed().values())
        second_half()   # sent from here on: routed after both drains
        res["state_after_drain"] = sorted({w.get("state") for url in self.disp_urls
                                           for w in self.workers(url) if w.get("name") == name})
        # remove it once its requests have ended (the safe sequence: drain, wait for 0, delete)
        held = []
        for url in self.disp_urls:
            while True:
                w = next((w for w in self.workers(url) if w.get("name") == name), {})
                held.append(w.get("requests"))
                if w.get("requests") == 0:
                    break
                if time.monotonic() > deadline:
                    raise Failed(f"membership: {name} still holds requests at the workload's deadline: {w}")
                time.sleep(0.25)
            code, data = self.admin("DELETE", f"/admin/workers/{name}", url=url)
            step(f"remove {name} ({url})", code, code == 200)
            if code != 200:
                raise Failed(f"membership: DELETE {name} at {url}: HTTP {code}: {str(data)[:500]}")
        res["requests_on_drained_seen"] = sorted({x for x in held if x is not None})
        res["listed_after_delete"] = sorted({w.get("name") for url in self.disp_urls for w in self.workers(url)})
        # resume d0 once every request is routed: the second half was, inside the window the
        # check reads (a retry counts twice, and may let this pass a moment sooner)
        wait_routed(n, "to resume d0")
        res["d0_resumed_at"] = on_all("resume d0", "POST", "/admin/workers/d0/resume", 200)

    def membership_check(self) -> None:
        """Each dispatcher's records against the times of the admin calls: no request routed
        after the dispatcher answered the drain went to the drained prefill worker, and none
        routed between its answer to d0's drain and the sending of d0's resume decoded on d0.
        By the time a request was routed (its record's ``routed_at``), which is what a drain
        governs: its arrival only bounds that from below, so a check by arrival needs a grace
        before the resume, and on a loaded host a grace can swallow the whole window."""
        res = self.membership
        name = res.get("drained")
        after, window, drecs = [], [], []
        for url, path in self.records_of.items():
            recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
                if path.is_file() else []
            drecs += recs
            t_drain = res.get("drained_at", {}).get(url, [None, None])[1]
            t_d0 = res.get("d0_drained_at", {}).get(url, [None, None])[1]
            t_resume = res.get("d0_resumed_at", {}).get(url, [None, None])[0]
            routed = [r for r in recs if isinstance(r.get("routed_at"), (int, float))]
            after += [r for r in routed if t_drain is not None and r["routed_at"] > t_drain]
            window += [r for r in routed if t_d0 and t_resume and t_d0 < r["routed_at"] < t_resume]
        to_drained = [r.get("id") for r in after if r.get("prefill") == name]
        on_d0_drained = [r.get("id") for r in window if r.get("decode") == "d0"]
        on_added = [r for r in drecs if r.get("decode") == "d1"]
        res.update({
            "requests_after_drain": len(after), "routed_to_drained_after_drain": to_drained[:10],
            "routed_to_drained_before_drain": sum(1 for r in drecs if r.get("prefill") == name) - len(to_drained),
            "decode_on_added": len(on_added), "requests_while_d0_drained": len(window),
            "decode_on_d0_while_drained": on_d0_drained[:10],
            "prefill_routed_after_drain": {k: sum(1 for r in after if r.get("prefill") == k)
                                           for k in sorted({r.get("prefill") for r in after if r.get("prefill")})},
            "decode_routed": {k: sum(1 for r in drecs if r.get("decode") == k)
                              for k in sorted({r.get("decode") for r in drecs if r.get("decode")})}})
        res["ok"] = (all(s["ok"] for s in res["steps"]) and res.get("state_after_drain") == ["draining"]
                     and name not in res.get("listed_after_delete", [name]) and len(after) > 0 and not to_drained
                     and len(window) > 0 and not on_d0_drained and len(on_added) > 0
                     and self.checks["requests"]["ok"])
        self.checks["membership"] = res

    def kv_check(self) -> None:
        h = self.net.hosts

        def scrape(role):
            code, body = self.curl(f"http://{h[role]}:{self.http_port[role]}/metrics", timeout=20)
            if code != 200:
                raise Failed(f"GET /metrics of {role}: HTTP {code}")
            return parse_metrics(body)

        # counters of the engine processes reach /metrics through files: allow them a moment
        deadline = time.monotonic() + 30
        while True:
            m = {r: scrape(r) for r in (*self.prefills, *self.decodes)}
            sent = {r: metric_sum(m[r], "proserve:kv_sent_bytes_total") for r in self.prefills}
            recv = {r: metric_sum(m[r], "proserve:kv_received_bytes_total") for r in self.decodes}
            received = sum(recv.values())
            transfers = sum(metric_sum(m[r], "proserve:kv_received_transfers_total") for r in self.decodes)
            if (sum(sent.values()) == received and transfers >= self.n_requests) or time.monotonic() > deadline:
                break
            time.sleep(1)
        send_fail = {r: metric_sum(m[r], "proserve:kv_send_failures_total") for r in self.prefills}
        load_fail = sum(metric_sum(m[r], "proserve:kv_load_failures_total") for r in self.decodes)
        total = sum(sent.values())
        # the decode engines computed (almost) no prompt themselves: vLLM may compute a prompt's last token
        by_source: dict[str, float] = {}
        for r in self.decodes:
            for k, v in m[r].items():
                if k.startswith("vllm:prompt_tokens_by_source_total") and 'source="' in k:
                    src = k.split('source="', 1)[1].split('"', 1)[0]
                    by_source[src] = by_source.get(src, 0.0) + v
        local = by_source.get("local_compute", 0.0)
        self.checks["kv_bytes"] = {
            "ok": total == received and received > 0 and transfers == self.n_requests
            and not any(send_fail.values()) and load_fail == 0 and local <= self.n_requests
            and by_source.get("external_kv_transfer", 0) > 0,
            "decode_prompt_tokens_by_source": {k: int(v) for k, v in by_source.items()},
            "sent_by_prefill": {r: int(v) for r, v in sent.items()}, "sent_total": int(total),
            "received_by_decode": int(received), "received_transfers": int(transfers),
            "received_by_decode_worker": {r: int(v) for r, v in recv.items()},
            "requests": self.n_requests, "send_failures": send_fail, "load_failures": load_fail}
        # the wire: per-connection TCP byte counters on the decode host's KV port
        peers: dict[str, int] = {}
        for role in self.decodes:
            p = sh([*self.net.exec(role), "ss", "-H", "-tni", "state", "established",
                    f"( sport = :{self.kv_port} )"], check=False)
            lines = p.stdout.splitlines()
            for i, line in enumerate(lines):
                f = line.split()
                local = next((j for j, x in enumerate(f) if x.endswith(f":{self.kv_port}")), None)
                if local is not None and local + 1 < len(f):
                    peer = f[local + 1].rpartition(":")[0].strip("[]")
                    info = lines[i + 1] if i + 1 < len(lines) else ""
                    rcv = next((int(t.split(":")[1]) for t in info.split() if t.startswith("bytes_received:")), 0)
                    peers[peer] = peers.get(peer, 0) + rcv
        prefill_addrs = {h[r] for r in self.prefills}
        used = {h[r] for r in self.prefills if sent[r] > 0}
        wire = sum(v for k, v in peers.items() if k in prefill_addrs)
        self.checks["kv_tcp"] = {
            "ok": bool(peers) and set(peers) <= prefill_addrs and used <= set(peers) and wire >= received,
            "bytes_received_from": peers, "wire_total": wire, "payload_total": int(received),
            "note": "wire bytes include CURVE framing and the transfers' headers and acks"}

    def dispatchers_check(self) -> None:
        """--dispatchers 2: each dispatcher served its share, received its workers' queue
        publications (CURVE), none malformed, and saw in them requests the other one sent."""
        per, ok = {}, True
        for url in self.disp_urls:
            code, body = self.curl(url + "/metrics", timeout=10)
            m = parse_metrics(body) if code == 200 else {}

            def by(name: str, result: str | None = None, m: dict = m) -> float:
                return sum(v for k, v in m.items() if k.split("{")[0] == name
                           and (result is None or f'result="{result}"' in k))
            d = {"records": self.info.get("records_per_dispatcher", {}).get(url, 0),
                 "publications_ok": int(by("proserve:dispatcher_publications_total", "ok")),
                 "publications_malformed": int(by("proserve:dispatcher_publications_total", "malformed")),
                 "publications_stale": int(by("proserve:dispatcher_publications_total", "stale")),
                 "foreign_requests_seen": int(by("proserve:dispatcher_publication_foreign_requests_total"))}
            ok &= (code == 200 and d["records"] > 0 and d["publications_ok"] > 0 and d["publications_malformed"] == 0
                   and d["foreign_requests_seen"] > 0)
            per[url] = d
        self.checks["dispatchers"] = {"ok": ok, "per_dispatcher": per,
                                      "publication_interval_s": PUBLISH_INTERVAL_S}

    def listeners_check(self) -> None:
        h = self.net.hosts
        intended = {"p0": {("tcp", h["p0"], self.http_port["p0"])},
                    "p1": {("tcp", h["p1"], self.http_port["p1"])},
                    "cli": set(), "sw": set()}
        for r in self.disps:
            intended[r] = {("tcp", h[r], self.http_port["disp"])}
        if self.publish:   # the queue publications, on the prefill hosts' addresses
            for r in self.prefills:
                intended[r].add(("tcp", h[r], self.publish_port))
        for r in self.decodes:
            intended[r] = {("tcp", h[r], self.http_port[r]), ("tcp", h[r], self.kv_port)}
        per_ns, wildcard, unexpected, missing = {}, [], [], []
        for role in intended:
            p = sh([*self.net.exec(role), "ss", "-H", "-ltunp"], check=False)
            ls = parse_listeners(p.stdout)
            per_ns[role] = [f"{x['proto']} {x['addr']}:{x['port']} {x['process']}".strip() for x in ls]
            seen = set()
            for x in ls:
                key = (x["proto"], x["addr"], x["port"])
                seen.add(key)
                if x["addr"] in WILDCARD:
                    wildcard.append(f"{role}: {x['proto']} {x['addr'] or '*'}:{x['port']} {x['process']}")
                elif not is_loopback(x["addr"]) and key not in intended[role]:
                    unexpected.append(f"{role}: {x['proto']} {x['addr']}:{x['port']} {x['process']}")
            missing += [f"{role}: {k[0]} {k[1]}:{k[2]}" for k in intended[role] if k not in seen]
        self.checks["listeners"] = {
            "ok": not wildcard and not unexpected and not missing, "wildcard": wildcard,
            "unexpected_non_loopback": unexpected, "intended_missing": missing,
            "intended": {r: sorted(f"{p} {a}:{port}" for p, a, port in v) for r, v in intended.items() if v},
            "per_namespace": per_ns}

    def auth_check(self) -> None:
        h = self.net.hosts
        res, ok = {}, True
        bearer = ["-H", f"Authorization: Bearer {self.worker_key}"]
        body = ["-H", "Content-Type: application/json", "-d",
                json.dumps({"prompt": [5, 6, 7], "max_tokens": 1, "model": "x"})]
        for role in (*self.prefills, *self.decodes):
            base = f"http://{h[role]}:{self.http_port[role]}"
            got = {
                "GET /v1/models without key": self.curl(base + "/v1/models")[0],
                "POST /v1/completions without key": self.curl(base + "/v1/completions", *body)[0],
                "POST /tokenize without key": self.curl(base + "/tokenize", *body)[0],
                "GET /v1/models with a wrong key": self.curl(base + "/v1/models", "-H",
                                                             "Authorization: Bearer sk-wrong")[0],
                "GET /v1/models with the key": self.curl(base + "/v1/models", *bearer)[0],
                "GET /health (open)": self.curl(base + "/health")[0],
            }
            want = {k: (200 if ("with the key" in k or "open" in k) else 401) for k in got}
            ok &= got == want
            res[role] = got
        # the dispatcher wants a client key for completions; with one it answers
        dbody = ["-H", "Content-Type: application/json", "-d", json.dumps({"prompt": [5, 6, 7], "max_tokens": 2})]
        dgot = {"POST /v1/completions without key": self.curl(self.disp_url + "/v1/completions", *dbody)[0],
                "POST /v1/completions with a wrong key": self.curl(
                    self.disp_url + "/v1/completions", *dbody, "-H", "Authorization: Bearer sk-wrong")[0],
                "POST /v1/completions with a client key": self.curl(
                    self.disp_url + "/v1/completions", *dbody, "-H", f"Authorization: Bearer {HIGH_KEY}",
                    timeout=120)[0],
                "GET /v1/models without key": self.curl(self.disp_url + "/v1/models")[0],
                "GET /v1/models with a client key": self.curl(
                    self.disp_url + "/v1/models", "-H", f"Authorization: Bearer {HIGH_KEY}")[0]}
        dwant = {k: (200 if "client key" in k else 401) for k in dgot}
        ok &= dgot == dwant
        res["disp"] = dgot
        self.checks["auth"] = {"ok": ok, "status_codes": res}

    def curve_check(self) -> None:
        """Two strangers dial the decode host's KV port from the client host: one without CURVE, one
        with a CURVE key pair the receiver does not admit. Neither gets through: the receiver counts
        their failed handshakes, accepts no transfer from them, and stays healthy."""
        h = self.net.hosts
        d0 = f"http://{h['d0']}:{self.http_port['d0']}"
        bearer = ["-H", f"Authorization: Bearer {self.worker_key}"]

        def status() -> dict:
            """The receiver's counters as of a heartbeat written after this call began (the
            receiver writes its status file about once a second)."""
            t, deadline = time.time(), time.monotonic() + 15
            while True:
                code, body = self.curl(d0 + "/kv/status", *bearer)
                if code != 200:
                    raise Failed(f"GET /kv/status of d0: HTTP {code}: {body[:300]}")
                data = json.loads(body)
                if data.get("time", 0) > t or time.monotonic() > deadline:
                    return data.get("stats", {})
                time.sleep(0.3)

        before = status()
        server_pub = self.out / "hosts" / "p0" / "secrets" / "kv" / "server.key"   # public: any client may know it
        code = (
            "import sys, time, zmq, zmq.auth\n"
            "addr, server_key = sys.argv[1], sys.argv[2]\n"
            "ctx = zmq.Context()\n"
            "out = {}\n"
            "for name in ('no_curve', 'unknown_curve_key'):\n"
            "    s = ctx.socket(zmq.DEALER)\n"
            "    s.setsockopt(zmq.LINGER, 0)\n"
            "    s.setsockopt(zmq.SNDTIMEO, 3000)\n"
            "    if name == 'unknown_curve_key':\n"
            "        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()\n"
            "        s.curve_serverkey = zmq.auth.load_certificate(server_key)[0]\n"
            "    s.connect(addr)\n"
            "    try:\n"
            "        s.send_multipart([b'hello', b'x' * 64])\n"
            "        out[name] = 'queued locally, never delivered'\n"
            "    except zmq.Again:\n"
            "        out[name] = 'could not send (no handshake)'\n"
            "    time.sleep(1.5)\n"
            "    s.close()\n"
            "ctx.term()\n"
            "print(out)\n")
        p = sh([*self.net.exec("cli"), self.py, "-c", code, f"tcp://{h['d0']}:{self.kv_port}", str(server_pub)],
               timeout=60, check=False)
        deadline = time.monotonic() + 15   # the receiver writes its status about once a second
        while True:
            after = status()
            grew = after.get("handshake_failures", 0) - before.get("handshake_failures", 0)
            denied = after.get("auth_failures", 0) - before.get("auth_failures", 0)
            if (grew >= 2 and denied >= 1) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        health = self.curl(d0 + "/health")[0]
        same = {k: (before.get(k), after.get(k)) for k in ("transfers_completed", "messages_received")}
        self.checks["kv_curve"] = {
            "ok": p.returncode == 0 and grew >= 2 and denied >= 1 and all(a == b for a, b in same.values())
            and None not in same["transfers_completed"] and health == 200,
            "strangers": p.stdout.strip() or p.stderr.strip()[-500:], "handshake_failures_added": grew,
            "zap_denials_added": denied,
            "unchanged": same, "decode_health_after": health}

    # teardown ---------------------------------------------------------------------------------
    def teardown(self) -> None:
        t0 = time.monotonic()
        stopped = {}
        for p in reversed(self.procs):   # the dispatcher first, then the workers
            stopped[p.name] = p.stop()
        left = self.net.down()
        # the run's secrets are throwaway: remove them (logs, configs and records stay in --out)
        for d in [self.out / "secrets-all", *self.out.glob("hosts/*/secrets")]:
            shutil.rmtree(d, ignore_errors=True)
        self.info["stopped"] = stopped
        self.info["namespaces_left"] = left
        self.info["namespaces_after"] = [n for n in netns_list() if n.startswith(self.tag + "-")]
        self.mark("teardown", t0)

    def main(self) -> int:
        rc = EXIT_FAIL
        error = None
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            stale = cleanup_stale()
            if stale:
                log(f"removed namespaces of earlier runs whose process is gone: {', '.join(stale)}")
            t = time.monotonic()
            sec = self.secrets()
            self.mark("secrets", t)
            t = time.monotonic()
            o = self.a.subnet
            self.net.up({"disp": 10, "p0": 11, "p1": 12, "d0": 21, "cli": 30,
                         **({"d1": 22} if self.a.membership else {}),
                         **({"disp2": 14} if "disp2" in self.disps else {})})
            self.mark("network", t)
            log(f"namespaces {', '.join(self.net.made)} on {o}.0/24 (bridge br0 in {self.net.sw})")
            binds = self.cpu_binds()
            t = time.monotonic()
            for role in ("d0", "p0"):   # one engine start at a time ...
                self.start_worker(role, sec[role], binds[role])
            # ... but the decode worker added at run time (--membership) starts beside p1, on the
            # other core: it is not in the dispatcher's config, the admin API adds it mid-run
            late = self.start_worker("d1", sec["d1"], binds["d1"], wait=False) if self.a.membership else None
            self.start_worker("p1", sec["p1"], binds["p1"])
            if late is not None:
                self.wait_worker("d1", late)
            self.start_dispatcher(sec)
            self.mark("cluster up", t)
            self.workload()
            t = time.monotonic()
            self.kv_check()
            if self.publish:
                self.dispatchers_check()
            self.listeners_check()
            self.auth_check()
            self.curve_check()
            self.mark("checks", t)
            rc = EXIT_OK if all(c["ok"] for c in self.checks.values()) else EXIT_FAIL
        except Failed as e:
            error = str(e)
            log(f"error: {e}")
        except (KeyboardInterrupt, _Stop):
            error = "interrupted"
            log("interrupted: tearing down")
        except Exception as e:   # anything unforeseen still ends in the teardown and the report
            import traceback
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            log(f"error: {error}")
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # a second Ctrl-C must not cut the teardown
                signal.signal(sig, signal.SIG_IGN)
            try:
                self.teardown()
            finally:
                self.timings["total"] = round(time.monotonic() - self.t0, 1)
                if self.info.get("namespaces_after"):
                    rc = EXIT_FAIL
                    error = (error or "") + f" namespaces left after teardown: {self.info['namespaces_after']}"
                self.report(rc, error)
        return rc

    def report(self, rc: int, error: str | None) -> None:
        summary = {"ok": rc == EXIT_OK, "error": error, "tag": self.tag, "subnet": f"{self.a.subnet}.0/24",
                   "hosts": self.net.hosts, "checks": self.checks, "timings_s": self.timings, "info": self.info,
                   "out": str(self.out)}
        if self.a.json:
            Path(self.a.json).write_text(json.dumps(summary, indent=1, default=str))
        print()
        print(f"== multi-host run {self.tag}: {'PASS' if rc == EXIT_OK else 'FAIL'} ==")
        for role, addr in self.net.hosts.items():
            print(f"  host {self.net.ns(role):<14} {addr}")
        for name, c in self.checks.items():
            detail = {k: v for k, v in c.items() if k not in ("ok", "per_namespace")}
            print(f"  [{'ok' if c['ok'] else 'FAIL'}] {name}: {json.dumps(detail, default=str)}")
        if "listeners" in self.checks:
            print("  listeners by namespace (ss -ltunp):")
            for role, ls in self.checks["listeners"]["per_namespace"].items():
                for line in ls or ["(none)"]:
                    print(f"    {role:<5} {line}")
        if self.info.get("loadgen_table"):
            print("  load generator report:")
            for line in self.info["loadgen_table"]:
                print("    " + line)
        print("  timings (s): " + ", ".join(f"{k} {v}" for k, v in self.timings.items()))
        print(f"  teardown: {self.info.get('stopped')}; namespaces left: {self.info.get('namespaces_after')}")
        if error:
            print(f"  error: {error}")
        print(f"  logs: {self.out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", action="store_true",
                    help="only check that namespaces, veth links and a bridge can be made here (exit 0 or 3)")
    ap.add_argument("--requests", type=int, default=30, help="requests to replay (default 30)")
    ap.add_argument("--rate", type=float, default=2.0, help="their mean arrival rate, req/s (default 2)")
    ap.add_argument("--subnet", default="10.77.0", help="the first three octets of the private /24 (default 10.77.0)")
    ap.add_argument("--out", default=None, help="logs, secrets, config and the load generator's records "
                                                "(default /tmp/<tag>)")
    ap.add_argument("--json", default=None, help="write the checks, timings and listeners as JSON here")
    ap.add_argument("--tag", default=None, help="namespace name prefix (default psmh<pid>)")
    ap.add_argument("--membership", action="store_true",
                    help="also a second decode worker (its own namespace) added through the dispatcher's admin "
                         "API mid-run, the busiest prefill worker drained mid-run and removed once idle, d0 "
                         "drained and resumed (issue 15)")
    ap.add_argument("--dispatchers", type=int, choices=[1, 2], default=1,
                    help="2: a second dispatcher in its own namespace with the same workers, the replay split "
                         "over both, the prefill workers publishing their queues (CURVE) for both (issue 15)")
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds each engine may take to start (300)")
    ap.add_argument("--workload-timeout", type=float, default=420, help="seconds the replay may take (420)")
    a = ap.parse_args(argv)
    if a.requests < 2:
        ap.error("--requests must be at least 2 (two classes)")
    parts = a.subnet.split(".")
    if len(parts) != 3 or not all(x.isdigit() and 0 <= int(x) <= 255 for x in parts):
        ap.error(f"--subnet: three octets like 10.77.0, got {a.subnet!r}")
    why = probe()
    if why:
        print(f"cannot run here: {why}", file=sys.stderr)
        return EXIT_CANNOT
    if a.probe:
        print("network namespaces, veth links and bridges can be made here")
        return EXIT_OK
    try:
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            print("cannot run here: vLLM is not installed (pip install -e '.[cpu]')", file=sys.stderr)
            return EXIT_CANNOT
    except ImportError:
        pass

    def stop(signum, frame):
        raise _Stop()
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, stop)
    return Run(a).main()


if __name__ == "__main__":
    sys.exit(main())
