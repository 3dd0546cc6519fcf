"""`python -m proserve.prefill|decode` refuses insecure set-ups at start-up and passes the
security settings to vLLM (no engine is started here: argv and env are checked)."""

from __future__ import annotations

import json

import pytest

from proserve.kvtransfer.auth import generate_keys
from proserve.prefill import worker


def launch(role: str, *flags: str) -> tuple[list[str], dict, dict]:
    """(vLLM argv, env, kv_connector_extra_config) after the start-up checks."""
    args = worker.build_parser(role).parse_args(list(flags))
    worker.check_security(role, args)
    argv, env = worker.vllm_argv(role, args)
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"] \
        if "--kv-transfer-config" in argv else {}
    return argv, env, extra


def test_non_loopback_kv_address_needs_curve_keys(tmp_path):
    with pytest.raises(SystemExit, match="not a loopback address.*--kv-keys"):
        launch("decode", "--kv-listen", "tcp://10.0.0.5:15600")
    _, _, extra = launch("decode", "--kv-listen", "tcp://10.0.0.5:15600", "--kv-insecure")
    assert extra["insecure"] is True
    generate_keys(tmp_path / "kv")
    _, _, extra = launch("decode", "--kv-listen", "tcp://10.0.0.5:15600", "--kv-keys", str(tmp_path / "kv"))
    assert extra["keys_dir"] == str((tmp_path / "kv").resolve()) and "insecure" not in extra
    _, _, extra = launch("prefill", "--kv-keys", str(tmp_path / "kv"))
    assert extra["keys_dir"] == str((tmp_path / "kv").resolve())


def test_missing_key_files_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="server.key_secret"):
        launch("decode", "--kv-keys", str(tmp_path / "empty"))
    with pytest.raises(SystemExit, match="client.key_secret"):
        launch("prefill", "--kv-keys", str(tmp_path / "empty"))


def test_non_loopback_http_needs_an_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="no API key"):
        launch("prefill", "--host", "0.0.0.0")
    launch("prefill", "--host", "0.0.0.0", "--allow-no-api-key")
    key = tmp_path / "worker.key"
    key.write_text("sk-worker-abc123\n")
    argv, env, _ = launch("prefill", "--host", "0.0.0.0", "--api-key-file", str(key))
    assert env["VLLM_API_KEY"] == "sk-worker-abc123"
    assert "sk-worker-abc123" not in " ".join(argv), "the key must not show in the process list"
    key.write_text("two words")
    with pytest.raises(SystemExit, match="one key"):
        launch("prefill", "--api-key-file", str(key))
    with pytest.raises(SystemExit, match="cannot read"):
        launch("prefill", "--api-key-file", str(tmp_path / "nope"))


def test_guard_middleware_heartbeat_and_caps_reach_vllm():
    argv, env, extra = launch("decode", "--kv-max-open", "64", "--kv-max-held-mib", "96", "--kv-timeout", "10")
    assert argv[argv.index("--middleware") + 1] == "proserve.prefill.worker_http.WorkerGuard"
    assert extra["heartbeat_path"] == env["PROSERVE_KV_HEARTBEAT"]
    assert (extra["max_open_transfers"], extra["max_held_mib"], extra["result_ttl_s"]) == (64, 96, 120.0)
    # the per-peer cap is not given: the connector sizes it from the engine's own KV cache
    assert "max_peer_mib" not in extra and extra["prefill_peers"] == 4
    assert extra["layerwise_save"] is False           # a decode worker keeps full CUDA graphs
    assert env["PROSERVE_KV_RANKS"] == "1"
    argv, env, extra = launch("decode", "--tensor-parallel-size", "2", "--kv-max-peer-mib", "300")
    assert env["PROSERVE_KV_RANKS"] == "2" and extra["max_peer_mib"] == 300 and "max_held_mib" not in extra
    argv, env, extra = launch("prefill", "--kv-connect-timeout", "0.5")
    assert "layerwise_save" not in extra                # a prefill worker sends layer by layer
    assert "PROSERVE_KV_HEARTBEAT" not in env and extra["connect_timeout_s"] == 0.5
    assert "--middleware" in argv and env["PROMETHEUS_MULTIPROC_DIR"]


@pytest.mark.parametrize("flag", ["--kv-max-open", "--kv-max-held-mib", "--kv-result-ttl", "--kv-prefill-peers"])
def test_caps_must_be_positive(flag, monkeypatch):
    def no_exec(*a):
        raise AssertionError("the worker would have started vLLM")
    monkeypatch.setattr(worker.os, "execvpe", no_exec)
    with pytest.raises(SystemExit, match=rf"error: {flag} must be a number > 0, got 0"):
        worker.main("decode", [flag, "0"])


# -- tensor parallelism and device placement ------------------------------------------------------
PLACEMENT = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND")


@pytest.fixture
def clean_env(monkeypatch):
    """No inherited placement variables; the process may use cores 0-3 unless a test says otherwise."""
    for v in PLACEMENT:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    return monkeypatch


def placement(env: dict) -> dict:
    return {v: env[v] for v in PLACEMENT if v in env}


def test_tensor_parallel_size_reaches_vllm(clean_env):
    argv, env, _ = launch("prefill")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1" and argv.count("--tensor-parallel-size") == 1
    assert placement(env) == {}                     # one rank: nothing placed, vLLM's defaults
    argv, env, _ = launch("prefill", "--tensor-parallel-size", "2", "--device", "cuda")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv.count("--tensor-parallel-size") == 1
    assert placement(env) == {}                     # no --devices: the inherited CUDA_VISIBLE_DEVICES


@pytest.mark.parametrize("flags, says", [
    (["--tensor-parallel-size", "2", "--tensor-parallel-size", "2"], "--tensor-parallel-size given twice"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1, got 0"),
])
def test_tensor_parallel_size_flag_is_checked(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        worker.build_parser("prefill").parse_args(flags)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("passthrough", [["-tp", "2"], ["-tp=2"], ["--tensor-parallel-size", "2"],
                                         ["--tensor_parallel_size=2"], ["--tensor", "2"]])
def test_tensor_parallel_size_only_through_the_worker_flag(passthrough, clean_env):
    with pytest.raises(SystemExit, match=r"use the worker's --tensor-parallel-size N"):
        launch("prefill", "--tensor-parallel-size", "2", "--", *passthrough)
    with pytest.raises(SystemExit, match=r"use the worker's --tensor-parallel-size N"):
        launch("decode", "--", "--max-num-seqs", "8", *passthrough)


@pytest.mark.parametrize("passthrough", [["-pp", "2"], ["--pipeline-parallel-size", "4"],
                                         ["--pipeline-parallel-size=2"], ["--pipeline_parallel_size", "2"]])
def test_pipeline_parallelism_is_refused(passthrough, clean_env):
    with pytest.raises(SystemExit, match="pipeline parallelism is not supported by ProServe's KV connector yet; "
                                         "use --tensor-parallel-size"):
        launch("decode", "--", *passthrough)


def test_pipeline_parallel_size_one_passes(clean_env):
    argv, _, _ = launch("prefill", "--", "-pp", "1")
    assert argv[-2:] == ["-pp", "1"]


@pytest.mark.parametrize("device, var", [("cuda", "CUDA_VISIBLE_DEVICES"), ("npu", "ASCEND_RT_VISIBLE_DEVICES")])
def test_devices_set_the_accelerator_variable(device, var, clean_env):
    _, env, _ = launch("prefill", "--device", device, "--tensor-parallel-size", "2", "--devices", "2,3")
    assert placement(env) == {var: "2,3"}
    _, env, _ = launch("decode", "--device", device, "--tensor-parallel-size", "4", "--devices", "4-7")
    assert placement(env) == {var: "4,5,6,7"}
    clean_env.setenv(var, "0,1,2,3,4,5,6,7")           # --devices overrides an inherited list
    _, env, _ = launch("decode", "--device", device, "--devices", "5")
    assert placement(env) == {var: "5"}
    with pytest.raises(SystemExit, match=r"--devices 0: 1 device\(s\) for --tensor-parallel-size 2: give exactly 2"):
        launch("prefill", "--device", device, "--tensor-parallel-size", "2", "--devices", "0")
    with pytest.raises(SystemExit, match=r"--devices 0,1,2: 3 device\(s\) for --tensor-parallel-size 2"):
        launch("prefill", "--device", device, "--tensor-parallel-size", "2", "--devices", "0,1,2")


@pytest.mark.parametrize("devices", ["", "a", "0,,1", "1-0", "0,0", "-1", "0;1"])
def test_devices_must_be_distinct_indices(devices, clean_env):
    with pytest.raises(SystemExit, match="--devices"):
        launch("prefill", "--device", "cuda", "--devices", devices)


def test_devices_on_cpu_are_cores_split_over_the_ranks(clean_env):
    _, env, _ = launch("prefill", "--tensor-parallel-size", "2", "--devices", "0,1,2,3")
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    _, env, _ = launch("prefill", "--tensor-parallel-size", "2", "--devices", "3,1")
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "3|1"}
    _, env, _ = launch("decode", "--devices", "1-3")              # one rank: all of them
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "1-3"}
    with pytest.raises(SystemExit, match=r"3 CPU core\(s\) for --tensor-parallel-size 2: give a multiple of 2"):
        launch("prefill", "--tensor-parallel-size", "2", "--devices", "0,1,2")
    with pytest.raises(SystemExit, match=r"core\(s\) 6-7 are not allowed to this process \(allowed: 0-3\)"):
        launch("prefill", "--tensor-parallel-size", "2", "--devices", "0,1,6,7")
    with pytest.raises(SystemExit, match="--cpu-bind and --devices"):
        launch("prefill", "--devices", "0", "--cpu-bind", "0")


def test_cpu_ranks_are_bound_by_default(clean_env, capsys):
    """vLLM's own binding needs a NUMA node per rank (it fails on a 1-node host): with several
    ranks and no binding given, the worker splits the cores it may use evenly over them."""
    _, env, _ = launch("prefill", "--tensor-parallel-size", "2")
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    clean_env.setattr(worker.os, "sched_getaffinity", lambda pid: {0, 1})
    _, env, _ = launch("decode", "--tensor-parallel-size", "2")
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    clean_env.setattr(worker.os, "sched_getaffinity", lambda pid: {4, 5, 6})   # an extra core stays free
    _, env, _ = launch("decode", "--tensor-parallel-size", "2")
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "4|5"}
    clean_env.setattr(worker.os, "sched_getaffinity", lambda pid: {0})         # fewer cores than ranks
    capsys.readouterr()
    _, env, _ = launch("prefill", "--tensor-parallel-size", "2")
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "0|0"}
    assert "warning: 1 CPU core(s) for 2 tensor-parallel ranks" in capsys.readouterr().err
    # a binding given, as a flag or inherited, is kept (one group per rank)
    _, env, _ = launch("prefill", "--tensor-parallel-size", "2", "--cpu-bind", "1|0")
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "1|0"}
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "3|2")
    _, env, _ = launch("prefill", "--tensor-parallel-size", "2")
    assert placement(env) == {"VLLM_CPU_OMP_THREADS_BIND": "3|2"}
    with pytest.raises(SystemExit, match=r"VLLM_CPU_OMP_THREADS_BIND '3\|2' has 2 '\|'-separated group\(s\) for "
                                         r"--tensor-parallel-size 3"):
        launch("prefill", "--tensor-parallel-size", "3")
    with pytest.raises(SystemExit, match=r"--cpu-bind '0' has 1 '\|'-separated group\(s\) for --tensor-parallel-size 2"):
        launch("prefill", "--tensor-parallel-size", "2", "--cpu-bind", "0")


def test_decode_ranks_need_consecutive_kv_ports(clean_env):
    assert "rank r listens on port + r (tcp)" in " ".join(worker.build_parser("decode").format_help().split())
    launch("decode", "--tensor-parallel-size", "2", "--kv-listen", "tcp://127.0.0.1:65534", "--device", "cuda")
    with pytest.raises(SystemExit, match=r"ranks listen on ports 65535\.\.65536, past 65535"):
        launch("decode", "--tensor-parallel-size", "2", "--kv-listen", "tcp://127.0.0.1:65535", "--device", "cuda")
    launch("decode", "--tensor-parallel-size", "4", "--kv-listen", "ipc:///tmp/kv.sock", "--device", "cuda")
