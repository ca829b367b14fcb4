#!/usr/bin/env bash
# Build a CPU-only SGLang virtual environment from PyPI into DIR (default: .sglang-venv).
#
#   scripts/sglang-cpu-env.sh /work/sglang-venv
#   /work/sglang-venv/bin/python axrl/inference/sglang/cpu_compat.py --model-path M --port 30000
#
# `pip install sglang` pins a CUDA torch and pulls CUDA kernels (> 5 GB). This script instead
# installs the CPU torch, then every non-CUDA requirement of sglang constrained to that torch,
# then sglang itself with --no-deps. It is a CPU debugging aid for the tested version only;
# GPU machines use `pip install "axrl[sglang]"` (docs/sglang.md). Idempotent: a DIR already
# built by this script for the same versions is left as is. Prints the time it took.
#
# Env: AXRL_SGLANG_VERSION (default 0.5.23), AXRL_SGLANG_TORCH (default 2.13.0),
#      AXRL_SGLANG_TRITON (default 3.9.0), AXRL_SGLANG_BASE_PYTHON (default python3.11),
#      AXRL_TORCH_INDEX_URL (the index torch comes from; default: pip's own, unless that would
#      bring a CUDA build, then PyTorch's CPU index https://download.pytorch.org/whl/cpu),
#      AXRL_SGLANG_TORCH_SPEC (a wheel file or another spec for torch).
set -euo pipefail

DIR="${1:-.sglang-venv}"
SGLANG_VERSION="${AXRL_SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${AXRL_SGLANG_TORCH:-2.13.0}"
TRITON_VERSION="${AXRL_SGLANG_TRITON:-3.9.0}"
BASE_PYTHON="${AXRL_SGLANG_BASE_PYTHON:-python3.11}"
STAMP="sglang==${SGLANG_VERSION} torch==${TORCH_VERSION} triton==${TRITON_VERSION} recipe=2"
start=$(date +%s)

# shellcheck source=cpu-env-lib.sh
source "$(dirname "$0")/cpu-env-lib.sh"
env_is_built sglang-cpu-env "$DIR" .axrl-sglang-env "$STAMP" sglang
echo "sglang-cpu-env: building $STAMP into $DIR"
new_venv sglang-cpu-env "$BASE_PYTHON" "$DIR" AXRL_SGLANG_BASE_PYTHON
PY="$DIR/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check --progress-bar off)

# 1. The CPU torch first; the constraints file keeps every later resolve on it.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "torch==${TORCH_VERSION}" > "$work/constraints.txt"
# The CPU build, from PyPI or PyTorch's CPU index (scripts/cpu-env-lib.sh says how it chooses).
install_cpu_torch sglang-cpu-env "$PY" "${AXRL_SGLANG_TORCH_SPEC:-torch==${TORCH_VERSION}}" "$TORCH_VERSION" "$work"

# 2. sglang's own requirement list, read from the wheel's metadata, minus what is CUDA-only or
#    only needed for vision/audio models (each would drag a CUDA torch or fail to load here).
"$PY" -m pip download --disable-pip-version-check --no-deps --progress-bar off \
  "sglang==${SGLANG_VERSION}" -d "$work/wheel" >/dev/null
"$PY" - "$work" <<'EOF'
import re, sys, zipfile, glob
from email.parser import Parser
work = sys.argv[1]
whl = glob.glob(f"{work}/wheel/sglang-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
# CUDA kernels/toolkits, torch itself (installed above), the vision/audio stack
# (torchvision/torchaudio/torchcodec/timm pull or need a matching CUDA torch) and xgrammar
# (installed below without its triton dependency).
skip = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|timm|cuda-python|flash-attn-4|flashinfer[-_]python"
    r"|humming-kernels|nvidia-.*|nvshmem4py-.*|quack-kernels|sgl-.*|sglang-kernel|tilelang"
    r"|xgrammar)$", re.I)
keep, dropped = [], []
for req in msg.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
    (dropped if skip.match(name) else keep).append(req)
open(f"{work}/requirements.txt", "w").write("\n".join(keep) + "\n")
open(f"{work}/requirements.skipped", "w").write("\n".join(dropped) + "\n")
print("sglang-cpu-env: skipping", ", ".join(sorted(re.match(r"[A-Za-z0-9_.\-]+", d).group(0) for d in dropped)))
EOF
"${PIP[@]}" -c "$work/constraints.txt" -r "$work/requirements.txt"

# 3. triton (sglang imports it at top level; the PyPI wheel has no dependencies and runs no
#    kernel here), xgrammar (the default grammar backend, imported at start-up) without its
#    dependencies, then sglang itself without its dependency pins.
xgrammar_req="$(grep -iE '^xgrammar' "$work/requirements.skipped" || echo xgrammar)"
"${PIP[@]}" --no-deps "triton==${TRITON_VERSION}" "$xgrammar_req"
"${PIP[@]}" --no-deps "$work"/wheel/sglang-*.whl

# Nothing CUDA may have slipped in through a transitive dependency.
if "$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|torchvision==|flashinfer|sgl-kernel)'; then
  echo "sglang-cpu-env: a CUDA/vision package above was pulled in transitively; see the skip list" >&2
  exit 3
fi
"$PY" -c "import torch; assert torch.version.cuda is None, torch.__version__"
# The server must import through cpu_compat's patches (`--help` parses the flags and exits).
"$PY" "$(cd "$(dirname "$0")/.." && pwd)/axrl/inference/sglang/cpu_compat.py" --help >/dev/null
"$PY" -c "import importlib.metadata as m; print('sglang-cpu-env: sglang', m.version('sglang'), 'torch', m.version('torch'))"
echo "$STAMP" > "$DIR/.axrl-sglang-env"
end=$(date +%s)
echo "sglang-cpu-env: done in $((end - start)) s; size $(du -sh "$DIR" | cut -f1)"
