"""scripts/bench_product_path.py without an engine: the refusal of bad arguments (exit 2,
nothing written), the stock vLLM command line of each stock configuration, the request
bodies each configuration's client sends (vLLM's integer priority per class for
vllm-priority, no ProServe fields for stock vLLM), the policy string handed to
bench_fidelity.Cluster, and the mean ± sd table from synthetic per-run summaries."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_product_path as bpp  # noqa: E402

from proserve.bench import engine_policies as ep  # noqa: E402

from proserve.bench import loadgen as lg  # noqa: E402
from proserve.scheduler.request import ConfigError, Request  # noqa: E402


def _classes():
    return lg.load_classes(None, 0.5, 0.05)


# --- arguments -------------------------------------------------------------------------------

def test_configs_parse_in_the_order_given():
    assert bpp.parse_configs("vllm-priority, proserve") == ["vllm-priority", "proserve"]
    assert bpp.parse_configs(bpp.build_parser().get_default("configs")) == list(bpp.CONFIGS)
    assert list(bpp.CONFIGS) == ["proserve", "proserve-1p1d", "vllm-fcfs", "vllm-priority"]


@pytest.mark.parametrize("text, msg", [
    ("proserve,sglang", "unknown 'sglang'"),
    ("vllm", "unknown 'vllm'"),
    (" , ", "no configuration"),
    ("vllm-fcfs,vllm-fcfs", "given twice"),
])
def test_bad_configs_are_refused(text, msg):
    with pytest.raises(ConfigError, match=msg):
        bpp.parse_configs(text)


def test_loads_become_rates_in_increasing_order():
    assert bpp.parse_loads("1.1,0.35,0.7", 15.95) == [(0.35, 5.58), (0.7, 11.16), (1.1, 17.55)]
    for text, cap, msg in (("0", 15.95, "finite rate"), ("-0.5", 15.95, "finite rate"), ("nan", 15.95, "finite"),
                           ("1e-9", 15.95, "finite rate"), ("x", 15.95, "not a number"), ("", 15.95, "no load"),
                           ("0.5,0.5", 15.95, "twice"), ("0.5", 0.0, "--capacity"), ("0.5", math.inf, "--capacity")):
        with pytest.raises(ConfigError, match=msg):
            bpp.parse_loads(text, cap)


@pytest.mark.parametrize("flags, msg", [
    (["--configs", "proserve,bogus"], "unknown 'bogus'"),
    (["--configs", ""], "no configuration"),
    (["--loads", "0.35,abc"], "not a number"),
    (["--loads", "0"], "finite rate"),
    (["--capacity", "-1"], "--capacity"),
    (["--repeats", "0"], "--repeats"),
    (["--duration", "0"], "--duration"),
    (["--stock-budget", "0"], "--stock-budget"),
    (["--drain-timeout", "-5"], "--drain-timeout"),
    (["--port", "65400"], "--port"),
    (["--policy", "no_such_policy"], "unknown 'no_such_policy'"),
    (["--policy-param", "headroom=1.5"], "headroom"),
    (["--policy-param", "bogus=1"], "bogus"),
    (["--policy-param", "headroom"], "KEY=VALUE"),
    (["--policy-param", "gain=1"], "gain"),
    (["--loads", "0.35,0.3500001"], "given twice"),
    (["--policy-param", "headroom=0.1", "--policy-param", "headroom=0.2"], "twice"),
    (["--policy-param", "age_limit=[1, 2]"], "cannot pass through"),
    (["--configs", "vllm-fcfs", "--policy-param", "headroom=0.3"], "ProServe configurations only"),
    (["--latency-model", "/nonexistent/model.json"], "no such file"),
    (["--model", "/nonexistent/model-dir"], "no such directory"),
])
def test_main_refuses_bad_arguments_with_exit_2_before_anything(tmp_path, capsys, flags, msg):
    out = tmp_path / "o"
    assert bpp.main([*flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err
    assert not out.exists()                     # nothing written, nothing started


def test_a_stock_only_run_does_not_check_the_proserve_policy():
    args = bpp.build_parser().parse_args(["--configs", "vllm-fcfs", "--latency-model", "/nonexistent.json"])
    configs, loads, classes = bpp.validate(args)
    assert configs == ["vllm-fcfs"] and [ld for ld, _ in loads] == [0.35, 0.7, 1.1]
    assert set(classes) == {"high", "low"}


def test_good_policy_params_pass():
    args = bpp.build_parser().parse_args(["--policy-param", "headroom=0.3", "--policy-param", "pace=first_token",
                                          "--policy-param", "decode_first=all"])
    bpp.validate(args)
    assert args.policy_param == ["headroom=0.3", "pace=first_token", "decode_first=all"]


# --- stock vLLM --------------------------------------------------------------------------------

def test_stock_server_command_of_each_stock_config():
    args = SimpleNamespace(model="/m/scaled", max_model_len=2048, block_size=32, stock_budget=256)
    for config, policy in (("vllm-fcfs", "fcfs"), ("vllm-priority", "priority")):
        assert bpp.STOCK_POLICY[config] == policy
        cmd = bpp.stock_server_cmd(args, policy, 9200)
        assert cmd == [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", "/m/scaled", "--load-format", "dummy", "--max-model-len", "2048",
                       "--block-size", "32", "--dtype", "bfloat16",
                       "--max-num-batched-tokens", "256", "--enable-chunked-prefill",
                       "--scheduling-policy", policy, "--no-enable-prefix-caching",
                       "--port", "9200", "--host", "127.0.0.1"]
    args.stock_budget, args.max_model_len = 512, 1024
    cmd = bpp.stock_server_cmd(args, "fcfs", 8300)
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "512"
    assert cmd[cmd.index("--max-model-len") + 1] == "1024"
    with pytest.raises(ValueError, match="fcfs or priority"):
        bpp.stock_server_cmd(args, "lifo", 8300)
    # one engine core and 1 GiB of KV, as the ProServe worker
    # pinned to core 0 only where launch_cluster.sh pins the ProServe workers (a 2-core host)
    assert bpp.stock_server_env(2) == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert bpp.stock_server_env(16) == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_stock_server_uses_its_own_port_and_the_defaults_of_the_parser():
    args = bpp.build_parser().parse_args(["--port", "9000"])
    args.model = "/abs/model"
    cmd = bpp.stock_server_cmd(args, "priority", bpp.port_of(args, "stock"))
    assert cmd[cmd.index("--port") + 1] == "9400" and cmd[cmd.index("--max-num-batched-tokens") + 1] == "256"
    assert bpp.config_ports(args, "vllm-priority") == [9400]
    assert bpp.config_ports(args, "proserve") == [9000, 9100]
    assert bpp.config_ports(args, "proserve-1p1d") == [9000, 9100, 9200, 9300]


def test_vllm_priority_sends_vllms_integer_priority_per_class():
    classes = _classes()
    assert bpp.class_priority_body(classes) == {"high": {"priority": 0}, "low": {"priority": 1}}
    args = SimpleNamespace(timeout=300.0)
    cfg = bpp.client_config("vllm-priority", "http://127.0.0.1:9400", 0, args, classes)
    assert (cfg.api, cfg.send_xargs, cfg.class_keys) == ("vllm", False, {})
    for cls, prio in (("high", 0), ("low", 1)):
        c = classes[cls]
        req = Request(f"r-{cls}", cls, c.weight, c.ttft_slo, c.tpot_slo, 0.0, 10, 5)
        body = lg.request_body(req, [1, 2, 3], "m", cfg, arrival_unix=1.0)
        assert body["priority"] == prio and "vllm_xargs" not in body and "slo" not in body


def test_vllm_fcfs_sends_no_scheduling_fields_and_proserve_the_class_and_its_key():
    classes = _classes()
    args = SimpleNamespace(timeout=300.0)
    c = classes["high"]
    req = Request("r0", "high", c.weight, c.ttft_slo, c.tpot_slo, 0.0, 10, 5)
    fcfs = bpp.client_config("vllm-fcfs", "http://x:1", 0, args, classes)
    body = lg.request_body(req, [1], "m", fcfs, arrival_unix=1.0)
    assert "priority" not in body and "vllm_xargs" not in body and fcfs.class_body == {}
    for config in ("proserve", "proserve-1p1d"):
        ps = bpp.client_config(config, "http://x:1", 7, args, classes)
        assert ps.api == "proserve" and ps.seed == 7 and ps.class_keys == bpp.bf.CLASS_KEYS
        body = lg.request_body(req, [1], "m", ps)
        assert body["priority"] == "high" and body["slo"] == {"ttft_ms": 500.0, "tpot_ms": 50.0}
        assert ps.headers_for("high")["Authorization"] == f"Bearer {bpp.bf.CLASS_KEYS['high']}"


def test_equal_weights_share_a_vllm_priority():
    C = SimpleNamespace
    body = bpp.class_priority_body({"gold": C(weight=3.0), "silver": C(weight=2.0), "bronze": C(weight=2.0)})
    assert body == {"gold": {"priority": 0}, "silver": {"priority": 1}, "bronze": {"priority": 1}}


# --- the table -----------------------------------------------------------------------------------

def _row(config, load, rate, repeat, tdg, slo, hi, lo, p99, errors=0, n=100):
    m = lambda t, s, **kw: {"requests": n // 2, "errors": 0, "tdg_ratio": t, "slo_attainment": s, **kw}  # noqa: E731
    return {"config": config, "repeat": repeat, "load": load, "rate": rate, "requests": n,
            "metrics": {"all": {"requests": n, "errors": errors, "tdg_ratio": tdg, "slo_attainment": slo,
                                "ttft_p99": 1.0},
                        "high": m(hi, hi, ttft_p99=0.2), "low": m(lo, lo, ttft_p99=p99)}}


def test_mean_and_sd_over_repeats():
    rows = [_row("proserve", 0.35, 5.58, 0, 0.9, 0.8, 1.0, 0.8, 0.5),
            _row("vllm-priority", 0.35, 5.58, 0, 1.0, 1.0, 1.0, 1.0, 0.3, errors=2),
            _row("proserve", 0.35, 5.58, 1, 0.8, 0.6, 0.9, 0.7, 0.7),
            _row("vllm-priority", 0.35, 5.58, 1, 1.0, 0.9, 1.0, 0.8, float("nan"), errors=1)]
    means = bpp.aggregate(rows)
    assert [(m["config"], m["load"], m["runs"]) for m in means] == [("proserve", 0.35, 2), ("vllm-priority", 0.35, 2)]
    p = means[0]["figures"]
    assert p["TDG_all"]["mean"] == pytest.approx(0.85) and p["TDG_all"]["sd"] == pytest.approx(math.sqrt(0.005))
    assert p["SLO_high"]["mean"] == pytest.approx(0.95) and p["low_TTFT_p99_s"]["mean"] == pytest.approx(0.6)
    v = means[1]
    assert v["errors"] == 3 and v["requests"] == 200
    # a NaN P99 (no low request got a token) is left out of the mean, not averaged as 0
    assert v["figures"]["low_TTFT_p99_s"] == {"mean": 0.3, "sd": None, "n": 1}
    text = bpp.format_table(means)
    lines = text.splitlines()
    assert lines[0].split() == ["config", "load", "req/s", "runs", "reqs", "err", "TDG_all", "TDG_high", "TDG_low",
                                "SLO_all", "SLO_high", "SLO_low", "low_TTFT_p99_s"]
    assert lines[1].startswith("proserve ") and "0.850 ± 0.071" in lines[1] and "0.60 ± 0.14" in lines[1]
    assert lines[2].startswith("vllm-priority") and lines[2].rstrip().endswith("0.30")   # one value: no ±
    assert len({len(ln) for ln in lines}) == 1                  # aligned columns


def test_one_run_shows_plain_values_and_missing_classes_a_dash():
    row = _row("vllm-fcfs", 1.1, 17.55, None, 0.394, 0.269, 0.39, 0.4, 2.3)
    del row["metrics"]["low"]
    means = bpp.aggregate([row])
    text = bpp.format_table(means)
    body = text.splitlines()[1].split()
    assert body[:6] == ["vllm-fcfs", "1.1", "17.55", "1", "100", "0"]
    assert body[6:] == ["0.394", "0.390", "-", "0.269", "0.390", "-", "-"]
    assert "±" not in text


def test_header_states_the_stock_flags_and_the_1p1d_note():
    args = bpp.build_parser().parse_args(["--configs", "proserve-1p1d,vllm-priority"])
    args.model = "/abs/model"
    classes = _classes()
    gain = SimpleNamespace(w_p=3.48)
    head = bpp.header(args, ["proserve-1p1d", "vllm-priority"], [(0.35, 5.58)], gain, {0.35: 168}, classes)
    assert "VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 python -m vllm.entrypoints.openai.api_server " \
           "--model /abs/model" in head
    assert "--max-num-batched-tokens 256 --enable-chunked-prefill --scheduling-policy priority" in head
    assert "high -> 0, low -> 1" in head
    assert "TWO engine cores" in head and "5.58 (0.35x, 168 reqs)" in head
    assert "TWO engine cores" not in bpp.header(args, ["proserve", "vllm-fcfs"], [(0.35, 5.58)], gain,
                                                {0.35: 168}, classes)


def test_help_explains_the_configurations():
    text = bpp.build_parser().format_help()
    for word in ("proserve-1p1d", "vllm-priority", "--max-num-batched-tokens", "TWO engine cores", "mean ± sd",
                 "flock /tmp/proserve-engine.lock", "results.json"):
        assert word in text


def test_stock_server_stop_leaves_no_group_member_behind(tmp_path):
    # a stand-in server: a leader that dies on SIGTERM and a child that ignores it, as an
    # engine core still finishing would; stop() waits for the whole group, then SIGKILLs it
    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen(['bash', '-c', \"trap '' TERM; exec sleep 120\"])\n"
              "open(sys.argv[-1], 'w').write(str(c.pid))\n"
              "time.sleep(120)\n")
    pidf = tmp_path / "child.pid"
    srv = bpp.StockServer([sys.executable, "-c", script, "--port", "1", str(pidf)], {}, tmp_path / "server.log")
    pgid = srv.proc.pid
    for _ in range(200):
        if pidf.exists() and pidf.read_text():
            break
        time.sleep(0.05)
    child = int(pidf.read_text())
    try:
        assert ep.group_alive(pgid)
        srv.stop(grace=1.0)
        for _ in range(50):             # SIGKILL is asynchronous
            if not ep.group_alive(pgid):
                break
            time.sleep(0.05)
        assert not ep.group_alive(pgid)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_wait_healthy_reports_an_exited_server_and_a_healthy_one(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("boom: the reason it died\n")
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match=r"(?s)stock vLLM exited \(3\).*boom: the reason it died"):
        ep.wait_healthy(dead, "http://127.0.0.1:9", log, 5, "stock vLLM")
    srv = subprocess.Popen([sys.executable, "-c",
                            "import http.server, sys\n"
                            "class H(http.server.BaseHTTPRequestHandler):\n"
                            "    def do_GET(self):\n"
                            "        self.send_response(200); self.end_headers()\n"
                            "    def log_message(self, *a): pass\n"
                            "s = http.server.HTTPServer(('127.0.0.1', 0), H)\n"
                            "print(s.server_port, flush=True)\n"
                            "s.serve_forever()\n"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline())
        assert ep.wait_healthy(srv, f"http://127.0.0.1:{port}", log, 10, "x") < 10
    finally:
        srv.kill()
        srv.wait()
