"""scripts/engine_paired_seeds.py: seeds read from each run's argv, pairing by seed
across directories, and the paired differences by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("engine_paired_seeds", ROOT / "scripts" / "engine_paired_seeds.py")
eps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(eps)


def _write(d: Path, seed: int | None, rows: dict[str, tuple[float, float]]) -> Path:
    d.mkdir(parents=True)
    argv = ["--levels", "0.35"] + ([] if seed is None else ["--seed", str(seed)])
    metrics = lambda t, s: {c: {"tdg_ratio": t, "slo_attainment": s} for c in ("all", "high", "low")}  # noqa: E731
    res = {"argv": argv, "rates": [1.0],
           "rows": [{"policy": p, "metrics": metrics(*v)} for p, v in rows.items()]}
    (d / "results.json").write_text(json.dumps(res))
    return d


def test_seed_of():
    assert eps.seed_of(["--seed", "3"]) == 3 and eps.seed_of(["--seed=5"]) == 5 and eps.seed_of([]) == 0


def test_pairs_by_seed_across_directories(tmp_path, capsys):
    dirs = [_write(tmp_path / "a0", None, {"slide_batching": (0.9, 0.8), "stock_fcfs@256": (0.85, 0.8)}),
            _write(tmp_path / "a1", 1, {"slide_batching": (0.8, 0.7), "stock_fcfs@256": (0.82, 0.6)}),
            _write(tmp_path / "b0", 0, {"slide_batching:stretch=true": (0.95, 0.8)}),
            _write(tmp_path / "b1", 1, {"slide_batching:stretch=true": (0.9, 0.7)})]
    vals = eps.load(dirs)
    assert vals[("stock_fcfs@256", 1)]["hi_slo"] == 0.6
    assert eps.main([str(d) for d in dirs]) == 0
    out = capsys.readouterr().out
    # slide_batching - fcfs: +0.05 and -0.02 -> mean +0.015, se 0.035; ahead in 1, behind in 1
    assert "stock_fcfs@256: tdg +0.0150 ± 0.0350 (1/0/1)" in out
    # both SlideBatching rows are references, and each is held against the other
    assert "slide_batching: tdg +0.0750 ± 0.0250 (2/0/0)" in out


def test_refuses_a_duplicate_and_several_rates(tmp_path):
    d1 = _write(tmp_path / "x", 0, {"p": (1, 1)})
    d2 = _write(tmp_path / "y", 0, {"p": (1, 1)})
    with pytest.raises(SystemExit, match="twice"):
        eps.load([d1, d2])
    res = json.loads((d1 / "results.json").read_text())
    res["rates"] = [1.0, 2.0]
    (d1 / "results.json").write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="rates"):
        eps.load([d1])
