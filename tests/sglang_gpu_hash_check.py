"""Run by tests/test_sglang_weight_checksums.py with the SGLang environment's python and
TRITON_INTERPRET=1: SGLang's own Triton hash kernels (sglang/kernels/ops/memory/gpu_tensor_hash.py),
run by Triton's interpreter on host tensors with gpu_tensor_hash's launch parameters, against
AxRL's torch recomputation `sglang_cuda_hash`. Prints one JSON line {"checked": N, "differ": [...]}.

Standalone: AxRL is not installed in the SGLang environment, so weight_checksums.py (which imports
only torch and the standard library) is loaded from its file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton

from sglang.kernels.ops.memory import gpu_tensor_hash as g

MODULE = Path(__file__).resolve().parents[1] / "axrl" / "inference" / "sglang" / "weight_checksums.py"


def load_module():
    spec = importlib.util.spec_from_file_location("weight_checksums", MODULE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def kernel_hash(t: torch.Tensor, seed: int = 0x243F6A88, tile: int = 8192, block: int = 256, chunk: int = 1024) -> str:
    """gpu_tensor_hash's host code with its defaults, minus the `is_cuda` assertion (the
    interpreter runs the kernels on host tensors), formatted as `_hash_tensor` formats it."""
    tb = t.contiguous().reshape(-1).view(torch.uint8)
    if tb.numel() % 4:
        tb = torch.cat([tb, tb.new_zeros(-tb.numel() % 4)])
    u32 = tb.view(torch.uint32)
    n = u32.numel()
    if n == 0:
        return f"{0:016x}"
    grid = (triton.cdiv(n, tile),)
    partials = torch.empty(grid[0], dtype=torch.uint64)
    g.hash_tiles32_kernel_blocked[grid](
        u32, partials, n, seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
        FM_C1=g.FMIX32_C1, FM_C2=g.FMIX32_C2, POS_A=g.POS_C1, POS_B=g.POS_C2, TILE=tile, BLOCK=block, USE_CG=True)
    cur = partials
    while cur.numel() > 1:
        nxt = torch.empty(triton.cdiv(cur.numel(), chunk), dtype=torch.uint64)
        g.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, cur.numel(), CHUNK=chunk)
        cur = nxt
    return f"{g._final_splitmix64(int(cur.item())):016x}"


def main() -> None:
    mod = load_module()
    mod._CHUNK = mod._TILE              # several chunks on a small tensor: chunk boundaries are exercised
    gen = torch.Generator().manual_seed(0)
    cases = {
        "fp32 a tile + 77 words": torch.randn(8192 + 77, generator=gen),
        "bf16 odd count (padded word)": torch.randn(4097, generator=gen).to(torch.bfloat16),
        "fp16 [3, 5]": torch.randn(3, 5, generator=gen).to(torch.float16),
        "uint8 7 bytes": torch.arange(7, dtype=torch.uint8),
        "fp32 one word": torch.tensor([1.0]),
    }
    differ = [name for name, t in cases.items() if kernel_hash(t) != mod.sglang_cuda_hash(t)]
    print(json.dumps({"checked": len(cases), "differ": differ}))


if __name__ == "__main__":
    main()
