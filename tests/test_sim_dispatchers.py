"""Several dispatchers in front of one pool of instances (issue 15), in the simulator:
``SimConfig.dispatchers`` / ``dispatcher_sync`` ("blind", "publish", "shared"), and the
pure merge of an instance's publication with a dispatcher's own dispatches
(``RouterHost.published`` / ``PrefillQueueMap.published``)."""

import subprocess
import sys

import pytest

from proserve.bench.workloads import build_workload
from proserve.profiler.modelfile import BUNDLED, load
from proserve.scheduler import ConfigError, GainConfig
from proserve.scheduler.estimator import Estimator
from proserve.scheduler.host import RouterHost
from proserve.scheduler.registry import make_global
from proserve.scheduler.routing.base import PrefillInstance
from proserve.scheduler.routing.estimates import queue_snapshot
from proserve.sim.cluster import SimConfig, Simulator, simulate

MODEL = load(BUNDLED)
TRACE = "bench/data/azure_conv_2023.csv"


def workload(n=300, rate=12.0, seed=0):
    return build_workload(TRACE, rate=rate, num_requests=n, seed=seed, fmt="azure")


def gain_for(reqs):
    return GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs])


def times(res):
    return [(r.id, r.instance, tuple(r.token_times), r.error) for r in res.requests]


def run(cfg, n=300, rate=12.0, seed=0):
    reqs = workload(n, rate, seed)
    sim = Simulator(MODEL, cfg, gain_for(reqs))
    return sim, sim.run(reqs)


CFG = dict(deployment="colocated", instances=4, global_policy="go_routing")


# -- one dispatcher: what it was ------------------------------------------------------------------

@pytest.mark.parametrize("sync", [None, "blind", "shared"])
@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_one_dispatcher_is_the_simulator_of_old(deployment, sync):
    """dispatchers=1 (any mode but "publish") runs no publication and gives the very same token
    times as the default config (checked against the code before this change by hand: identical)."""
    base = dict(deployment=deployment, instances=4, prefill_instances=2, decode_instances=2,
                global_policy="go_routing", seed=3)
    _, ref = run(SimConfig(**base), 250, 14.0)
    sim, got = run(SimConfig(dispatchers=1, dispatcher_sync=sync, **base), 250, 14.0)
    assert times(got) == times(ref)
    assert sim.publications == 0 and len(sim.dispatchers) == 1
    assert sim.dispatchers[0].router is sim.router and sim.dispatchers[0].host is sim.router_host


# -- blind: each dispatcher sees its own dispatches only ------------------------------------------

def _two(make_req, second_at, sync, **kw):
    """Two long prompts: the first through dispatcher 0 at t=0, the second through dispatcher 1
    at ``second_at`` (round-robin), onto 2 co-located instances; the instances they went to."""
    r0 = make_req(prompt=4000, output=2, arrival=0.0, id="a")
    r1 = make_req(prompt=4000, output=2, arrival=second_at, id="b")
    cfg = SimConfig(instances=2, global_policy="go_routing", dispatchers=2, dispatcher_sync=sync, **kw)
    simulate([r0, r1], MODEL, cfg)
    assert r0.finished and r1.finished
    return r0.instance, r1.instance


def test_blind_dispatchers_pile_onto_the_same_instance(make_req):
    """Dispatcher 1 does not see dispatcher 0's request queued on instance 0 (its prefill takes
    0.32 s) and picks instance 0 as well; one shared map sends it to the idle instance 1."""
    assert _two(make_req, 0.07, "blind") == (0, 0)
    assert _two(make_req, 0.07, "shared") == (0, 1)


def test_publish_shows_the_others_dispatches_after_one_interval(make_req):
    """Before the first publication (t = 0.05 s) dispatcher 1 is as blind as without it; after
    it, it sees dispatcher 0's request on instance 0 and goes to instance 1."""
    assert _two(make_req, 0.03, "publish", publish_interval_s=0.05) == (0, 0)
    assert _two(make_req, 0.07, "publish", publish_interval_s=0.05) == (0, 1)
    assert _two(make_req, 0.07, "publish", publish_interval_s=0.1) == (0, 0)


# -- the merge: publication + own dispatches since -------------------------------------------------

def _host(n=2, seed=0):
    views = [PrefillInstance(i, Estimator(MODEL)) for i in range(n)]
    return RouterHost(make_global("go_routing", deployment="colocated", seed=seed), views), views


def test_a_publication_replaces_the_view_and_keeps_own_dispatches_not_in_it(make_req):
    host, views = _host()
    p = views[0]
    own_old = make_req(prompt=800, arrival=0.0, id="own-old")    # reached the engine: published
    own_new = make_req(prompt=500, arrival=0.9, id="own-new")    # still on its way
    foreign = make_req(prompt=300, arrival=0.5, id="foreign")    # another dispatcher's
    host.dispatched(own_old, 0, 0.0)
    host.dispatched(own_new, 0, 1.0)
    assert [r.id for r in p.queue] == ["own-old", "own-new"] and p.ts == 1.0
    snap = queue_snapshot(p, GainConfig())
    v = p.version
    # the engine has run 200 of own-old's 800 tokens; its queue: own-old, foreign
    host.published(0, [(own_old, 600, 200), (foreign, 300, 0)], ts=1.01, n_decode=3, decode_kv=3000.0)
    assert [r.id for r in p.queue] == ["own-old", "foreign", "own-new"]
    assert p.dispatched == {"own-old": (600, 200), "foreign": (300, 0), "own-new": (500, 0)}
    assert p.ts == 1.01 and p.version > v                      # lag from the publication; cache rebuilt
    assert queue_snapshot(p, GainConfig()) is not snap
    assert (p.n_decode, p.decode_kv, p.avg_decode_kv) == (3, 3000.0, 1000.0)
    # own events keep moving the view: own-new's prefill finishes, it decodes here (co-located)
    host.prefill_finished(own_new, 1.2)
    assert [r.id for r in p.queue] == ["own-old", "foreign"] and p.n_decode == 4 and p.ts == 1.2
    # the next publication: foreign's prefill is done (gone), own-old still queued; nothing in flight
    host.published(0, [(own_old, 100, 700)], ts=1.3, n_decode=5, decode_kv=5000.0)
    assert [r.id for r in p.queue] == ["own-old"] and p.dispatched == {"own-old": (100, 700)}
    assert views[1].queue == [] and views[1].version == 0      # other instances untouched


def test_own_dispatches_elsewhere_or_decoding_are_not_kept(make_req):
    host, views = _host()
    here, there = make_req(prompt=400, id="here"), make_req(prompt=400, id="there")
    host.dispatched(here, 0, 0.0)
    host.dispatched(there, 1, 0.0)
    host.prefill_finished(here, 0.1)           # decoding on 0 now: not a queued prefill
    host.published(0, [], ts=0.2, n_decode=1, decode_kv=400.0)
    host.published(1, [], ts=0.2, n_decode=0, decode_kv=0.0)
    assert views[0].queue == [] and views[0].n_decode == 1
    assert [r.id for r in views[1].queue] == ["there"]        # in flight to 1: kept
    host.finished(here, 0.5)
    assert views[0].n_decode == 0


# -- whole runs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("sync", ["blind", "publish", "shared"])
@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_every_request_finishes_and_each_router_hears_of_its_own(deployment, sync, monkeypatch):
    from proserve.scheduler.routing.go_routing import GoRouting
    heard = []
    monkeypatch.setattr(GoRouting, "on_request_finished", lambda self, r, now: heard.append((id(self), r.id)),
                        raising=False)
    cfg = SimConfig(deployment=deployment, instances=4, prefill_instances=2, decode_instances=2,
                    global_policy="go_routing", dispatchers=3, dispatcher_sync=sync, dispatch_delay=0.02,
                    publish_interval_s=0.03)
    sim, res = run(cfg, 240, 14.0)
    reqs = res.requests
    assert all(r.finished and r.error is None and r.num_emitted == r.output_len for r in reqs)
    assert sorted(rid for _, rid in heard) == sorted(r.id for r in reqs)          # each once
    # round-robin: request k (in arrival order) through dispatcher k mod 3, and only its router hears
    routers = {id(d.router): d.index for d in sim.dispatchers}
    order = {r.id: k for k, r in enumerate(sorted(reqs, key=lambda r: r.arrival))}
    assert all(routers[who] == order[rid] % 3 for who, rid in heard)
    for d in sim.dispatchers:   # nothing of their own left in their views
        assert d.host._at == {}
        if sync != "publish":
            assert all(p.queue == [] and p.n_decode == 0 for p in d.p_states)
    assert (sim.publications > 0) == (sync == "publish")
    assert len({id(d.p_states) for d in sim.dispatchers}) == (1 if sync == "shared" else 3)


@pytest.mark.parametrize("spread", ["round_robin", "random"])
def test_runs_are_deterministic_per_seed(spread):
    cfg = dict(CFG, dispatchers=4, dispatcher_sync="publish", dispatcher_spread=spread, seed=5)
    _, a = run(SimConfig(**cfg), 200, 14.0)
    _, b = run(SimConfig(**cfg), 200, 14.0)
    assert times(a) == times(b)


def test_random_spread_uses_every_dispatcher():
    sim, _ = run(SimConfig(**CFG, dispatchers=4, dispatcher_sync="blind", dispatcher_spread="random"), 120)
    used = {d.index for d in sim.dispatchers if d.router.last_decision is not None}
    assert used == {0, 1, 2, 3}


# -- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(dispatchers=0), "dispatchers must be an integer >= 1, got 0"),
    (dict(dispatchers=2.0), "dispatchers must be an integer >= 1"),
    (dict(dispatcher_sync="gossip"), "dispatcher_sync"),
    (dict(publish_interval_s=0), "publish_interval_s must be a number > 0"),
    (dict(publish_interval_s=-1.0), "publish_interval_s must be a number > 0"),
    (dict(dispatcher_spread="hash"), "dispatcher_spread"),
])
def test_invalid_dispatcher_settings_fail_at_start(kw, match):
    with pytest.raises(ConfigError, match=match):
        simulate(workload(5), MODEL, SimConfig(global_policy="go_routing", **kw))


def test_sync_mode_defaults():
    assert SimConfig().sync_mode == "shared"
    assert SimConfig(dispatchers=2).sync_mode == "publish"
    assert SimConfig(dispatchers=2, dispatcher_sync="blind").sync_mode == "blind"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "proserve.sim", *args], capture_output=True, text=True,
                          timeout=300, check=False)


def test_cli_runs_several_dispatchers_and_rejects_bad_values(tmp_path):
    p = _cli("run", "--instances", "4", "--global", "go_routing", "--rate", "12", "--num-requests", "60",
             "--dispatchers", "2", "--dispatcher-sync", "blind", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    import json
    out = json.loads((tmp_path / "run.json").read_text())
    assert out["dispatchers"] == 2 and out["dispatcher_sync"] == "blind"
    p = _cli("run", "--num-requests", "10", "--dispatchers", "0")
    assert p.returncode == 2 and "dispatchers must be an integer >= 1" in p.stderr
    p = _cli("sweep", "--num-requests", "10", "--publish-interval", "-1")
    assert p.returncode == 2 and "publish_interval_s must be a number > 0" in p.stderr
