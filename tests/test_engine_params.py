"""Per-request scheduling parameters and the plugin's configuration: parsed and
checked without an engine (the engine-side behaviour is in test_engine_scheduler
and test_engine_http)."""

from __future__ import annotations

import json

import pytest

from proserve.prefill import params, worker
from proserve.prefill.engine_config import EngineConfig, build, check
from proserve.scheduler.config import default_classes
from proserve.scheduler.estimator import LatencyModel
from proserve.scheduler.request import ConfigError

CLASSES = default_classes()
MODEL = LatencyModel(1e-9, 1e-9, 1e-5, 1e-7, 1e-4, 1e-3)


def test_defaults_come_from_the_class():
    p = params.parse({"priority_class": "high"}, CLASSES, "low")
    assert (p.priority, p.weight, p.ttft_slo, p.tpot_slo, p.arrival_time) == ("high", 2.0, 1.0, 0.1, None)
    p = params.parse(None, CLASSES, "low")
    assert p.priority == "low" and p.weight == 1.0


def test_overrides():
    p = params.parse({"priority_class": "low", "weight": 3, "ttft_slo": 0.5, "tpot_slo": "0.05",
                      "arrival_time": 1700000000.5, "unrelated": "kept for other plugins"}, CLASSES, "low")
    assert (p.weight, p.ttft_slo, p.tpot_slo, p.arrival_time) == (3.0, 0.5, 0.05, 1700000000.5)


@pytest.mark.parametrize("xargs, field", [
    ({"priority_class": "gold"}, "priority_class"),
    ({"priority_class": 1}, "priority_class"),
    ({"ttft_slo": -1}, "ttft_slo"),
    ({"ttft_slo": 0}, "ttft_slo"),
    ({"tpot_slo": "fast"}, "tpot_slo"),
    ({"tpot_slo": float("nan")}, "tpot_slo"),
    ({"weight": -2}, "weight"),
    ({"weight": True}, "weight"),
    ({"arrival_time": float("inf")}, "arrival_time"),
])
def test_bad_values_name_the_field(xargs, field):
    with pytest.raises(params.ParamsError, match=f"vllm_xargs.{field}"):
        params.parse(xargs, CLASSES, "low")


def test_unknown_class_lists_the_configured_ones():
    with pytest.raises(params.ParamsError, match="vllm_xargs.priority_class must be one of high, low, got 'gold'"):
        params.parse({"priority_class": "gold"}, CLASSES, "low")


def test_validator_reads_classes_from_the_environment(monkeypatch):
    monkeypatch.setenv(params.CLASSES_ENV, json.dumps(
        [{"name": "gold", "weight": 4, "ttft_slo": 0.3, "tpot_slo": 0.03},
         {"name": "bronze", "weight": 1, "ttft_slo": 2, "tpot_slo": 0.2}]))
    monkeypatch.delenv(params.DEFAULT_CLASS_ENV, raising=False)
    monkeypatch.setattr(params.ParamsValidator, "_table", None)

    class SP:
        extra_args = {"priority_class": "gold"}

    params.ParamsValidator.validate_params(SP())
    SP.extra_args = {"priority_class": "high"}
    with pytest.raises(ValueError, match="vllm_xargs.priority_class must be one of bronze, gold, got 'high'"):
        params.ParamsValidator.validate_params(SP())
    assert params.ParamsValidator._table[1] == "bronze"   # untagged requests get the lowest weight


@pytest.mark.vllm
def test_both_model_runners_load_the_validator_and_it_leaves_logits_alone(monkeypatch):
    """vLLM 0.32 on CUDA runs Model Runner V2, whose loader refuses a class that is not
    its own logits-processor interface (the V1 runner, used here on CPU, has another):
    both of vLLM's loaders take the validator, and under either it changes no logits."""
    torch = pytest.importorskip("torch")
    from vllm.v1.sample.logits_processor import _load_custom_logitsprocs
    try:        # Model Runner V2's loader: vLLM >= 0.32 (0.23 and 0.27 have the V1 runner only)
        from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs
    except ImportError:
        _load_v2_logitsprocs = None
    fqcn = "proserve.prefill.params:ParamsValidator"
    assert _load_custom_logitsprocs([fqcn]) == [params.ParamsValidator]
    if _load_v2_logitsprocs is not None:
        assert _load_v2_logitsprocs([fqcn]) == [params.ParamsValidator]
    logits = torch.randn(3, 11)
    v1 = params.ParamsValidator(None, torch.device("cpu"), False)
    assert v1.is_argmax_invariant() and torch.equal(v1.apply(logits.clone()), logits)
    v2 = params.ParamsValidator(None, None)
    assert v2.add_request(0, None) is False and torch.equal(v2.apply(logits.clone(), None), logits)
    monkeypatch.setattr(params.ParamsValidator, "_table", None)
    monkeypatch.delenv(params.CLASSES_ENV, raising=False)

    class SP:
        extra_args = {"priority_class": "nope"}
    with pytest.raises(ValueError, match="priority_class"):
        params.ParamsValidator.validate_params(SP())


def test_engine_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="unknown key"):
        EngineConfig.from_dict({"local_polcy": "sjf"})
    with pytest.raises(ConfigError, match="unknown local policy 'nope'"):
        EngineConfig.from_dict({"local_policy": "nope"})
    with pytest.raises(ConfigError, match="mode must be one of colocated, prefill_only, got 'both'"):
        EngineConfig.from_dict({"mode": "both"})
    with pytest.raises(ConfigError, match="gamma must be a number > 0"):
        check({"policy_params": {"gamma": 0}})
    with pytest.raises(ConfigError, match="unexpected keyword"):
        check({"policy_params": {"gama": 1}})
    with pytest.raises(ConfigError, match="theta"):
        check({"theta": 1.5})
    with pytest.raises(ConfigError, match="default_class must be one of high, low, got 'gold'"):
        check({"default_class": "gold"})


def test_engine_config_builds_the_policy():
    parts = build(EngineConfig.from_dict({"local_policy": "slide_batching", "policy_params": {"phi": "c"}}),
                  model=MODEL)
    assert parts.policy.name == "slide_batching" and parts.policy.phi == "c"
    assert parts.default_class == "low"
    assert build(EngineConfig.from_dict({"local_policy": "stock"}), model=MODEL).policy is None


def _argv(role, *flags):
    args = worker.build_parser(role).parse_args(list(flags))
    return worker.vllm_argv(role, args)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_worker_loads_the_plugin_and_validator():
    argv, env = _argv("prefill", "--gamma", "2", "--phi", "p", "--policy-param", "token_budget=512")
    assert _flag(argv, "--scheduler-cls") == worker.PLUGIN
    assert "--no-async-scheduling" not in argv    # vLLM's default: the plugin runs under async scheduling too
    assert _flag(argv, "--logits-processors") == worker.VALIDATOR
    cfg = json.loads(_flag(argv, "--additional-config"))["proserve"]
    assert cfg["local_policy"] == "slide_batching" and cfg["mode"] == "prefill_only"
    assert cfg["policy_params"] == {"gamma": 2.0, "phi": "p", "token_budget": 512}
    assert "--kv-transfer-config" in argv
    assert env["PROMETHEUS_MULTIPROC_DIR"] and json.loads(env[params.CLASSES_ENV])[0]["name"] == "high"


def test_worker_colocated_and_off():
    argv, _ = _argv("prefill", "--colocated", "--local-policy", "sarathi_priority")
    assert "--kv-transfer-config" not in argv
    assert json.loads(_flag(argv, "--additional-config"))["proserve"]["mode"] == "colocated"
    argv, _ = _argv("decode")   # decode workers keep vLLM's scheduler unless asked
    assert "--scheduler-cls" not in argv and "--logits-processors" not in argv


@pytest.mark.parametrize("flags, msg", [
    (["--local-policy", "nope"], "unknown policy 'nope'"),
    (["--gamma", "-1"], "gamma must be a number > 0"),
    (["--latency-model", "/nonexistent.json"], "cannot read"),
    (["--default-class", "gold"], "--default-class 'gold' is not a class"),
    (["--policy-param", "gamma"], "KEY=VALUE"),
])
def test_worker_rejects_bad_flags(flags, msg, capsys):
    with pytest.raises(SystemExit) as e:
        _argv("prefill", *flags)
    assert msg in str(e.value)


def test_worker_classes_file(tmp_path):
    f = tmp_path / "classes.json"
    f.write_text(json.dumps([{"name": "gold", "weight": 3, "ttft_slo": 0.5, "tpot_slo": 0.05}]))
    argv, env = _argv("prefill", "--classes", str(f))
    assert json.loads(_flag(argv, "--additional-config"))["proserve"]["classes"][0]["name"] == "gold"
    assert env[params.DEFAULT_CLASS_ENV] == "gold"
    f.write_text(json.dumps([{"name": "gold", "weight": -3, "ttft_slo": 0.5, "tpot_slo": 0.05}]))
    with pytest.raises(SystemExit, match="weight must be a number > 0"):
        _argv("prefill", "--classes", str(f))
    f.write_text("[{")
    with pytest.raises(SystemExit, match="not valid JSON"):
        _argv("prefill", "--classes", str(f))
