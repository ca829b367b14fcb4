"""The objective and correction registries (`algo.loss`, `algo.correction`): every formula
against a direct reference written here with plain Python loops (values and gradients, random
inputs and hand-picked case rows), GSPO's two forms, the recorded rule bits, and the registry
contract (one file + one registration; config validation names the key)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from axrl.algo import CORRECTIONS, OBJECTIVES, LossRule, PolicyLossConfig, make_policy_loss
from axrl.algo.objectives import objective
from axrl.algo.terms import ObjectiveTerms, flag
from axrl.config import ConfigError, load_config
from axrl.train.protocol import PackedBatch
from tests.test_algo import ctx_for, loss_inputs, ref_aggregate

torch.set_num_threads(1)
NAN = float("nan")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


# --------------------------------------------------------------------------- references (floats, loops)

def samples_of(batch: PackedBatch) -> list[list[int]]:
    """Loss-token indices of each sample."""
    off, m = batch.offsets.tolist(), batch.loss_mask.tolist()
    return [[t for t in range(off[i], off[i + 1]) if m[t]] for i in range(len(off) - 1)]


def agg_weight(batch: PackedBatch, mode: str) -> list[float]:
    """d aggregate / d token loss, by hand."""
    ctx = ctx_for(batch)
    w = [0.0] * batch.num_tokens
    for toks in samples_of(batch):
        for t in toks:
            w[t] = {"token-mean": 1 / ctx.num_loss_tokens, "seq-mean-token-mean": 1 / (len(toks) * ctx.num_loss_samples),
                    "seq-mean-token-sum": 1 / ctx.num_loss_samples}[mode]
    return w


def reinforce_ref(name: str, lp: float, old: float, A: float, lo: float, hi: float, **kw) -> tuple[float, float, int]:
    """(loss, d loss / d lp, rule bits) of one token of a REINFORCE-form objective: −A·sg(w)·lp."""
    r = math.exp(lp - old)
    hard, soft = 0, False
    if name == "grpo2":
        c = kw.get("dual_soft_clip", 3.0)
        if A >= 0 and r > 1:
            w = min(r, 1 + hi)
            hard = LossRule.CLIP_HIGH if r > 1 + hi else 0
        elif A >= 0:
            w = r
        elif r > 1:
            w = min(r, c)
            soft = r > c
        else:
            w = max(r, 1 - lo)
            hard = LossRule.CLIP_LOW if r < 1 - lo else 0
    elif name == "cispo":
        w = min(max(r, 1 - lo), 1 + hi)
        soft = r > 1 + hi or r < 1 - lo
    elif name == "topr":
        rr = kw.get("seq_ratio", r)
        w = 1.0 if A >= 0 else min(max(rr, 0.0), 1.0)
        soft = A < 0 and rr > 1
    else:
        raise AssertionError(name)
    grad = 0.0 if hard else -A * w
    return -A * w * lp, grad, int(hard) | (int(LossRule.SOFT_CLIP) if soft else 0)


def objective_ref(name: str, batch: PackedBatch, lp, lo: float, hi: float, mode: str, **kw):
    """(loss, per-token gradient, per-token rule bits) of a whole batch, by hand."""
    T = batch.num_tokens
    old = [float(x) for x in batch.old_logprobs]
    A = [float(x) for x in batch.advantages]
    lp = [float(x) for x in lp]
    g = agg_weight(batch, mode)
    tok, grad, rules = [0.0] * T, [0.0] * T, [0] * T
    for toks in filter(None, samples_of(batch)):
        if name in ("gspo", "gspo_token"):
            s = math.exp(sum(lp[t] - old[t] for t in toks) / len(toks))
            clipped = {t: (-A[t] * min(max(s, 1 - lo), 1 + hi)) > (-A[t] * s) for t in toks}
            for t in toks:
                tok[t] = -A[t] * (min(max(s, 1 - lo), 1 + hi) if clipped[t] else s)
                rules[t] = (int(LossRule.CLIP_HIGH) if A[t] > 0 else int(LossRule.CLIP_LOW)) if clipped[t] else 0
                if name == "gspo":    # ℓ_t' depends on every lp of the sample through s
                    grad[t] = sum(g[u] * (0.0 if clipped[u] else -A[u] * s / len(toks)) for u in toks)
                else:                 # only on its own lp, with derivative s
                    grad[t] = g[t] * (0.0 if clipped[t] else -A[t] * s)
            continue
        seq = math.exp(sum(lp[t] - old[t] for t in toks))
        for t in toks:
            extra = {"seq_ratio": seq} if kw.get("level") == "sequence" else {}
            args = {k: v for k, v in kw.items() if k == "dual_soft_clip"}
            tok[t], d, rules[t] = reinforce_ref(name, lp[t], old[t], A[t], lo, hi, **args, **extra)
            grad[t] = g[t] * d
    loss = ref_aggregate(tok, batch.loss_mask.tolist(), batch.offsets.tolist(), mode, ctx_for(batch).num_loss_tokens,
                         ctx_for(batch).num_loss_samples)
    return loss, grad, rules


def run_loss(cfg: PolicyLossConfig, batch: PackedBatch, lp0: torch.Tensor):
    lp = lp0.clone().requires_grad_(True)
    loss, metrics = make_policy_loss(cfg)(lp, torch.zeros_like(lp), batch, ctx_for(batch))
    loss.backward()
    return loss, lp.grad, metrics


# --------------------------------------------------------------------------- objectives on random inputs

CASES = [("grpo2", {}), ("grpo2", {"dual_soft_clip": 1.5}), ("cispo", {}), ("topr", {"level": "token"}),
         ("topr", {"level": "sequence"}), ("gspo", {}), ("gspo_token", {})]


@pytest.mark.parametrize("mode", AGGS)
@pytest.mark.parametrize("name,args", CASES, ids=[f"{n}-{a}" for n, a in CASES])
def test_objective_matches_reference(name, args, mode):
    batch, lp0, _ = loss_inputs([6, 9, 3, 12, 5, 8], seed=7, empty_sample=2, spread=0.5)
    lo, hi = (0.2, 0.28) if not name.startswith("gspo") else (0.05, 0.08)
    cfg = PolicyLossConfig(loss=name, loss_args=args, clip_low=lo, clip_high=hi, loss_agg=mode, tis=False)
    loss, grad, metrics = run_loss(cfg, batch, lp0)
    want, want_grad, rules = objective_ref(name, batch, lp0, lo, hi, mode, **args)
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-14)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=grad.dtype), rtol=1e-9, atol=1e-14)
    m = batch.loss_mask > 0
    got_rules = metrics["tokens/loss_rule"] & ~int(LossRule.RATIO_CLAMP)
    assert got_rules[m].tolist() == [rules[t] for t in range(batch.num_tokens) if m[t]]
    assert got_rules[~m].eq(0).all()
    # a random sequence ratio rarely exceeds 1 (topr/sequence's cap): test_topr_case_rows covers it
    assert any(rules) or args.get("level") == "sequence", "the random batch must exercise a clip / cap"


def test_gspo_and_gspo_token_give_the_same_gradient_with_sequence_advantages():
    batch, lp0, _ = loss_inputs([7, 4, 10, 6], seed=3, spread=0.3)
    # one advantage per sequence (the GRPO broadcast)
    adv = torch.zeros_like(batch.advantages)
    for i, s in enumerate(samples_of(batch)):
        adv[s] = [1.3, -0.7, 0.4, -2.0][i]
    batch.advantages = adv
    for mode in AGGS:
        grads = {}
        for name in ("gspo", "gspo_token"):
            loss, grads[name], _ = run_loss(PolicyLossConfig(loss=name, clip_low=0.05, clip_high=0.05, loss_agg=mode, tis=False),
                                            batch, lp0)
        torch.testing.assert_close(grads["gspo"], grads["gspo_token"], rtol=1e-10, atol=1e-15)
        assert grads["gspo"].abs().sum() > 0


# --------------------------------------------------------------------------- case rows by hand

def case_batch(cases: dict[str, tuple[float, float]]) -> tuple[PackedBatch, torch.Tensor, dict[str, int]]:
    """One loss token per (ratio, advantage) case, after a masked first position."""
    old = -1.0
    names = list(cases)
    T = len(names) + 1
    lp = torch.zeros(T, dtype=torch.float64)
    adv = torch.zeros(T, dtype=torch.float64)
    for k, name in enumerate(names, start=1):
        lp[k] = old + math.log(cases[name][0])
        adv[k] = cases[name][1]
    mask = torch.ones(T)
    mask[0] = 0
    batch = PackedBatch(input_ids=torch.arange(T), offsets=torch.tensor([0, T]), loss_mask=mask, advantages=adv,
                        old_logprobs=torch.full((T,), old, dtype=torch.float64))
    return batch, lp, {n: k for k, n in enumerate(names, start=1)}


def test_grpo2_case_rows():
    """Every row of the grpo2 case table, hand-computed: (loss value, gradient) with lp = −1 + log r."""
    cases = {"pos_up_in": (1.2, 2.0), "pos_up_above": (1.5, 2.0), "pos_down": (0.5, 2.0),
             "neg_up_in": (2.0, -1.0), "neg_up_above": (4.0, -1.0), "neg_down_in": (0.9, -1.0),
             "neg_down_below": (0.5, -1.0), "zero_adv_up": (1.5, 0.0)}
    batch, lp0, idx = case_batch(cases)
    loss, grad, metrics = run_loss(PolicyLossConfig(loss="grpo2", clip_low=0.2, clip_high=0.28, tis=False), batch, lp0)
    M = 8
    lp = {n: -1.0 + math.log(r) for n, (r, _) in cases.items()}
    want = {  # name: (w, gradient kept?)
        "pos_up_in": (1.2, True), "pos_up_above": (1.28, False), "pos_down": (0.5, True),
        "neg_up_in": (2.0, True), "neg_up_above": (3.0, True), "neg_down_in": (0.9, True),
        "neg_down_below": (0.8, False), "zero_adv_up": (1.28, False)}
    total = 0.0
    for name, (w, kept) in want.items():
        A = cases[name][1]
        total += -A * w * lp[name]
        assert float(grad[idx[name]]) == pytest.approx((-A * w if kept else 0.0) / M, abs=1e-12), name
    assert loss.item() == pytest.approx(total / M, rel=1e-12)
    rule = {n: int(metrics["tokens/loss_rule"][k]) for n, k in idx.items()}
    assert rule["pos_up_above"] == LossRule.CLIP_HIGH and rule["neg_down_below"] == LossRule.CLIP_LOW
    assert rule["neg_up_above"] == LossRule.SOFT_CLIP and rule["zero_adv_up"] == LossRule.CLIP_HIGH
    assert all(rule[n] == 0 for n in ("pos_up_in", "pos_down", "neg_up_in", "neg_down_in"))
    assert metrics["clipfrac"] == pytest.approx(3 / M) and metrics["rule_soft_clip_frac"] == pytest.approx(1 / M)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_topr_case_rows(level):
    cases = {"pos_up": (1.7, 1.0), "pos_down": (0.4, 1.5), "neg_down": (0.6, -2.0), "neg_up": (1.8, -1.0)}
    batch, lp0, idx = case_batch(cases)
    if level == "sequence":  # one sample per case: the sequence ratio is the token's own
        batch = PackedBatch(input_ids=torch.arange(8), offsets=torch.tensor([0, 2, 4, 6, 8]),
                            loss_mask=torch.tensor([0, 1.0] * 4), advantages=torch.zeros(8, dtype=torch.float64),
                            old_logprobs=torch.full((8,), -1.0, dtype=torch.float64))
        lp = torch.zeros(8, dtype=torch.float64)
        idx = {}
        for k, name in enumerate(cases):
            lp[2 * k + 1] = -1.0 + math.log(cases[name][0])
            batch.advantages[2 * k + 1] = cases[name][1]
            idx[name] = 2 * k + 1
        lp0 = lp
    loss, grad, metrics = run_loss(PolicyLossConfig(loss="topr", loss_args={"level": level}, loss_agg="token-mean", tis=False),
                                   batch, lp0)
    want_w = {"pos_up": 1.0, "pos_down": 1.0, "neg_down": 0.6, "neg_up": 1.0}
    M = 4
    total = 0.0
    for name, w in want_w.items():
        A = cases[name][1]
        total += -A * w * (-1.0 + math.log(cases[name][0]))
        assert float(grad[idx[name]]) == pytest.approx(-A * w / M, abs=1e-12), name
    assert loss.item() == pytest.approx(total / M, rel=1e-12)
    assert int(metrics["tokens/loss_rule"][idx["neg_up"]]) == LossRule.SOFT_CLIP
    assert int(metrics["tokens/loss_rule"][idx["neg_down"]]) == 0


def test_topr_sequence_level_uses_the_product_ratio():
    # two tokens with ratios 0.5 and 1.6: token level caps only the second, sequence level uses 0.8 for both
    batch = PackedBatch(input_ids=torch.arange(3), offsets=torch.tensor([0, 3]), loss_mask=torch.tensor([0, 1.0, 1.0]),
                        advantages=torch.tensor([0.0, -1.0, -1.0], dtype=torch.float64),
                        old_logprobs=torch.full((3,), -1.0, dtype=torch.float64))
    lp0 = torch.tensor([0.0, -1.0 + math.log(0.5), -1.0 + math.log(1.6)], dtype=torch.float64)
    _, g_tok, _ = run_loss(PolicyLossConfig(loss="topr", tis=False), batch, lp0)
    _, g_seq, _ = run_loss(PolicyLossConfig(loss="topr", loss_args={"level": "sequence"}, tis=False), batch, lp0)
    assert g_tok[1:].tolist() == pytest.approx([0.5 / 2, 1.0 / 2])
    assert g_seq[1:].tolist() == pytest.approx([0.8 / 2, 0.8 / 2])


# --------------------------------------------------------------------------- corrections

def correction_ref(name: str, batch: PackedBatch, **p) -> tuple[list[float], list[int]]:
    """(weight, rule bits) per token, by hand."""
    T = batch.num_tokens
    old, roll = batch.old_logprobs.tolist(), batch.rollout_logprobs.tolist()
    w, rules = [1.0] * T, [0] * T
    for toks in samples_of(batch):
        avail = [t for t in toks if not math.isnan(roll[t])]
        d = {t: old[t] - roll[t] for t in avail}
        level = p.get("level", "token")
        for t in toks:
            if t not in d:
                rules[t] |= int(LossRule.NO_ROLLOUT) if name in ("tis", "mis") else 0
                if name == "veto" and any(d[u] < math.log(p["threshold"]) for u in avail):
                    w[t], rules[t] = 0.0, int(LossRule.VETO)
                continue
            lr = {"token": d[t], "sequence": sum(d.values()), "geometric": sum(d.values()) / len(d)}[level]
            x = math.exp(lr)
            if name == "tis":
                w[t] = min(x, p["cap"])
                rules[t] |= int(LossRule.TIS_TRUNCATED) if x > p["cap"] else 0
            elif name == "mis":
                inside = p["lower"] <= x <= p["upper"]
                w[t] = x if inside else 0.0
                rules[t] |= 0 if inside else int(LossRule.MIS_MASKED)
            elif name == "icepop":
                inside = p["low"] <= math.exp(d[t]) <= p["high"]
                w[t] = 1.0 if inside else 0.0
                rules[t] |= 0 if inside else int(LossRule.ICEPOP_MASKED)
            elif name == "veto":
                if any(d[u] < math.log(p["threshold"]) for u in avail):
                    w[t], rules[t] = 0.0, int(LossRule.VETO)
    return w, rules


CORRECTION_CASES = [("tis", {"level": "token", "cap": 1.5}), ("tis", {"level": "sequence", "cap": 2.0}),
                    ("tis", {"level": "geometric", "cap": 1.2}), ("mis", {"level": "token", "lower": 0.7, "upper": 1.4}),
                    ("mis", {"level": "geometric", "lower": 0.8, "upper": 1.25}),
                    ("mis", {"level": "sequence", "lower": 0.3, "upper": 3.0}),
                    ("icepop", {"low": 0.7, "high": 1.5}), ("veto", {"threshold": 0.6})]


@pytest.mark.parametrize("name,params", CORRECTION_CASES, ids=[f"{n}-{p}" for n, p in CORRECTION_CASES])
def test_correction_matches_reference(name, params):
    batch, lp0, _ = loss_inputs([6, 9, 4, 12, 7], seed=13, spread=0.2)
    batch.rollout_logprobs[int(batch.offsets[3]) + 5] = NAN  # a loss token without a rollout logprob
    w, rules = correction_ref(name, batch, **params)
    cfg = PolicyLossConfig(correction={name: params}, tis=False)
    loss, grad, metrics = run_loss(cfg, batch, lp0)
    base_loss, base_grad, _ = run_loss(PolicyLossConfig(tis=False), batch, lp0)  # ppo without corrections
    m = batch.loss_mask > 0
    got_w = metrics["tokens/is_weight"]
    torch.testing.assert_close(got_w[m], torch.tensor(w, dtype=got_w.dtype)[m], rtol=1e-6, atol=0)
    got_rules = metrics["tokens/loss_rule"] & ~int(LossRule.CLIP_HIGH | LossRule.CLIP_LOW | LossRule.RATIO_CLAMP)
    assert got_rules[m].tolist() == [rules[t] for t in range(batch.num_tokens) if m[t]]
    # the weight multiplies the objective's per-token loss: gradient = w · the uncorrected gradient
    torch.testing.assert_close(grad, base_grad * torch.tensor(w, dtype=grad.dtype), rtol=1e-9, atol=1e-15)
    assert 0 < sum(1 for t in range(batch.num_tokens) if m[t] and rules[t]) < int(m.sum()), "exercise both sides"
    assert metrics["is_weight_mean"] == pytest.approx(sum(w[t] for t in range(len(w)) if m[t]) / int(m.sum()), rel=1e-6)


def test_corrections_combine_by_product_and_legacy_tis_is_the_token_correction():
    batch, lp0, _ = loss_inputs([8, 10, 6], seed=21, spread=0.2)
    combo = {"tis": {"cap": 1.3}, "icepop": {"low": 0.8, "high": 1.25}}
    _, g_both, m_both = run_loss(PolicyLossConfig(correction=combo, tis=False), batch, lp0)
    w_tis, _ = correction_ref("tis", batch, level="token", cap=1.3)
    w_ice, _ = correction_ref("icepop", batch, low=0.8, high=1.25)
    m = batch.loss_mask > 0
    want = torch.tensor([a * b for a, b in zip(w_tis, w_ice)])
    torch.testing.assert_close(m_both["tokens/is_weight"][m], want[m].float(), rtol=1e-6, atol=0)
    # algo.tis / tis_cap are the token-level tis correction
    _, g_legacy, _ = run_loss(PolicyLossConfig(tis=True, tis_cap=1.3), batch, lp0)
    _, g_explicit, _ = run_loss(PolicyLossConfig(correction={"tis": {"level": "token", "cap": 1.3}}, tis=False), batch, lp0)
    torch.testing.assert_close(g_legacy, g_explicit, rtol=0, atol=0)
    # an explicit entry wins over the short form, null switches it off
    _, g_off, m_off = run_loss(PolicyLossConfig(tis=True, correction={"tis": None}), batch, lp0)
    _, g_plain, _ = run_loss(PolicyLossConfig(tis=False), batch, lp0)
    torch.testing.assert_close(g_off, g_plain, rtol=0, atol=0)
    assert "is_weight_mean" not in m_off and "tis_weight_mean" in m_off  # diagnostics stay


def test_ppo_loss_rules_mark_the_clipped_branches():
    from tests.test_algo import branch_batch
    batch, lp0, idx = branch_batch()
    _, _, metrics = run_loss(PolicyLossConfig(dual_clip=3.0, tis=False), batch, lp0)
    rule = {n: int(metrics["tokens/loss_rule"][k]) for n, k in idx.items()}
    assert rule == {"inside_pos": 0, "above_pos": LossRule.CLIP_HIGH, "below_pos": 0, "below_neg": LossRule.CLIP_LOW,
                    "above_neg": 0, "dual_neg": LossRule.DUAL_CLIP, "inside_neg": 0, "zero_adv": 0}
    assert metrics["rule_dual_clip_frac"] == metrics["dual_clipfrac"]


# --------------------------------------------------------------------------- registry contract

def test_config_names_the_bad_key():
    for override, needle in [("algo.loss=ppo2", "algo.loss: unknown objective 'ppo2'"),
                             ("algo.loss_args={dual_soft_clip: 0.5}", "algo.loss_args.dual_soft_clip"),
                             ("algo.loss_args={level: token}", "algo.loss_args.level: unknown key"),
                             ("algo.correction={mis: {lower: 2, upper: 1}}", "algo.correction.mis"),
                             ("algo.correction={tiss: {}}", "algo.correction: unknown correction 'tiss'"),
                             ("r3_scope={loss_tokens_only: true}", "r3_scope: set only with r3: true")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [*(["algo.loss=grpo2"] if "dual_soft" in override else []), override])
        assert needle in str(e.value), (override, str(e.value))
    cfg = load_config(None, ["algo.loss=grpo2", "algo.loss_args={dual_soft_clip: 4}", "algo.correction.icepop={}",
                             "r3=true", "r3_scope.exclude_layers=[0]"])
    assert cfg.algo.loss == "grpo2" and list(cfg.r3_scope.exclude_layers) == [0]


def test_a_new_objective_is_one_function_and_one_registration():
    """What a user adds: the function, its decorator; the config accepts its name and parameters,
    the loss runs it, and its rule bits reach the metrics and the per-token columns."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        scale: float = 1.0

    @objective("test_scaled_reinforce", params=Params, rules=LossRule.SOFT_CLIP, summary="test", source="test")
    def scaled(x, band, p):
        neg = (x.adv < 0) & x.mask
        loss = torch.where(x.mask, -p.scale * x.adv * x.lp, torch.zeros_like(x.lp))
        return ObjectiveTerms(loss=loss, ratio=torch.exp(x.log_ratio()).detach(), rules=flag(neg, LossRule.SOFT_CLIP))

    try:
        cfg = load_config(None, ["algo.loss=test_scaled_reinforce", "algo.loss_args={scale: 2.0}", "algo.tis=false"])
        from axrl.assembly.build import policy_loss
        batch, lp0, _ = loss_inputs([5, 7], seed=1)
        loss, grad, metrics = run_loss(policy_loss(cfg).cfg, batch, lp0)
        m = batch.loss_mask > 0
        M = int(m.sum())
        torch.testing.assert_close(grad[m], -2.0 * batch.advantages[m] / M)
        assert metrics["rule_soft_clip_frac"] == pytest.approx(float((batch.advantages[m] < 0).sum()) / M)
        with pytest.raises(ConfigError, match="algo.loss_args.scal: unknown key"):
            load_config(None, ["algo.loss=test_scaled_reinforce", "algo.loss_args={scal: 2.0}"])
    finally:
        OBJECTIVES._entries.pop("test_scaled_reinforce")


def test_registries_list_the_documented_entries():
    assert OBJECTIVES.names() == ["cispo", "grpo2", "gspo", "gspo_token", "ppo", "topr"]
    assert CORRECTIONS.names() == ["icepop", "mis", "tis", "veto"]
    from axrl.trace.schema import LOSS_RULE_CODES
    assert {k: v[0] for k, v in LOSS_RULE_CODES.items()} == {int(r): r.name.lower() for r in LossRule}
