#!/usr/bin/env bash
# Stop what launch_prefill.sh / launch_decode.sh / launch_dispatcher.sh started on this host.
#   scripts/stop_pool.sh [-d RUN_DIR] [-t GRACE_SECONDS] [prefill|decode|dispatcher ...]   (default: all)
# The dispatcher goes first (no new request then reaches a stopping worker). Each recorded
# process group gets SIGTERM -- the worker's vLLM engine processes with it -- then SIGKILL
# after the grace period (default 30 s). The stopped entries leave RUN_DIR/pids. Exit status
# 0 when nothing it was asked to stop still runs, 1 otherwise.
set -uo pipefail
run=run; grace=30; only=()
while [[ $# -gt 0 ]]; do
  case $1 in
    -d) run=${2:?-d needs a directory}; shift 2 ;;
    -t) grace=${2:?-t needs seconds}; shift 2 ;;
    prefill|decode|dispatcher) only+=("$1"); shift ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $grace =~ ^[0-9]+$ ]] || { echo "error: -t must be a whole number of seconds, got '$grace'" >&2; exit 2; }
[[ -f $run/pids ]] || { echo "nothing to stop: no $run/pids"; exit 0; }
wanted() { local r; ((${#only[@]})) || return 0; for r in "${only[@]}"; do [[ $r == "$1" ]] && return 0; done; return 1; }
# the live (not zombie) processes of group $1 (the launchers start each process as its group's
# leader), and process $1 itself (one started some other way)
live() { ps -eo pid=,pgid=,stat= | awk -v g="$1" '($2 == g || $1 == g) && $3 !~ /^Z/ {print $1}'; }
alive() { [[ -n $(live "$1") ]]; }
wait_gone() {  # pgid seconds
  local end=$((SECONDS + $2))
  while alive "$1" && ((SECONDS < end)); do sleep 0.2; done
  ! alive "$1"
}
# a recorded pid may be stale (a crashed worker, a reboot) and reused by another program:
# only a process whose command line names proserve is ours to signal
ours() { [[ $1 =~ ^[0-9]+$ ]] && (($1 > 1)) && tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null | grep -q proserve; }
stop() {  # pid what
  local g=$1 what=$2
  if ! alive "$g"; then echo "$what (pid $g): not running"; return 0; fi
  if ! ours "$g"; then echo "$what (pid $g): that process is not a ProServe one (a stale $run/pids entry): left alone"; return 0; fi
  kill -TERM -- "-$g" 2>/dev/null || kill -TERM "$g" 2>/dev/null
  if wait_gone "$g" "$grace"; then echo "stopped $what (pid $g)"; return 0; fi
  kill -KILL -- "-$g" 2>/dev/null || kill -KILL "$g" 2>/dev/null
  if wait_gone "$g" 10; then echo "killed $what (pid $g) after ${grace} s"; return 0; fi
  echo "error: $what (group $g) still has processes: $(live "$g" | tr '\n' ' ')" >&2
  return 1
}
keep=(); left=0
mapfile -t entries < "$run/pids"
for pass in dispatcher workers; do
  for e in "${entries[@]}"; do
    read -r pid role i port <<< "$e"
    [[ -n ${pid:-} ]] || continue
    if [[ $pass == dispatcher ]]; then [[ $role == dispatcher ]] || continue
    else [[ $role != dispatcher ]] || continue; fi
    if ! wanted "$role"; then keep+=("$e"); continue; fi
    what="$role worker $i"; [[ $role == dispatcher ]] && what="dispatcher $i"
    stop "$pid" "$what" || { keep+=("$e"); left=1; }
  done
done
if ((${#keep[@]})); then printf '%s\n' "${keep[@]}" > "$run/pids"; else rm -f "$run/pids"; fi
exit $left
