"""PPO's critic (`algo.advantage: gae`) on the Megatron backend: the driver's side of the value
model that the backend's ranks hold beside the policy (`MegatronRank.attach_critic`).

Same interface and arithmetic as the torch critic (`axrl/train/critic.py`): `values` (no grad),
`train` (one AdamW update per split, the value loss `axrl.train.value_loss` normalised by the
update's trained tokens, accumulated micro-batch by micro-batch in the same order and sizes),
`copy_policy`, the fingerprint and the pickle-free checkpoint files in `critic/`, under the torch
critic's names — so the loop, the trace, replay and resume use either, and a critic checkpoint
moves between the backends. The value model has the policy's parallel layout (TP, EP, DP): its
micro-batches are cut into DP shares like the policy's (`shares.py`), its gradients reduced and
clipped by the ranks' optimizer step, in its own optimizer slot. No randomness is drawn, so
replay re-executes its updates bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import torch

from axrl.model import ModelConfig
from axrl.train.critic import (CriticConfig, CriticFiles, CriticUpdate, check_critic_state, critic_sources,
                               initial_value_head)
from axrl.train.determinism import capture_rng_state
from axrl.train.fingerprint import weights_fingerprint
from axrl.train.megatron.rank import MegatronRank
from axrl.train.megatron.rank_calls import RankCall
from axrl.train.megatron.rank_state import gather_moments, gather_weights, load_moments
from axrl.train.megatron.shares import StepKnobs, by_micro_batch, split_for_ranks
from axrl.train.megatron.value_head import VALUE_HEAD, body_to_megatron, critic_to_hf, critic_to_megatron
from axrl.train.optim import lr_at
from axrl.train.protocol import PackedBatch

_SLOT = "critic"


class MegatronCritic(CriticFiles):
    """The value model on the Megatron backend's ranks, its AdamW slot and schedule counters."""

    def __init__(self, group: Any, dp_of: list[int], data_parallel: int, model_config: ModelConfig,
                 dtype: torch.dtype, config: CriticConfig, body: dict[str, torch.Tensor], *,
                 from_policy: bool = True, source: str = "critic.model") -> None:
        """`group` is the backend's `RankGroup` (the ranks build the value model beside the policy);
        `body` the decoder's initial weights under Hugging Face names (the policy's, or `critic.model`'s)."""
        self.config = config
        self.from_policy = from_policy  # see `Critic.from_policy`
        self._group, self._dp_of, self._dp = group, dp_of, data_parallel
        self.model_config, self._dtype = model_config, dtype
        # the torch critic's initial head (axrl.train.critic.initial_value_head), so both start alike
        head = initial_value_head(model_config.hidden_size, config.seed)
        full = {**body_to_megatron(body, model_config, source),
                **{f"value_head.{k}": v for k, v in head.items()}}
        group.call(MegatronRank.attach_critic, {k: v.detach().to("cpu", torch.float32) for k, v in full.items()})
        self.scheduler_step = 0
        self.skipped_steps = 0
        self._weights: dict[str, torch.Tensor] | None = None  # gathered, until the weights change

    def _call(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """The rank method `fn(critic_rank, *args)` on every rank's value model (checked here)."""
        return self._group.call(MegatronRank.on_critic, RankCall.of(fn, *args))

    def _each(self, fn: Callable[..., Any], batch: PackedBatch, *args: Any) -> list[list[Any]]:
        """`fn(critic_rank, work, *args)` on every rank's value model with its DP share; per
        micro-batch, the shares' answers in sample order (`shares.by_micro_batch`)."""
        c = self.config
        knobs = StepKnobs(dtype=c.dtype, micro_batch_tokens=c.micro_batch_tokens, micro_batch_size=c.micro_batch_size)
        shares = split_for_ranks(batch.to("cpu"), self._dp, knobs)
        works = [shares[d] for d in self._dp_of]
        return by_micro_batch(self._group.call_each(MegatronRank.on_critic_with, works,
                                                    RankCall.each(fn, works[0], *args)))

    def values(self, batch: PackedBatch) -> torch.Tensor:
        """float32 [T] (on the batch's device): V of every token (0 at each sample's first)."""
        per_mb = self._each(MegatronRank.value_forward, batch)
        return torch.cat([share for shares in per_mb for share in shares]).to(batch.input_ids.device)

    def train(self, batch: PackedBatch, splits: Sequence[Sequence[int]]) -> list[CriticUpdate]:
        """One update per entry of `splits` (sample rows of a `critic_batch`), in order."""
        return [self._update(batch.select(list(samples))) for samples in splits]

    def _update(self, batch: PackedBatch) -> CriticUpdate:
        """`Critic._update` on the ranks: accumulate, then the ranks' AdamW step in the critic's slot."""
        c = self.config
        denom = float(batch.loss_mask.sum().clamp(min=1))
        per_mb = self._each(MegatronRank.value_forward_backward, batch, c.value_clip, denom)
        total, clipped = 0.0, 0.0
        for shares in per_mb:
            for loss, n_clipped in (s for s in shares if s is not None):
                total += loss
                clipped += n_clipped
        lr = lr_at(c, self.scheduler_step)
        norm = self._call(MegatronRank.optimizer_step, _SLOT, lr, c.grad_clip, c.betas, c.eps, c.weight_decay)[0][0]
        if math.isfinite(norm):
            self.scheduler_step += 1
            self._weights = None
        else:
            self.skipped_steps += 1
        return CriticUpdate(value_loss=total, value_clip_frac=clipped / denom, grad_norm=float(norm), lr=lr)

    def copy_policy(self, weights: dict[str, torch.Tensor]) -> None:
        """Load the policy's HF-named `weights` into the value model's decoder (the head is kept)."""
        head = {k: v for k, v in self._full().items() if k in VALUE_HEAD}
        body = body_to_megatron(weights, self.model_config, "the policy's weights")
        self._call(MegatronRank.load_weights, {**{k: v.float() for k, v in body.items()}, **head})
        self._weights = None

    # ------------------------------------------------------------------ state
    def _full(self) -> dict[str, torch.Tensor]:
        return gather_weights(self._call, self.model_config.num_experts)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The value model's weights under the torch critic's names, gathered from the ranks."""
        if self._weights is None:
            self._weights = {k: v.to(self._dtype) for k, v in critic_to_hf(self._full(), self.model_config).items()}
        return iter(self._weights.items())

    def fingerprint(self) -> str:
        """Digest of the critic's weights (recorded per step, compared by replay)."""
        return weights_fingerprint(self.named_weights())

    def state_dict(self) -> dict[str, Any]:
        """The torch critic's `state_dict` layout: weights, AdamW moments per name, counters, config."""
        optim = gather_moments(self._call, _SLOT, lambda full: critic_to_hf(full, self.model_config),
                               self.model_config.num_experts)
        return {"model": {n: t.clone() for n, t in self.named_weights()}, "optimizer": optim,
                "scheduler_step": self.scheduler_step, "skipped_steps": self.skipped_steps,
                "rng": capture_rng_state(), "config": self.config.to_dict()}

    def load_state_dict(self, state: dict[str, Any], sources: dict[str, str] | None = None) -> None:
        """Restore `state_dict`'s output, validated first (the RNG is the policy backend's to restore)."""
        src = critic_sources(sources)
        weights = check_critic_state(dict(self.named_weights()), state, self.config, src)
        cfg, c = self.model_config, self.config
        to_mg = lambda named: critic_to_megatron(named, cfg, src("model"))  # noqa: E731
        self._call(MegatronRank.load_weights, {k: v.float() for k, v in to_mg(weights).items()})
        load_moments(self._call, _SLOT, state["optimizer"], to_mg, c.betas, c.eps, c.weight_decay)
        self.scheduler_step = int(state["scheduler_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._weights = None

__all__ = ["MegatronCritic"]
