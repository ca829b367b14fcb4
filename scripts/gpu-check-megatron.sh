#!/usr/bin/env bash
# GPU check of the Megatron backend (one script, < 10 min on one GPU): the parity and R3 tests on
# CUDA in fp32 and bf16 plus a short `axrl train` run (tests/test_megatron_gpu.py), with the
# measured figures written as JSON lines to ${OUT:-.}/megatron-gpu.jsonl and the log beside it.
# Copy the figures into docs/megatron.md ("GPU check"). Needs torch with CUDA and
# megatron-core==0.16.1 (pip install -e '.[megatron,test]' after installing your CUDA torch).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-check-lib.sh
gpu_check_start megatron-gpu
timeout 540 python -m pytest -q -s -p no:cacheprovider --timeout=500 tests/test_megatron_gpu.py 2>&1 | tee -a "$out/megatron-gpu.log"
rc=${PIPESTATUS[0]}
echo "exit code $rc; figures in $out/megatron-gpu.jsonl"
exit "$rc"
