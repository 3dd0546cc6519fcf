#!/usr/bin/env bash
# Shared body of launch_prefill.sh / launch_decode.sh: ROLE DEFAULT_BASE_PORT [options].
set -euo pipefail
role=$1; base=$2; shift 2
n=1; kvbase=15600; run=run
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) n=$2; shift 2 ;;
    -p) base=$2; shift 2 ;;
    -k) kvbase=$2; shift 2 ;;
    -d) run=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,6p' "$(dirname "$0")/launch_${role}.sh"; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $n =~ ^[1-9][0-9]*$ ]] || { echo "error: -n must be a positive integer, got '$n'" >&2; exit 2; }
mkdir -p "$run"
cd "$(dirname "$0")/.."
for ((i = 0; i < n; i++)); do
  port=$((base + i))
  args=(--port "$port")
  [[ $role == decode ]] && args+=(--kv-listen "tcp://127.0.0.1:$((kvbase + i))")
  log="$run/$role-$i.log"
  nohup python3 -m "$role" "${args[@]}" "$@" > "$log" 2>&1 &
  echo "$! $role $i $port" >> "$run/pids"
  echo "started $role worker $i: pid $! http://127.0.0.1:$port log $log"
done
