"""Results of simulator runs: per-request records, metrics, text tables, PNG plots."""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from proserve.scheduler.request import Request
from proserve.scheduler.tdg import ClassMetrics, ClassSums, GainConfig, request_latencies, slo_attained, summarize


def request_records(reqs: Iterable[Request], gain: GainConfig) -> list[dict]:
    out = []
    for r in reqs:
        out.append({
            "id": r.id, "priority": r.priority, "weight": r.weight,
            "arrival": r.arrival, "prompt_len": r.prompt_len, "output_len": r.output_len,
            "ttft_slo": r.ttft_slo, "tpot_slo": r.tpot_slo, "instance": r.instance,
            "tokens": r.num_emitted, "ttft": r.ttft, "tpot": r.tpot,
            "finish": r.token_times[-1] if r.token_times else None,
            "tdg": gain.tdg(r), "ideal_gain": gain.ideal_gain(r), "slo_met": slo_attained(r),
            "error": r.error,
        })
    return out


def metrics_dict(reqs: Sequence[Request], gain: GainConfig, duration: float | None = None) -> dict:
    return {k: v.as_dict() for k, v in summarize(reqs, gain, duration).items()}


class MetricsAccumulator:
    """:func:`proserve.scheduler.tdg.summarize` over a stream: each request is added once, when
    it ends, and can then be dropped — the memory-light path of long simulations
    (``proserve.sim.stream``), where millions of requests' token timelines would not fit.

    The sums are ``ClassSums``, the ones ``summarize`` adds up, per class and overall;
    the request's TTFT and TPOT (8 bytes each, for the percentiles) are kept in its
    class only: memory grows by about 16 bytes per request, whatever its number of
    tokens. :meth:`result` gives the ``ClassMetrics`` that ``summarize`` would give for
    the same requests (equal up to float summation order; tests/test_sim_stream.py).
    """

    def __init__(self, gain: GainConfig):
        self.gain = gain
        self.sums: dict[str, ClassSums] = {"all": ClassSums()}
        self.ttfts: dict[str, array] = {}
        self.tpots: dict[str, array] = {}

    def add(self, r: Request) -> None:
        terms = ClassSums.terms(r, self.gain)
        cls = self.sums.get(r.priority)
        if cls is None:
            cls = self.sums[r.priority] = ClassSums()
            self.ttfts[r.priority], self.tpots[r.priority] = array("d"), array("d")
        self.sums["all"].add(r, terms)
        cls.add(r, terms)
        ttft, tpot = request_latencies(r)
        if ttft is not None:
            self.ttfts[r.priority].append(ttft)   # "all" takes the union of the classes' values in result()
        if tpot is not None:
            self.tpots[r.priority].append(tpot)

    @property
    def count(self) -> int:
        return self.sums["all"].requests

    def result(self, duration: float) -> dict[str, ClassMetrics]:
        """``"all"`` then each class by name, as :func:`summarize` orders them."""
        classes = sorted(k for k in self.sums if k != "all")

        def values(per_class: dict[str, array], names: list[str]) -> np.ndarray:
            return np.concatenate([np.frombuffer(per_class[c]) for c in names] or [np.empty(0)])

        out = {"all": self.sums["all"].metrics("all", values(self.ttfts, classes), values(self.tpots, classes),
                                                duration)}
        for name in classes:
            out[name] = self.sums[name].metrics(name, values(self.ttfts, [name]), values(self.tpots, [name]),
                                                duration)
        return out


def _clean(x):
    """JSON has no NaN/inf: write null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def write_json(path: str | Path, obj) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(obj), indent=1, sort_keys=False) + "\n")


# -- tables ------------------------------------------------------------------------
ROW_FIELDS = [
    ("TDG", "tdg_ratio", "{:.3f}"), ("TDG_hi", "tdg_ratio@high", "{:.3f}"), ("TDG_lo", "tdg_ratio@low", "{:.3f}"),
    ("SLO", "slo_attainment", "{:.3f}"), ("SLO_hi", "slo_attainment@high", "{:.3f}"),
    ("SLO_lo", "slo_attainment@low", "{:.3f}"), ("TTFT_p50", "ttft_p50", "{:.2f}"),
    ("TTFT_p99", "ttft_p99", "{:.2f}"), ("TPOT_p50", "tpot_p50", "{:.3f}"), ("TPOT_p99", "tpot_p99", "{:.3f}"),
    ("tok/s", "throughput_tokens_s", "{:.0f}"),
]


def lookup(metrics: dict, key: str) -> float:
    name, _, cls = key.partition("@")
    m = metrics.get(cls or "all")
    return float("nan") if m is None or m.get(name) is None else float(m[name])


def format_table(rows: Sequence[dict], fields=ROW_FIELDS, keys=("policy", "rate")) -> str:
    """``rows``: dicts with the ``keys`` columns and a ``metrics`` dict (summarize output)."""
    head = [k for k in keys] + [f[0] for f in fields]
    body = []
    for row in rows:
        cells = [str(row[k]) for k in keys]
        for _, key, fmt in fields:
            v = lookup(row["metrics"], key)
            cells.append("-" if math.isnan(v) else fmt.format(v))
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) if i >= len(keys) else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(c.rjust(w) if i >= len(keys) else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))))
    return "\n".join(lines)


# -- admission control ---------------------------------------------------------------
def add_admission(metrics: dict, admission: dict) -> None:
    """Per class the requests came in, how many were refused (``rejected``, the
    dispatcher's 429s) and served in a lower class (``downgraded``), into ``metrics``
    (a :func:`metrics_dict`); ``all`` gets the sums. A refused request keeps the class it
    came in, so it is also one of that class's ``requests``, with zero gain and its SLO
    missed; a downgraded one is scored in the class it came in too (the simulator gives it
    back its class when it ends), as the load generator scores both."""
    tot = {"rejected": 0, "downgraded": 0}
    for cls, c in admission.items():
        m = metrics.get(cls)
        if m is not None:
            m["rejected"], m["downgraded"] = c["reject"], c["downgrade"]
        tot["rejected"] += c["reject"]
        tot["downgraded"] += c["downgrade"]
    if "all" in metrics:
        metrics["all"].update(tot)


def admission_fields(admission: dict) -> list[tuple[str, str, str]]:
    """Table columns for :func:`format_table`: refused requests per class (``rej_<class>``)."""
    return [(f"rej_{cls}", f"rejected@{cls}", "{:.0f}") for cls in sorted(admission)]


def format_admission(admission: dict) -> str:
    """One row per class the requests came in: each admission decision, and why refused."""
    reasons = sorted({k for c in admission.values() for k in c if k.startswith("reject:")})
    head = ["class", "admit", "queue", "downgrade", "reject"] + [r.split(":", 1)[1] for r in reasons]
    rows = [[cls] + [str(c.get(k, 0)) for k in ("admit", "queue", "downgrade", "reject", *reasons)]
            for cls, c in sorted(admission.items())]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths))),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
              for r in rows]
    return "\n".join(lines)


# -- plots -------------------------------------------------------------------------
def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise RuntimeError("plots need matplotlib: pip install 'proserve[plot]'") from e
    return plt


def _save(plt, fig, path) -> None:
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: Sequence[dict], path: str | Path, series_key: str = "policy",
               metrics=("tdg_ratio", "slo_attainment", "tdg_ratio@high", "tdg_ratio@low"),
               title: str = "") -> None:
    """Metric vs request rate, one line per ``series_key`` value (mean over seeds)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), squeeze=False)
    series = sorted({r[series_key] for r in rows}, key=lambda s: [r[series_key] for r in rows].index(s))
    colors = plt.get_cmap("tab20").colors
    markers = "os^vD<>pPX*h"
    for ax, metric in zip(axes[0], metrics):
        for i, s in enumerate(series):
            pts = {}
            for r in rows:
                if r[series_key] == s:
                    pts.setdefault(r["rate"], []).append(lookup(r["metrics"], metric))
            xs = sorted(pts)
            first = i == 0  # the policy under study is listed first: draw it bold
            ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker=markers[i % len(markers)],
                    ms=4 if first else 3, lw=2.4 if first else 1.1, zorder=3 if first else 2,
                    color="black" if first else colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20], label=s)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(metric.replace("@", " "))
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    _save(plt, fig, path)


def plot_timeline(points, path: str | Path, bin_s: float = 1.0, title: str = "") -> None:
    """URGENT and NORMAL request counts over time (the paper's Figure 17), averaged per bin."""
    plt = _pyplot()
    bins: dict[int, list] = {}
    for p in points:
        bins.setdefault(int(p.t // bin_s), []).append(p)
    xs = sorted(bins)
    urgent = [sum(p.n_urgent for p in bins[x]) / len(bins[x]) for x in xs]
    normal = [sum(p.n_normal for p in bins[x]) / len(bins[x]) for x in xs]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    t = [x * bin_s for x in xs]
    ax.plot(t, urgent, label="URGENT", color="tab:red")
    ax.plot(t, normal, label="NORMAL", color="tab:blue")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests in queue")
    ax.legend()
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    _save(plt, fig, path)
