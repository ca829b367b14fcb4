"""The deep dump of one step: instrumentation too costly for every step, gathered while the
step's updates run (again) and written to `RUN/replay/step_N.h5`. Written by
`axrl-debug replay --dump` and, at the time of a gradient spike, by the online spike trigger
(`axrl.runtime.spike_trigger`); read by `axrl-debug spikes` and the TUI.

Everything is *observed*, never changed: the loss wrapper recomputes the loss's own per-token
terms (`PolicyLoss.token_terms`) on detached copies and per-sample gradients use
`torch.autograd.grad` (which leaves `.grad` alone), so an instrumented re-execution is still
compared bit for bit with the recording.

Dump file layout (format "axrl-replay-dump", version 1; T, N as in the step file, U updates,
P parameter tensors, L MoE layers, E experts, A hooked activations). Row t of every `/tokens`
dataset is token t of the step file, row i of `/samples` is sample row i:

    / attrs            format, version, step, run, verdict, first_divergence, checkpoint_step,
                       source ("replay" | "spike_trigger"), loss, loss_agg, tis, tis_cap, r3,
                       created_unix, schema_version (of the trace)
    /samples/offsets, /tokens/ids, /tokens/loss_mask   copies from the step file, so that
                       `axrl.trace.StepFile` opens a dump like a step file
    /tokens/update             int32   [T]  update that trained the token (-1: none)
    /tokens/logprob            float32 [T]  trainer logprob in that update's forward (NaN: not trained)
    /tokens/ratio              float32 [T]  the objective's ratio (token r, or the sequence ratio of gspo)
    /tokens/tis_weight         float32 [T]  min(exp(old - rollout), tis_cap) (NaN without rollout logprob)
    /tokens/is_weight          float32 [T]  the corrections' weight applied to the token (NaN: not trained)
    /tokens/loss_rule          uint16  [T]  LossRule bits (docs/trace-format.md)
    /tokens/pg_loss            float32 [T]  per-token policy loss after the objective and corrections
    /tokens/loss_contribution  float32 [T]  the token's share of its update's loss; summed over the
                                            update's tokens it gives /updates/loss (up to rounding)
    /tokens/clipped            uint8   [T]  1 where the objective hard-clipped (zero surrogate gradient)
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

Real tokens only (padding never counts). /params, /activations, /router, /tokens/activation_norm and
the per-sample gradient columns come from `TrainBackend.inspect` (absent, NaN, when the backend
cannot inspect its model, e.g. Megatron's ranks). Activation norms and per-sample gradients are
measured one sample at a time, so their last bits may differ from the update's micro-batched forward.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from axrl.algo import LossRule, PolicyLoss, aggregation_weights
from axrl.runtime.results import UpdateResult
from axrl.trace import SCHEMA_VERSION
from axrl.train.protocol import R3, Inspection, LossContext, PackedBatch, TrainBackend

DUMP_FORMAT = "axrl-replay-dump"
DUMP_VERSION = 1
DUMP_DIR = "replay"
_HARD_CLIP = int(LossRule.CLIP_HIGH | LossRule.CLIP_LOW)


def dump_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where a step's dump is written (and `spikes` / the TUI look for it)."""
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


class DumpProbe:
    """`UpdateHooks` + a wrapping `LossFn` that record the dump of one step.

    Create it with the step's full batch and update splits, pass `probe.loss_fn` and the probe
    (as hooks) to `run_updates`, then `probe.close()` and `probe.write(path, ...)`. Model
    internals (activations, router, per-sample gradients) come from `TrainBackend.inspect`,
    called before each update on the weights that update's forward uses.
    """

    def __init__(self, backend: TrainBackend, loss_fn: PolicyLoss, batch: PackedBatch,
                 splits: list[list[int]], *, r3: R3) -> None:
        self.backend, self.inner, self.batch, self.splits, self.r3 = backend, loss_fn, batch, splits, r3
        T, N = batch.num_tokens, batch.num_samples
        nan = np.full(T, np.nan, np.float32)
        self.tok = {"update": np.full(T, -1, np.int32), "logprob": nan.copy(), "ratio": nan.copy(),
                    "tis_weight": nan.copy(), "is_weight": nan.copy(), "loss_rule": np.zeros(T, np.uint16),
                    "pg_loss": np.zeros(T, np.float32), "loss_contribution": np.zeros(T, np.float32),
                    "clipped": np.zeros(T, np.uint8)}
        self.samples = {"update": np.full(N, -1, np.int32), "loss": np.zeros(N), "grad_norm": np.full(N, np.nan),
                        "grad_cosine": np.full(N, np.nan)}
        self.inspections: list[Inspection | None] = []
        self._active = False
        self._update = -1
        self._cursor = 0                   # next sample position inside the current update

    # ------------------------------------------------------------------ UpdateHooks
    def before_update(self, index: int, batch: PackedBatch) -> None:
        self.inspections.append(self.backend.inspect(batch, self.inner, r3=self.r3))
        self._update, self._cursor, self._active = index, 0, True

    def before_optimizer_step(self, index: int) -> None:
        self._active = False

    def after_update(self, index: int, result: UpdateResult) -> None:
        """Nothing to record: the update's numbers come back in its UpdateResult."""

    # ------------------------------------------------------------------ LossFn
    def loss_fn(self, logprobs: torch.Tensor, entropy: torch.Tensor, mb: PackedBatch,
                ctx: LossContext) -> tuple[torch.Tensor, dict[str, Any]]:
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
            terms = self.inner.token_terms(logprobs.detach(), entropy.detach(), mb)
            tok = terms.token_loss(cfg).detach().double()
            weight = aggregation_weights(terms.mask, mb.offsets.to(terms.mask.device), ctx, cfg.loss_agg,
                                         cfg.agg_norm_len)
        contribution = (weight * tok).cpu().numpy()
        m = terms.mask.cpu().numpy()
        i = idx.numpy()
        rules = terms.rules.cpu().numpy()
        self.tok["update"][i] = u
        self.tok["logprob"][i] = np.where(m, logprobs.detach().float().cpu().numpy(), np.nan)
        self.tok["ratio"][i] = np.where(m, terms.ratio.float().cpu().numpy(), np.nan)
        self.tok["is_weight"][i] = np.where(m, terms.is_weight.float().cpu().numpy(), np.nan)
        self.tok["loss_rule"][i] = np.where(m, rules, 0).astype(np.uint16)
        if terms.tis is not None:
            available = m & ~terms.tis[2].cpu().numpy()
            self.tok["tis_weight"][i] = np.where(available, terms.tis[0].float().cpu().numpy(), np.nan)
        self.tok["pg_loss"][i] = terms.pg.detach().float().cpu().numpy()
        self.tok["loss_contribution"][i] = contribution
        self.tok["clipped"][i] = ((rules & _HARD_CLIP) > 0) & m
        sample_of = np.repeat(np.arange(len(rows)), mb.lengths.numpy())
        for k, r in enumerate(rows):
            self.samples["update"][r] = u
            self.samples["loss"][r] = float(contribution[sample_of == k].astype(np.float64).sum())

    # ------------------------------------------------------------------ output
    def close(self) -> None:
        self._active = False

    def write(self, path: Path, *, updates: list[dict[str, float]], attrs: dict[str, Any]) -> Path:
        """Write the dump atomically (tmp file + rename) and return its path."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        str_dt = h5py.string_dtype("utf-8")
        internals = self._inspection_datasets()
        cfg = self.inner.cfg
        with h5py.File(tmp, "w") as f:
            f.attrs.update({"format": DUMP_FORMAT, "version": DUMP_VERSION, "created_unix": time.time(),
                            "loss": cfg.loss, "loss_agg": cfg.loss_agg, "tis": cfg.tis_short_form(), "tis_cap": cfg.tis_cap,
                            "r3": bool(self.r3)})
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
            for name, v in internals.items():
                f.create_dataset(name, data=v, dtype=str_dt if v.dtype == object else v.dtype)
        os.replace(tmp, path)
        return path

    def _inspection_datasets(self) -> dict[str, np.ndarray]:
        """The model-internals datasets, from one `Inspection` per update (rows mapped back to the
        step's tokens and samples; fills the per-sample gradient columns); {} without them."""
        if not self.inspections or any(x is None for x in self.inspections):
            return {}
        ins: list[Inspection] = self.inspections  # type: ignore[assignment]
        first = ins[0]
        T, A = self.batch.num_tokens, len(first.activation_names)
        act = np.full((T, A), np.nan, np.float32)
        mean, top = np.zeros((len(ins), A)), np.zeros((len(ins), A))
        off = self.batch.offsets.numpy()
        for u, (rows, x) in enumerate(zip(self.splits, ins)):
            norms = x.activation_norm.numpy()
            act[np.concatenate([np.arange(off[r], off[r + 1]) for r in rows])] = norms
            mean[u], top[u] = norms.mean(axis=0), norms.max(axis=0)
            self.samples["grad_norm"][rows] = x.sample_grad_norm.numpy()
            self.samples["grad_cosine"][rows] = x.sample_grad_cosine.numpy()
        out = {"tokens/activation_norm": act, "params/names": np.asarray(first.param_names, dtype=object),
               "params/grad_norm": np.stack([x.param_grad_norm.numpy() for x in ins]),
               "activations/names": np.asarray(first.activation_names, dtype=object),
               "activations/norm_mean": mean, "activations/norm_max": top}
        if first.moe_layers:
            tokens = np.stack([x.router_tokens.numpy() for x in ins])
            totals = tokens.sum(-1, keepdims=True)
            out.update({"router/layers": np.asarray(first.moe_layers, np.int64), "router/tokens": tokens,
                        "router/load": tokens / np.where(totals > 0, totals, 1),
                        "router/entropy": np.stack([x.router_entropy.numpy() for x in ins])})
        return out
