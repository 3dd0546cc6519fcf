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
    argv, env, extra = launch("prefill", "--kv-connect-timeout", "0.5")
    assert "PROSERVE_KV_HEARTBEAT" not in env and extra["connect_timeout_s"] == 0.5
    assert "--middleware" in argv and env["PROMETHEUS_MULTIPROC_DIR"]


@pytest.mark.parametrize("flag", ["--kv-max-open", "--kv-max-held-mib", "--kv-result-ttl"])
def test_caps_must_be_positive(flag, monkeypatch):
    def no_exec(*a):
        raise AssertionError("the worker would have started vLLM")
    monkeypatch.setattr(worker.os, "execvpe", no_exec)
    with pytest.raises(SystemExit, match=rf"error: {flag} must be a number > 0, got 0"):
        worker.main("decode", [flag, "0"])
