#!/usr/bin/env bash
# GPU check of `rollout.exact: true` (one script, a few minutes on one GPU): the exact embedded engine
# and the exact torch trainer on CUDA, fp32 and bf16 — bitwise equal logprobs and routing or not, and
# the cost (rollout tokens/s and train-step ratios, exact over normal, wall clock) —
# scripts/gpu_check_exact.py. Figures go as JSON lines to ${OUT:-.}/exact-gpu.jsonl, the log beside
# it; copy them into docs/train.md ("True on-policy"). Exits 2 without a CUDA device, 1 when a dtype
# is not bitwise. Needs a CUDA build of torch (install it first, then `pip install -e '.[test]'`).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-check-lib.sh
gpu_check_start exact-gpu
timeout 420 python scripts/gpu_check_exact.py "$@" 2>>"$out/exact-gpu.log" | tee -a "$report"
rc=${PIPESTATUS[0]}
echo "exit code $rc; figures in $report"
exit "$rc"
