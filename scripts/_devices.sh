# shellcheck shell=bash disable=SC2034  # (sets variables for the scripts that source it)
# Device placement of local workers: sourced by launch_cluster.sh and _launch_pool.sh.
# A worker with T tensor-parallel ranks gets one group of devices: with --device cuda or npu
# T devices (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES), with cpu a multiple of T cores,
# an equal share per rank (VLLM_CPU_OMP_THREADS_BIND, ranks separated by '|').
# Errors: "error: ... (see --help)" on stderr, exit 2.

dev_die() { echo "error: $* (see --help)" >&2; exit 2; }

# dev_scan WORKER_FLAGS...: DEV_FAMILY (the worker's --device, default cpu) and DEV_CPU_BIND (1
# when the flags bind cores themselves, --cpu-bind); the flags after a `--` are vLLM's. The
# tensor-parallel size and the devices are the script's options, not worker flags.
dev_scan() {
  DEV_FAMILY=cpu; DEV_CPU_BIND=0
  local prev="" a
  for a in "$@"; do
    [[ $a == -- ]] && break
    case $a in
      --tensor*) dev_die "$a in the worker flags: give the script's --tensor-parallel-size" ;;
      --devices|--devices=*) dev_die "$a in the worker flags: give the script's --devices" ;;
      --cpu-bind|--cpu-bind=*) DEV_CPU_BIND=1 ;;
      --device=*) DEV_FAMILY=${a#*=} ;;
    esac
    [[ $prev == --device ]] && DEV_FAMILY=$a
    prev=$a
  done
  case $DEV_FAMILY in cpu|cuda|npu) ;; *) dev_die "--device $DEV_FAMILY: cpu, cuda or npu" ;; esac
}

# dev_expand LIST: DEV_IDS from "0,1" or "0-3,6"; status 1 if LIST is not that, or repeats an id
dev_expand() {
  DEV_IDS=()
  local part a b c parts
  local -A seen=()
  [[ -n $1 && $1 != *, && $1 != ,* ]] || return 1
  IFS=, read -ra parts <<< "$1"
  for part in "${parts[@]}"; do
    [[ $part =~ ^([0-9]{1,4})(-([0-9]{1,4}))?$ ]] || return 1   # ids below 10000: no wrap, no endless range
    a=$((10#${BASH_REMATCH[1]})); b=$((10#${BASH_REMATCH[3]:-$a}))
    ((b >= a)) || return 1
    for ((c = a; c <= b; c++)); do
      [[ -z ${seen[$c]:-} ]] || return 1
      seen[$c]=1; DEV_IDS+=("$c")
    done
  done
}

# dev_ranges IDS...: "0 1 2 5" -> "0-2,5"
dev_ranges() {
  local out="" start="" prev="" i
  for i in "$@"; do
    if [[ -n $prev ]] && ((i == prev + 1)); then prev=$i; continue; fi
    [[ -n $start ]] && out+="${out:+,}$start" && ((prev != start)) && out+="-$prev"
    start=$i; prev=$i
  done
  [[ -n $start ]] && out+="${out:+,}$start" && ((prev != start)) && out+="-$prev"
  echo "$out"
}

# dev_assign VAR=VALUE: the assignment as a shell word (the value quoted only when it must be)
dev_assign() {
  local v=${1#*=}
  if [[ $v =~ ^[A-Za-z0-9_,./:-]*$ ]]; then echo "$1"; else echo "${1%%=*}='$v'"; fi
}

# dev_cores: DEV_CORES, the CPU ids this shell may run on (its affinity)
dev_cores() {
  local list
  list=$(awk '/^Cpus_allowed_list:/ {print $2}' /proc/self/status 2>/dev/null || true)
  dev_expand "$list" || dev_expand "0-$(($(nproc) - 1))"
  DEV_CORES=("${DEV_IDS[@]}")
}

# dev_env FAMILY TP IDS...: DEV_ENV, the "VAR=value" that places one worker's TP ranks on IDS
# (cpu: len(IDS)/TP cores per rank, in order)
dev_env() {
  local fam=$1 tp=$2 share r groups=()
  shift 2
  case $fam in
    cuda) DEV_ENV="CUDA_VISIBLE_DEVICES=$(IFS=,; echo "$*")" ;;
    npu) DEV_ENV="ASCEND_RT_VISIBLE_DEVICES=$(IFS=,; echo "$*")" ;;
    *)
      local ids=("$@")
      share=$(($# / tp))
      for ((r = 0; r < tp; r++)); do groups+=("$(dev_ranges "${ids[@]:r*share:share}")"); done
      DEV_ENV="VLLM_CPU_OMP_THREADS_BIND=$(IFS='|'; echo "${groups[*]}")" ;;
  esac
}

# dev_plan TP DEVICES PIN2: the placement of the workers described by W_ROLE, W_INDEX, W_FAMILY and
# W_CPU_BIND (arrays, one entry per local worker, in launch order) -> W_ENV (one "VAR=value" per
# worker, "" for none). DEVICES: one group per worker separated by ':' (e.g. 0,1:2,3), or "" to
# assign: cuda/npu worker k (counting the accelerator workers) gets devices k*TP .. k*TP+TP-1; a cpu
# worker with TP > 1 gets TP equal shares of disjoint cores when every rank can have its own, else
# the ranks of each worker split all the cores (workers then share them); a cpu worker with TP 1 is
# left to vLLM, except with PIN2=1 on a 2-core host: prefill workers on one core, decode on the other.
dev_plan() {
  local tp=$1 devices=$2 pin2=$3
  local nw=${#W_ROLE[@]} k i ids groups ncpuw=0 gslot=0 cslot=0 share what
  local -A owner=()
  W_ENV=()
  dev_cores
  local nc=${#DEV_CORES[@]}
  for ((k = 0; k < nw; k++)); do [[ ${W_FAMILY[k]} == cpu ]] && ((ncpuw += 1)); done
  if [[ -n $devices ]]; then
    IFS=: read -ra groups <<< "$devices"
    [[ $devices != *: ]] || groups+=("")
    ((${#groups[@]} == nw)) || dev_die "--devices $devices has ${#groups[@]} group(s) for $nw worker(s): one" \
      "group per worker, separated by ':'"
  elif ((tp > 1 && ncpuw > 0 && ncpuw * tp > nc)); then
    echo "note: $ncpuw CPU worker(s) x $tp ranks on $nc core(s): the workers share cores" \
         "(--devices gives each its own)" >&2
  fi
  for ((k = 0; k < nw; k++)); do
    what="${W_ROLE[k]} worker ${W_INDEX[k]}"
    ids=()
    if [[ -n $devices ]]; then
      ((W_CPU_BIND[k] == 0)) || dev_die "--devices and --cpu-bind for $what: give one"
      dev_expand "${groups[k]}" || dev_die "--devices: $what gets '${groups[k]}': expected distinct device" \
        "indices separated by ',' (ranges a-b allowed)"
      ids=("${DEV_IDS[@]}")
      if [[ ${W_FAMILY[k]} == cpu ]]; then
        ((${#ids[@]} % tp == 0)) || dev_die "--devices: $what gets ${#ids[@]} CPU core(s) (${groups[k]}) for" \
          "--tensor-parallel-size $tp: give a multiple of $tp (each rank gets an equal share)"
      else
        ((${#ids[@]} == tp)) || dev_die "--devices: $what gets ${#ids[@]} device(s) (${groups[k]}) for" \
          "--tensor-parallel-size $tp: give exactly $tp, one per rank"
        for i in "${ids[@]}"; do
          [[ -z ${owner[$i]:-} ]] || echo "note: device $i is given to ${owner[$i]} and to $what" >&2
          owner[$i]=$what
        done
      fi
    elif [[ ${W_FAMILY[k]} != cpu ]]; then
      for ((i = gslot * tp; i < (gslot + 1) * tp; i++)); do ids+=("$i"); done
      ((gslot += 1))
    elif ((W_CPU_BIND[k])); then
      :   # the worker's own --cpu-bind
    elif ((tp == 1)); then
      if ((pin2 && nc == 2)); then
        ids=("${DEV_CORES[$([[ ${W_ROLE[k]} == prefill ]] && echo 0 || echo 1)]}")
      fi
    elif ((ncpuw * tp <= nc)); then
      share=$((nc / (ncpuw * tp)))
      ids=("${DEV_CORES[@]:cslot*tp*share:tp*share}")
      ((cslot += 1))
    elif ((nc >= tp)); then
      ids=("${DEV_CORES[@]:0:nc / tp * tp}")
    else   # fewer cores than ranks: every rank gets all of them
      for ((i = 0; i < tp; i++)); do ids+=("${DEV_CORES[@]}"); done
    fi
    W_ENV[k]=""
    if ((${#ids[@]})); then dev_env "${W_FAMILY[k]}" "$tp" "${ids[@]}"; W_ENV[k]=$DEV_ENV; fi
  done
}
