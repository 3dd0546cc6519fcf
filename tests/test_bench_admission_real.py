"""scripts/bench_admission_real.py without an engine: the per-class report from recorded
requests (429 latency, TTFT overrun of the admitted) and the refusal of bad modes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_admission_real as bar  # noqa: E402


def _rec(cls, status, sent, responded, ttft=None, slo=0.5):
    return {"priority": cls, "status": status, "sent": sent, "responded": responded, "ttft": ttft,
            "ttft_slo": slo}


def test_class_report_429_latency_and_ttft_overrun():
    recs = [_rec("low", 429, 1.0, 1.002), _rec("low", 429, 2.0, 2.08), _rec("low", 200, 3.0, 3.01, ttft=0.4),
            _rec("low", 200, 4.0, 4.01, ttft=0.7), _rec("low", 503, 5.0, 5.01),
            _rec("high", 200, 1.0, 1.01, ttft=0.2), _rec("high", 200, 2.0, 2.01, ttft=1.5)]
    summary = {"metrics": {"low": {"tdg_ratio": 0.4, "slo_attainment": 0.2},
                           "high": {"tdg_ratio": 0.9, "slo_attainment": 0.5}}}
    rep = bar.class_report(recs, summary)
    low, high = rep["low"], rep["high"]
    assert (low["requests"], low["served"], low["rejected"], low["other_errors"]) == (5, 2, 2, 1)
    assert low["reject_s"]["max"] == pytest.approx(0.08) and low["reject_s"]["over_50ms"] == 1
    assert low["reject_s"]["p50"] == pytest.approx(0.08)           # nearest rank of two: the upper
    # overrun = max(0, TTFT - SLO): 0 and 0.2 s; one late
    assert low["ttft_overrun_s"]["late"] == 1 and low["ttft_overrun_s"]["max"] == pytest.approx(0.2)
    assert high["rejected"] == 0 and high["reject_s"]["max"] is None
    assert high["ttft_overrun_s"]["max"] == pytest.approx(1.0) and high["tdg_ratio"] == 0.9


def test_bad_modes_are_refused_before_any_cluster(tmp_path, capsys):
    assert bar.main(["--modes", "queue,drop", "--out", str(tmp_path)]) == 2
    assert "drop" in capsys.readouterr().err
    assert bar.main(["--modes", ",", "--out", str(tmp_path)]) == 2


def test_records_without_responded_still_count_their_429s():
    # requests.jsonl written before Result.responded existed: counted, no latency
    recs = [{"priority": "low", "status": 429, "sent": 1.0, "ttft": None, "ttft_slo": 0.5}]
    rep = bar.class_report(recs, {"metrics": {}})
    assert rep["low"]["rejected"] == 1 and rep["low"]["reject_s"]["max"] is None


@pytest.mark.parametrize("flags", [["--load", "0"], ["--capacity", "-1"], ["--load", "nan"], ["--load", "1e-9"]])
def test_a_rate_that_is_not_one_is_refused_before_anything_is_written(tmp_path, capsys, flags):
    assert bar.main([*flags, "--out", str(tmp_path / "o")]) == 2
    assert "rate" in capsys.readouterr().err and not (tmp_path / "o").exists()
