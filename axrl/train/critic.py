"""The critic of PPO (`algo.advantage: gae`): a value model and its optimizer, in-process.

The value model is the policy's architecture with the LM head replaced by a scalar head
(`ValueModel`); V_t is read from the hidden state at position t−1 — the state in which token t
was sampled, the same position whose logits gave token t's logprob (PackedBatch alignment;
V_0 = 0, position 0 is never a trained token). The head's weight starts small and random
(N(0, VALUE_HEAD_STD²), from a generator of its own), its bias at 0: a zero weight would leave the
body without gradient (∂V/∂hidden = the head's weight), so only the bias and the head's weight along
features the policy's last hidden state already carries could learn — and the policy's features
need not carry what predicts the return (bench/critic_fit.py: on a task whose reward the prompt
decides, a zero head explained 0–4 % of held-out return variance after 10 steps, a random one 97 %).

It reuses the policy backend's pieces so the two step alike: the same micro-batch split and
right padding (`axrl.train.micro_batch`), the same AdamW groups, grad norm and clipping
(`axrl.train.optim`), the same pickle-free checkpoint files (`checkpoint_files`, in a `critic/`
directory beside the policy's). The loss is `axrl.train.value_loss`. Routing replay does not
apply to the critic (its routers are its own). Deterministic under the backend's determinism
settings: no randomness is drawn, so replay re-executes its updates bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from pydantic import Field
from torch import nn

from axrl.train.value_loss import explained_variance, value_loss
from axrl.model import Qwen3ForCausalLM
from axrl.train.checkpoint_files import check_optimizer_state, read_checkpoint, warn_config_diff, write_checkpoint
from axrl.train.determinism import capture_rng_state
from axrl.train.fingerprint import weights_fingerprint
from axrl.train.micro_batch import micro_batch_ranges, pad_micro_batch, unpad
from axrl.train.optim import adamw, adamw_update, lr_at, restore_adamw_state
from axrl.train.protocol import PackedBatch
from axrl.train.settings import BackendConfig

CRITIC_DIR = "critic"   # the critic's checkpoint files, inside the run checkpoint's directory


class CriticConfig(BackendConfig):
    """The critic's optimizer and micro-batching (`BackendConfig`) plus PPO's value clipping and
    its updates (mini-batches) per step."""

    value_clip: float | None = Field(0.2, gt=0, description="PPO value clipping: V_old ± value_clip (None = off)")
    updates_per_step: int = Field(1, ge=1)


@dataclass
class CriticUpdate:
    """One critic optimizer update: its value loss (token mean), clipped fraction, grad norm, lr."""

    value_loss: float
    value_clip_frac: float
    grad_norm: float
    lr: float


VALUE_HEAD_STD = 0.02   # the value head's initial weight std (HF's initializer_range, verl's critic head)


def initial_value_head(hidden_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The value head's initial weights ({"weight": [1, hidden], "bias": [1]}, float32, CPU): weight
    N(0, VALUE_HEAD_STD²) from its own generator seeded with `seed` (the process RNG is not drawn
    from, so building a critic moves no run's random stream), bias 0."""
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(1, hidden_size, generator=g) * VALUE_HEAD_STD, "bias": torch.zeros(1)}


class ValueModel(nn.Module):
    """The policy's decoder with a scalar value head instead of the LM head (module docstring: its init)."""

    def __init__(self, body: Qwen3ForCausalLM, seed: int = 0) -> None:
        super().__init__()
        body.lm_head = nn.Identity()  # type: ignore[assignment]  # (never called: compute_logits=False)
        self.body = body
        p = next(body.parameters())
        self.value_head = nn.Linear(body.config.hidden_size, 1, device=p.device, dtype=p.dtype)
        init = initial_value_head(body.config.hidden_size, seed)
        with torch.no_grad():
            self.value_head.weight.copy_(init["weight"])
            self.value_head.bias.copy_(init["bias"])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """float32 [b, S]: V at each position, in PackedBatch alignment (column s from hidden s−1)."""
        hidden = self.body(input_ids, attention_mask=attention_mask, compute_logits=False).hidden
        v = self.value_head(hidden).squeeze(-1).float()
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)


def critic_batch(batch: PackedBatch, old_values: torch.Tensor, returns: torch.Tensor) -> PackedBatch:
    """The critic's training batch: tokens and loss mask of `batch`, with the returns in the
    `advantages` slot and the old values in `old_logprobs`, so that `select` and the micro-batch
    split carry them with their tokens."""
    return dataclasses.replace(batch, advantages=returns.float(), old_logprobs=old_values.float(),
                               rollout_logprobs=None, ref_logprobs=None, routed_experts=None)


class CriticFiles:
    """A critic's checkpoint files in `critic/` beside the policy's, from its `state_dict` and into
    its `load_state_dict` (the torch critic's and the Megatron backend's)."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any], sources: dict[str, str] | None = None) -> None:
        raise NotImplementedError

    def save(self, directory: str | Path) -> None:
        """The critic's checkpoint files in `directory/critic`."""
        write_checkpoint(Path(directory) / CRITIC_DIR, self.state_dict())

    def load(self, directory: str | Path) -> None:
        """Restore from `directory/critic` (every file validated first; never unpickles)."""
        d = Path(directory) / CRITIC_DIR
        if not d.is_dir():
            raise FileNotFoundError(f"{d} not found: this run trains a critic (algo.advantage: gae) but the "
                                    "checkpoint has no critic state (written by a run without `critic`?)")
        self.load_state_dict(*read_checkpoint(d))


class Critic(CriticFiles):
    """The value model, its AdamW and schedule counters; `values` (no grad) and `train` (updates)."""

    def __init__(self, body: Qwen3ForCausalLM, config: CriticConfig, *, from_policy: bool = True) -> None:
        self.config = config
        # Started from the policy (critic.model null): `copy_policy` gives it the policy's weights at
        # RL start, after the warm-up, as PPO's critic is initialised from the SFT model.
        self.from_policy = from_policy
        self.model = ValueModel(body, seed=config.seed)
        self.device = next(self.model.parameters()).device
        self._params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = adamw([p for _, p in self._params], lr=lr_at(config, 0), betas=config.betas,
                               eps=config.eps, weight_decay=config.weight_decay)
        self.scheduler_step = 0
        self.skipped_steps = 0

    def _micro_batches(self, batch: PackedBatch) -> list[PackedBatch]:
        ranges = micro_batch_ranges(batch, self.config.micro_batch_tokens, self.config.micro_batch_size)
        return [batch] if len(ranges) == 1 else [batch.select(list(r)) for r in ranges]

    def _run(self, mb: PackedBatch) -> torch.Tensor:
        """Packed V [T_mb] (float32, on the model's device) of one micro-batch."""
        pm = pad_micro_batch(mb, device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.dtype == "bfloat16"):
            v = self.model(pm.input_ids, pm.attention_mask)
        return unpad(v, pm.rows, pm.cols)

    def values(self, batch: PackedBatch) -> torch.Tensor:
        """float32 [T] (on the batch's device): V of every token (0 at each sample's first)."""
        self.model.eval()
        with torch.no_grad():
            v = torch.cat([self._run(mb) for mb in self._micro_batches(batch)])
        return v.to(batch.input_ids.device)

    def train(self, batch: PackedBatch, splits: Sequence[Sequence[int]]) -> list[CriticUpdate]:
        """One update per entry of `splits` (sample rows of a `critic_batch`), in order."""
        return [self._update(batch.select(list(samples))) for samples in splits]

    def _update(self, batch: PackedBatch) -> CriticUpdate:
        """Accumulate the value loss micro-batch by micro-batch (normalised by the update's trained
        tokens), then the policy's update arithmetic (`optim.adamw_update`)."""
        self.model.train()
        denom = float(batch.loss_mask.sum().clamp(min=1))
        total, clipped = 0.0, 0.0
        for mb in self._micro_batches(batch):
            values = self._run(mb)  # padded from the host batch, as the policy's forward is
            mb = mb.to(self.device)
            assert mb.old_logprobs is not None and mb.advantages is not None
            loss, n_clipped = value_loss(values, mb.old_logprobs, mb.advantages, mb.loss_mask,
                                         self.config.value_clip, denom)
            loss.backward()
            total += float(loss.detach())
            clipped += float(n_clipped)
        lr = lr_at(self.config, self.scheduler_step)
        norm, _, applied = adamw_update(self.optimizer, [p for _, p in self._params], lr=lr,
                                        grad_clip=self.config.grad_clip)
        if applied:
            self.scheduler_step += 1
        else:
            self.skipped_steps += 1
        return CriticUpdate(value_loss=total, value_clip_frac=clipped / denom, grad_norm=float(norm), lr=lr)

    def copy_policy(self, weights: dict[str, torch.Tensor]) -> None:
        """Load the policy's HF-named `weights` into the value model's decoder (the head is kept)."""
        body = dict(self.model.body.named_parameters())
        missing = sorted(set(body) - set(weights))
        if missing:
            raise ValueError(f"the policy's weights do not fit the critic's decoder (missing {missing[:5]})")
        with torch.no_grad():
            for name, p in body.items():
                p.copy_(weights[name])

    # ------------------------------------------------------------------ state
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The value model's parameters by name (views)."""
        return ((n, p.detach()) for n, p in self._params)

    def fingerprint(self) -> str:
        """Digest of the critic's weights (recorded per step, compared by replay)."""
        return weights_fingerprint(self.named_weights())

    def state_dict(self) -> dict[str, Any]:
        """Weights, AdamW moments per parameter name, schedule counters, config (the policy
        backend's checkpoint layout, so `checkpoint_files` writes and validates it)."""
        optim = {name: {k: v.detach().clone() for k, v in self.optimizer.state[p].items()}
                 for name, p in self._params if p in self.optimizer.state}
        return {"model": {n: p.clone() for n, p in self.named_weights()}, "optimizer": optim,
                "scheduler_step": self.scheduler_step, "skipped_steps": self.skipped_steps,
                "rng": capture_rng_state(), "config": self.config.to_dict()}

    def load_state_dict(self, state: dict[str, Any], sources: dict[str, str] | None = None) -> None:
        """Restore `state_dict`'s output (validated first; the RNG is the policy backend's to restore)."""
        params = dict(self._params)
        weights = check_critic_state(params, state, self.config, critic_sources(sources))
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n])
        restore_adamw_state(self.optimizer, params, state["optimizer"])
        self.scheduler_step = int(state["scheduler_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def critic_sources(sources: dict[str, str] | None) -> Callable[[str], str]:
    """Where each key of a critic state came from (`read_checkpoint`'s file names), for errors."""
    return lambda key: (sources or {}).get(key, f"critic state dict['{key}']")


def check_critic_state(params: dict[str, torch.Tensor], state: dict[str, Any], config: CriticConfig,
                       src: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """Validate a critic `state` against the value model's `params` (names and shapes of weights and
    AdamW moments; a config that differs warns) before anything changes; its weights."""
    check_optimizer_state(params, state["optimizer"], src("optimizer"))
    weights = state["model"]
    if set(weights) != set(params) or any(tuple(weights[n].shape) != tuple(p.shape) for n, p in params.items()):
        raise ValueError(f"{src('model')}: the critic's weights do not match its value model "
                         f"(missing {sorted(set(params) - set(weights))[:5]}, "
                         f"unknown {sorted(set(weights) - set(params))[:5]}, or shapes differ)")
    if state.get("config") is not None:
        warn_config_diff(config, state["config"], src("config"))
    return weights


def critic_metrics(updates: list[CriticUpdate], old_values: torch.Tensor, returns: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, float]:
    """The step's critic metrics: value_loss / value_clip_frac / critic_grad_norm (means over its
    updates) and the explained variance of the values GAE used."""
    n = max(len(updates), 1)
    return {"value_loss": sum(u.value_loss for u in updates) / n,
            "value_clip_frac": sum(u.value_clip_frac for u in updates) / n,
            "critic_grad_norm": sum(u.grad_norm for u in updates) / n,
            "critic_lr": updates[-1].lr if updates else float("nan"),
            "explained_variance": explained_variance(old_values, returns, mask)}
