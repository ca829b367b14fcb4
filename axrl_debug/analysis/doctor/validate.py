"""`doctor --validate`: replay a flagged step's training under each mitigation that fits a finding and
measure its effect against an exactly on-policy reference.

The reference is the step's own generated tokens re-scored by the trainer: the rollout logprobs
replaced by the trainer's old logprobs (ratio 1 on every token, no mismatch at all). The baseline is the step as
trained (the recorded rollout logprobs). Each variant runs the step's updates from the same
starting state (weights and optimizer); its effect is measured on
* the loss: |loss − reference loss|, and
* the gradient of the step's first update (read before its optimizer step: Adam's first update is
  nearly sign(g), which would hide the difference): its relative error ‖g − g_ref‖ / ‖g_ref‖ and
  its cosine to the reference.
A mitigation is recommended only when it brings the gradient closer to the reference than the
baseline does (a smaller relative error), with the numbers.

Mitigations (by finding): `mask_untrained` — the masking fix (loss only on tokens the engine
generated); `tis_mask` — tokens whose |Δ| is outside the envelope's max bound leave the loss;
`tis_cap=1.05` — a tighter truncation of the importance weight; `r3` — routing replay (the recorded
engine routing forced in the trainer's forward). A resync or another precision changes what the
engine samples, so it cannot be measured on the recorded tokens: those are said, not measured.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

ENGINE_SIDE = ("stale_tensor", "weights_out_of_sync", "kv_cache_precision", "prefill_decode", "routing_flips",
               "logprob_semantics", "precision", "staleness", "context_mismatch")
NOT_MEASURABLE = {"weights_out_of_sync": "resync (re-send the weights; the sentinel's sync.on_failure: resync)",
                  "stale_tensor": "resync of the stale tensor",
                  "kv_cache_precision": "a KV cache at the trainer's precision (rollout.kv_dtype)"}


def _mitigations(cause: str) -> list[str]:
    if cause == "masking":
        return ["mask_untrained"]
    if cause == "routing_flips":
        return ["r3", "tis_mask", "tis_cap=1.05"]
    if cause in ENGINE_SIDE:
        return ["tis_mask", "tis_cap=1.05"]
    return []


def validate_findings(ctx: Context, findings: list[Finding], say: Callable[[str], None]) -> None:
    """Measure the mitigations of every finding on its first flagged step (or its first step)."""
    from replay.policy import policy_before
    from replay.recorded import load_recorded_step

    wanted = [f for f in findings if _mitigations(f.cause) and f.steps]
    if not wanted:
        return
    step = next((s for s in wanted[0].steps if s in ctx.flagged), wanted[0].steps[0])
    state = policy_before(ctx.run, step)
    try:
        rec = load_recorded_step(state.inventory.files[step], state.cfg)
        bench = _Bench(state.backend, state.cfg, rec, step)
        ref = bench.run("reference", on_policy(rec.batch))
        base = bench.run("baseline", rec.batch)
        for f in wanted:
            rows = []
            for name in _mitigations(f.cause):
                say(f"mitigation {name} on step {step}")
                rows.append(_compare(name, bench.variant(name, ctx), ref, base))
            for name, what in NOT_MEASURABLE.items():
                if f.cause == name:
                    rows.append({"mitigation": what, "measured": False,
                                 "why": "changes what the engine samples: not measurable on the recorded tokens"})
            f.validation = rows
    finally:
        state.close()


def on_policy(batch):
    """The exactly on-policy batch: the tokens the engine generated (loss only on them), their rollout
    logprobs := the trainer's old logprobs (ratio 1 everywhere)."""
    ro = batch.rollout_logprobs
    gen = torch.isfinite(ro)
    return dataclasses.replace(batch, rollout_logprobs=torch.where(gen, batch.old_logprobs, ro),
                               loss_mask=batch.loss_mask * gen.to(batch.loss_mask.dtype))


class _Bench:
    """Runs the step's updates on variants of its batch, each from the same starting state."""

    def __init__(self, backend, cfg, rec, step: int) -> None:
        self.backend, self.cfg, self.rec, self.step = backend, cfg, rec, step
        self.start = backend.state_dict()

    def run(self, label: str, batch, cfg=None) -> dict[str, Any]:
        from axrl.assembly.build import policy_loss
        from axrl.assembly.settings import routing_replay, step_settings
        from axrl.runtime.updates import run_updates

        cfg = cfg or self.cfg
        self.backend.load_state_dict(self.start)
        grads = _FirstGradient(self.backend)
        results = run_updates(self.backend, batch, self.rec.splits[:1], policy_loss(cfg), r3=routing_replay(cfg),
                              lr_scale=step_settings(cfg).lr_scale_at(self.step), hooks=grads)
        return {"label": label, "loss": float(results[0].metrics.loss), "delta": grads.grad}

    def variant(self, name: str, ctx: Context) -> dict[str, Any]:
        b = self.rec.batch
        if name == "mask_untrained":
            gen = torch.isfinite(b.rollout_logprobs)
            return self.run(name, dataclasses.replace(b, loss_mask=b.loss_mask * gen.to(b.loss_mask.dtype)))
        if name == "tis_mask":
            d = (b.old_logprobs - b.rollout_logprobs).abs()
            keep = ~(torch.isfinite(d) & (d > ctx.envelope.max_abs))
            return self.run(name, dataclasses.replace(b, loss_mask=b.loss_mask * keep.to(b.loss_mask.dtype)))
        if name.startswith("tis_cap="):
            cfg = self.cfg.model_copy(deep=True)
            cfg.algo.tis_cap = float(name.split("=", 1)[1])
            return self.run(name, b, cfg)
        if name == "r3":
            from axrl.assembly.settings import routing_replay
            cfg = self.cfg.model_copy(deep=True)
            cfg.r3 = True
            if b.routed_experts is None:
                raise ValueError("no recorded routing")
            old = self.backend.forward(dataclasses.replace(b, old_logprobs=None), r3=routing_replay(cfg))
            return self.run(name, dataclasses.replace(b, old_logprobs=old.logprobs), cfg)
        raise ValueError(name)


class _FirstGradient:
    """UpdateHooks that keeps the first update's gradient (all parameters, flattened, float64)."""

    def __init__(self, backend) -> None:
        self.backend, self.grad = backend, None

    def before_update(self, index, batch) -> None:
        pass

    def before_optimizer_step(self, index) -> None:
        if self.grad is None:
            ps = [p for p in self.backend.model.parameters() if p.grad is not None]
            self.grad = torch.cat([p.grad.detach().flatten().double() for p in ps])

    def after_update(self, index, result) -> None:
        pass


def _compare(name: str, v: dict[str, Any], ref: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    def err(x):
        n = float(ref["delta"].norm())
        return float((x["delta"] - ref["delta"]).norm()) / n if n > 0 else math.nan

    def cos(x):
        n = float(x["delta"].norm() * ref["delta"].norm())
        return float(x["delta"] @ ref["delta"]) / n if n > 0 else math.nan

    row = {"mitigation": name, "measured": True, "loss": v["loss"], "reference_loss": ref["loss"],
           "loss_error": abs(v["loss"] - ref["loss"]), "baseline_loss_error": abs(base["loss"] - ref["loss"]),
           "grad_rel_error": err(v), "baseline_grad_rel_error": err(base),
           "grad_cosine": cos(v), "baseline_grad_cosine": cos(base)}
    row["recommended"] = bool(row["grad_rel_error"] < row["baseline_grad_rel_error"])
    return row
