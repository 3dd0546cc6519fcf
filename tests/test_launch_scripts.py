"""The per-host launch scripts: scripts/launch_dispatcher.sh, the pool scripts
(launch_prefill.sh / launch_decode.sh over _launch_pool.sh) and stop_pool.sh.

No vLLM engine starts here: the dispatcher runs in front of fake workers
(proserve.bench.fake_worker), and the pool scripts either print their command
lines (--dry-run) or start a stand-in ``python3`` (first on PATH) that records
its arguments and serves a fake worker on the --host/--port it was given.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
OWN = ["launch_dispatcher.sh", "_launch_pool.sh", "launch_prefill.sh", "launch_decode.sh", "stop_pool.sh"]
SOURCED = ["_devices.sh"]   # a library the launch scripts source: checked, not run


def sh(*args: str, env: dict | None = None, timeout: float = 180, cwd: Path | None = None,
       cores: set[int] | None = None):
    """Run a script with bash; ``cores``: the CPU affinity it runs with (what it sees as this host's cores)."""
    pre = (lambda: os.sched_setaffinity(0, cores)) if cores is not None else None
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
                          env=env or os.environ.copy(), stdin=subprocess.DEVNULL, check=False, preexec_fn=pre)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """A base port with n free consecutive ports after it."""
    for _ in range(50):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def http_status(url: str, timeout: float = 5) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_pids(run: Path) -> list[list[str]]:
    f = run / "pids"
    return [line.split() for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def kill_recorded(run: Path) -> None:
    """Safety net: the process groups a failed test left behind."""
    for fields in read_pids(run):
        try:
            os.killpg(int(fields[0]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


def secrets_dir(tmp: Path) -> Path:
    """The layout of scripts/make_keys.sh (the scripts check that the files exist, not their content)."""
    d = tmp / "secrets"
    (d / "kv" / "clients").mkdir(parents=True)
    (d / "worker.key").write_text("sk-worker-test\n")
    for f in ("client.key_secret", "server.key", "server.key_secret"):
        (d / "kv" / f).write_text("x\n")
    return d


# -- syntax and usage -------------------------------------------------------------------------------
@pytest.mark.parametrize("script", OWN + SOURCED + ["launch_cluster.sh", "stop_cluster.sh"])
def test_bash_syntax(script):
    p = sh("-n", str(SCRIPTS / script))
    assert p.returncode == 0, p.stderr
    assert script in SOURCED or os.access(SCRIPTS / script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script, words", [
    ("launch_dispatcher.sh", ["-c CONFIG", "-k KEYS_FILE", "-d RUN_DIR", "-t SECONDS", "/health", "stop_pool.sh"]),
    ("launch_prefill.sh", ["-H BIND_ADDR", "--secrets DIR", "--api-key-file", "--kv-keys", "--dry-run", "-w SECONDS",
                           "--tensor-parallel-size T", "--devices GROUPS", "CUDA_VISIBLE_DEVICES",
                           "ASCEND_RT_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND"]),
    ("launch_decode.sh", ["-H BIND_ADDR", "--kv-host", "-k KV_BASE_PORT", "--secrets DIR", "CURVE", "--dry-run",
                          "--tensor-parallel-size T", "--devices GROUPS", "KV_BASE_PORT+i*T", "rank 0's"]),
    ("launch_cluster.sh", ["-P N_PREFILL", "--tensor-parallel-size N", "--devices GROUPS", "--dry-run",
                           "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND",
                           "each worker gets 0|1", "stop_cluster.sh"]),
    ("stop_pool.sh", ["-d RUN_DIR", "dispatcher", "SIGTERM"]),
])
def test_help(script, words):
    p = sh(str(SCRIPTS / script), "--help")
    assert p.returncode == 0, p.stderr
    for w in words:
        assert w in p.stdout, f"{script} --help lacks {w!r}:\n{p.stdout}"
    assert not any(line.startswith("#") for line in p.stdout.splitlines())


def test_unknown_option_is_an_error():
    for script in ("launch_dispatcher.sh", "launch_prefill.sh", "launch_decode.sh", "stop_pool.sh", "launch_cluster.sh"):
        p = sh(str(SCRIPTS / script), "--no-such-option")
        assert p.returncode == 2 and "error: unknown" in p.stderr, (script, p.stderr)


# -- the pool scripts: bind address and security options -------------------------------------------
def dry(script: str, *args: str) -> list[str]:
    p = sh(str(SCRIPTS / script), "--dry-run", *args)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()


def test_pool_defaults_to_loopback():
    (line,) = dry("launch_prefill.sh")
    assert line == "python3 -m proserve.prefill --host 127.0.0.1 --port 8100"
    (line,) = dry("launch_decode.sh")
    assert line == "python3 -m proserve.decode --host 127.0.0.1 --port 8200 --kv-listen tcp://127.0.0.1:15600"


def test_pool_host_flag_reaches_the_worker_command(tmp_path):
    s = secrets_dir(tmp_path)
    lines = dry("launch_prefill.sh", "-n", "2", "-p", "9100", "-H", "10.1.2.3", "--secrets", str(s),
                "--", "--cpu-bind", "0", "--", "--max-num-seqs", "8")
    assert lines == [f"python3 -m proserve.prefill --host 10.1.2.3 --port {9100 + i} --api-key-file {s}/worker.key "
                     f"--kv-keys {s}/kv --cpu-bind 0 -- --max-num-seqs 8" for i in range(2)]
    lines = dry("launch_decode.sh", "-n", "2", "-k", "17000", "-H", "10.1.2.3", "--api-key-file", str(s / "worker.key"),
                "--kv-keys", str(s / "kv"))
    assert lines == [f"python3 -m proserve.decode --host 10.1.2.3 --port {8200 + i} --kv-listen "
                     f"tcp://10.1.2.3:{17000 + i} --api-key-file {s}/worker.key --kv-keys {s}/kv" for i in range(2)]
    # KV on another address than HTTP; IPv6 in brackets
    (line,) = dry("launch_decode.sh", "-H", "127.0.0.1", "--kv-host", "fd00::5", "--kv-keys", str(s / "kv"))
    words = shlex.split(line)   # the printed lines are shell-quoted (printf %q)
    assert words[words.index("--host") + 1] == "127.0.0.1"
    assert words[words.index("--kv-listen") + 1] == "tcp://[fd00::5]:15600"
    # a trusted network: the workers' own opt-outs, passed through
    (line,) = dry("launch_decode.sh", "-H", "0.0.0.0", "--", "--allow-no-api-key", "--kv-insecure")
    assert line.endswith("--host 0.0.0.0 --port 8200 --kv-listen tcp://0.0.0.0:15600 --allow-no-api-key --kv-insecure")


@pytest.mark.parametrize("script, args, says", [
    ("launch_prefill.sh", ["-H", "10.1.2.3"], "no API key"),
    ("launch_decode.sh", ["-H", "0.0.0.0"], "no API key"),
    ("launch_decode.sh", ["-H", "10.1.2.3", "--api-key-file", "{s}/worker.key"], "no CURVE keys"),
    ("launch_decode.sh", ["--kv-host", "10.1.2.3"], "no CURVE keys"),
    ("launch_prefill.sh", ["--api-key-file", "{s}/missing.key"], "not a readable file"),
    ("launch_prefill.sh", ["--secrets", "{s}/nowhere"], "no such directory"),
    ("launch_decode.sh", ["--kv-keys", "{s}/worker.key"], "no such directory"),
    ("launch_prefill.sh", ["--kv-host", "10.1.2.3"], "--kv-host is for decode workers"),
    ("launch_prefill.sh", ["-n", "0"], "-n must be a positive integer"),
    ("launch_prefill.sh", ["-H"], "-H needs a value"),
    ("launch_prefill.sh", ["-H", "-n", "2"], "-H needs a value"),
])
def test_pool_refuses_what_the_workers_would_refuse(tmp_path, script, args, says):
    s = secrets_dir(tmp_path)
    p = sh(str(SCRIPTS / script), "--dry-run", "-d", str(tmp_path / "run"), *[a.format(s=s) for a in args])
    assert p.returncode == 2, p.stdout + p.stderr
    assert says in p.stderr and p.stderr.startswith("error:"), p.stderr
    assert not (tmp_path / "run").exists()


def test_pool_kv_keys_of_the_wrong_role(tmp_path):
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / "client.key_secret").write_text("x")
    (kv / "server.key").write_text("x")
    p = sh(str(SCRIPTS / "launch_decode.sh"), "--kv-keys", str(kv), "--dry-run")
    assert p.returncode == 2 and "lacks server.key_secret" in p.stderr, p.stderr
    assert sh(str(SCRIPTS / "launch_prefill.sh"), "--kv-keys", str(kv), "--dry-run").returncode == 0


# -- devices and tensor parallelism (the pool scripts and launch_cluster.sh) ------------------------
PLACEMENT = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND")


def no_placement_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in PLACEMENT}


def dry_workers(script: str, *args: str, cores: set[int] | None = None) -> list[tuple[dict, list[str]]]:
    """(the variables it is started with, its command) of each line a --dry-run prints."""
    p = sh(str(SCRIPTS / script), "--dry-run", *args, cores=cores, env=no_placement_env())
    assert p.returncode == 0, p.stderr
    out = []
    for line in p.stdout.strip().splitlines():
        words = shlex.split(line)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        out.append((env, words))
    return out


def opt(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def opts(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words) if w == flag]


def need_cores(n: int) -> set[int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        pytest.skip(f"needs {n} CPU cores, this process may use {len(cores)}")
    return set(cores[:n])


@pytest.mark.parametrize("device, var", [("cuda", "CUDA_VISIBLE_DEVICES"), ("npu", "ASCEND_RT_VISIBLE_DEVICES")])
def test_cluster_dry_run_gives_each_worker_its_own_devices(tmp_path, device, var):
    run = tmp_path / "run"
    lines = dry_workers("launch_cluster.sh", "-d", str(run), "-P", "2", "-D", "2", "--tensor-parallel-size", "2",
                        "--ports", "9100,9200,17000", "--prefill-args", f"--device {device}",
                        "--decode-args", f"--device={device}")
    *workers, (denv, disp) = lines
    assert [w[2] for _, w in workers] == ["proserve.prefill"] * 2 + ["proserve.decode"] * 2
    # worker k (prefill, then decode) gets devices 2k, 2k+1: no device twice
    assert [env for env, _ in workers] == [{var: "0,1"}, {var: "2,3"}, {var: "4,5"}, {var: "6,7"}]
    assert all(opt(w, "--tensor-parallel-size") == "2" for _, w in workers)
    # decode worker j's ranks receive KV on 17000 + 2j + r; the dispatcher gets rank 0's address
    assert [opt(w, "--kv-listen") for _, w in workers[2:]] == ["tcp://127.0.0.1:17000", "tcp://127.0.0.1:17002"]
    assert disp[:3] == ["python3", "-m", "proserve.dispatcher"] and denv == {}
    assert opts(disp, "--decode") == ["http://127.0.0.1:9200=tcp://127.0.0.1:17000",
                                      "http://127.0.0.1:9201=tcp://127.0.0.1:17002"]
    assert opts(disp, "--prefill") == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    assert not run.exists()   # a dry run starts and makes nothing
    # given groups, in the same order; one rank each without --tensor-parallel-size
    lines = dry_workers("launch_cluster.sh", "-d", str(run), "-P", "2", "-D", "1", "--devices", "3:1:0",
                        "--prefill-args", f"--device {device}", "--decode-args", f"--device {device}")
    assert [env for env, _ in lines[:3]] == [{var: "3"}, {var: "1"}, {var: "0"}]
    assert not any("--tensor-parallel-size" in w for _, w in lines)
    assert opt(lines[2][1], "--kv-listen") == "tcp://127.0.0.1:15600"


def test_cluster_dry_run_binds_cpu_ranks():
    two = need_cores(2)
    c0, c1 = sorted(two)
    bind = "VLLM_CPU_OMP_THREADS_BIND"
    # one rank: prefill workers on one core, decode workers on the other (vLLM's CPU worker busy-polls)
    lines = dry_workers("launch_cluster.sh", "-P", "2", "-D", "1", cores=two)
    assert [env for env, _ in lines] == [{bind: str(c0)}, {bind: str(c0)}, {bind: str(c1)}, {}]
    # two ranks each on 2 cores: every worker's ranks split them (prefill and decode share cores)
    lines = dry_workers("launch_cluster.sh", "--tensor-parallel-size", "2", cores=two)
    assert [env for env, _ in lines[:2]] == [{bind: f"{c0}|{c1}"}] * 2
    assert opt(lines[1][1], "--kv-listen") == "tcp://127.0.0.1:15600"
    # the worker's own --cpu-bind is left alone
    lines = dry_workers("launch_cluster.sh", "--prefill-args", "--cpu-bind 1", cores=two)
    assert [env for env, _ in lines[:2]] == [{}, {bind: str(c1)}]
    # given cores, split per rank
    lines = dry_workers("launch_cluster.sh", "--tensor-parallel-size", "2", "--devices", "0-3:4,5,7,6", cores=two)
    assert [env for env, _ in lines[:2]] == [{bind: "0-1|2-3"}, {bind: "4-5|7,6"}]
    # fewer cores than ranks: the ranks share them
    lines = dry_workers("launch_cluster.sh", "--tensor-parallel-size", "2", cores={c0})
    assert [env for env, _ in lines[:2]] == [{bind: f"{c0}|{c0}"}] * 2


def test_cluster_dry_run_gives_cpu_ranks_disjoint_cores_when_there_are_enough():
    four = need_cores(4)
    c = sorted(four)
    lines = dry_workers("launch_cluster.sh", "--tensor-parallel-size", "2", cores=four)
    assert [env for env, _ in lines[:2]] == [{"VLLM_CPU_OMP_THREADS_BIND": f"{c[0]}|{c[1]}"},
                                             {"VLLM_CPU_OMP_THREADS_BIND": f"{c[2]}|{c[3]}"}]


def test_pool_dry_run_devices_and_kv_ports():
    lines = dry_workers("launch_decode.sh", "-n", "3", "--tensor-parallel-size", "2", "-k", "17000",
                        "--", "--device", "npu")
    assert [env for env, _ in lines] == [{"ASCEND_RT_VISIBLE_DEVICES": f"{2 * i},{2 * i + 1}"} for i in range(3)]
    assert [opt(w, "--kv-listen") for _, w in lines] == [f"tcp://127.0.0.1:{17000 + 2 * i}" for i in range(3)]
    assert all(opt(w, "--tensor-parallel-size") == "2" for _, w in lines)
    lines = dry_workers("launch_prefill.sh", "-n", "2", "--tp", "2", "--devices", "0-3:4-7")
    assert [env for env, _ in lines] == [{"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"},
                                         {"VLLM_CPU_OMP_THREADS_BIND": "4-5|6-7"}]
    lines = dry_workers("launch_prefill.sh", "-n", "2", "--", "--device", "cuda")
    assert [env for env, _ in lines] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]


CUDA2 = ["--prefill-args", "--device cuda", "--decode-args", "--device cuda"]


@pytest.mark.parametrize("script, args, says", [
    ("launch_cluster.sh", ["--tp", "2", "--devices", "0,1:2", *CUDA2],
     "--devices: decode worker 0 gets 1 device(s) (2) for --tensor-parallel-size 2: give exactly 2, one per rank"),
    ("launch_cluster.sh", ["--tp", "2", "--devices", "0,1,2:3,4"],
     "--devices: prefill worker 0 gets 3 CPU core(s) (0,1,2) for --tensor-parallel-size 2: give a multiple of 2"),
    ("launch_cluster.sh", ["--tp", "2", "--devices", "0,1", *CUDA2], "--devices 0,1 has 1 group(s) for 2 worker(s)"),
    ("launch_cluster.sh", ["--devices", "0:0,", *CUDA2], "decode worker 0 gets '0,'"),
    ("launch_cluster.sh", ["--prefill-args", "--tensor-parallel-size 2"], "give the script's --tensor-parallel-size"),
    ("launch_cluster.sh", ["--decode-args", "--devices 0"], "give the script's --devices"),
    ("launch_cluster.sh", ["--devices", "0:1", "--prefill-args", "--cpu-bind 0"],
     "--devices and --cpu-bind for prefill worker 0"),
    ("launch_cluster.sh", ["--tp", "0"], "--tensor-parallel-size must be a positive integer"),
    ("launch_cluster.sh", ["-D", "2", "--tp", "2", "--ports", "8100,8200,65533"], "KV ports 65533..65536 go past 65535"),
    ("launch_cluster.sh", ["--prefill-args", "--device tpu"], "--device tpu: cpu, cuda or npu"),
    ("launch_prefill.sh", ["--tp", "2", "--devices", "0", "--", "--device", "cuda"],
     "prefill worker 0 gets 1 device(s) (0) for --tensor-parallel-size 2"),
    ("launch_prefill.sh", ["--", "--tensor-parallel-size", "2"], "give the script's --tensor-parallel-size"),
    ("launch_prefill.sh", ["--devices", "0,x"], "expected distinct device indices"),
    ("launch_prefill.sh", ["--tp"], "--tp needs a value"),
    ("launch_decode.sh", ["-n", "2", "--tp", "2", "-k", "65533"], "KV ports 65533..65536 go past 65535"),
])
def test_device_options_refused_with_a_clear_error(tmp_path, script, args, says):
    p = sh(str(SCRIPTS / script), "--dry-run", "-d", str(tmp_path / "run"), *args, env=no_placement_env())
    assert p.returncode == 2, p.stdout + p.stderr
    assert says in p.stderr and p.stderr.startswith("error:"), p.stderr
    assert not p.stdout and not (tmp_path / "run").exists()


SHIM_ENV = """#!/usr/bin/env bash
# stand-in for python3: record the placement variables and the arguments; serve a fake worker if asked
echo "${CUDA_VISIBLE_DEVICES-unset} ${VLLM_CPU_OMP_THREADS_BIND-unset} $*" >> "$SHIM_LOG"
[[ -n ${SHIM_SERVE:-} ]] || exit 0
port=""
while [[ $# -gt 0 ]]; do case $1 in --port) port=$2; shift 2 ;; *) shift ;; esac; done
exec "$REAL_PYTHON" -m proserve.bench.fake_worker --host 127.0.0.1 --port "$port"
"""


def shim_env(tmp_path: Path, **extra) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(SHIM_ENV)
    (bin_dir / "python3").chmod(0o755)
    return {**no_placement_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "SHIM_LOG": str(tmp_path / "args"), "REAL_PYTHON": sys.executable, **extra}


def shim_lines(tmp_path: Path, n: int) -> list[str]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        f = tmp_path / "args"
        lines = f.read_text().splitlines() if f.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.1)
    raise AssertionError(f"the stand-ins recorded fewer than {n} starts")


def test_pool_starts_workers_with_their_variables(tmp_path):
    env = shim_env(tmp_path)
    run = tmp_path / "run"
    try:
        p = sh(str(SCRIPTS / "launch_prefill.sh"), "-n", "2", "--tp", "2", "--devices", "4,5:6,7", "-d", str(run),
               "-p", str(free_ports(2)), "--", "--device", "cuda", env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "CUDA_VISIBLE_DEVICES=6,7" in p.stdout
        lines = sorted(shim_lines(tmp_path, 2))
        assert [line.split()[:2] for line in lines] == [["4,5", "unset"], ["6,7", "unset"]]
        assert all("--tensor-parallel-size 2" in line for line in lines)
        (tmp_path / "args").unlink()
        p = sh(str(SCRIPTS / "launch_decode.sh"), "--tp", "2", "--devices", "1,0", "-d", str(run),
               "-p", str(free_port()), env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        (line,) = shim_lines(tmp_path, 1)
        assert line.split()[:2] == ["unset", "1|0"]   # through the shell's quoting intact
    finally:
        kill_recorded(run)


def test_cluster_starts_workers_with_their_variables(tmp_path):
    pytest.importorskip("aiohttp", reason="the fake workers need the [serve] extra")
    env = shim_env(tmp_path, SHIM_SERVE="1")
    run = tmp_path / "run"
    port, pbase, dbase, kvbase = free_port(), free_ports(1), free_ports(1), free_ports(2)
    try:
        p = sh(str(SCRIPTS / "launch_cluster.sh"), "-d", str(run), "-p", str(port), "--ports",
               f"{pbase},{dbase},{kvbase}", "--no-secrets", "--tp", "2", "--timeout", "120", *CUDA2, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "cluster ready" in p.stdout
        lines = shim_lines(tmp_path, 3)
        by_module = {line.split()[3]: line.split() for line in lines}
        assert by_module["proserve.prefill"][:2] == ["0,1", "unset"]
        assert by_module["proserve.decode"][:2] == ["2,3", "unset"]
        assert by_module["proserve.dispatcher"][:2] == ["unset", "unset"]
        d = by_module["proserve.dispatcher"]
        assert opt(d, "--decode") == f"http://127.0.0.1:{dbase}=tcp://127.0.0.1:{kvbase}"
        assert [e[1] for e in read_pids(run)] == ["prefill", "decode", "dispatcher"]
    finally:
        stop = sh(str(SCRIPTS / "stop_cluster.sh"), "-d", str(run), "-t", "10")
        kill_recorded(run)
    assert stop.returncode == 0, stop.stdout + stop.stderr


SHIM = """#!/usr/bin/env bash
# stand-in for python3 in the pool scripts: record the arguments, serve a fake worker
echo "$*" >> "$SHIM_LOG"
host=127.0.0.1; port=""
while [[ $# -gt 0 ]]; do
  case $1 in --host) host=$2; shift 2 ;; --port) port=$2; shift 2 ;; *) shift ;; esac
done
exec "$REAL_PYTHON" -m proserve.bench.fake_worker --host "$host" --port "$port"
"""


def test_pool_starts_waits_and_stops(tmp_path):
    pytest.importorskip("aiohttp", reason="the fake workers need the [serve] extra")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(SHIM)
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SHIM_LOG": str(tmp_path / "args"),
           "REAL_PYTHON": sys.executable}
    run = tmp_path / "run"
    base, kvbase = free_ports(2), free_ports(2)
    try:
        p = sh(str(SCRIPTS / "launch_decode.sh"), "-n", "2", "-p", str(base), "-k", str(kvbase), "-H", "127.0.0.1",
               "-d", str(run), "-w", "120", env=env, cwd=tmp_path)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "decode worker 1 healthy" in p.stdout
        args = (tmp_path / "args").read_text().splitlines()
        assert sorted(args) == [f"-m proserve.decode --host 127.0.0.1 --port {base + i} --kv-listen "
                                f"tcp://127.0.0.1:{kvbase + i}" for i in range(2)]
        entries = read_pids(run)
        assert [e[1:] for e in entries] == [["decode", str(i), str(base + i)] for i in range(2)]
        pids = [int(e[0]) for e in entries]
        assert all(pid_alive(pid) and os.getpgid(pid) == pid for pid in pids)   # each its own process group
        assert all(http_status(f"http://127.0.0.1:{base + i}/health") == 200 for i in range(2))
        assert (run / "decode-0.log").exists()
        # worker i is running: starting it again is refused
        again = sh(str(SCRIPTS / "launch_decode.sh"), "-p", str(base), "-d", str(run), env=env, cwd=tmp_path)
        assert again.returncode == 2 and "already running" in again.stderr
        # stop one role: the other's entries stay
        (run / "pids").write_text((run / "pids").read_text() + "999999999 prefill 0 1\n")
        stop = sh(str(SCRIPTS / "stop_pool.sh"), "-d", str(run), "decode")
        assert stop.returncode == 0, stop.stderr
        assert stop.stdout.count("stopped decode worker") == 2
        assert read_pids(run) == [["999999999", "prefill", "0", "1"]]
        deadline = time.monotonic() + 30
        while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pid_alive(pid) for pid in pids)
        stop = sh(str(SCRIPTS / "stop_pool.sh"), "-d", str(run))
        assert stop.returncode == 0 and "not running" in stop.stdout and not (run / "pids").exists()
    finally:
        kill_recorded(run)


def test_pool_wait_reports_a_worker_that_exits(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/usr/bin/env bash\necho "error: --host: refused for the test" >&2\nexit 1\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    run = tmp_path / "run"
    try:
        p = sh(str(SCRIPTS / "launch_prefill.sh"), "-p", str(free_port()), "-d", str(run), "-w", "60", env=env)
        assert p.returncode == 1
        assert "prefill worker 0 exited" in p.stderr and "refused for the test" in p.stderr, p.stderr
    finally:
        kill_recorded(run)


# -- launch_dispatcher.sh ---------------------------------------------------------------------------
@pytest.fixture
def fake_workers():
    """Two fake workers (a prefill and a decode stand-in) in a subprocess each; their URLs."""
    pytest.importorskip("aiohttp", reason="the fake workers need the [serve] extra")
    pytest.importorskip("fastapi", reason="the dispatcher needs the [serve] extra")
    procs, urls = [], []
    try:
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-m", "proserve.bench.fake_worker", "--port", "0"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                 stdin=subprocess.DEVNULL)
            procs.append(p)
            line = p.stdout.readline()   # "1 fake workers on http://127.0.0.1:PORT .. http://..."
            assert "fake workers on" in line, line
            urls.append(line.split()[4])
        yield urls
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def write_config(path: Path, port: int, prefill: str, decode: str, **extra) -> Path:
    lines = ["[dispatcher]", 'host = "127.0.0.1"', f"port = {port}", "health_interval_s = 0.2"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    lines += ["[[prefill]]", f'url = "{prefill}"', "[[decode]]", f'url = "{decode}"',
              f'kv_addr = "tcp://127.0.0.1:{free_port()}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def test_dispatcher_starts_answers_health_and_stops(tmp_path, fake_workers):
    port = free_port()
    cfg = write_config(tmp_path / "dispatcher.toml", port, *fake_workers)
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-test-000001"\nclient = "t"\nclass = "high"\n')
    run = tmp_path / "run"
    try:
        p = sh(str(SCRIPTS / "launch_dispatcher.sh"), "-c", str(cfg), "-k", str(keys), "-d", str(run), "-t", "120",
               "--", "--log-level", "info")
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"dispatcher ready: http://127.0.0.1:{port}" in p.stdout
        ((pid, role, idx, got_port),) = read_pids(run)
        assert (role, idx, got_port) == ("dispatcher", "0", str(port))
        pid = int(pid)
        assert pid_alive(pid) and os.getpgid(pid) == pid
        assert http_status(f"http://127.0.0.1:{port}/health") == 200
        cmdline = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        assert cmdline[cmdline.index("--config") + 1] == str(cfg)
        assert cmdline[cmdline.index("--keys") + 1] == str(keys)
        assert "dispatcher on http://127.0.0.1" in (run / "dispatcher.log").read_text()
        # one dispatcher per run dir
        again = sh(str(SCRIPTS / "launch_dispatcher.sh"), "-c", str(cfg), "-d", str(run))
        assert again.returncode == 2 and "already running" in again.stderr
        stop = sh(str(SCRIPTS / "stop_pool.sh"), "-d", str(run))
        assert stop.returncode == 0 and "stopped dispatcher 0" in stop.stdout, stop.stdout + stop.stderr
        assert not (run / "pids").exists()
        deadline = time.monotonic() + 30
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(pid)
        assert http_status(f"http://127.0.0.1:{port}/health", timeout=2) is None
    finally:
        kill_recorded(run)


def test_dispatcher_not_healthy_in_time_is_stopped(tmp_path, fake_workers):
    port = free_port()
    dead = f"http://127.0.0.1:{free_port()}"   # nothing listens there: the decode pool never comes up
    cfg = write_config(tmp_path / "d.toml", port, fake_workers[0], dead)
    run = tmp_path / "run"
    try:
        p = sh(str(SCRIPTS / "launch_dispatcher.sh"), "-c", str(cfg), "-d", str(run), "-t", "3")
        assert p.returncode == 1, p.stdout + p.stderr
        assert "not healthy after 3s" in p.stderr and "last /health answer" in p.stderr and dead in p.stderr
        assert "stopped dispatcher 0" in p.stderr
        assert not (run / "pids").exists()
        assert http_status(f"http://127.0.0.1:{port}/health", timeout=2) is None
    finally:
        kill_recorded(run)


@pytest.mark.parametrize("text, args, says", [
    ("[dispatcher\n", [], "not valid TOML"),
    ('[dispatcher]\nport = 8000\n[[prefill]]\nurl = "http://127.0.0.1:8100"\n', [], "needs decode instances"),
    (('[dispatcher]\n[[prefill]]\nurl = "http://127.0.0.1:8100"\n[[decode]]\nurl = "http://127.0.0.1:8200"\n'
      'kv_addr = "tcp://127.0.0.1:15600"\n'), ["--", "--no-such-flag"], "unrecognized arguments"),
    (None, [], "not a readable file"),
])
def test_dispatcher_bad_config_is_a_clear_error(tmp_path, text, args, says):
    pytest.importorskip("fastapi", reason="the dispatcher needs the [serve] extra")
    cfg = tmp_path / "bad.toml"
    if text is not None:
        cfg.write_text(text)
    run = tmp_path / "run"
    p = sh(str(SCRIPTS / "launch_dispatcher.sh"), "-c", str(cfg), "-d", str(run), *args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert says in p.stderr, p.stderr
    assert "error" in p.stderr and "started" not in p.stdout
    assert not (run / "pids").exists()


def test_dispatcher_needs_a_config():
    p = sh(str(SCRIPTS / "launch_dispatcher.sh"))
    assert p.returncode == 2 and "-c CONFIG is required" in p.stderr


def test_dispatcher_dry_run(tmp_path):
    pytest.importorskip("fastapi", reason="the dispatcher needs the [serve] extra")
    cfg = write_config(tmp_path / "d.toml", 18000, "http://127.0.0.1:8100", "http://127.0.0.1:8200")
    p = sh(str(SCRIPTS / "launch_dispatcher.sh"), "-c", str(cfg), "-d", str(tmp_path / "run"), "--dry-run",
           "--", "--port", "18001")
    assert p.returncode == 0, p.stderr
    assert f"python3 -m proserve.dispatcher --config {cfg} --port 18001" in p.stdout
    assert "http://127.0.0.1:18001" in p.stdout
    assert not (tmp_path / "run").exists()


def test_dispatcher_beyond_loopback_needs_keys_or_open_access(tmp_path):
    """Secure by default, as the workers' launchers: a dispatcher that would listen beyond
    loopback without client keys serves every class to whoever reaches it, so the check
    before start refuses it (exit 2, saying what to pass); keys, or the explicit
    --allow-open-access (flag or config), let it through."""
    pytest.importorskip("fastapi", reason="the dispatcher needs the [serve] extra")
    cfg = write_config(tmp_path / "d.toml", 18000, "http://127.0.0.1:8100", "http://127.0.0.1:8200")
    run = ["-c", str(cfg), "-d", str(tmp_path / "run"), "--dry-run"]
    p = sh(str(SCRIPTS / "launch_dispatcher.sh"), *run, "--", "--host", "0.0.0.0")
    assert p.returncode == 2 and "not a loopback address and no client API keys" in p.stderr, p.stderr
    assert "--keys" in p.stderr and "--allow-open-access" in p.stderr
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-test-000001"\nclient = "t"\nclass = "high"\n')
    assert sh(str(SCRIPTS / "launch_dispatcher.sh"), *run, "-k", str(keys), "--", "--host", "0.0.0.0").returncode == 0
    p = sh(str(SCRIPTS / "launch_dispatcher.sh"), *run, "--", "--host", "0.0.0.0", "--allow-open-access")
    assert p.returncode == 0 and "http://0.0.0.0:18000" in p.stdout, p.stderr
    opened = write_config(tmp_path / "o.toml", 18000, "http://127.0.0.1:8100", "http://127.0.0.1:8200",
                          allow_open_access=True)
    assert sh(str(SCRIPTS / "launch_dispatcher.sh"), "-c", str(opened), "-d", str(tmp_path / "run"), "--dry-run",
              "--", "--host", "10.1.2.3").returncode == 0
    for host in ("127.0.0.1", "localhost", "::1"):   # loopback stays open for local use
        assert sh(str(SCRIPTS / "launch_dispatcher.sh"), *run, "--", "--host", host).returncode == 0, host
    # the dispatcher itself refuses the same before it binds anything
    from proserve.dispatcher.cli import main
    assert main(["--config", str(cfg), "--host", "10.1.2.3"]) == 2
    bad = write_config(tmp_path / "b.toml", 18000, "http://127.0.0.1:8100", "http://127.0.0.1:8200",
                       allow_open_access="yes")
    p = sh(str(SCRIPTS / "launch_dispatcher.sh"), "-c", str(bad), "-d", str(tmp_path / "run"), "--dry-run")
    assert p.returncode == 2 and "allow_open_access" in p.stderr, p.stderr


def test_stop_pool_leaves_a_stale_pid_of_another_program_alone(tmp_path):
    """A pids file outliving its workers (a crash, a reboot): the recorded pid now belongs to
    another program, which stop_pool.sh must not signal; a pid of 1 is never signalled."""
    other = subprocess.Popen(["sleep", "300"])
    try:
        (tmp_path / "pids").write_text(f"{other.pid} prefill 0 8100\n1 decode 0 8200\n")
        r = subprocess.run(["bash", str(SCRIPTS / "stop_pool.sh"), "-d", str(tmp_path), "-t", "1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "not a ProServe one" in r.stdout
        assert other.poll() is None                   # still running
        assert not (tmp_path / "pids").exists()
    finally:
        other.kill()
        other.wait()
