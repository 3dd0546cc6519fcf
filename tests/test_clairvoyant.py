"""Clairvoyant references (issue 13, "how far from the limit"): simulator-only policies that
read the true output length. They are listed apart, an engine refuses them, and they decide
with the length as documented."""

import pytest

from proserve.prefill.engine_config import EngineConfig
from proserve.scheduler import ConfigError, Estimator, GainConfig, LatencyModel, Request, make_local, registry
from proserve.scheduler.local import PREFILL_ONLY, InstanceView

MODEL = LatencyModel(a_p=0.0, b_p=0.0, c_p=1e-3, a_d=0.0, b_d=1e-3, t_c=1e-2)
ORACLES = ("slide_batching_oracle", "jitserve_gmax_oracle")


def test_clairvoyant_policies_are_listed_apart_and_an_engine_refuses_them():
    for name in ORACLES:
        assert registry.is_clairvoyant(name)
        assert name not in registry.local_names()
        assert name in registry.local_names(clairvoyant=True)
        with pytest.raises(ConfigError, match="only the simulator knows"):
            EngineConfig.from_dict({"local_policy": name})
    assert not registry.is_clairvoyant("slide_batching")


def _req(id, out, arrival=-2.0, prompt=100):
    # waited 2 s for a 1 s TTFT SLO: past its deadline, so URGENT, ordered by density
    return Request(id, "low", 1.0, 1.0, 0.1, arrival, prompt, out)


def test_slide_batching_oracle_values_a_prefill_by_its_whole_output():
    # same prompt (exec 0.1 s), same arrival; true lengths 1 and 101 tokens; w_p = w_d = 1:
    #   short: (w_p + 0)/0.1 = 10;  long: (w_p + 100·w_d)/(0.1 + 100·0.001) = 101/0.2 = 505
    gain = GainConfig(w_p=1.0, w_d=1.0)
    short, long_ = _req("short", 1), _req("long", 101)
    view = InstanceView(now=0.0, waiting=[short, long_], mode=PREFILL_ONLY)
    oracle = make_local("slide_batching_oracle", Estimator(MODEL), gain, headroom=0.0, age_limit=None)
    plan = oracle.schedule(view)
    dens = {r.id: d for r, d in zip(plan.terms.requests, plan.terms.density)}
    assert dens["short"] == pytest.approx(10.0)
    assert dens["long"] == pytest.approx(505.0)
    assert plan.prefill[0][0].id == "long"
    # SlideBatching itself sees two equal first tokens (density 10 each): queue order decides
    plain = make_local("slide_batching", Estimator(MODEL), gain, headroom=0.0, age_limit=None).schedule(view)
    assert [d for d in plain.terms.density] == pytest.approx([10.0, 10.0])
    assert plain.prefill[0][0].id == "short"


def test_gmax_oracle_knows_the_tokens_still_to_come():
    oracle = make_local("jitserve_gmax_oracle", Estimator(MODEL))
    r = _req("r", 40)
    assert oracle._len_rem(r, 0) == 40 and oracle._len_rem(r, 39) == 1 and oracle._len_rem(r, 40) == 0
    plain = make_local("jitserve_gmax", Estimator(MODEL))
    assert plain._len_rem(r, 0) == plain.bound.remaining(0)     # the online bound, not the truth
