"""PPO's value model on megatron-core: the policy's `GPTModel` with a scalar value head in place
of its output layer, and the critic's weight names between the two layouts.

The head is a `value_head` Linear(hidden, 1) with bias on the `GPTModel` (zero-initialised, as
the torch critic's `ValueModel`), read from the final (normed) hidden state, so V_t comes from
the same hidden state as the torch critic's. It is called where `GPTModel` calls its output layer
(`_ValueOutput`). Under sequence parallelism a rank holds a slice of the sequence: it applies the
head to its slice and gathers the values over the tensor-parallel ranks (the backward takes each
rank's slice back), so the head's gradient is partial over TP like the norms' and is summed by
the rank's optimizer step (`MegatronRank._partial_group`). Expert parallelism needs nothing here:
the decoder is the policy's, with its expert layout.

Names: the critic's checkpoint is the torch critic's (`axrl/train/critic.py`): the decoder under
`body.` + its Hugging Face names (no `lm_head`), and `value_head.weight` / `value_head.bias`, so a
critic checkpoint moves between the two backends as the policy's does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from axrl.model import ModelConfig
from axrl.train.megatron.convert import to_hf, to_megatron

VALUE_HEAD = ("value_head.weight", "value_head.bias")
BODY = "body."  # the torch critic's prefix of its decoder's weights


class _ValueOutput(nn.Module):
    """Stands in for `GPTModel.output_layer`: [s, b, h] hidden → ([s, b, 1] values, None), the
    values gathered over the sequence-parallel ranks. Holds no parameters (the head is the model's)."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], sequence_parallel: bool) -> None:
        super().__init__()
        self._head = head  # a function, not a submodule: the head's weights stay named `value_head.*`
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight: Any = None,
                runtime_gather_output: Any = None) -> tuple[torch.Tensor, None]:
        v = self._head(hidden_states)
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # every TP rank computes the loss on all values; the backward keeps its own slice's
            v = gather_from_sequence_parallel_region(v, tensor_parallel_output_grad=False)
        return v, None


def attach_value_head(model: nn.Module, hidden_size: int, sequence_parallel: bool) -> None:
    """Replace `model`'s output layer by a zero-initialised scalar value head (`model.value_head`)."""
    p = next(model.parameters())
    model.value_head = nn.Linear(hidden_size, 1, device=p.device, dtype=p.dtype)
    nn.init.zeros_(model.value_head.weight)
    nn.init.zeros_(model.value_head.bias)
    head = model.value_head
    model.output_layer = _ValueOutput(lambda h: head(h), sequence_parallel)


def shifted_values(out: torch.Tensor) -> torch.Tensor:
    """float32 [b, S] in PackedBatch alignment from the head's [b, S, 1]: column s holds V of hidden
    state s−1 (the state token s was sampled in), column 0 is 0 — as `ValueModel.forward`."""
    v = out[..., 0].float()
    return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)


def zero_head(hidden_size: int) -> dict[str, torch.Tensor]:
    """The head's initial (zero) weights, full Megatron layout."""
    return {"value_head.weight": torch.zeros(1, hidden_size), "value_head.bias": torch.zeros(1)}


def body_to_megatron(hf: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """A decoder's Hugging Face weights (the policy's or a model's; `lm_head` ignored) → the value
    model's full Megatron weights without the head. ValueError names `source` when one is missing."""
    try:
        return to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, cfg, output_layer=False)
    except KeyError as e:
        raise ValueError(f"{source}: the weights do not fit the critic's decoder (missing {e.args[0]!r})") from None


def critic_to_megatron(named: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """The critic's checkpoint names (`body.` + HF, `value_head.*`) → full Megatron weights."""
    body = {k[len(BODY):]: v for k, v in named.items() if k.startswith(BODY)}
    return {**body_to_megatron(body, cfg, source), **{k: named[k] for k in VALUE_HEAD if k in named}}


def critic_to_hf(full: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full Megatron weights of the value model → the critic's checkpoint names."""
    body = {k: v for k, v in full.items() if k not in VALUE_HEAD}
    return {**{BODY + k: v for k, v in to_hf(body, cfg, output_layer=False).items()},
            **{k: full[k] for k in VALUE_HEAD}}


__all__ = ["VALUE_HEAD", "attach_value_head", "body_to_megatron", "critic_to_hf", "critic_to_megatron",
           "shifted_values", "zero_head"]
