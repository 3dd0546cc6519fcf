#!/usr/bin/env bash
# Stop a cluster started by scripts/launch_cluster.sh (dispatcher first, then the workers).
#   scripts/stop_cluster.sh [-d RUN_DIR] [-t GRACE_SECONDS]
# Every recorded process group gets SIGTERM -- whether or not its leader still
# lives, so the vLLM engine processes of a worker whose API server died are
# stopped too -- then SIGKILL after the grace period (default 30 s). It waits
# until each group is empty and says what it stopped. Exit status 0 when
# nothing is left running, 1 otherwise (the pid file is then kept).
set -uo pipefail
run=run; grace=30
while [[ $# -gt 0 ]]; do
  case $1 in
    -d) run=$2; shift 2 ;;
    -t) grace=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $grace =~ ^[0-9]+$ ]] || { echo "error: -t must be a whole number of seconds, got '$grace'" >&2; exit 2; }
[[ -f $run/pids ]] || { echo "nothing to stop: no $run/pids"; exit 0; }
# the live (not zombie) processes of group $1: a zombie holds nothing but its pid and
# goes when its parent reaps it
live() { ps -eo pid=,pgid=,stat= | awk -v g="$1" '$2 == g && $3 !~ /^Z/ {print $1}'; }
alive() { [[ -n $(live "$1") ]]; }
members() { live "$1" | wc -l; }
wait_empty() {  # pgid seconds
  local end=$((SECONDS + $2)) reaped=$((SECONDS + 5))
  while alive "$1" && ((SECONDS < end)); do sleep 0.2; done
  alive "$1" && return 1
  # gone but for zombies: give their parent (init, for an orphaned worker) a moment to reap them
  while kill -0 -- "-$1" 2>/dev/null && ((SECONDS < reaped)); do sleep 0.1; done
  return 0
}
stop() {  # pgid what
  local g=$1 what=$2 n
  if ! alive "$g"; then echo "$what (group $g): not running"; return 0; fi
  n=$(members "$g")
  kill -TERM -- "-$g" 2>/dev/null
  if wait_empty "$g" "$grace"; then
    echo "stopped $what (group $g, $n processes)"
  else
    kill -KILL -- "-$g" 2>/dev/null
    if wait_empty "$g" 10; then
      echo "killed $what (group $g, $n processes) after ${grace} s"
    else
      echo "error: $what (group $g) still has processes: $(live "$g" | tr '\n' ' ')" >&2
    fi
  fi
}
# the dispatcher first, so that no new request reaches a stopping worker
while read -r pid role i port; do stop "$pid" "$role"; done < <(awk '$2 == "dispatcher"' "$run/pids")
while read -r pid role i port; do stop "$pid" "$role worker $i"; done < <(awk '$2 != "dispatcher"' "$run/pids")
left=0
while read -r pid role i port; do
  alive "$pid" && { echo "still running: $role $i (group $pid)" >&2; left=1; }
done < "$run/pids"
((left)) || rm -f "$run/pids"
exit $left
