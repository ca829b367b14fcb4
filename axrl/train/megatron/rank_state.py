"""A model's state on the ranks ↔ the checkpoint layout: weights and AdamW moments gathered from
the ranks' shards into full tensors under checkpoint names, and back. Shared by the policy
(`backend.py`, Hugging Face names) and PPO's value model (`critic.py`, the torch critic's names):
`convert` maps full Megatron-named tensors to checkpoint names, `back` the other way.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from axrl.train.megatron.convert import unshard
from axrl.train.megatron.rank import MegatronRank

Call = Callable[..., list[Any]]                     # RankGroup.call of one model: (rank method, *args) → answers
Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def gather_weights(call: Call, num_experts: int) -> dict[str, torch.Tensor]:
    """The model's full Megatron-named weights, from every rank's shard."""
    return unshard(call(MegatronRank.local_weights), num_experts=num_experts)


def gather_moments(call: Call, slot: str, convert: Convert, num_experts: int) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer slot's AdamW state per checkpoint name ({step, exp_avg, exp_avg_sq}); {} before
    its first step."""
    parts = call(MegatronRank.optimizer_state, slot)
    if not parts[0][0]:
        return {}
    step = next(iter(parts[0][0].values()))["step"]
    moments = {k: convert(unshard([({n: s[k] for n, s in st.items()}, r) for st, r in parts], num_experts=num_experts))
               for k in ADAM_KEYS}
    return {name: {"step": step.clone(), "exp_avg": moments["exp_avg"][name].clone(),
                   "exp_avg_sq": moments["exp_avg_sq"][name].clone()} for name in moments["exp_avg"]}


def load_moments(call: Call, slot: str, optim: dict[str, dict[str, torch.Tensor]], back: Convert,
                 betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Set the slot's AdamW state from `gather_moments`' layout ({} = a fresh optimizer); grads cleared."""
    full: dict[str, dict[str, torch.Tensor]] = {}
    step = 0.0
    if optim:
        step = float(next(iter(optim.values()))["step"])
        moments = {k: back({n: s[k].float() for n, s in optim.items()}) for k in ADAM_KEYS}
        full = {n: {k: moments[k][n] for k in moments} for n in moments["exp_avg"]}
    call(MegatronRank.load_optimizer_state, slot, full, step, betas, eps, weight_decay)
    call(MegatronRank.zero_grad)


__all__ = ["gather_moments", "gather_weights", "load_moments"]
