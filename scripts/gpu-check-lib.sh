# Shared start of scripts/gpu-check-*.sh (sourced): gpu_check_start NAME sets $out (${OUT:-.}) and
# $report ($out/NAME.jsonl, emptied), writes the torch/GPU line to $out/NAME.log and exits 2 without
# a CUDA device; the tests append their figures to $AXRL_GPU_REPORT.
gpu_check_start() {
  out="${OUT:-.}"
  mkdir -p "$out"
  report="$out/$1.jsonl"
  : > "$report"
  python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))" \
    | tee "$out/$1.log" || exit 2
  export OMP_NUM_THREADS=1 AXRL_GPU_REPORT="$report"
}
