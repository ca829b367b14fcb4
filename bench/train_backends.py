"""Train-step time of the Megatron-core backend vs the embedded torch backend, side by side.

Same model (a `--preset` with random init, identical HF weights in every backend), same packed
batch (`--samples` sequences of `--min-len`..`--max-len` tokens with a PPO-style loss), same
settings (fp32, AdamW, grad clipping, `--micro-batch-tokens`, 1 torch thread per process). One
step = `forward_backward` + `optimizer_step`, as an RL update runs it. The backends take turns
(round-robin, `--repeats` rounds) so machine noise hits all of them alike; each figure is the
median. Backends: `torch`, `megatron` (world size 1, in-process) and, with `--tp` / `--ep`, one
parallel layout `megatron_tp{T}_ep{E}` (`--tp 2`: tensor + expert parallel 2; `--ep 2`: TP 1,
experts over 2 data-parallel ranks; world size = TP × DP worker processes with 1 thread each:
more cores than the others, so its ratio is not a like-for-like efficiency figure on a 2-core
machine), and `torch_lora`: the torch backend training LoRA adapters (`--lora-rank`, alpha = 2 × rank,
every target) on the same frozen model, against `torch` as full fine-tuning.

    python bench/train_backends.py [--preset tiny-moe] [--samples 16] [--repeats 15] [--tp 2] [--ep 2]

Before timing it prints parity from the identical initial state: max |Δ| of logprobs and
entropy, routing agreement, and after one update the loss, grad-norm and weight differences
(Megatron vs torch, and TP/EP vs Megatron world size 1).

Ends with one JSON line: median step seconds per backend, `megatron_vs_torch_ratio`
(> 1 = Megatron slower), the logprob / grad-norm parity figures, and LoRA against full fine-tuning:
`lora_vs_full_step_time` (median step time ratio, < 1 = LoRA faster) and `lora_vs_full_optimizer_bytes`
(AdamW state bytes ratio), with the absolute `torch_optimizer_bytes` / `torch_lora_optimizer_bytes`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from axrl.algo import PolicyLossConfig, make_policy_loss  # noqa: E402
from axrl.model import build_model, preset_config  # noqa: E402
from axrl.train import PackedBatch, TorchBackend, TorchBackendConfig  # noqa: E402
from axrl.train.torch.lora import LoRAConfig  # noqa: E402


def make_batch(samples: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (samples,), generator=g)
    T = int(lengths.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    loss_mask = (torch.rand(T, generator=g) < 0.6).float()
    loss_mask[offsets[:-1]] = 0.0
    logprobs = -torch.rand(T, generator=g) * 5
    return PackedBatch(input_ids=torch.randint(0, vocab, (T,), generator=g), offsets=offsets, loss_mask=loss_mask,
                       advantages=torch.randn(T, generator=g), old_logprobs=logprobs, rollout_logprobs=logprobs,
                       temperature=0.7)


def optimizer_bytes(backend: TorchBackend) -> int:
    """Bytes of the AdamW state (moments and step counters) the backend holds."""
    return sum(t.numel() * t.element_size() for s in backend.optimizer.state.values() for t in s.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=160)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tp", type=int, default=0, help="also time tensor parallel (with expert parallel = tp "
                    "unless --ep is given)")
    ap.add_argument("--ep", type=int, default=0, help="also time expert parallel (data parallel derived: "
                    "world = TP x DP with EP dividing it)")
    ap.add_argument("--lora-rank", type=int, default=8, help="rank of the torch_lora backend (alpha = 2 x rank)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from axrl.train.megatron import MegatronBackend, MegatronBackendConfig

    cfg = preset_config(args.preset)
    batch = make_batch(args.samples, args.min_len, args.max_len, cfg.vocab_size)
    loss_fn = make_policy_loss(PolicyLossConfig(tis=True))
    common = dict(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens, num_threads=1)
    backends = {"torch": TorchBackend(build_model(cfg, seed=0), TorchBackendConfig(**common)),
                "megatron": MegatronBackend(build_model(cfg, seed=0), MegatronBackendConfig(**common)),
                "torch_lora": TorchBackend(build_model(cfg, seed=0), TorchBackendConfig(
                    **common, lora=LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)))}
    tp = max(args.tp, 1)
    ep = args.ep or (tp if cfg.is_moe else 1)
    parallel = f"megatron_tp{tp}_ep{ep}" if tp * ep > 1 else None
    if parallel:
        backends[parallel] = MegatronBackend(build_model(cfg, seed=0), MegatronBackendConfig(
            **common, tensor_parallel=tp, expert_parallel=ep))
    times: dict[str, list[float]] = {name: [] for name in backends}
    losses: dict[str, float] = {}
    parity: dict[str, float] = {}
    try:
        # Parity first, from the identical initial state: forward, then one update (which is
        # also the warm-up round: first-call allocations, lazy inits).
        fwd = {name: b.forward(batch) for name, b in backends.items()}
        stats = {}
        for name, b in backends.items():
            m = b.forward_backward(batch, loss_fn)
            stats[name] = (m.loss, b.optimizer_step().grad_norm)
        for name in list(backends)[1:]:
            ref = "torch" if name in ("megatron", "torch_lora") else "megatron"
            a, o = fwd[ref], fwd[name]
            wa, wb = dict(backends[ref].named_weights()), dict(backends[name].named_weights())
            entries = {
                f"{name}_vs_{ref}_logprob_max_diff": float((a.logprobs - o.logprobs).abs().max()),
                f"{name}_vs_{ref}_entropy_max_diff": float((a.entropy - o.entropy).abs().max()),
                f"{name}_vs_{ref}_routing_agreement": float((a.routed_experts == o.routed_experts).float().mean())
                if a.routed_experts is not None else 1.0,
                f"{name}_vs_{ref}_loss_diff": abs(stats[ref][0] - stats[name][0]),
                f"{name}_vs_{ref}_grad_norm_rel_diff": abs(stats[ref][1] - stats[name][1]) / stats[ref][1],
                f"{name}_vs_{ref}_weight_max_diff_after_update": max(float((wa[k] - wb[k]).abs().max()) for k in wa)}
            if name == "torch_lora":  # other parameters train: only the zero-B forward and loss compare
                entries = {k: v for k, v in entries.items() if "grad_norm" not in k and "weight" not in k}
            parity.update(entries)
        for _ in range(args.repeats):
            for name, b in backends.items():
                t = time.perf_counter()
                m = b.forward_backward(batch, loss_fn)
                b.optimizer_step()
                times[name].append(time.perf_counter() - t)
                losses[name] = m.loss
    finally:
        for b in backends.values():
            close = getattr(b, "close", None)
            if close:
                close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print("parity (fp32, same initial HF weights; one update = forward_backward + optimizer_step):")
    for key, value in parity.items():
        print(f"  {key:<52} {value:.3g}")
    print(f"{args.preset}: {args.samples} samples, {batch.num_tokens} tokens, {args.repeats} rounds, 1 thread/process")
    print(f"{'backend':<18} {'median s':>9} {'min s':>8} {'vs torch':>9} {'last loss':>12}")
    for name in backends:
        print(f"{name:<18} {med[name]:>9.4f} {min(times[name]):>8.4f} {med[name] / med['torch']:>8.2f}x "
              f"{losses[name]:>12.6f}")
    out = {"preset": args.preset, "tokens": batch.num_tokens,
           **{f"{name}_step_s": round(v, 4) for name, v in med.items()},
           "megatron_vs_torch_ratio": round(med["megatron"] / med["torch"], 3),
           **{k: float(f"{v:.3g}") for k, v in parity.items() if "logprob" in k or "grad_norm" in k},
           **lora_vs_full(backends, med)}
    if parallel:
        out[f"{parallel}_vs_torch_ratio"] = round(med[parallel] / med["torch"], 3)
    print(json.dumps(out))


def lora_vs_full(backends: dict, med: dict[str, float]) -> dict[str, float]:
    """LoRA against full fine-tuning on the torch backend: step-time and optimizer-state ratios."""
    full, lora = optimizer_bytes(backends["torch"]), optimizer_bytes(backends["torch_lora"])
    return {"lora_vs_full_step_time": round(med["torch_lora"] / med["torch"], 3),
            "lora_vs_full_optimizer_bytes": float(f"{lora / full:.3g}"),
            "torch_optimizer_bytes": full, "torch_lora_optimizer_bytes": lora}


if __name__ == "__main__":
    main()
