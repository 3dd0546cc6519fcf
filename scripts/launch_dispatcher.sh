#!/usr/bin/env bash
# Start a ProServe dispatcher alone, from a config file, as an operator of a multi-host
# cluster does on the dispatcher's host (the workers run elsewhere: scripts/launch_prefill.sh,
# scripts/launch_decode.sh on theirs).
#   scripts/launch_dispatcher.sh -c CONFIG [-k KEYS_FILE] [-d RUN_DIR] [-t SECONDS] [--dry-run]
#                                [-- extra `python -m proserve.dispatcher` flags]
# CONFIG: the cluster config, TOML or JSON (instances, classes, host/port, worker_api_key_file;
# see `python -m proserve.dispatcher --help` and dispatcher/config.py); KEYS_FILE: the clients'
# API keys (--keys). Flags after `--` override the file (e.g. -- --port 8001 --log-level debug).
# The config (and keys) are checked first: a bad one is reported here, exit status 2, and
# nothing starts. The dispatcher then runs in the background, its own process group, logging
# to RUN_DIR/dispatcher.log, its PID in RUN_DIR/pids (default RUN_DIR: ./run); the script
# waits until its /health answers 200 (a prefill and, disaggregated, a decode instance healthy),
# at most -t SECONDS (default 120; 0: don't wait). If it exits or is not healthy in time, the
# end of its log and its last /health answer are shown, it is stopped, and the exit status is 1.
# Binds what the config says (default 127.0.0.1, loopback; another address needs KEYS_FILE or
# the dispatcher's --allow-open-access, as the dispatcher itself refuses). --dry-run: check, print the
# command, start nothing. scripts/stop_pool.sh -d RUN_DIR [dispatcher] stops it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
config=""; keys=""; run=run; timeout=120; dry=0
usage() { sed -n '2,/^[^#]/p' "$0" | sed -e '/^[^#]/d' -e 's/^# \{0,1\}//'; }
need() { [[ $# -ge 2 && -n $2 && $2 != -* ]] || { echo "error: $1 needs a value (see --help)" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case $1 in
    -c|--config) need "$@"; config=$2; shift 2 ;;
    -k|--keys) need "$@"; keys=$2; shift 2 ;;
    -d) need "$@"; run=$2; shift 2 ;;
    -t|--timeout) need "$@"; timeout=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
extra=("$@")
[[ -n $config ]] || { echo "error: -c CONFIG is required (the dispatcher's cluster config; see --help)" >&2; exit 2; }
[[ -f $config && -r $config ]] || { echo "error: -c $config: not a readable file" >&2; exit 2; }
config=$(cd "$(dirname "$config")" && pwd)/$(basename "$config")
if [[ -n $keys ]]; then
  [[ -f $keys && -r $keys ]] || { echo "error: -k $keys: not a readable file" >&2; exit 2; }
  keys=$(cd "$(dirname "$keys")" && pwd)/$(basename "$keys")
fi
[[ $timeout =~ ^[0-9]+$ ]] || { echo "error: -t must be a whole number of seconds, got '$timeout'" >&2; exit 2; }

args=(--config "$config")
[[ -n $keys ]] && args+=(--keys "$keys")
args+=("${extra[@]}")

# Check the config, keys and flags with the dispatcher's own parser; learn where it will listen.
addr=$(python3 - "${args[@]}" <<'EOF'
import sys
try:
    from proserve.dispatcher.cli import build_parser, config_from_args
    from proserve.dispatcher.config import check_open_access, load_keys
    from proserve.scheduler.request import ConfigError
except ImportError as e:
    print(f"error: cannot import the dispatcher ({e}): pip install -e '.[serve]'", file=sys.stderr)
    sys.exit(2)
args = build_parser().parse_args(sys.argv[1:])   # a bad flag: argparse says so and exits 2
try:
    cfg = config_from_args(args)
    if args.keys:
        load_keys(args.keys, cfg.classes)
    check_open_access(cfg, bool(args.keys))   # a non-loopback host needs keys or --allow-open-access
except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
except OSError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
print(cfg.host, cfg.port)
EOF
) || exit 2
read -r host port <<< "$addr"
[[ -n ${host:-} && ${port:-} =~ ^[0-9]+$ ]] || { echo "error: could not read host and port from $config" >&2; exit 2; }
bracket() { [[ $1 == *:* && $1 != \[* ]] && echo "[$1]" || echo "$1"; }
case $host in 0.0.0.0) probe=127.0.0.1 ;; ::|"[::]") probe="[::1]" ;; *) probe=$(bracket "$host") ;; esac
url="http://$(bracket "$host"):$port"
cmd=(python3 -m proserve.dispatcher "${args[@]}")
if ((dry)); then
  printf '%q ' "${cmd[@]}"; echo
  echo "would listen on $url (config checked)"
  exit 0
fi

mkdir -p "$run"; run=$(cd "$run" && pwd)
if [[ -f $run/pids ]]; then
  while read -r pid role _ _; do
    if [[ $role == dispatcher && $pid =~ ^[0-9]+$ && -n $(ps -o stat= -p "$pid" 2>/dev/null | grep -v '^Z') ]]; then
      echo "error: a dispatcher is already running from $run (pid $pid): scripts/stop_pool.sh -d $run dispatcher," \
           "or another -d RUN_DIR" >&2
      exit 2
    fi
  done < "$run/pids"
fi
if ((timeout > 0)) && ! command -v curl > /dev/null; then
  echo "error: waiting for /health needs curl (or pass -t 0 not to wait)" >&2; exit 2
fi
log=$run/dispatcher.log
set -m   # a process group of its own: scripts/stop_pool.sh stops the group
nohup "${cmd[@]}" > "$log" 2>&1 < /dev/null &
pid=$!
set +m   # (and no job-status notices from this shell)
echo "$pid dispatcher 0 $port" >> "$run/pids"
echo "started dispatcher: pid $pid $url (log $log)"
((timeout > 0)) || exit 0

fail() {
  echo "error: $1; the end of $log:" >&2
  tail -n 20 "$log" >&2
  [[ -n ${2:-} ]] && echo "last /health answer: $2" >&2
  "$root/scripts/stop_pool.sh" -d "$run" -t 10 dispatcher >&2 || true
  exit 1
}
t0=$SECONDS; answer=""
while :; do
  code=$(curl -s -o "$run/.dispatcher-health" -w '%{http_code}' --max-time 5 "http://$probe:$port/health" || true)
  [[ $code == 200 ]] && break
  [[ -s $run/.dispatcher-health ]] && answer=$(head -c 2000 "$run/.dispatcher-health")
  kill -0 "$pid" 2>/dev/null || fail "the dispatcher exited (status: $(wait "$pid" 2>/dev/null; echo $?))" "$answer"
  ((SECONDS - t0 < timeout)) \
    || fail "the dispatcher is not healthy after ${timeout}s (HTTP ${code:-none} from http://$probe:$port/health)" "$answer"
  sleep 0.5
done
rm -f "$run/.dispatcher-health"
echo "dispatcher ready: $url"
