"""bench/starvation.py: the starvation bound checked request by request, below saturation."""

import json

import pytest

from proserve.bench.starvation import check_run, main, peak_load


def rec(i, arrival, ttft, cls="low", slo=0.5):
    return {"id": f"r{i}", "arrival": arrival, "ttft": ttft, "priority": cls, "ttft_slo": slo}


def test_peak_load_is_exact_at_arrivals_inside_the_horizon():
    arrivals = [0.0, 1.0, 5.0, 5.1, 5.2]
    # [4, 6] with 1 s windows: three arrivals within one second at t = 5.2
    assert peak_load(arrivals, 4.0, 6.0, 1.0) == 3.0
    # the window reaches back before the start: at t = 0.5 the arrival at 0 counts
    assert peak_load(arrivals, 0.5, 0.9, 1.0) == 1.0
    # a burst after the horizon does not count
    assert peak_load(arrivals, 0.0, 4.9, 1.0) == 1.0


def test_quiet_run_every_request_is_clear_and_within_the_bound():
    recs = [rec(i, i * 1.0, 0.3) for i in range(20)]          # 1 req/s against a capacity of 5
    c = check_run(recs, capacity=5.0, age_limit=8, window=3.0)["low"]
    assert (c.n, c.clear, c.violations, c.no_token) == (20, 20, [], [])
    assert c.max_ttft_clear == pytest.approx(0.3)


def test_a_request_starved_in_a_quiet_period_is_caught():
    # one low request waits 6 s while arrivals stay at 1 req/s: below saturation, over 8 x 0.5 s
    recs = [rec(i, i * 1.0, 0.3) for i in range(20)]
    recs[5] = rec(5, 5.0, 6.0)
    c = check_run(recs, capacity=5.0, age_limit=8, window=3.0)["low"]
    assert c.violations == ["r5"]
    assert c.max_ttft_clear == 6.0


def test_requests_meeting_a_burst_before_their_bound_are_not_held_to_it():
    # quiet until 10 s, then 30 requests within 1 s (30 req/s against a capacity of 5)
    recs = [rec(i, float(i), 0.2) for i in range(10)]
    recs += [rec(10 + j, 10.0 + j / 30, 9.0) for j in range(30)]
    recs.append(rec(99, 7.0, 8.0, cls="high"))    # arrived 3 s before the burst, bound 4 s: meets it
    recs.append(rec(98, 2.0, 0.2, cls="high"))    # done long before
    out = check_run(recs, capacity=5.0, age_limit=8, window=3.0)
    # arrivals 0-6: the load stays under 5 req/s until a dozen of the burst are in (t ≈ 10.4)
    assert out["low"].clear == 7
    assert out["low"].violations == []
    assert out["low"].max_ttft_all == 9.0
    assert out["high"].clear == 1 and out["high"].violations == []


def test_no_first_token_is_counted_apart_and_a_tighter_capacity_clears_fewer():
    recs = [rec(i, i * 0.5, 0.2) for i in range(20)]              # 2 req/s
    recs[3] = rec(3, 1.5, None)
    c = check_run(recs, capacity=5.0)["low"]
    assert c.no_token == ["r3"] and c.violations == []
    assert check_run(recs, capacity=1.5)["low"].clear == 0       # 2 req/s is past 1.5
    with pytest.raises(ValueError):
        check_run(recs, capacity=0)


def test_cli_pools_runs_and_exits_1_on_a_violation(tmp_path, capsys):
    for run, late in (("run0", 0.3), ("run1", 6.0)):
        d = tmp_path / "cfg" / run / "rate1.0"
        d.mkdir(parents=True)
        with (d / "requests.jsonl").open("w") as f:
            for r in [rec(i, float(i), late if i == 4 else 0.3) for i in range(12)]:
                f.write(json.dumps(r) + "\n")
    assert main([str(tmp_path), "--capacity", "5"]) == 1
    out = capsys.readouterr().out
    assert "rate1.0" in out and "over: r4" in out
    assert "requests clear of overload over the bound: 1" in out
    assert main([str(tmp_path / "cfg" / "run0"), "--capacity", "5", "--per-run"]) == 0
    with pytest.raises(FileNotFoundError):
        main([str(tmp_path / "nope"), "--capacity", "5"])
