#!/usr/bin/env bash
# Profile a vLLM engine's step times and fit ProServe's batch latency model (Eq. 5-7).
#
#   bash scripts/profile.sh [MODEL] [DEVICE] [OUT] [-- more `python -m proserve.profiler` flags]
#
# Defaults: the bundled tiny Llama (random weights), cpu, profiler/models/tiny-llama-cpu.json
# (the scheduler plugin's default latency model). Plots, every measured step (samples.jsonl, which
# `python -m proserve.profiler --from-samples` refits without an engine) and the report (stdout.txt) go to
# PLOTS (default docs/results/profile). The full grid takes about 5 minutes on 2 CPU cores.
# Set PROSERVE_ENGINE_LOCK=/path/to/lockfile to wait for other vLLM engines on a shared machine
# (flock) so that their load does not end up in the measurements.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-prefill/models/tiny-llama}
DEVICE=${2:-cpu}
OUT=${3:-profiler/models/tiny-llama-cpu.json}
shift $(( $# < 3 ? $# : 3 ))
if [[ "${1:-}" == "--" ]]; then shift; fi
PLOTS=${PLOTS:-docs/results/profile}
mkdir -p "$PLOTS"
cmd=(python3 -m proserve.profiler --model "$MODEL" --device "$DEVICE" --out "$OUT" --plots "$PLOTS"
     --samples "$PLOTS/samples.jsonl" "$@")
if [[ -n "${PROSERVE_ENGINE_LOCK:-}" ]]; then
  cmd=(flock "$PROSERVE_ENGINE_LOCK" "${cmd[@]}")
fi
echo "+ ${cmd[*]}" | tee "$PLOTS/stdout.txt"
"${cmd[@]}" 2>&1 | tee -a "$PLOTS/stdout.txt"
