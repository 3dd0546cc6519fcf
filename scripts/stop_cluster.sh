#!/usr/bin/env bash
# Stop a cluster started by scripts/launch_cluster.sh (dispatcher first, then the workers).
#   scripts/stop_cluster.sh [-d RUN_DIR]
# Each process gets SIGTERM (its whole process group: vLLM's engine processes too),
# then SIGKILL after 30 s. Exit status 0 when nothing is left running.
set -uo pipefail
run=run
while [[ $# -gt 0 ]]; do
  case $1 in
    -d) run=$2; shift 2 ;;
    -h|--help) sed -n '2,5p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -f $run/pids ]] || { echo "nothing to stop: no $run/pids"; exit 0; }
stop() {  # pid what
  local pid=$1 what=$2
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"
    echo "killed $what (pid $pid) after 30 s"
  else
    echo "stopped $what (pid $pid)"
  fi
  # the group's leftovers (vLLM engine-core processes), if any
  kill -KILL -- "-$pid" 2>/dev/null || true
}
# the dispatcher first, so that no new request reaches a stopping worker
awk '$2 == "dispatcher"' "$run/pids" | while read -r pid role i port; do stop "$pid" "$role"; done
awk '$2 != "dispatcher"' "$run/pids" | while read -r pid role i port; do stop "$pid" "$role worker $i"; done
left=0
while read -r pid role i port; do
  kill -0 "$pid" 2>/dev/null && { echo "still running: $role $i (pid $pid)" >&2; left=1; }
done < "$run/pids"
((left)) || rm -f "$run/pids"
exit $left
