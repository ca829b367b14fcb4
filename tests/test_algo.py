"""Tests of axrl.algo: each formula against an independent reference written with plain Python
loops / numpy over tokens, plus the LossFn contract (micro-batch invariance, NaN safety)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from axrl.algo import (
    PolicyLossConfig,
    aggregate_loss,
    compute_advantages,
    group_normalized_advantages,
    kl_penalty,
    make_policy_loss,
    reduce_microbatch_metrics,
    reinforce_advantages,
    segment_sum,
    token_advantages,
)
from axrl.train.metrics import TOKEN_COLUMN_PREFIX
from axrl.train.protocol import LossContext, PackedBatch

torch.set_num_threads(1)
NAN = float("nan")


# --------------------------------------------------------------------------- reference formulas


def ref_grpo(rewards: list[float], groups: list, normalize_std: bool, eps: float = 1e-6,
             ddof: int = 0) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        if len(members) == 1:
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        if normalize_std:
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - ddof))
            out.append((r - mean) / (std + eps))
        else:
            out.append(r - mean)
    return out


def ref_kl(lp: float, ref: float, est: str) -> float:
    r = ref - lp  # log pi_ref / pi
    if est == "k1":
        return -r
    if est == "k2":
        return r * r / 2
    return math.exp(r) - 1 - r


def ref_dkl(lp: float, ref: float, est: str) -> float:
    if est == "k1":
        return 1.0
    if est == "k2":
        return lp - ref
    return 1.0 - math.exp(ref - lp)


def ref_token(lp, old, A, roll, ref, ent, cfg: PolicyLossConfig) -> tuple[float, float, dict]:
    """(per-token loss, d loss/d lp, flags) for one loss token, by hand."""
    ratio = math.exp(lp - old)
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    pg1 = -A * ratio
    pg2 = -A * min(max(ratio, lo), hi)
    clipped = pg2 > pg1
    pg = pg2 if clipped else pg1
    dpg = 0.0 if clipped else -A * ratio
    dual = False
    if cfg.dual_clip is not None and A < 0 and pg > -cfg.dual_clip * A:
        pg, dpg, dual = -cfg.dual_clip * A, 0.0, True
    w = 1.0
    capped = False
    if roll is not None and not math.isnan(roll):
        raw = math.exp(old - roll)
        capped = raw > cfg.tis_cap
        w = min(raw, cfg.tis_cap)
    if cfg.tis_short_form():
        pg, dpg = pg * w, dpg * w
    loss, grad = pg, dpg
    if cfg.kl_coef > 0:
        loss += cfg.kl_coef * ref_kl(lp, ref, cfg.kl_estimator)
        grad += cfg.kl_coef * ref_dkl(lp, ref, cfg.kl_estimator)
    loss -= cfg.entropy_coef * ent
    return loss, grad, {"clipped": clipped, "dual": dual, "w": w, "capped": capped,
                        "ratio": ratio, "pg": pg}


def ref_aggregate(tok_losses: list[float], mask: list[float], offsets: list[int], mode: str,
                  M: int, S: int, norm_len: float | None = None) -> float:
    if mode == "token-mean":
        return sum(l for l, m in zip(tok_losses, mask) if m) / M
    total = 0.0
    for i in range(len(offsets) - 1):
        s, e = offsets[i], offsets[i + 1]
        vals = [tok_losses[t] for t in range(s, e) if mask[t]]
        if not vals:
            continue
        if mode == "seq-mean-token-mean":
            total += sum(vals) / len(vals)
        else:
            total += sum(vals)
    if mode == "seq-mean-token-sum-norm":
        return total / (S * norm_len)
    return total / S


# --------------------------------------------------------------------------- helpers


def loss_inputs(lengths: list[int], seed: int = 0, dtype=torch.float64, empty_sample: int | None = None,
                spread: float = 0.4) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
    """A loss's inputs (batch, trainer logprobs, entropy): a random packed batch with prompt-like
    first tokens masked and NaN rollout logprobs off the mask (not `backend_util.make_batch`, a
    backend's input)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    offsets = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int64)
    mask = torch.zeros(T, dtype=torch.float32)
    adv = torch.zeros(T, dtype=dtype)
    for i, (s, e) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        prompt = 1 + int(torch.randint(0, max(1, (e - s) // 2), (1,), generator=g))
        if i != empty_sample:
            mask[s + prompt:e] = 1
        adv[s:e] = float(torch.randn(1, generator=g, dtype=torch.float64))
    m = mask > 0
    adv = torch.where(m, adv, torch.zeros_like(adv))
    old = -torch.rand(T, generator=g, dtype=dtype) * 3 - 0.05
    lp = old + torch.randn(T, generator=g, dtype=dtype) * spread
    lp = torch.where(m, lp, torch.full_like(lp, -float("inf")))  # junk at prompt tokens
    rollout = torch.where(m, old + torch.randn(T, generator=g, dtype=dtype) * 0.5,
                          torch.full_like(old, NAN))
    ref = torch.where(m, old + torch.randn(T, generator=g, dtype=dtype) * 0.3,
                      torch.full_like(old, NAN))
    old = torch.where(m, old, torch.full_like(old, NAN))
    ent = torch.rand(T, generator=g, dtype=dtype) * 2
    batch = PackedBatch(input_ids=torch.arange(T), offsets=offsets, loss_mask=mask,
                        advantages=adv, old_logprobs=old, rollout_logprobs=rollout,
                        ref_logprobs=ref)
    return batch, lp, ent


def ctx_for(batch: PackedBatch) -> LossContext:
    n_i = segment_sum(batch.loss_mask, batch.offsets)
    return LossContext(num_loss_tokens=int(batch.loss_mask.sum()), num_samples=batch.num_samples,
                       num_loss_samples=int((n_i > 0).sum()))


def reference_loss(batch: PackedBatch, lp: torch.Tensor, ent: torch.Tensor, cfg: PolicyLossConfig,
                   ctx: LossContext) -> tuple[float, list[float], list[dict]]:
    """Full reference: loss, d loss / d lp per token (chain rule through the aggregation)."""
    T = batch.num_tokens
    mask = batch.loss_mask.tolist()
    offsets = batch.offsets.tolist()
    toks, dtok, flags = [0.0] * T, [0.0] * T, [dict() for _ in range(T)]
    for t in range(T):
        if not mask[t]:
            continue
        old = float(batch.old_logprobs[t]) if batch.old_logprobs is not None else float(lp[t])
        roll = float(batch.rollout_logprobs[t]) if batch.rollout_logprobs is not None else None
        ref = float(batch.ref_logprobs[t]) if batch.ref_logprobs is not None else 0.0
        toks[t], dtok[t], flags[t] = ref_token(float(lp[t]), old, float(batch.advantages[t]), roll,
                                               ref, float(ent[t]), cfg)
    loss = ref_aggregate(toks, mask, offsets, cfg.loss_agg, ctx.num_loss_tokens,
                         ctx.num_loss_samples, cfg.agg_norm_len)
    # d aggregate / d token loss
    scale = [0.0] * T
    for i in range(len(offsets) - 1):
        s, e = offsets[i], offsets[i + 1]
        n = sum(mask[s:e])
        for t in range(s, e):
            if not mask[t]:
                continue
            if cfg.loss_agg == "token-mean":
                scale[t] = 1 / ctx.num_loss_tokens
            elif cfg.loss_agg == "seq-mean-token-mean":
                scale[t] = 1 / (n * ctx.num_loss_samples)
            elif cfg.loss_agg == "seq-mean-token-sum":
                scale[t] = 1 / ctx.num_loss_samples
            else:
                scale[t] = 1 / (ctx.num_loss_samples * cfg.agg_norm_len)
    grads = [d * s for d, s in zip(dtok, scale)]
    return loss, grads, flags


# --------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("unbiased", [False, True])
def test_grpo_matches_reference(normalize_std: bool, unbiased: bool) -> None:
    rng = np.random.default_rng(0)
    groups = [7, 3, 7, 3, 9, 7, 3, 7, 42, 9]   # non-contiguous, unsorted labels; 42 is a singleton
    rewards = rng.normal(size=len(groups)).tolist()
    got = group_normalized_advantages(torch.tensor(rewards, dtype=torch.float64),
                                      torch.tensor(groups), normalize_std=normalize_std,
                                      unbiased=unbiased)
    want = ref_grpo(rewards, groups, normalize_std, ddof=1 if unbiased else 0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    assert got[8] == 0.0


def test_grpo_population_std_default_and_numpy() -> None:
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv = group_normalized_advantages(rewards, np.zeros(6, dtype=np.int64), eps=0.0)
    np.testing.assert_allclose(adv.numpy(), (rewards - rewards.mean()) / rewards.std(ddof=0))


def test_grpo_singletons_and_constant_groups_are_zero() -> None:
    adv = group_normalized_advantages([1.0, 5.0, 2.0, 2.0, 2.0], ["a", "b", "c", "c", "c"])
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0]
    adv = group_normalized_advantages([3.0], [0], normalize_std=True, unbiased=True)
    assert adv.tolist() == [0.0]
    assert compute_advantages([1.0, 0.0], [0, 1], estimator="dr_grpo").tolist() == [0.0, 0.0]


def test_grpo_string_labels_and_dtype() -> None:
    adv = group_normalized_advantages([1, 0, 1, 1], ["p", "q", "p", "q"], normalize_std=False)
    assert adv.dtype == torch.float32
    assert adv.tolist() == [0.0, -0.5, 0.0, 0.5]


def test_reinforce_and_compute_advantages() -> None:
    r = [1.0, 2.0, 6.0]
    assert reinforce_advantages(r).tolist() == [-2.0, -1.0, 3.0]
    assert compute_advantages(r, estimator="reinforce").tolist() == [-2.0, -1.0, 3.0]
    g = compute_advantages(r, [0, 0, 1], estimator="grpo")
    np.testing.assert_allclose(g.numpy(), ref_grpo(r, [0, 0, 1], True), rtol=1e-6)
    with pytest.raises(ValueError):
        compute_advantages(r, None, estimator="grpo")
    with pytest.raises(ValueError):
        compute_advantages(r, [0, 0, 1], estimator="ppo")  # type: ignore[arg-type]


def test_token_advantages_broadcast() -> None:
    offsets = torch.tensor([0, 3, 5, 9])
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.float32)
    got = token_advantages(torch.tensor([0.5, NAN, -2.0]), offsets, mask)
    # the NaN advantage of sample 1 lands on its loss token only; masked tokens stay exactly 0
    want = [0, 0.5, 0.5, 0, NAN, 0, 0, -2.0, -2.0]
    np.testing.assert_array_equal(got.numpy(), np.array(want, dtype=np.float32))
    with pytest.raises(ValueError):
        token_advantages(torch.tensor([1.0, 2.0]), offsets, mask)


# --------------------------------------------------------------------------- KL


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimator_values(est: str) -> None:
    lp = torch.tensor([-0.1, -2.0, -0.7, -5.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([-0.3, -1.0, -0.7, -0.5, -4.0], dtype=torch.float64)
    got = kl_penalty(lp, ref, est)  # type: ignore[arg-type]
    want = [ref_kl(a, b, est) for a, b in zip(lp.tolist(), ref.tolist())]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


def test_k3_nonnegative_and_exact_near_zero() -> None:
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(10_000, generator=g) * 3
    ref = torch.randn(10_000, generator=g) * 3
    assert bool((kl_penalty(lp, ref, "k3") >= 0).all())
    assert bool((kl_penalty(lp, ref, "k2") >= 0).all())
    # r ≈ 1e-6 in float32: k3 ≈ r²/2 ≈ 5e-13; a float32 exp(r) − 1 − r cancels to garbage
    ref32 = torch.tensor([1e-6], dtype=torch.float32)
    tiny = kl_penalty(torch.tensor([0.0]), ref32, "k3")
    r = float(ref32)
    assert tiny.dtype == torch.float32
    assert float(tiny) == pytest.approx(r * r / 2 + r ** 3 / 6, rel=1e-6)


def test_kl_direction_is_policy_to_ref() -> None:
    """E_{x∼π}[k1] = E_{x∼π}[k3] = KL(π ‖ π_ref) exactly (expectation as a weighted sum)."""
    pi = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    pref = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2], dtype=torch.float64)
    kl_fwd = float((pi * (pi.log() - pref.log())).sum())    # KL(π‖π_ref)
    kl_rev = float((pref * (pref.log() - pi.log())).sum())  # KL(π_ref‖π)
    assert abs(kl_fwd - kl_rev) > 0.05  # the test distinguishes the two directions
    for est in ("k1", "k3"):
        expect = float((pi * kl_penalty(pi.log(), pref.log(), est)).sum())
        assert expect == pytest.approx(kl_fwd, rel=1e-12)


def test_kl_clamp_and_unknown() -> None:
    out = kl_penalty(torch.tensor([-200.0]), torch.tensor([0.0]), "k3", log_ratio_clamp=20.0)
    assert float(out) == pytest.approx(math.exp(20) - 21, rel=1e-6)
    with pytest.raises(ValueError):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- PPO branches


def branch_batch() -> tuple[PackedBatch, torch.Tensor, dict[str, int]]:
    """One loss token per PPO branch (float64), after a masked first position."""
    old = -1.0
    cases = {  # name: (ratio, advantage)
        "inside_pos": (1.1, 2.0),        # in band, A > 0: unclipped
        "above_pos": (1.5, 2.0),         # ρ > 1 + 0.28, A > 0: clipped
        "below_pos": (0.5, 2.0),         # ρ < 1 − 0.2, A > 0: NOT clipped (pessimistic min)
        "below_neg": (0.5, -1.5),        # ρ < 1 − 0.2, A < 0: clipped
        "above_neg": (1.5, -1.5),        # ρ > 1 + ε, A < 0: unclipped (below dual bound 3)
        "dual_neg": (5.0, -1.5),         # ρ ≫ 1, A < 0: dual clip at c = 3
        "inside_neg": (0.9, -1.0),       # in band, A < 0
        "zero_adv": (1.7, 0.0),
    }
    names = list(cases)
    T = len(names) + 1
    lp = torch.zeros(T, dtype=torch.float64)
    adv = torch.zeros(T, dtype=torch.float64)
    for k, name in enumerate(names, start=1):
        ratio, a = cases[name]
        lp[k] = old + math.log(ratio)
        adv[k] = a
    mask = torch.ones(T, dtype=torch.float32)
    mask[0] = 0
    batch = PackedBatch(input_ids=torch.arange(T), offsets=torch.tensor([0, T]), loss_mask=mask,
                        advantages=adv, old_logprobs=torch.full((T,), old, dtype=torch.float64))
    return batch, lp, {n: k for k, n in enumerate(names, start=1)}


def test_ppo_branches_values_gradients_clipfrac() -> None:
    batch, lp0, idx = branch_batch()
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis=False)
    ctx = ctx_for(batch)
    lp = lp0.clone().requires_grad_(True)
    ent = torch.zeros_like(lp)
    loss, metrics = make_policy_loss(cfg)(lp, ent, batch, ctx)
    loss.backward()
    M = ctx.num_loss_tokens
    # hand-written expected per-token loss and gradient (d/d lp = d/dρ · ρ)
    want = {
        "inside_pos": (-2.0 * 1.1, -2.0 * 1.1),
        "above_pos": (-2.0 * 1.28, 0.0),
        "below_pos": (-2.0 * 0.5, -2.0 * 0.5),
        "below_neg": (1.5 * 0.8, 0.0),
        "above_neg": (1.5 * 1.5, 1.5 * 1.5),
        "dual_neg": (1.5 * 3.0, 0.0),
        "inside_neg": (1.0 * 0.9, 1.0 * 0.9),
        "zero_adv": (0.0, 0.0),
    }
    assert loss.item() == pytest.approx(sum(v[0] for v in want.values()) / M, rel=1e-12)
    for name, (_, g) in want.items():
        assert float(lp.grad[idx[name]]) == pytest.approx(g / M, abs=1e-12), name
    assert float(lp.grad[0]) == 0.0
    assert metrics["clipfrac"] == pytest.approx(2 / M)       # above_pos, below_neg
    assert metrics["clipfrac_high"] == pytest.approx(1 / M)
    assert metrics["clipfrac_low"] == pytest.approx(1 / M)
    assert metrics["dual_clipfrac"] == pytest.approx(1 / M)
    assert metrics["ratio_max"] == pytest.approx(5.0)
    assert metrics["ratio_min"] == pytest.approx(0.5)
    ratios = [1.1, 1.5, 0.5, 0.5, 1.5, 5.0, 0.9, 1.7]
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / M)
    assert metrics["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / M)
    assert metrics["num_loss_tokens"] == M

    # without dual clip the bad-action token is unbounded: loss 1.5·5, gradient 1.5·5
    lp2 = lp0.clone().requires_grad_(True)
    loss2, m2 = make_policy_loss(PolicyLossConfig(dual_clip=None, tis=False))(lp2, ent, batch, ctx)
    loss2.backward()
    assert float(lp2.grad[idx["dual_neg"]]) == pytest.approx(1.5 * 5.0 / M)
    assert m2["dual_clipfrac"] == 0.0
    assert (loss2 - loss).item() == pytest.approx(1.5 * (5.0 - 3.0) / M)


def test_symmetric_clip_band() -> None:
    batch, lp0, idx = branch_batch()
    # 0.15 keeps every hand-picked ratio off the band edges (an edge is a rounding coin-flip)
    cfg = PolicyLossConfig(clip_low=0.15, clip_high=0.15, tis=False)
    lp = lp0.clone().requires_grad_(True)
    loss, metrics = make_policy_loss(cfg)(lp, torch.zeros_like(lp), batch, ctx_for(batch))
    want, _, flags = reference_loss(batch, lp0, torch.zeros_like(lp0), cfg, ctx_for(batch))
    assert loss.item() == pytest.approx(want, rel=1e-12)
    n_clip = sum(1 for f in flags if f.get("clipped"))
    assert n_clip == 2  # above_pos (1.5 > 1.15, A > 0) and below_neg (0.5 < 0.85, A < 0)
    assert metrics["clipfrac"] == pytest.approx(n_clip / ctx_for(batch).num_loss_tokens)


def test_on_policy_without_old_logprobs_is_reinforce() -> None:
    batch, lp0, _ = loss_inputs([5, 7, 4], seed=3)
    batch.old_logprobs = None
    batch.rollout_logprobs = None
    batch.ref_logprobs = None
    ctx = ctx_for(batch)
    lp = lp0.clone().requires_grad_(True)
    loss, metrics = make_policy_loss(PolicyLossConfig(tis=False))(lp, torch.zeros_like(lp), batch, ctx)
    loss.backward()
    m = batch.loss_mask > 0
    expected_grad = torch.where(m, -batch.advantages / ctx.num_loss_tokens, torch.zeros_like(lp0))
    torch.testing.assert_close(lp.grad, expected_grad, rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(float(-batch.advantages[m].sum()) / ctx.num_loss_tokens)
    assert metrics["clipfrac"] == 0.0 and metrics["ratio_max"] == 1.0
    assert "tis_weight_mean" not in metrics and "kl" not in metrics


# --------------------------------------------------------------------------- TIS


def test_tis_weights_and_cap() -> None:
    T = 6
    old = torch.full((T,), -1.0, dtype=torch.float64)
    # old − rollout: masked, 0.5, −1, ln 2 + 0.3 (capped at 2), 3 (capped), NaN (missing)
    rollout = torch.tensor([NAN, -1.5, 0.0, -1.0 - math.log(2) - 0.3, -4.0, NAN], dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.float32)
    adv = torch.tensor([0.0, 1.0, -2.0, 0.5, 1.0, 1.0], dtype=torch.float64)
    batch = PackedBatch(input_ids=torch.arange(T), offsets=torch.tensor([0, T]), loss_mask=mask,
                        advantages=adv, old_logprobs=old, rollout_logprobs=rollout)
    lp0 = old.clone()  # ρ = 1: the surrogate is −A, gradient −A·w
    ctx = ctx_for(batch)
    cfg = PolicyLossConfig(tis=True, tis_cap=2.0)
    lp = lp0.clone().requires_grad_(True)
    loss, metrics = make_policy_loss(cfg)(lp, torch.zeros_like(lp), batch, ctx)
    loss.backward()
    w = [math.exp(0.5), math.exp(-1.0), 2.0, 2.0, 1.0]   # per loss token, by hand
    A = [1.0, -2.0, 0.5, 1.0, 1.0]
    M = 5
    assert loss.item() == pytest.approx(sum(-a * x for a, x in zip(A, w)) / M, rel=1e-12)
    torch.testing.assert_close(lp.grad[1:], torch.tensor([-a * x / M for a, x in zip(A, w)],
                                                         dtype=torch.float64))
    assert metrics["tis_weight_mean"] == pytest.approx(sum(w) / M)
    assert metrics["tis_capped_frac"] == pytest.approx(2 / M)
    assert metrics["tis_missing_frac"] == pytest.approx(1 / M)
    assert torch.isfinite(lp.grad).all()

    # tis=False: the same diagnostics, but the loss is uncorrected
    loss_off, m_off = make_policy_loss(PolicyLossConfig(tis=False))(lp0, torch.zeros_like(lp0), batch, ctx)
    assert loss_off.item() == pytest.approx(-sum(A) / M)
    assert m_off["tis_weight_mean"] == pytest.approx(metrics["tis_weight_mean"])

    with pytest.raises(ValueError):
        batch.rollout_logprobs = None
        make_policy_loss(cfg)(lp0, torch.zeros_like(lp0), batch, ctx)


# --------------------------------------------------------------------------- full loss vs reference

FULL_CFGS = [
    PolicyLossConfig(tis=False),
    PolicyLossConfig(clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-mean", tis=False),
    PolicyLossConfig(dual_clip=3.0, tis=True, tis_cap=1.5, kl_coef=0.05, kl_estimator="k3",
                     entropy_coef=0.01),
    PolicyLossConfig(kl_coef=0.1, kl_estimator="k1", loss_agg="seq-mean-token-sum", tis=False),
    PolicyLossConfig(kl_coef=0.1, kl_estimator="k2", tis=True, entropy_coef=0.02,
                     loss_agg="seq-mean-token-sum-norm", agg_norm_len=16),
]


@pytest.mark.parametrize("cfg", FULL_CFGS, ids=lambda c: f"{c.loss_agg}-kl{c.kl_coef}-tis{c.tis}")
def test_loss_and_gradient_match_reference(cfg: PolicyLossConfig) -> None:
    batch, lp0, ent0 = loss_inputs([6, 9, 3, 12, 5], seed=11, empty_sample=2, spread=0.4)
    ctx = ctx_for(batch)
    lp = lp0.clone().requires_grad_(True)
    ent = ent0.clone().requires_grad_(True)
    loss, metrics = make_policy_loss(cfg)(lp, ent, batch, ctx)
    loss.backward()
    want, want_grad, flags = reference_loss(batch, lp0, ent0, cfg, ctx)
    assert loss.item() == pytest.approx(want, rel=1e-10)
    assert metrics["loss"] == pytest.approx(want, rel=1e-10)
    np.testing.assert_allclose(lp.grad.numpy(), want_grad, rtol=1e-9, atol=1e-14)
    # exercised several branches
    assert 0 < metrics["clipfrac"] < 1
    # entropy gradient: −α · d aggregate / d token
    m = batch.loss_mask > 0
    if cfg.entropy_coef:
        assert bool((ent.grad[m] < 0).all()) and bool((ent.grad[~m] == 0).all())
    # the components add up
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] + metrics["kl_loss"]
                                            + metrics["entropy_loss"], rel=1e-10)
    n_clip = sum(1 for f in flags if f.get("clipped"))
    assert metrics["clipfrac"] == pytest.approx(n_clip / ctx.num_loss_tokens)
    kl_ref = [ref_kl(float(lp0[t]), float(batch.ref_logprobs[t]), cfg.kl_estimator)
              for t in range(batch.num_tokens) if m[t]]
    assert metrics["kl"] == pytest.approx(sum(kl_ref) / ctx.num_loss_tokens, rel=1e-10)
    assert metrics["entropy"] == pytest.approx(float(ent0[m].mean()), rel=1e-10)


def test_token_mean_vs_seq_mean_differ_as_expected() -> None:
    # sample 0 has 1 loss token with loss 4, sample 1 has 3 with loss 0
    tok = torch.tensor([0.0, 4.0, 0.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([0, 1, 0, 1, 1, 1.0])
    offsets = torch.tensor([0, 2, 6])
    ctx = LossContext(num_loss_tokens=4, num_samples=2, num_loss_samples=2)
    assert float(aggregate_loss(tok, mask, offsets, ctx, "token-mean")) == pytest.approx(1.0)
    assert float(aggregate_loss(tok, mask, offsets, ctx, "seq-mean-token-mean")) == pytest.approx(2.0)
    assert float(aggregate_loss(tok, mask, offsets, ctx, "seq-mean-token-sum")) == pytest.approx(2.0)
    assert float(aggregate_loss(tok, mask, offsets, ctx, "seq-mean-token-sum-norm", 8)) == \
        pytest.approx(0.25)
    empty = LossContext(0, 2, 0)
    assert float(aggregate_loss(tok * 0, mask * 0, offsets, empty, "seq-mean-token-mean")) == 0.0


# --------------------------------------------------------------------------- LossFn contract


@pytest.mark.parametrize("cfg", FULL_CFGS, ids=lambda c: f"{c.loss_agg}-kl{c.kl_coef}-tis{c.tis}")
@pytest.mark.parametrize("split", [[[0, 1], [2, 3, 4], [5]], [[5, 3], [0], [4, 2, 1]]])
def test_micro_batch_invariance(cfg: PolicyLossConfig, split: list[list[int]]) -> None:
    batch, lp0, ent0 = loss_inputs([7, 4, 10, 3, 8, 6], seed=5, empty_sample=3, dtype=torch.float64)
    ctx = ctx_for(batch)
    fn = make_policy_loss(cfg)

    lp_full = lp0.clone().requires_grad_(True)
    ent_full = ent0.clone().requires_grad_(True)
    loss_full, m_full = fn(lp_full, ent_full, batch, ctx)
    loss_full.backward()

    lp_leaf = lp0.clone().requires_grad_(True)
    ent_leaf = ent0.clone().requires_grad_(True)
    starts, ends = batch.offsets[:-1], batch.offsets[1:]
    total = 0.0
    rows = []
    for samples in split:
        mb = batch.select(samples)
        idx = torch.cat([torch.arange(int(starts[i]), int(ends[i])) for i in samples])
        loss_mb, m_mb = fn(lp_leaf[idx], ent_leaf[idx], mb, ctx)
        loss_mb.backward()  # gradient accumulation into the same leaves
        total += loss_mb.item()
        rows.append(m_mb)
    assert total == pytest.approx(loss_full.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(lp_leaf.grad, lp_full.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ent_leaf.grad, ent_full.grad, rtol=1e-12, atol=1e-15)
    reduced = reduce_microbatch_metrics(rows)
    scalars = {k: v for k, v in m_full.items() if not k.startswith(TOKEN_COLUMN_PREFIX)}
    assert set(reduced) == set(scalars)
    for key, value in scalars.items():
        assert reduced[key] == pytest.approx(value, rel=1e-10, abs=1e-14), key
    # the per-token columns of the parts are the full batch's, row for row
    order = torch.cat([torch.arange(int(starts[i]), int(ends[i])) for samples in split for i in samples])
    for key in ("tokens/is_weight", "tokens/loss_rule"):
        torch.testing.assert_close(torch.cat([r[key] for r in rows]), m_full[key][order])


def test_float32_micro_batch_invariance() -> None:
    batch, lp0, ent0 = loss_inputs([30, 50, 20, 40], seed=9, dtype=torch.float32)
    cfg = PolicyLossConfig(tis=True, kl_coef=0.01, loss_agg="seq-mean-token-mean")
    ctx = ctx_for(batch)
    fn = make_policy_loss(cfg)
    lp_full = lp0.clone().requires_grad_(True)
    loss_full, _ = fn(lp_full, ent0, batch, ctx)
    loss_full.backward()
    lp_leaf = lp0.clone().requires_grad_(True)
    total = 0.0
    for samples in ([0, 1], [2, 3]):
        mb = batch.select(samples)
        idx = torch.cat([torch.arange(int(batch.offsets[i]), int(batch.offsets[i + 1])) for i in samples])
        loss_mb, _ = fn(lp_leaf[idx], ent0[idx], mb, ctx)
        loss_mb.backward()
        total += loss_mb.item()
    assert loss_full.dtype == torch.float32
    assert total == pytest.approx(loss_full.item(), rel=1e-5)
    torch.testing.assert_close(lp_leaf.grad, lp_full.grad, rtol=1e-5, atol=1e-7)


def test_nan_and_inf_at_masked_positions_give_finite_gradients() -> None:
    batch, lp0, ent0 = loss_inputs([6, 9, 5], seed=2)
    m = batch.loss_mask > 0
    # make sure all the poison is there: NaN rollout/old/ref/advantage and −inf/NaN logprobs
    assert torch.isnan(batch.rollout_logprobs[~m]).all()
    batch.advantages = torch.where(m, batch.advantages, torch.full_like(batch.advantages, NAN))
    lp0 = lp0.clone()
    lp0[~m] = torch.tensor([-float("inf"), NAN] * int((~m).sum()), dtype=lp0.dtype)[: int((~m).sum())]
    ent0 = torch.where(m, ent0, torch.full_like(ent0, NAN))
    cfg = PolicyLossConfig(dual_clip=3.0, tis=True, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01,
                           loss_agg="seq-mean-token-mean")
    lp = lp0.clone().requires_grad_(True)
    ent = ent0.clone().requires_grad_(True)
    loss, metrics = make_policy_loss(cfg)(lp, ent, batch, ctx_for(batch))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all() and torch.isfinite(ent.grad).all()
    assert bool((lp.grad[~m] == 0).all()) and bool((ent.grad[~m] == 0).all())
    assert all(math.isfinite(v) for k, v in metrics.items() if not k.startswith(TOKEN_COLUMN_PREFIX))
    assert metrics["tis_missing_frac"] == 0.0


def test_extreme_log_ratio_is_clamped() -> None:
    T = 3
    batch = PackedBatch(input_ids=torch.arange(T), offsets=torch.tensor([0, T]),
                        loss_mask=torch.tensor([0.0, 1.0, 1.0]),
                        advantages=torch.tensor([0.0, -1.0, 1.0]),
                        old_logprobs=torch.tensor([0.0, -200.0, -1.0]))
    lp = torch.tensor([0.0, -1.0, -1.0], requires_grad=True)  # ρ = e^199 without the clamp
    loss, metrics = make_policy_loss(PolicyLossConfig(tis=False))(lp, torch.zeros(T), batch, ctx_for(batch))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert metrics["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)


def test_validation_errors() -> None:
    for bad in (dict(clip_low=1.5), dict(clip_high=-0.1), dict(dual_clip=1.0), dict(tis_cap=0.0),
                dict(kl_coef=-1.0), dict(kl_estimator="k5"), dict(loss_agg="mean"),
                dict(loss_agg="seq-mean-token-sum-norm"), dict(log_ratio_clamp=0.0)):
        with pytest.raises(ValueError):
            PolicyLossConfig(**bad)  # type: ignore[arg-type]
    batch, lp0, ent0 = loss_inputs([4, 4], seed=0)
    ctx = ctx_for(batch)
    batch.ref_logprobs = None
    with pytest.raises(ValueError):
        make_policy_loss(PolicyLossConfig(kl_coef=0.1, tis=False))(lp0, ent0, batch, ctx)
    batch.advantages = None
    with pytest.raises(ValueError):
        make_policy_loss(PolicyLossConfig(tis=False))(lp0, ent0, batch, ctx)


def test_reduce_microbatch_metrics() -> None:
    rows = [{"loss": 1.0, "ratio_max": 2.0, "ratio_min": 0.5}, {"loss": 0.5, "ratio_max": 3.0,
                                                               "ratio_min": 0.7, "kl": 0.1}]
    assert reduce_microbatch_metrics(rows) == {"loss": 1.5, "ratio_max": 3.0, "ratio_min": 0.5,
                                               "kl": 0.1}
