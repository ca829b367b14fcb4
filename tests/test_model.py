"""Parity of the embedded Qwen3 / Qwen3-MoE model with Hugging Face transformers, and the HF export."""

from __future__ import annotations

import json

import pytest
import torch

from axrl.model import ModelConfig, build_model, load_hf, preset_config, save_hf
from axrl.tokenizer import Tokenizer

import transformers  # noqa: E402  (the test extra installs it: a broken import fails)

torch.set_num_threads(1)

SHAPES = [
    # (preset, overrides): several head layouts, expert counts and widths.
    ("micro-moe", {}),
    ("micro-moe", dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, num_key_value_heads=1)),
    ("micro-moe", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                       num_hidden_layers=3, mlp_only_layers=[1], tie_word_embeddings=True)),
    ("tiny-dense", dict(num_hidden_layers=2)),
    ("tiny-dense", dict(num_hidden_layers=2, num_key_value_heads=4, tie_word_embeddings=True)),
]


def _hf_pair(tmp_path, preset: str, overrides: dict, seed: int = 0):
    """Our model with random weights, and the same weights loaded by transformers from our export."""
    ours = build_model(preset_config(preset, **overrides), seed=seed).eval()
    save_hf(ours, tmp_path / "m")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    return ours, theirs


@pytest.mark.parametrize("preset,overrides", SHAPES)
def test_logits_match_transformers(tmp_path, preset, overrides):
    ours, theirs = _hf_pair(tmp_path, preset, overrides)
    expected_cls = "Qwen3MoeForCausalLM" if ours.config.is_moe else "Qwen3ForCausalLM"
    assert type(theirs).__name__ == expected_cls
    gen = torch.Generator().manual_seed(1)
    for batch, seq in [(1, 1), (1, 17), (3, 9), (4, 33)]:
        ids = torch.randint(0, ours.config.vocab_size, (batch, seq), generator=gen)
        with torch.no_grad():
            a = ours(ids).logits
            b = theirs(ids).logits
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (batch, seq, (a - b).abs().max())


@pytest.mark.parametrize("preset,overrides", SHAPES[:1] + SHAPES[3:4])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batches_match_transformers(tmp_path, preset, overrides, side):
    ours, theirs = _hf_pair(tmp_path, preset, overrides)
    gen = torch.Generator().manual_seed(2)
    lengths = [5, 12, 1, 9]
    S = max(lengths)
    ids = torch.randint(3, ours.config.vocab_size, (len(lengths), S), generator=gen)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, S - n:] = 1
    # Positions count real tokens only, as HF generate() does for left padding.
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, position_ids=pos).logits
        b = theirs(ids, attention_mask=mask, position_ids=pos).logits
    valid = mask.bool()
    assert torch.allclose(a[valid], b[valid], atol=1e-5, rtol=0), (a[valid] - b[valid]).abs().max()
    # Each padded row equals that sample run alone.
    for i, n in enumerate(lengths):
        alone = ours(ids[i][valid[i]][None]).logits[0]
        assert torch.allclose(a[i][valid[i]], alone, atol=1e-5, rtol=0)


def test_router_topk_matches_hf_gate(tmp_path):
    ours, theirs = _hf_pair(tmp_path, "micro-moe", dict(num_experts=8, num_experts_per_tok=2))
    captured: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: captured.append(o[2]))
             for layer in theirs.model.layers]
    ids = torch.randint(0, 1024, (3, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs(ids)
        routed = ours(ids, return_routing=True).routed_experts  # [B, S, L, k]
    for h in hooks:
        h.remove()
    assert routed.shape == (3, 21, 2, 2)
    for layer, hf_idx in enumerate(captured):
        ours_idx = routed[:, :, layer].reshape(-1, 2)
        assert torch.equal(ours_idx.sort(-1).values, hf_idx.sort(-1).values)


def test_forced_routing_replays_exactly_and_keeps_router_gradients():
    model = build_model(preset_config("micro-moe", num_experts=8), seed=4)
    ids = torch.randint(0, 1024, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        own = model(ids, return_routing=True)
    # Replaying the model's own routing is the identity.
    replay = model(ids, forced_experts=own.routed_experts, return_routing=True)
    assert torch.equal(replay.routed_experts, own.routed_experts)
    assert torch.allclose(replay.logits, own.logits, atol=0, rtol=0)
    # Forcing different experts uses exactly those, changes the output, and still trains the router.
    forced = torch.randint(0, 8, own.routed_experts.shape, generator=torch.Generator().manual_seed(6))
    forced[..., 1] = (forced[..., 0] + 1 + forced[..., 1] % 7) % 8  # two distinct experts per token
    out = model(ids, forced_experts=forced, return_routing=True)
    assert torch.equal(out.routed_experts, forced)
    assert not torch.allclose(out.logits, own.logits)
    out.logits.logsumexp(-1).sum().backward()
    for layer in model.model.layers:
        grad = layer.mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_export_load_roundtrip_and_transformers_load(tmp_path):
    model = build_model(preset_config("tiny-moe"), seed=7)
    tok = Tokenizer.default()
    out = save_hf(model, tmp_path / "export", tokenizer=tok)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg["eos_token_id"] == tok.eos_token_id

    back = load_hf(out)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([hf_tok.encode("What is 12 + 30?")])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_loads_a_checkpoint_written_by_transformers(tmp_path):
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf")
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)


def test_bad_model_dirs_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        load_hf(tmp_path)
    save_hf(build_model(preset_config("micro-moe"), seed=0), tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["num_experts"] = 5
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weight names do not match"):
        load_hf(tmp_path / "a")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=3,
                    num_key_value_heads=2, head_dim=4, intermediate_size=8)


def test_same_seed_same_weights():
    a = build_model(preset_config("micro-moe"), seed=11)
    b = build_model(preset_config("micro-moe"), seed=11)
    c = build_model(preset_config("micro-moe"), seed=12)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
