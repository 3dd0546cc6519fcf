#!/usr/bin/env bash
# Make the secrets a ProServe cluster authenticates with:
#   scripts/make_keys.sh DIR [--overwrite]
# DIR/worker.key     API key the dispatcher sends to the workers (python -m proserve.prefill|decode
#                    --api-key-file DIR/worker.key; python -m proserve.dispatcher --worker-key-file DIR/worker.key)
# DIR/kv/            ZeroMQ CURVE keys of the KV transport (python -m proserve.prefill|decode --kv-keys DIR/kv):
#                    decode hosts need kv/server.key_secret and kv/clients/, prefill hosts
#                    kv/client.key_secret and kv/server.key
# Files are readable by their owner only. Copy to each host only what its role needs.
set -euo pipefail
[[ $# -ge 1 && $1 != -h && $1 != --help ]] || { sed -n '2,9p' "$0"; exit 0; }
umask 077
mkdir -p "$1"; dir=$(cd "$1" && pwd); shift
overwrite=()
[[ ${1:-} == --overwrite ]] && overwrite=(--overwrite)
if [[ -e $dir/worker.key && ${#overwrite[@]} -eq 0 ]]; then
  echo "error: $dir/worker.key exists (pass --overwrite to replace the keys)" >&2; exit 2
fi
python3 -c 'import secrets; print("sk-worker-" + secrets.token_hex(24))' > "$dir/worker.key"
cd "$(dirname "$0")/.."
python3 -m proserve.kvtransfer.keys "$dir/kv" "${overwrite[@]}" >/dev/null
echo "keys in $dir: worker.key (HTTP API key), kv/ (CURVE)"
