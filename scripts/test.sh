#!/usr/bin/env bash
# Install ProServe with its test extras and run the whole test suite.
# Exit code: pytest's, except that "no tests collected" (5) is a failure too.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e ".[test,plot]" || exit 1
python3 -m pytest -q "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
