#!/usr/bin/env bash
# Stop the workers started by launch_prefill.sh / launch_decode.sh.
#   scripts/stop_pool.sh [-d RUN_DIR] [prefill|decode]   (default: both)
set -uo pipefail
run=run; only=""
while [[ $# -gt 0 ]]; do
  case $1 in
    -d) run=$2; shift 2 ;;
    prefill|decode) only=$1; shift ;;
    *) echo "error: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -f $run/pids ]] || { echo "nothing to stop: no $run/pids"; exit 0; }
keep=()
while read -r pid role i port; do
  if [[ -n $only && $role != "$only" ]]; then keep+=("$pid $role $i $port"); continue; fi
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    echo "stopped $role worker $i (pid $pid)"
  fi
done < "$run/pids"
if ((${#keep[@]})); then printf '%s\n' "${keep[@]}" > "$run/pids"; else rm -f "$run/pids"; fi
