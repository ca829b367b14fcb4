"""Decoupled PPO (AReaL) — the objective of asynchronous runs — is the run's PPO loss with TIS:
the behaviour policy μ is the rollout engine (`rollout_logprob`), the proximal policy π_prox the
trainer's recompute before the update (`old_logprob`); the PPO ratio is taken around π_prox and
the behaviour→proximal ratio, capped, weights each token:

    ℓ = −1/M Σ_t  min(π_prox/μ, C) · min(r_t Â_t, clip(r_t, 1−ε_low, 1+ε_high) Â_t),   r_t = π_θ/π_prox

Checked here against that formula, written out directly, on random inputs: value and gradient."""

from __future__ import annotations

import torch

from axrl.config import load_config
from axrl.assembly.build import policy_loss
from axrl.train.protocol import LossContext, PackedBatch


def decoupled_ppo_reference(lp, prox, behav, adv, mask, eps_low, eps_high, cap):
    r = torch.exp(lp - prox)
    surrogate = torch.minimum(r * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv)
    w = torch.clamp(torch.exp(prox - behav), max=cap)
    return -(w * surrogate * mask).sum() / mask.sum()


def test_async_objective_is_decoupled_ppo():
    g = torch.Generator().manual_seed(0)
    T = 400
    prox = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    behav = prox + torch.randn(T, generator=g, dtype=torch.float64) * 0.5   # stale + engine: far from 1
    lp0 = prox + torch.randn(T, generator=g, dtype=torch.float64) * 0.3     # some ratios outside the band
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    mask = (torch.rand(T, generator=g) < 0.8).double()
    mask[0] = 0
    batch = PackedBatch(input_ids=torch.zeros(T, dtype=torch.int64), offsets=torch.tensor([0, T]), loss_mask=mask,
                        advantages=adv, old_logprobs=prox, rollout_logprobs=behav)
    cfg = load_config(None, ["runtime.mode=async", "algo.tis=true", "algo.tis_cap=2.0", "algo.clip_low=0.2",
                             "algo.clip_high=0.28", "algo.loss_agg=token-mean"])
    ctx = LossContext(num_loss_tokens=int(mask.sum()), num_samples=1, num_loss_samples=1)

    lp = lp0.clone().requires_grad_()
    loss, _ = policy_loss(cfg)(lp, torch.zeros(T, dtype=torch.float64), batch, ctx)
    loss.backward()
    lp_ref = lp0.clone().requires_grad_()
    want = decoupled_ppo_reference(lp_ref, prox, behav, adv, mask, 0.2, 0.28, 2.0)
    want.backward()
    assert torch.allclose(loss.double(), want, rtol=1e-6, atol=1e-12)
    assert torch.allclose(lp.grad.double(), lp_ref.grad, rtol=1e-5, atol=1e-12)
    # The weights matter: both the cap and the clip band bind on this input.
    w = torch.exp(prox - behav)
    r = torch.exp(lp0 - prox)
    assert bool((w[mask > 0] > 2.0).any()) and bool(((r < 0.8) | (r > 1.28))[mask > 0].any())
