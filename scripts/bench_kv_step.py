#!/usr/bin/env python3
"""A prefill engine's step time with and without a KV transfer in flight.

One vLLM prefill engine (the KV producer, ProServe's connector and scheduler
plugin with vLLM's own decisions, ``stock``) runs a model of random weights
whose KV is large for its compute (default: 8 layers, 8 KV heads of 128 in
float32 over a hidden size of 128: 64 KiB of KV per token), one prompt of
``--prompt`` tokens per step (default 1,024: 64 MiB of KV per step, the size of
the sender's credit window). A bare ``KVReceiver`` in another process takes the KV (the decode side,
without an engine, so that only the producer's step is measured). In the same
run it alternates, request by request:

* ``none``: prompts without ``kv_transfer_params`` (no transfer);
* ``plain``: each with a transfer to the receiver, no encryption;
* ``curve``: the same over CURVE (a second engine and receiver, with keys);

in blocks of ``--block`` steps (a transfer is still in flight during the step
after the one that made it, so each block's first step is not counted), for
``--requests`` blocks of each kind after ``--warmup``. The figure per column is
the median of the engine's own step times (the plugin's step record: from the
end of ``schedule()`` to ``update_from_output()``, which is where
``save_kv_layer``, ``wait_for_save`` and ``get_transfer_results`` run); the
ratio column is each against ``none`` of the same engine. ``in KV hooks`` is the
time the forward thread itself spent in those three hooks per step that sent
(``scripts/bench_kv_hooks.py`` times them): what the forward pass waited for
the KV path, whatever else the host was doing. On a 2-core host the step time
also carries the sending threads' CPU (ZeroMQ's I/O thread, CURVE, the
receiver process), which on a GPU host run on cores the forward pass does not
use; the hook time is the figure that moves with the design.

``--kv-package DIR`` runs another copy of ``kvtransfer`` (a directory holding
an importable package, e.g. an older commit's ``kvtransfer`` copied to
``DIR/oldkv``, given as ``DIR:oldkv``) on both sides: how the "before" rows of
the results were measured.

    python scripts/bench_kv_step.py [--requests 8] [--prompt 1024] [--out FILE]

The engine is bound to core 0 and the receiver to core 1 where there are two.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def model_dir(root: Path, layers: int, kv_heads: int, head_dim: int, hidden: int) -> Path:
    d = root / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": kv_heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": 1024,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}))
    return d


RECEIVER = textwrap.dedent("""
    import importlib, sys, time
    pkg, addr, keys = sys.argv[1], sys.argv[2], sys.argv[3]
    R = importlib.import_module(pkg + ".receiver")
    curve = importlib.import_module(pkg + ".auth").ServerKeys.load(keys) if keys else None
    rx = R.KVReceiver(addr, curve=curve, max_held_bytes=4 << 30, max_peer_bytes=4 << 30)
    print("ready", flush=True)
    while True:
        for x in rx.completed():
            rx.take(x)
        time.sleep(0.01)
""")


def start_receiver(pkg: str, addr: str, keys: str, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-c", RECEIVER, pkg, addr, keys]
    if os.cpu_count() and os.cpu_count() >= 2:
        cmd = ["taskset", "-c", "1"] + cmd
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    line = p.stdout.readline()
    if "ready" not in line:
        raise RuntimeError("the receiver did not start")
    return p


def run_engine(args, pkg: str, keys: str, record: Path, model: Path, addr: str) -> dict[str, list[float]]:
    """One engine; alternates none / transfer per request; -> step times per kind."""
    from vllm import LLM, SamplingParams

    from proserve.scheduler.request import ConfigError  # noqa: F401  (the plugin's package imports)
    extra = {"timeout_s": 60, "max_staged_mib": 1024}
    hooks = record.with_suffix(".hooks.jsonl")
    os.environ.update(PROSERVE_BENCH_KV_PKG=pkg, PROSERVE_BENCH_HOOKS_OUT=str(hooks),
                      PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")]))
    if keys:
        extra["keys_dir"] = keys
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              dtype="float32", enforce_eager=True, max_num_batched_tokens=max(4096, args.prompt),
              enable_prefix_caching=False,
              scheduler_cls="proserve.prefill.engine_scheduler.ProServeScheduler", async_scheduling=False,
              additional_config={"proserve": {"local_policy": "stock", "record_steps": str(record)}},
              kv_transfer_config={"kv_connector": "ProServeConnector",
                                  "kv_connector_module_path": "bench_kv_hooks", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": extra})
    kinds: dict[int, str] = {}     # the request's number (vLLM numbers requests in order) -> its kind
    # blocks of --block steps, alternating none / xfer: a transfer is still in flight during the
    # step after the one that made it, so each block's first step (the transition) is not counted
    n_blocks = 2 * (args.warmup + args.requests)
    for i in range(n_blocks * args.block):
        blk = i // args.block
        kind = "none" if blk % 2 == 0 else "xfer"
        counted = i % args.block != 0 and blk >= 2 * args.warmup
        extra = None
        if kind == "xfer":   # how vLLM takes kv_transfer_params offline (vllm/v1/request.py)
            extra = {"kv_transfer_params": {"do_remote_decode": True, "xfer_id": f"b{time.time_ns()}-{i}",
                                            "remote_addr": addr}}
        llm.generate([{"prompt_token_ids": [(7 * i + j) % 1000 + 3 for j in range(args.prompt)]}],
                     SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=extra),
                     use_tqdm=False)
        kinds[i] = kind if counted else "skip"
    time.sleep(1.0)   # the last acks
    del llm
    steps = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    out: dict[str, list[float]] = {"none": [], "xfer": [], "skip": [], "hooks": []}
    for s in steps:
        if len(s["prefills"]) != 1 or not s["admitted"] or s["prefills"][0][0] != args.prompt:
            continue   # only whole prompts, one per step
        n = int(str(s["admitted"][0][0]).split("-")[0])
        out[kinds.get(n, "skip")].append(s["time"])
    for line in hooks.read_text().splitlines():
        h = json.loads(line)
        if h["saves"]:
            out["hooks"].append(h["save_s"] + h["wait_s"] + h["finished_s"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4, help="measured blocks per column (default 4)")
    ap.add_argument("--block", type=int, default=5, help="steps per block (default 5; its first is not counted)")
    ap.add_argument("--warmup", type=int, default=1, help="blocks of each kind not counted (default 1)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-package", default=None, metavar="DIR:PACKAGE",
                    help="another copy of kvtransfer to run on both sides (default: this checkout's)")
    ap.add_argument("--no-curve", action="store_true", help="skip the CURVE engine")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--out", default=None, help="append the table here too")
    args = ap.parse_args(argv)
    env = dict(os.environ)
    pkg = "proserve.kvtransfer"
    if args.kv_package:
        d, _, pkg = args.kv_package.partition(":")
        env["PYTHONPATH"] = d + os.pathsep + env.get("PYTHONPATH", "")
        sys.path.insert(0, d)
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0")
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-step-"))
    model = model_dir(tmp, args.layers, args.kv_heads, args.head_dim, args.hidden)
    kv_per_token = args.layers * 2 * args.kv_heads * args.head_dim * 4
    rows = []
    variants = [("plain", "")]
    if not args.no_curve:
        keys = tmp / "keys"
        subprocess.run([sys.executable, "-c", f"import sys; from {pkg}.keys import main; sys.exit(main())",
                        str(keys)], check=True, env=env, stdout=subprocess.DEVNULL)
        variants.append(("curve", str(keys)))
    from proserve.kvtransfer.transport import free_port
    for name, keys in variants:
        addr = f"tcp://127.0.0.1:{free_port()}"
        rx = start_receiver(pkg, addr, keys, env)
        try:
            times = run_engine(args, pkg, keys, tmp / f"steps-{name}.jsonl", model, addr)
        finally:
            rx.kill()
            rx.wait()
        base = statistics.median(times["none"])
        hook = statistics.median(times["hooks"]) if times["hooks"] else float("nan")
        if name == "plain":
            rows.append(("none", base, 1.0, None, len(times["none"])))
        rows.append((name, statistics.median(times["xfer"]), statistics.median(times["xfer"]) / base, hook,
                     len(times["xfer"])))
        if name == "curve":
            rows.append(("none (curve engine)", base, 1.0, None, len(times["none"])))
    mib = kv_per_token * args.prompt / MIB
    lines = [f"# prefill step time, {args.label}: one {args.prompt}-token prompt per step, {mib:.0f} MiB of KV "
             f"({args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}, float32)",
             "| transfer in flight | median step (ms) | vs none | in KV hooks (ms) | steps |",
             "|---|---:|---:|---:|---:|"]
    for name, t, r, hook, n in rows:
        lines.append(f"| {name} | {1000 * t:.1f} | {r:.2f}x | {'' if hook is None else f'{1000 * hook:.1f}'} | {n} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
