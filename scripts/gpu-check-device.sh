#!/usr/bin/env bash
# GPU check of `runtime.device: cuda` (one script, < 10 min on one GPU): placement and dtype of the
# torch trainer and the embedded engine, a short run that must replay bit for bit on the GPU in fp32
# and bf16 (tests/test_device_gpu.py), then the whole default example on the GPU. Figures go as JSON
# lines to ${OUT:-.}/device-gpu.jsonl, the log beside it; copy them into docs/models.md ("GPU").
# Needs a CUDA build of torch (install it first, then `pip install -e '.[test]'`).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-check-lib.sh
gpu_check_start device-gpu
timeout 240 python -m pytest -q -s -p no:cacheprovider --timeout=200 tests/test_device_gpu.py 2>&1 | tee -a "$out/device-gpu.log"
rc=${PIPESTATUS[0]}
rm -rf "$out/quickstart-gpu"
start=$(date +%s)
timeout 330 axrl train examples/quickstart.yaml --set runtime.device=cuda --run-dir "$out/quickstart-gpu" \
  2>&1 | tail -n 60 >> "$out/device-gpu.log"
qrc=${PIPESTATUS[0]}
python - "$out/quickstart-gpu/metrics.jsonl" "$(( $(date +%s) - start ))" "$qrc" >> "$out/device-gpu.jsonl" <<'PY'
import json, sys
path, seconds, rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    rows = [json.loads(line) for line in open(path)]
except OSError:
    rows = []
evals = {r["step"]: r["eval_reward"] for r in rows if "eval_reward" in r}
print(json.dumps({"check": "quickstart_gpu", "exit_code": rc, "wall_seconds": seconds, "steps": len(rows),
                  "eval_reward": evals, "eval_reward_final": rows[-1].get("eval_reward_final") if rows else None}))
PY
tail -n 1 "$out/device-gpu.jsonl"
[ "$rc" -eq 0 ] && [ "$qrc" -eq 0 ]; status=$?
echo "exit code $status; figures in $out/device-gpu.jsonl"
exit "$status"
