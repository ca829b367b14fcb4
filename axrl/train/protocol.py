"""The train-side contract shared by the embedded PyTorch backend and the Megatron-core backend.

A batch is a packed token stream with CSR offsets — the same layout as the trace's `/samples`
and `/tokens` groups — so a recorded step can be fed back to any backend unchanged (replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field

from axrl.model.config import ModelConfig


@dataclass
class PackedBatch:
    """N samples of variable length concatenated into T tokens.

    Per-token conventions (index t of sample i covers token `input_ids[offsets[i] + t]`):
    - logprob-like tensors hold log p(token_t | tokens_<t); position 0 of a sample has no
      prediction and is never in `loss_mask`.
    - `loss_mask` is 1 where the policy generated the token and it is trained on.
    - `routed_experts` [T, L, k] is the routing each token had as *input* at rollout; when set
      and R3 is on, the trainer forward replays it.
    """

    input_ids: torch.Tensor                       # int64 [T]
    offsets: torch.Tensor                         # int64 [N + 1], offsets[0] = 0, offsets[-1] = T
    loss_mask: torch.Tensor                       # float32 [T] in {0, 1}
    advantages: torch.Tensor | None = None        # float32 [T]
    old_logprobs: torch.Tensor | None = None      # float32 [T], trainer recompute before the update
    rollout_logprobs: torch.Tensor | None = None  # float32 [T], NaN where not generated
    ref_logprobs: torch.Tensor | None = None      # float32 [T], reference policy (KL penalty)
    routed_experts: torch.Tensor | None = None    # int64 [T, L, k]
    temperature: float = 1.0                      # rollout temperature; logprobs use logits / temperature

    def __post_init__(self) -> None:
        T = self.input_ids.numel()
        if self.offsets.numel() < 1 or int(self.offsets[0]) != 0 or int(self.offsets[-1]) != T:
            raise ValueError(f"PackedBatch.offsets must start at 0 and end at T={T}, "
                             f"got {self.offsets.tolist()[:3]}…{self.offsets.tolist()[-1:]}")
        if bool((self.offsets[1:] - self.offsets[:-1] < 1).any()):
            raise ValueError("PackedBatch.offsets: every sample needs at least one token")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and f.name != "offsets" and value.shape[0] != T:
                raise ValueError(f"PackedBatch.{f.name} has {value.shape[0]} rows, expected T={T}")
        if self.temperature <= 0:
            raise ValueError(f"PackedBatch.temperature must be > 0, got {self.temperature}")

    @property
    def num_samples(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def sample_index(self) -> torch.Tensor:
        """int64 [T]: the sample each token belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_samples), self.lengths)

    def to(self, device: torch.device | str) -> "PackedBatch":
        """This batch with every tensor on `device`; the batch itself when they all are there already
        (no copy, no re-validation)."""
        device = torch.device(device)
        tensors = {f.name: getattr(self, f.name) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        if all(_is_on(t, device) for t in tensors.values()):
            return self
        return replace(self, **{name: t.to(device) for name, t in tensors.items()})

    def select(self, samples: list[int]) -> "PackedBatch":
        """The sub-batch of the given samples, in the given order."""
        starts, ends = self.offsets[:-1], self.offsets[1:]
        idx = torch.cat([torch.arange(int(starts[i]), int(ends[i])) for i in samples])
        lengths = torch.tensor([int(ends[i] - starts[i]) for i in samples], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        per_token = {f.name: getattr(self, f.name)[idx] for f in fields(self)
                     if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "offsets"}
        return replace(self, offsets=offsets, **per_token)


def _is_on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` lives on `device` (a device without an index, e.g. "cuda", matches any of its kind)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


@dataclass
class LossContext:
    """Batch-wide counts, so a micro-batch's loss can be normalised as part of the whole batch and
    gradient accumulation gives the same gradient whatever the micro-batch split."""

    num_loss_tokens: int      # sum of loss_mask over the whole optimizer batch
    num_samples: int          # samples in the whole optimizer batch
    num_loss_samples: int     # samples with at least one loss token

    @classmethod
    def of(cls, batch: "PackedBatch") -> "LossContext":
        """The counts of `batch` taken as a whole optimizer batch."""
        per_sample = torch.zeros(batch.num_samples).index_add_(0, batch.sample_index().cpu(),
                                                               batch.loss_mask.float().cpu())
        return cls(num_loss_tokens=int(batch.loss_mask.sum()), num_samples=batch.num_samples,
                   num_loss_samples=int((per_sample > 0).sum()))


class LossFn(Protocol):
    """Loss over one micro-batch: returns (scalar loss to backprop, metrics).

    logprobs/entropy [T_mb] follow PackedBatch's conventions and carry grad. The returned loss
    must already be scaled to its share of the whole batch (see LossContext). Metrics are floats
    (or 0-d tensors), except keys starting with `axrl.train.metrics.TOKEN_COLUMN_PREFIX`
    ("tokens/"): per-token columns [T_mb] of the micro-batch, which the backend concatenates in
    batch order into `TrainMetrics.tokens` (what the objective did to each token).
    """

    def __call__(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch,
                 ctx: LossContext) -> tuple[torch.Tensor, dict[str, Any]]:
        ...


class R3Scope(BaseModel):
    """Which part of the recorded routing a forward replays (R3, rollout routing replay); the YAML
    section `r3_scope` (partial R3, with `r3: true`) is this type.

    `layers`: decoder-layer indices whose MoE routers replay (None: every MoE layer), minus
    `exclude_layers`; the other layers route on their own. `loss_tokens_only`: replay only at the
    rows of loss tokens (the generated tokens as inputs); prompt and tool tokens route on their
    own. `R3Scope()` is full R3, the same as `r3=True`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: tuple[int, ...] | None = Field(None, description="decoder layers that replay (null: every MoE layer)")
    exclude_layers: tuple[int, ...] = Field((), description="decoder layers that do not replay")
    loss_tokens_only: bool = Field(False, description="replay only at loss tokens (generated tokens as inputs)")

    @property
    def full(self) -> bool:
        return self.layers is None and not self.exclude_layers and not self.loss_tokens_only

    def replays_layer(self, layer: int) -> bool:
        return (self.layers is None or layer in self.layers) and layer not in self.exclude_layers


#: the `r3` argument of the backend calls: off (False), full (True) or a partial scope
R3 = bool | R3Scope


def r3_scope(r3: R3) -> R3Scope | None:
    """The scope an `r3` argument asks for (None: no replay)."""
    if isinstance(r3, R3Scope):
        return r3
    return R3Scope() if r3 else None


@dataclass
class ForwardResult:
    logprobs: torch.Tensor                  # float32 [T]; 0 at each sample's first position
    entropy: torch.Tensor                   # float32 [T]; entropy of the distribution predicting token t
    routed_experts: torch.Tensor | None     # int64 [T, L, k] for MoE models


@dataclass
class TrainMetrics:
    """What one `forward_backward` call measured: summed loss, one row per micro-batch, and the
    loss function's per-token columns over the call's batch ([T], batch order)."""

    loss: float
    micro_batches: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class AdamHyper:
    """AdamW settings of one update that replace the backend's configured ones for that update
    (a Tinker-API client sends its own with every optim_step). Weight decay applies to matrices
    only, as AxRL always decays."""

    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float   # 0: off


@dataclass
class StepStats:
    grad_norm: float   # total L2 norm before clipping
    lr: float          # learning rate used by this step
    # L2 norm of each parameter tensor's gradient before clipping, under Hugging Face names, in a
    # fixed order (their root-sum-square is grad_norm); what the total norm was made of
    param_grad_norm: dict[str, float] = field(default_factory=dict)


@dataclass
class Inspection:
    """What `TrainBackend.inspect` measured on one optimizer batch at the current weights (for
    replay's deep dumps). Row t of the per-token arrays is token t of the batch; A hooked points,
    L MoE layers, E experts, N samples, P parameter tensors."""

    activation_names: list[str]          # [A]: embed_tokens, layers.0 … layers.{n-1}, norm
    activation_norm: torch.Tensor        # float32 [T, A]  L2 norm of each token's hidden state
    moe_layers: list[int]                # [L]: decoder layer index of each MoE layer
    router_tokens: torch.Tensor          # int64 [L, E]  (token, top-k slot) assignments per expert
    router_entropy: torch.Tensor         # float64 [L]  mean entropy (nats) of the router softmax
    sample_grad_norm: torch.Tensor       # float64 [N]  ‖gradient of the sample's share of the loss‖
    sample_grad_cosine: torch.Tensor     # float64 [N]  cosine with the batch's total gradient
    param_names: list[str]               # [P]
    param_grad_norm: torch.Tensor        # float64 [P]  per-tensor norm of the total gradient


class ForwardProbe(Protocol):
    """An `axrl.model.ActivationProbe` that also learns the layout of each micro-batch it sees."""

    def begin(self, samples: list[int], rows: torch.Tensor, cols: torch.Tensor) -> None:
        """The next micro-batch holds batch samples `samples` (in row order); packed token t of it
        sits at padded position (rows[t], cols[t])."""
        ...

    def at(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        ...


@runtime_checkable
class TrainBackend(Protocol):
    """Implemented by the embedded PyTorch backend and the Megatron-core backend.

    Everything the loop, warm-up, replay and dumps need from a trainer is here, so a remote
    stand-in (a Ray actor, an RPC client) can replace a backend unchanged. Run-time knobs are
    parameters of the calls (`lr`, `lr_scale`, `weights`), never mutations of a config object.
    """

    @property
    def model_config(self) -> ModelConfig:
        """Architecture of the trained model (what an inference engine is built from)."""
        ...

    def forward(self, batch: PackedBatch, *, r3: R3 = False, weights: str | None = None) -> ForwardResult:
        """No-grad per-token logprobs, entropy and routing (e.g. old logprobs before an update).

        `r3` replays `batch.routed_experts` (True: fully; an `R3Scope`: some layers / loss tokens
        only); the returned routing is the one the forward used. `weights` names a set kept with
        `keep_weights` to compute under instead of the current weights (behaviour-policy or
        reference logprobs); the current weights are untouched."""
        ...

    def forward_backward(self, batch: PackedBatch, loss_fn: LossFn, *, r3: R3 = False) -> TrainMetrics:
        """Accumulate gradients of `loss_fn` over the batch, micro-batch by micro-batch in a fixed order."""
        ...

    def optimizer_step(self, *, lr: float | None = None, lr_scale: float = 1.0,
                       adam: AdamHyper | None = None) -> StepStats:
        """Clip, step the optimizer and LR schedule, zero the gradients.

        The learning rate is the schedule's, times `lr_scale`; `lr` replaces the schedule's value
        (a phase with its own fixed rate, e.g. a supervised warm-up). `adam` replaces the configured
        betas, eps, weight decay and clip norm for this update only."""
        ...

    def reset_optimizer(self) -> None:
        """Forget the optimizer moments and the schedule position: the next update starts a new
        phase as a freshly built backend would (RL after a supervised warm-up)."""
        ...

    def keep_weights(self, key: str) -> None:
        """Keep a copy of the current weights under `key` (replacing an older one)."""
        ...

    def forget_weights(self, key: str) -> None:
        """Drop the copy kept under `key` (no-op when there is none)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights under Hugging Face names (for weight sync to inference engines)."""
        ...

    def sync_source(self) -> Any:
        """The current weights as `InferenceEngine.update_weights` takes them, for weight sync: an
        HF-named state dict in-process (`WeightSync` copies it), or a handle that a remote
        engine resolves itself (a Ray train group's object-store snapshot, never via the driver)."""
        ...

    def fingerprint(self) -> str:
        """Cheap deterministic digest of all parameters: equal iff the weights are bitwise equal."""
        ...

    def inspect(self, batch: PackedBatch, loss_fn: LossFn, *, r3: R3 = False) -> Inspection | None:
        """Costly diagnostics of one optimizer batch at the current weights (activation norms,
        router load, per-sample gradients), without changing any state; None when the backend
        cannot observe its model's internals."""
        ...

    def probe_forward(self, batch: PackedBatch, probe: "ForwardProbe", *, r3: R3 = False) -> ForwardResult | None:
        """`forward` with `probe` on the model's hook points (`axrl.model.ActivationProbe`), micro-batch by
        micro-batch exactly as `forward` splits and pads the batch (mismatch attribution observes and
        patches the trainer's computation as it ran); before each micro-batch `probe.begin` says which
        samples it holds and where each packed token sits in the padded layout. An observing probe
        leaves the result bitwise equal to `forward`'s. None when the backend cannot hook its model."""
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...

    def save(self, directory: str | Path) -> None:
        """Weights (safetensors), optimizer, scheduler and RNG state; loading never unpickles."""
        ...

    def load(self, directory: str | Path) -> None:
        ...

    def export_hf(self, directory: str | Path) -> Path:
        """Write an HF model directory (config.json, model.safetensors, tokenizer files)."""
        ...

    def close(self) -> None:
        """Release worker processes and devices; the backend is unusable afterwards."""
        ...
