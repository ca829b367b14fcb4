"""One rank of the Megatron backend: its shard of the `GPTModel`, its optimizer, and the
forward / backward / step of a packed batch. Runs in the driver process at world size 1 and in
each worker process otherwise (`parallel.py`); every rank gets the whole batch and computes the
whole batch's logprobs (logits are gathered over TP), so any rank's answer is the answer.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from axrl.model import ModelConfig
from axrl.train.megatron import cpu_compat
from axrl.train.megatron.convert import EXPERT_NAME, split_rule, shard
from axrl.train.determinism import set_determinism
from axrl.train.megatron.model import ParallelSizes, build_gpt_model
from axrl.train.micro_batch import micro_batches, next_token_logprobs, pad_micro_batch, unpad
from axrl.train.protocol import LossContext, LossFn, PackedBatch
from axrl.train.torch_backend import clip_grads_

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class StepKnobs:
    """The backend-config values a rank needs per call (read from the driver's live `config`,
    so replay what-ifs and faults that replace `backend.config` reach the workers)."""

    dtype: str = "float32"
    micro_batch_tokens: int = 0
    micro_batch_size: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(rank: int, world_size: int, port: int, sizes: ParallelSizes, seed: int) -> None:
    """gloo process group over localhost + Megatron's parallel state (idempotent at world size 1)."""
    import torch.distributed as dist

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    elif dist.get_world_size() != world_size:
        raise RuntimeError(f"this process already has a torch.distributed default group of size "
                           f"{dist.get_world_size()}; the Megatron backend needs one of size {world_size} "
                           "(build it before initialising other default process groups)")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=sizes.tensor_parallel,
                                     expert_model_parallel_size=sizes.expert_parallel,
                                     expert_tensor_parallel_size=sizes.expert_tensor_parallel)
        # Megatron's RNG tracker must exist (forked even at dropout 0); it never draws numbers here.
        model_parallel_cuda_manual_seed(seed)
    elif ps.get_tensor_model_parallel_world_size() != sizes.tensor_parallel:
        raise RuntimeError("this process already holds a Megatron parallel state of another size; "
                           "tensor/expert parallel runs use worker processes")


class MegatronRank:
    """This process's shard of the model and optimizer slots (one AdamW per slot: the RL run's
    and, e.g., a supervised warm-up's, sharing the same weights)."""

    def __init__(self, model_cfg: ModelConfig, sizes: ParallelSizes, dispatcher: str, full_weights: dict[str, torch.Tensor]) -> None:
        from megatron.core import parallel_state as ps

        self.cfg, self.sizes = model_cfg, sizes
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model = build_gpt_model(model_cfg, sizes, dispatcher=dispatcher)
        self.model.to(self.device)
        self.ranks = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=sizes.tensor_parallel,
                          ep_rank=ps.get_expert_model_parallel_rank() if model_cfg.is_moe else 0,
                          ep_size=sizes.expert_parallel,
                          etp_rank=ps.get_expert_tensor_parallel_rank() if model_cfg.is_moe else 0,
                          etp_size=sizes.expert_tensor_parallel)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.edp_group = ps.get_expert_data_parallel_group() if model_cfg.is_moe else None
        self.edp_rank = ps.get_expert_data_parallel_rank() if model_cfg.is_moe else 0
        self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.load_weights(full_weights)
        # Routers in layer order: the per-model RouterReplay instances (Megatron's static list is
        # process-global and would mix several models in one process).
        self.routers = [m.router_replay for m in self.model.modules()
                        if getattr(m, "router_replay", None) is not None and hasattr(m, "routing")]
        self.moe_layers = [i for i in range(model_cfg.num_hidden_layers) if model_cfg.is_moe_layer(i)]
        self.optimizers: dict[str, torch.optim.Optimizer] = {}

    def release(self) -> None:
        """Drop this model's routers from Megatron's process-global RouterReplay list."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(r) for r in self.routers}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]

    # ------------------------------------------------------------------ weights
    def load_weights(self, full: dict[str, torch.Tensor]) -> None:
        local = shard(full, num_experts=self.cfg.num_experts, **self.ranks)
        with torch.no_grad():
            for name, p in self.params:
                if name not in local:
                    raise ValueError(f"Megatron weights lack '{name}'")
                if tuple(local[name].shape) != tuple(p.shape):
                    raise ValueError(f"'{name}': shard shape {tuple(local[name].shape)}, the model expects {tuple(p.shape)}")
                p.copy_(local[name].to(p.device, p.dtype))

    def local_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        return {n: p.detach().cpu().clone() for n, p in self.params}, self.ranks

    # ------------------------------------------------------------------ forward
    def _run(self, mb: PackedBatch, r3: bool, dtype: str,
             routing_out: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Packed (logprobs, entropy, routing [T, L, k] or None) of one micro-batch; the routing
        is the replayed one under R3 (as in the embedded backend), else what the routers chose."""
        pm = pad_micro_batch(mb, with_routing=r3)
        ids, b, S = pm.input_ids, pm.input_ids.shape[0], pm.input_ids.shape[1]
        tp = self.sizes.tensor_parallel if self.sizes.sequence_parallel else 1
        S_pad = -(-S // tp) * tp  # sequence parallel splits the sequence evenly over TP ranks
        if S_pad != S:
            ids = torch.nn.functional.pad(ids, (0, S_pad - S))
        position_ids = torch.arange(S_pad).expand(b, S_pad)
        # Megatron's mask marks what may NOT be attended; its default mask is built on "cuda".
        mask = ~torch.ones(S_pad, S_pad, dtype=torch.bool).tril()[None, None]
        moe = bool(self.routers)
        if moe:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction
            if r3:
                forced = torch.nn.functional.pad(pm.forced_experts, (0, 0, 0, 0, 0, S_pad - S))  # [b, S_pad, L, k]
                n_local = S_pad * b // tp
                lo = self.ranks["tp_rank"] * n_local if tp > 1 else 0
                for router, layer in zip(self.routers, self.moe_layers):
                    rows = forced[:, :, layer].transpose(0, 1).reshape(S_pad * b, -1)  # sequence-major
                    router.clear_indices()
                    router.set_target_indices(rows[lo:lo + n_local].to(self.device))
                    router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                for router in self.routers:
                    router.clear_indices()
                    router.set_router_replay_action(RouterReplayAction.RECORD)
        dev = self.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = self.model(ids.to(dev), position_ids.to(dev), mask.to(dev))
        logits = logits[:, :S]
        logprobs, entropy = next_token_logprobs(logits, pm.input_ids.to(dev), mb.temperature)
        routing = None
        if moe:
            if routing_out:  # the gather is a TP collective per layer: skipped when training
                routing = pm.forced_experts.to(dev) if r3 else self._gather_routing(b, S_pad)[:, :S]
                routing = unpad(routing, pm.rows.to(dev), pm.cols.to(dev))
            for router in self.routers:
                router.clear_indices()  # REPLAY_FORWARD also queues indices for a recompute
        return unpad(logprobs, pm.rows.to(dev), pm.cols.to(dev)), unpad(entropy, pm.rows.to(dev), pm.cols.to(dev)), routing

    def _gather_routing(self, b: int, S_pad: int) -> torch.Tensor:
        """[b, S_pad, L, k] from the routers' recorded sequence-major [S*b/TP, k] shards."""
        import torch.distributed as dist

        k, L = self.cfg.num_experts_per_tok, self.cfg.num_hidden_layers
        out = torch.zeros(b, S_pad, L, k, dtype=torch.int64, device=self.device)
        tp = self.sizes.tensor_parallel if self.sizes.sequence_parallel else 1
        for router, layer in zip(self.routers, self.moe_layers):
            rows = router.get_recorded_indices().long()
            if tp > 1:
                parts = [torch.empty_like(rows) for _ in range(tp)]
                dist.all_gather(parts, rows.contiguous(), group=self.tp_group)
                rows = torch.cat(parts)
            out[:, :, layer] = rows.view(S_pad, b, k).transpose(0, 1)
        return out

    def forward(self, batch: PackedBatch, r3: bool, knobs: StepKnobs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self.model.eval()
        with torch.no_grad():
            parts = [self._run(mb, r3, knobs.dtype) for mb in micro_batches(batch, knobs.micro_batch_tokens, knobs.micro_batch_size)]
        cat = lambda i: None if parts[0][i] is None else torch.cat([p[i] for p in parts]).cpu()  # noqa: E731
        return cat(0), cat(1), cat(2)

    def forward_backward(self, batch: PackedBatch, loss_fn: LossFn, r3: bool, knobs: StepKnobs) -> list[dict[str, float]]:
        self.model.train()
        per_sample = torch.zeros(batch.num_samples).index_add_(0, batch.sample_index(), batch.loss_mask.float())
        ctx = LossContext(num_loss_tokens=int(batch.loss_mask.sum()), num_samples=batch.num_samples,
                          num_loss_samples=int((per_sample > 0).sum()))
        rows: list[dict[str, float]] = []
        for mb in micro_batches(batch, knobs.micro_batch_tokens, knobs.micro_batch_size):
            logprobs, entropy, _ = self._run(mb, r3, knobs.dtype, routing_out=False)
            loss, metrics = loss_fn(logprobs, entropy, _to(mb, self.device), ctx)
            if loss.requires_grad:
                loss.backward()
            rows.append({"loss": float(loss.detach()), **{k: float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
                                                          for k, v in metrics.items()},
                         "num_tokens": float(mb.num_tokens), "num_loss_tokens": float(mb.loss_mask.sum())})
        return rows

    # ------------------------------------------------------------------ optimizer
    def _optimizer(self, slot: str, betas: tuple[float, float], eps: float, weight_decay: float) -> torch.optim.Optimizer:
        if slot not in self.optimizers:
            decay = [p for _, p in self.params if p.ndim >= 2]
            no_decay = [p for _, p in self.params if p.ndim < 2]
            self.optimizers[slot] = torch.optim.AdamW(
                [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=0.0, betas=betas, eps=eps, foreach=False, fused=False)
        return self.optimizers[slot]

    def _partial_group(self, name: str) -> Any:
        """The group over which `name`'s gradient is split (None: complete on this rank).

        TP-replicated dense params (norms, router: the rank's sequence shard under SP; q/k norms:
        the rank's heads) are partial over TP; experts replicated over expert-data-parallel ranks
        saw only their rank's tokens."""
        if EXPERT_NAME.match(name):
            return self.edp_group if self.sizes.expert_data_parallel > 1 else None
        if self.sizes.tensor_parallel > 1 and split_rule(name)[0] is None:
            return self.tp_group
        return None

    def _owned(self, name: str) -> bool:
        """Whether this rank counts `name` in the global grad norm (each element exactly once)."""
        if EXPERT_NAME.match(name):
            return self.edp_rank == 0
        return split_rule(name)[0] is not None or self.ranks["tp_rank"] == 0

    def optimizer_step(self, slot: str, lr: float, grad_clip: float, betas: tuple[float, float], eps: float,
                       weight_decay: float) -> float:
        """All-reduce partial grads, global grad norm, clip, AdamW step (skipped if non-finite)."""
        import torch.distributed as dist

        opt = self._optimizer(slot, betas, eps, weight_decay)
        for name, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # like Megatron's grad buffer: every param steps
            group = self._partial_group(name)
            if group is not None:
                dist.all_reduce(p.grad, group=group)
        sq = torch.zeros((), dtype=torch.float64)
        for name, p in self.params:
            if self._owned(name):
                sq += p.grad.detach().float().norm(2).cpu().double() ** 2
        if self.sizes.world_size > 1:
            sq = sq.to(self.device)  # NCCL reduces device tensors only
            dist.all_reduce(sq)
            sq = sq.cpu()
        norm = torch.sqrt(sq).float()
        if torch.isfinite(norm):
            if grad_clip > 0:
                clip_grads_([p.grad for _, p in self.params], grad_clip, norm)
            for group, decay in zip(opt.param_groups, (weight_decay, 0.0)):
                # read live: a replay what-if may change them between steps
                group.update(lr=lr, betas=tuple(betas), eps=eps, weight_decay=decay)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    def zero_grad(self) -> None:
        for _, p in self.params:
            p.grad = None

    def optimizer_state(self, slot: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
        """This rank's AdamW moments per local param name (empty before the first step)."""
        opt = self.optimizers.get(slot)
        if opt is None:
            return {}, self.ranks
        return {n: {k: v.detach().cpu().clone() for k, v in opt.state[p].items()}
                for n, p in self.params if p in opt.state}, self.ranks

    def load_optimizer_state(self, slot: str, full: dict[str, dict[str, torch.Tensor]], step: float,
                             betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """Set moments from full Megatron-layout tensors ({} = fresh optimizer)."""
        opt = self._optimizer(slot, betas, eps, weight_decay)
        opt.state.clear()
        if full:
            local = {k: shard({n: s[k] for n, s in full.items()}, num_experts=self.cfg.num_experts, **self.ranks)
                     for k in _ADAM_KEYS}
            for name, p in self.params:
                opt.state[p] = {"step": torch.tensor(float(step)),
                                **{k: local[k][name].to(p.device, p.dtype).clone() for k in _ADAM_KEYS}}
        opt.zero_grad(set_to_none=True)

    def drop_slot(self, slot: str) -> None:
        self.optimizers.pop(slot, None)


def _to(mb: PackedBatch, device: torch.device) -> PackedBatch:
    if device.type == "cpu":
        return mb
    from dataclasses import fields, replace
    return replace(mb, **{f.name: getattr(mb, f.name).to(device) for f in fields(mb)
                          if isinstance(getattr(mb, f.name), torch.Tensor)})


def worker_setup(seed: int, num_threads: int) -> None:
    """Deterministic mode in a worker process, as the driver has it: seeds, one intra-op thread
    count for every rank (gradients differ bitwise between counts), deterministic kernels."""
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    set_determinism(seed, num_threads, deterministic=True)
    relax_on_cuda()


def relax_on_cuda() -> None:
    """On CUDA, Megatron's token (un)permutation uses scatter-add, which has no deterministic
    CUDA kernel: warn instead of failing there (GPU runs are not bitwise-replayable anyway
    without a deterministic attention/GEMM set-up). No effect on CPU."""
    if torch.cuda.is_available() and torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(True, warn_only=True)


__all__ = ["MegatronRank", "StepKnobs", "free_port", "init_distributed", "relax_on_cuda", "worker_setup"]
