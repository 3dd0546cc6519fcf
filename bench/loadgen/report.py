"""The report: the run's table (:func:`format_summary`), ``requests.jsonl`` and
``summary.json`` (:func:`write_outputs`), re-scoring a run from its records
(:func:`load_records`, :func:`report_from_records`), the PNG plots
(:func:`write_plots`) and the progress display (:class:`Progress`)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from proserve.scheduler.request import ConfigError, Request
from proserve.scheduler.tdg import GainConfig

from .client import Run
from .scoring import STALL_S, Result, result_records, summarize_run
from .workload import workload_gain

# --- report: table, records, plots ------------------------------------------------------

#: the table's columns: header, summary key, format (times in seconds)
TABLE_COLUMNS = [("class", None, "{}"), ("reqs", "requests", "{:d}"), ("errors", "errors", "{:d}"),
                 ("TDG_Ratio", "tdg_ratio", "{:.3f}"), ("SLO_att", "slo_attainment", "{:.3f}"),
                 ("TTFT_p50", "ttft_p50", "{:.3f}"), ("TTFT_p90", "ttft_p90", "{:.3f}"),
                 ("TTFT_p99", "ttft_p99", "{:.3f}"), ("TPOT_p50", "tpot_p50", "{:.4f}"),
                 ("TPOT_p90", "tpot_p90", "{:.4f}"), ("TPOT_p99", "tpot_p99", "{:.4f}"),
                 ("req/s", "throughput_req_s", "{:.2f}"), ("out_tok/s", "throughput_tokens_s", "{:.0f}")]


def format_summary(summary: dict) -> str:
    """The run's table: rows ``all`` and each class, then client health and errors."""
    cols = TABLE_COLUMNS
    rows = [[c[0] for c in cols]]
    for name, m in summary["metrics"].items():
        row = [name]
        for _, key, fmt in cols[1:]:
            v = m.get(key)
            row.append("-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("TTFT/TPOT in seconds; req/s = finished requests, out_tok/s = output tokens, "
                 "per second from the first arrival to the last token")
    n_un = summary["metrics"].get("all", {}).get("unstreamed", 0)
    if n_un:
        lines.append(f"unstreamed: {n_un} of {summary['metrics']['all']['requests']} requests "
                     f"(all tokens at the response time: TTFT = whole response, TPOT = 0)")
    lag = summary["send_lag_s"]
    st = summary.get("client_stalls")
    health = f"send lag p50 {_ms(lag['p50'])} p99 {_ms(lag['p99'])} max {_ms(lag['max'])}; "
    if st is not None:
        health += (f"client event-loop stalls > {_ms(st.get('over_s', STALL_S))}: {st.get('count', 0)} "
                   f"(max {_ms(st.get('max_s', 0.0))}); ")
    lines.append(health + f"malformed SSE chunks: {summary['malformed_chunks']}")
    for name, e in summary["errors"].items():
        if name != "all" and e["errors"]:
            lines.append(f"errors[{name}]: " + "; ".join(f"{n}× {k}" for k, n in e["by_error"].items()))
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def clean_json(x):
    """JSON has no NaN/inf: null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    return x


def write_outputs(out_dir: str | Path, reqs: Sequence[Request], run: Run, gain: GainConfig,
                  summary: dict, meta: dict | None = None, links: Sequence | None = None) -> list[dict]:
    """``requests.jsonl`` and ``summary.json`` in ``out_dir``; returns the records written.
    With ``links`` (a multi-turn run) each record also names its ``conversation`` and ``turn``."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    records = [clean_json(rec) for rec in result_records(reqs, run.results, gain)]
    for rec, link in zip(records, links or ()):
        if link is not None:
            rec["conversation"], rec["turn"] = link.conversation, link.turn
    with open(d / "requests.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    doc = dict(meta or {})
    doc.update({"t0_unix": run.t0_unix, "wall_s": run.wall_s, **summary})
    (d / "summary.json").write_text(json.dumps(clean_json(doc), indent=1) + "\n")
    return records


_REQUEST_FIELDS = ("id", "priority", "weight", "ttft_slo", "tpot_slo", "prompt_len", "output_len", "arrival")
_RESULT_FIELDS = tuple(f for f in Result.__dataclass_fields__)


def load_records(path: str | Path) -> tuple[list[Request], list[Result], list[dict]]:
    """Read a run's ``requests.jsonl`` (or the directory holding it): the workload
    requests, their results and the raw records, in file order."""
    p = Path(path)
    if p.is_dir():
        p = p / "requests.jsonl"
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    reqs, results, records = [], [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{n}: not valid JSON: {e.msg}") from None
        missing = [k for k in _REQUEST_FIELDS + ("expected_tokens", "token_times") if k not in rec] \
            if isinstance(rec, dict) else ["(not an object)"]
        if missing:
            raise ConfigError(f"{p}:{n}: not a load generator record (missing {', '.join(missing)})")
        reqs.append(Request(**{k: rec[k] for k in _REQUEST_FIELDS}))
        results.append(Result(**{k: rec[k] for k in _RESULT_FIELDS if k in rec}))
        records.append(rec)
    if not reqs:
        raise ConfigError(f"{p}: no records")
    return reqs, results, records


def report_from_records(path: str | Path, gain: GainConfig | None = None) -> dict:
    """The run's summary recomputed from ``requests.jsonl`` alone (JSON-clean, as in
    ``summary.json``): ``metrics``, ``errors``, ``gain``, ``send_lag_s``,
    ``malformed_chunks``. ``gain``: default the CLI's (w_p = mean prompt / mean
    output of the records, w_d = 1); pass ``GainConfig(**summary["gain"])`` for a
    run with ``--w-p``/``--w-d``. The client's event-loop stalls are not in the
    records, so ``client_stalls`` is left out. On a run's own output every value
    equals ``summary.json``'s.
    """
    reqs, results, _ = load_records(path)
    summary = summarize_run(reqs, results, gain or workload_gain(reqs))
    summary.pop("client_stalls")
    return clean_json(summary)


def have_matplotlib() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


PLOT_FILES = ("ttft_cdf.png", "tpot_cdf.png", "classes.png")


def write_plots(out_dir: str | Path, records: Sequence[Mapping], summary: Mapping) -> list[Path]:
    """PNG plots of one run in ``out_dir`` (see :data:`PLOT_FILES`): TTFT and TPOT
    CDFs per class (the same requests the percentiles use; dotted lines: the
    class SLOs) and TDG_Ratio / SLO attainment per class. Needs matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'proserve[plot]' (or pass --no-plots)") from None
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    classes = sorted({r["priority"] for r in records})
    colors = {c: f"C{i}" for i, c in enumerate(classes)}
    out = []
    # summarize()'s sets: TTFT of every request with a token, TPOT of finished ones with > 1 token
    series = {
        "ttft": ("TTFT (s)", "ttft_slo", lambda r: r.get("ttft") is not None),
        "tpot": ("TPOT (s; unstreamed requests: 0)", "tpot_slo",
                 lambda r: r.get("error") is None and (r.get("tokens") or 0) > 1 and r.get("tpot") is not None),
    }
    for key, (label, slo_key, keep) in series.items():
        fig = Figure(figsize=(6, 4))
        ax = fig.add_subplot()
        for c in classes:
            v = np.sort([r[key] for r in records if r["priority"] == c and keep(r)])
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", color=colors[c],
                        label=f"{c} (n={len(v)})")
            for slo in sorted({r[slo_key] for r in records if r["priority"] == c}):
                ax.axvline(slo, color=colors[c], linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if classes:
            ax.legend(loc="lower right")
        ax.set_title(f"{key.upper()} CDF per class (dotted: SLO)")
        fig.tight_layout()
        path = d / f"{key}_cdf.png"
        fig.savefig(path, dpi=100)
        out.append(path)
    names = list(summary["metrics"])
    fig = Figure(figsize=(7, 3.5))
    for i, (mkey, title) in enumerate((("tdg_ratio", "TDG_Ratio"), ("slo_attainment", "SLO attainment"))):
        ax = fig.add_subplot(1, 2, i + 1)
        vals = [summary["metrics"][n].get(mkey) for n in names]
        vals = [v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0 for v in vals]
        bars = ax.bar(names, vals, color=["0.5" if n == "all" else colors.get(n, "C9") for n in names])
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.1)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = d / "classes.png"
    fig.savefig(path, dpi=100)
    out.append(path)
    return out


class Progress:
    """Progress of a run (``replay(progress=...)``): a tqdm bar on stderr when tqdm
    imports (``use_tqdm=None``), else a one-line ``done/total`` count rewritten at
    most every ``interval`` seconds. Call :meth:`close` at the end."""

    def __init__(self, total: int, use_tqdm: bool | None = None, file=None, interval: float = 0.5):
        self.total, self.file, self.interval = total, file or sys.stderr, interval
        self.errors, self.done, self._last = 0, 0, -math.inf
        self._t0 = time.monotonic()
        self.bar = None
        if use_tqdm is not False:
            try:
                from tqdm import tqdm
            except ImportError:
                if use_tqdm:
                    raise
            else:
                self.bar = tqdm(total=total, unit="req", desc="requests", file=self.file, dynamic_ncols=True,
                                smoothing=0.1, mininterval=0.2)
                self.bar.set_postfix(errors=0, refresh=False)

    def __call__(self, done: int, total: int, res: Result) -> None:
        self.done = done
        if not res.ok:
            self.errors += 1
        if self.bar is not None:
            if not res.ok:
                self.bar.set_postfix(errors=self.errors, refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        if done == total or now - self._last >= self.interval:
            self._last = now
            print(f"\r{done}/{total} requests done, {self.errors} errors, {now - self._t0:.0f} s",
                  end="", file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.done:
            print(file=self.file, flush=True)
