"""The command line (``python -m proserve.bench.loadgen``): the argument parser, the
client settings, classes and workload from the flags, and :func:`main`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from proserve.scheduler import validate
from proserve.scheduler.config import classes_from_dicts, default_classes
from proserve.scheduler.request import ConfigError, PriorityClass, Request

from ..workloads import LengthDist, TurnLink
from .body import APIS, ClientConfig, deep_merge, parse_class_keys
from .client import replay
from .report import (
    Progress,
    clean_json,
    format_summary,
    have_matplotlib,
    load_records,
    report_from_records,
    write_outputs,
    write_plots,
)
from .scoring import summarize_run
from .workload import (
    ARRIVAL_MODES,
    DEFAULT_TOKEN_LOW,
    DEFAULT_VOCAB,
    make_conversation_workload,
    make_workload,
    workload_gain,
)

DEFAULT_NUM_REQUESTS = 200
DEFAULT_CONVERSATIONS = 50

# --- command line -------------------------------------------------------------------------

def _json_arg(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}: not valid JSON ({e.msg}): {text!r}") from None


def load_classes(path: str | None, ttft: float | None = None, tpot: float | None = None) -> dict[str, PriorityClass]:
    """Classes from a ``--classes`` JSON file (the prefill worker's format) or the defaults,
    with every class's SLOs overridden by ``ttft``/``tpot`` where given."""
    if path:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"--classes {path}: cannot read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--classes {path}: not valid JSON (line {e.lineno}): {e.msg}") from None
        classes = classes_from_dicts(raw, f"--classes {path}")
    else:
        classes = default_classes()
    return {n: PriorityClass(n, c.weight, ttft if ttft is not None else c.ttft_slo,
                             tpot if tpot is not None else c.tpot_slo) for n, c in classes.items()}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    w = ap.add_argument_group("workload")
    w.add_argument("--trace", default="azure",
                   help="'azure' (bundled Azure 2023 conversation trace), 'synthetic', or a trace file")
    w.add_argument("--format", dest="trace_format", choices=["azure", "burstgpt", "mooncake", "sharegpt"],
                   help="trace file format (default: sniffed)")
    w.add_argument("--num-requests", type=int, default=None,
                   help=f"first N requests of the trace (default {DEFAULT_NUM_REQUESTS}; not with --multi-turn)")
    w.add_argument("--seed", type=int, default=0,
                   help="priority tags, prompt tokens, Poisson arrivals, unstreamed picks (default 0)")
    w.add_argument("--classes", default=None,
                   help="JSON file [{name, weight, ttft_slo, tpot_slo}, ...] (default high w=2 / low w=1)")
    w.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO of every class, seconds")
    w.add_argument("--tpot-slo", type=float, default=None, help="TPOT SLO of every class, seconds")
    w.add_argument("--prompt-div", type=float, default=1.0,
                   help="divide every prompt length by this (a trace with prefix blocks: every block, see "
                        "--prefix-block-tokens)")
    w.add_argument("--output-div", type=float, default=1.0, help="divide every output length by this")
    w.add_argument("--max-prompt", type=int, default=None, help="clip prompt lengths to this")
    w.add_argument("--max-model-len", type=int, default=2048,
                   help="fit prompt + output into this (output cut first; default 2048, the tiny model's)")
    w.add_argument("--prefix-block-tokens", type=int, default=None, metavar="B",
                   help="tokens per prefix block. A trace with block ids (Mooncake hash_ids, 512-token blocks) "
                        "gets prompts made of shared blocks (equal ids, equal tokens); B scales each block to B "
                        "tokens and every prompt by B/512, e.g. 16 for a tiny CPU engine (instead of "
                        "--prompt-div; default: the trace's 512). --multi-turn: the block size of the turns' "
                        "prefix blocks (default 16)")
    m = ap.add_argument_group("multi-turn conversations")
    m.add_argument("--multi-turn", action="store_true",
                   help="conversations instead of single requests: with --trace synthetic, generated ones "
                        "(--conversations, --turns, --message-len, --answer-len); with a ShareGPT --trace, "
                        "every conversation's human/gpt turns. Turn k+1's prompt is turn k's prompt + its "
                        "answer (a fixed token block of the answer's length) + the new message; it is sent "
                        "when turn k's answer has arrived, plus --think-time. --rate counts new "
                        "conversations per second (Poisson starts; without it: 1/s synthetic, all at once "
                        "from a file)")
    m.add_argument("--conversations", type=int, default=None, metavar="N",
                   help=f"--multi-turn: number of conversations (synthetic) or the first N of the file "
                        f"(default {DEFAULT_CONVERSATIONS})")
    m.add_argument("--turns", default=None, metavar="DIST",
                   help="--multi-turn synthetic: turns per conversation, fixed:N | uniform:LO:HI | "
                        "lognormal:MEAN:SIGMA[:LO[:HI]] (default uniform:2:6)")
    m.add_argument("--message-len", default=None, metavar="DIST",
                   help="--multi-turn synthetic: tokens of each user message (default lognormal:96:0.8:4:1024)")
    m.add_argument("--answer-len", default=None, metavar="DIST",
                   help="--multi-turn synthetic: tokens of each answer (max_tokens; default "
                        "lognormal:192:0.6:4:1024)")
    m.add_argument("--think-time", type=float, default=0.0, metavar="S",
                   help="--multi-turn: mean seconds between an answer and the next message, exponential, "
                        "seeded (default 0: at once)")
    w.add_argument("--w-p", type=float, default=None,
                   help="TDG first-token weight (default: mean prompt / mean output, as the simulator)")
    w.add_argument("--w-d", type=float, default=1.0, help="TDG decode-token weight (default 1)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m proserve.bench.loadgen",
        description="Replay a workload (Azure, BurstGPT, Mooncake, ShareGPT or synthetic) against an "
                    "OpenAI-compatible /v1/completions endpoint — a plain vLLM server, a ProServe worker, "
                    "or the ProServe dispatcher (--api proserve) — streaming and timestamping every "
                    "token, and report TDG_Ratio, SLO attainment, TTFT/TPOT percentiles, throughput and "
                    "errors per priority class (scheduler.tdg.summarize, as the simulator) as a table, "
                    "requests.jsonl + summary.json and PNG plots. Exit status: 0, 1 if any request ended "
                    "in an error, 2 for a bad flag.")
    ap.add_argument("--url", default=None,
                    help="base URL, e.g. http://127.0.0.1:8100 (or .../v1); required unless --from-records")
    ap.add_argument("--api", choices=APIS, default="vllm",
                    help="how requests name their class and SLOs: 'vllm' (default): vllm_xargs, for a plain "
                         "vLLM server or a ProServe worker; 'proserve': the dispatcher's 'priority' and "
                         "'slo' {ttft_ms, tpot_ms} fields with the class's API key")
    ap.add_argument("--model", default=None, help="model name (default: the first one GET /v1/models lists)")
    ap.add_argument("--api-key", default=None,
                    help="sent as 'Authorization: Bearer KEY' (--api proserve: for classes without a "
                         "--class-key / --keys entry)")
    ap.add_argument("--class-key", action="append", default=[], metavar="CLASS=KEY",
                    help="--api proserve: the API key of one class's requests (repeatable; over --keys)")
    ap.add_argument("--keys", default=None, metavar="FILE",
                    help="--api proserve: the dispatcher's keys file (TOML, or .json; [[keys]] key, client, "
                         "class): each class uses the first key of that class")
    ap.add_argument("--rate", type=float, default=None,
                    help="mean arrival rate, req/s (default: the trace's own timing)")
    ap.add_argument("--arrivals", choices=ARRIVAL_MODES, default="trace",
                    help="'trace' (default): the trace's timestamps, scaled to --rate; 'poisson': seeded "
                         "exponential gaps of mean 1/--rate (needs --rate), lengths from the trace rows")
    add_workload_args(ap)
    c = ap.add_argument_group("requests")
    c.add_argument("--stream-fraction", type=float, default=1.0, metavar="F",
                   help="fraction of requests sent streamed, in [0, 1] (default 1); the others, chosen by "
                        "--seed, are sent with \"stream\": false and all their tokens are timestamped when "
                        "the response arrives")
    c.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                   help=f"prompt token ids are drawn below this (default {DEFAULT_VOCAB}, the tiny model)")
    c.add_argument("--token-low", type=int, default=DEFAULT_TOKEN_LOW,
                   help=f"lowest prompt token id (default {DEFAULT_TOKEN_LOW}: skips pad/bos/eos)")
    c.add_argument("--no-xargs", action="store_true",
                   help="--api vllm: do not send vllm_xargs (priority_class, weight, SLOs, arrival_time), "
                        "e.g. for stock vLLM scheduling")
    c.add_argument("--no-token-ids", action="store_true",
                   help="do not ask for token_ids; count one token per non-empty text chunk "
                        "(unstreamed: usage.completion_tokens)")
    c.add_argument("--body", default=None, metavar="JSON", help="extra fields merged into every request body")
    c.add_argument("--class-body", action="append", default=[], metavar="CLASS=JSON",
                   help="extra body fields of one class's requests, e.g. high='{\"priority\": 0}' (repeatable)")
    c.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds (default 600)")
    o = ap.add_argument_group("output")
    o.add_argument("--out", default=None, help="directory for requests.jsonl, summary.json and the plots")
    o.add_argument("--plots", action=argparse.BooleanOptionalAction, default=None,
                   help="write ttft_cdf.png, tpot_cdf.png and classes.png into --out (default: on when "
                        "matplotlib imports and --out is given)")
    o.add_argument("--from-records", default=None, metavar="PATH",
                   help="send nothing: re-score a run's requests.jsonl (or its directory) and print its "
                        "table (plots into --out if given); --w-p/--w-d as for the run")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def client_config(args) -> ClientConfig:
    class_body: dict[str, dict] = {}
    for item in args.class_body:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--class-body expects CLASS=JSON, got {item!r}")
        v = _json_arg(text, f"--class-body {name}")
        if not isinstance(v, dict):
            raise ConfigError(f"--class-body {name}: must be a JSON object")
        deep_merge(class_body.setdefault(name, {}), v)
    body = _json_arg(args.body, "--body") if args.body else {}
    if not isinstance(body, dict):
        raise ConfigError("--body must be a JSON object")
    validate.positive("", "--timeout", args.timeout)
    validate.fraction("", "--stream-fraction", args.stream_fraction)
    return ClientConfig(base_url=args.url, model=args.model, api_key=args.api_key, vocab=args.vocab,
                        token_low=args.token_low, seed=args.seed, send_xargs=not args.no_xargs,
                        return_token_ids=not args.no_token_ids, body=body, class_body=class_body,
                        request_timeout=args.timeout, api=args.api,
                        class_keys=parse_class_keys(args.class_key, args.keys),
                        stream_fraction=args.stream_fraction)


def _dist(text: str | None, flag: str) -> LengthDist | None:
    if text is None:
        return None
    try:
        return LengthDist.parse(text)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None


def workload_from_args(args, rate: float | None) -> list[Request]:
    return workload_and_links(args, rate)[0]


def workload_and_links(args, rate: float | None) -> tuple[list[Request], list[TurnLink] | None]:
    """The workload of the flags and, with ``--multi-turn``, its turn links (else None)."""
    classes = load_classes(args.classes, args.ttft_slo, args.tpot_slo)
    multi = args.multi_turn
    if args.prefix_block_tokens is not None:
        validate.integer("", "--prefix-block-tokens", args.prefix_block_tokens)
    synth_only = [f for f, v in (("--turns", args.turns), ("--message-len", args.message_len),
                                 ("--answer-len", args.answer_len)) if v is not None]
    if not multi:
        used = [f for f, bad in (("--conversations", args.conversations is not None),
                                 ("--think-time", args.think_time != 0.0)) if bad] + synth_only
        if used:
            raise ConfigError(f"{', '.join(used)}: only with --multi-turn")
        n = DEFAULT_NUM_REQUESTS if args.num_requests is None else args.num_requests
        return make_workload(args.trace, rate, n, args.seed, classes, args.trace_format,
                             args.prompt_div, args.output_div, args.max_prompt, args.max_model_len,
                             args.arrivals, args.prefix_block_tokens), None
    if args.num_requests is not None:
        raise ConfigError("--num-requests does not apply to --multi-turn (pass --conversations N)")
    if args.arrivals != "trace":
        raise ConfigError("--arrivals does not apply to --multi-turn (conversations start as a Poisson "
                          "process at --rate; later turns follow their answers)")
    if args.trace == "azure":
        raise ConfigError("--multi-turn needs --trace synthetic or a ShareGPT JSON file")
    if args.trace != "synthetic":
        if args.trace_format not in (None, "sharegpt"):
            raise ConfigError(f"--multi-turn reads ShareGPT conversations, not --format {args.trace_format}")
        if synth_only:
            raise ConfigError(f"{', '.join(synth_only)}: only with --trace synthetic")
    validate.non_negative("", "--think-time", args.think_time)
    n = DEFAULT_CONVERSATIONS if args.conversations is None else args.conversations
    validate.integer("", "--conversations", n)
    return make_conversation_workload(
        args.trace, rate, n, args.seed, classes, args.prompt_div, args.output_div, args.max_prompt,
        args.max_model_len, args.think_time, args.prefix_block_tokens,
        _dist(args.turns, "--turns"), _dist(args.message_len, "--message-len"),
        _dist(args.answer_len, "--answer-len"))


def want_plots(args) -> bool:
    """``--plots`` / ``--no-plots`` / default (on with matplotlib and --out)."""
    if args.plots is False:
        return False
    if args.plots is None:
        return args.out is not None and have_matplotlib()
    if not args.out:
        raise ConfigError("--plots writes PNG files into --out: pass --out DIR")
    if not have_matplotlib():
        raise ConfigError("--plots needs matplotlib (pip install 'proserve[plot]'); or pass --no-plots")
    return True


def _rescore(args, plots: bool) -> int:
    reqs, _, records = load_records(args.from_records)
    summary = report_from_records(args.from_records, workload_gain(reqs, args.w_p, args.w_d))
    print(format_summary(summary))
    if plots:
        paths = write_plots(args.out, records, summary)
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 1 if summary["metrics"]["all"]["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plots = want_plots(args)
        if args.from_records:
            return _rescore(args, plots)
        if not args.url:
            raise ConfigError("--url is required (or --from-records PATH to re-score a run)")
        if args.rate is not None:
            validate.positive("", "--rate", args.rate)
        cfg = client_config(args)
        reqs, links = workload_and_links(args, args.rate)
        known = {r.priority for r in reqs} | set(load_classes(args.classes))
        for flag, names in (("--class-body", cfg.class_body),
                            ("--class-key", [i.partition("=")[0] for i in args.class_key])):
            unknown = sorted(set(names) - known)
            if unknown:
                raise ConfigError(f"{flag}: unknown class(es) {', '.join(unknown)} "
                                  f"(classes: {', '.join(sorted(known))})")
        cfg.check(r.priority for r in reqs)
        gain = workload_gain(reqs, args.w_p, args.w_d)
        progress = None if args.quiet else Progress(len(reqs))
        try:
            run = asyncio.run(replay(reqs, cfg, progress, links))
        finally:
            if progress is not None:
                progress.close()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize_run(reqs, run.results, gain, run.stalls)
    print(format_summary(summary))
    print(f"{len(reqs)} requests in {run.wall_s:.1f} s")
    if args.out:
        meta = {"url": args.url, "api": args.api, "rate": args.rate, "arrivals": args.arrivals,
                "stream_fraction": args.stream_fraction, "trace": args.trace,
                "multi_turn": bool(args.multi_turn),
                "argv": sys.argv[1:] if argv is None else argv}
        records = write_outputs(args.out, reqs, run, gain, summary, meta, links)
        print(f"wrote {args.out}/requests.jsonl and summary.json")
        if plots:
            try:
                paths = write_plots(args.out, records, clean_json(summary))
                print(f"wrote {', '.join(p.name for p in paths)}")
            except Exception as e:   # a plot must not lose a run whose results are written
                print(f"error: plots not written: {type(e).__name__}: {e}", file=sys.stderr)
    return 1 if summary["metrics"]["all"]["errors"] else 0
