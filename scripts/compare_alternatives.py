#!/usr/bin/env python3
"""Simulator comparison of the alternative schedulers against SlideBatching and
the baselines, on TDG and on each alternative paper's own metric.

Runs the simulator on the bundled Azure 2023 conversation trace, in two
deployments, for every seed:

* **co-located**, one instance (round-robin routing, i.e. none), every local
  policy in ``COLOCATED_LOCALS`` at every rate in ``--colocated-rates``;
* **disaggregated**, ``--prefill-instances`` + ``--decode-instances``
  (default 4 + 8, as docs/results.md §2), the (local, global) pairs of
  ``DISAGG_COMBOS`` at every rate in ``--disagg-rates``.

Every run is scored on (overall and per priority class):

* PROSERVE's TDG_Ratio (the headline; first-token TDG too), SLO attainment
  (TTFT and mean TPOT strictly below the SLOs), P99 TTFT and TPOT,
  throughput (``proserve.scheduler.tdg.summarize``);
* JITServe's token goodput ratio (tokens on their TTFT + (i-1)·TPOT timeline
  over tokens to produce) and request goodput ratio
  (``proserve.scheduler.alternatives.jitserve.metrics``);
* SLOs-Serve's per-request attainment, on its §3.2 deadline line (the
  default) and on its §6 10-token windows (``proserve.scheduler.alternatives.slos_serve.metrics``),
  and, over the rates of a sweep, its serving capacity: the rate at which
  attainment crosses 90 % (per seed, then mean ± sd);
* UniBoost's P99 TTLT, i.e. last token minus arrival, over completed requests
  (``proserve.scheduler.alternatives.uniboost.metrics``; unfinished requests are counted).

Writes ``<deployment>.json`` (every run, the seed means, the capacities, the
configuration and the wall time), ``<deployment>.md`` (tables) and
``<deployment>.png`` (one panel per metric vs rate, one line per policy) under
``--out`` (default ``docs/results/alternatives``), and ``README.md`` there
with the command and the runtime. Runs fan out over ``--jobs`` processes, as
``python -m proserve.sim sweep`` does.

Beside the defaults it runs the papers' own variants (``COLOCATED_VARIANTS``:
JITServe ranking by plain-token goodput, UniBoost without γ-Ada or MemGuard)
and, disaggregated, every local policy also under round-robin, so that a
router's share can be told from its local policy's.

    python scripts/compare_alternatives.py                 # the full comparison, 15-18 min on 2 cores
    python scripts/compare_alternatives.py --summary       # docs/results.md §5's tables from the JSON
    python scripts/compare_alternatives.py --replot        # redraw the PNGs from the JSON
    python scripts/compare_alternatives.py --quick --out out/alt   # 1 seed, fewer requests, 1-2 min
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from proserve.scheduler.alternatives.jitserve import metrics as jitserve  # noqa: E402
from proserve.scheduler.alternatives.slos_serve import metrics as slos_serve  # noqa: E402
from proserve.scheduler.alternatives.uniboost import metrics as uniboost  # noqa: E402
from proserve.sim.__main__ import RunSpec, _gain, _load_model, _workload  # noqa: E402
from proserve.sim.cluster import SimConfig, Simulator  # noqa: E402
from proserve.sim.report import _clean, lookup, metrics_dict  # noqa: E402

# SlideBatching first (drawn bold), then the three alternatives, then the baselines.
COLOCATED_LOCALS = (
    "slide_batching", "jitserve_gmax", "slos_serve", "uniboost",
    "sarathi_fcfs", "sarathi_priority", "vllm_fcfs", "weighted_vtc",
    "fairbatching", "edf", "sjf", "only_deadline", "only_density", "wo_latency_aware",
)
# Disaggregated: each policy with its own router where its paper has one; UniBoost has none.
# The same local policies under round-robin too, to tell the router's share from the local policy's.
DISAGG_COMBOS = (
    ("slide_batching", "go_routing"),
    ("jitserve_gmax", "jitserve_power_of_k"),
    ("slos_serve", "slos_serve_routing"),
    ("uniboost", "round_robin"),
    ("sarathi_fcfs", "min_load"),
    ("sarathi_fcfs", "round_robin"),
    ("slide_batching", "round_robin"),
    ("jitserve_gmax", "round_robin"),
    ("slos_serve", "round_robin"),
)
# The papers' own variants and ablations of their policies, reported beside the defaults (tables
# and JSON; not drawn): JITServe's goodput counted in plain tokens, its own metric (the default
# counts TDG weights); UniBoost without γ-Ada (its Phase-3, §4.3) and without MemGuard (Phase-2).
COLOCATED_VARIANTS = (
    ("jitserve_gmax", {"goodput": "tokens"}),
    ("uniboost", {"adaptive": False}),
    ("uniboost", {"memguard": False}),
)
NEW_LOCALS = ("jitserve_gmax", "slos_serve", "uniboost")
TARGET = 0.9          # SLOs-Serve: capacity at 90 % attainment

# (column, metric key, format) — metric keys are "name" (overall) or "name@class"
COLUMNS = [
    ("TDG", "tdg_ratio", "{:.3f}"),
    ("TDG1", "first_token_tdg_ratio", "{:.3f}"),
    ("SLO", "slo_attainment", "{:.3f}"),
    ("SLO_hi", "slo_attainment@high", "{:.3f}"),
    ("SLO_lo", "slo_attainment@low", "{:.3f}"),
    ("TTFT_p99 s", "ttft_p99", "{:.2f}"),
    ("TTLT_p99 s [UniBoost]", "ttlt_p99", "{:.1f}"),
    ("tok goodput [JITServe]", "token_goodput_ratio", "{:.3f}"),
    ("attain [SLOs-Serve]", "slos_attainment", "{:.3f}"),
    ("tok/s", "throughput_tokens_s", "{:.0f}"),
]
# plot panels: (metric key, y label, log scale)
PANELS = [
    ("tdg_ratio", "TDG_Ratio", False),
    ("slo_attainment", "SLO attainment (all)", False),
    ("slo_attainment@high", "SLO attainment (high)", False),
    ("slo_attainment@low", "SLO attainment (low)", False),
    ("ttft_p99", "P99 TTFT (s)", True),
    ("ttlt_p99", "P99 TTLT (s) [UniBoost]", True),
    ("token_goodput_ratio", "token goodput ratio [JITServe]", False),
    ("slos_attainment", "SLO attainment [SLOs-Serve]", False),
]


# -- one run ------------------------------------------------------------------------------
def paper_metrics(reqs, duration: float) -> dict[str, dict]:
    """The three alternative papers' metrics of one run, overall (``all``) and per class."""
    jit = jitserve.token_goodput(reqs, duration)
    line = slos_serve.attainment_by_class(reqs, mode="line")
    window = slos_serve.attainment_by_class(reqs, mode="window", window=10)
    ttlt = uniboost.ttlt_stats(reqs)
    out = {}
    for cls in jit:
        t = ttlt[cls]
        out[cls] = {
            "token_goodput_ratio": jit[cls]["token_goodput_ratio"],
            "token_goodput_per_s": jit[cls]["token_goodput_per_s"],
            "request_goodput_ratio": jit[cls]["request_goodput_ratio"],
            "slos_attainment": line[cls],
            "slos_attainment_window": window[cls],
            "ttlt_mean": t.mean, "ttlt_p50": t.p50, "ttlt_p95": t.p95, "ttlt_p99": t.p99,
            "ttlt_unfinished": t.unfinished,
        }
    return out


def run_one(spec: RunSpec) -> dict:
    """Simulate one spec; PROSERVE's metrics and the three papers' metrics, per class."""
    model = _load_model(spec.latency_model)
    reqs = _workload(spec)
    gain = _gain(spec, reqs)
    t0 = time.perf_counter()
    sim = Simulator(model, spec.sim, gain, spec.classes)
    res = sim.run(reqs)
    wall = time.perf_counter() - t0
    metrics = metrics_dict(res.requests, gain, res.duration)
    for cls, extra in paper_metrics(res.requests, res.duration).items():
        metrics.setdefault(cls, {}).update(extra)
    return {
        "deployment": spec.sim.deployment, "policy": spec.sim.local_policy, "global": spec.sim.global_policy,
        "local_params": dict(spec.sim.local_params),
        "series": series_name(spec.sim.deployment, spec.sim.local_policy, spec.sim.global_policy,
                              spec.sim.local_params),
        "rate": spec.rate, "seed": spec.seed, "requests": len(reqs), "wall_s": wall,
        "duration_s": res.duration, "sim_steps": res.steps,
        "errors": sum(1 for r in res.requests if r.error is not None),
        "diagnostics": diagnostics(sim, res.requests),
        "metrics": metrics,
    }


def diagnostics(sim: Simulator, reqs) -> dict:
    """What the policies did, for reading the tables: requests per front (prefill or
    co-located) instance, and per instance the state a policy exposes (UniBoost's final γ,
    GMAX's preemptions and refused displacements)."""
    counts = [0] * len(sim.front)
    for r in reqs:
        if r.instance is not None:
            counts[r.instance] += 1
    out = {"requests_per_instance": counts}
    pols = [i.policy for i in sim.front]
    if all(hasattr(p, "gamma") for p in pols):
        out["final_gamma"] = [p.gamma for p in pols]
    if all(hasattr(p, "preemptions") for p in pols):
        out["gmax_preemptions"] = [p.preemptions for p in pols]
        out["gmax_kept"] = [p.kept for p in pols]
    return out


def series_name(deployment: str, local: str, glob: str, params: dict | None = None) -> str:
    """``local`` (co-located) or ``local+global``; local parameters in brackets."""
    name = local if deployment == "colocated" else f"{local}+{glob}"
    if params:
        name += "[" + ",".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in params.items()) + "]"
    return name


def make_specs(deployment: str, combos: Sequence[tuple], rates: Sequence[float],
               seeds: Sequence[int], num_requests: int, prefill: int = 4, decode: int = 8) -> list[RunSpec]:
    """One spec per (combo, rate, seed); a combo is ``(local, global)`` or ``(local, global, params)``."""
    specs = []
    for combo in combos:
        local, glob = combo[0], combo[1]
        params = dict(combo[2]) if len(combo) > 2 else {}
        for rate in rates:
            for seed in seeds:
                sim = SimConfig(deployment=deployment, instances=1, prefill_instances=prefill,
                                decode_instances=decode, local_policy=local, local_params=params,
                                global_policy=glob, seed=seed)
                specs.append(RunSpec(trace="azure", rate=float(rate), num_requests=num_requests, seed=seed, sim=sim))
    return specs


def run_all(specs: list[RunSpec], jobs: int) -> list[dict]:
    """Every spec, in order, over ``jobs`` processes (progress on stderr)."""
    out = []
    if jobs <= 1:
        for i, sp in enumerate(specs):
            out.append(run_one(sp))
            print(f"\r[{i + 1}/{len(specs)}]", end="", file=sys.stderr, flush=True)
    else:
        with ProcessPoolExecutor(jobs) as ex:
            for i, r in enumerate(ex.map(run_one, specs)):
                out.append(r)
                print(f"\r[{i + 1}/{len(specs)}]", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return out


# -- aggregation -----------------------------------------------------------------------------
def _mean_sd(vals: list) -> tuple[float, float]:
    """Mean and sample sd of the values that are neither None nor NaN."""
    vals = [float(v) for v in vals if v is not None]
    vals = [v for v in vals if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """Mean and standard deviation over seeds of every numeric metric, per (series, rate),
    in the order the series and rates first appear."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["series"], r["rate"]), []).append(r)
    rows = []
    for (series, rate), rs in groups.items():
        mean, sd = {}, {}
        for cls in rs[0]["metrics"]:
            mean[cls], sd[cls] = {}, {}
            for k, v in rs[0]["metrics"][cls].items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) or v is None:
                    mean[cls][k], sd[cls][k] = _mean_sd([x["metrics"].get(cls, {}).get(k) for x in rs])
        rows.append({"series": series, "policy": rs[0]["policy"], "global": rs[0]["global"],
                     "local_params": rs[0].get("local_params", {}), "rate": rate,
                     "seeds": sorted(x["seed"] for x in rs), "errors": sum(x["errors"] for x in rs),
                     "metrics": mean, "sd": sd})
    return rows


def capacity_table(runs: Sequence[dict], key: str = "slos_attainment", target: float = TARGET,
                   num_gpus: int = 1) -> list[dict]:
    """SLOs-Serve serving capacity per series: for each seed, the rate where ``key``
    (overall) crosses ``target`` over that seed's sweep (``slos_serve.capacity``,
    interpolated); then mean ± sd over seeds. ``bound`` is ``">="`` when some seed
    met the target at every rate swept (its capacity is a lower bound), ``"<"`` when
    some seed missed it at the lowest rate (capacity 0)."""
    by: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for r in runs:
        by.setdefault(r["series"], {}).setdefault(r["seed"], []).append((r["rate"], lookup(r["metrics"], key)))
    out = []
    for series, seeds in by.items():
        caps, all_met, none_met = [], 0, 0
        for seed in sorted(seeds):
            pts = sorted((x, a) for x, a in seeds[seed] if not math.isnan(a))
            caps.append(slos_serve.capacity(pts, target=target, num_gpus=1))
            all_met += all(a >= target for _, a in pts)
            none_met += pts[0][1] < target
        mean, sd = _mean_sd(caps)
        bound = ">=" if all_met else "<" if none_met == len(caps) else ""
        out.append({"series": series, "metric": key, "target": target, "capacity": mean, "sd": sd,
                    "per_gpu": mean / num_gpus, "num_gpus": num_gpus, "per_seed": caps, "bound": bound,
                    "seeds_all_met": all_met, "seeds_none_met": none_met,
                    "lowest_rate": min(x for pts in seeds.values() for x, _ in pts)})
    return out


def write_compact_json(path: Path, obj) -> None:
    """Compact, one line per run (``runs`` is the bulk of the file); NaN/inf as null.
    (Values keep full precision, so that the tables ``--summary`` prints from the JSON
    round exactly as the sweep's own.)"""
    obj = _clean(obj)
    runs = obj.pop("runs", [])
    body = json.dumps(obj, separators=(",", ":"))[:-1]
    lines = [body + ',"runs":['] + [json.dumps(r, separators=(",", ":")) + "," for r in runs]
    if runs:
        lines[-1] = lines[-1][:-1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "]}\n")


# -- tables ---------------------------------------------------------------------------------
def _cell(row: dict, key: str, fmt: str, with_sd: bool = False) -> str:
    v = lookup(row["metrics"], key)
    if math.isnan(v):
        return "-"
    s = fmt.format(v)
    if with_sd:
        d = lookup(row["sd"], key)
        if not math.isnan(d):
            s += " ± " + fmt.format(d)
    return s


def long_table(rows: Sequence[dict], columns=COLUMNS) -> str:
    """Markdown: one line per (policy, rate), every column of ``columns`` (TDG with ± sd)."""
    head = "| policy | rate | " + " | ".join(c[0] for c in columns) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(columns)]
    for r in rows:
        cells = [_cell(r, key, fmt, with_sd=(key == "tdg_ratio")) for _, key, fmt in columns]
        unfinished = lookup(r["metrics"], "ttlt_unfinished")
        if unfinished and not math.isnan(unfinished):
            cells[[c[1] for c in columns].index("ttlt_p99")] += f" ({unfinished:.0f} unfinished)"
        lines.append(f"| {r['series']} | {r['rate']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pivot_table(rows: Sequence[dict], key: str, fmt: str, with_sd: bool = False,
                caps: Sequence[dict] | None = None) -> str:
    """Markdown: policies × rates for one metric (optionally a capacity column)."""
    rates = sorted({r["rate"] for r in rows})
    series = list(dict.fromkeys(r["series"] for r in rows))
    cell = {(r["series"], r["rate"]): _cell(r, key, fmt, with_sd) for r in rows}
    cap = {c["series"]: c for c in caps or ()}
    head = "| policy | " + " | ".join(f"{x:g} req/s" for x in rates) + " |"
    sep = "|---|" + "---:|" * len(rates)
    if caps is not None:
        head += " capacity @ 90 % (req/s) |"
        sep += "---:|"
    lines = [head, sep]
    for s in series:
        line = f"| {s} | " + " | ".join(cell.get((s, x), "-") for x in rates) + " |"
        if caps is not None:
            line += f" {format_capacity(cap[s])} |" if s in cap else " - |"
        lines.append(line)
    return "\n".join(lines)


def format_capacity(c: dict) -> str:
    """``2.81 ± 0.05``; ``≥ 6`` when a seed met the target at every rate (a lower
    bound); ``< 2`` when every seed missed it at the lowest rate; per GPU if > 1."""
    if c["bound"] == "<":
        return f"< {c['lowest_rate']:g}"
    s = ("≥ " if c["bound"] == ">=" else "") + f"{c['capacity']:.2f}"
    if c["sd"] and not math.isnan(c["sd"]):
        s += f" ± {c['sd']:.2f}"
    if c["num_gpus"] > 1:
        s += f" ({c['per_gpu']:.2f}/GPU)"
    return s


def markdown(deployment: str, rows: Sequence[dict], caps: dict[str, list[dict]], header: str) -> str:
    first_token = deployment == "disaggregated"
    parts = [header, ""]
    parts += ["### TDG_Ratio (mean ± sd over seeds)" + (" — overall; first-token TDG below" if first_token else ""),
              "", pivot_table(rows, "tdg_ratio", "{:.3f}", with_sd=True), ""]
    if first_token:
        parts += ["### First-token TDG_Ratio (PROSERVE §5.2's disaggregated headline)", "",
                  pivot_table(rows, "first_token_tdg_ratio", "{:.3f}"), ""]
    parts += ["### SLO attainment (PROSERVE: TTFT and mean TPOT strictly below the SLO), overall; "
              "capacity = rate at 90 %", "",
              pivot_table(rows, "slo_attainment", "{:.3f}", caps=caps["slo_attainment"]), "",
              "### SLO attainment, high class", "", pivot_table(rows, "slo_attainment@high", "{:.3f}"), "",
              "### SLO attainment, low class", "", pivot_table(rows, "slo_attainment@low", "{:.3f}"), "",
              "### P99 TTFT (s)", "", pivot_table(rows, "ttft_p99", "{:.2f}"), "",
              "### JITServe: token goodput ratio (tokens by TTFT_SLO + (i-1)·TPOT_SLO / tokens)", "",
              pivot_table(rows, "token_goodput_ratio", "{:.3f}"), "",
              "### SLOs-Serve: SLO attainment (every token on the §3.2 deadline line); "
              "serving capacity = rate at 90 % attainment", "",
              pivot_table(rows, "slos_attainment", "{:.3f}", caps=caps["slos_attainment"]), "",
              "### SLOs-Serve §6 variant: first token within TTFT SLO, mean TPOT of every 10 tokens "
              "within TPOT SLO", "",
              pivot_table(rows, "slos_attainment_window", "{:.3f}", caps=caps["slos_attainment_window"]), "",
              "### UniBoost: P99 TTLT (s), completed requests", "",
              pivot_table(rows, "ttlt_p99", "{:.1f}"), "",
              "### Everything, per policy and rate (means over seeds)", "", long_table(rows), ""]
    return "\n".join(parts)


# -- plot -------------------------------------------------------------------------------------
def plot(rows: Sequence[dict], path: str | Path, title: str = "", panels=PANELS) -> None:
    """One panel per metric vs rate, one line per policy, styled as ``proserve.sim.report.plot_sweep``
    (first series bold black, tab20 colours, distinct markers)."""
    from proserve.sim.report import _pyplot
    plt = _pyplot()
    ncol = 4
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow + 1.0), squeeze=False)
    rows = [r for r in rows if not r.get("local_params")]     # variants: tables only
    series = list(dict.fromkeys(r["series"] for r in rows))
    colors = plt.get_cmap("tab20").colors
    markers = "os^vD<>pPX*h"
    for ax, (key, label, log) in zip(axes.flat, panels):
        for i, s in enumerate(series):
            pts = sorted((r["rate"], lookup(r["metrics"], key)) for r in rows if r["series"] == s)
            pts = [(x, y) for x, y in pts if not math.isnan(y)]
            first = i == 0
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)],
                    ms=4 if first else 3, lw=2.4 if first else 1.1, zorder=3 if first else 2,
                    ls="--" if any(s.startswith(n) for n in NEW_LOCALS) else "-",
                    color="black" if first else colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20], label=s)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 7 if max(len(s) for s in series) < 20 else 4
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=min(ncol, len(series)),
               fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    rows_legend = math.ceil(len(series) / ncol)
    fig.tight_layout(rect=(0, 0.045 * rows_legend + 0.01, 1, 1))   # (sim.report._save would redo the layout)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- driver -----------------------------------------------------------------------------------
def sweep(deployment: str, combos, rates, seeds, num_requests: int, jobs: int, out: Path | None,
          prefill: int = 4, decode: int = 8, command: str = "", make_plot: bool = True) -> dict:
    """Run one deployment's sweep; write ``<deployment>.{json,md,png}`` under ``out``."""
    specs = make_specs(deployment, combos, rates, seeds, num_requests, prefill, decode)
    t0 = time.perf_counter()
    runs = run_all(specs, jobs)
    wall = time.perf_counter() - t0
    rows = aggregate(runs)
    gpus = 1 if deployment == "colocated" else prefill + decode
    caps = {k: capacity_table(runs, k, TARGET, gpus)
            for k in ("slos_attainment", "slos_attainment_window", "slo_attainment")}
    shape = "1 instance" if deployment == "colocated" else f"{prefill} prefill + {decode} decode instances"
    header = (f"## {deployment}, {shape}: Azure 2023 conversation trace, first {num_requests} requests, "
              f"rates {', '.join(f'{x:g}' for x in rates)} req/s, seeds {', '.join(map(str, seeds))}\n\n"
              f"{len(specs)} runs in {wall:.0f} s wall over {jobs} processes. Regenerate: `{command}`.")
    result = {"deployment": deployment, "shape": shape, "rates": list(rates), "seeds": list(seeds),
              "num_requests": num_requests, "combos": [list(c) for c in combos], "wall_s": wall,
              "jobs": jobs, "command": command, "rows": rows, "capacity": caps, "runs": runs,
              "markdown": markdown(deployment, rows, caps, header)}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_compact_json(out / f"{deployment}.json", {k: v for k, v in result.items() if k != "markdown"})
        (out / f"{deployment}.md").write_text(result["markdown"] + "\n")
        if make_plot:
            plot(rows, out / f"{deployment}.png", title=f"{deployment}, {shape}, Azure conversation trace")
    return result


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "alternatives"))
    ap.add_argument("--deployments", default="colocated,disaggregated")
    ap.add_argument("--colocated-rates", default="2,2.5,3,3.25,3.5,4,4.5,5,6")
    ap.add_argument("--disagg-rates", default="20,25,30,35,40,45,50")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--num-requests", type=int, default=2000, help="co-located requests per run")
    ap.add_argument("--disagg-num-requests", type=int, default=3000)
    ap.add_argument("--prefill-instances", type=int, default=4)
    ap.add_argument("--decode-instances", type=int, default=8)
    ap.add_argument("--locals", default=",".join(COLOCATED_LOCALS), help="co-located local policies")
    ap.add_argument("--no-variants", action="store_true", help="skip COLOCATED_VARIANTS")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true", help="seed 0 only, 600 / 1,000 requests")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--summary", action="store_true",
                    help="no simulation: print docs/results.md §5's tables from the JSON under --out")
    ap.add_argument("--replot", action="store_true",
                    help="no simulation: redraw <deployment>.png from the <deployment>.json under --out")
    args = ap.parse_args(list(argv) if argv is not None else None)
    seeds = [0] if args.quick else [int(s) for s in _floats(args.seeds)]
    n_co = 600 if args.quick else args.num_requests
    n_dis = 1000 if args.quick else args.disagg_num_requests
    out = Path(args.out)
    command = "python scripts/compare_alternatives.py" + (" " + " ".join(sys.argv[1:]) if argv is None and
                                                           len(sys.argv) > 1 else "")
    deps = [d for d in args.deployments.split(",") if d]
    if args.summary:
        print(summary(out))
        return 0
    if args.replot:
        for dep in deps:
            data = json.loads((out / f"{dep}.json").read_text())
            plot(data["rows"], out / f"{dep}.png", title=f"{dep}, {data['shape']}, Azure conversation trace")
        return 0
    t0 = time.perf_counter()
    for dep in deps:
        if dep == "colocated":
            combos = [(lp, "round_robin") for lp in args.locals.split(",") if lp]
            if not args.no_variants and not args.quick:
                combos += [(lp, "round_robin", params) for lp, params in COLOCATED_VARIANTS]
            res = sweep(dep, combos, _floats(args.colocated_rates), seeds, n_co, args.jobs, out,
                        command=command, make_plot=not args.no_plot)
        elif dep == "disaggregated":
            res = sweep(dep, DISAGG_COMBOS, _floats(args.disagg_rates), seeds, n_dis, args.jobs, out,
                        args.prefill_instances, args.decode_instances, command=command,
                        make_plot=not args.no_plot)
        else:
            ap.error(f"unknown deployment {dep!r}")
        print(res["markdown"])
        print()
    total = time.perf_counter() - t0
    write_readme(out, command, args.jobs)
    print(f"total {total:.0f} s; wrote {out}", file=sys.stderr)
    return 0


# the rows docs/results.md §5 shows (the full tables are in <deployment>.md)
SUMMARY_SERIES = {
    "colocated": ("slide_batching", "jitserve_gmax", "jitserve_gmax[goodput=tokens]", "slos_serve", "uniboost",
                  "uniboost[adaptive=false]", "uniboost[memguard=false]", "sarathi_fcfs", "sarathi_priority",
                  "vllm_fcfs", "weighted_vtc", "sjf"),
    "disaggregated": tuple(f"{a}+{b}" for a, b in DISAGG_COMBOS),
}


def _triple_table(rows: Sequence[dict], rates: Sequence[float]) -> str:
    """SLO attainment ``all (high / low)`` per policy at ``rates``."""
    head = "| policy | " + " | ".join(f"{x:g} req/s" for x in rates) + " |"
    lines = [head, "|---|" + "---:|" * len(rates)]
    by = {(r["series"], r["rate"]): r for r in rows}
    for s in dict.fromkeys(r["series"] for r in rows):
        cells = []
        for x in rates:
            r = by.get((s, x))
            if r is None:
                cells.append("-")
                continue
            m = r["metrics"]
            cells.append(f"{lookup(m, 'slo_attainment'):.2f} ({lookup(m, 'slo_attainment@high'):.2f} / "
                         f"{lookup(m, 'slo_attainment@low'):.2f})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(out: Path) -> str:
    """The tables of docs/results.md §5, from the JSON files under ``out``."""
    parts = []
    for dep, keep in SUMMARY_SERIES.items():
        f = out / f"{dep}.json"
        if not f.exists():
            continue
        data = json.loads(f.read_text())
        rows = [r for r in data["rows"] if r["series"] in keep]
        caps = {k: [c for c in v if c["series"] in keep] for k, v in data["capacity"].items()}
        loaded = [x for x in data["rates"] if (x >= 3 if dep == "colocated" else x >= 35)]
        parts += [f"#### {dep}: TDG_Ratio (mean over seeds; sd ≤ "
                  f"{max(lookup(r['sd'], 'tdg_ratio') for r in rows):.3f})", "",
                  pivot_table(rows, "tdg_ratio", "{:.3f}"), ""]
        if dep == "disaggregated":
            parts += [f"#### {dep}: first-token TDG_Ratio", "",
                      pivot_table(rows, "first_token_tdg_ratio", "{:.3f}"), ""]
        parts += [f"#### {dep}: SLO attainment, all (high / low)", "", _triple_table(rows, loaded), "",
                  f"#### {dep}: P99 TTFT (s)", "", pivot_table(rows, "ttft_p99", "{:.1f}"), "",
                  f"#### {dep}: JITServe token goodput ratio", "",
                  pivot_table(rows, "token_goodput_ratio", "{:.3f}"), "",
                  f"#### {dep}: SLOs-Serve attainment (§3.2 line) and capacity at 90 %", "",
                  pivot_table(rows, "slos_attainment", "{:.3f}", caps=caps["slos_attainment"]), "",
                  f"#### {dep}: UniBoost P99 TTLT (s)", "", pivot_table(rows, "ttlt_p99", "{:.1f}"), ""]
    return "\n".join(parts)


def write_readme(out: Path, command: str, jobs: int) -> None:
    """README.md under ``out``: the files there, each sweep's size and wall time."""
    lines, total = [], 0.0
    for dep in ("colocated", "disaggregated"):
        f = out / f"{dep}.json"
        if f.exists():
            data = json.loads(f.read_text())
            total += data["wall_s"]
            lines.append(f"* `{dep}.md` / `{dep}.json` / `{dep}.png`: {data['shape']}, {len(data['runs'])} runs, "
                         f"{data['wall_s'] / 60:.1f} min wall")
    if (out / "bench_scheduler.txt").exists():
        lines.append("* `bench_scheduler.txt`: `python scripts/bench_scheduler.py`, decision times of every "
                     "policy (load average of the machine before and after on its first and last lines)")
    head = ["# Alternative schedulers vs SlideBatching (simulator)", "",
            f"Regenerate: `{command}` (about {total / 60:.0f} min wall on {os.cpu_count()} cores shared with "
            f"other work, {jobs} processes). Reading and context: docs/results.md §5.", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
