"""bench/starvation.py: the starvation bound checked request by request, below saturation."""

import json

import pytest

from proserve.bench.starvation import RecordError, check_run, main, peak_load


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
    assert (c.n, c.clear, c.violations, c.refused) == (20, 20, [], [])
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


def test_no_first_token_is_a_violation_unless_the_request_was_answered_with_an_error():
    recs = [rec(i, i * 0.5, 0.2) for i in range(20)]              # 2 req/s
    recs[3] = dict(rec(3, 1.5, None), status=200)                 # waited, never got a token
    recs[4] = dict(rec(4, 2.0, None), status=429)                 # refused at once
    recs[5] = rec(5, 2.5, None)                                   # no status: the client gave up
    c = check_run(recs, capacity=5.0)["low"]
    assert c.violations == ["r3", "r5"] and c.refused == ["r4"]
    assert check_run(recs, capacity=1.5)["low"].clear == 0       # 2 req/s is past 1.5
    with pytest.raises(ValueError):
        check_run(recs, capacity=0)


def test_strict_counts_only_the_load_up_to_the_arrival():
    # r7 arrives at 7 s, 3 s before a burst, and waits 8 s: the burst excuses it by
    # default (the system is past saturation during its wait), not under strict
    recs = [rec(i, float(i), 0.2) for i in range(10)]
    recs[7] = rec(7, 7.0, 8.0)
    recs += [rec(10 + j, 10.0 + j / 30, 1.0) for j in range(30)]
    assert check_run(recs, capacity=5.0)["low"].violations == []
    strict = check_run(recs, capacity=5.0, strict=True)["low"]
    assert strict.violations == ["r7"]
    assert strict.clear == 10 + 12        # every quiet arrival, and the burst's first 12 (< 15 in 3 s)


@pytest.mark.parametrize("bad", [
    {"arrival": float("nan")}, {"arrival": -1.0}, {"arrival": "3"}, {"ttft": float("nan")},
    {"ttft": -0.1}, {"ttft": "9.0"}, {"ttft_slo": 0}, {"ttft_slo": None}, {"priority": None},
    {"arrival": True},
])
def test_a_record_it_cannot_read_is_an_error_not_a_result(bad):
    recs = [rec(i, float(i), 0.3) for i in range(5)]
    recs[2] = {**recs[2], **bad}
    with pytest.raises(RecordError, match="r2"):
        check_run(recs, capacity=5.0)
    missing = {k: v for k, v in recs[0].items() if k != "ttft_slo"}
    with pytest.raises(RecordError):
        check_run([missing], capacity=5.0)


def test_cli_errors_name_the_file_and_exit_2(tmp_path, capsys):
    d = tmp_path / "cfg" / "run0" / "rate1.0"
    d.mkdir(parents=True)
    f = d / "requests.jsonl"
    f.write_text(json.dumps(rec(0, 0.0, 0.1)) + "\n{\"id\": \"r1\", \"arri\n")   # a truncated last line
    assert main([str(tmp_path), "--capacity", "5"]) == 2
    assert f"{f}:2: not JSON" in capsys.readouterr().err
    f.write_text("")
    assert main([str(tmp_path), "--capacity", "5"]) == 2
    assert "no records" in capsys.readouterr().err
    assert main([str(tmp_path / "nope"), "--capacity", "5"]) == 2
    assert main([str(tmp_path / "cfg" / "run0")] * 2 + ["--capacity", "5", "--window", "1"]) == 2   # still empty


def test_cli_pools_runs_and_exits_1_on_a_violation(tmp_path, capsys, monkeypatch):
    for run, late in (("run0", 0.3), ("run1", 6.0)):
        d = tmp_path / "cfg" / run / "rate1.0"
        d.mkdir(parents=True)
        with (d / "requests.jsonl").open("w") as f:
            for r in [rec(i, float(i), late if i == 4 else 0.3) for i in range(12)]:
                f.write(json.dumps(r) + "\n")
    assert main([str(tmp_path), "--capacity", "5"]) == 1
    out = capsys.readouterr().out
    assert "cfg/rate1.0" in out and "over: r4" in out           # the configuration named, runs pooled
    assert "requests clear of overload over the bound: 1" in out
    # one run given twice, by a relative and an absolute path: read once, named by its run
    run0 = tmp_path / "cfg" / "run0"
    monkeypatch.chdir(tmp_path)
    assert main(["cfg/run0", str(run0), "--capacity", "5", "--per-run"]) == 0
    out = capsys.readouterr().out
    assert " rate1.0\n" in out and "# 1 runs" in out
    monkeypatch.chdir(run0 / "rate1.0")                          # a file in the current directory
    assert main(["requests.jsonl", "--capacity", "5"]) == 0
    assert " rate1.0\n" in capsys.readouterr().out
