"""bench.engine_policies, the tuned stock baseline (issue 13): configuration names
(``stock_fcfs@256``, ``slide_batching:headroom=0.3``), ``--stock-budgets`` expansion,
the engine command each configuration gets, the best-of-sweep selection from
recorded result rows, and the errors. No engine: everything here is pure."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from proserve.bench import engine_policies as ep
from proserve.scheduler.request import ConfigError


# --- names ------------------------------------------------------------------------------

def test_budget_and_params_parse_into_the_spec():
    s = ep.parse_policy("stock_fcfs@256")
    assert (s.name, s.base, s.budget, s.params, s.local_policy) == ("stock_fcfs@256", "stock_fcfs", 256, (), "stock")
    assert s.stock and s.class_body is None
    p = ep.parse_policy("stock_priority@512")
    assert p.class_body == {"high": {"priority": 0}, "low": {"priority": 1}}     # still sends vLLM's priority
    h = ep.parse_policy("slide_batching:headroom=0.3:age_limit=null")
    assert h.budget is None and h.params == (("headroom", "0.3"), ("age_limit", "null")) and not h.stock
    assert h.slug == "slide_batching_headroom=0.3_age_limit=null"      # its --out folder: no ':'
    plain = ep.parse_policy("stock_fcfs")
    assert (plain.name, plain.budget, plain.vllm_args) == ("stock_fcfs", None, ("--scheduling-policy", "fcfs"))
    assert ep.parse_policy(" slide_batching@1024 ").budget == 1024       # a budget on SlideBatching is allowed


@pytest.mark.parametrize("text, msg", [
    ("stock_fcfs@0", ">= 1"),
    ("stock_fcfs@-64", ">= 1"),
    ("stock_fcfs@2k", "must be an integer"),
    ("stock_lifo", "unknown stock_lifo"),
    ("", "unknown (empty)"),
    ("stock_fcfs:headroom=0.3", "stock vLLM takes no policy parameters"),
    ("slide_batching:headroom=1.5", "headroom must be a number in [0, 1)"),
    ("slide_batching:headroom=-0.1", "headroom"),
    ("slide_batching:bogus=1", "bogus"),
    ("slide_batching:headroom", "KEY=VALUE"),
    ("slide_batching:=3", "KEY=VALUE"),
    ("slide_batching:headroom=0.1:headroom=0.2", "twice"),
])
def test_bad_names_are_refused_before_any_engine(text, msg):
    with pytest.raises(ConfigError) as e:
        ep.parse_policy(text)
    assert msg in str(e.value)


def test_stock_budgets_expand_only_stock_entries_without_a_budget():
    specs = ep.expand_policies("slide_batching:headroom=0,slide_batching:headroom=0.3,stock_fcfs,stock_priority@512",
                               [64, 256, 2048])
    assert [s.name for s in specs] == ["slide_batching:headroom=0", "slide_batching:headroom=0.3",
                                       "stock_fcfs@64", "stock_fcfs@256", "stock_fcfs@2048", "stock_priority@512"]
    assert [s.name for s in ep.expand_policies("stock_fcfs,slide_batching")] == ["stock_fcfs", "slide_batching"]
    assert ep.parse_budgets("64, 128,2048") == [64, 128, 2048] and ep.parse_budgets(None) == []
    for bad, msg in (("64,0", ">= 1"), ("64,x", "not an integer"), ("64,64", "twice")):
        with pytest.raises(ConfigError, match=msg):
            ep.parse_budgets(bad)
    with pytest.raises(ConfigError, match="run twice"):
        ep.expand_policies("stock_fcfs@64,stock_fcfs", [64])
    with pytest.raises(ConfigError, match="no policy"):
        ep.expand_policies(" , ")


def test_main_refuses_bad_configurations_with_exit_2(capsys):
    assert ep.main(["--policies", "stock_fcfs@0"]) == 2
    assert ">= 1" in capsys.readouterr().err
    assert ep.main(["--policies", "stock_fcfs", "--stock-budgets", "128,abc"]) == 2
    assert "--stock-budgets" in capsys.readouterr().err
    assert ep.main(["--policies", "slide_batching:gamma=0"]) == 2
    assert "gamma" in capsys.readouterr().err


# --- engine command -----------------------------------------------------------------------

ARGS = SimpleNamespace(max_model_len=2048, engine_cpu="0", latency_model=None)


def _cmd(name: str) -> list[str]:
    return ep.engine_command(ep.parse_policy(name), 23456, ARGS, Path("/tmp/c.json"), 3.5, Path("/tmp/s.jsonl"))


def test_engine_command_passes_the_budget_to_vllm_with_chunked_prefill():
    cmd = _cmd("stock_fcfs@256")
    vllm = cmd[cmd.index("--") + 1:]
    assert vllm == ["--no-enable-prefix-caching", "--scheduling-policy", "fcfs",
                    "--max-num-batched-tokens", "256", "--enable-chunked-prefill"]
    assert cmd[cmd.index("--local-policy") + 1] == "stock" and "--policy-param" not in cmd
    # max_num_seqs is left to vLLM (its CPU default 128 is lowered to a smaller budget)
    assert "--max-num-seqs" not in cmd
    pri = _cmd("stock_priority@64")
    assert pri[pri.index("--") + 1:] == ["--no-enable-prefix-caching", "--scheduling-policy", "priority",
                                         "--max-num-batched-tokens", "64", "--enable-chunked-prefill"]


def test_engine_command_without_budget_is_the_untuned_default():
    cmd = _cmd("stock_fcfs")
    assert "--max-num-batched-tokens" not in cmd and "--enable-chunked-prefill" not in cmd
    assert cmd[cmd.index("--") + 1:] == ["--no-enable-prefix-caching", "--scheduling-policy", "fcfs"]
    assert cmd[cmd.index("--max-model-len") + 1] == "2048" and cmd[cmd.index("--w-p") + 1] == "3.5"


def test_step_records_can_be_turned_off():
    assert "--record-steps" in _cmd("slide_batching")          # on unless asked (as docs/results were measured)
    off = ep.engine_command(ep.parse_policy("slide_batching"), 1, SimpleNamespace(**vars(ARGS), record_steps=False),
                            Path("/tmp/c.json"), 1.0, Path("/tmp/s.jsonl"))
    assert "--record-steps" not in off
    assert ep.build_parser().parse_args(["--no-record-steps"]).record_steps is False
    assert ep.build_parser().parse_args([]).record_steps is True


def test_engine_command_passes_policy_params_to_the_plugin():
    cmd = _cmd("slide_batching:headroom=0.3:age_limit=null")
    before = cmd[:cmd.index("--")]
    assert before[before.index("--local-policy") + 1] == "slide_batching"
    assert [before[i + 1] for i, a in enumerate(before) if a == "--policy-param"] == ["headroom=0.3", "age_limit=null"]
    assert cmd[cmd.index("--") + 1:] == ["--no-enable-prefix-caching"]
    sb = _cmd("slide_batching@512")
    assert sb[sb.index("--") + 1:] == ["--no-enable-prefix-caching", "--max-num-batched-tokens", "512",
                                       "--enable-chunked-prefill"]


def test_the_worker_launcher_accepts_the_policy_flags():
    """The flags before ``--`` parse with the real worker parser (no engine is started)."""
    from proserve.prefill.worker import build_parser
    cmd = _cmd("slide_batching:headroom=0.3")
    a = build_parser("prefill").parse_args(cmd[cmd.index("proserve.prefill") + 1:])
    assert a.local_policy == "slide_batching" and a.policy_param == ["headroom=0.3"] and a.colocated
    assert a.vllm_args[-1] == "--no-enable-prefix-caching"


# --- best of the sweep ---------------------------------------------------------------------

def _row(policy, rate, tdg, slo, tdg_hi=None, slo_hi=None):
    m = lambda t, s: {"requests": 10, "errors": 0, "tdg_ratio": t, "slo_attainment": s, "ttft_p50": 0.1,
                      "ttft_p99": 0.4, "tpot_p50": 0.02, "tpot_p99": 0.04}
    return {"policy": policy, "rate": rate,
            "metrics": {"all": m(tdg, slo), "high": m(tdg if tdg_hi is None else tdg_hi, slo if slo_hi is None else slo_hi),
                        "low": m(tdg, slo)},
            "overhead": {"sched_ms_per_step": 0.1, "step_ms": 5.0, "sched_share": 0.02}, "step_stats": {"steps": 0}}


# recorded figures, chosen so that TDG and SLO pick different budgets, and the per-rate
# best differs from the one best on average
ROWS = [
    _row("slide_batching:headroom=0", 4.0, 0.99, 0.95), _row("slide_batching:headroom=0", 8.0, 0.85, 0.40),
    _row("slide_batching:headroom=0.3", 4.0, 0.99, 0.97), _row("slide_batching:headroom=0.3", 8.0, 0.80, 0.70),
    _row("stock_fcfs@64", 4.0, 0.90, 0.97), _row("stock_fcfs@64", 8.0, 0.60, 0.62),
    _row("stock_fcfs@256", 4.0, 0.98, 0.96), _row("stock_fcfs@256", 8.0, 0.70, 0.50),
    _row("stock_fcfs@2048", 4.0, 0.99, 0.94), _row("stock_fcfs@2048", 8.0, 0.55, 0.45),
    _row("stock_priority@512", 4.0, 0.97, 0.96, slo_hi=0.99), _row("stock_priority@512", 8.0, 0.66, 0.60, slo_hi=0.75),
]


def test_best_of_per_rate_and_deployed():
    b = ep.best_of(ROWS)
    assert set(b) == {"stock_fcfs", "stock_priority"}      # SlideBatching is not tuned here
    f = b["stock_fcfs"]
    assert f["configs"] == ["stock_fcfs@64", "stock_fcfs@256", "stock_fcfs@2048"] and f["rates"] == [4.0, 8.0]
    at = {e["rate"]: e for e in f["per_rate"]}
    assert at[4.0]["tdg_ratio"] == {"policy": "stock_fcfs@2048", "budget": 2048, "value": 0.99}
    assert at[4.0]["slo_attainment"]["policy"] == "stock_fcfs@64"
    assert at[8.0]["tdg_ratio"]["budget"] == 256 and at[8.0]["slo_attainment"]["budget"] == 64
    # mean TDG: 64 → 0.75, 256 → 0.84, 2048 → 0.77; mean SLO: 64 → 0.795, 256 → 0.73, 2048 → 0.695
    assert f["deployed"]["tdg_ratio"]["policy"] == "stock_fcfs@256"
    assert f["deployed"]["tdg_ratio"]["mean"] == pytest.approx(0.84)
    assert f["deployed"]["slo_attainment"]["policy"] == "stock_fcfs@64"
    assert b["stock_priority"]["deployed"]["tdg_ratio"]["budget"] == 512
    json.dumps(b)                                          # goes into results.json as is


def test_best_of_ties_nan_and_incomplete_sweeps():
    rows = [_row("stock_fcfs@128", 4.0, 0.9, 0.5), _row("stock_fcfs@64", 4.0, 0.9, 0.5),
            _row("stock_fcfs", 4.0, float("nan"), 0.6),                 # vLLM's default: a candidate too
            _row("stock_fcfs@32", 4.0, 0.99, 0.99), _row("stock_fcfs@128", 8.0, 0.5, 0.5),
            _row("stock_fcfs@64", 8.0, 0.4, 0.6), _row("stock_fcfs", 8.0, 0.45, 0.1)]
    f = ep.best_of(rows)["stock_fcfs"]
    at = {e["rate"]: e for e in f["per_rate"]}
    assert at[4.0]["tdg_ratio"]["policy"] == "stock_fcfs@32"          # best at that rate although incomplete
    # @32 ran at one rate only: not a deployable candidate; @128 and @64 tie on TDG at 4.0,
    # @128 wins on the mean (0.7 vs 0.65); the default's NaN ranks last, not first
    assert f["deployed"]["tdg_ratio"]["policy"] == "stock_fcfs@128"
    assert f["deployed"]["slo_attainment"]["policy"] == "stock_fcfs@64"
    assert at[8.0]["slo_attainment"]["policy"] == "stock_fcfs@64"
    tie = ep.best_of([_row("stock_fcfs@128", 4.0, 0.9, 0.5), _row("stock_fcfs@64", 4.0, 0.9, 0.5)])
    assert tie["stock_fcfs"]["deployed"]["tdg_ratio"]["policy"] == "stock_fcfs@128"   # first run wins a tie
    assert ep.best_of([_row("slide_batching", 4.0, 0.9, 0.9)]) == {}
    nan_only = ep.best_of([_row("stock_fcfs", 4.0, float("nan"), float("nan"))])["stock_fcfs"]
    assert nan_only["deployed"]["tdg_ratio"]["policy"] == "stock_fcfs"
    assert nan_only["deployed"]["tdg_ratio"]["mean"] == -math.inf


def test_comparison_table_puts_slide_batching_next_to_the_best_tuned_rows():
    text = ep.format_best(ROWS)
    lines = text.splitlines()
    assert "deployed" in lines[0] and "stock_fcfs: by TDG stock_fcfs@256 (mean 0.840)" in lines[0]
    head = lines[2].split()
    assert head[:3] == ["rate", "configuration", "chosen"] and "dTDG" in head and "dSLO_hi" in head
    rows8 = [ln for ln in lines[4:] if ln.startswith("8 ")]
    names8 = [ln.split()[1] for ln in rows8]
    # both SlideBatching variants, then each family's picks (one row per configuration)
    assert names8 == ["slide_batching:headroom=0", "slide_batching:headroom=0.3", "stock_fcfs@256",
                      "stock_fcfs@64", "stock_priority@512"]
    f256 = next(ln for ln in rows8 if ln.split()[1] == "stock_fcfs@256")
    assert "best TDG here" in f256 and "best mean TDG" in f256
    assert "stock_fcfs@2048" not in "\n".join(rows8)       # picked at no criterion at rate 8
    # deltas against the best of ANY stock configuration at that rate, per metric:
    # at 8: best stock TDG 0.70 (fcfs@256), SLO 0.62 (fcfs@64), SLO high 0.75 (priority@512)
    h3 = rows8[1].split()
    d = dict(zip(head[-4:], h3[-4:]))
    assert d == {"dTDG": "+0.100", "dTDG_hi": "+0.100", "dSLO": "+0.080", "dSLO_hi": "-0.050"}
    h0 = dict(zip(head[-4:], rows8[0].split()[-4:]))
    assert h0["dTDG"] == "+0.150" and h0["dSLO"] == "-0.220"


def test_report_reprints_a_recorded_results_file(tmp_path, capsys):
    p = tmp_path / "results.json"
    p.write_text(json.dumps({"argv": ["--stock-budgets", "64,256,2048"], "rows": ROWS}))
    assert ep.main(["--report", str(p)]) == 0
    out = capsys.readouterr().out
    assert "best TDG here" in out and "slide_batching:headroom=0.3" in out and "stock_fcfs@2048" in out
    (tmp_path / "bad.json").write_text("{}")
    assert ep.main(["--report", str(tmp_path / "bad.json")]) == 2
    assert "rows" in capsys.readouterr().err


# --- the model and repeated runs --------------------------------------------------------------

def test_engine_command_serves_the_given_model_with_dummy_weights_when_it_has_none(tmp_path):
    from proserve.bench.scaled_model import SCALED_MODEL, make_scaled_model
    model = make_scaled_model(tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    assert all(cfg[k] == v for k, v in SCALED_MODEL.items()) and (model / "tokenizer.json").exists()
    cmd = ep.engine_command(ep.parse_policy("slide_batching"), 1, SimpleNamespace(**vars(ARGS), model=str(model)),
                            Path("/tmp/c.json"), 1.0, Path("/tmp/s.jsonl"))
    before = cmd[:cmd.index("--")]
    assert before[before.index("--model") + 1] == str(model)
    assert before[before.index("--load-format") + 1] == "dummy"
    (model / "model.safetensors").write_bytes(b"")               # weights present: vLLM's own load format
    cmd = ep.engine_command(ep.parse_policy("slide_batching"), 1, SimpleNamespace(**vars(ARGS), model=str(model)),
                            Path("/tmp/c.json"), 1.0, Path("/tmp/s.jsonl"))
    assert "--load-format" not in cmd
    assert "--model" not in _cmd("slide_batching")               # default: the worker's bundled tiny model


def test_main_refuses_a_missing_model_and_bad_repeats(tmp_path, capsys):
    cores = os.sched_getaffinity(0)
    assert ep.main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "weights.bin").write_bytes(b"")                  # a file is not a model directory
    assert ep.main(["--model", str(tmp_path / "weights.bin"), "--out", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert ep.main(["--repeats", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--repeats" in capsys.readouterr().err
    # --host-cpu (default: core 1) pins only a run that goes ahead: a refused one leaves the
    # caller's cores alone (the workers it would start next inherit them)
    assert os.sched_getaffinity(0) == cores


def _run(policy, rate, rep, tdg, slo, ttft99=0.4):
    r = _row(policy, rate, tdg, slo)
    r["repeat"] = rep
    for m in r["metrics"].values():
        m["ttft_p99"] = ttft99
    return r


def test_mean_rows_fold_repeats_into_mean_and_sd():
    rows = [_run("slide_batching", 4.0, 0, 0.90, 0.80, 1.0), _run("stock_fcfs@256", 4.0, 0, 0.95, 0.70),
            _run("slide_batching", 4.0, 1, 0.80, 0.60, 3.0), _run("stock_fcfs@256", 4.0, 1, 0.85, 0.50),
            _run("slide_batching", 4.0, 2, 0.70, float("nan"), 2.0)]
    means = {m["policy"]: m for m in ep.mean_rows(rows)}
    sb = means["slide_batching"]
    assert sb["runs"] == 3 and sb["metrics"]["all"]["requests"] == 30
    assert sb["metrics"]["all"]["tdg_ratio"] == pytest.approx(0.80)
    assert sb["metrics"]["all"]["tdg_ratio_sd"] == pytest.approx(0.10)
    # a NaN run is left out of that metric's mean, not counted as 0
    assert sb["metrics"]["all"]["slo_attainment"] == pytest.approx(0.70)
    assert sb["metrics"]["high"]["ttft_p99"] == pytest.approx(2.0)
    one = ep.mean_rows([_run("stock_fcfs@64", 8.0, 0, 0.5, 0.5)])[0]
    assert one["runs"] == 1 and one["metrics"]["all"]["tdg_ratio_sd"] is None
    # the best-of selection ranks the means: fcfs@256 mean TDG 0.90 > SlideBatching 0.80
    text, best = ep.tables(rows)
    assert best["stock_fcfs"]["deployed"]["tdg_ratio"]["mean"] == pytest.approx(0.90)
    assert "# mean ± sd over the runs" in text and "0.800 ± 0.100" in text and "slide_batching #2" in text
    cmp_line = next(ln for ln in text.splitlines() if ln.startswith("4 ") and "slide_batching" in ln)
    assert cmp_line.split()[-4] == "-0.100"                      # dTDG on the means
    single, _ = ep.tables([_row("stock_fcfs@64", 8.0, 0.5, 0.5)])
    assert "mean ± sd" not in single


def test_tables_of_a_recorded_run_with_a_null_overhead_share():
    # results.json stores NaN as null (clean_json): a zero-step run's sched_share comes back None
    r = _row("stock_fcfs@64", 8.0, 0.5, 0.5)
    r["overhead"] = {"sched_ms_per_step": None, "step_ms": None, "sched_share": None}
    text, _ = ep.tables([r])
    assert "stock_fcfs@64" in text
