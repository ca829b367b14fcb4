"""The embedded PyTorch train backend: micro-batched forward/backward, AdamW, LR schedule and
pickle-free checkpoints, bitwise reproducible in deterministic mode (docs/design.md).

Precision: parameters, gradients and optimizer state stay in the model's dtype (fp32 for
`build_model`); `dtype="bfloat16"` runs the forward under CPU/CUDA autocast (fp32 master
weights, as Megatron's bf16 mode does). Logprobs and entropy are always computed in fp32.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

from axrl.model import ModelConfig, Qwen3ForCausalLM, hf_state_dict, load_weights_into, save_hf
from axrl.train.determinism import RngState, capture_rng_state, restore_rng_state, set_determinism
from axrl.train.fingerprint import weights_fingerprint
from axrl.train.metrics import reduce_microbatch_metrics
from axrl.train.micro_batch import (label_logprobs, micro_batch_ranges, next_token_logprobs, pad_micro_batch,
                                    restrict_routing_, unpad)
from axrl.train.prefix_tree import build_prefix_tree
from axrl.train.inspection import inspect_model
from axrl.train.metrics import join_token_columns, split_token_columns
from axrl.train.protocol import (R3, ForwardProbe, ForwardResult, Inspection, LossContext, LossFn, PackedBatch, R3Scope,
                                 StepStats, TrainMetrics, r3_scope)

CHECKPOINT_FORMAT = "axrl-torch-backend"
CHECKPOINT_VERSION = 1
MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE = (
    "model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json")
_ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


@dataclass
class TorchBackendConfig:
    """Optimizer, schedule, micro-batching and determinism settings of `TorchBackend`."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01          # applied to matrices only (not norms), as Megatron does
    grad_clip: float = 1.0              # max total L2 norm; 0 = off
    lr_schedule: str = "constant"       # constant | cosine | linear (after warmup)
    warmup_steps: int = 0
    total_steps: int = 0                # updates over which cosine/linear decay to min_lr_ratio
    min_lr_ratio: float = 0.0
    micro_batch_tokens: int = 0         # real tokens per micro-batch; 0 = no limit
    micro_batch_size: int = 0           # samples per micro-batch; 0 = no limit
    dtype: str = "float32"              # float32 | bfloat16 (autocast compute dtype)
    seed: int = 0
    num_threads: int = 0                # torch intra-op threads; 0 = keep the current count
    deterministic: bool = True
    prefix_merge: bool = False          # one forward over each micro-batch's prefix tree (train/prefix_tree.py)

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))  # JSON gives a list back
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr_schedule must be constant|cosine|linear, got {self.lr_schedule!r}")
        if self.lr_schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} needs total_steps > warmup_steps "
                             f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32|bfloat16, got {self.dtype!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("lr", "eps", "weight_decay", "grad_clip", "warmup_steps", "total_steps",
                     "micro_batch_tokens", "micro_batch_size", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TorchBackendConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TorchBackendConfig field(s) {unknown}")
        return cls(**d)


def lr_at(config: TorchBackendConfig, step: int) -> float:
    """Learning rate of update `step` (0-based count of applied updates).

    Linear warmup reaches `lr` at update warmup_steps-1 (the first update already gets
    lr/warmup_steps, not 0); then cosine/linear decay from `lr` at update warmup_steps to
    `lr * min_lr_ratio` at update total_steps and after.
    """
    c = config
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    if c.lr_schedule == "constant":
        return c.lr
    progress = min(1.0, (step - c.warmup_steps) / (c.total_steps - c.warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if c.lr_schedule == "cosine" else 1.0 - progress
    return c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * decay)


def tensor_grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """fp32 [P]: the L2 norm of each gradient tensor, in order."""
    if not grads:
        return torch.zeros(0)
    return torch.stack([g.detach().float().norm(2).cpu() for g in grads])


def grad_norm(grads: list[torch.Tensor], per_tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Total L2 norm (fp32 scalar) as the norm of per-tensor norms in a fixed order, like
    `torch.nn.utils.clip_grad_norm_` without foreach: deterministic, no cross-thread reduction order.
    `per_tensor`: the `tensor_grad_norms` of `grads` when already computed."""
    if not grads:
        return torch.zeros(())
    return (tensor_grad_norms(grads) if per_tensor is None else per_tensor).norm(2)


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale grads in place so their total norm is at most `max_norm` (torch's formula)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))


def use_r3(cfg: ModelConfig, batch: PackedBatch, r3: R3) -> R3Scope | None:
    """The R3 scope a forward replays `batch.routed_experts` under (None: no replay): r3 on an MoE
    model, with routing of the right shape and range and scope layers that exist (else ValueError)."""
    scope = r3_scope(r3)
    if scope is None or not cfg.is_moe:
        return None  # a dense model has no routing to replay
    re = batch.routed_experts
    if re is None:
        raise ValueError("r3=True but PackedBatch.routed_experts is None")
    want = cfg.routing_shape()[:2]
    if re.ndim != 3 or tuple(re.shape[1:]) != want:
        raise ValueError(f"PackedBatch.routed_experts has shape {tuple(re.shape)}, expected [T, {want[0]}, {want[1]}]")
    if re.numel() and (int(re.min()) < 0 or int(re.max()) >= cfg.num_experts):
        raise ValueError(f"PackedBatch.routed_experts holds expert ids outside [0, {cfg.num_experts})")
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    bad = [i for i in (scope.layers or ()) + scope.exclude_layers if i not in moe]
    if bad:
        raise ValueError(f"R3 scope layers {bad} are not MoE layers of the model (MoE layers: {moe})")
    return scope


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
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # One fixed parameter order drives grad norm, optimizer groups and checkpoints.
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._hf_names = [n for n, _ in self._params]  # the model's parameter names are HF names
        decay = [p for _, p in self._params if p.ndim >= 2]
        no_decay = [p for _, p in self._params if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr_at(config, 0), betas=config.betas, eps=config.eps, foreach=False, fused=False)
        self.scheduler_step = 0     # applied updates; skipped (non-finite) updates don't count
        self.skipped_steps = 0
        self._has_grads = False
        self._kept: dict[str, dict[str, torch.Tensor]] = {}  # keep_weights copies, by key

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

    def _on_device(self, mb: PackedBatch) -> PackedBatch:
        if self.device.type == "cpu":
            return mb
        moved = {f.name: getattr(mb, f.name).to(self.device) for f in fields(mb)
                 if isinstance(getattr(mb, f.name), torch.Tensor)}
        return replace(mb, **moved)

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
        return inspect_model(self.model, batch, loss_fn, r3=self._use_r3(batch, r3),
                             autocast_bf16=self.config.dtype == "bfloat16")

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
            loss, metrics = loss_fn(logprobs, entropy, self._on_device(mb), ctx)
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
    def optimizer_step(self, *, lr: float | None = None, lr_scale: float = 1.0) -> StepStats:
        """Grad norm (before clipping), clip, AdamW step, schedule step, zero grads. The rate is
        `lr` when given, else the schedule's times `lr_scale`.

        A non-finite grad norm skips the update and the schedule step (as Megatron does), so
        the weights and optimizer moments stay intact; the nan/inf norm is reported.
        """
        if not self._has_grads:
            raise RuntimeError("optimizer_step() called without a forward_backward() since the last step")
        for _, p in self._params:
            # A param without grad (e.g. an expert no token reached) gets zeros, so every param
            # is stepped like in Megatron's contiguous grad buffer and has optimizer state.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for _, p in self._params]
        per_tensor = tensor_grad_norms(grads)
        norm = grad_norm(grads, per_tensor)
        lr = lr_at(self.config, self.scheduler_step) * lr_scale if lr is None else lr
        if torch.isfinite(norm):
            if self.config.grad_clip > 0:
                clip_grads_(grads, self.config.grad_clip, norm)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.scheduler_step += 1
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
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
        """Current weights under HF names (tied lm_head omitted); views, not copies."""
        return iter(hf_state_dict(self.model).items())

    def sync_source(self) -> dict[str, torch.Tensor]:
        """The HF-named weights (views; `WeightSync.post` takes the copy)."""
        return dict(self.named_weights())

    def fingerprint(self) -> str:
        return weights_fingerprint(self.named_weights())

    def export_hf(self, directory: str | Path) -> Path:
        return save_hf(self.model, directory, self.tokenizer)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """A copy of everything needed to continue bitwise: weights (HF names), AdamW moments
        and steps per param name, schedule counters, global RNG states and the config."""
        optim = {name: {k: v.detach().clone() for k, v in self.optimizer.state[p].items()}
                 for name, p in self._params if p in self.optimizer.state}
        return {
            "model": {k: v.clone() for k, v in hf_state_dict(self.model).items()},
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
        self._check_optimizer_state(state["optimizer"], src("optimizer"))
        if state.get("config") is not None:
            self._warn_config_diff(state["config"], src("config"))
        try:  # first: a malformed RNG state fails before weights or moments change
            restore_rng_state(state["rng"])
        except ValueError as e:
            raise ValueError(f"{src('rng')}: {e}") from e
        load_weights_into(self.model, state["model"], source=src("model"))
        self.optimizer.state.clear()
        params = dict(self._params)
        for name, s in state["optimizer"].items():
            p = params[name]
            self.optimizer.state[p] = {"step": s["step"].detach().clone().cpu(),
                                       "exp_avg": s["exp_avg"].detach().to(p.device, p.dtype).clone(),
                                       "exp_avg_sq": s["exp_avg_sq"].detach().to(p.device, p.dtype).clone()}
        self.scheduler_step = int(state["scheduler_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.optimizer.zero_grad(set_to_none=True)
        self._has_grads = False

    def _check_optimizer_state(self, optim: dict[str, dict[str, torch.Tensor]], source: str) -> None:
        """Validate before touching anything: all params or none (before the first update)."""
        params = dict(self._params)
        unknown = sorted(set(optim) - set(params))
        missing = sorted(set(params) - set(optim)) if optim else []
        if unknown or missing:
            raise ValueError(f"{source}: optimizer state does not match the model's parameters "
                             f"(unknown {unknown[:5]}, missing {missing[:5]})")
        for name, s in optim.items():
            if set(s) != set(_ADAM_KEYS):
                raise ValueError(f"{source}: '{name}' has optimizer entries {sorted(s)}, expected {list(_ADAM_KEYS)}")
            for k in ("exp_avg", "exp_avg_sq"):
                if tuple(s[k].shape) != tuple(params[name].shape):
                    raise ValueError(f"{source}: '{name}.{k}' has shape {tuple(s[k].shape)}, "
                                     f"the parameter has {tuple(params[name].shape)}")

    def _warn_config_diff(self, saved: dict[str, Any], source: str) -> None:
        # The current config wins (a resume may change e.g. lr on purpose), but a silent change
        # breaks bitwise continuation, so say so.
        current = self.config.to_dict()
        # A common field the checkpoint predates (e.g. prefix_merge) had its default then; fields
        # of one backend only (Megatron's layout) still show up when moving between backends.
        saved = {**TorchBackendConfig().to_dict(), **saved}
        diff = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)}
        if diff:
            warnings.warn(f"{source}: checkpoint config differs from the current one (saved, current): {diff}",
                          stacklevel=3)

    def save(self, directory: str | Path) -> None:
        """Write model/optimizer/rng safetensors and trainer_state.json (written last: its
        presence marks a complete checkpoint). Each file is written to *.tmp then renamed."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        rng: RngState = state["rng"]
        optim = {f"{name}.{k}": v.contiguous() for name, s in state["optimizer"].items() for k, v in s.items()}
        _atomic(d / MODEL_FILE, lambda p: save_file(state["model"], p, metadata={"format": "pt"}))
        _atomic(d / OPTIMIZER_FILE, lambda p: save_file(optim, p, metadata={"format": "axrl-adamw"}))
        _atomic(d / RNG_FILE, lambda p: save_file(rng.tensors, p))
        meta = {
            "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
            "scheduler_step": state["scheduler_step"], "skipped_steps": state["skipped_steps"],
            "weights_fingerprint": weights_fingerprint(state["model"]),
            "config": state["config"], "rng": rng.meta,
            "num_threads": torch.get_num_threads(), "torch_version": torch.__version__,
        }
        _atomic(d / STATE_FILE, lambda p: Path(p).write_text(json.dumps(meta, indent=1) + "\n"))

    def load(self, directory: str | Path) -> None:
        """Restore a `save`d checkpoint; every file is validated (the weights against the recorded
        fingerprint) before any state is changed. Never unpickles."""
        d = Path(directory)
        state_path = d / STATE_FILE
        meta = _read_json(state_path)
        if meta.get("format") != CHECKPOINT_FORMAT or meta.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"{state_path}: not a {CHECKPOINT_FORMAT} v{CHECKPOINT_VERSION} checkpoint "
                             f"(format={meta.get('format')!r}, version={meta.get('version')!r})")
        try:
            scheduler_step, skipped, fp, config, rng_meta = (
                int(meta["scheduler_step"]), int(meta.get("skipped_steps", 0)), str(meta["weights_fingerprint"]),
                dict(meta["config"]), dict(meta["rng"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{state_path}: missing or malformed field ({e!r})") from e
        model = _read_safetensors(d / MODEL_FILE)
        if weights_fingerprint(model) != fp:
            raise ValueError(f"{d / MODEL_FILE}: weights do not match the fingerprint recorded in "
                             f"{STATE_FILE} (corrupt file or files from different checkpoints)")
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in _read_safetensors(d / OPTIMIZER_FILE).items():
            name, _, entry = key.rpartition(".")
            optim.setdefault(name, {})[entry] = t
        rng = RngState(tensors=_read_safetensors(d / RNG_FILE), meta=rng_meta)
        self._load_state(
            {"model": model, "optimizer": optim, "scheduler_step": scheduler_step, "skipped_steps": skipped,
             "rng": rng, "config": config},
            sources={"model": str(d / MODEL_FILE), "optimizer": str(d / OPTIMIZER_FILE),
                     "rng": f"{d / RNG_FILE} + {STATE_FILE}", "config": str(state_path)})


def _aggregate(rows: list[dict[str, float]]) -> dict[str, float]:
    """Whole-call metrics. Loss functions normalise by batch-wide counts (LossContext), so
    micro-batch values add up; "*_max"/"*_min" keys combine by max/min."""
    return {**reduce_microbatch_metrics(rows), "num_micro_batches": float(len(rows))}


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, path)


_CHECKPOINT_FILES = f"{MODEL_FILE}, {OPTIMIZER_FILE}, {RNG_FILE} and {STATE_FILE}"


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a TorchBackend checkpoint needs {_CHECKPOINT_FILES}")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a TorchBackend checkpoint needs {_CHECKPOINT_FILES}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data
