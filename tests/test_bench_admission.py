"""scripts/bench_admission.py end to end, briefly: the dispatcher (its own process) in
front of the script's serial fake workers, 2 s of load at 3x the prefill pool's capacity.

No timing is asserted (speed is the benchmark's to measure, and this host's load would
decide it): only that the report has its fields, that the low class (on_overload
reject) got 429s, all ``slo_unreachable``, and the high class (queue) none, and that the
dispatcher's own counters agree with what the client saw.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

for _mod in ("uvicorn", "fastapi", "aiohttp", "prometheus_client"):
    pytest.importorskip(_mod, reason="the dispatcher needs the [serve] extra")

ROOT = Path(__file__).resolve().parent.parent


def test_bench_admission_runs_and_rejects_only_low(tmp_path):
    out = tmp_path / "summary.json"
    # a low TTFT SLO of 0.3 s and 3x capacity: the low class is past its SLO within
    # the first second whatever this host's speed (the estimate counts modelled work)
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_admission.py"), "--duration", "2",
                        "--load", "3", "--low-ttft", "0.3", "--idle-samples", "2", "--drain-timeout", "30",
                        "--json", str(out)], check=False, cwd=ROOT, capture_output=True, text=True,
                        timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    text = p.stdout
    for field in ("offered", "x the prefill pool's capacity", "dispatcher /health round trip, idle",
                  "dispatcher /health round trip, during load", "added to a routed request, idle, token ids",
                  "added to a routed request, idle, text", "429 ms P50", "P99", "max", ">50ms", "TTFT ms P50",
                  "high class:", "429s over 50 ms:", "dispatcher /metrics admission decisions:"):
        assert field in text, field
    rows = {tuple(line.split()[:2]): line.split() for line in text.splitlines()
            if line.split()[:1] in (["high"], ["low"]) and len(line.split()) > 2}
    assert {("high", "ids"), ("high", "text"), ("high", "all"), ("low", "ids"), ("low", "text"),
            ("low", "all")} <= set(rows)

    s = json.loads(out.read_text())
    high, low = s["classes"]["high"]["all"], s["classes"]["low"]["all"]
    assert high["requests"] > 0 and high["rejected_429"] == 0 and high["served"] == high["requests"]
    assert low["rejected_429"] > 0 and low["other"] == 0
    assert low["429_ms"] is not None and set(low["429_ms"]) == {"p50", "p99", "max"}
    assert low["rejected_429"] == int(rows[("low", "all")][4])    # the table's 429 column
    assert s["errors"] == 0 and s["unfinished"] == 0
    recs = s["requests"]
    assert {r["kind"] for r in recs} == {"ids", "text"} and {r["stream"] for r in recs} == {True, False}
    assert all(r.get("code") == "slo_unreachable" for r in recs if r["status"] == 429)
    # the dispatcher counted the same refusals (and refused nothing of the high class)
    assert s["admission"].get("low reject slo_unreachable") == low["rejected_429"]
    assert not any(k.startswith("high reject") for k in s["admission"])
