"""Write ``deploy/grafana/proserve.json``, the Grafana dashboard of a ProServe cluster.

    python deploy/grafana/make_dashboard.py            # rewrite proserve.json
    python deploy/grafana/make_dashboard.py --check    # exit 1 if proserve.json is stale

The JSON is what Grafana imports (Dashboards -> New -> Import, or file
provisioning); this script is its source, so that a panel is a line here
rather than forty lines of JSON. ``tests/test_dashboard.py`` checks that the
JSON is this script's output and that every metric an expression names is one
the code exports.

Panels read two kinds of scrape target:

* the **dispatcher** (``proserve:dispatcher_*``, ``dispatcher/metrics.py``):
  per class TDG, SLO attainment, TTFT/TPOT, outcomes, admission; routing; its
  view of every worker. Its per-worker metrics carry the worker in a label
  named ``instance``, which Prometheus renames ``exported_instance`` when it
  scrapes them (``honor_labels: false``, the default), since ``instance`` is
  the scrape target's own label; the dashboard reads ``exported_instance``
  (variable ``$worker``).
* the **workers** (``proserve:*`` of the SlideBatching plugin,
  ``prefill/sched_metrics.py``, and of the KV connector,
  ``kvtransfer/connector_metrics.py``; a few of vLLM's own ``vllm:*``),
  selected by the scrape target's ``instance`` (variable ``$instance``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("proserve.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
PRIO = 'priority=~"$priority"'
WORKER = 'exported_instance=~"$worker"'
INST = 'instance=~"$instance"'


class Layout:
    """Panels left to right, 24 grid units a row."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.row_h = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += self.row_h
        self.panels.append({"type": "row", "id": self._id(), "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.y += 1
        self.x = self.row_h = 0

    def add(self, panel: dict, w: int, h: int) -> None:
        if self.x + w > 24:
            self.y += self.row_h
            self.x = self.row_h = 0
        panel = {"id": self._id(), **panel, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def target(expr: str, legend: str = "", ref: str = "A") -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref, "range": True}


def targets(*pairs: tuple[str, str]) -> list[dict]:
    return [target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(pairs)]


def timeseries(title: str, desc: str, tgts: list[dict], unit: str = "short", stack: bool = False,
               minimum: float | None = 0, maximum: float | None = None, step: bool = False) -> dict:
    defaults: dict = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10 if stack else 0,
                                               "showPoints": "never", "spanNulls": False,
                                               "lineInterpolation": "stepAfter" if step else "linear",
                                               "stacking": {"mode": "normal" if stack else "none", "group": "A"}}}
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {"type": "timeseries", "title": title, "description": desc, "datasource": DS, "targets": tgts,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                                   "calcs": ["lastNotNull", "mean", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, desc: str, expr: str, unit: str = "short", decimals: int | None = None,
         thresholds: list[tuple[float | None, str]] | None = None) -> dict:
    steps = [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])]
    defaults: dict = {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "stat", "title": title, "description": desc, "datasource": DS, "targets": [target(expr)],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto",
                        "orientation": "auto"}}


def quantiles(metric: str, by: str, sel: str, legend: str) -> list[dict]:
    qs = (0.5, 0.9, 0.99)
    series = f"{metric}_bucket{{{sel}}}" if sel else f"{metric}_bucket"
    return [target(f"histogram_quantile({q}, sum by (le, {by}) (rate({series}[{RATE}])))",
                   f"{legend} p{int(q * 100)}", chr(ord("A") + i)) for i, q in enumerate(qs)]


def rate(metric: str, sel: str = "", by: str = "") -> str:
    inner = f"rate({metric}{{{sel}}}[{RATE}])" if sel else f"rate({metric}[{RATE}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def ratio(num: str, den: str) -> str:
    """num / den, with no value (rather than NaN or Inf) where nothing was counted."""
    return f"({num}) / (({den}) > 0)"


def dashboard() -> dict:
    L = Layout()
    D = "proserve:dispatcher_"

    # -- overview -------------------------------------------------------------------------------
    L.row("Overview (dispatcher)")
    L.add(stat("Requests / s", "Requests that ended, every class and outcome",
               rate(D + "requests_total"), "reqps", 2), 4, 4)
    L.add(stat("In flight", "Requests being served by the dispatcher now",
               f"sum({D}requests_in_flight)"), 4, 4)
    L.add(stat("TDG ratio", "TDG gained / (gained + missed), all classes (Eq. 3 with the dispatcher's gain "
                            "weights): 1 means every delivered token met its deadline",
               ratio(rate(D + "tdg_gained_total"),
                     f"{rate(D + 'tdg_gained_total')} + {rate(D + 'tdg_missed_total')}"), "percentunit", 3,
               [(None, "red"), (0.8, "orange"), (0.95, "green")]), 4, 4)
    L.add(stat("SLO attainment", "Requests with TTFT and TPOT both within their SLO, over every request that "
                                 "ended in a class (a failed or rejected request counts as a miss)",
               ratio(rate(D + "slo_attained_total"), rate(D + "requests_total", 'priority!="-"')),
               "percentunit", 3, [(None, "red"), (0.8, "orange"), (0.95, "green")]), 4, 4)
    L.add(stat("Healthy prefill instances", "Prefill (or co-located) instances in the candidate set",
               f'sum({D}instance_healthy{{role="prefill"}})', "short", 0,
               [(None, "red"), (1, "green")]), 4, 4)
    L.add(stat("Healthy decode instances", "Decode instances in the candidate set (none in a co-located "
                                           "deployment)",
               f'sum({D}instance_healthy{{role="decode"}})', "short", 0), 4, 4)

    # -- TDG and SLO per class ------------------------------------------------------------------
    L.row("TDG and SLO per class")
    L.add(timeseries("TDG gained / s", "TDG gained per second, per priority class (Eq. 3)",
                     [target(rate(D + "tdg_gained_total", PRIO, "priority"), "{{priority}}")]), 8, 8)
    L.add(timeseries("TDG missed / s", "Ideal gain of the delivered tokens minus what they earned, per second",
                     [target(rate(D + "tdg_missed_total", PRIO, "priority"), "{{priority}}")]), 8, 8)
    L.add(timeseries("TDG ratio", "gained / (gained + missed) per class",
                     [target(ratio(rate(D + "tdg_gained_total", PRIO, "priority"),
                                   f"{rate(D + 'tdg_gained_total', PRIO, 'priority')} + "
                                   f"{rate(D + 'tdg_missed_total', PRIO, 'priority')}"), "{{priority}}")],
                     "percentunit", maximum=1), 8, 8)
    L.add(timeseries("SLO attainment", "Requests with TTFT and TPOT both within SLO over the requests that "
                                       "ended, per class",
                     [target(ratio(rate(D + "slo_attained_total", PRIO, "priority"),
                                   rate(D + "requests_total", PRIO, "priority")), "{{priority}}")],
                     "percentunit", maximum=1), 8, 8)
    L.add(timeseries("Output tokens / s", "Output tokens delivered per class",
                     [target(rate(D + "output_tokens_total", PRIO, "priority"), "{{priority}}")]), 8, 8)
    L.add(timeseries("Requests in flight", "Requests being served by each dispatcher",
                     [target(f"{D}requests_in_flight", "{{instance}}")]), 8, 8)

    # -- latency --------------------------------------------------------------------------------
    L.row("Latency (as the client sees it, measured at the dispatcher)")
    L.add(timeseries("TTFT", "Time to first token per class: p50, p90, p99 of the histogram",
                     quantiles(D + "ttft_seconds", "priority", PRIO, "{{priority}}"), "s"), 12, 8)
    L.add(timeseries("TPOT", "Mean time per output token after the first, per class: p50, p90, p99",
                     quantiles(D + "tpot_seconds", "priority", PRIO, "{{priority}}"), "s"), 12, 8)

    # -- requests and admission -----------------------------------------------------------------
    L.row("Requests, admission and rejections")
    L.add(timeseries("Request outcomes / s", "Requests that ended, by class and outcome (ok, client_error, "
                                             "auth_error, rejected, upstream_error, timeout, cancelled, "
                                             "internal_error); class '-': refused before it was known",
                     [target(rate(D + "requests_total", "", "priority, outcome"), "{{priority}} {{outcome}}")],
                     "reqps", stack=True), 8, 8)
    L.add(timeseries("Admission decisions / s", "Admission control (when configured), per class the request "
                                                "came in: admit, queue (no instance meets its TTFT SLO; queued "
                                                "anyway), downgrade, reject; reason -, slo_unreachable, queue_full",
                     [target(rate(D + "admission_total", PRIO, "priority, decision, reason"),
                             "{{priority}} {{decision}} ({{reason}})")], "reqps", stack=True), 8, 8)
    L.add(timeseries("Rejected before routing / s", "By reason: auth 401, body_too_large 413, body_timeout 408, "
                                                    "header_timeout, overloaded / client_overloaded 429, bad_json "
                                                    "400, slo_unreachable / queue_full 429 (admission control)",
                     [target(rate(D + "rejected_total", "", "reason"), "{{reason}}")], "reqps", stack=True), 8, 8)
    L.add(timeseries("Timeouts / s", "header, body (client side); stream_idle, request (towards the workers)",
                     [target(rate(D + "timeouts_total", "", "kind"), "{{kind}}")], "reqps"), 8, 8)
    L.add(timeseries("Retries / s", "Requests retried on another instance, by the leg that failed",
                     [target(rate(D + "retries_total", "", "role"), "{{role}}")], "reqps"), 8, 8)
    L.add(timeseries("Stream back-pressure", "Stream read waits for a slow client (/s) and the "
                                                          "fullest stream queue since start (events)",
                     targets((rate(D + "stream_backpressure_total"), "back-pressure waits / s"),
                             (f"max({D}stream_queue_peak_events)", "stream queue peak (events)"))), 8, 8)

    # -- routing --------------------------------------------------------------------------------
    L.row("Routing (GoRouting, Alg. 2)")
    L.add(timeseries("Routing branches / s", "GoRouting's branch per decision: light = line 13 (an instance "
                                             "that idles), fill = line 15, balance = line 17, fallback = line 19, "
                                             "scored = C − H by llm-d's score (choose=scorers)",
                     [target(rate(D + "route_branch_total", "", "branch"), "{{branch}}")], "ops", stack=True),
          8, 8)
    L.add(timeseries("Routing decision time", "Time GoRouting (or the configured policy) takes per decision",
                     quantiles(D + "route_seconds", "instance", "", "{{instance}}")
                     + [target(ratio(f"sum by (instance) (rate({D}route_seconds_sum[{RATE}]))",
                                     f"sum by (instance) (rate({D}route_seconds_count[{RATE}]))"),
                               "{{instance}} mean", "D")], "s"), 8, 8)
    L.add(timeseries("Routed / s per instance", "Routing decisions per worker and role",
                     [target(rate(D + "routed_total", WORKER, "role, exported_instance"),
                             "{{role}} {{exported_instance}}")], "ops", stack=True), 8, 8)

    # -- the dispatcher's view of the workers ---------------------------------------------------
    L.row("Instances (the dispatcher's view)")
    L.add(timeseries("PrefillQueueMap length", "Requests the dispatcher has sent to a prefill instance that "
                                               "have not finished their prefill",
                     [target(f"sum by (exported_instance) ({D}prefill_queue{{{WORKER}}})",
                             "{{exported_instance}}")], step=True), 8, 8)
    L.add(timeseries("β per prefill instance", "Online latency-correction factor β each prefill instance "
                                               "reports (PROSERVE §4.1), as the dispatcher last read it",
                     [target(f"max by (exported_instance) ({D}instance_beta{{{WORKER}}})",
                             "{{exported_instance}}")], minimum=None), 8, 8)
    L.add(timeseries("Free KV blocks per decode instance", "Last poll of each decode instance's free KV blocks, "
                                                           "minus the blocks dispatched since",
                     [target(f"min by (exported_instance) ({D}decode_free_kv_blocks{{{WORKER}}})",
                             "{{exported_instance}}")]), 8, 8)
    L.add(timeseries("Instance health", "1 while an instance is in the candidate set",
                     [target(f"min by (role, exported_instance) ({D}instance_healthy{{{WORKER}}})",
                             "{{role}} {{exported_instance}}")], maximum=1, step=True), 8, 8)
    L.add(timeseries("Failed health checks / s", "Health checks by result other than ok: timeout_progressing "
                                                 "(slow /health while requests progress: not a failure), timeout, "
                                                 "refused, bad_status, unauthorized, bad_answer",
                     [target(rate(D + "health_checks_total", f'{WORKER}, result!="ok"', "exported_instance, result"),
                             "{{exported_instance}} {{result}}")], "ops"), 8, 8)
    L.add(timeseries("Broken connections, scrape failures, KV fallbacks / s",
                     "Connections to a worker that broke mid-request; failed /metrics scrapes; decode legs sent "
                     "without their KV (the decode worker recomputes the prompt)",
                     targets((rate(D + "broken_connections_total", WORKER, "exported_instance"),
                              "broken {{exported_instance}}"),
                             (rate(D + "scrape_failures_total", WORKER, "exported_instance, reason"),
                              "scrape {{exported_instance}} {{reason}}"),
                             (rate(D + "kv_fallbacks_total", "", "decode, reason"),
                              "KV fallback {{decode}} {{reason}}")), "ops"), 8, 8)

    # -- workers, scraped directly --------------------------------------------------------------
    L.row("Workers (their own /metrics)")
    L.add(timeseries("β (engine)", "The SlideBatching plugin's online correction factor β per worker",
                     [target(f"proserve:beta{{{INST}}}", "{{instance}} {{policy}}")], minimum=None), 8, 8)
    L.add(timeseries("Step offset δ", "The correction's per-step offset: a step is estimated at β·T_pd + δ",
                     [target(f"proserve:step_offset_seconds{{{INST}}}", "{{instance}}")], "s", minimum=None), 8, 8)
    L.add(timeseries("Latency budget", "Latency budget of the latest batch plan (Alg. 1 line 7)",
                     [target(f"proserve:t_budget_seconds{{{INST}}}", "{{instance}}")], "s"), 8, 8)
    L.add(timeseries("Step time: measured vs estimated", "Latest batch: measured time and β·T_pd (+ δ)",
                     targets((f"proserve:last_step_seconds{{{INST}}}", "{{instance}} measured"),
                             (f"proserve:last_step_estimate_seconds{{{INST}}}", "{{instance}} estimated")), "s"),
          8, 8)
    L.add(timeseries("Mean step time and scheduling overhead", "Mean measured step time, and the time spent in "
                                                               "schedule() (policy + vLLM) as a share of it",
                     targets((ratio(f"sum by (instance) (rate(proserve:step_seconds_total{{{INST}}}[{RATE}]))",
                                    f"sum by (instance) (rate(proserve:steps_total{{{INST}}}[{RATE}]))"),
                              "{{instance}} mean step (s)"),
                             (ratio(f"sum by (instance) (rate(proserve:schedule_seconds_total{{{INST}}}[{RATE}]))",
                                    f"sum by (instance) (rate(proserve:step_seconds_total{{{INST}}}[{RATE}]))"),
                              "{{instance}} schedule share"))), 8, 8)
    L.add(timeseries("URGENT / NORMAL requests", "Requests in the latest batch plan by SlideBatching's class",
                     targets((f"proserve:urgent_requests{{{INST}}}", "{{instance}} urgent"),
                             (f"proserve:normal_requests{{{INST}}}", "{{instance}} normal")), step=True), 8, 8)
    L.add(timeseries("vLLM requests running / waiting", "vLLM's scheduler state per worker",
                     targets((f"sum by (instance) (vllm:num_requests_running{{{INST}}})", "{{instance}} running"),
                             (f"sum by (instance) (vllm:num_requests_waiting{{{INST}}})", "{{instance}} waiting")),
                     step=True), 8, 8)
    L.add(timeseries("KV cache usage", "vLLM's used fraction of the KV cache per worker",
                     [target(f"max by (instance) (vllm:kv_cache_usage_perc{{{INST}}})", "{{instance}}")],
                     "percentunit", maximum=1), 8, 8)
    L.add(timeseries("KV transfer bytes / s", "KV payload bytes sent by prefill workers and received (checked and "
                                              "injected) by decode workers",
                     targets((f"sum by (instance) (rate(proserve:kv_sent_bytes_total{{{INST}}}[{RATE}]))",
                              "{{instance}} sent"),
                             (f"sum by (instance) (rate(proserve:kv_received_bytes_total{{{INST}}}[{RATE}]))",
                              "{{instance}} received")), "Bps"), 8, 8)
    L.add(timeseries("KV transfers and failures / s", "Transfers received; sends failed by destination and "
                                                      "reason; loads failed by reason (the prompt was recomputed)",
                     targets((f"sum by (instance) (rate(proserve:kv_received_transfers_total{{{INST}}}[{RATE}]))",
                              "{{instance}} received"),
                             (rate("proserve:kv_send_failures_total", INST, "instance, dest, reason"),
                              "{{instance}} send failed → {{dest}} ({{reason}})"),
                             (f"sum by (instance, reason) (rate(proserve:kv_load_failures_total{{{INST}}}[{RATE}]))",
                              "{{instance}} load failed ({{reason}})")), "ops"), 8, 8)
    L.add(timeseries("KV destinations up", "1 while a prefill worker's circuit breaker to a decode worker's KV "
                                           "address is closed",
                     [target(f"min by (instance, dest) (proserve:kv_destination_up{{{INST}}})",
                             "{{instance}} → {{dest}}")], maximum=1, step=True), 8, 8)

    def query_var(name: str, label: str, query: str, regex: str = "") -> dict:
        return {"type": "query", "name": name, "label": label, "datasource": DS,
                "definition": query, "query": {"query": query, "refId": f"{name}-var"},
                "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "regex": regex}

    templating = [
        {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus",
         "current": {}, "hide": 0, "options": [], "refresh": 1, "regex": ""},
        # class "-": requests refused before their class was known (they still count in the outcome panels)
        query_var("priority", "Priority class", f"label_values({D}requests_total, priority)", "/^(?!-$).+/"),
        query_var("worker", "Worker (dispatcher's view)", f"label_values({D}instance_healthy, exported_instance)"),
        query_var("instance", "Worker target", "label_values(vllm:num_requests_running, instance)"),
    ]
    return {
        "title": "ProServe",
        "uid": "proserve-cluster",
        "description": "ProServe dispatcher and workers: per-class TDG and SLO attainment, TTFT/TPOT, admission, "
                       "GoRouting, queues, β, KV. Source: deploy/grafana/make_dashboard.py",
        "tags": ["proserve", "vllm", "llm-serving"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [],
        "panels": L.panels,
        "templating": {"list": templating},
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the JSON differs from this script's output")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python {Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out} ({len(json.loads(text)['panels'])} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
