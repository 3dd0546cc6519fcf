#!/usr/bin/env bash
# The main job: install ProServe, start a local cluster (1 prefill + 1 decode vLLM
# CPU worker with the bundled tiny random-weight Llama, and the dispatcher with
# API keys for a high- and a low-priority client), replay a short priority-tagged
# slice of the Azure conversation trace through it, print the per-priority report
# (TDG_Ratio, SLO attainment, TTFT/TPOT percentiles, throughput), stop the cluster.
#   scripts/demo.sh [--skip-install] [extra `python -m proserve.bench.loadgen` flags, e.g. --rate 8]
# Output: out/demo/ (loadgen/ report, per-request records and plots; run/ logs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [[ ${1:-} == --skip-install ]]; then shift; else bash scripts/install.sh; fi
out=$root/out/demo
run=$out/run
mkdir -p "$out"
cat > "$out/keys.toml" <<'KEYS'
# demo API keys: client -> priority class (see dispatcher/config.py)
[[keys]]
key = "sk-demo-high-0001"
client = "interactive-app"
class = "high"

[[keys]]
key = "sk-demo-low-00001"
client = "batch-jobs"
class = "low"
KEYS
[[ -s $run/pids ]] && bash scripts/stop_cluster.sh -d "$run" >/dev/null 2>&1 || true
trap 'echo; echo "stopping the cluster"; bash scripts/stop_cluster.sh -d "$run"' EXIT
bash scripts/launch_cluster.sh -d "$run" --keys "$out/keys.toml"
echo
rc=0
echo "replaying 120 requests (Azure conversation trace at 4 req/s, lengths / 4, 50/50 high/low, half streamed)"
python3 -m proserve.bench.loadgen --url http://127.0.0.1:8000 --api proserve --keys "$out/keys.toml" \
  --num-requests 120 --rate 4 --prompt-div 4 --output-div 4 --max-prompt 1024 \
  --stream-fraction 0.5 --out "$out/loadgen" "$@" || rc=$?
echo
echo "dispatcher view (GET /metrics):"
curl -s http://127.0.0.1:8000/metrics | grep -E '^proserve:dispatcher_(requests_total|tdg_gained_total|tdg_missed_total|routed_total)' || true
exit $rc   # non-zero when a request failed
