"""scripts/device_check_kv.py, in its CPU smoke mode, run as the GPU machine runs it: a
subprocess started from outside the repository, importing ``proserve.kvtransfer`` from
the checkout by itself (not from the installed package). The GPU-only checks (the races)
are skipped on CPU; staging, the consumer's writes and the throughput path must pass."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check_kv.py"


def test_cpu_smoke_run_passes_and_reports(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out), "--budget-s", "90"]
    p = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    report = json.loads((out / "device_check_kv.json").read_text())
    assert report["ok"] is True and report["device"] == "cpu" and report["quick"] is True
    # imported from the checkout through the script's own proserve/ package, not the installed one
    assert Path(report["import"]["kvtransfer"]) == (ROOT / "kvtransfer").resolve()
    assert "proserve-import-" in report["import"]["proserve"]
    results = {c["id"]: c["result"] for c in report["checks"]}
    assert results == {1: "pass", 2: "skip", 3: "pass", 4: "skip", 5: "pass"}
    checks = {c["id"]: c for c in report["checks"]}
    assert "no asynchronous streams on CPU".lower() in checks[2]["figures"].lower()
    # every case of checks 1 and 3 ran (both layouts, both dtypes; the loader's thread; rows)
    assert all(isinstance(v, dict) and v["exact"] for v in checks[1]["cases"].values())
    assert len(checks[1]["cases"]) == 5
    c3 = checks[3]["cases"]
    assert all(isinstance(v, dict) and v["written_wrong"] == 0 and v["others_wrong"] == 0 for v in c3.values()), c3
    assert {"NHD/fp8/rows/inject", "HND/bf16/packed/inject", "NHD/bf16/blocks/loader",
            "HND/bf16/blocks/write_device"} <= set(c3)
    fig = checks[5]["details"]
    assert fig["plain_GBps"] > 0 and fig["curve_GBps"] > 0 and fig["d2h_GBps"] > 0
    md = (out / "device_check_kv.md").read_text()
    assert "| 5 | throughput" in md and "| check | result | figures |" in md
    assert "| 3 | consumer writes bit-exact, other blocks untouched | pass |" in p.stdout
