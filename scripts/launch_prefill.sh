#!/usr/bin/env bash
# Start N prefill workers on this host.
#   scripts/launch_prefill.sh [-n N] [-p BASE_PORT] [-d RUN_DIR] [-- extra `python -m proserve.prefill` flags]
# Worker i serves HTTP on BASE_PORT+i (default 8100+i). Logs go to RUN_DIR/prefill-i.log
# and PIDs to RUN_DIR/pids (default RUN_DIR: ./run); scripts/stop_pool.sh stops them.
exec "$(dirname "$0")/_launch_pool.sh" prefill 8100 "$@"
