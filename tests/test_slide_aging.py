"""SlideBatching's aging (issue 13, "no starvation"): in the simulator, a steady stream of
short high-class requests at about the instance's capacity and three long low-class prompts.
Algorithm 1 alone keeps putting the low prompts last (URGENT by density, theirs the lowest);
with aging each waits at most about ``age_limit·TTFT_SLO`` plus the prefill of the aged
requests ahead of it. Deterministic simulation on the bundled latency model: the assertions
are about decisions, not this host's speed."""

from proserve.profiler.modelfile import BUNDLED, load
from proserve.scheduler import GainConfig, Request
from proserve.sim.cluster import SimConfig, simulate

MODEL = load(BUNDLED)
GAIN = GainConfig(w_p=5.0, w_d=1.0)
TTFT_SLO = 1.0


def _workload(gap: float = 0.027, seconds: float = 60.0):
    # high: 300-token prompts every `gap` s (about 1.1× what the instance clears over these
    # 60 s, a burst); low: three 4000-token prompts at 1.0, 1.5 and 2.0 s
    rs = [Request(f"h{i}", "high", 2.0, TTFT_SLO, 0.1, i * gap, 300, 30) for i in range(int(seconds / gap))]
    rs += [Request(f"l{j}", "low", 1.0, TTFT_SLO, 0.1, 1.0 + 0.5 * j, 4000, 30) for j in range(3)]
    return sorted(rs, key=lambda r: r.arrival)


def _run(**params):
    out = simulate(_workload(), MODEL, SimConfig(local_policy="slide_batching", global_policy="round_robin",
                                                 local_params=params), GAIN)
    low = [r.ttft for r in out.requests if r.priority == "low"]
    high = [r.ttft for r in out.requests if r.priority == "high"]
    return low, sum(high) / len(high)


def test_without_aging_the_long_low_prompts_wait_until_the_burst_ends():
    low, _ = _run(age_limit=None)
    assert max(low) > 30.0          # two of them wait for the whole burst (about 74 s)


def test_aging_bounds_the_wait_for_a_first_token():
    k = 8.0
    low, high_mean = _run(age_limit=k, age_share=0.25)
    # k·TTFT_SLO, plus the aged prefills ahead at share ρ of each step (4000 tokens each,
    # about 0.3 s of work alone, at a quarter of a 0.1 s step: ~1.3 s each), plus a margin
    assert max(low) <= k * TTFT_SLO + 2 * 1.5 + 1.0
    # what it costs the high class: their mean TTFT moves by under a second
    _, base_high_mean = _run(age_limit=None)
    assert high_mean - base_high_mean < 1.0
