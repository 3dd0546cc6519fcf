"""The Grafana dashboard (deploy/grafana/proserve.json) names only metrics the code exports.

Every PromQL expression of the dashboard (panel targets and template-variable
queries) is parsed for metric names, and each name is looked up in what the
code really exposes:

* ``proserve:dispatcher_*``: the exposition text of a fresh
  ``proserve.dispatcher.metrics.Metrics`` registry, every labelled family
  touched once so that it has samples (Counters appear as ``_total``,
  Histograms as ``_bucket``/``_sum``/``_count``);
* other ``proserve:*``: the exposition text of the workers' metric modules
  (``proserve.prefill.sched_metrics``, ``proserve.kvtransfer.connector_metrics``),
  made in a subprocess so that the test process's default registry stays clean;
* ``vllm:*``: the name (less a ``_total``/``_bucket``/``_sum``/``_count`` suffix)
  as a string in the installed vLLM's source (skipped where vLLM is not installed).

Any other name fails. A made-up name in a copy of the dashboard is caught.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "proserve.json"
GENERATOR = ROOT / "deploy" / "grafana" / "make_dashboard.py"

# PromQL's functions, aggregations and keywords: identifiers that are not metric names
PROMQL_WORDS = frozenset("""
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max
    clamp_min count_over_time cos cosh day_of_month day_of_week day_of_year days_in_month deg delta deriv exp
    floor histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar
    histogram_sum holt_winters double_exponential_smoothing hour idelta increase irate label_join label_replace
    last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi predict_linear
    present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_by_label
    sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp
    vector year
    sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
    by without on ignoring group_left group_right bool and or unless offset atan2 inf nan le
""".split())
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)(?=\s*(\(?))")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*?)\s*(?:,\s*[A-Za-z_][A-Za-z0-9_]*\s*)?\)\s*$", re.DOTALL)


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers outside label matchers,
    ranges and grouping lists that are neither PromQL words nor function calls."""
    e = _STRING.sub('""', expr)
    e = _BRACES.sub("{}", e)
    e = _BRACKETS.sub("[]", e)
    e = _GROUPING.sub(r"\1 ()", e)
    names = set()
    for m in _IDENT.finditer(e):
        word, call = m.group(1), m.group(2)
        if word in PROMQL_WORDS or call:
            continue
        names.add(word)
    return names


def expressions(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target (rows' nested panels too) and template-variable query."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"]))
            walk(p.get("panels", []))

    walk(dash.get("panels", []))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = _LABEL_VALUES.match(q)
        if m:
            q = m.group(1)
        if q.strip():
            out.append((f"variable ${v['name']}", q))
    return out


# -- what the code exports ----------------------------------------------------------------------
def _sample_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def _touch_all(metrics) -> None:
    """Give every labelled metric one child, so that its samples appear in the exposition."""
    for m in metrics:
        labels = getattr(m, "_labelnames", ())
        if labels:
            m.labels(*["x"] * len(labels))


def dispatcher_names() -> set[str]:
    pytest.importorskip("prometheus_client", reason="the dispatcher's metrics need the [serve] extra")
    from prometheus_client import generate_latest
    from prometheus_client.metrics import MetricWrapperBase

    from proserve.dispatcher.metrics import Metrics
    m = Metrics()
    _touch_all(v for v in vars(m).values() if isinstance(v, MetricWrapperBase))
    return _sample_names(generate_latest(m.registry).decode())


WORKER_EXPOSITION = r"""
import os, sys
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
from prometheus_client import REGISTRY, generate_latest
from proserve.prefill import sched_metrics
from proserve.kvtransfer import connector_metrics

def touch(metrics):
    for m in metrics:
        labels = getattr(m, "_labelnames", ())
        if labels:
            m.labels(*["x"] * len(labels))

touch(sched_metrics._families().values())
touch((connector_metrics.get()._m or {}).values())
sys.stdout.write(generate_latest(REGISTRY).decode())
"""


def worker_names() -> set[str]:
    pytest.importorskip("prometheus_client", reason="the workers' metrics need prometheus_client")
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    p = subprocess.run([sys.executable, "-c", WORKER_EXPOSITION], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120, check=False)
    assert p.returncode == 0, f"the workers' metric modules failed to export:\n{p.stderr}"
    return {n for n in _sample_names(p.stdout) if n.startswith("proserve:")}


def vllm_source_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def vllm_defines(name: str, src: Path) -> bool:
    base = re.sub(r"_(total|bucket|sum|count)$", "", name)
    needles = {f'"{name}"', f'"{base}"', f"'{name}'", f"'{base}'"}
    for f in src.rglob("*.py"):
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        if "vllm:" in text and any(n in text for n in needles):
            return True
    return False


def unexported(dash: dict, dispatcher: set[str], workers: set[str], vllm_src: Path | None) -> list[str]:
    """Problems: every (place, name) whose name no code exports."""
    bad = []
    for where, expr in expressions(dash):
        names = metric_names(expr)
        if not names:
            bad.append(f"{where}: no metric name in {expr!r}")
        for n in sorted(names):
            if n.startswith("proserve:dispatcher_"):
                ok = n in dispatcher
            elif n.startswith("proserve:"):
                ok = n in workers
            elif n.startswith("vllm:"):
                ok = True if vllm_src is None else vllm_defines(n, vllm_src)
            else:
                ok = False
            if not ok:
                bad.append(f"{where}: {n} is not exported by the code")
    return bad


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> tuple[set[str], set[str]]:
    return dispatcher_names(), worker_names()


# -- the tests ----------------------------------------------------------------------------------
def test_metric_name_parser():
    assert metric_names('histogram_quantile(0.9, sum by (le, priority) '
                        '(rate(proserve:dispatcher_ttft_seconds_bucket{priority=~"$priority"}[$__rate_interval])))') \
        == {"proserve:dispatcher_ttft_seconds_bucket"}
    assert metric_names("(sum(rate(a_total[5m]))) / ((sum(rate(b_total[5m])) + c) > 0)") == {"a_total", "b_total", "c"}
    assert metric_names('max by (instance) (vllm:kv_cache_usage_perc{instance=~"$instance", x="sum(y)"})') \
        == {"vllm:kv_cache_usage_perc"}
    assert metric_names("foo offset 5m and on (job) bar") == {"foo", "bar"}
    assert metric_names("sum without (le) (baz)") == {"baz"}


def test_dashboard_is_valid_grafana_json(dash):
    assert dash["schemaVersion"] >= 36 and dash["title"] and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("priority", "instance"):
        assert variables[name]["type"] == "query"
    ids, cells = set(), set()
    panels = dash["panels"]
    assert len(panels) > 20
    for p in panels:
        assert p["id"] not in ids, f"duplicate panel id {p['id']}"
        ids.add(p["id"])
        g = p["gridPos"]
        assert set(g) >= {"h", "w", "x", "y"} and g["w"] > 0 and g["h"] > 0 and 0 <= g["x"] and g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another at {(x, y)}"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["type"] in ("timeseries", "stat") and p["title"] and p["targets"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"]
            assert t["datasource"]["uid"] == "${datasource}"
            e = _STRING.sub('""', t["expr"])
            for o, c in ("()", "[]", "{}"):
                assert e.count(o) == e.count(c), f"unbalanced {o}{c} in {t['expr']!r}"
            assert not re.search(r"(^|[\s(])\{", e), f"selector without a metric name in {t['expr']!r}"


def test_dashboard_matches_its_generator(dash):
    spec = importlib.util.spec_from_file_location("make_dashboard", GENERATOR)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert DASHBOARD.read_text() == gen.render(), \
        "deploy/grafana/proserve.json is stale: run python deploy/grafana/make_dashboard.py"


def test_every_metric_in_the_dashboard_is_exported(dash, exported):
    dispatcher, workers = exported
    # the panels the issue asks for are there
    used = set().union(*(metric_names(e) for _, e in expressions(dash)))
    for n in ("proserve:dispatcher_tdg_gained_total", "proserve:dispatcher_tdg_missed_total",
              "proserve:dispatcher_slo_attained_total", "proserve:dispatcher_ttft_seconds_bucket",
              "proserve:dispatcher_tpot_seconds_bucket", "proserve:dispatcher_prefill_queue",
              "proserve:dispatcher_instance_beta", "proserve:dispatcher_decode_free_kv_blocks",
              "proserve:dispatcher_route_branch_total", "proserve:dispatcher_route_seconds_bucket",
              "proserve:dispatcher_admission_total", "proserve:dispatcher_rejected_total",
              "proserve:dispatcher_requests_total", "proserve:dispatcher_health_checks_total", "proserve:beta"):
        assert n in used, f"the dashboard has no panel on {n}"
    bad = unexported(dash, dispatcher, workers, vllm_source_dir())
    assert not bad, "\n".join(bad)


def test_vllm_metrics_exist_in_installed_vllm(dash):
    src = vllm_source_dir()
    if src is None:
        pytest.skip("vLLM is not installed: the dashboard's vllm:* names cannot be checked against its source "
                    "(pip install -e '.[cpu]')")
    names = {n for _, e in expressions(dash) for n in metric_names(e) if n.startswith("vllm:")}
    assert names, "the dashboard uses no vllm:* metric"
    missing = [n for n in sorted(names) if not vllm_defines(n, src)]
    assert not missing, f"not in vLLM {src}: {missing}"
    assert not vllm_defines("vllm:made_up_metric_for_the_test", src)


def test_a_made_up_metric_is_caught(dash, exported):
    dispatcher, workers = exported
    bad_dash = copy.deepcopy(dash)
    panel = next(p for p in bad_dash["panels"] if p["type"] == "timeseries")
    panel["targets"].append({"refId": "Z", "expr": 'sum(rate(proserve:dispatcher_made_up_total{priority="high"}[5m]))'})
    bad_dash["panels"][-1]["targets"][0]["expr"] += " + proserve:no_such_worker_metric"
    bad_dash["templating"]["list"].append({"type": "query", "name": "x",
                                           "query": {"query": "label_values(up_nonsense, job)"}})
    bad = unexported(bad_dash, dispatcher, workers, None)
    text = "\n".join(bad)
    assert "proserve:dispatcher_made_up_total" in text
    assert "proserve:no_such_worker_metric" in text
    assert "up_nonsense" in text      # neither proserve: nor vllm:
    assert len(bad) == 3, text
    # a counter named without its exposed _total suffix is caught too
    bad_dash = copy.deepcopy(dash)
    bad_dash["panels"][1]["targets"][0]["expr"] = "sum(rate(proserve:dispatcher_tdg_gained[5m]))"
    assert any("proserve:dispatcher_tdg_gained " in b for b in unexported(bad_dash, dispatcher, workers, None))
