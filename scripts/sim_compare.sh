#!/usr/bin/env bash
# Quick start: install ProServe and compare SlideBatching with the paper's
# baselines in the simulator on the bundled Azure conversation trace
# (1 co-located instance, 1,000 requests per run, rates from light to overload).
# Extra arguments go to `python -m proserve.sim sweep` (e.g. --seeds 0,1,2).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e ".[plot]"
exec python3 -m proserve.sim sweep --rates 2,3,4,5,6 --num-requests 1000 --out out/sim-compare "$@"
