# Sourced by scripts/sglang-cpu-env.sh and scripts/vllm-cpu-env.sh: what building a server's CPU
# environment always takes.
#
#   env_is_built LABEL DIR MARKER STAMP MODULE   exit 0 (after saying so) if DIR was built for STAMP
#   new_venv LABEL BASE_PYTHON DIR VARIABLE      a fresh virtual environment at DIR, pip upgraded
#                                                (VARIABLE: the one that names BASE_PYTHON)
#   install_cpu_torch LABEL PY SPEC VERSION WORKDIR
#
# install_cpu_torch installs a CPU build of torch into the environment and checks that it is one.
# A local CPU wheel (pip's find-links) sorts above PyPI's CUDA build of the same version; where
# there is none, PyPI's Linux wheel is the CUDA build (multi-GB of nvidia-* packages), so a
# resolution that would bring nvidia-* packages switches to PyTorch's CPU index — the equivalent of
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# AXRL_TORCH_INDEX_URL names the index instead (empty: the default indexes); SPEC may be a wheel
# file or another spec (checked either way: by what the build is, torch.version.cuda, not by its
# version label).
install_cpu_torch() {
  local label="$1" py="$2" spec="$3" version="$4" work="$5"
  local pip=("$py" -m pip install --disable-pip-version-check --progress-bar off)
  local torch_index=()
  if [[ -n "${AXRL_TORCH_INDEX_URL:-}" ]]; then
    torch_index=(--index-url "$AXRL_TORCH_INDEX_URL")
  elif [[ -z "${AXRL_TORCH_INDEX_URL+set}" ]] \
       && "${pip[@]}" -q --dry-run --ignore-installed --report "$work/torch.json" "$spec" >/dev/null 2>&1 \
       && "$py" -c 'import json, sys; sys.exit(not any(i["metadata"]["name"].lower().startswith("nvidia-")
                    for i in json.load(open(sys.argv[1]))["install"]))' "$work/torch.json"; then
    echo "$label: $spec resolves to a CUDA build here: installing it from https://download.pytorch.org/whl/cpu"
    torch_index=(--index-url "https://download.pytorch.org/whl/cpu")
  fi
  "${pip[@]}" "$spec" "${torch_index[@]}"
  "$py" - "$label" "$version" <<'PYEOF'
import sys, torch
label, version = sys.argv[1:]
if torch.version.cuda is not None or torch.__version__.split("+")[0] != version:
    sys.exit(f"{label}: expected a CPU build of torch {version}, got {torch.__version__} "
             f"(cuda={torch.version.cuda}); on a CPU-only machine set "
             "AXRL_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu")
PYEOF
}

env_is_built() {
  local label="$1" dir="$2" marker="$3" stamp="$4" module="$5"
  if [[ -f "$dir/$marker" && "$(cat "$dir/$marker")" == "$stamp" ]] \
     && "$dir/bin/python" -c "import $module" >/dev/null 2>&1; then
    echo "$label: $dir already built ($stamp); nothing to do"
    exit 0
  fi
}

new_venv() {
  local label="$1" base="$2" dir="$3" variable="$4"
  if ! command -v "$base" >/dev/null; then
    echo "$label: $base not found; set $variable to a Python 3.11 interpreter" >&2
    exit 2
  fi
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")"
  "$base" -m venv "$dir"
  "$dir/bin/python" -m pip install --disable-pip-version-check --progress-bar off --upgrade pip >/dev/null
}
