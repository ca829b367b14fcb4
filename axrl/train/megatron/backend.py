"""`MegatronBackend`: the `TrainBackend` protocol over megatron-core's `GPTModel`.

The driver (this object) holds the public API, the learning-rate schedule, RNG state and
checkpoints; the ranks (`rank.py`) hold the model shards and optimizer state — in this process
at world size 1, in spawned worker processes for tensor / expert / data parallelism (`parallel.py`).
Weights and optimizer moments leave the ranks in the Hugging Face layout (`convert.py`), so
weight sync, `export_hf`, the trace fingerprint and checkpoints are the embedded backend's:
a checkpoint written by one backend (or one parallel layout) loads into the other.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from axrl.model import ModelConfig, Qwen3ForCausalLM, hf_state_dict, load_weights_into, save_hf
from axrl.train.checkpoint_files import check_optimizer_state, read_checkpoint, warn_config_diff, write_checkpoint
from axrl.train.determinism import capture_rng_state, restore_rng_state, set_determinism
from axrl.train.fingerprint import weights_fingerprint
from axrl.train.metrics import TOKEN_COLUMN_PREFIX, join_token_columns, reduce_microbatch_metrics
from axrl.train.optim import lr_at
from axrl.train.protocol import R3, AdamHyper, ForwardResult, Inspection, LossFn, PackedBatch, R3Scope, StepStats, TrainMetrics
from axrl.train.megatron.probe_hooks import MEGATRON_HOW
from axrl.train.megatron.rank import MegatronRank
from axrl.train.megatron.rank_state import gather_moments, gather_weights, load_moments
from axrl.train.megatron.shares import by_micro_batch, split_for_ranks
from axrl.train.r3 import use_r3
from axrl.train.megatron.settings import MegatronLayout
from axrl.train.settings import BackendConfig

if TYPE_CHECKING:
    from axrl.train.critic import CriticConfig
    from axrl.train.megatron.critic import MegatronCritic
    from axrl.train.megatron.parallel import RankGroup

INSTALL_HINT = "train.backend=megatron needs megatron-core: pip install 'axrl[megatron]'"
_SLOT = "main"  # the ranks' optimizer slot (reset_optimizer drops it for a fresh AdamW)


def require_megatron() -> None:
    """Raise ImportError with the install command when megatron-core is missing."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None


class MegatronBackendConfig(BackendConfig, MegatronLayout):
    """`BackendConfig` (optimizer, schedule, micro-batching, determinism) + the parallel layout
    (`MegatronLayout`, the YAML's `train.megatron`).

    World size = tensor_parallel × data_parallel (Megatron's layout, one machine); expert_parallel
    divides it. data_parallel 0 (default) derives the smallest that fits: EP / gcd(TP, EP), i.e.
    1 when EP divides TP (experts fold into the TP ranks), 2 for TP 1 / EP 2. Sequence parallelism
    is required with TP > 1 (MoE + TP training needs it in Megatron).
    """


def check_parallel_fit(cfg: ModelConfig, c: MegatronBackendConfig) -> None:
    """The model's head / expert counts must split evenly over the parallel sizes."""
    tp, ep, world = c.tensor_parallel, c.expert_parallel, c.world_size
    if cfg.num_key_value_heads % tp:
        raise ValueError(f"train.megatron.tensor_parallel={tp} must divide the model's num_key_value_heads "
                         f"({cfg.num_key_value_heads})")
    if cfg.vocab_size % tp:
        raise ValueError(f"train.megatron.tensor_parallel={tp} must divide vocab_size ({cfg.vocab_size})")
    if torch.cuda.is_available() and world > torch.cuda.device_count():
        raise ValueError(f"train.megatron: world size {world} (tensor_parallel × data_parallel) needs {world} GPUs "
                         f"(one rank per GPU, NCCL); this machine has {torch.cuda.device_count()}")
    if ep > 1 and (not cfg.is_moe or cfg.num_experts % ep):
        raise ValueError(f"train.megatron.expert_parallel={ep} must divide the model's num_experts ({cfg.num_experts})")


class MegatronBackend:
    """`TrainBackend` over megatron-core; built from an HF-layout `Qwen3ForCausalLM` (its initial weights).

    Same semantics as `TorchBackend` — micro-batch order, loss normalisation, AdamW with decay on
    matrices, clipping, skipped non-finite updates, LR schedule, checkpoint files — so the loop,
    trace, mismatch analysis and replay use either unchanged. Call `close()` (or let the process
    exit) to stop worker processes.
    """

    probe_how = MEGATRON_HOW  # how `probe_forward` obtains each probe point (bisect prints it)
    probe_observes_only = True  # `probe_forward`'s probes may not patch activations (explain does)

    def __init__(self, model: Qwen3ForCausalLM, config: MegatronBackendConfig | None = None, tokenizer: Any = None,
                 group: Callable[..., RankGroup] | None = None) -> None:
        """`group(model_config, sizes, dispatcher, weights, seed, num_threads)` builds the ranks
        (default: in this process at world size 1, else worker processes; Ray actors under
        `runtime.executor: ray`)."""
        require_megatron()
        self.config = config = config or MegatronBackendConfig()
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        check_parallel_fit(model.config, config)
        if config.deterministic:
            set_determinism(config.seed, config.num_threads, deterministic=True)
            from axrl.train.megatron.rank import relax_on_cuda
            relax_on_cuda()
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        from axrl.train.megatron.convert import to_megatron
        from axrl.train.megatron.model import ParallelSizes
        from axrl.train.megatron.parallel import InProcessGroup, WorkerGroup

        sizes = ParallelSizes(config.tensor_parallel, config.expert_parallel,
                              config.sequence_parallel and config.tensor_parallel > 1, config.data_parallel_size)
        # fp32 weights on the ranks whatever the model dtype (bf16 runs autocast, see module doc)
        weights = {k: v.detach().to("cpu", torch.float32)
                   for k, v in to_megatron(hf_state_dict(model), model.config).items()}
        group_cls = group or (InProcessGroup if sizes.world_size == 1 else WorkerGroup)
        self._group: RankGroup = group_cls(model.config, sizes, config.moe_dispatcher, weights, config.seed,
                                config.num_threads or torch.get_num_threads())
        self._data_parallel = sizes.data_parallel
        self._dp_of = self._group.call(MegatronRank.data_parallel_rank)  # global rank → its DP rank
        self._dtype = next(model.parameters()).dtype
        self._hf_names = [n for n, p in model.named_parameters() if p.requires_grad]  # StepStats order
        self.scheduler_step = 0
        self.skipped_steps = 0
        self._has_grads = False
        self._weights: dict[str, torch.Tensor] | None = None  # HF-layout gather, until the weights change
        self._kept: set[str] = set()
        self.critic: MegatronCritic | None = None  # PPO's value model on the same ranks (`attach_critic`)

    def attach_critic(self, config: CriticConfig, body: dict[str, torch.Tensor] | None = None, *,
                      source: str = "critic.model") -> MegatronCritic:
        """PPO's value model on the ranks, beside the policy (same parallel layout), its decoder from
        `body` (Hugging Face names: `critic.model`'s weights, which must have the policy's
        architecture) or, when None, the policy's current weights — then `from_policy`, and the loop
        copies the policy in again at RL start (`MegatronCritic.copy_policy`)."""
        from axrl.train.megatron.critic import MegatronCritic

        self.critic = MegatronCritic(self._group, self._dp_of, self._data_parallel, self.model_config, self._dtype,
                                     config, self._hf_weights() if body is None else body,
                                     from_policy=body is None, source="the policy's weights" if body is None else source)
        return self.critic

    # ------------------------------------------------------------------ forward / backward
    def _knobs(self) -> Any:
        from axrl.train.megatron.shares import StepKnobs

        c = self.config
        return StepKnobs(dtype=c.dtype, micro_batch_tokens=c.micro_batch_tokens, micro_batch_size=c.micro_batch_size,
                         prefix_merge=c.prefix_merge)

    def _call_with_shares(self, fn: Callable[..., Any], batch: PackedBatch, *args: Any) -> list[Any]:
        """The rank method `fn(rank, work, *args)` on every rank, each sent only its DP rank's `RankWork`."""
        works = split_for_ranks(batch.to("cpu"), self._data_parallel, self._knobs())
        return self._group.call_each(fn, [works[d] for d in self._dp_of], *args)

    def _use_r3(self, batch: PackedBatch, r3: R3) -> R3Scope | None:
        return use_r3(self.model_config, batch, r3)

    def forward(self, batch: PackedBatch, *, r3: R3 = False, weights: str | None = None) -> ForwardResult:
        """No-grad logprobs/entropy [T] (fp32) and the routing [T, L, k] this forward used; under
        the weights kept as `weights` when given (the ranks swap them in and back)."""
        if weights is not None and weights not in self._kept:
            raise KeyError(f"no weights kept under {weights!r} (kept: {sorted(self._kept)})")
        if weights is not None:
            self._group.call(MegatronRank.swap_weights, weights)
        try:
            answers = self._call_with_shares(MegatronRank.forward, batch, self._use_r3(batch, r3))
        finally:
            if weights is not None:
                self._group.call(MegatronRank.swap_weights, weights)
        per_mb = by_micro_batch(answers)
        # micro-batches in order, each one's DP shares in order: the batch's sample order
        cat = lambda i: None if per_mb[0][0][i] is None else torch.cat(  # noqa: E731
            [share[i] for shares in per_mb for share in shares])
        logprobs, entropy, routing = cat(0), cat(1), cat(2)
        dev = batch.input_ids.device
        return ForwardResult(logprobs=logprobs.to(dev), entropy=entropy.to(dev),
                             routed_experts=None if routing is None else routing.to(dev))

    def forward_backward(self, batch: PackedBatch, loss_fn: LossFn, *, r3: R3 = False) -> TrainMetrics:
        """Accumulate grads of `loss_fn` micro-batch by micro-batch (fixed order, see micro_batch.py)."""
        per_mb = by_micro_batch(self._call_with_shares(MegatronRank.forward_backward, batch, loss_fn, self._use_r3(batch, r3)))
        # shares in dp order = sample order: their per-token columns concatenate into the batch's
        shares = [[_split_columns(r) for r in mb if r is not None] for mb in per_mb]
        # one row per micro-batch, as the embedded backend reports; DP shares combine like micro-batches
        rows = [parts[0][0] if len(parts) == 1 else reduce_microbatch_metrics([p[0] for p in parts]) for parts in shares]
        self._has_grads = True
        return TrainMetrics(loss=sum(r["loss"] for r in rows), micro_batches=rows,
                            metrics={**reduce_microbatch_metrics(rows), "num_micro_batches": float(len(rows))},
                            tokens=join_token_columns([p[1] for parts in shares for p in parts]))

    def optimizer_step(self, *, lr: float | None = None, lr_scale: float = 1.0,
                       adam: AdamHyper | None = None) -> StepStats:
        """Grad norm (before clipping), clip, AdamW step, schedule step, zero grads; a non-finite
        norm skips the update and the schedule step. The rate is `lr` when given, else the
        schedule's times `lr_scale`; `adam` (else the config's) gives betas, eps, decay and clip."""
        if not self._has_grads:
            raise RuntimeError("optimizer_step() called without a forward_backward() since the last step")
        c = self.config
        lr = lr_at(c, self.scheduler_step) * lr_scale if lr is None else lr
        adam = adam or AdamHyper(c.betas, c.eps, c.weight_decay, c.grad_clip)
        answers = self._group.call(MegatronRank.optimizer_step, _SLOT, lr, adam.grad_clip, adam.betas, adam.eps,
                                   adam.weight_decay)
        norm = answers[0][0]
        if torch.isfinite(torch.tensor(norm)):
            self.scheduler_step += 1
            self._weights = None
        else:
            self.skipped_steps += 1
        self._has_grads = False
        sq: dict[str, float] = {}
        for _, pieces in answers:
            for name, v in pieces.items():
                sq[name] = sq.get(name, 0.0) + v
        return StepStats(grad_norm=norm, lr=lr,
                         param_grad_norm={n: math.sqrt(sq[n]) for n in self._hf_names if n in sq})

    def reset_optimizer(self) -> None:
        self._group.call(MegatronRank.drop_slot, _SLOT)  # the next step builds a fresh AdamW
        self._group.call(MegatronRank.zero_grad)
        self.scheduler_step = self.skipped_steps = 0
        self._has_grads = False

    def keep_weights(self, key: str) -> None:
        self._group.call(MegatronRank.keep_weights, key)
        self._kept.add(key)

    def forget_weights(self, key: str) -> None:
        self._group.call(MegatronRank.forget_weights, key)
        self._kept.discard(key)

    def inspect(self, batch: PackedBatch, loss_fn: LossFn, *, r3: R3 = False) -> Inspection | None:
        """None: the ranks' GPTModel is not hooked (replay dumps leave those groups out)."""
        return None

    def probe_forward(self, batch: PackedBatch, probe: Any, *, r3: R3 = False) -> ForwardResult | None:
        """`forward` (current weights, the same micro-batches, unmerged: the points sit on the padded
        layout) with `probe` at the probe points, by forward hooks on the GPTModel's modules
        (`probe_hooks.py`). None when the ranks are worker processes (world size > 1): the hooks
        cannot reach them."""
        rank = getattr(self._group, "rank", None)
        if rank is None:
            return None
        from axrl.train.megatron.probe_hooks import probe_shares
        from axrl.train.megatron.shares import StepKnobs

        k = self._knobs()
        knobs = StepKnobs(dtype=k.dtype, micro_batch_tokens=k.micro_batch_tokens, micro_batch_size=k.micro_batch_size)
        work = split_for_ranks(batch.to("cpu"), 1, knobs)[0]
        parts = probe_shares(rank, work, self._use_r3(batch, r3), probe)
        cat = lambda i: None if parts[0][i] is None else torch.cat([p[i] for p in parts])  # noqa: E731
        dev = batch.input_ids.device
        routing = cat(2)
        return ForwardResult(logprobs=cat(0).to(dev), entropy=cat(1).to(dev),
                             routed_experts=None if routing is None else routing.to(dev))

    # ------------------------------------------------------------------ weights
    def _hf_weights(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            from axrl.train.megatron.convert import to_hf

            full = gather_weights(self._group.call, self.model_config.num_experts)
            self._weights = {k: v.to(self._dtype) for k, v in to_hf(full, self.model_config).items()}
        return self._weights

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights under HF names (tied lm_head omitted), gathered from the ranks."""
        return iter(self._hf_weights().items())

    def sync_source(self) -> dict[str, torch.Tensor]:
        """The HF-named weights (views; `WeightSync.post` takes the copy)."""
        return dict(self.named_weights())

    def fingerprint(self) -> str:
        return weights_fingerprint(self.named_weights())

    def hf_model(self) -> Qwen3ForCausalLM:
        """A new embedded (HF-layout) model holding the current weights."""
        model = Qwen3ForCausalLM(self.model_config).to(self._dtype)
        load_weights_into(model, self._hf_weights(), source="Megatron backend weights")
        return model

    def export_hf(self, directory: str | Path) -> Path:
        return save_hf(self.hf_model(), directory, self.tokenizer)

    def close(self) -> None:
        """Stop the worker processes (no-op at world size 1)."""
        self._group.close()

    # ------------------------------------------------------------------ state
    def _optimizer_hf(self) -> dict[str, dict[str, torch.Tensor]]:
        from axrl.train.megatron.convert import to_hf

        return gather_moments(self._group.call, _SLOT, lambda full: to_hf(full, self.model_config),
                              self.model_config.num_experts)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bitwise, in the embedded backend's layout (HF names)."""
        return {"model": {k: v.clone() for k, v in self._hf_weights().items()}, "optimizer": self._optimizer_hf(),
                "scheduler_step": self.scheduler_step, "skipped_steps": self.skipped_steps,
                "rng": capture_rng_state(), "config": self.config.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_state(state, sources={})

    def _load_state(self, state: dict[str, Any], sources: dict[str, str]) -> None:
        from axrl.train.megatron.convert import to_megatron

        src = lambda key: sources.get(key, f"state dict['{key}']")  # noqa: E731
        weights = self._hf_weights()
        optim = state["optimizer"]
        check_optimizer_state(weights, optim, src("optimizer"))
        if state.get("config") is not None:
            warn_config_diff(self.config, state["config"], src("config"))
        try:
            restore_rng_state(state["rng"])
        except ValueError as e:
            raise ValueError(f"{src('rng')}: {e}") from e
        model_sd = state["model"]
        bad = sorted(set(weights) ^ (set(model_sd) - ({"lm_head.weight"} if self.model_config.tie_word_embeddings else set())))
        if bad:
            raise ValueError(f"{src('model')}: weight names do not match the model config ({bad[:5]})")
        for name, t in model_sd.items():
            if name in weights and tuple(t.shape) != tuple(weights[name].shape):
                raise ValueError(f"{src('model')}: '{name}' has shape {tuple(t.shape)}, the model expects {tuple(weights[name].shape)}")
        cfg = self.model_config
        self._group.call(MegatronRank.load_weights, {k: v.float() for k, v in to_megatron(model_sd, cfg).items()})
        c = self.config
        load_moments(self._group.call, _SLOT, optim, lambda hf: to_megatron(hf, cfg), c.betas, c.eps, c.weight_decay)
        self.scheduler_step = int(state["scheduler_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._has_grads = False
        self._weights = None

    # The checkpoint files (safetensors + JSON, never pickle) are the embedded backend's
    # (`checkpoint_files`): same state layout, same validation.
    def save(self, directory: str | Path) -> None:
        """Write model/optimizer/rng safetensors and trainer_state.json (`checkpoint_files`); with a
        critic, its files in `critic/` too."""
        write_checkpoint(directory, self.state_dict())
        if self.critic is not None:
            self.critic.save(directory)

    def load(self, directory: str | Path) -> None:
        """Restore a `save`d checkpoint; every file is validated before any state is changed. With a
        critic, its state too (`critic/`, read first: a checkpoint without it fails before the
        policy changes)."""
        if self.critic is not None:
            self.critic.load(directory)
        self._load_state(*read_checkpoint(directory))


def _split_columns(row: dict[str, Any]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """A rank's metrics row → (its scalars, its per-token columns without the prefix)."""
    n = len(TOKEN_COLUMN_PREFIX)
    return ({k: v for k, v in row.items() if not k.startswith(TOKEN_COLUMN_PREFIX)},
            {k[n:]: v for k, v in row.items() if k.startswith(TOKEN_COLUMN_PREFIX)})


warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message="Apex is not installed.*")
