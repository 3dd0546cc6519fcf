"""Command line of the cluster simulator.

    python -m proserve.sim run    ...   one configuration: table, JSON, optional plots
    python -m proserve.sim sweep  ...   request rates × policies × seeds: one table, one plot
    python -m proserve.sim plan   ...   capacity planning: the cheapest deployment meeting per-class
                               targets at a rate, or the highest rate a deployment sustains
    python -m proserve.sim policies     list the local and global policies by name

Run ``python -m proserve.sim <command> --help`` for the flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from proserve.scheduler import registry, validate
from proserve.scheduler.admission import AdmissionConfig, parse_actions
from proserve.scheduler.config import (
    classes_from_dicts,
    default_classes,
    overload_actions_from_dicts,
    parse_key_values,
)
from proserve.scheduler.request import ConfigError, PriorityClass
from proserve.scheduler.tdg import GainConfig

from .cluster import DEPLOYMENTS, SimConfig, simulate
from .report import (
    ROW_FIELDS,
    add_admission,
    admission_fields,
    format_admission,
    format_table,
    metrics_dict,
    plot_sweep,
    plot_timeline,
    request_records,
    write_json,
)

BUNDLED_TRACE = Path(__file__).resolve().parent.parent / "bench" / "data" / "azure_conv_2023.csv"


@dataclass
class RunSpec:
    """Everything one simulation needs; picklable so sweeps can fan out."""

    trace: str = "azure"
    trace_format: str | None = None
    rate: float | None = None
    num_requests: int | None = 2000
    seed: int = 0
    classes: dict | None = None      # name -> PriorityClass
    shares: dict | None = None
    latency_model: str | None = None
    w_p: float | None = None
    w_d: float = 1.0
    deadline: str = "fixed"
    sim: SimConfig = field(default_factory=SimConfig)
    # length shaping as bench.loadgen does it for a real engine (identity by default)
    prompt_div: float = 1.0
    output_div: float = 1.0
    max_prompt: int | None = None
    max_model_len: int | None = None

    @property
    def shaped(self) -> bool:
        return self.prompt_div != 1.0 or self.output_div != 1.0 or self.max_prompt is not None


def _load_model(path: str | None):
    from proserve.profiler.modelfile import BUNDLED, load
    return load(path or BUNDLED)


def _workload(spec: RunSpec):
    if spec.shaped:
        # the load generator's pipeline (bench.loadgen.workload.make_workload), so that a
        # simulated workload is the one bench.loadgen sends to a real cluster
        from proserve.bench.loadgen.workload import make_workload
        if spec.shares:
            raise ConfigError("--shares cannot be combined with --prompt-div/--output-div/--max-prompt "
                              "(the load generator tags classes 50/50)")
        return make_workload(spec.trace, spec.rate, spec.num_requests, spec.seed, spec.classes,
                             spec.trace_format, spec.prompt_div, spec.output_div, spec.max_prompt,
                             spec.max_model_len)
    from proserve.bench.workloads import build_workload
    source = str(BUNDLED_TRACE) if spec.trace == "azure" else spec.trace
    fmt = "azure" if spec.trace == "azure" else spec.trace_format
    return build_workload(source, rate=spec.rate, num_requests=spec.num_requests, seed=spec.seed,
                          classes=spec.classes, shares=spec.shares, fmt=fmt, max_model_len=spec.max_model_len)


def _gain(spec: RunSpec, reqs) -> GainConfig:
    if spec.w_p is None:
        g = GainConfig.from_workload([r.prompt_len for r in reqs], [r.output_len for r in reqs], spec.deadline)
        return GainConfig(g.w_p * spec.w_d, spec.w_d, spec.deadline)
    return GainConfig(spec.w_p, spec.w_d, spec.deadline)


def run_spec(spec: RunSpec, keep_requests: bool = False) -> dict:
    """Simulate one spec; return a JSON-able dict (metrics, config, optionally records)."""
    model = _load_model(spec.latency_model)
    reqs = _workload(spec)
    gain = _gain(spec, reqs)
    t0 = time.perf_counter()
    res = simulate(reqs, model, spec.sim, gain, spec.classes)
    wall = time.perf_counter() - t0
    out = {
        "policy": spec.sim.local_policy, "global": spec.sim.global_policy, "rate": spec.rate,
        "seed": spec.seed, "requests": len(reqs), "wall_s": wall, "sim_steps": res.steps,
        "preemptions": res.preemptions,
        "duration_s": res.duration, "gain": {"w_p": gain.w_p, "w_d": gain.w_d, "deadline": gain.deadline},
        "metrics": metrics_dict(res.requests, gain, res.duration),
    }
    if spec.sim.dispatchers > 1:
        out["dispatchers"] = spec.sim.dispatchers
        out["dispatcher_sync"] = spec.sim.sync_mode
    if res.admission:
        out["admission"] = res.admission
        add_admission(out["metrics"], res.admission)
    if res.prefix_prompt_tokens:
        out["prefix_cache"] = {"prompt_tokens": res.prefix_prompt_tokens, "hit_tokens": res.prefix_hit_tokens,
                               "hit_rate": res.prefix_hit_tokens / res.prefix_prompt_tokens}
    if keep_requests:
        out["records"] = request_records(res.requests, gain)
        out["timeline"] = res.timeline
    return out


# -- argument parsing ---------------------------------------------------------------------
def _floats(s: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: expected comma-separated numbers, got {s!r}") from None
    if not vals:
        raise ConfigError(f"{what}: empty list")
    return vals


def _add_common(p: argparse.ArgumentParser, deployment: bool = True) -> None:
    """The flags every simulating command shares; ``deployment=False`` leaves out
    --deployment/--instances/--prefill-instances/--decode-instances (``plan`` chooses them)."""
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default="azure",
                   help="'azure' (bundled Azure 2023 conversation trace), 'synthetic', or a trace file path")
    w.add_argument("--format", dest="trace_format", choices=["azure", "burstgpt", "mooncake", "sharegpt"],
                   help="trace file format (default: sniffed from the file)")
    w.add_argument("--num-requests", type=int, default=2000,
                   help="use the first N requests of the trace (default 2000; 0 = all)")
    w.add_argument("--classes", help="JSON file: list of {name, weight, ttft_slo, tpot_slo[, on_overload]} "
                                     "(default: high w=2 / low w=1, TTFT 1 s, TPOT 0.1 s)")
    w.add_argument("--ttft-slo", type=float, help="TTFT SLO of every class, seconds (overrides --classes)")
    w.add_argument("--tpot-slo", type=float, help="TPOT SLO of every class, seconds (overrides --classes)")
    w.add_argument("--shares", help="class shares, e.g. high=0.5,low=0.5 (default 50/50)")
    w.add_argument("--prompt-div", type=float, default=1.0,
                   help="divide every prompt length by this, as bench.loadgen does for a real engine (default 1)")
    w.add_argument("--output-div", type=float, default=1.0, help="divide every output length by this (default 1)")
    w.add_argument("--max-prompt", type=int, help="clip prompt lengths to this many tokens")
    w.add_argument("--max-model-len", type=int,
                   help="cut prompt + output to this many tokens (the engine's max_model_len)")
    g = p.add_argument_group("gain (TDG, Eq. 3)")
    g.add_argument("--w-p", type=float, help="first-token weight (default: mean prompt / mean output × w_d, §5.1)")
    g.add_argument("--w-d", type=float, default=1.0, help="decode-token weight (default 1)")
    g.add_argument("--deadline", choices=["fixed", "ttft_anchored"], default="fixed",
                   help="token deadlines: Eq. 3 (fixed) or footnote 2 (ttft_anchored)")
    c = p.add_argument_group("cluster")
    if deployment:
        c.add_argument("--deployment", choices=DEPLOYMENTS, default="colocated")
        c.add_argument("--instances", type=int, default=1, help="co-located instances (default 1)")
        c.add_argument("--prefill-instances", type=int, default=4,
                       help="disaggregated prefill instances (default 4)")
        c.add_argument("--decode-instances", type=int, default=4, help="disaggregated decode instances (default 4)")
    c.add_argument("--dispatchers", type=int, default=1,
                   help="dispatchers in front of the instances, arrivals spread over them as a load balancer "
                        "would (default 1; issue 15)")
    c.add_argument("--dispatcher-sync", choices=["blind", "publish", "shared"],
                   help="with several dispatchers, what each sees of the others' dispatches: 'blind' (nothing: "
                        "its own PrefillQueueMap only), 'publish' (default with --dispatchers > 1: instances "
                        "publish their queued prefill work every --publish-interval; a dispatcher's view is the "
                        "last publication plus its own dispatches since) or 'shared' (one map for all: the "
                        "upper bound)")
    c.add_argument("--publish-interval", type=float, default=0.05,
                   help="seconds between the instances' publications of their queued work (default 0.05)")
    c.add_argument("--dispatcher-spread", choices=["round_robin", "random"], default="round_robin",
                   help="how the load balancer spreads arrivals over the dispatchers (default round_robin; "
                        "random is seeded)")
    c.add_argument("--latency-model", help="latency-model JSON (default: bundled 7B-class sketch)")
    c.add_argument("--true-latency-model", help="model the simulated hardware follows, if different "
                                                "from the one the policies estimate with (exercises β)")
    c.add_argument("--noise-cv", type=float, default=0.0, help="log-normal step-time noise CV (default 0)")
    c.add_argument("--kv-bandwidth", type=float, default=25.0, help="KV transfer bandwidth in GB/s (default 25)")
    c.add_argument("--kv-blocks", type=int, help="KV blocks per instance (default: from the latency model)")
    c.add_argument("--exact", action="store_true", help="simulate every decode step (no macro-steps)")
    c.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="no prefix caching (default: on, as vLLM's; it acts on traces with prefix blocks, "
                        "Mooncake's hash_ids: a request skips the prefill of its leading blocks the instance "
                        "holds, LRU over the instance's KV memory; the run's hit rate is in its JSON)")
    c.add_argument("--no-prefix-index", dest="prefix_index", action="store_false",
                   help="the router keeps no index of the instances' prefix caches (default: it indexes the "
                        "prefix blocks it dispatched to each and prices a request's prefill net of the "
                        "prefix it expects there)")
    h = p.add_argument_group("what the real cluster adds around the engines (scripts/bench_fidelity.py measures it)")
    h.add_argument("--first-token", choices=["prefill", "decode"], default="prefill",
                   help="disaggregated: who emits the first token: 'prefill' (the paper, §4.3; default) or "
                        "'decode' (ProServe's dispatcher and vLLM: the decode worker emits every output token "
                        "after the KV arrived)")
    h.add_argument("--dispatch-delay", type=float, default=0.0,
                   help="seconds from a request's arrival to its instance's queue (HTTP hops; default 0)")
    h.add_argument("--handoff-delay", type=float, default=0.0,
                   help="disaggregated: seconds from a prefill's end to its KV transfer start (default 0)")
    h.add_argument("--stream-delay", type=float, default=0.0,
                   help="seconds from a token's step end to the client (default 0)")
    a = p.add_argument_group(
        "admission control, as the dispatcher applies it (scheduler/admission.py; off by default)")
    a.add_argument("--on-overload", action="append", metavar="CLASS=ACTION",
                   help="what a class does when no instance can meet a request's TTFT SLO (GoRouting's "
                        "estimate, Δ_max <= 0): queue (default), reject (refused at arrival, scored as the load "
                        "generator scores a 429: no token, zero gain, SLO missed) or downgrade (served in the "
                        "next class down by weight); repeatable or comma-separated, e.g. low=reject; overrides "
                        "on_overload in --classes")
    a.add_argument("--max-queued-requests", type=int, metavar="N",
                   help="an instance with N requests waiting for prefill takes no more; a request finding "
                        "every instance so is refused (default: no cap)")
    a.add_argument("--max-queued-tokens", type=int, metavar="N",
                   help="... likewise with N prompt tokens waiting for prefill (default: no cap)")
    a.add_argument("--max-concurrent", type=int, metavar="N",
                   help="requests in progress at once, overall, as the dispatcher's max_concurrent: a request "
                        "arriving over it is refused (default: no limit)")
    a.add_argument("--max-concurrent-per-class", type=int, metavar="N",
                   help="... per class, as the dispatcher's max_concurrent_per_key with one key per class "
                        "(what the real cluster answers with 429s under overload; default: no limit)")
    p.add_argument("--local-param", action="append", metavar="KEY=VALUE",
                   help="local policy parameter, e.g. gamma=1.5 eta=0.05 phi=c (repeatable)")
    p.add_argument("--global-param", action="append", metavar="KEY=VALUE",
                   help="global policy parameter, e.g. alpha=0.9 mu=0.2 lam=0.8, or order=deadline for "
                        "GoRouting with the paper's estimate (repeatable)")
    p.add_argument("--out", help="output directory for JSON and plots")


def _spec_from(args, local: str, glob: str, rate: float | None, seed: int) -> RunSpec:
    classes = None
    actions: dict[str, str] = {}
    if args.classes:
        try:
            items = json.loads(Path(args.classes).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--classes {args.classes}: {e}") from None
        classes = classes_from_dicts(items, f"--classes {args.classes}")
        actions = overload_actions_from_dicts(items, f"--classes {args.classes}")
    actions.update(parse_actions(args.on_overload))
    if args.ttft_slo is not None or args.tpot_slo is not None:
        for what, v in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
            if v is not None:
                validate.positive("", what, v)
        classes = {n: PriorityClass(n, c.weight, args.ttft_slo if args.ttft_slo is not None else c.ttft_slo,
                                    args.tpot_slo if args.tpot_slo is not None else c.tpot_slo)
                   for n, c in (classes or default_classes()).items()}
    shares = None
    if args.shares:
        shares = {k: float(v) for k, v in parse_key_values(args.shares.split(","), "--shares").items()}
    true_model = _load_model(args.true_latency_model) if args.true_latency_model else None
    sim = SimConfig(
        deployment=getattr(args, "deployment", "colocated"), instances=getattr(args, "instances", 1),
        prefill_instances=getattr(args, "prefill_instances", 1),
        decode_instances=getattr(args, "decode_instances", 1), local_policy=local,
        local_params=parse_key_values(args.local_param, "--local-param"), global_policy=glob,
        global_params=parse_key_values(args.global_param, "--global-param"), noise_cv=args.noise_cv,
        true_model=true_model, kv_bandwidth=args.kv_bandwidth * 1e9, num_kv_blocks=args.kv_blocks,
        fast_forward=not args.exact, record_timeline=getattr(args, "timeline", False), seed=seed,
        first_token=args.first_token, dispatch_delay=args.dispatch_delay, handoff_delay=args.handoff_delay,
        stream_delay=args.stream_delay, prefix_cache=args.prefix_cache, prefix_index=args.prefix_index,
        admission=AdmissionConfig(actions, args.max_queued_requests, args.max_queued_tokens),
        max_concurrent=args.max_concurrent, max_concurrent_per_class=args.max_concurrent_per_class,
        dispatchers=args.dispatchers, dispatcher_sync=args.dispatcher_sync,
        publish_interval_s=args.publish_interval, dispatcher_spread=args.dispatcher_spread)
    return RunSpec(trace=args.trace, trace_format=args.trace_format, rate=rate,
                   num_requests=args.num_requests or None, seed=seed, classes=classes, shares=shares,
                   latency_model=args.latency_model, w_p=args.w_p, w_d=args.w_d, deadline=args.deadline, sim=sim,
                   prompt_div=args.prompt_div, output_div=args.output_div, max_prompt=args.max_prompt,
                   max_model_len=args.max_model_len)


def _validate_early(spec: RunSpec) -> None:
    """Fail at start-up, before any simulation, on a bad name or value."""
    from .cluster import Simulator
    spec.sim.validate()
    registry.local_policy(spec.sim.local_policy)
    registry.global_policy(spec.sim.global_policy)
    Simulator(_load_model(spec.latency_model), spec.sim, GainConfig(), spec.classes)
    if spec.rate is not None:
        validate.positive("", "--rate", spec.rate)
    if spec.num_requests is not None:
        validate.integer("", "--num-requests", spec.num_requests, 0)
    for what, v in (("--prompt-div", spec.prompt_div), ("--output-div", spec.output_div)):
        validate.positive("", what, v)
    if spec.max_prompt is not None:
        validate.integer("", "--max-prompt", spec.max_prompt, 1)
    if spec.max_model_len is not None:
        validate.integer("", "--max-model-len", spec.max_model_len, 2)


def cmd_run(args) -> int:
    spec = _spec_from(args, args.local, args.glob, args.rate, args.seed)
    _validate_early(spec)
    res = run_spec(spec, keep_requests=True)
    row = {"policy": spec.sim.local_policy, "rate": spec.rate, "metrics": res["metrics"]}
    print(f"# {len(res['records'])} requests, {spec.sim.deployment}, local={spec.sim.local_policy}, "
          f"global={spec.sim.global_policy}, rate={spec.rate}, simulated {res['duration_s']:.1f} s "
          f"in {res['wall_s']:.2f} s wall ({res['sim_steps']} steps, {res['preemptions']} preemptions)")
    print(format_table([row]))
    print()
    print(format_table([{"class": k, "metrics": {"all": v}} for k, v in res["metrics"].items()],
                       keys=("class",), fields=[f for f in ROW_FIELDS if "@" not in f[1]]))
    if "admission" in res:
        print()
        print("# admission per class the requests came in (refused: no token, zero gain, SLO missed)")
        print(format_admission(res["admission"]))
    if args.out:
        out = Path(args.out)
        timeline = res.pop("timeline")
        write_json(out / "run.json", res)
        if args.timeline and timeline:
            write_json(out / "timeline.json", [p.__dict__ for p in timeline])
            if args.plot:
                plot_timeline(timeline, out / "timeline.png",
                              title=f"{spec.sim.local_policy} URGENT/NORMAL, rate {spec.rate}")
        print(f"wrote {out / 'run.json'}")
    return 0


def cmd_sweep(args) -> int:
    rates = _floats(args.rates, "--rates")
    locals_ = [s for s in args.local.split(",") if s]
    globals_ = [s for s in args.glob.split(",") if s]
    seeds = [int(s) for s in _floats(args.seeds, "--seeds")]
    specs = [_spec_from(args, lp, gp, r, s) for lp in locals_ for gp in globals_ for r in rates for s in seeds]
    for lp in locals_:
        registry.local_policy(lp)
    for gp in globals_:
        registry.global_policy(gp)
    _validate_early(specs[0])
    for sp in specs:
        validate.positive("", "--rates", sp.rate)
    t0 = time.perf_counter()
    jobs = max(1, args.jobs)
    if jobs == 1:
        results = []
        for i, sp in enumerate(specs):
            results.append(run_spec(sp))
            print(f"\r[{i + 1}/{len(specs)}] {sp.sim.local_policy}/{sp.sim.global_policy} rate={sp.rate}",
                  end="", file=sys.stderr, flush=True)
    else:
        with ProcessPoolExecutor(jobs) as ex:
            results = []
            for i, r in enumerate(ex.map(run_spec, specs)):
                results.append(r)
                print(f"\r[{i + 1}/{len(specs)}]", end="", file=sys.stderr, flush=True)
    print(f"\r{len(specs)} runs in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    series = "policy" if len(globals_) == 1 else "global" if len(locals_) == 1 else "combo"
    rows = []
    for r in results:
        r["combo"] = f"{r['policy']}+{r['global']}"
        rows.append(r)
    rows_avg = _average_seeds(rows, series)
    first_token = args.deployment == "disaggregated"
    fields = _fields(first_token)
    admitted = {cls: c for r in rows for cls, c in r.get("admission", {}).items()}
    if admitted:
        fields = fields + admission_fields(admitted)   # refused requests per class (mean over seeds)
    print(f"# {args.deployment}, trace={args.trace}, {specs[0].num_requests or 'all'} requests, "
          f"seeds={seeds}" + (", TDG = first-token TDG (§5.2)" if first_token else ""))
    print(format_table(rows_avg, fields=fields, keys=(series, "rate")))
    if args.out:
        out = Path(args.out)
        write_json(out / "sweep.json", {"args": {k: v for k, v in vars(args).items() if k != "func"},
                                        "runs": rows})
        (out / "table.txt").write_text(format_table(rows_avg, fields=fields, keys=(series, "rate")) + "\n")
        if not args.no_plot:
            metrics = ("first_token_tdg_ratio", "first_token_tdg_ratio@high", "first_token_tdg_ratio@low",
                       "slo_attainment") if first_token else \
                ("tdg_ratio", "tdg_ratio@high", "tdg_ratio@low", "slo_attainment")
            plot_sweep(rows_avg, out / "sweep.png", series_key=series, metrics=metrics,
                       title=f"{args.deployment}, {args.trace}")
        print(f"wrote {out}/sweep.json, table.txt" + ("" if args.no_plot else ", sweep.png"))
    return 0


def _fields(first_token: bool):
    if not first_token:
        return ROW_FIELDS
    return [("TDG1", "first_token_tdg_ratio", "{:.3f}"), ("TDG1_hi", "first_token_tdg_ratio@high", "{:.3f}"),
            ("TDG1_lo", "first_token_tdg_ratio@low", "{:.3f}")] + ROW_FIELDS


def _average_seeds(rows: list[dict], series: str) -> list[dict]:
    """Mean of every metric over seeds, per (series, rate)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r[series], r["rate"]), []).append(r)
    out = []
    for (s, rate), rs in groups.items():
        metrics = {}
        for cls in rs[0]["metrics"]:
            metrics[cls] = {}
            for k, v in rs[0]["metrics"][cls].items():
                if isinstance(v, (int, float)):
                    vals = [x["metrics"][cls][k] for x in rs if x["metrics"].get(cls)]
                    metrics[cls][k] = sum(vals) / len(vals)
        out.append({series: s, "rate": rate, "metrics": metrics})
    return out


def cmd_plan(args) -> int:
    from . import plan as pl
    if (args.rate is None) == (args.deployment is None):
        raise ConfigError("plan: give exactly one of --rate R (the cheapest deployment at R req/s) "
                          "or --deployment colocated:N|disagg:P:D (the highest rate it sustains)")
    seeds = [int(s) for s in _floats(args.seeds, "--seeds")]
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds: expected distinct non-negative integers, got {args.seeds!r}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for k in kinds:
        if k not in DEPLOYMENTS:
            raise ConfigError(f"--kinds: unknown deployment kind {k!r} (choose from {', '.join(DEPLOYMENTS)})")
    if not kinds:
        raise ConfigError("--kinds: empty list")
    base = _spec_from(args, args.local, args.glob, args.rate, seeds[0])
    targets = pl.parse_targets(args.target, (base.classes or default_classes()).keys())
    dep = pl.parse_deployment(args.deployment) if args.deployment else pl.colocated(1)
    _validate_early(replace(base, sim=dep.apply(base.sim)))
    if args.rate is None and args.rate_start is not None:
        validate.positive("", "--rate-start", args.rate_start)
    if args.plot:
        from .report import _pyplot
        try:
            _pyplot()
        except RuntimeError as e:
            raise ConfigError(f"--plot: {e}") from None
    progress = pl.Progress(enabled=not args.quiet)
    with pl.Planner(base, run_spec, targets, seeds, args.jobs, progress) as planner:
        if args.rate is not None:
            result = planner.cheapest(args.rate, args.max_instances, kinds)
        else:
            result = planner.highest_rate(dep, args.rate_start, args.rate_tol)
    what = (f"cheapest deployment at {args.rate:g} req/s" if args.rate is not None
            else f"highest rate of {dep}")
    print(f"# plan: {what}; targets {', '.join(map(str, targets))}; trace={args.trace}, "
          f"{base.num_requests or 'all'} requests, seeds={seeds}, local={args.local}, global={args.glob}, "
          f"latency model={args.latency_model or 'bundled'}")
    print("# a point passes only if every seed meets every target; metrics are the worst seed")
    table = pl.format_trials(result, targets)
    summary = pl.describe(result, targets, args.rate, args.max_instances, args.rate_tol)
    print(table)
    print(summary)
    if args.out:
        out = Path(args.out)
        write_json(out / "plan.json", {"args": {k: v for k, v in vars(args).items() if k != "func"},
                                       "targets": [str(t) for t in targets], **result.as_dict()})
        (out / "table.txt").write_text(table + "\n" + summary + "\n")
        print(f"wrote {out}/plan.json, table.txt")
    if args.plot:
        pl.plot_plan(result, targets, args.plot, title=f"{what}, {args.trace}")
        print(f"wrote {args.plot}")
    return 0 if result.answer is not None else 1


def cmd_policies(args) -> int:
    print("local policies (--local):")
    for n in registry.local_names(clairvoyant=True):
        print(f"  {n:18s} {registry.local_policy(n).summary}")
    print("global policies (--global):")
    for n in registry.global_names():
        print(f"  {n:18s} {registry.global_policy(n).summary}")
    return 0


PLAN_HELP = """Capacity planning on the simulator.

  --rate R               the cheapest deployment meeting every --target at R req/s:
                         co-located N (galloping 1, 2, 4, ... then bisection; assumes
                         more instances never hurt) and disaggregated P:D (for each P,
                         the largest D the cost bound allows, then bisection on D; assumes
                         more prefill or decode instances never hurt); cost = instances,
                         a tie goes to co-located
  --deployment D         the highest rate D sustains (galloping ×2 / ÷2, then bisection
                         to --rate-tol; assumes a higher rate never helps)

Prints every point tried (deployment, rate, per-class TDG_Ratio and SLO attainment of
the worst seed, pass/fail, simulation wall time, search step) and the answer; exit
status 1 if nothing passes. Example:

  python -m proserve.sim plan --rate 12 --target high:tdg_ratio>=0.95,slo>=0.9 --seeds 0,1 --plot plan.png
  python -m proserve.sim plan --deployment disagg:1:2 --target high:tdg>=0.95,slo>=0.9
"""

PAPER_LOCAL = ("slide_batching,vllm_fcfs,weighted_vtc,sarathi_fcfs,sarathi_priority,fairbatching,"
               "edf,sjf,only_deadline,only_density,wo_latency_aware")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m proserve.sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="simulate one configuration")
    r.add_argument("--local", default="slide_batching", help="local batch policy (see `python -m proserve.sim policies`)")
    r.add_argument("--global", dest="glob", default="go_routing", help="global routing policy")
    r.add_argument("--rate", type=float, help="scale the trace to this mean request rate (req/s)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeline", action="store_true", help="record URGENT/NORMAL counts per step")
    r.add_argument("--plot", action="store_true", help="also write PNG plots to --out")
    _add_common(r)
    r.set_defaults(func=cmd_run)
    s = sub.add_parser("sweep", help="request rates × policies × seeds: one table and one plot")
    s.add_argument("--local", default=PAPER_LOCAL, help="comma-separated local policies (default: the paper's set)")
    s.add_argument("--global", dest="glob", default="round_robin",
                   help="comma-separated global policies (default round_robin)")
    s.add_argument("--rates", default="1,2,3,4,5,6", help="comma-separated request rates, req/s")
    s.add_argument("--seeds", default="0", help="comma-separated seeds (workload tagging and arrivals)")
    s.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel runs")
    s.add_argument("--no-plot", action="store_true", help="skip the PNG")
    _add_common(s)
    s.set_defaults(func=cmd_sweep)
    pn = sub.add_parser(
        "plan", help="capacity planning: cheapest deployment at a rate, or highest rate of a deployment",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=PLAN_HELP)
    mode = pn.add_argument_group("what to find (exactly one)")
    mode.add_argument("--rate", type=float,
                      help="find the cheapest deployment (fewest instances: co-located N or disaggregated "
                           "P:D) that meets every target at this request rate, req/s")
    mode.add_argument("--deployment", metavar="colocated:N|disagg:P:D",
                      help="find the highest request rate this deployment sustains")
    pn.add_argument("--target", action="append", metavar="CLASS:METRIC>=V[,...]",
                    help="per-class target, repeatable, e.g. high:tdg_ratio>=0.95,slo>=0.9 or all:ttft_p99<=2; "
                         "CLASS is a class name or 'all'; metrics: tdg_ratio (tdg), slo_attainment (slo), "
                         "first_token_tdg_ratio (tdg1), ttft_p50/p90/p99, tpot_p50/p90/p99, ...; "
                         "operators >=, <=, >, <")
    pn.add_argument("--local", default="slide_batching", help="local batch policy (default slide_batching)")
    pn.add_argument("--global", dest="glob", default="go_routing", help="global routing policy (default go_routing)")
    pn.add_argument("--seeds", default="0",
                    help="comma-separated seeds; a point passes only if every seed passes (default 0)")
    pn.add_argument("--max-instances", type=int, default=16,
                    help="--rate: largest N or P+D to try (default 16)")
    pn.add_argument("--kinds", default="colocated,disaggregated",
                    help="--rate: deployment kinds to search (default colocated,disaggregated)")
    pn.add_argument("--rate-start", type=float,
                    help="--deployment: first rate tried (default: 1 req/s per instance)")
    pn.add_argument("--rate-tol", type=float, default=0.02,
                    help="--deployment: stop when (failing - passing rate) / passing rate <= this (default 0.02)")
    pn.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="parallel simulations: the seeds of a point, then several points of a bisection")
    pn.add_argument("--plot", metavar="PNG", help="write a plot of every point tried (needs matplotlib)")
    pn.add_argument("--quiet", action="store_true", help="no progress bar (it is off anyway when stderr is "
                                                         "not a terminal)")
    _add_common(pn, deployment=False)
    pn.set_defaults(func=cmd_plan)
    p = sub.add_parser("policies", help="list policy names")
    p.set_defaults(func=cmd_policies)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
