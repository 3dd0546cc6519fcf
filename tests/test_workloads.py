"""bench/: trace loaders, synthetic workloads, §5.1 scaling, priority tagging."""

from __future__ import annotations

import gzip
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from proserve.bench import (
    LengthDist,
    TraceError,
    TraceRecord,
    assign_arrivals,
    build_workload,
    fit_to_context,
    load_azure,
    load_burstgpt,
    load_mooncake,
    load_sharegpt,
    load_trace,
    poisson_arrivals,
    scale_to_rate,
    sniff_format,
    synthetic,
    tag_priorities,
)
from proserve.scheduler.config import default_classes
from proserve.scheduler.request import ConfigError, PriorityClass, Request

# the copy bundled with the package (bench/data), identical to the shared one
AZURE = Path(__file__).resolve().parents[1] / "bench" / "data" / "azure_conv_2023.csv"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,0
2023-11-16 18:15:48,91,16
"""

BURST_CSV = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,30,447,Conversation log
118.5,ChatGPT,1360,208,1568,API log
"""

MOONCAKE = "\n".join(json.dumps(d) for d in [
    {"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [1, 2, 3]},
    {"timestamp": 0, "input_length": 6472, "output_length": 26, "hash_ids": [4]},
    {"timestamp": 3052, "input_length": 12, "output_length": 0, "hash_ids": []},
    {"timestamp": 1500.5, "input_length": 100, "output_length": 7},
]) + "\n"

SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "x" * 40},
                                  {"from": "gpt", "value": "y" * 9}]},
    {"id": "b", "conversations": [{"from": "gpt", "value": "hello"}]},          # no pair: skipped
    {"id": "c", "conversations": [{"from": "system", "value": "be nice"},
                                  {"from": "human", "value": "hi"},
                                  {"from": "gpt", "value": ""},
                                  {"from": "human", "value": "more"},
                                  {"from": "gpt", "value": "z" * 100}]},
    {"id": "d", "conversations": []},                                           # skipped
]


# --- Azure ---------------------------------------------------------------------

def test_azure_fixture(tmp_path):
    recs = load_azure(write(tmp_path, "az.csv", AZURE_CSV))
    assert [r.prompt_len for r in recs] == [374, 91, 396, 879]          # sorted by arrival
    assert recs[0].arrival == 0.0
    assert recs[1].arrival == pytest.approx(2 - 0.68059, abs=1e-9)
    assert recs[2].arrival == pytest.approx(50.9951690 - 46.6805900, abs=1e-9)
    assert recs[3].output_len == 1                                       # 0 generated → clamped to 1
    assert all(isinstance(r, TraceRecord) for r in recs)


def test_azure_limit_and_gzip(tmp_path):
    p = tmp_path / "az.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write(AZURE_CSV)
    assert [r.prompt_len for r in load_azure(p, limit=2)] == [374, 396]
    assert sniff_format(p) == "azure"


def test_azure_real_trace():
    recs = load_azure(AZURE)
    assert len(recs) == 19366
    assert recs[0].arrival == 0.0
    arr = np.array([r.arrival for r in recs])
    assert np.all(np.diff(arr) >= 0)
    assert np.mean([r.prompt_len for r in recs]) == pytest.approx(1154.7, abs=0.05)
    assert np.mean([r.output_len for r in recs]) == pytest.approx(211.1, abs=0.05)
    assert arr[-1] == pytest.approx(3501.721937, abs=1e-6)  # 18:15:46.68059 → 19:14:08.402527
    assert load_trace(AZURE, limit=10) == recs[:10]


@pytest.mark.parametrize("row, line, words", [
    ("2023-11-16 18:15:47.1,12", 3, ["missing column 'GeneratedTokens'"]),
    ("2023-11-16 18:15:47.1,12,abc", 3, ["GeneratedTokens", "integer", "'abc'"]),
    ("2023-11-16 18:15:47.1,12,3.5", 3, ["GeneratedTokens", "integer"]),
    ("2023-11-16 18:15:47.1,-4,3", 3, ["ContextTokens", ">= 0"]),
    ("2023-11-16 18:15:47.1,0,3", 3, ["ContextTokens is 0"]),
    ("2023-11-16 18:15:47.1,,3", 3, ["empty value", "ContextTokens"]),
    ("16/11/2023 18:15:47,12,3", 3, ["unparseable TIMESTAMP", "16/11/2023"]),
    ("2023-13-16 18:15:47.1,12,3", 3, ["unparseable TIMESTAMP"]),
])
def test_azure_malformed(tmp_path, row, line, words):
    p = write(tmp_path, "bad_azure.csv",
              "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
              + row + "\n2023-11-16 18:15:48.0,5,5\n")
    with pytest.raises(TraceError) as ei:
        load_azure(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: line {line}: "), msg
    assert ei.value.line == line and ei.value.path == str(p)
    for w in words:
        assert w in msg


def test_azure_line_numbers_count_blank_lines(tmp_path):
    p = write(tmp_path, "gaps.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6,1,1\n\n\n2023-11-16 18:15:47,x,1\n")
    with pytest.raises(TraceError, match=r"gaps\.csv: line 5: "):
        load_azure(p)


def test_azure_bad_header_and_empty(tmp_path):
    p = write(tmp_path, "hdr.csv", "TIMESTAMP,Context,GeneratedTokens\n2023-11-16 18:15:46,1,1\n")
    with pytest.raises(TraceError, match=r"hdr\.csv: line 1: missing column\(s\) 'ContextTokens'"):
        load_azure(p)
    p = write(tmp_path, "empty.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match=r"empty\.csv: contains no requests"):
        load_azure(p)
    with pytest.raises(TraceError, match=r"nothing\.csv: line 1: empty file"):
        load_azure(write(tmp_path, "nothing.csv", ""))
    with pytest.raises(TraceError, match=r"missing\.csv: cannot open"):
        load_azure(tmp_path / "missing.csv")


# --- BurstGPT ------------------------------------------------------------------

def test_burstgpt_fixture(tmp_path):
    p = write(tmp_path, "burst.csv", BURST_CSV)
    recs = load_burstgpt(p)
    # the failed row (Response tokens 0) is skipped
    assert [(r.arrival, r.prompt_len, r.output_len) for r in recs] == [
        (0.0, 472, 18), (113.0, 417, 30), (113.5, 1360, 208)]
    chat = load_burstgpt(p, model="ChatGPT")
    assert [r.prompt_len for r in chat] == [472, 1360]
    assert chat[1].arrival == 113.5
    assert load_burstgpt(p, limit=1) == recs[:1]
    assert load_trace(p, model="GPT-4") == [TraceRecord(0.0, 417, 30)]
    with pytest.raises(TraceError, match=r"burst\.csv: contains no requests for model 'Claude' "
                                         r"\(models seen: ChatGPT, GPT-4\)"):
        load_burstgpt(p, model="Claude")


@pytest.mark.parametrize("row, words", [
    ("abc,ChatGPT,1,1,2,API log", ["unparseable Timestamp", "'abc'"]),
    ("7,ChatGPT,1.5,1,2,API log", ["Request tokens", "integer"]),
    ("7,ChatGPT,0,4,4,API log", ["Request tokens is 0"]),
    ("7,ChatGPT,3,-1,2,API log", ["Response tokens", ">= 0"]),
    ("7,ChatGPT", ["missing column 'Request tokens'"]),
])
def test_burstgpt_malformed(tmp_path, row, words):
    p = write(tmp_path, "bad_burst.csv", BURST_CSV + row + "\n")
    with pytest.raises(TraceError) as ei:
        load_burstgpt(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: line 6: "), msg
    for w in words:
        assert w in msg


# --- Mooncake ------------------------------------------------------------------

def test_mooncake_fixture(tmp_path):
    p = write(tmp_path, "mc.jsonl", MOONCAKE)
    recs = load_mooncake(p)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in recs] == [
        (0.0, 6955, 52), (0.0, 6472, 26), (1.5005, 100, 7), (3.052, 12, 1)]  # output 0 → 1
    assert [r.hash_ids for r in recs] == [(1, 2, 3), (4,), (), ()]         # kept; absent: none
    assert load_mooncake(p, limit=2) == recs[:2]
    assert load_trace(p) == recs


def test_mooncake_reference_trace_keeps_its_prefix_structure():
    """issue 14's reference trace (../shared/data beside the checkout): every prompt's blocks
    named, 64 % of them repeating an earlier block."""
    ref = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
    if not ref.exists():
        pytest.skip(f"{ref} is not beside this checkout")
    recs = load_mooncake(ref)
    assert len(recs) == 3993 and all(len(r.hash_ids) == -(-r.prompt_len // 512) for r in recs)
    seen: set[int] = set()
    repeat = 0
    for r in recs:
        repeat += sum(h in seen for h in r.hash_ids)
        seen.update(r.hash_ids)
    assert 0.6 < repeat / sum(len(r.hash_ids) for r in recs) < 0.7


@pytest.mark.parametrize("line_text, words", [
    ('{"timestamp": 1, "input_length": 3', ["invalid JSON"]),
    ('[1, 2, 3]', ["expected a JSON object", "list"]),
    ('{"timestamp": 1, "output_length": 3}', ["missing column 'input_length'"]),
    ('{"timestamp": "soon", "input_length": 3, "output_length": 3}', ["unparseable timestamp"]),
    ('{"timestamp": 1, "input_length": 3.5, "output_length": 3}', ["input_length", "integer"]),
    ('{"timestamp": 1, "input_length": true, "output_length": 3}', ["input_length", "integer"]),
    ('{"timestamp": 1, "input_length": 0, "output_length": 3}', ["input_length is 0"]),
    ('{"timestamp": 1, "input_length": 3, "output_length": -3}', ["output_length", ">= 0"]),
    ('{"timestamp": 1, "input_length": 3, "output_length": 3, "hash_ids": 7}', ["hash_ids", "list", "int"]),
    ('{"timestamp": 1, "input_length": 3, "output_length": 3, "hash_ids": [1, 2]}', ["hash_ids", "2 blocks",
                                                                                     "at most 1"]),
    ('{"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [1, -2]}', ["hash_ids", "-2"]),
    ('{"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [1, true]}', ["hash_ids", "True"]),
    ('{"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": ["a"]}', ["hash_ids", "'a'"]),
])
def test_mooncake_malformed(tmp_path, line_text, words):
    p = write(tmp_path, "bad.jsonl", MOONCAKE + "\n" + line_text + "\n")  # blank line 5, bad line 6
    with pytest.raises(TraceError) as ei:
        load_mooncake(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: line 6: "), msg
    for w in words:
        assert w in msg


# --- ShareGPT ------------------------------------------------------------------

def test_sharegpt_fixture(tmp_path):
    p = write(tmp_path, "sg.json", json.dumps(SHAREGPT))
    recs = load_sharegpt(p)
    # a: 40 chars → 10 tokens, 9 chars → 3; c: first human→gpt pair ("hi", "") → 1, 1
    assert [(r.arrival, r.prompt_len, r.output_len) for r in recs] == [(0.0, 10, 3), (0.0, 1, 1)]
    words = load_sharegpt(p, tokenizer=lambda s: len(s.split()))
    assert [(r.prompt_len, r.output_len) for r in words] == [(1, 1), (1, 1)]
    ids = load_sharegpt(p, tokenizer=lambda s: list(range(len(s))))  # a list of ids works too
    assert [(r.prompt_len, r.output_len) for r in ids] == [(40, 9), (2, 1)]
    assert load_sharegpt(p, limit=1) == recs[:1]
    assert load_trace(p) == recs
    with pytest.raises(ConfigError, match="do not apply"):
        load_trace(p, model="x")


@pytest.mark.parametrize("data, record, words", [
    (SHAREGPT + ["not a record"], 4, ["expected a JSON object", "str"]),
    (SHAREGPT + [{"id": "e"}], 4, ["(id 'e')", "'conversations'"]),
    (SHAREGPT[:2] + [{"id": "f", "conversations": [{"from": "human"}]}], 2,
     ["conversations[0]", "'value'"]),
])
def test_sharegpt_malformed(tmp_path, data, record, words):
    p = write(tmp_path, "bad_sg.json", json.dumps(data))
    with pytest.raises(TraceError) as ei:
        load_sharegpt(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: record {record}: "), msg
    assert ei.value.record == record
    for w in words:
        assert w in msg


def test_sharegpt_bad_files(tmp_path):
    with pytest.raises(TraceError, match=r"obj\.json: expected a JSON list"):
        load_sharegpt(write(tmp_path, "obj.json", '{"id": 1}'))
    with pytest.raises(TraceError, match=r"broken\.json: line 3: invalid JSON"):
        load_sharegpt(write(tmp_path, "broken.json", '[\n{"id": 1},\n{"id": ]\n'))
    with pytest.raises(TraceError, match=r"nopair\.json: contains no requests"):
        load_sharegpt(write(tmp_path, "nopair.json", json.dumps(SHAREGPT[1:2] + SHAREGPT[3:])))
    with pytest.raises(TraceError, match=r"tok\.json: record 0: .*tokenizer returned"):
        load_sharegpt(write(tmp_path, "tok.json", json.dumps(SHAREGPT)), tokenizer=lambda s: "n")


# --- dispatch ------------------------------------------------------------------

def test_load_trace_dispatch_and_sniffing(tmp_path):
    az = write(tmp_path, "trace.txt", AZURE_CSV)
    bu = write(tmp_path, "b.csv", BURST_CSV)
    mc = write(tmp_path, "m.log", MOONCAKE)
    sg = write(tmp_path, "s.data", json.dumps(SHAREGPT))
    assert [sniff_format(p) for p in (az, bu, mc, sg)] == ["azure", "burstgpt", "mooncake", "sharegpt"]
    assert load_trace(az) == load_azure(az) == load_trace(az, "azure")
    assert load_trace(bu, "burstgpt") == load_burstgpt(bu)
    with pytest.raises(ConfigError, match=r"unknown trace format 'csv' \(choose from azure, "
                                          r"burstgpt, mooncake, sharegpt\)"):
        load_trace(az, "csv")
    with pytest.raises(TraceError, match=r"odd\.csv: line 1: cannot tell the trace format"):
        load_trace(write(tmp_path, "odd.csv", "a,b,c\n1,2,3\n"))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="limit must be an integer >= 1"):
            load_trace(az, limit=bad)


# --- synthetic -----------------------------------------------------------------

def test_synthetic_basic_and_seeded():
    a = synthetic(500, 4.0, seed=3)
    assert a == synthetic(500, 4.0, seed=3)
    assert a != synthetic(500, 4.0, seed=4)
    assert len(a) == 500 and a[0].arrival == 0.0
    assert all(b.arrival >= x.arrival for x, b in zip(a, a[1:]))
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in a)
    # lengths do not depend on the arrival process
    g = synthetic(500, 9.0, arrival="gamma", cv=3.0, seed=3)
    assert [(r.prompt_len, r.output_len) for r in g] == [(r.prompt_len, r.output_len) for r in a]


def test_synthetic_length_distributions():
    recs = synthetic(20000, 1.0, prompt=LengthDist.fixed(7), output=LengthDist.uniform(3, 5), seed=1)
    assert {r.prompt_len for r in recs} == {7}
    assert {r.output_len for r in recs} == {3, 4, 5}
    ln = LengthDist.lognormal(500, 0.5, lo=10, hi=900)
    x = np.array([r.prompt_len for r in synthetic(50000, 1.0, prompt=ln, seed=2)])
    assert x.min() >= 10 and x.max() <= 900
    unclamped = LengthDist.lognormal(500, 0.5)
    y = np.array([r.prompt_len for r in synthetic(50000, 1.0, prompt=unclamped, seed=2)])
    assert y.mean() == pytest.approx(500, rel=0.02)
    assert LengthDist.parse("fixed:128") == LengthDist.fixed(128)
    assert LengthDist.parse("uniform:64:512") == LengthDist.uniform(64, 512)
    assert LengthDist.parse("lognormal:1024:0.8:1:8192") == LengthDist.lognormal(1024, 0.8, 1, 8192)


@pytest.mark.parametrize("arrival, cv", [("poisson", 1.0), ("gamma", 2.0), ("gamma", 0.5)])
def test_synthetic_arrival_rate_and_cv(arrival, cv):
    t = np.array([r.arrival for r in synthetic(200_000, 5.0, arrival=arrival, cv=cv, seed=11)])
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_constant_arrivals():
    t = [r.arrival for r in synthetic(5, 2.0, arrival="constant")]
    assert t == pytest.approx([0, 0.5, 1.0, 1.5, 2.0])


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=0, rate=1.0), ["n must be an integer >= 1", "0"]),
    (dict(n=2.5, rate=1.0), ["n must be", "2.5"]),
    (dict(n=10, rate=0), ["rate must be", "0"]),
    (dict(n=10, rate=-3.0), ["rate", "-3.0"]),
    (dict(n=10, rate=float("inf")), ["rate", "inf"]),
    (dict(n=10, rate=1.0, arrival="weibull"), ["'weibull'", "poisson, gamma, constant"]),
    (dict(n=10, rate=1.0, arrival="gamma", cv=0), ["cv", "0"]),
    (dict(n=10, rate=1.0, arrival="poisson", cv=2.0), ["cv=2.0", "gamma"]),
    (dict(n=10, rate=1.0, seed=-1), ["seed", "-1"]),
    (dict(n=10, rate=1.0, prompt=128), ["prompt must be a LengthDist", "128"]),
])
def test_synthetic_invalid(kwargs, words):
    with pytest.raises(ConfigError) as ei:
        synthetic(**kwargs)
    for w in words:
        assert w in str(ei.value)


@pytest.mark.parametrize("make, words", [
    (lambda: LengthDist.fixed(0), ["value", "0"]),
    (lambda: LengthDist.uniform(10, 5), ["hi must be >= lo", "lo=10", "hi=5"]),
    (lambda: LengthDist.uniform(0, 5), ["lo", "0"]),
    (lambda: LengthDist.lognormal(-1, 0.5), ["mean", "-1"]),
    (lambda: LengthDist.lognormal(100, -0.5), ["sigma", "-0.5"]),
    (lambda: LengthDist("zipf"), ["'zipf'"]),
    (lambda: LengthDist.parse("uniform:1"), ["'uniform:1'", "arguments"]),
    (lambda: LengthDist.parse("fixed:ten"), ["'fixed:ten'"]),
])
def test_length_dist_invalid(make, words):
    with pytest.raises(ConfigError) as ei:
        make()
    for w in words:
        assert w in str(ei.value)


# --- scaling ---------------------------------------------------------------------

def mean_rate(recs):
    return (len(recs) - 1) / (recs[-1].arrival - recs[0].arrival)


@pytest.mark.parametrize("rate", [0.37, 2.0, 55.5])
def test_scale_to_rate_exact_and_preserves_gaps(rate):
    recs = synthetic(1000, 3.0, arrival="gamma", cv=2.0, seed=5)
    out = scale_to_rate(recs, rate)
    assert mean_rate(out) == pytest.approx(rate, rel=1e-9)
    assert out[0].arrival == 0.0
    g0, g1 = np.diff([r.arrival for r in recs]), np.diff([r.arrival for r in out])
    np.testing.assert_allclose(g1, g0 * (g1.sum() / g0.sum()), rtol=1e-9, atol=1e-12)
    big = g0 > 1e-3  # tiny gaps are differences of large floats: compare ratios on the others
    ratio = g1[big] / g0[big]
    assert np.ptp(ratio) <= 1e-9 * ratio.mean()                      # one common factor
    assert [(r.prompt_len, r.output_len) for r in out] == [(r.prompt_len, r.output_len) for r in recs]


def test_scale_real_trace():
    recs = load_azure(AZURE)
    out = scale_to_rate(recs, 20.0)
    assert mean_rate(out) == pytest.approx(20.0, rel=1e-9)
    assert out[-1].arrival == pytest.approx((len(recs) - 1) / 20.0, rel=1e-12)


def test_scale_shifts_and_sorts():
    recs = [TraceRecord(10.0, 1, 1), TraceRecord(12.0, 2, 2), TraceRecord(11.0, 3, 3)]
    out = scale_to_rate(recs, 2.0)   # 3 requests over 1 s at rate 2 → span 1 s
    assert [(r.arrival, r.prompt_len) for r in out] == [(0.0, 1), (0.5, 3), (1.0, 2)]
    assert scale_to_rate([TraceRecord(4.0, 1, 1)], 3.0) == [TraceRecord(0.0, 1, 1)]
    assert scale_to_rate([], 3.0) == []


def test_scale_without_timestamps_uses_poisson():
    recs = [TraceRecord(0.0, i + 1, 1) for i in range(20000)]
    out = scale_to_rate(recs, 8.0, seed=9)
    assert out == poisson_arrivals(recs, 8.0, seed=9)
    assert out != poisson_arrivals(recs, 8.0, seed=10)
    assert [r.prompt_len for r in out] == [r.prompt_len for r in recs]
    gaps = np.diff([r.arrival for r in out])
    assert out[0].arrival == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    g = scale_to_rate(recs, 8.0, arrival="gamma", cv=2.0)
    assert g == assign_arrivals(recs, 8.0, "gamma", 2.0)


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), "5"])
def test_scale_invalid_rate(rate):
    with pytest.raises(ConfigError, match=f"rate must be a number > 0, got {rate!r}"):
        scale_to_rate([TraceRecord(0.0, 1, 1), TraceRecord(1.0, 1, 1)], rate)
    with pytest.raises(ConfigError, match="rate"):
        poisson_arrivals([TraceRecord(0.0, 1, 1)], rate)


# --- priority tagging --------------------------------------------------------------

def test_tag_priorities_defaults_seeded_and_balanced():
    recs = synthetic(10_000, 10.0, seed=0)
    reqs = tag_priorities(recs, seed=42)
    assert all(isinstance(r, Request) for r in reqs)
    assert [r.id for r in reqs[:3]] == ["r0", "r1", "r2"]
    again = tag_priorities(recs, seed=42)
    assert [r.priority for r in reqs] == [r.priority for r in again]
    assert [r.priority for r in reqs] != [r.priority for r in tag_priorities(recs, seed=43)]
    n_high = sum(r.priority == "high" for r in reqs)
    assert abs(n_high - 5000) < 4 * math.sqrt(10_000 * 0.25)      # 4 sigma
    cls = default_classes()
    for r, rec in zip(reqs, recs):
        pc = cls[r.priority]
        assert (r.weight, r.ttft_slo, r.tpot_slo) == (pc.weight, pc.ttft_slo, pc.tpot_slo)
        assert (r.arrival, r.prompt_len, r.output_len) == (rec.arrival, rec.prompt_len, rec.output_len)
    assert {r.weight for r in reqs} == {2.0, 1.0}


def test_tag_priorities_custom_classes_and_shares():
    recs = synthetic(10_000, 10.0, seed=1)
    classes = {"gold": PriorityClass("gold", 5.0, 0.5, 0.05),
               "silver": PriorityClass("silver", 2.0, 1.0, 0.1),
               "bronze": PriorityClass("bronze", 1.0, 2.0, 0.2)}
    reqs = tag_priorities(recs, classes, shares={"gold": 1, "silver": 3}, seed=0, start=100.0)
    counts = {k: sum(r.priority == k for r in reqs) for k in classes}
    assert counts["bronze"] == 0
    assert counts["gold"] / len(reqs) == pytest.approx(0.25, abs=0.02)
    assert reqs[0].arrival == 100.0
    gold = next(r for r in reqs if r.priority == "gold")
    assert (gold.weight, gold.ttft_slo, gold.tpot_slo) == (5.0, 0.5, 0.05)
    only_low = tag_priorities(recs[:100], shares={"low": 1.0})
    assert {r.priority for r in only_low} == {"low"}


@pytest.mark.parametrize("kwargs, words", [
    (dict(shares={"high": -1, "low": 1}), ["shares['high']", "-1"]),
    (dict(shares={"high": 0, "low": 0}), ["must not all be 0"]),
    (dict(shares={"urgent": 1}), ["unknown class 'urgent'", "high, low"]),
    (dict(shares={"high": float("nan")}), ["shares['high']", "nan"]),
    (dict(classes={}), ["non-empty"]),
    (dict(classes={"a": PriorityClass("b", 1, 1, 1)}), ["classes['a']", "'b'"]),
    (dict(seed="x"), ["seed", "'x'"]),
    (dict(max_model_len=1), ["max_model_len", "1"]),
    (dict(start=float("inf")), ["start", "inf"]),
])
def test_tag_priorities_invalid(kwargs, words):
    with pytest.raises(ConfigError) as ei:
        tag_priorities([TraceRecord(0.0, 1, 1)], **kwargs)
    for w in words:
        assert w in str(ei.value)


def test_fit_to_context(caplog):
    recs = [TraceRecord(0.0, 100, 50), TraceRecord(1.0, 100, 1000), TraceRecord(2.0, 2000, 9),
            TraceRecord(3.0, 1023, 1)]
    out, changed = fit_to_context(recs, 1024)
    assert changed == 2
    assert [(r.prompt_len, r.output_len) for r in out] == [(100, 50), (100, 924), (1023, 1), (1023, 1)]
    with caplog.at_level("WARNING", logger="proserve.bench.workloads"):
        reqs = tag_priorities(recs, max_model_len=1024)
    assert max(r.prompt_len + r.output_len for r in reqs) == 1024
    assert "2 of 4 requests exceeded max_model_len=1024" in caplog.text


# --- build_workload ------------------------------------------------------------------

def test_build_workload_azure():
    reqs = build_workload(AZURE, rate=12.5, num_requests=2000, seed=7, start=3.0)
    assert len(reqs) == 2000
    assert reqs[0].arrival == 3.0
    assert (len(reqs) - 1) / (reqs[-1].arrival - reqs[0].arrival) == pytest.approx(12.5, rel=1e-9)
    again = build_workload(str(AZURE), rate=12.5, num_requests=2000, seed=7, start=3.0)
    assert [(r.id, r.priority, r.arrival, r.prompt_len) for r in reqs] == \
           [(r.id, r.priority, r.arrival, r.prompt_len) for r in again]
    # the trace's own timing without a rate
    raw = build_workload(AZURE, num_requests=5)
    assert [r.arrival for r in raw] == [r.arrival for r in load_azure(AZURE, limit=5)]


def test_build_workload_synthetic_and_files(tmp_path):
    syn = build_workload("synthetic", rate=4.0, num_requests=300, seed=1,
                         prompt=LengthDist.fixed(32), output=LengthDist.fixed(8))
    assert len(syn) == 300 and {(r.prompt_len, r.output_len) for r in syn} == {(32, 8)}
    assert len(build_workload("synthetic")) == 1000
    sg = write(tmp_path, "sg.json", json.dumps(SHAREGPT))
    reqs = build_workload(sg, rate=2.0, seed=0)
    assert len(reqs) == 2 and reqs[0].arrival == 0.0 and reqs[1].arrival > 0
    assert all(r.arrival == 0.0 for r in build_workload(sg))       # no rate: all at once
    bu = write(tmp_path, "b.csv", BURST_CSV)
    assert len(build_workload(bu, model="ChatGPT")) == 2
    with pytest.raises(ConfigError, match="num_requests must be an integer >= 1, got 0"):
        build_workload("synthetic", num_requests=0)
    with pytest.raises(ConfigError, match="apply only to source 'synthetic'"):
        build_workload(bu, prompt=LengthDist.fixed(3))
    with pytest.raises(ConfigError, match="do not apply to source 'synthetic'"):
        build_workload("synthetic", fmt="azure")
    with pytest.raises(TraceError, match="nope.csv: cannot open"):
        build_workload(os.path.join(tmp_path, "nope.csv"), fmt="azure")
