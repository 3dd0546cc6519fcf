#!/usr/bin/env bash
# Shared body of launch_prefill.sh / launch_decode.sh: ROLE DEFAULT_BASE_PORT [options]
# (their headers are the usage). Each worker runs in a process group of its own, its
# PID recorded in RUN_DIR/pids as "PID ROLE INDEX PORT" (scripts/stop_pool.sh reads it).
set -euo pipefail
role=$1; base=$2; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
n=1; kvbase=15600; run=run; host=127.0.0.1; kvhost=""; keyfile=""; kvkeys=""; secrets=""; wait_s=0; dry=0
tp=1; devices=""
# shellcheck source=scripts/_devices.sh
source "$root/scripts/_devices.sh"
usage() { sed -n '2,/^[^#]/p' "$root/scripts/launch_${role}.sh" | sed -e '/^[^#]/d' -e 's/^# \{0,1\}//'; }
need() { [[ $# -ge 2 && -n $2 && $2 != -* ]] || { echo "error: $1 needs a value (see --help)" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) need "$@"; n=$2; shift 2 ;;
    -p) need "$@"; base=$2; shift 2 ;;
    -k) need "$@"; kvbase=$2; shift 2 ;;
    -d) need "$@"; run=$2; shift 2 ;;
    -H|--host) need "$@"; host=$2; shift 2 ;;
    --kv-host) need "$@"; kvhost=$2; shift 2 ;;
    --api-key-file) need "$@"; keyfile=$2; shift 2 ;;
    --kv-keys) need "$@"; kvkeys=$2; shift 2 ;;
    --secrets) need "$@"; secrets=$2; shift 2 ;;
    -w|--wait) need "$@"; wait_s=$2; shift 2 ;;
    --tensor-parallel-size|--tp) need "$@"; tp=$2; shift 2 ;;
    --devices) need "$@"; devices=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
extra=("$@")
[[ $n =~ ^[1-9][0-9]{0,4}$ ]] || { echo "error: -n must be a positive integer, got '$n'" >&2; exit 2; }
[[ $tp =~ ^[1-9][0-9]{0,3}$ ]] || { echo "error: --tensor-parallel-size must be a positive integer, got '$tp'" >&2; exit 2; }
for v in base kvbase; do
  [[ ${!v} =~ ^[1-9][0-9]{0,4}$ ]] || { echo "error: port base must be a positive integer, got '${!v}'" >&2; exit 2; }
done
((base + n - 1 <= 65535)) || { echo "error: ports $base..$((base + n - 1)) go past 65535" >&2; exit 2; }
[[ $wait_s =~ ^[0-9]+$ ]] || { echo "error: --wait must be a whole number of seconds, got '$wait_s'" >&2; exit 2; }
if [[ $role == decode ]]; then
  # worker i's ranks receive KV on kvbase + i*tp .. kvbase + i*tp + tp-1
  ((kvbase + n * tp - 1 <= 65535)) || { echo "error: KV ports $kvbase..$((kvbase + n * tp - 1)) go past 65535" >&2; exit 2; }
  kvhost=${kvhost:-$host}
elif [[ -n $kvhost ]]; then
  echo "error: --kv-host is for decode workers (a prefill worker connects to the decode workers' KV addresses)" >&2
  exit 2
fi

# a live process (a zombie left to a parent that does not reap is not one)
running() { [[ $1 =~ ^[0-9]+$ && -n $(ps -o stat= -p "$1" 2>/dev/null | grep -v '^Z') ]]; }
is_loopback() { [[ $1 == localhost || $1 == 127.* || $1 == ::1 || $1 == "[::1]" ]]; }
has_extra() { local a; for a in "${extra[@]}"; do [[ $a == "$1" ]] && return 0; done; return 1; }
bracket() { [[ $1 == *:* && $1 != \[* ]] && echo "[$1]" || echo "$1"; }
# where this host reaches a worker bound to $1 (a wildcard bind: through loopback)
probe_host() { case $1 in 0.0.0.0) echo 127.0.0.1 ;; ::|"[::]") echo "[::1]" ;; *) bracket "$1" ;; esac; }

# -- security options: checked here, so that a refused start fails now rather than in a log --
if [[ -n $secrets ]]; then
  [[ -d $secrets ]] || { echo "error: --secrets $secrets: no such directory (scripts/make_keys.sh DIR makes one)" >&2; exit 2; }
  [[ -z $keyfile && -f $secrets/worker.key ]] && keyfile=$secrets/worker.key
  [[ -z $kvkeys && -d $secrets/kv ]] && kvkeys=$secrets/kv
  [[ -n $keyfile ]] || { echo "error: --secrets $secrets has no worker.key (scripts/make_keys.sh DIR)" >&2; exit 2; }
fi
if [[ -n $keyfile ]]; then
  [[ -f $keyfile && -r $keyfile ]] || { echo "error: --api-key-file $keyfile: not a readable file" >&2; exit 2; }
  keyfile=$(cd "$(dirname "$keyfile")" && pwd)/$(basename "$keyfile")
fi
if [[ -n $kvkeys ]]; then
  [[ -d $kvkeys ]] || { echo "error: --kv-keys $kvkeys: no such directory (scripts/make_keys.sh DIR makes DIR/kv)" >&2; exit 2; }
  kvkeys=$(cd "$kvkeys" && pwd)
  if [[ $role == decode ]]; then
    need_files=(server.key_secret clients)
  else
    need_files=(client.key_secret server.key)
  fi
  for f in "${need_files[@]}"; do
    [[ -e $kvkeys/$f ]] || { echo "error: --kv-keys $kvkeys lacks $f (a $role host needs ${need_files[*]})" >&2; exit 2; }
  done
fi
if ! is_loopback "$host" && [[ -z $keyfile && -z ${VLLM_API_KEY:-} ]] && ! has_extra --allow-no-api-key; then
  echo "error: -H $host is not a loopback address and no API key is given: pass --api-key-file FILE or" \
       "--secrets DIR (scripts/make_keys.sh DIR makes them), or '-- --allow-no-api-key' on a trusted network" >&2
  exit 2
fi
if [[ $role == decode ]] && ! is_loopback "$kvhost" && [[ -z $kvkeys ]] && ! has_extra --kv-insecure \
    && ! has_extra --colocated; then
  echo "error: KV address $kvhost is not a loopback address and no CURVE keys are given: pass --kv-keys DIR or" \
       "--secrets DIR (scripts/make_keys.sh DIR makes them), or '-- --kv-insecure' on a trusted network" >&2
  exit 2
fi
if [[ $role == prefill ]] && ! is_loopback "$host" && [[ -z $kvkeys ]] && ! has_extra --kv-insecure \
    && ! has_extra --colocated; then
  echo "note: no --kv-keys: these prefill workers can push KV to loopback decode workers only" \
       "(other hosts' decode workers need CURVE: --kv-keys DIR or --secrets DIR)" >&2
fi
sec=()
[[ -n $keyfile ]] && sec+=(--api-key-file "$keyfile")
[[ -n $kvkeys ]] && sec+=(--kv-keys "$kvkeys")

# -- devices: one group per worker (_devices.sh) ------------------------------------------------
dev_scan "${extra[@]}"
W_ROLE=(); W_INDEX=(); W_FAMILY=(); W_CPU_BIND=()
for ((i = 0; i < n; i++)); do
  W_ROLE+=("$role"); W_INDEX+=("$i"); W_FAMILY+=("$DEV_FAMILY"); W_CPU_BIND+=("$DEV_CPU_BIND")
done
dev_plan "$tp" "$devices" 0

# -- the command lines ------------------------------------------------------------------------
cmds=(); envs=()
for ((i = 0; i < n; i++)); do
  args=(python3 -m "proserve.$role" --host "$host" --port "$((base + i))")
  [[ $role == decode ]] && args+=(--kv-listen "tcp://$(bracket "$kvhost"):$((kvbase + i * tp))")
  ((tp > 1)) && args+=(--tensor-parallel-size "$tp")
  args+=("${sec[@]}" "${extra[@]}")
  cmds+=("$(printf '%q ' "${args[@]}")")
  envs+=("${W_ENV[i]:+$(dev_assign "${W_ENV[i]}") }")
done
if ((dry)); then
  for ((i = 0; i < n; i++)); do echo "${envs[i]}${cmds[i]% }"; done
  exit 0
fi

mkdir -p "$run"; run=$(cd "$run" && pwd)
if [[ -f $run/pids ]]; then
  while read -r pid r i _; do
    if [[ $r == "$role" ]] && running "$pid" && ((i < n)); then
      echo "error: $role worker $i is already running (pid $pid, $run/pids): scripts/stop_pool.sh -d $run $role" >&2
      exit 2
    fi
  done < "$run/pids"
fi
if [[ $host == 0.0.0.0 || $host == :: || $host == "[::]" ]]; then
  echo "note: -H $host binds every interface of this host" >&2
fi
cd "$root"
set -m   # every worker gets a process group of its own, so a stop reaches vLLM's engine processes too
pids=(); ports=()
for ((i = 0; i < n; i++)); do
  port=$((base + i)); log="$run/$role-$i.log"
  eval "nohup env ${envs[i]}${cmds[i]} > \"\$log\" 2>&1 < /dev/null &"
  pids+=("$!"); ports+=("$port")
  echo "$! $role $i $port" >> "$run/pids"
  kv=""
  [[ $role == decode ]] && kv=", KV tcp://$(bracket "$kvhost"):$((kvbase + i * tp))"
  ((tp > 1)) && [[ $role == decode ]] && kv+="..$((kvbase + i * tp + tp - 1))"
  echo "started $role worker $i: pid $! http://$(bracket "$host"):$port$kv${W_ENV[i]:+, ${W_ENV[i]}} (log $log)"
done
set +m   # no job-status notices from this shell
((wait_s > 0)) || exit 0
command -v curl > /dev/null || { echo "error: --wait needs curl" >&2; exit 2; }
t0=$SECONDS; rc=0
for ((i = 0; i < n; i++)); do
  url="http://$(probe_host "$host"):${ports[i]}/health"
  until curl -sf -o /dev/null --max-time 5 "$url"; do
    if ! kill -0 "${pids[i]}" 2>/dev/null; then
      echo "error: $role worker $i exited; the end of $run/$role-$i.log:" >&2
      tail -n 20 "$run/$role-$i.log" >&2; rc=1; break
    fi
    if ((SECONDS - t0 > wait_s)); then
      echo "error: $role worker $i not healthy after ${wait_s}s ($url; log $run/$role-$i.log)" >&2; rc=1; break
    fi
    sleep 1
  done
  ((rc)) && break
  echo "$role worker $i healthy"
done
((rc)) && echo "the workers keep running: scripts/stop_pool.sh -d $run $role stops them" >&2
exit $rc
