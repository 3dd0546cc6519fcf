"""scripts/bench_prefix_real.py without an engine: the refusal of bad arguments (exit 2,
nothing started), the worker and dispatcher command lines of each router (read back by the
dispatcher's own CLI: policy, params, prefix index), the hit-rate arithmetic from the
counters' deltas scraped off fake workers' vLLM-style /metrics, the ideal hit rate of a
small conversation workload, the table and results.json of main(), and one whole router
run (processes started, replay through a real dispatcher, counters scraped, everything
stopped) against fake workers standing in for vLLM (bench/fake_worker.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_prefix_real as bpr  # noqa: E402

from proserve.bench import loadgen as lg  # noqa: E402
from proserve.bench.engine_policies import group_alive  # noqa: E402
from proserve.bench.fake_worker import FakeWorker  # noqa: E402
from proserve.dispatcher.cli import build_parser as dispatcher_parser  # noqa: E402
from proserve.dispatcher.cli import config_from_args  # noqa: E402
from proserve.scheduler.registry import make_global  # noqa: E402
from proserve.scheduler.request import ConfigError  # noqa: E402


def _args(*flags: str):
    args = bpr.build_parser().parse_args(list(flags))
    bpr.validate(args)
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- arguments -------------------------------------------------------------------------------

def test_routers_parse_in_the_order_given():
    assert bpr.parse_routers("round-robin, prefix-go") == ["round-robin", "prefix-go"]
    assert bpr.parse_routers(bpr.build_parser().get_default("routers")) == ["prefix-go", "paper-go", "round-robin"]
    assert "llmd" in bpr.ROUTERS


@pytest.mark.parametrize("flags, msg", [
    (["--routers", "prefix-go,sglang"], "unknown 'sglang'"),
    (["--routers", " , "], "no router"),
    (["--routers", "paper-go,paper-go"], "given twice"),
    (["--runs", "0"], "--runs"),
    (["--conversations", "0"], "--conversations"),
    (["--rate", "0"], "--rate"),
    (["--rate", "nan"], "--rate"),
    (["--think-time", "-1"], "--think-time"),
    (["--block-size", "16"], "multiple of 32"),
    (["--turns", "fixed"], "--turns"),
    (["--answer-len", "bogus:1"], "--answer-len"),
    (["--drain-timeout", "0"], "--drain-timeout"),
    (["--port", "65500"], "--port"),
    (["--model", "/no/such/dir"], "no such directory"),
    (["--latency-model", "/no/such.json"], "no such file"),
    (["--policy", "no_such_policy"], "no_such_policy"),
    (["--policy-param", "bogus=1"], "bogus"),
])
def test_bad_arguments_are_refused_before_anything_starts(flags, msg, tmp_path, capsys):
    with pytest.raises(ConfigError, match=msg):
        _args(*flags)
    out = tmp_path / "out"
    assert bpr.main([*flags, "--out", str(out)]) == 2
    assert msg.split("'")[0].strip() in capsys.readouterr().err
    assert not out.exists()


def test_defaults_give_a_workload_where_the_prefix_cache_matters():
    args = _args()
    assert args.latency_model == str(bpr.EPYC_LATENCY_MODEL)
    assert _args("--model", "tiny").latency_model == str(bpr.TINY_LATENCY_MODEL)
    reqs, links = bpr.make_workload(args, lg.load_classes(None, 0.5, 0.05))
    assert 12 * 4 <= len(reqs) <= 20 * 6
    assert len({ln.conversation for ln in links}) == args.conversations
    # two thirds of the prompt tokens are the previous turn's prompt, in full blocks
    assert 0.5 < bpr.ideal_hit_rate(reqs, links, args.block_size) < 0.8
    assert max(r.prompt_len + r.output_len for r in reqs) <= args.max_model_len


def test_ideal_hit_rate_counts_the_previous_turns_full_blocks():
    class R:
        def __init__(self, n):
            self.prompt_len = n
    from proserve.bench.workloads import TurnLink as L
    reqs = [R(40), R(100), R(170)]
    links = [L("c0", 0, None, 0.0, (), 32), L("c0", 1, 0, 0.0, (), 32), L("c0", 2, 1, 0.0, (), 32)]
    # turn 1 finds 32 of turn 0's 40 tokens, turn 2 finds 96 of turn 1's 100
    assert bpr.ideal_hit_rate(reqs, links, 32) == pytest.approx((32 + 96) / 310)
    assert bpr.ideal_hit_rate([], [], 32) is None


# --- what each router runs ---------------------------------------------------------------------

@pytest.mark.parametrize("router, policy, params, index", [
    ("prefix-go", "go_routing", {}, True),
    ("paper-go", "go_routing", {"order": "deadline"}, False),
    ("round-robin", "round_robin", {}, True),
    ("llmd", "llmd_scorers", {}, True),
    ("prefix-go-events", "go_routing", {}, True),
])
def test_each_router_starts_the_dispatcher_it_names(router, policy, params, index, tmp_path):
    args = _args("--port", "9000")
    cmd = bpr.dispatcher_command(args, router, tmp_path / "keys.toml", tmp_path / "classes.json", 3.5)
    assert cmd[1:3] == ["-m", "proserve.dispatcher"]
    assert ("--no-prefix-index" in cmd) == (not index)
    # read back by the dispatcher's own command line
    classes = tmp_path / "classes.json"
    classes.write_text(json.dumps([{"name": "high", "weight": 2, "ttft_slo": 0.5, "tpot_slo": 0.05},
                                   {"name": "low", "weight": 1, "ttft_slo": 0.5, "tpot_slo": 0.05}]))
    ns = dispatcher_parser().parse_args(cmd[3:])
    cfg = config_from_args(ns)
    assert cfg.global_policy == policy
    assert cfg.global_params == params
    assert cfg.prefix_index is index
    assert cfg.deployment == "colocated"
    assert [p.url for p in cfg.prefill] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    events = router == "prefix-go-events"         # the index follows the engines' KV-cache events
    assert [p.kv_events for p in cfg.prefill] == (["tcp://127.0.0.1:10100", "tcp://127.0.0.1:10101"] if events
                                                  else ["", ""])
    cfg.validate()
    assert cfg.port == 9000 and cfg.gain.w_p == 3.5
    make_global(cfg.global_policy, gain=cfg.gain, classes=cfg.classes, deployment=cfg.deployment,
                seed=cfg.seed, **cfg.global_params)     # the params are the policy's own


def test_paper_go_is_the_papers_estimate_without_the_index():
    assert bpr.ROUTERS["paper-go"]["params"] == {"order": "deadline"}
    assert bpr.ROUTERS["prefix-go"]["params"] == {} and bpr.ROUTERS["prefix-go"]["prefix_index"]


def test_workers_are_colocated_one_per_core_with_prefix_caching_on(tmp_path, monkeypatch):
    args = _args("--port", "9000", "--policy-param", "headroom=0.1")
    monkeypatch.setattr(bpr.os, "cpu_count", lambda: 2)
    cmds = [bpr.worker_command(args, i, tmp_path / "c.json", 2.0) for i in range(2)]
    for i, cmd in enumerate(cmds):
        assert cmd[1:4] == ["-m", "proserve.prefill", "--colocated"]
        assert cmd[cmd.index("--port") + 1] == str(9100 + i)
        assert cmd[cmd.index("--cpu-bind") + 1] == str(i)
        assert cmd[cmd.index("--block-size") + 1] == "32"
        assert cmd[cmd.index("--policy-param") + 1] == "headroom=0.1"
        assert cmd[-2:] == ["--", "--enable-prefix-caching"]
        assert "--no-enable-prefix-caching" not in cmd
    assert "--kv-events-port" not in cmds[0]
    ev = bpr.worker_command(args, 1, tmp_path / "c.json", 2.0, kv_events=True)
    assert ev[ev.index("--kv-events-port") + 1] == "10101" and ev[-2:] == ["--", "--enable-prefix-caching"]
    assert [bpr.worker_cpu(i, 8) for i in range(2)] == ["0-3", "4-7"]
    assert [bpr.worker_cpu(i, 1) for i in range(2)] == ["0", "0"]


# --- hit rate from the workers' counters ---------------------------------------------------------

def _metrics_page(hits: float, queries: float, done: float, step_s: float, caching: str = "True") -> str:
    return (f'vllm:cache_config_info{{block_size="32",enable_prefix_caching="{caching}",num_gpu_blocks="100"}} 1.0\n'
            f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
            f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} {done}\n'
            f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} 0.0\n'
            f'proserve:step_seconds_total{{policy="slide_batching"}} {step_s}\n')


def test_hit_rate_is_the_counters_deltas_over_both_workers():
    async def go():
        ws = [await FakeWorker(metrics_text=_metrics_page(10, 100, 2, 1.0)).start(),
              await FakeWorker(metrics_text=_metrics_page(0, 50, 2, 2.0)).start()]
        try:
            before = await asyncio.to_thread(lambda: [bpr.scrape(w.url) for w in ws])
            ws[0].metrics_text = _metrics_page(310, 500, 12, 11.0)     # +300 hits of +400 queried, 10 done
            ws[1].metrics_text = _metrics_page(100, 450, 8, 7.0)       # +100 of +400, 6 done
            after = await asyncio.to_thread(lambda: [bpr.scrape(w.url) for w in ws])
            await asyncio.to_thread(bpr.check_prefix_caching, ws[0].url)
            ws[1].metrics_text = _metrics_page(0, 0, 0, 0, caching="False")
            with pytest.raises(RuntimeError, match="prefix caching is off"):
                await asyncio.to_thread(bpr.check_prefix_caching, ws[1].url)
            return before, after
        finally:
            for w in ws:
                await w.stop()

    before, after = asyncio.run(go())
    s = bpr.prefix_stats(before, after, wall_s=20.0)
    assert (s["hits"], s["queries"]) == (400, 800)
    assert s["hit_rate"] == pytest.approx(0.5)
    assert [w["hit_rate"] for w in s["workers"]] == [pytest.approx(0.75), pytest.approx(0.25)]
    assert [w["requests"] for w in s["workers"]] == [10, 6]
    assert [w["busy"] for w in s["workers"]] == [pytest.approx(0.5), pytest.approx(0.25)]
    # nothing queried: no rate, not a division by zero; a counter that went back: a restarted worker
    same = bpr.prefix_stats(before, before)
    assert same["hit_rate"] is None and "busy" not in same["workers"][0]
    with pytest.raises(RuntimeError, match="backwards"):
        bpr.prefix_stats(after, before)


# --- the table and results.json ----------------------------------------------------------------------

def _row(router: str, run: int, hit: float, tdg: float) -> dict:
    m = {"all": {"requests": 10, "errors": 0, "ttft_p50": 0.1, "ttft_p99": 0.9, "tdg_ratio": tdg,
                 "slo_attainment": 0.8},
         "high": {"requests": 5, "tdg_ratio": tdg + 0.05, "slo_attainment": 0.9},
         "low": {"requests": 5, "tdg_ratio": tdg - 0.05, "slo_attainment": 0.7}}
    return {"router": router, "run": run, "requests": 10, "metrics": m,
            "prefix": {"hit_rate": hit, "hits": hit * 100, "queries": 100,
                       "workers": [{"requests": 6, "busy": 0.6}, {"requests": 4, "busy": 0.4}]}}


def test_aggregate_and_table_give_mean_and_sd_per_router():
    rows = [_row("prefix-go", 0, 0.6, 0.9), _row("round-robin", 0, 0.3, 0.7),
            _row("prefix-go", 1, 0.5, 0.8), _row("round-robin", 1, 0.3, 0.6)]
    means = bpr.aggregate(rows)
    assert [m["router"] for m in means] == ["prefix-go", "round-robin"]
    pg = means[0]
    assert pg["runs"] == 2 and pg["requests"] == 20 and pg["errors"] == 0
    assert pg["figures"]["hit_rate"]["mean"] == pytest.approx(0.55)
    assert pg["figures"]["TDG_high"]["mean"] == pytest.approx(0.9)
    assert means[1]["figures"]["hit_rate"]["sd"] == 0.0
    text = bpr.format_table(means)
    head, first = text.splitlines()[:2]
    for col in ("router", "hit", "TTFT_p50", "TTFT_p99", "TDG_all", "TDG_high", "TDG_low", "SLO_all", "split",
                "busy"):
        assert col in head.split()
    assert first.split()[0] == "prefix-go" and "0.550 ± 0.071" in first and "6/4" in first and "0.60/0.40" in first
    one = bpr.format_table(bpr.aggregate(rows[:1]))
    assert "±" not in one and "0.600" in one


def test_main_writes_the_table_and_results_json(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(router, run, reqs, links, args, classes, gain, files):
        calls.append((router, run))
        assert files["keys"].is_file() and files["classes"].is_file()
        if router == "paper-go" and run == 1:
            raise TimeoutError("the engines did not drain")
        return _row(router, run, {"prefix-go": 0.6, "paper-go": 0.4, "round-robin": 0.3}[router], 0.8)

    monkeypatch.setattr(bpr, "run_router", fake_run)
    out = tmp_path / "out"
    rc = bpr.main(["--runs", "2", "--model", "tiny", "--conversations", "3", "--out", str(out)])
    assert rc == 1      # one run failed: reported, the others ran
    assert calls == [(r, n) for n in range(2) for r in ("prefix-go", "paper-go", "round-robin")]
    doc = json.loads((out / "results.json").read_text())
    assert set(doc) >= {"argv", "routers", "runs", "ideal_hit_rate", "rows", "means", "failed", "cold_cache"}
    assert doc["routers"]["paper-go"]["params"] == {"order": "deadline"}
    assert doc["failed"] == [{"router": "paper-go", "run": 1, "error": "TimeoutError: the engines did not drain"}]
    assert [m["router"] for m in doc["means"]] == ["prefix-go", "paper-go", "round-robin"]
    assert [m["runs"] for m in doc["means"]] == [2, 1, 2]
    table = (out / "table.txt").read_text()
    assert "# FAILED paper-go run 1" in table and "ideal hit rate" in table
    assert table.strip() in capsys.readouterr().out


# --- one whole router run against fake workers ----------------------------------------------------------

#: a fake vLLM worker process: bench/fake_worker.py's FakeWorker whose /metrics counts what it served
FAKE = """
import asyncio, sys
from aiohttp import web
from proserve.bench.fake_worker import FakeWorker

class Counting(FakeWorker):
    async def metrics(self, request):
        n = self.requests
        return web.Response(text=(
            'vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="1000"} 1.0\\n'
            f'vllm:prefix_cache_hits_total{{engine="0"}} {30 * n}\\n'
            f'vllm:prefix_cache_queries_total{{engine="0"}} {100 * n}\\n'
            f'vllm:request_success_total{{engine="0"}} {n}\\n'
            f'proserve:step_seconds_total{{policy="x"}} {0.01 * n}\\n'
            'vllm:num_requests_running{engine="0"} 0\\nvllm:num_requests_waiting{engine="0"} 0\\n'))

async def main():
    await Counting(port=int(sys.argv[sys.argv.index("--port") + 1]), keep_bodies=False).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_one_router_run_end_to_end_on_fake_workers(tmp_path, monkeypatch):
    port = _free_port()
    wports = [_free_port(), _free_port()]
    monkeypatch.setattr(bpr, "worker_port", lambda args, i: wports[i])
    monkeypatch.setattr(bpr, "worker_command", lambda args, i, c, w, *_: [sys.executable, "-c", FAKE, "--port",
                                                                       str(wports[i])])
    out = tmp_path / "out"
    args = _args("--model", "tiny", "--port", str(port), "--conversations", "3", "--turns", "fixed:2",
                 "--rate", "50", "--think-time", "0", "--warmup", "1", "--start-timeout", "120",
                 "--drain-timeout", "30", "--timeout", "60", "--out", str(out))
    args.out = str(out)
    out.mkdir()
    classes = lg.load_classes(None, 0.5, 0.05)
    files = bpr.write_inputs(out, classes)
    reqs, links = bpr.make_workload(args, classes)
    gain = lg.workload_gain(reqs)
    started = []
    real_start = bpr.Processes.start

    def spy(self, cmd, log, env=None):
        p = real_start(self, cmd, log, env)
        started.append(p.proc.pid)
        return p

    monkeypatch.setattr(bpr.Processes, "start", spy)
    row = bpr.run_router("paper-go", 0, reqs, links, args, classes, gain, files)
    assert len(started) == 3      # two workers, then the dispatcher
    assert not any(group_alive(pid) for pid in started)    # all stopped
    assert row["router"] == "paper-go" and row["metrics"]["all"]["requests"] == len(reqs) == 6
    assert row["metrics"]["all"]["errors"] == 0
    assert row["conversations"] == 3 and row["conv_per_s"] > 0
    # the fake counters: 30 hits of 100 queried per request, after the warm-up (1 request each)
    st = row["prefix"]
    assert sum(w["requests"] for w in st["workers"]) == len(reqs)
    assert st["queries"] == 100 * len(reqs) and st["hit_rate"] == pytest.approx(0.3)
    base = out / "paper-go" / "run0"
    summary = json.loads((base / "summary.json").read_text())
    assert summary["router"] == "paper-go" and "--no-prefix-index" in summary["dispatcher_cmd"]
    assert summary["prefix"]["hit_rate"] == pytest.approx(0.3)
    assert len((base / "requests.jsonl").read_text().splitlines()) == len(reqs)
    assert (base / "worker-0.log").exists() and (base / "dispatcher-requests.jsonl").exists()


def test_a_busy_port_fails_the_run_before_anything_starts(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        args = _args("--model", "tiny", "--port", str(s.getsockname()[1]), "--out", str(tmp_path))
        monkeypatch.setattr(bpr.Processes, "start", lambda *a, **k: pytest.fail("started a process"))
        with pytest.raises(RuntimeError, match="in use"):
            bpr.run_router("prefix-go", 0, [], [], args, {}, None, {})
