#!/usr/bin/env bash
# Start N decode workers on this host.
#   scripts/launch_decode.sh [-n N] [-p BASE_PORT] [-k KV_BASE_PORT] [-d RUN_DIR] [-- extra `python -m proserve.decode` flags]
# Worker i serves HTTP on BASE_PORT+i (default 8200+i) and receives KV on
# tcp://127.0.0.1:KV_BASE_PORT+i (default 15600+i). Logs: RUN_DIR/decode-i.log, PIDs: RUN_DIR/pids.
exec "$(dirname "$0")/_launch_pool.sh" decode 8200 "$@"
