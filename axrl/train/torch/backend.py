"""The embedded PyTorch train backend: micro-batched forward/backward, AdamW, LR schedule and
pickle-free checkpoints, bitwise reproducible in deterministic mode (docs/design.md).

Precision: parameters, gradients and optimizer state stay in the model's dtype (fp32 for
`build_model`); `dtype="bfloat16"` runs the forward under CPU/CUDA autocast (fp32 master
weights, as Megatron's bf16 mode does). Logprobs and entropy are always computed in fp32.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from axrl.model import ModelConfig, Qwen3ForCausalLM, hf_state_dict, load_weights_into, save_hf
from axrl.model.exact import set_exact
from axrl.train.critic import Critic
from axrl.train.checkpoint_files import check_optimizer_state, read_checkpoint, warn_config_diff, write_checkpoint
from axrl.train.determinism import capture_rng_state, restore_rng_state, set_determinism
from axrl.train.fingerprint import weights_fingerprint
from axrl.train.torch.inspection import inspect_model
from axrl.train.torch.lora import LoRAAdapters, LoRAConfig, export_peft
from axrl.train.metrics import join_token_columns, reduce_microbatch_metrics, split_token_columns
from axrl.train.micro_batch import (label_logprobs, micro_batch_ranges, next_token_logprobs, pad_micro_batch,
                                    restrict_routing_, unpad)
from axrl.train.optim import adamw, adamw_update, lr_at, restore_adamw_state, set_adam_hyper
from axrl.train.prefix_tree import build_prefix_tree
from axrl.train.protocol import (R3, AdamHyper, ForwardProbe, ForwardResult, Inspection, LossContext, LossFn, PackedBatch, R3Scope,
                                 StepStats, TrainMetrics)
from axrl.train.r3 import use_r3
from axrl.train.settings import BackendConfig


class TorchBackendConfig(BackendConfig):
    """Optimizer, schedule, micro-batching and determinism settings of `TorchBackend` (the shared
    `BackendConfig`) plus `lora`: train LoRA adapters on a frozen base (None = full fine-tuning)."""

    lora: LoRAConfig | None = None
    exact: bool = False  # rollout.exact: the forwards run the exact op set (axrl/model/exact.py)


class TorchBackend:
    """`TrainBackend` over the embedded `Qwen3ForCausalLM`, in-process.

    With `config.deterministic` the constructor calls `set_determinism(seed, num_threads)`,
    which is process-global (seeds, thread count, deterministic algorithms).
    """

    def __init__(self, model: Qwen3ForCausalLM, config: TorchBackendConfig | None = None, tokenizer: Any = None) -> None:
        self.config = config = config or TorchBackendConfig()
        if config.deterministic:
            set_determinism(config.seed, config.num_threads, deterministic=True)
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model = set_exact(model, True) if config.exact else model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # With LoRA the base is frozen and only the adapters (PEFT names) train.
        self.lora = None if config.lora is None else LoRAAdapters(model, config.lora, config.seed)
        # One fixed parameter order drives grad norm, optimizer groups and checkpoints.
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params += self.lora.named_parameters() if self.lora else []
        self._hf_names = [n for n, _ in self._params]  # the model's parameter names are HF names
        self.optimizer = adamw([p for _, p in self._params], lr=lr_at(config, 0), betas=config.betas, eps=config.eps,
                               weight_decay=config.weight_decay)
        self.scheduler_step = 0     # applied updates; skipped (non-finite) updates don't count
        self.skipped_steps = 0
        self._has_grads = False
        self._kept: dict[str, dict[str, torch.Tensor]] = {}  # keep_weights copies, by key
        # PPO's value model (algo.advantage: gae), set by the run's assembly; saved and loaded with
        # the policy, so checkpoints, resume and replay carry it (axrl/train/critic.py).
        self.critic: Critic | None = None

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    # ------------------------------------------------------------------ forward / backward
    def _micro_batch_ranges(self, batch: PackedBatch) -> list[range]:
        return micro_batch_ranges(batch, self.config.micro_batch_tokens, self.config.micro_batch_size,
                                  merged=self.config.prefix_merge)

    def _micro_batches(self, batch: PackedBatch) -> list[PackedBatch]:
        ranges = self._micro_batch_ranges(batch)
        return [batch] if len(ranges) == 1 else [batch.select(list(r)) for r in ranges]

    def _use_r3(self, batch: PackedBatch, r3: R3) -> R3Scope | None:
        return use_r3(self.model.config, batch, r3)

    def _run(self, mb: PackedBatch, r3: R3Scope | None, probe: ForwardProbe | None = None,
             samples: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """Packed (logprobs, entropy, routing) [T_mb] of one micro-batch, on the model's device, and
        how many positions the forward computed (samples × longest; tree slots when merged).
        `probe`: see `probe_forward` (its hook points sit on the padded layout, so a probed forward
        is the unmerged one); `samples` are the micro-batch's rows in the whole batch."""
        if self.config.prefix_merge and probe is None:
            return self._run_merged(mb, r3)
        pm = pad_micro_batch(mb, with_routing=r3 is not None, device=self.device, scope=r3)
        if probe is not None:
            probe.begin(samples or [], pm.rows, pm.cols)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.dtype == "bfloat16"):
            out = self.model(pm.input_ids, attention_mask=pm.attention_mask, forced_experts=pm.forced_experts,
                             return_routing=True, probe=probe)
        logprobs, entropy = next_token_logprobs(out.logits, pm.input_ids, mb.temperature)
        routing = None if out.routed_experts is None else unpad(out.routed_experts, pm.rows, pm.cols)
        return unpad(logprobs, pm.rows, pm.cols), unpad(entropy, pm.rows, pm.cols), routing, pm.input_ids.numel()

    def _run_merged(self, mb: PackedBatch, r3: R3Scope | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """`_run` over the micro-batch's prefix tree: one [1, S] forward with the tree attention
        mask (dense bool, SDPA; exact on CPU), unpacked to the micro-batch's tokens."""
        tree = build_prefix_tree(mb)
        dev = self.device
        forced = None
        if r3 is not None:
            if mb.routed_experts is None:
                raise ValueError("R3 needs PackedBatch.routed_experts, but the batch has none")
            # A shared slot replays its training path's routing (PrefixTree.routing_source).
            forced = mb.routed_experts.long().cpu()[tree.routing_source][None]
            if not r3.full:
                slots = torch.arange(tree.num_slots)
                loss_rows = mb.loss_mask.cpu()[tree.routing_source] > 0
                restrict_routing_(forced, r3, torch.zeros_like(slots), slots, loss_rows)
            forced = forced.to(dev)
        mask = tree.attention_mask(dev)[None, None]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.config.dtype == "bfloat16"):
            out = self.model(tree.input_ids[None].to(dev), position_ids=tree.position_ids[None].to(dev), mask=mask,
                             forced_experts=forced, return_routing=True)
        logprobs, entropy = label_logprobs(out.logits[0], tree.labels.to(dev), mb.temperature)
        routing = None if out.routed_experts is None else tree.unpack(out.routed_experts[0])
        return tree.unpack_predictions(logprobs), tree.unpack_predictions(entropy), routing, tree.num_slots

    def forward(self, batch: PackedBatch, *, r3: R3 = False, weights: str | None = None) -> ForwardResult:
        """No-grad logprobs/entropy [T] (fp32) and the routing [T, L, k] this forward used; under
        the weights kept as `weights` when given (see `keep_weights`)."""
        return self._no_grad_forward(batch, r3, weights=weights)

    def _no_grad_forward(self, batch: PackedBatch, r3: R3, *, weights: str | None = None,
                         probe: ForwardProbe | None = None) -> ForwardResult:
        r3 = self._use_r3(batch, r3)
        # The micro-batches' rows in the batch: the probe is told which samples each one holds.
        ranges = self._micro_batch_ranges(batch)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._swapped(weights):
                parts = [self._run(mb, r3, probe, list(rng)) for rng, mb in zip(ranges, self._micro_batches(batch))]
        finally:
            self.model.train(was_training)
        out_device = batch.input_ids.device
        routing = None if parts[0][2] is None else torch.cat([p[2] for p in parts]).to(out_device)
        return ForwardResult(logprobs=torch.cat([p[0] for p in parts]).to(out_device),
                             entropy=torch.cat([p[1] for p in parts]).to(out_device), routed_experts=routing)

    @contextlib.contextmanager
    def _swapped(self, key: str | None) -> Iterator[None]:
        """Run the block with the parameters' storage pointed at the kept copy `key`."""
        if key is None:
            yield
            return
        if key not in self._kept:
            raise KeyError(f"no weights kept under {key!r} (kept: {sorted(self._kept)})")
        kept = self._kept[key]
        current = {name: p.data for name, p in self._params}
        try:
            for name, p in self._params:
                p.data = kept[name]
            yield
        finally:
            for name, p in self._params:
                p.data = current[name]

    def keep_weights(self, key: str) -> None:
        self._kept[key] = {name: p.detach().clone() for name, p in self._params}

    def forget_weights(self, key: str) -> None:
        self._kept.pop(key, None)

    def probe_forward(self, batch: PackedBatch, probe: ForwardProbe, *, r3: R3 = False) -> ForwardResult:
        """`forward` (current weights) with `probe` on the model's hook points, same micro-batches."""
        return self._no_grad_forward(batch, r3, probe=probe)

    def inspect(self, batch: PackedBatch, loss_fn: LossFn, *, r3: R3 = False) -> Inspection:
        # LoRA dropout draws from the global RNG in training-mode forwards: an inspection between
        # two steps must leave the RNG where it was, or the next step would not re-execute bitwise.
        rng = capture_rng_state() if self.lora and self.lora.config.dropout > 0 else None
        try:
            return inspect_model(self.model, batch, loss_fn, r3=self._use_r3(batch, r3),
                                 autocast_bf16=self.config.dtype == "bfloat16", params=self._params)
        finally:
            if rng is not None:
                restore_rng_state(rng)

    def close(self) -> None:
        """Nothing to release: the model lives in this process."""

    def forward_backward(self, batch: PackedBatch, loss_fn: LossFn, *, r3: R3 = False) -> TrainMetrics:
        """Accumulate grads of `loss_fn` micro-batch by micro-batch (fixed order, see micro_batch.py).

        `ctx` counts the whole `batch`; when one optimizer batch is fed through several calls,
        the loss function must normalise over the full optimizer batch itself.
        """
        r3 = self._use_r3(batch, r3)
        self.model.train()
        ctx = LossContext.of(batch)
        rows: list[dict[str, float]] = []
        columns: list[dict[str, torch.Tensor]] = []
        for mb in self._micro_batches(batch):
            logprobs, entropy, _, computed = self._run(mb, r3)
            loss, metrics = loss_fn(logprobs, entropy, mb.to(self.device), ctx)
            if loss.requires_grad:
                loss.backward()
            self._has_grads = True
            scalars, cols = split_token_columns(metrics, mb.num_tokens)
            columns.append(cols)
            rows.append({"loss": float(loss.detach()), **scalars,
                         "num_tokens": float(mb.num_tokens), "num_loss_tokens": float(mb.loss_mask.sum()),
                         "num_computed": float(computed)})
        return TrainMetrics(loss=sum(r["loss"] for r in rows), micro_batches=rows, metrics=_aggregate(rows),
                            tokens=join_token_columns(columns))

    # ------------------------------------------------------------------ optimizer
    def optimizer_step(self, *, lr: float | None = None, lr_scale: float = 1.0,
                       adam: AdamHyper | None = None) -> StepStats:
        """Grad norm (before clipping), clip, AdamW step, schedule step, zero grads. The rate is
        `lr` when given, else the schedule's times `lr_scale`; `adam` (else the config's) gives the
        betas, eps, weight decay and clip norm.

        A non-finite grad norm skips the update and the schedule step (as Megatron does), so
        the weights and optimizer moments stay intact; the nan/inf norm is reported.
        """
        if not self._has_grads:
            raise RuntimeError("optimizer_step() called without a forward_backward() since the last step")
        lr = lr_at(self.config, self.scheduler_step) * lr_scale if lr is None else lr
        c = self.config
        adam = adam or AdamHyper(c.betas, c.eps, c.weight_decay, c.grad_clip)
        set_adam_hyper(self.optimizer, adam.betas, adam.eps, adam.weight_decay)
        norm, per_tensor, applied = adamw_update(self.optimizer, [p for _, p in self._params], lr=lr,
                                                 grad_clip=adam.grad_clip)
        if applied:
            self.scheduler_step += 1
        else:
            self.skipped_steps += 1
        self._has_grads = False
        return StepStats(grad_norm=float(norm), lr=lr,
                         param_grad_norm=dict(zip(self._hf_names, per_tensor.tolist())))

    def reset_optimizer(self) -> None:
        self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler_step = self.skipped_steps = 0
        self._has_grads = False

    # ------------------------------------------------------------------ weights
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights under HF names (tied lm_head omitted); views, not copies. With LoRA the
        adapted weights are merged (new tensors): what the engine runs and the trace fingerprints."""
        weights = hf_state_dict(self.model)
        return iter((self.lora.merged(weights) if self.lora else weights).items())

    def sync_source(self) -> dict[str, torch.Tensor]:
        """The HF-named weights (views; `WeightSync.post` takes the copy)."""
        return dict(self.named_weights())

    def fingerprint(self) -> str:
        return weights_fingerprint(self.named_weights())

    def export_hf(self, directory: str | Path) -> Path:
        """The model as an HF directory; with LoRA the merged model (`lora.export_peft` writes the
        adapters alone)."""
        with self.lora.merged_into_model() if self.lora else contextlib.nullcontext():
            return save_hf(self.model, directory, self.tokenizer)

    def export_adapter(self, directory: str | Path, base_model: str | None = None) -> Path:
        """The LoRA adapters alone in PEFT's format for the base model at `base_model` (`lora.export_peft`)."""
        if self.lora is None:
            raise ValueError("no LoRA adapters to export: train.lora is null (full fine-tuning); "
                             "export the whole model instead")
        return export_peft(self.lora, directory, base_model, moe=self.model.config.is_moe)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """A copy of everything needed to continue bitwise: weights (HF names; with LoRA the base
        weights and the adapters under their PEFT names), AdamW moments and steps per param name,
        schedule counters, global RNG states and the config."""
        optim = {name: {k: v.detach().clone() for k, v in self.optimizer.state[p].items()}
                 for name, p in self._params if p in self.optimizer.state}
        adapters = self.lora.state_dict() if self.lora else {}
        return {
            "model": {**{k: v.clone() for k, v in hf_state_dict(self.model).items()}, **adapters},
            "optimizer": optim,
            "scheduler_step": self.scheduler_step,
            "skipped_steps": self.skipped_steps,
            "rng": capture_rng_state(),
            "config": self.config.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_state(state, sources={})

    def _load_state(self, state: dict[str, Any], sources: dict[str, str]) -> None:
        src = lambda key: sources.get(key, f"state dict['{key}']")  # noqa: E731
        check_optimizer_state(dict(self._params), state["optimizer"], src("optimizer"))
        if state.get("config") is not None:
            warn_config_diff(self.config, state["config"], src("config"))
        try:  # first: a malformed RNG state fails before weights or moments change
            restore_rng_state(state["rng"])
        except ValueError as e:
            raise ValueError(f"{src('rng')}: {e}") from e
        self._load_weights(state["model"], src("model"))
        restore_adamw_state(self.optimizer, dict(self._params), state["optimizer"])
        self.scheduler_step = int(state["scheduler_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._has_grads = False

    def _load_weights(self, weights: dict[str, torch.Tensor], source: str) -> None:
        """The checkpoint's base weights into the model, its adapters (if any) into the adapters."""
        own = self.lora.owns if self.lora else (lambda key: False)
        adapters = {k: v for k, v in weights.items() if own(k)}
        if self.lora:
            self.lora.check(adapters, source)  # before the base weights change
        load_weights_into(self.model, {k: v for k, v in weights.items() if not own(k)}, source=source)
        if self.lora:
            self.lora.load_state_dict(adapters, source)

    def save(self, directory: str | Path) -> None:
        """Write model/optimizer/rng safetensors and trainer_state.json (`checkpoint_files`)."""
        write_checkpoint(directory, self.state_dict())
        if self.critic is not None:
            self.critic.save(directory)

    def load(self, directory: str | Path) -> None:
        """Restore a `save`d checkpoint; every file is validated (the weights against the recorded
        fingerprint) before any state is changed. Never unpickles. With a critic, its state too
        (`critic/`, read first: a checkpoint without it fails before the policy changes)."""
        if self.critic is not None:
            self.critic.load(directory)
        self._load_state(*read_checkpoint(directory))


def _aggregate(rows: list[dict[str, float]]) -> dict[str, float]:
    """Whole-call metrics. Loss functions normalise by batch-wide counts (LossContext), so
    micro-batch values add up; "*_max"/"*_min" keys combine by max/min."""
    return {**reduce_microbatch_metrics(rows), "num_micro_batches": float(len(rows))}
