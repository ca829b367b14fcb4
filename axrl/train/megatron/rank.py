"""One rank of the Megatron backend: its shard of the `GPTModel`, its optimizer, and the
forward / backward / step of its part of a packed batch. Runs in the driver process at world
size 1, otherwise in each worker process (`parallel.py`) or Ray rank actor
(`axrl/ray_executor/megatron_ranks.py`).

A rank is sent only its own rows: the backend cuts the batch into micro-batches and each
micro-batch into DP shares (`shares.py`), and a DP rank gets its `RankWork` — its share of every
micro-batch, padded here to the [rows, S] shape all DP ranks run (the MoE dispatchers' collectives
and gloo's all-gather need equal token counts; a rank whose share is empty runs padding only). The
TP ranks of one DP rank run the same share and gather its logits over TP. Results leave the ranks
with tp_rank 0, tagged with their dp_rank, and the backend puts them back in sample order.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import torch

from axrl.train.value_loss import value_loss
from axrl.model import ModelConfig
from axrl.train.megatron import cpu_compat
from axrl.train.megatron.convert import EXPERT_NAME, global_expert_name, hf_slices, split_rule, shard
from axrl.train.determinism import set_determinism
from axrl.train.megatron.model import ParallelSizes, build_gpt_model, rope_positions
from axrl.train.megatron.partial_replay import replay_rows, stop_partial
from axrl.train.megatron.shares import RankWork, Share
from axrl.train.megatron.value_head import attach_value_head, shifted_values
from axrl.train.micro_batch import (PaddedMicroBatch, label_logprobs, next_token_logprobs, pad_micro_batch,
                                    restrict_routing_, unpad)
from axrl.train.prefix_tree import PrefixTree
from axrl.train.metrics import TOKEN_COLUMN_PREFIX, split_token_columns
from axrl.train.optim import adamw, clip_grads_, set_adam_hyper
from axrl.train.protocol import LossFn, R3Scope

if TYPE_CHECKING:
    from axrl.train.megatron.rank_calls import RankCall

_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(rank: int, world_size: int, port: int, sizes: ParallelSizes, seed: int,
                     host: str = "127.0.0.1") -> None:
    """gloo process group at rank 0's `host:port` (localhost for the backend's own worker processes;
    rank 0's node for Ray rank actors) + Megatron's parallel state (idempotent at world size 1)."""
    import torch.distributed as dist

    cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size)
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
    """This process's shard of the model, its optimizer slots (AdamW per slot) and the weight
    copies kept for forwards under other weights (behaviour / reference policies)."""

    def __init__(self, model_cfg: ModelConfig, sizes: ParallelSizes, dispatcher: str, full_weights: dict[str, torch.Tensor],
                 *, value_head: bool = False) -> None:
        """`value_head`: PPO's value model (`value_head.py`): the decoder with a scalar head instead
        of the LM head, whose routers route freely (routing replay is the policy's)."""
        from megatron.core import parallel_state as ps

        self.cfg, self.sizes, self.dispatcher = model_cfg, sizes, dispatcher
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model = build_gpt_model(model_cfg, sizes, dispatcher=dispatcher, routing_replay=not value_head)
        if value_head:
            attach_value_head(self.model, model_cfg.hidden_size, sizes.sequence_parallel)
        self.model.to(self.device)
        self.ranks = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=sizes.tensor_parallel,
                          ep_rank=ps.get_expert_model_parallel_rank() if model_cfg.is_moe else 0,
                          ep_size=sizes.expert_parallel,
                          etp_rank=ps.get_expert_tensor_parallel_rank() if model_cfg.is_moe else 0,
                          etp_size=sizes.expert_tensor_parallel)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.tp_dp_group = ps.get_tensor_and_data_parallel_group()
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
        self.kept: dict[str, list[torch.Tensor]] = {}
        self.critic: MegatronRank | None = None  # PPO's value model on this rank (`attach_critic`)

    def release(self) -> None:
        """Drop this model's routers from Megatron's process-global RouterReplay list."""
        if self.critic is not None:
            self.critic.release()
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

    def keep_weights(self, key: str) -> None:
        self.kept[key] = [p.detach().clone() for _, p in self.params]

    def forget_weights(self, key: str) -> None:
        self.kept.pop(key, None)

    def swap_weights(self, key: str) -> None:
        """Exchange the live weights with the copy kept under `key` (twice = back where it was);
        exact, since nothing is converted."""
        kept = self.kept[key]
        for i, (_, p) in enumerate(self.params):
            p.data, kept[i] = kept[i], p.data

    def data_parallel_rank(self) -> int:
        """Which DP rank this rank is (its `RankWork` is that DP rank's)."""
        return self.dp_rank

    def _reports(self, name: str) -> bool:
        """Whether this rank sends `name` to the driver: one copy of each shard (DP / expert-DP
        replicas hold the same bits)."""
        return self.edp_rank == 0 if EXPERT_NAME.match(name) else self.dp_rank == 0

    def local_weights(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        return {n: p.detach().cpu().clone() for n, p in self.params if self._reports(n)}, self.ranks

    # ------------------------------------------------------------------ forward
    def _share(self, share: Share, r3: R3Scope | None) -> PaddedMicroBatch:
        """This DP rank's share of a micro-batch, right-padded ([b, S], S of the share)."""
        if share.batch is not None:
            return pad_micro_batch(share.batch, with_routing=r3 is not None, scope=r3)
        # An empty share (fewer samples than DP ranks) still runs a padding row: the MoE
        # dispatch and the backward are collectives that every rank must join.
        empty = torch.zeros(0, 1, dtype=torch.int64)
        L, k = self.cfg.num_hidden_layers, self.cfg.num_experts_per_tok
        forced = torch.zeros(0, 1, L, k, dtype=torch.int64) if r3 is not None else None
        return PaddedMicroBatch(empty, empty, empty[:, 0], empty[:, 0], forced)

    def _tree_share(self, share: Share, r3: R3Scope | None) -> tuple[PrefixTree | None, torch.Tensor | None]:
        """Prefix-merged layout of this rank's share: its tree (None for an empty share) and the
        forced routing per slot [S, L, k] (R3)."""
        part, tree, forced = share.batch, share.tree, None
        if part is None:
            return None, None
        if tree is None:
            raise ValueError("a prefix-merged forward needs the shares' trees (split_for_ranks with prefix_merge)")
        if r3 is not None:
            forced = part.routed_experts.long()[tree.routing_source]  # a shared slot: its training path's
            if not r3.full:
                slots = torch.arange(tree.num_slots)
                restrict_routing_(forced[None], r3, torch.zeros_like(slots), slots,
                                  part.loss_mask[tree.routing_source] > 0)
        return tree, forced

    def _run(self, share: Share, work: RankWork, r3: R3Scope | None,
             routing_out: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """Packed (logprobs, entropy, routing [T, L, k] or None) of this rank's share of one
        micro-batch, and the positions its forward computed (padding to the ranks' common shape
        included); the routing is the replayed one under full R3 (as in the embedded backend),
        else what the routers used (chosen, or replayed on the rows a partial R3 scope covers).

        `work.prefix_merge`: the share runs as one prefix tree ([1, S] slots, tree attention through
        Megatron's attention-mask input, each slot's RoPE position its depth), unpacked to the
        share's tokens exactly as the torch backend does."""
        if work.prefix_merge:
            return self._run_merged(share, work, r3, routing_out)
        logits, pm, b_run, S_pad = self._padded_forward(share, work, r3)
        b, S = pm.input_ids.shape
        dev = self.device
        logits = logits[:b, :S]
        logprobs, entropy = next_token_logprobs(logits, pm.input_ids.to(dev), work.temperature)
        rows, cols = pm.rows.to(dev), pm.cols.to(dev)
        routing = None
        if self.routers:
            if routing_out:  # the gather is a TP collective per layer: skipped when training
                full_r3 = r3 is not None and r3.full
                routing = pm.forced_experts.to(dev) if full_r3 else self._gather_routing(b_run, S_pad)[:b, :S]
                routing = unpad(routing, rows, cols)
            self._clear_routers()
        return unpad(logprobs, rows, cols), unpad(entropy, rows, cols), routing, b_run * S_pad


    def _padded_forward(self, share: Share, work: RankWork,
                        r3: R3Scope | None) -> tuple[torch.Tensor, PaddedMicroBatch, int, int]:
        """The model's output [b_run, S_pad, …] on this rank's share of a micro-batch, padded to the
        rows and length every DP rank runs (and to a multiple of TP under sequence parallelism),
        with the share's padded micro-batch, b_run and S_pad. The routers replay or record (`_set_routers`)."""
        pm, b_run = self._share(share, r3), share.rows
        b, S = pm.input_ids.shape
        S_run = share.seq_len  # the whole micro-batch's: the same on every DP rank
        tp = self.sizes.tensor_parallel if self.sizes.sequence_parallel else 1
        S_pad = -(-S_run // tp) * tp  # sequence parallel splits the sequence evenly over TP ranks
        ids = torch.nn.functional.pad(pm.input_ids, (0, S_pad - S, 0, b_run - b))
        position_ids = torch.arange(S_pad).expand(b_run, S_pad)
        # Megatron's mask marks what may NOT be attended; its default mask is built on "cuda".
        mask = ~torch.ones(S_pad, S_pad, dtype=torch.bool).tril()[None, None]
        forced = None
        if r3 is not None and self.routers:
            # padding rows/positions replay expert 0, as pad_micro_batch pads them
            forced = torch.nn.functional.pad(pm.forced_experts, (0, 0, 0, 0, 0, S_pad - S, 0, b_run - b))
        self._set_routers(r3, forced, S_pad, b_run, tp)
        dev = self.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=work.dtype == "bfloat16"):
            out = self.model(ids.to(dev), position_ids.to(dev), mask.to(dev))
        return out, pm, b_run, S_pad

    def _run_merged(self, share: Share, work: RankWork, r3: R3Scope | None,
                    routing_out: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """`_run` over this rank's share as a prefix tree (see `_run`)."""
        tree, forced = self._tree_share(share, r3)
        S_run = share.slots  # the largest share's tree: the collectives need equal token counts
        tp = self.sizes.tensor_parallel if self.sizes.sequence_parallel else 1
        S_pad = -(-S_run // tp) * tp
        S = 0 if tree is None else tree.num_slots
        ids = torch.zeros(1, S_pad, dtype=torch.int64)
        positions = torch.zeros(S_pad, dtype=torch.int64)
        allowed = torch.eye(S_pad, dtype=torch.bool)  # padding slots attend only to themselves
        if tree is not None:
            ids[0, :S], positions[:S] = tree.input_ids, tree.position_ids
            allowed[:S, :S] = tree.attention_mask()
        mask = ~allowed[None, None]  # Megatron's mask marks what may NOT be attended
        if forced is not None or (r3 is not None and self.routers):
            full = torch.zeros(1, S_pad, self.cfg.num_hidden_layers, self.cfg.num_experts_per_tok, dtype=torch.int64)
            if forced is not None:
                full[0, :S] = forced
            forced = full
        self._set_routers(r3, forced, S_pad, 1, tp)
        dev = self.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=work.dtype == "bfloat16"), \
                rope_positions(self.model, positions.to(dev)):
            logits = self.model(ids.to(dev), positions[None].to(dev), mask.to(dev))
        routing = None
        if self.routers:
            if routing_out and tree is not None:
                full_r3 = r3 is not None and r3.full
                per_slot = forced[0, :S].to(dev) if full_r3 else self._gather_routing(1, S_pad)[0, :S]
                routing = tree.unpack(per_slot)
            elif routing_out:
                self._gather_routing(1, S_pad)  # a TP collective: every rank joins
            self._clear_routers()
        if tree is None:  # an empty share: nothing to return, but the graph reaches the weights
            empty = logits.sum() * 0.0
            return empty.reshape(1)[:0], empty.reshape(1)[:0], routing, S_pad
        logprobs, entropy = label_logprobs(logits[0, :S], tree.labels.to(dev), work.temperature)
        return tree.unpack_predictions(logprobs), tree.unpack_predictions(entropy), routing, S_pad

    def _set_routers(self, r3: R3Scope | None, forced: torch.Tensor | None, S_pad: int, b_run: int, tp: int) -> None:
        """Point every MoE router at this forward: replay `forced` [b_run, S_pad, L, k] (R3;
        partial scopes replay only rows >= 0) or record what it chooses."""
        if not self.routers:
            return
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
        partial = r3 is not None and not r3.full
        if r3 is not None:
            n_local = S_pad * b_run // tp
            lo = self.ranks["tp_rank"] * n_local if tp > 1 else 0
            for router, layer in zip(self.routers, self.moe_layers):
                rows = forced[:, :, layer].transpose(0, 1).reshape(S_pad * b_run, -1)  # sequence-major
                rows = rows[lo:lo + n_local].to(self.device)
                router.clear_indices()
                if partial:  # −1 rows route freely (pad_micro_batch's partial-scope marker)
                    router.set_router_replay_action(RouterReplayAction.RECORD)
                    replay_rows(router, rows.clamp_min(0), rows[:, 0] >= 0)
                else:
                    router.set_target_indices(rows)
                    router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            for router in self.routers:
                router.clear_indices()
                router.set_router_replay_action(RouterReplayAction.RECORD)

    def _clear_routers(self) -> None:
        for router in self.routers:
            router.clear_indices()  # REPLAY_FORWARD also queues indices for a recompute
            stop_partial(router)

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

    def _answer(self, parts: list[Any]) -> tuple[int, list[Any]] | None:
        """(dp_rank, per-micro-batch results of this rank's shares) from tp_rank 0; None from the
        other TP ranks, which hold the same results (logits are gathered over TP)."""
        return (self.dp_rank, parts) if self.ranks["tp_rank"] == 0 else None

    def forward(self, work: RankWork, r3: R3Scope | None) -> tuple[int, list[Any]] | None:
        """Per micro-batch: (logprobs, entropy, routing or None) of this rank's share, on the host."""
        self.model.eval()
        with torch.no_grad():
            parts = [tuple(None if t is None else t.cpu()
                           for t in self._run(share, work, r3)[:3])
                     for share in work.shares]
        return self._answer(parts)

    def forward_backward(self, work: RankWork, loss_fn: LossFn,
                         r3: R3Scope | None) -> tuple[int, list[dict[str, Any] | None]] | None:
        """Accumulate this rank's gradients; per micro-batch the metrics row of this rank's share
        (None for an empty share), its per-token columns as CPU tensors under their
        `TOKEN_COLUMN_PREFIX` keys. Loss normalisation uses the whole batch's `LossContext`, so the
        shares' losses (and gradients) sum to the micro-batch's."""
        self.model.train()
        rows: list[dict[str, float] | None] = []
        for share in work.shares:
            logprobs, entropy, _, computed = self._run(share, work, r3, routing_out=False)
            part = share.batch
            if part is None:
                # every rank joins the backward's collectives (MoE dispatch, TP); zero gradients
                (logprobs.sum() * 0.0).backward()
                rows.append(None)
                continue
            loss, metrics = loss_fn(logprobs, entropy, part.to(self.device), work.ctx)
            if loss.requires_grad:
                loss.backward()
            elif self.sizes.world_size > 1:
                (logprobs.sum() * 0.0).backward()  # a constant loss: the other ranks still run a backward
            scalars, columns = split_token_columns(metrics, part.num_tokens)
            rows.append({"loss": float(loss.detach()), **scalars,
                         "num_tokens": float(part.num_tokens), "num_loss_tokens": float(part.loss_mask.sum()),
                         "num_computed": float(computed),
                         **{TOKEN_COLUMN_PREFIX + k: v for k, v in columns.items()}})
        return self._answer(rows)

    # ------------------------------------------------------------------ PPO's critic
    def attach_critic(self, full_weights: dict[str, torch.Tensor]) -> None:
        """Build the value model on this rank (same parallel layout as the policy) from full
        Megatron weights (`value_head.critic_to_megatron`)."""
        self.critic = MegatronRank(self.cfg, self.sizes, self.dispatcher, full_weights, value_head=True)

    def on_critic(self, call: RankCall) -> Any:
        """A typed call (`RankCall.of`) on the value model's rank (its weights, optimizer slot, state)."""
        return call.run(self._critic())

    def on_critic_with(self, work: RankWork, call: RankCall) -> Any:
        """`on_critic` with this rank's own `RankWork` first (`RankGroup.call_each`; `RankCall.each`)."""
        return call.run(self._critic(), work)

    def _critic(self) -> MegatronRank:
        if self.critic is None:
            raise RuntimeError("this Megatron rank holds no critic (attach_critic was not called)")
        return self.critic

    def _values(self, share: Share, work: RankWork) -> torch.Tensor:
        """Packed V [T] (float32) of this rank's share of a micro-batch (value model only)."""
        out, pm, _, _ = self._padded_forward(share, work, None)
        b, S = pm.input_ids.shape
        return unpad(shifted_values(out[:b, :S]), pm.rows.to(self.device), pm.cols.to(self.device))

    def value_forward(self, work: RankWork) -> tuple[int, list[torch.Tensor]] | None:
        """Per micro-batch, V of this rank's share on the host (no grad)."""
        self.model.eval()
        with torch.no_grad():
            return self._answer([self._values(share, work).cpu() for share in work.shares])

    def value_forward_backward(self, work: RankWork, clip: float | None,
                               denom: float) -> tuple[int, list[tuple[float, float] | None]] | None:
        """Accumulate the value loss's gradients (`axrl.train.value_loss` over the update's
        `denom` trained tokens; the work's batch carries the returns in `advantages` and the old
        values in `old_logprobs`, `critic.critic_batch`). Per micro-batch this share's (loss,
        clipped-token count), None for an empty share."""
        self.model.train()
        rows: list[tuple[float, float] | None] = []
        for share in work.shares:
            values = self._values(share, work)
            if share.batch is None:  # every rank joins the backward's collectives
                (values.sum() * 0.0).backward()
                rows.append(None)
                continue
            mb = share.batch.to(self.device)
            loss, clipped = value_loss(values, mb.old_logprobs, mb.advantages, mb.loss_mask, clip, denom)
            loss.backward()
            rows.append((float(loss.detach()), float(clipped)))
        return self._answer(rows)

    # ------------------------------------------------------------------ optimizer
    def _optimizer(self, slot: str, betas: tuple[float, float], eps: float, weight_decay: float) -> torch.optim.Optimizer:
        if slot not in self.optimizers:
            self.optimizers[slot] = adamw([p for _, p in self.params], lr=0.0, betas=betas, eps=eps,
                                          weight_decay=weight_decay)
        set_adam_hyper(self.optimizers[slot], betas, eps, weight_decay)  # a step may bring its own
        return self.optimizers[slot]

    def _partial_group(self, name: str) -> Any:
        """The group over which `name`'s gradient is split and summed (None: complete here).

        Dense params saw only this DP rank's samples: partial over DP. TP-replicated dense params
        (norms, router: the rank's sequence shard under SP; q/k norms: the rank's heads) are also
        partial over TP, so over TP × DP. Experts saw every token routed to them through the EP
        dispatch; when replicated over expert-data-parallel ranks, each copy saw only its ranks'
        tokens."""
        s = self.sizes
        if EXPERT_NAME.match(name):
            return self.edp_group if s.expert_data_parallel > 1 else None
        over_tp = s.tensor_parallel > 1 and split_rule(name)[0] is None
        if over_tp and s.data_parallel > 1:
            return self.tp_dp_group
        if over_tp:
            return self.tp_group
        return self.dp_group if s.data_parallel > 1 else None

    def _owned(self, name: str) -> bool:
        """Whether this rank counts `name` in the global grad norm (each element exactly once)."""
        if EXPERT_NAME.match(name):
            return self.edp_rank == 0
        return self.dp_rank == 0 and (split_rule(name)[0] is not None or self.ranks["tp_rank"] == 0)

    def optimizer_step(self, slot: str, lr: float, grad_clip: float, betas: tuple[float, float], eps: float,
                       weight_decay: float) -> tuple[float, dict[str, float]]:
        """All-reduce partial grads, global grad norm, clip, AdamW step (skipped if non-finite).
        Returns the norm and, per HF tensor, the squared norm of the parts this rank owns (the
        driver sums them over ranks: TP shards add up, replicas are counted once)."""
        import torch.distributed as dist

        opt = self._optimizer(slot, betas, eps, weight_decay)
        for name, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # like Megatron's grad buffer: every param steps
            group = self._partial_group(name)
            if group is not None:
                dist.all_reduce(p.grad, group=group)
        sq = torch.zeros((), dtype=torch.float64)
        pieces: dict[str, float] = {}
        per_rank = self.cfg.num_experts // self.sizes.expert_parallel if self.cfg.num_experts else 0
        for name, p in self.params:
            if self._owned(name):
                sq += p.grad.detach().float().norm(2).cpu().double() ** 2
                full_name = global_expert_name(name, self.ranks["ep_rank"], per_rank)
                for hf, part in hf_slices(full_name, p.grad.detach(), self.cfg, self.sizes.tensor_parallel):
                    pieces[hf] = pieces.get(hf, 0.0) + float(part.float().norm(2).double() ** 2)
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
        return float(norm), pieces

    def zero_grad(self) -> None:
        for _, p in self.params:
            p.grad = None

    def optimizer_state(self, slot: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
        """This rank's AdamW moments per local param name (empty before the first step)."""
        opt = self.optimizers.get(slot)
        if opt is None:
            return {}, self.ranks
        return {n: {k: v.detach().cpu().clone() for k, v in opt.state[p].items()}
                for n, p in self.params if p in opt.state and self._reports(n)}, self.ranks

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


__all__ = ["MegatronRank", "free_port", "init_distributed", "relax_on_cuda", "worker_setup"]
