#!/usr/bin/env bash
# Regenerate every table and plot in docs/results/ (about 30 minutes on 2 cores).
#   bash scripts/reproduce_results.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e ".[plot]"
D=docs/results
mkdir -p "$D/colocated" "$D/disaggregated"

# 1. PD co-located, 1 instance, Azure conversation trace, every local policy,
#    light to overload, 3 seeds (the paper's Figure 10 / §5.2 single-node finding).
python3 -m proserve.sim sweep --rates 2,3,3.5,4,5,6 --seeds 0,1,2 --num-requests 2000 \
  --out "$D/colocated" | tee "$D/colocated/stdout.txt"

# 2. PD disaggregated, 4 prefill + 8 decode instances (8 so that decode is not the
#    bottleneck), GoRouting vs Min-Load (round-robin for reference) over two local
#    policies (Figure 11), and GoRouting with the min-load fallback variant.
python3 -m proserve.sim sweep --deployment disaggregated --prefill-instances 4 --decode-instances 8 \
  --local slide_batching,sarathi_fcfs --global go_routing,min_load,round_robin \
  --rates 20,30,35,40,45,50 --seeds 0,1,2 --num-requests 3000 \
  --out "$D/disaggregated" | tee "$D/disaggregated/stdout.txt"
python3 -m proserve.sim sweep --deployment disaggregated --prefill-instances 4 --decode-instances 8 \
  --local slide_batching,sarathi_fcfs --global go_routing --global-param fallback=min_load \
  --rates 20,30,35,40,45,50 --seeds 0,1,2 --num-requests 3000 --no-plot \
  | tee "$D/disaggregated/go_routing_minload_fallback.txt"

# 3. URGENT / NORMAL counts over time under three loads (Figure 17).
for rate in 3 4 6; do
  python3 -m proserve.sim run --rate "$rate" --num-requests 2000 --global round_robin \
    --timeline --plot --out "out/timeline-$rate" > /dev/null
  cp "out/timeline-$rate/timeline.png" "$D/timeline-rate$rate.png"
done

# 4. Decision times and simulator speed (every local and global policy at the end).
python3 scripts/bench_scheduler.py | tee "$D/bench_scheduler.txt"

# 5. Alternative schedulers (JITServe GMAX, SLOs-Serve, UniBoost) against SlideBatching and the
#    baselines, co-located and disaggregated, on TDG and on each paper's own metric (15-18 minutes).
python3 scripts/compare_alternatives.py --out "$D/alternatives" > /dev/null
