"""Decoupled PPO (AReaL) — the objective of asynchronous runs. The behaviour policy μ is the rollout
engine (`rollout_logprob`), the proximal policy π_prox the trainer's recompute before the update
(`old_logprob`); the PPO ratio is taken around π_prox and the behaviour weight w = π_prox/μ, a plain
importance weight (uncapped unless `algo.behaviour_weight_cap`), multiplies each token's clipped
surrogate:

    ℓ = −1/M Σ_t  w_t · min(r_t Â_t, clip(r_t, 1−ε_low, 1+ε_high) Â_t),   r_t = π_θ/π_prox,  w_t = π_prox/μ

The references below are that formula written out in float64, independently of the loss's code
(no correction registry, no cap unless the case asks for one); value and gradient are compared."""

from __future__ import annotations

import pytest
import torch

from axrl.assembly.build import policy_loss
from axrl.assembly.settings import loss_config
from axrl.config import ConfigError, load_config
from axrl.train.protocol import LossContext, PackedBatch

EPS_LOW, EPS_HIGH = 0.2, 0.28


def decoupled_ppo_reference(lp, prox, behav, adv, mask, cap=None, dual_clip=None):
    """−mean over loss tokens of w · min(r·A, clip(r)·A) (dual clip: max with c·A for A < 0), float64."""
    lp, prox, behav, adv, mask = (x.double() for x in (lp, prox, behav, adv, mask))
    r = torch.exp(lp - prox)
    surrogate = torch.minimum(r * adv, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)
    w = torch.exp(prox - behav)
    if cap is not None:
        w = torch.minimum(w, torch.full_like(w, cap))
    return -(w * surrogate * mask).sum() / mask.sum()


def _inputs(seed: int = 0, T: int = 400):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    behav = prox + torch.randn(T, generator=g, dtype=torch.float64) * 0.7   # stale + engine: far from 1
    lp0 = prox + torch.randn(T, generator=g, dtype=torch.float64) * 0.3     # some ratios outside the band
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    mask = (torch.rand(T, generator=g) < 0.8).double()
    mask[0] = 0
    return lp0, prox, behav, adv, mask


def _run(overrides: list[str], lp0, prox, behav, adv, mask):
    T = lp0.numel()
    batch = PackedBatch(input_ids=torch.zeros(T, dtype=torch.int64), offsets=torch.tensor([0, T]), loss_mask=mask,
                        advantages=adv, old_logprobs=prox, rollout_logprobs=behav)
    cfg = load_config(None, [f"algo.clip_low={EPS_LOW}", f"algo.clip_high={EPS_HIGH}", "algo.loss_agg=token-mean",
                             *overrides])
    ctx = LossContext(num_loss_tokens=int(mask.sum()), num_samples=1, num_loss_samples=1)
    lp = lp0.clone().requires_grad_()
    loss, metrics = policy_loss(cfg)(lp, torch.zeros(T, dtype=torch.float64), batch, ctx)
    loss.backward()
    return loss, lp.grad, metrics


def _check(overrides: list[str], cap=None, dual_clip=None, seed: int = 0):
    lp0, prox, behav, adv, mask = _inputs(seed)
    loss, grad, metrics = _run(overrides, lp0, prox, behav, adv, mask)
    lp_ref = lp0.clone().requires_grad_()
    want = decoupled_ppo_reference(lp_ref, prox, behav, adv, mask, cap=cap, dual_clip=dual_clip)
    want.backward()
    assert torch.allclose(loss.double(), want, rtol=1e-10, atol=1e-12)
    assert torch.allclose(grad.double(), lp_ref.grad, rtol=1e-9, atol=1e-12)
    return prox, behav, lp0, mask, metrics


def test_async_objective_is_decoupled_ppo_with_an_uncapped_behaviour_weight():
    prox, behav, lp0, mask, metrics = _check(["runtime.mode=async"])
    # The weights matter: behaviour weights far above the old cap (2) and ratios outside the band.
    w = torch.exp(prox - behav)[mask > 0]
    r = torch.exp(lp0 - prox)[mask > 0]
    assert float(w.max()) > 4.0 and bool(((r < 1 - EPS_LOW) | (r > 1 + EPS_HIGH)).any())
    assert metrics["rule_tis_truncated_frac"] == 0.0   # nothing truncated
    # and the old capped objective is measurably different on this input
    old_capped = decoupled_ppo_reference(lp0, prox, behav, _inputs()[3], mask, cap=2.0)
    assert abs(float(old_capped) - metrics["loss"]) > 1e-3


def test_async_behaviour_weight_cap_truncates_when_asked():
    _, _, _, _, metrics = _check(["runtime.mode=async", "algo.behaviour_weight_cap=1.5"], cap=1.5)
    assert metrics["rule_tis_truncated_frac"] > 0


def test_async_decoupled_ppo_with_dual_clip():
    _check(["runtime.mode=async", "algo.dual_clip=3.0"], dual_clip=3.0, seed=1)


def test_decoupled_true_in_a_sync_run_is_the_same_objective():
    _check(["algo.decoupled=true"])


def test_sync_runs_keep_token_tis_at_cap_2_by_default():
    """π_prox = μ up to engine/trainer mismatch in a synchronous run: the default loss (and so the
    quickstart's bits) is unchanged — the same formula with the weight truncated at tis_cap = 2."""
    _check([], cap=2.0)
    assert loss_config(load_config(None)).decoupled is None


def test_async_runs_never_drop_the_behaviour_weight_silently():
    for off in (["algo.tis=false"], ["algo.correction.tis=null"]):
        with pytest.raises(ConfigError, match="would drop the behaviour weight.*algo.decoupled: false"):
            load_config(None, ["runtime.mode=async", *off])
    with pytest.raises(ConfigError, match=r"algo.tis_cap \(1.5\).*algo.behaviour_weight_cap: 1.5"):
        load_config(None, ["runtime.mode=async", "algo.tis_cap=1.5"])
    with pytest.raises(ConfigError, match="behaviour_weight_cap caps the behaviour weight of decoupled PPO"):
        load_config(None, ["algo.behaviour_weight_cap=2"])   # a sync run: the cap would do nothing
    with pytest.raises(ConfigError, match="keep one"):
        load_config(None, ["runtime.mode=async", "algo.behaviour_weight_cap=2", "algo.correction.tis={cap: 3}"])
    # the explicit opt-out: plain PPO around π_prox, no behaviour weight
    lp0, prox, behav, adv, mask = _inputs()
    loss, _, metrics = _run(["runtime.mode=async", "algo.decoupled=false", "algo.tis=false"], lp0, prox, behav, adv,
                            mask)
    r = torch.exp(lp0 - prox)
    want = -(torch.minimum(r * adv, torch.clamp(r, 1 - EPS_LOW, 1 + EPS_HIGH) * adv) * mask).sum() / mask.sum()
    assert torch.allclose(loss.double(), want, rtol=1e-10)
    assert "is_weight_mean" not in metrics


def test_an_explicit_tis_correction_is_the_behaviour_weight_of_an_async_run():
    lp0, prox, behav, adv, mask = _inputs()
    loss, _, _ = _run(["runtime.mode=async", "algo.correction.tis={level: token, cap: 3.0}"], lp0, prox, behav, adv,
                      mask)
    assert torch.allclose(loss.double(), decoupled_ppo_reference(lp0, prox, behav, adv, mask, cap=3.0), rtol=1e-10)


def test_an_overflowing_behaviour_weight_is_guarded_by_the_log_ratio_clamp():
    """Uncapped, w = exp(old − rollout) would overflow to inf for a broken engine logprob and make the
    whole update non-finite; its log is clamped at log_ratio_clamp (20), as the PPO ratio's is."""
    lp0, prox, behav, adv, mask = _inputs()
    behav = behav.clone()
    behav[5:9] = prox[5:9] - 100.0                    # w = e^100: inf in float32
    mask[5:9] = 1
    loss, grad, metrics = _run(["runtime.mode=async"], lp0.float(), prox.float(), behav.float(), adv.float(),
                               mask.float())
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    guarded = prox + torch.clamp(behav - prox, min=-20.0)   # w = min(π_prox/μ, e^20)
    want = decoupled_ppo_reference(lp0, prox, guarded, adv, mask)
    assert torch.allclose(loss.double(), want, rtol=1e-5)
    assert metrics["rule_ratio_clamp_frac"] == pytest.approx(4 / float(mask.sum()), rel=1e-6)


def test_recorded_async_config_round_trips_to_the_same_loss():
    """config.yaml holds every key (decoupled: null, behaviour_weight_cap: null): a resumed or replayed
    asynchronous run resolves to the same uncapped objective."""
    from axrl.config import Config, config_to_dict

    cfg = load_config("examples/quickstart_async.yaml")
    again = Config.model_validate(config_to_dict(cfg))
    assert loss_config(again) == loss_config(cfg)
    assert [p.cap for _, p in loss_config(again).corrections()] == [None]
