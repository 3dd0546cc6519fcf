#!/usr/bin/env bash
# Start N decode workers on this host.
#   scripts/launch_decode.sh [-n N] [-p BASE_PORT] [-k KV_BASE_PORT] [-H BIND_ADDR] [--kv-host ADDR]
#                            [-d RUN_DIR] [-w SECONDS] [--secrets DIR | --api-key-file FILE --kv-keys DIR]
#                            [--tensor-parallel-size T] [--devices GROUPS]
#                            [--dry-run] [-- extra `python -m proserve.decode` flags]
# Worker i serves HTTP on BIND_ADDR:BASE_PORT+i (default 127.0.0.1:8200+i, loopback) and
# receives KV on tcp://KV_HOST:KV_BASE_PORT+i*T (default: BIND_ADDR, port 15600+i*T; its rank r
# on that port + r); give the dispatcher URL=tcp://ADDR:PORT (rank 0's) with this host's address.
# A non-loopback -H needs the API key the dispatcher sends (--api-key-file FILE, or
# '-- --allow-no-api-key' on a trusted network);
# a non-loopback KV address needs CURVE keys (--kv-keys DIR: a decode host needs
# DIR/server.key_secret and DIR/clients/; or '-- --kv-insecure').
# --secrets DIR: both from scripts/make_keys.sh's layout (DIR/worker.key, DIR/kv).
# -w SECONDS: wait (at most that long) until every worker answers /health; default: don't.
# --tensor-parallel-size T (or --tp T, default 1) and --devices GROUPS: as launch_prefill.sh.
# --dry-run: print the worker command lines, each after the variables it is started with; start nothing.
# Logs: RUN_DIR/decode-i.log, PIDs: RUN_DIR/pids (default RUN_DIR: ./run); scripts/stop_pool.sh stops them.
exec "$(dirname "$0")/_launch_pool.sh" decode 8200 "$@"
