"""What per-tensor checksums of a real SGLang server cost (axrl/inference/sglang/weight_checksums.py):
one SGLang server (cpu_compat, float32, one torch thread) on a random-init preset checkpoint, and
in the same process, interleaved round by round so machine load hits them alike:

- `sglang_checksum_s`: one `POST /weights_checker {"action": "checksum"}` (the server hashes every
  parameter and buffer, SHA-256 on the host) + the JSON round trip (`held_checksums`);
- `expected_checksum_s`: the trainer side, `expected_checksums` of the HF state dict (fuse, stack,
  hash) as a CPU server hashes;
- `expected_cuda_hash_s`: the same with `server_device="cuda"` (SGLang's Triton hash recomputed
  with torch integer ops), on this machine's CPU.

Medians of `--rounds` (default 5). Checks that the two sides agree (zero mismatches) before
timing. Ends with one JSON line: `sglang_checksum_s`, `expected_checksum_s`, `tensors`, and more.

    AXRL_SGLANG_PYTHON=.../bin/python python bench/sglang_checksum_cost.py [--preset tiny-moe] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from axrl.inference.sglang.launcher import SGLangLauncher, free_port
from axrl.inference.sglang.weight_checksums import compare, expected_checksums, held_checksums
from axrl.model import build_model, hf_state_dict, load_hf, preset_config, save_hf
from axrl.tokenizer import Tokenizer

CPU_COMPAT = Path(__file__).resolve().parents[1] / "axrl" / "inference" / "sglang" / "cpu_compat.py"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--python", default=os.environ.get("AXRL_SGLANG_PYTHON", ""),
                    help="the SGLang environment's python (default: $AXRL_SGLANG_PYTHON)")
    a = ap.parse_args()
    if not a.python or not Path(a.python).is_file():
        sys.exit("give the SGLang environment's python: --python or AXRL_SGLANG_PYTHON (scripts/sglang-cpu-env.sh)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer.default()
        cfg = preset_config(a.preset, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
        model_dir = save_hf(build_model(cfg, seed=0), Path(tmp) / "model", tokenizer=tok)
        sd = hf_state_dict(load_hf(model_dir))
        launcher = SGLangLauncher(model_dir, command=[a.python, str(CPU_COMPAT)],
                                  server_args=["--dtype", "float32", "--random-seed", "0"], base_port=free_port(),
                                  env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
                                  startup_timeout_s=300)
        launcher.start()
        try:
            url = launcher.urls[0]
            held, want = held_checksums(url), expected_checksums(sd, torch.float32)
            mismatches, compared = compare(want, held)
            if mismatches:
                sys.exit(f"the sides disagree on a fresh server: {[m.name for m in mismatches]}")
            times: dict[str, list[float]] = {"sglang": [], "expected": [], "cuda": []}
            for _ in range(a.rounds):
                times["sglang"].append(timed(lambda: held_checksums(url)))
                times["expected"].append(timed(lambda: expected_checksums(sd, torch.float32)))
                times["cuda"].append(timed(lambda: expected_checksums(sd, torch.float32, server_device="cuda")))
        finally:
            launcher.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"{a.preset}: {len(sd)} HF tensors ({nbytes / 1e6:.1f} MB fp32) → {len(held)} SGLang tensors reported, "
          f"{len(compared)} compared")
    print(f"server /weights_checker checksum: {med['sglang']:.4f} s   trainer side (sha256): {med['expected']:.4f} s "
          f"(ratio server/trainer {med['sglang'] / med['expected']:.2f})   trainer side for a CUDA server "
          f"(Triton hash recomputed on CPU): {med['cuda']:.4f} s")
    print(json.dumps({"sglang_checksum_s": round(med["sglang"], 4), "expected_checksum_s": round(med["expected"], 4),
                      "expected_cuda_hash_s": round(med["cuda"], 4), "tensors": len(compared),
                      "held_tensors": len(held), "hf_tensors": len(sd), "megabytes": round(nbytes / 1e6, 2),
                      "rounds": a.rounds, "preset": a.preset}))


if __name__ == "__main__":
    main()
