"""``python -m proserve.dispatcher``: start the ProServe dispatcher."""

from __future__ import annotations

import argparse
import logging
import sys

from proserve.scheduler.admission import parse_actions
from proserve.scheduler.config import classes_from_dicts, overload_actions_from_dicts, parse_key_values
from proserve.scheduler.registry import global_names
from proserve.scheduler.request import ConfigError
from proserve.scheduler.tdg import GainConfig

from .config import (
    DecodeSpec,
    DispatcherConfig,
    PrefillSpec,
    check_local_policy,
    check_open_access,
    load_config,
    load_keys,
    read_file,
)

EPILOG = """\
examples:
  # 1 prefill + 1 decode worker on this host (scripts/launch_cluster.sh starts all three)
  python -m proserve.dispatcher --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200=tcp://127.0.0.1:15600
  # everything from a file (TOML or JSON; see dispatcher/config.py), API keys from another
  python -m proserve.dispatcher --config cluster.toml --keys keys.toml
  # co-located instances (whole requests on one engine), Min-Load routing
  python -m proserve.dispatcher --deployment colocated --prefill http://127.0.0.1:8100 --global-policy min_load
  # workers started with an API key (their --api-key-file): the dispatcher sends it on every call
  python -m proserve.dispatcher --config cluster.toml --keys keys.toml --worker-key-file secrets/worker.key

requests: POST /v1/completions or /v1/chat/completions with 'Authorization: Bearer <key>'; optional
fields "priority": "<class>" and "slo": {"ttft_ms": 500, "tpot_ms": 50} within what the key allows.

limits: the key is checked before the body is read; bodies over --max-body-mb get 413, bodies that
take longer than --body-timeout 408, connections that do not send their headers within
--header-timeout are closed; over --max-concurrent requests in progress (or --max-concurrent-per-key
for one client) get 429 with Retry-After. Every error is an OpenAI-style JSON object.

admission control (off by default): when no instance can serve a request within its TTFT SLO
(GoRouting's estimate, whatever --global-policy), its class's --on-overload action applies:
queue (default), reject (429 with Retry-After before any prefill work) or downgrade (served in the
next class down by weight; the response says so in x-proserve-priority and
x-proserve-downgraded-from). --max-queued-requests/--max-queued-tokens cap what waits for prefill
per instance (every instance full: 429). /metrics: proserve:dispatcher_admission_total{priority,
decision, reason}.
  python -m proserve.dispatcher --config cluster.toml --keys keys.toml --on-overload low=reject

dynamic membership: with --admin-key-file (a file holding a key of 16+ characters, not a client key)
the admin API adds, drains and removes workers at run time; without it /admin/* answers 403.
  curl -H "Authorization: Bearer $(cat admin.key)" http://127.0.0.1:8000/admin/workers
  curl -H "Authorization: Bearer $(cat admin.key)" -H 'content-type: application/json' \\
       -d '{"role": "decode", "url": "http://10.0.0.8:8200", "kv_addr": "tcp://10.0.0.8:15600"}' \\
       http://127.0.0.1:8000/admin/workers
  curl -X POST -H "Authorization: Bearer $(cat admin.key)" http://127.0.0.1:8000/admin/workers/p1/drain
  curl -X DELETE -H "Authorization: Bearer $(cat admin.key)" http://127.0.0.1:8000/admin/workers/p1
A drained worker takes no new requests and finishes its own; DELETE answers 409 while requests run
there (?force=true removes it anyway and lets them finish there). [[discover]] entries in the config
(role, host, port, kv_port, interval_s) re-resolve a DNS name (a Kubernetes headless service) and
add/drain/remove workers as its addresses change; see dispatcher/membership.py. A worker added
there gets the worker key and the prompts routed to it: --worker-hosts 10.0.0.0/8,*.svc.cluster.local
limits where such workers may be (others: 403, and discovery logs them and leaves them out).
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m proserve.dispatcher", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="ProServe global dispatcher: an OpenAI-compatible HTTP API that routes each "
                    "priority-tagged request to a prefill/decode pair (GoRouting by default), drives the "
                    "KV hand-off, streams tokens back and reports TDG and SLO metrics on /metrics.")
    ap.add_argument("--config", help="cluster config file (TOML or JSON): instances, classes, gain, policy; "
                                     "the flags below override it")
    ap.add_argument("--keys", help="API-key file (TOML or JSON): key -> client, class, allowed SLO ranges. "
                                   "Without it access is open (a warning is logged) and only a loopback --host "
                                   "is allowed (see --allow-open-access)")
    ap.add_argument("--host", help="bind address (default 127.0.0.1; expose deliberately: another address "
                                   "needs --keys, or --allow-open-access)")
    ap.add_argument("--allow-open-access", action="store_true", default=None,
                    help="listen on a non-loopback --host without --keys (any client that reaches the port "
                         "may use any class; a trusted network only; config: allow_open_access = true)")
    ap.add_argument("--port", type=int, help="port (default 8000)")
    ap.add_argument("--prefill", action="append", default=[],
                    metavar="URL[,latency_model=PATH][,local_policy=NAME][,kv_events=ADDR][,publish=ADDR]",
                    help="a prefill (or co-located) worker; repeatable. local_policy: the worker's --local-policy "
                         "(default slide_batching), whose queue order GoRouting's estimate assumes; kv_events: "
                         "where it publishes its KV-cache events (its --kv-events-port, e.g. "
                         "tcp://127.0.0.1:5557): its prefix index then follows its engine's cache exactly; "
                         "publish: where it publishes its queued prefill work (its --publish-queue-port), for "
                         "several dispatchers")
    ap.add_argument("--decode", action="append", default=[], metavar="URL=KV_ADDR",
                    help="a decode worker and the ZeroMQ address it receives KV on (its --kv-listen); repeatable")
    ap.add_argument("--deployment", choices=["disaggregated", "colocated"],
                    help="disaggregated (prefill + decode pools, default) or colocated (whole requests on "
                         "the --prefill instances)")
    ap.add_argument("--global-policy", help=f"routing policy (default go_routing); one of: "
                                            f"{', '.join(global_names())}")
    ap.add_argument("--global-param", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument of the routing policy, e.g. alpha=0.9, or order=deadline for "
                         "GoRouting with the paper's estimate (VALUE parsed as JSON)")
    ap.add_argument("--latency-model", help="latency-model JSON for instances that name none "
                                            "(default: profiler/models/tiny-llama-cpu.json)")
    ap.add_argument("--classes", help="JSON file: [{\"name\", \"weight\", \"ttft_slo\", \"tpot_slo\"[, "
                                      "\"on_overload\"]}, ...] "
                                      "(seconds; default high w=2 / low w=1, TTFT 1 s, TPOT 0.1 s)")
    ap.add_argument("--default-class", help="class of requests that name none with open access "
                                            "(default: the lowest-weight class)")
    ap.add_argument("--w-p", type=float, help="TDG weight of the first token (Eq. 3; default 1)")
    ap.add_argument("--w-d", type=float, help="TDG weight of each later token (default 1)")
    ap.add_argument("--model", help="served model name (default: what the workers report)")
    ap.add_argument("--record-requests", metavar="PATH", help="append one JSON line per finished request")
    ap.add_argument("--health-interval", type=float, help="seconds between health checks (default 1)")
    ap.add_argument("--health-timeout", type=float, help="seconds a worker's /health (and /metrics) may take "
                                                         "(default 5; a slow /health of a worker whose requests "
                                                         "are progressing is not a failure)")
    ap.add_argument("--request-timeout", type=float, help="seconds a request may take in all (default 600); "
                                                          "the only limit on an unstreamed answer")
    ap.add_argument("--stream-idle-timeout", type=float, metavar="SECONDS",
                    help="longest silence between two events of a worker's stream (default 60); the "
                         "request then ends (504) but the worker stays in service")
    ap.add_argument("--max-body-mb", type=float, help="largest request body in MB (default 16; 413 above)")
    ap.add_argument("--header-timeout", type=float, metavar="SECONDS",
                    help="a client connection must send its request headers within this (default 10)")
    ap.add_argument("--body-timeout", type=float, metavar="SECONDS",
                    help="... and its whole body within this after them (default 30; 408)")
    ap.add_argument("--max-concurrent", type=int, metavar="N",
                    help="requests in progress at once, overall (default 1024; 429 above)")
    ap.add_argument("--max-concurrent-per-key", type=int, metavar="N",
                    help="requests in progress at once per client of the keys file (default 256; 429 above)")
    ap.add_argument("--on-overload", action="append", default=[], metavar="CLASS=ACTION",
                    help="what CLASS does with a request no instance can serve within its TTFT SLO: queue "
                         "(default), reject (429 + Retry-After, before any prefill work) or downgrade (serve it "
                         "in the next class down by weight); repeatable or comma-separated, e.g. low=reject; "
                         "overrides on_overload in the config's classes")
    ap.add_argument("--max-queued-requests", type=int, metavar="N",
                    help="an instance with N requests waiting for prefill takes no more; a request finding "
                         "every instance so gets 429 (default: no cap)")
    ap.add_argument("--max-queued-tokens", type=int, metavar="N",
                    help="... likewise with N prompt tokens waiting for prefill (default: no cap)")
    ap.add_argument("--shutdown-timeout", type=float, metavar="SECONDS",
                    help="on SIGINT/SIGTERM, how long requests in progress may still run (default 30)")
    ap.add_argument("--worker-key-file", metavar="PATH",
                    help="file holding the API key the workers demand (sent as 'Authorization: Bearer' on "
                         "every call to them); default: $PROSERVE_WORKER_API_KEY if set, else no key")
    ap.add_argument("--admin-key-file", metavar="PATH",
                    help="file holding the admin API key (16+ characters; not a client key): turns on "
                         "/admin/workers to add, drain and remove workers at run time (default: off, 403)")
    ap.add_argument("--worker-hosts", metavar="HOST[,HOST...]",
                    type=lambda v: [h.strip() for h in v.split(",") if h.strip()],
                    help="where workers added at run time (admin API, discovery) may be: IP addresses, "
                         "networks (10.0.0.0/8), DNS names and *.suffix patterns, matched against the host of "
                         "each of their addresses (URL, kv_addr, kv_events, publish) as written; others get 403 "
                         "(default: anywhere; config: worker_hosts)")
    ap.add_argument("--no-prefix-index", dest="prefix_index", action="store_false", default=None,
                    help="keep no index of the prefill workers' prefix caches: route as if no prompt were "
                         "cached (default: an index of the prompts' KV blocks routed to each worker, sized by "
                         "its KV memory from its /metrics, so GoRouting and the cache-aware policies weigh the "
                         "prefix a request would find there; config: prefix_index = false)")
    ap.add_argument("--kv-events-keys", metavar="DIR",
                    help="CURVE client keys for the prefill workers' KV-cache events (kv_events=): "
                         "client.key_secret and the workers' server.key, layout of `python -m "
                         "proserve.kvtransfer.keys DIR`; required for a non-loopback kv_events address "
                         "(config: kv_events_keys; kv_events_insecure = true goes without, on a trusted network)")
    pub = ap.add_argument_group(
        "several dispatchers (issue 15)",
        "Each prefill worker started with --publish-queue-port publishes its queued prefill work; a "
        "dispatcher reading it (publish = \"tcp://HOST:PORT\" in the worker's [[prefill]] entry, or "
        "--prefill URL,publish=ADDR) routes on the publication plus its own dispatches, so that several "
        "dispatchers in front of the same workers see each other's requests.")
    pub.add_argument("--publication-keys", metavar="DIR",
                     help="CURVE client keys for the workers' queue publications: client.key_secret and the "
                          "workers' server.key (layout of `python -m proserve.kvtransfer.keys DIR`); required for "
                          "a non-loopback publish address (config: publication_keys; publication_insecure = true "
                          "goes without, on a trusted network)")
    pub.add_argument("--publication-interval", type=float, metavar="SECONDS",
                     help="the workers' --publish-interval (default 0.1; config: publication_interval_s)")
    pub.add_argument("--publication-stale-intervals", type=int, metavar="K",
                     help="a worker with no publication for K intervals is routed on this dispatcher's own "
                          "view of it until the next (default 5; config: publication_stale_intervals)")
    ap.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS",
                    help="at start, wait up to this long for every instance to answer (default: don't)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def config_from_args(args) -> DispatcherConfig:
    cfg = load_config(args.config) if args.config else DispatcherConfig()
    for attr, flag in (("host", "host"), ("port", "port"), ("allow_open_access", "allow_open_access"),
                       ("deployment", "deployment"),
                       ("global_policy", "global_policy"), ("default_class", "default_class"),
                       ("model", "model"), ("record_requests", "record_requests"),
                       ("health_interval_s", "health_interval"), ("health_timeout_s", "health_timeout"),
                       ("request_timeout_s", "request_timeout"), ("stream_idle_timeout_s", "stream_idle_timeout"),
                       ("max_body_mb", "max_body_mb"), ("header_timeout_s", "header_timeout"),
                       ("body_timeout_s", "body_timeout"), ("max_concurrent", "max_concurrent"),
                       ("max_concurrent_per_key", "max_concurrent_per_key"),
                       ("max_queued_requests", "max_queued_requests"), ("max_queued_tokens", "max_queued_tokens"),
                       ("shutdown_timeout_s", "shutdown_timeout"),
                       ("worker_api_key_file", "worker_key_file"), ("prefix_index", "prefix_index"),
                       ("admin_key_file", "admin_key_file"), ("latency_model", "latency_model"),
                       ("worker_hosts", "worker_hosts"),
                       ("kv_events_keys", "kv_events_keys"),
                       ("publication_keys", "publication_keys"),
                       ("publication_interval_s", "publication_interval"),
                       ("publication_stale_intervals", "publication_stale_intervals")):
        v = getattr(args, flag)
        if v is not None:
            setattr(cfg, attr, v)
    if args.global_param:
        cfg.global_params = {**cfg.global_params, **parse_key_values(args.global_param, "--global-param")}
    if args.classes:
        items = _read_list(args.classes)
        cfg.classes = classes_from_dicts(items, f"--classes {args.classes}")
        cfg.on_overload = overload_actions_from_dicts(items, f"--classes {args.classes}")
    if args.on_overload:
        cfg.on_overload = {**cfg.on_overload, **parse_actions(args.on_overload)}
    if args.w_p is not None or args.w_d is not None:
        cfg.gain = GainConfig(w_p=args.w_p if args.w_p is not None else cfg.gain.w_p,
                              w_d=args.w_d if args.w_d is not None else cfg.gain.w_d,
                              deadline=cfg.gain.deadline)
    for item in args.prefill:
        url, _, rest = item.partition(",")
        opts = parse_key_values([x for x in rest.split(",") if x], "--prefill") if rest else {}
        unknown = set(opts) - {"latency_model", "local_policy", "kv_events", "publish"}
        if unknown:
            raise ConfigError(f"--prefill {item!r}: unknown option(s) {', '.join(sorted(unknown))}")
        lp = check_local_policy(opts.get("local_policy", PrefillSpec.local_policy), f"--prefill {item!r}: local_policy")
        cfg.prefill.append(PrefillSpec(url, opts.get("latency_model"), local_policy=lp,
                                       kv_events=opts.get("kv_events", "")))
        cfg.prefill[-1].publish = opts.get("publish", "")   # issue 15: its queue publication address
    for item in args.decode:
        url, sep, kv = item.partition("=")
        if not sep:
            raise ConfigError(f"--decode expects URL=KV_ADDR (e.g. http://127.0.0.1:8200=tcp://127.0.0.1:15600), "
                              f"got {item!r}")
        cfg.decode.append(DecodeSpec(url, kv))
    if args.latency_model:
        for s in cfg.prefill:
            s.latency_model = s.latency_model or args.latency_model
    if args.prefill and not args.decode and args.deployment is None and not cfg.decode:
        raise ConfigError("no decode workers: add --decode URL=KV_ADDR, or --deployment colocated to serve "
                          "whole requests on the --prefill instances")
    cfg.validate("dispatcher config")
    return cfg


def _read_list(path: str) -> list:
    """A classes file: a JSON list, or a TOML/JSON table holding ``classes``."""
    try:
        data = read_file(path, allow_list=True)
    except ConfigError as e:
        raise ConfigError(f"--classes {e}") from None
    if isinstance(data, dict):
        data = data.get("classes")
    if not isinstance(data, list):
        raise ConfigError(f"--classes {path}: expected a list of classes (or a table with 'classes')")
    return data


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        keys = load_keys(args.keys, cfg.classes) if args.keys else None
        check_open_access(cfg, keys is not None)
        from .server import Dispatcher, create_app
        d = Dispatcher(cfg, keys)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from .server import uvicorn_config
    app = create_app(d, wait_s=args.wait_ready)
    logging.getLogger("proserve.dispatcher").info(
        "dispatcher on http://%s:%d: %s, policy %s, %d prefill + %d decode instances%s", cfg.host, cfg.port,
        cfg.deployment, cfg.global_policy, len(cfg.prefill), len(cfg.decode),
        ", with a worker key" if d.worker_key else "")
    if cfg.discover or d.admin_key:
        logging.getLogger("proserve.dispatcher").info(
            "dynamic membership: %d [[discover]] name(s), admin API %s", len(cfg.discover),
            "on" if d.admin_key else "off")
    uvicorn.Server(uvicorn_config(d, app, log_level=args.log_level if args.log_level != "info" else "warning")).run()
    return 0
