"""`--dump`: instrumentation too costly for training, gathered while step N is re-executed, written
to `RUN/replay/step_N.h5`.

Everything is *observed*, never changed: forward hooks and the loss wrapper compute on detached
copies, per-sample gradients use `torch.autograd.grad` (which leaves `.grad` alone), so the
instrumented re-execution is still compared bit for bit with the recording.

Dump file layout (format "axrl-replay-dump", version 1; T, N as in the step file, U updates,
P parameter tensors, L MoE layers, E experts, A hooked activations). Row t of every `/tokens`
dataset is token t of the step file, row i of `/samples` is sample row i:

    / attrs            format, version, step, run, verdict, first_divergence, checkpoint_step,
                       loss_agg, tis, tis_cap, r3, created_unix, schema_version (of the trace)
    /samples/offsets, /tokens/ids, /tokens/loss_mask   copies from the step file, so that
                       `axrl.trace.StepFile` opens a dump like a step file
    /tokens/update             int32   [T]  update that trained the token (-1: none)
    /tokens/logprob            float32 [T]  trainer logprob in that update's forward (NaN: not trained)
    /tokens/ratio              float32 [T]  importance ratio exp(logprob - old_logprob) the loss used
    /tokens/tis_weight         float32 [T]  min(exp(old - rollout), tis_cap) (NaN without rollout logprob)
    /tokens/pg_loss            float32 [T]  per-token policy-gradient loss (after clip, dual clip, TIS)
    /tokens/loss_contribution  float32 [T]  the token's share of its update's loss; summed over the
                                            update's tokens it gives /updates/loss (up to rounding)
    /tokens/clipped            uint8   [T]  1 where the clipped branch was taken (zero surrogate gradient)
    /tokens/activation_norm    float32 [T, A]  L2 norm of the token's hidden state at each hooked point
    /samples/update            int32   [N]  update the sample was trained in (-1: none)
    /samples/loss              float64 [N]  sum of the sample's loss contributions
    /samples/grad_norm         float64 [N]  ||gradient of the sample's share of the loss||, before clipping
    /samples/grad_cosine       float64 [N]  cosine between that gradient and the update's total gradient
    /updates/{loss, grad_norm, lr}  float64 [U]  as re-executed
    /params/names              str     [P]  parameter tensors (HF names)
    /params/grad_norm          float64 [U, P]  per-tensor gradient norm before clipping
    /router/layers             int64   [L]  decoder layer index of each MoE layer
    /router/load               float64 [U, L, E]  fraction of (token, top-k slot) assignments per expert
    /router/tokens             int64   [U, L, E]  the same as counts
    /router/entropy            float64 [U, L]  mean entropy (nats) of the router softmax per token
    /activations/names         str     [A]  hooked points: embed_tokens, layers.0 .. layers.{n-1}, norm
    /activations/norm_mean     float64 [U, A]  mean over trained-on and context tokens of the update
    /activations/norm_max      float64 [U, A]  max of the same

Real tokens only (padding never counts). Groups absent when the backend has no torch model to hook.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch import nn

from axrl.algo import PolicyLoss, aggregate_loss, kl_penalty, ppo_token_loss
from axrl.trace import SCHEMA_VERSION
from axrl.train.micro_batch import next_token_logprobs, pad_micro_batch, unpad
from axrl.train.protocol import LossContext, PackedBatch, TrainBackend

DUMP_FORMAT = "axrl-replay-dump"
DUMP_VERSION = 1
DUMP_DIR = "replay"


def dump_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where `axrl-debug replay --dump` writes (and `spikes` / the TUI look for) step N's dump."""
    return Path(run_dir) / DUMP_DIR / f"step_{int(step):06d}.h5"


def read_dump(path: str | os.PathLike) -> dict[str, Any]:
    """A dump file as `{'attrs': {...}, '/tokens/ratio': array, ...}` (strings as `str`)."""
    out: dict[str, Any] = {}
    with h5py.File(path, "r") as f:
        out["attrs"] = {k: (v.decode() if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v)
                        for k, v in f.attrs.items()}

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                out["/" + name] = obj.asstr()[()] if h5py.check_string_dtype(obj.dtype) else obj[()]
        f.visititems(visit)
    return out


def ctx_of(batch: PackedBatch) -> LossContext:
    """Batch-wide counts, as `forward_backward` computes them for the whole update."""
    per_sample = torch.zeros(batch.num_samples).index_add_(0, batch.sample_index(), batch.loss_mask.float().cpu())
    return LossContext(num_loss_tokens=int(batch.loss_mask.sum()), num_samples=batch.num_samples,
                       num_loss_samples=int((per_sample > 0).sum()))


class DumpProbe:
    """`UpdateHooks` + a wrapping `LossFn` that record the dump of one step.

    Create it with the step's full batch and update splits, pass `probe.loss_fn` and the probe
    (as hooks) to `run_updates`, then `probe.close()` and `probe.write(path, ...)`.
    """

    def __init__(self, backend: TrainBackend, loss_fn: PolicyLoss, batch: PackedBatch,
                 splits: list[list[int]], *, r3: bool) -> None:
        self.backend, self.inner, self.batch, self.splits, self.r3 = backend, loss_fn, batch, splits, r3
        T, N, U = batch.num_tokens, batch.num_samples, len(splits)
        nan = np.full(T, np.nan, np.float32)
        self.tok = {"update": np.full(T, -1, np.int32), "logprob": nan.copy(), "ratio": nan.copy(),
                    "tis_weight": nan.copy(), "pg_loss": np.zeros(T, np.float32),
                    "loss_contribution": np.zeros(T, np.float32), "clipped": np.zeros(T, np.uint8)}
        self.samples = {"update": np.full(N, -1, np.int32), "loss": np.zeros(N), "grad_norm": np.full(N, np.nan),
                        "grad_cosine": np.full(N, np.nan)}
        self.model: nn.Module | None = getattr(backend, "model", None)
        if not isinstance(self.model, nn.Module):
            self.model = None
        self.param_names: list[str] = []
        self.param_grad_norm = np.zeros((U, 0))
        self._handles: list[Any] = []
        self._active = False
        self._update = -1
        self._cursor = 0                   # next sample position inside the current update
        self._pending: dict[str, torch.Tensor] = {}
        self._real: torch.Tensor | None = None
        self.act_names: list[str] = []
        self.moe_layers: list[int] = []
        if self.model is not None:
            self._install(U)

    # ------------------------------------------------------------------ hooks
    def _install(self, U: int) -> None:
        model = self.model
        assert model is not None
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in self.params]
        self.param_grad_norm = np.zeros((U, len(self.params)))
        self._handles.append(model.register_forward_pre_hook(self._on_model_input, with_kwargs=True))
        inner = getattr(model, "model", None)
        layers = list(getattr(inner, "layers", []))
        points: list[tuple[str, nn.Module]] = []
        if hasattr(inner, "embed_tokens"):
            points.append(("embed_tokens", inner.embed_tokens))
        points += [(f"layers.{i}", layer) for i, layer in enumerate(layers)]
        if hasattr(inner, "norm"):
            points.append(("norm", inner.norm))
        self.act_names = [n for n, _ in points]
        for a, (name, module) in enumerate(points):
            self._handles.append(module.register_forward_hook(self._activation_hook(a)))
        self.moe_layers = [i for i, layer in enumerate(layers) if getattr(layer, "is_moe", False)]
        E = int(getattr(getattr(model, "config", None), "num_experts", 0) or 0)
        L = len(self.moe_layers)
        self.router_tokens = np.zeros((U, L, E), np.int64)
        self.router_entropy_sum = np.zeros((U, L))
        self.router_count = np.zeros((U, L))
        for j, i in enumerate(self.moe_layers):
            block = layers[i].mlp
            self._handles.append(block.register_forward_hook(self._experts_hook(j)))
            self._handles.append(block.gate.register_forward_hook(self._gate_hook(j)))
        A = len(points)
        self.act_sum, self.act_max, self.act_count = np.zeros((U, A)), np.zeros((U, A)), np.zeros((U, A))
        self.tok_act = np.full((self.batch.num_tokens, A), np.nan, np.float32)

    def _on_model_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._active:
            return
        mask = kwargs.get("attention_mask")
        ids = args[0] if args else kwargs["input_ids"]
        self._real = (torch.ones_like(ids) if mask is None else mask).bool()

    def _activation_hook(self, a: int):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self._active or self._real is None:
                return
            x = output[0] if isinstance(output, tuple) else output
            with torch.no_grad():
                norms = x.detach()[self._real].float().norm(dim=-1)   # [T_mb], packed order
            self._pending[f"act{a}"] = norms.cpu()
            u = self._update
            if norms.numel():
                self.act_sum[u, a] += float(norms.double().sum())
                self.act_max[u, a] = max(self.act_max[u, a], float(norms.max()))
                self.act_count[u, a] += norms.numel()
        return hook

    def _experts_hook(self, j: int):
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not self._active or self._real is None:
                return
            experts = output[1].detach()[self._real.reshape(-1)]
            counts = torch.bincount(experts.reshape(-1).cpu(), minlength=self.router_tokens.shape[2])
            self.router_tokens[self._update, j] += counts.numpy()[: self.router_tokens.shape[2]]
        return hook

    def _gate_hook(self, j: int):
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if not self._active or self._real is None:
                return
            with torch.no_grad():
                logits = output.detach()[self._real.reshape(-1)].float()
                logp = torch.log_softmax(logits, dim=-1)
                ent = -(logp.exp() * logp).sum(-1)
            self.router_entropy_sum[self._update, j] += float(ent.double().sum())
            self.router_count[self._update, j] += ent.numel()
        return hook

    # ------------------------------------------------------------------ UpdateHooks
    def before_update(self, index: int, batch: PackedBatch) -> None:
        self._update, self._cursor, self._active = index, 0, True

    def before_optimizer_step(self, index: int) -> None:
        self._active = False
        if self.model is None:
            return
        grads = [p.grad for _, p in self.params]
        self.param_grad_norm[index] = [0.0 if g is None else float(g.detach().double().norm()) for g in grads]
        self._per_sample_grads(index, grads)

    def _per_sample_grads(self, u: int, total: list[torch.Tensor | None]) -> None:
        """‖∇ share_i‖ and its cosine with the update's gradient, one sample at a time, with
        autograd.grad so the accumulated `.grad` (about to be stepped) is untouched."""
        model = self.model
        assert model is not None
        sub = self.batch.select(self.splits[u])
        ctx = ctx_of(sub)
        params = [p for _, p in self.params]
        total_sq = sum(float(g.double().pow(2).sum()) for g in total if g is not None)
        dtype = getattr(getattr(self.backend, "config", None), "dtype", "float32")
        use_r3 = self.r3 and bool(getattr(getattr(model, "config", None), "is_moe", False))
        device = next(model.parameters()).device
        for j, row in enumerate(self.splits[u]):
            mb = sub.select([j])
            pm = pad_micro_batch(mb, with_routing=use_r3, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                out = model(pm.input_ids, attention_mask=pm.attention_mask, forced_experts=pm.forced_experts)
            lp, ent = next_token_logprobs(out.logits, pm.input_ids, mb.temperature)
            loss, _ = self.inner(unpad(lp, pm.rows, pm.cols), unpad(ent, pm.rows, pm.cols), mb, ctx)
            if not loss.requires_grad:
                self.samples["grad_norm"][row], self.samples["grad_cosine"][row] = 0.0, np.nan
                continue
            gs = torch.autograd.grad(loss, params, allow_unused=True)
            sq, dot = 0.0, 0.0
            for g, G in zip(gs, total):
                if g is None:
                    continue
                g = g.detach().double()
                sq += float(g.pow(2).sum())
                if G is not None:
                    dot += float((g * G.detach().double()).sum())
            self.samples["grad_norm"][row] = sq ** 0.5
            denom = (sq * total_sq) ** 0.5
            self.samples["grad_cosine"][row] = dot / denom if denom > 0 else np.nan

    # ------------------------------------------------------------------ LossFn
    def loss_fn(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch,
                ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        """The real loss, unchanged, plus the per-token record of this micro-batch."""
        loss, metrics = self.inner(logprobs, entropy, mb, ctx)
        if self._update >= 0 and self._active:
            self._record_tokens(logprobs, entropy, mb, ctx)
        return loss, metrics

    def _record_tokens(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch, ctx: LossContext) -> None:
        u = self._update
        rows = self.splits[u][self._cursor:self._cursor + mb.num_samples]
        self._cursor += mb.num_samples
        off = self.batch.offsets
        idx = torch.cat([torch.arange(int(off[r]), int(off[r + 1])) for r in rows])
        if idx.numel() != mb.num_tokens:  # the backend split differently than documented: skip, don't lie
            return
        cfg = self.inner.cfg
        with torch.no_grad():
            mask = mb.loss_mask.cpu() > 0
            lp = torch.where(mask, logprobs.detach().float().cpu(), torch.zeros(()))
            adv = torch.where(mask, mb.advantages.float().cpu(), torch.zeros(()))
            old = lp if mb.old_logprobs is None else torch.where(mask, mb.old_logprobs.float().cpu(), lp)
            rollout = None if mb.rollout_logprobs is None else mb.rollout_logprobs.float().cpu()
            terms = ppo_token_loss(lp, old, adv, mask, cfg, rollout)
            tok = terms.pg
            if cfg.kl_coef > 0 and mb.ref_logprobs is not None:
                ref = torch.where(mask, mb.ref_logprobs.float().cpu(), lp)
                tok = tok + torch.where(mask, cfg.kl_coef * kl_penalty(lp, ref, cfg.kl_estimator,
                                                                      log_ratio_clamp=cfg.kl_log_ratio_clamp), 0.0)
            if cfg.entropy_coef != 0:
                tok = tok + torch.where(mask, -cfg.entropy_coef * entropy.detach().float().cpu(), 0.0)
        # The aggregation is linear in the per-token loss: its gradient is each token's weight.
        with torch.enable_grad():
            probe = torch.zeros_like(tok, requires_grad=True)
            agg = aggregate_loss(probe, mask, mb.offsets.cpu(), ctx, cfg.loss_agg, cfg.agg_norm_len)
            (weight,) = torch.autograd.grad(agg, probe) if agg.requires_grad else (torch.zeros_like(tok),)
        contribution = (weight * tok).numpy()
        m = mask.numpy()
        i = idx.numpy()
        self.tok["update"][i] = u
        self.tok["logprob"][i] = np.where(m, logprobs.detach().float().cpu().numpy(), np.nan)
        self.tok["ratio"][i] = np.where(m, terms.ratio.numpy(), np.nan)
        if terms.tis_weight is not None:
            self.tok["tis_weight"][i] = np.where(m & np.isfinite(rollout.numpy()), terms.tis_weight.numpy(), np.nan)
        self.tok["pg_loss"][i] = terms.pg.numpy()
        self.tok["loss_contribution"][i] = contribution
        self.tok["clipped"][i] = (terms.clipped_high | terms.clipped_low).numpy().astype(np.uint8)
        sample_of = np.repeat(np.arange(len(rows)), mb.lengths.numpy())
        for k, r in enumerate(rows):
            self.samples["update"][r] = u
            self.samples["loss"][r] = float(contribution[sample_of == k].astype(np.float64).sum())
        for name, norms in self._pending.items():
            if norms.numel() == len(i):
                self.tok_act[i, int(name[3:])] = norms.numpy()
        self._pending.clear()

    # ------------------------------------------------------------------ output
    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = False

    def write(self, path: Path, *, updates: list[dict[str, float]], attrs: dict[str, Any]) -> Path:
        """Write the dump atomically (tmp file + rename) and return its path."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        str_dt = h5py.string_dtype("utf-8")
        with h5py.File(tmp, "w") as f:
            f.attrs.update({"format": DUMP_FORMAT, "version": DUMP_VERSION, "created_unix": time.time(),
                            "loss_agg": self.inner.cfg.loss_agg, "tis": self.inner.cfg.tis,
                            "tis_cap": self.inner.cfg.tis_cap, "r3": self.r3})
            f.attrs.update({k: v for k, v in attrs.items() if v is not None})
            # The step file's own keys too, so `axrl.trace.StepFile` (spikes, TUI) opens a dump as it
            # opens a step, and rows line up without reading the trace.
            f.attrs["schema_version"] = SCHEMA_VERSION
            f["samples/offsets"] = self.batch.offsets.numpy().astype(np.int64)
            f["tokens/ids"] = self.batch.input_ids.numpy().astype(np.int32)
            f["tokens/loss_mask"] = (self.batch.loss_mask.numpy() > 0).astype(np.uint8)
            for k, v in self.tok.items():
                f[f"tokens/{k}"] = v
            for k, v in self.samples.items():
                f[f"samples/{k}"] = v
            for k in ("loss", "grad_norm", "lr"):
                f[f"updates/{k}"] = np.asarray([row[k] for row in updates], np.float64)
            if self.model is not None:
                f["tokens/activation_norm"] = self.tok_act
                f.create_dataset("params/names", data=np.asarray(self.param_names, dtype=object), dtype=str_dt)
                f["params/grad_norm"] = self.param_grad_norm
                f.create_dataset("activations/names", data=np.asarray(self.act_names, dtype=object), dtype=str_dt)
                with np.errstate(invalid="ignore", divide="ignore"):
                    f["activations/norm_mean"] = self.act_sum / self.act_count
                    f["activations/norm_max"] = self.act_max
                    if self.moe_layers:
                        f["router/layers"] = np.asarray(self.moe_layers, np.int64)
                        f["router/tokens"] = self.router_tokens
                        totals = self.router_tokens.sum(-1, keepdims=True)
                        f["router/load"] = self.router_tokens / np.where(totals > 0, totals, 1)
                        f["router/entropy"] = self.router_entropy_sum / self.router_count
        os.replace(tmp, path)
        return path
