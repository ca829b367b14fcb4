"""The embedded PyTorch train backend: alignment, micro-batching, R3, optimizer, checkpoints and
bitwise determinism (also across processes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from axrl.model import load_hf
from axrl.train import (LossContext, PackedBatch, TorchBackend, TorchBackendConfig, TrainBackend, capture_rng_state,
                        grad_norm, lr_at, pad_micro_batch, restore_rng_state, split_micro_batches, unpad,
                        weights_fingerprint)
from tests.backend_util import LENGTHS, make_backend, make_batch

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


def pg_loss(logprobs, entropy, mb: PackedBatch, ctx: LossContext):
    """Reference token-mean policy-gradient loss; loss and metrics normalised over the whole batch
    (the LossFn contract), so micro-batch values add up."""
    loss = -(mb.advantages * logprobs * mb.loss_mask).sum() / ctx.num_loss_tokens
    ent = (entropy.detach() * mb.loss_mask).sum() / ctx.num_loss_tokens
    return loss, {"entropy": float(ent)}


def grads(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in backend.model.named_parameters()}


# ---------------------------------------------------------------- micro-batching and alignment

def test_split_order_and_budgets():
    r = lambda *xs: [range(a, b) for a, b in xs]  # noqa: E731
    assert split_micro_batches([5, 9, 3, 12]) == r((0, 4))
    # The budget counts padded tokens (samples × longest): [5, 9] would pad to 18 > 14.
    assert split_micro_batches([5, 9, 3, 12], micro_batch_tokens=14) == r((0, 1), (1, 2), (2, 3), (3, 4))
    assert split_micro_batches([5, 7, 3, 12], micro_batch_tokens=14) == r((0, 2), (2, 3), (3, 4))
    assert split_micro_batches([4, 4, 4, 4, 30, 4], micro_batch_tokens=16) == r((0, 4), (4, 5), (5, 6))
    assert split_micro_batches([5, 9, 3, 12], micro_batch_size=3) == r((0, 3), (3, 4))
    # A sample longer than the budget sits alone; the budget counts real tokens.
    assert split_micro_batches([3, 20, 2, 4], micro_batch_tokens=10) == r((0, 1), (1, 2), (2, 4))
    assert split_micro_batches([3, 3, 3], micro_batch_tokens=100, micro_batch_size=2) == r((0, 2), (2, 3))


def test_pad_unpad_roundtrip():
    b = make_batch()
    pm = pad_micro_batch(b)
    assert pm.input_ids.shape == (len(LENGTHS), max(LENGTHS))
    assert torch.equal(unpad(pm.input_ids, pm.rows, pm.cols), b.input_ids)
    assert pm.attention_mask.sum(1).tolist() == LENGTHS
    assert torch.equal(pm.cols[b.offsets[:-1]], torch.zeros(len(LENGTHS), dtype=torch.int64))


@pytest.mark.parametrize("preset", ["micro-moe", "tiny-dense"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_direct_per_sample(preset, temperature):
    be = make_backend(preset, micro_batch_size=2)  # several micro-batches with padding
    b = make_batch(temperature=temperature)
    out = be.forward(b)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    assert isinstance(be, TrainBackend)
    for i in range(b.num_samples):
        s, e = int(b.offsets[i]), int(b.offsets[i + 1])
        ids = b.input_ids[s:e]
        with torch.no_grad():
            ref = be.model(ids[None], return_routing=True)
        logp = F.log_softmax(ref.logits[0].float() / temperature, dim=-1)
        want_lp = torch.cat([torch.zeros(1), logp[:-1].gather(-1, ids[1:, None]).squeeze(-1)])
        want_ent = torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)[:-1]])
        torch.testing.assert_close(out.logprobs[s:e], want_lp, atol=1e-6, rtol=0)
        torch.testing.assert_close(out.entropy[s:e], want_ent, atol=1e-6, rtol=1e-6)  # entropy ~ 7: fp32 ulp
        assert out.logprobs[s] == 0.0 and out.entropy[s] == 0.0
        if ref.routed_experts is not None:
            assert torch.equal(out.routed_experts[s:e], ref.routed_experts[0])
    if preset == "tiny-dense":
        assert out.routed_experts is None
    if temperature != 1.0:  # the temperature really is applied
        plain = be.forward(replace(b, temperature=1.0))
        assert not torch.allclose(plain.logprobs, out.logprobs)


def test_forward_and_train_forward_agree_bitwise():
    """old logprobs (no-grad forward) equal the logprobs the loss sees, so the first PPO ratio is exactly 1."""
    be = make_backend(micro_batch_size=2)
    b = make_batch()
    seen = []
    be.forward_backward(b, lambda lp, ent, mb, ctx: (seen.append(lp.detach()) or pg_loss(lp, ent, mb, ctx)))
    assert torch.equal(torch.cat(seen), be.forward(b).logprobs)


@pytest.mark.parametrize("split", [dict(micro_batch_size=1), dict(micro_batch_tokens=10), dict(micro_batch_size=2)])
def test_gradients_invariant_to_micro_batch_split(split):
    b = make_batch()
    one = make_backend()
    m1 = one.forward_backward(b, pg_loss)
    many = make_backend(**split)
    m2 = many.forward_backward(b, pg_loss)
    assert len(m2.micro_batches) > 1 and len(m1.micro_batches) == 1
    assert math.isclose(m1.loss, m2.loss, abs_tol=1e-6)
    assert math.isclose(m1.metrics["entropy"], m2.metrics["entropy"], abs_tol=1e-5)
    assert m2.metrics["num_tokens"] == b.num_tokens and m2.metrics["num_loss_tokens"] == float(b.loss_mask.sum())
    g1, g2 = grads(one), grads(many)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-6, rtol=0, msg=name)


def test_accumulation_over_several_calls():
    b = make_batch()
    denom = int(b.loss_mask.sum())

    def loss(lp, ent, mb, ctx):  # normalise over the full optimizer batch, not the call's part
        return -(mb.advantages * lp * mb.loss_mask).sum() / denom, {}

    whole = make_backend()
    whole.forward_backward(b, loss)
    parts = make_backend()
    parts.forward_backward(b.select([0, 1]), loss)
    parts.forward_backward(b.select([2, 3, 4]), loss)
    for (name, g1), g2 in zip(grads(whole).items(), grads(parts).values()):
        torch.testing.assert_close(g1, g2, atol=1e-6, rtol=0, msg=name)
    whole.optimizer_step(), parts.optimizer_step()


# ---------------------------------------------------------------- R3

def random_routing(T: int, layers: int, k: int, num_experts: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(T * layers)]).view(T, layers, k)


def forced_routing_batch(be: TorchBackend) -> tuple[PackedBatch, torch.Tensor, PackedBatch]:
    """(batch, a random routing for it, the batch carrying that routing)."""
    cfg = be.model.config
    b = make_batch()
    forced = random_routing(b.num_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts)
    return b, forced, replace(b, routed_experts=forced)


def test_r3_replays_forced_routing_and_router_still_learns():
    be = make_backend(micro_batch_size=2)
    b, forced, rb = forced_routing_batch(be)
    own = be.forward(rb)  # r3 off: the batch's routing is ignored
    replayed = be.forward(rb, r3=True)
    assert torch.equal(replayed.routed_experts, forced)
    assert not torch.equal(own.routed_experts, forced)
    assert not torch.allclose(own.logprobs, replayed.logprobs)
    be.forward_backward(rb, pg_loss, r3=True)
    for layer in be.model.model.layers:
        g = layer.mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0


def test_r3_with_own_routing_is_identical():
    be = make_backend(micro_batch_size=2)
    b = make_batch()
    plain = be.forward(b)
    forced = be.forward(replace(b, routed_experts=plain.routed_experts), r3=True)
    assert torch.equal(forced.logprobs, plain.logprobs) and torch.equal(forced.entropy, plain.entropy)


def test_r3_rejects_missing_or_bad_routing():
    be = make_backend()
    b = make_batch()
    with pytest.raises(ValueError, match="routed_experts"):
        be.forward(b, r3=True)
    bad = torch.full((b.num_tokens, 2, 2), 99, dtype=torch.int64)
    with pytest.raises(ValueError, match="expert ids"):
        be.forward(replace(b, routed_experts=bad), r3=True)


# ---------------------------------------------------------------- optimizer

def test_loss_decreases_on_a_fixed_batch():
    be = make_backend(lr=3e-3)
    b = make_batch()
    losses = []
    for _ in range(5):
        losses.append(be.forward_backward(b, pg_loss).loss)
        stats = be.optimizer_step()
        assert stats.grad_norm > 0 and stats.lr == 3e-3
    assert losses[-1] < losses[0] and all(x > y for x, y in zip(losses, losses[1:]))


def test_grad_clip_caps_the_norm_and_reports_the_unclipped_one():
    be = make_backend(grad_clip=1e-3)
    b = make_batch()
    be.forward_backward(b, pg_loss)
    unclipped = float(grad_norm([p.grad for p in be.model.parameters() if p.grad is not None]))
    seen = []
    step = be.optimizer.step
    be.optimizer.step = lambda *a, **k: (seen.append(float(grad_norm([p.grad for p in be.model.parameters()]))),
                                         step(*a, **k))[1]
    stats = be.optimizer_step()
    assert stats.grad_norm == pytest.approx(unclipped, rel=1e-6) and unclipped > 1e-2
    assert seen[0] == pytest.approx(1e-3, rel=1e-4)
    assert all(p.grad is None for p in be.model.parameters())  # zeroed after the step


def test_lr_schedule_values():
    cos = TorchBackendConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [lr_at(cos, s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_at(cos, 4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(cos, 6) == pytest.approx(0.1) and lr_at(cos, 100) == pytest.approx(0.1)
    lin = cos.model_copy(update={"lr_schedule": "linear"})
    assert lr_at(lin, 3) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_at(TorchBackendConfig(lr=2.0), 50) == 2.0
    with pytest.raises(ValueError, match="total_steps"):
        TorchBackendConfig(lr_schedule="cosine", total_steps=0)
    # The backend uses the schedule, one value per applied update.
    be = make_backend(lr=1e-3, lr_schedule="cosine", warmup_steps=2, total_steps=4)
    b = make_batch()
    lrs = []
    for _ in range(4):
        be.forward_backward(b, pg_loss)
        lrs.append(be.optimizer_step().lr)
    assert lrs == [lr_at(be.config, s) for s in range(4)] and lrs[:3] == [5e-4, 1e-3, 1e-3]
    assert be.optimizer.param_groups[0]["lr"] == lrs[-1]


def test_non_finite_grad_skips_the_update():
    b = make_batch()

    def nan_loss(lp, ent, mb, ctx):
        loss, m = pg_loss(lp, ent, mb, ctx)
        return loss * float("nan"), m

    skipped, clean = make_backend(), make_backend()
    for be in (skipped, clean):
        be.forward_backward(b, pg_loss), be.optimizer_step()
    before, before_opt = skipped.fingerprint(), skipped.state_dict()["optimizer"]
    skipped.forward_backward(b, nan_loss)
    stats = skipped.optimizer_step()
    assert math.isnan(stats.grad_norm)
    assert skipped.fingerprint() == before and skipped.scheduler_step == 1 and skipped.skipped_steps == 1
    after_opt = skipped.state_dict()["optimizer"]
    assert all(torch.equal(before_opt[n][k], after_opt[n][k]) for n in before_opt for k in before_opt[n])
    # Grads were zeroed: the next update equals one that never saw the bad batch.
    for be in (skipped, clean):
        be.forward_backward(b, pg_loss), be.optimizer_step()
    assert skipped.fingerprint() == clean.fingerprint()


def test_optimizer_step_without_grads_is_an_error():
    with pytest.raises(RuntimeError, match="forward_backward"):
        make_backend().optimizer_step()


def test_lr_override_and_scale():
    be = make_backend(lr=1e-2, lr_schedule="cosine", total_steps=10)
    be.forward_backward(make_batch(), pg_loss)
    assert be.optimizer_step(lr=0.5).lr == 0.5          # a fixed-rate phase ignores the schedule
    be.forward_backward(make_batch(), pg_loss)
    assert be.optimizer_step(lr_scale=3.0).lr == pytest.approx(3 * lr_at(be.config, 1))
    assert be.scheduler_step == 2


def test_reset_optimizer_equals_a_fresh_backend():
    """Warm-up then reset: the next update is bit for bit that of a backend built on the warmed-up
    weights (what `axrl train` relies on between supervised warm-up and RL)."""
    warm = make_backend()
    for _ in range(3):
        warm.forward_backward(make_batch(seed=1), pg_loss)
        warm.optimizer_step(lr=0.05)
    warm.reset_optimizer()
    fresh = make_backend(model_seed=9)
    fresh.load_state_dict({**warm.state_dict(), "optimizer": {}, "scheduler_step": 0})
    for be in (warm, fresh):
        be.forward_backward(make_batch(), pg_loss)
        be.optimizer_step()
    assert warm.fingerprint() == fresh.fingerprint() and warm.scheduler_step == 1


def test_forward_under_kept_weights():
    be = make_backend()
    batch = make_batch()
    before = be.forward(batch)
    be.keep_weights("v0")
    be.forward_backward(batch, pg_loss)
    be.optimizer_step()
    fp = be.fingerprint()
    after = be.forward(batch)
    assert not torch.equal(before.logprobs, after.logprobs)
    kept = be.forward(batch, weights="v0")
    assert torch.equal(kept.logprobs, before.logprobs) and torch.equal(kept.routed_experts, before.routed_experts)
    assert be.fingerprint() == fp and torch.equal(be.forward(batch).logprobs, after.logprobs)  # untouched
    be.forget_weights("v0")
    with pytest.raises(KeyError, match="v0"):
        be.forward(batch, weights="v0")


def test_inspect_observes_without_changing_state():
    be = make_backend()
    batch = make_batch()
    ins = be.inspect(batch, pg_loss)
    T, N = batch.num_tokens, batch.num_samples
    assert ins.activation_norm.shape == (T, len(ins.activation_names)) and torch.isfinite(ins.activation_norm).all()
    assert ins.activation_names[0] == "embed_tokens" and ins.activation_names[-1] == "norm"
    assert ins.router_tokens.sum(-1).tolist() == [T * 2] * len(ins.moe_layers)  # micro-moe: top-2
    assert ins.sample_grad_norm.shape == (N,) and (ins.sample_grad_norm > 0).all()
    assert all(p.grad is None for _, p in be.model.named_parameters())
    # The per-sample gradients add up to the batch gradient the update uses.
    be.forward_backward(batch, pg_loss)
    actual = torch.tensor([float(p.grad.double().norm()) for _, p in be.model.named_parameters() if p.requires_grad])
    assert torch.allclose(ins.param_grad_norm, actual.double(), rtol=1e-4, atol=1e-9)


def test_backend_satisfies_the_protocol():
    assert isinstance(make_backend(), TrainBackend)


def test_bfloat16_autocast_trains():
    be = make_backend(dtype="bfloat16")
    ref = make_backend()
    b = make_batch()
    out = be.forward(b)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, ref.forward(b).logprobs, atol=0.1, rtol=0)
    be.forward_backward(b, pg_loss)
    assert math.isfinite(be.optimizer_step().grad_norm)
    assert next(be.model.parameters()).dtype == torch.float32  # master weights stay fp32


# ---------------------------------------------------------------- state, checkpoints, determinism

def run_updates(be: TorchBackend, n: int, seed0: int = 10) -> list[tuple[str, str, str]]:
    """(loss, grad norm, fingerprint) per update, floats as hex so equality means bitwise."""
    out = []
    for i in range(n):
        m = be.forward_backward(make_batch(seed=seed0 + i), pg_loss)
        s = be.optimizer_step()
        out.append((m.loss.hex(), s.grad_norm.hex(), be.fingerprint()))
    return out


CONFIG = dict(lr=1e-2, micro_batch_size=2, lr_schedule="cosine", warmup_steps=1, total_steps=5, grad_clip=0.5)


def test_save_load_continues_bitwise(tmp_path):
    a = make_backend(**CONFIG)
    run_updates(a, 2, seed0=0)
    a.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer_state.json"]
    expected = run_updates(a, 2, seed0=2)
    b = make_backend(model_seed=123, **CONFIG)  # different weights, overwritten by load
    assert b.fingerprint() != expected[0][2]
    b.load(tmp_path / "ckpt")
    assert b.scheduler_step == 2
    assert run_updates(b, 2, seed0=2) == expected
    # The in-memory state dict round-trips the same way.
    c = make_backend(model_seed=7, **CONFIG)
    c.load_state_dict(a.state_dict())
    assert c.scheduler_step == 4
    assert run_updates(c, 1, seed0=4) == run_updates(a, 1, seed0=4)


def test_rng_state_roundtrip_without_pickle():
    import random

    import numpy as np
    state = capture_rng_state()
    json.dumps(state.meta)  # plain JSON
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    restore_rng_state(state)
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def test_fingerprint_is_bitwise():
    w = {"a": torch.randn(4, 3), "b": torch.ones(2)}
    assert weights_fingerprint(w) == weights_fingerprint(dict(reversed(list(w.items()))))
    bumped = {**w, "b": torch.nextafter(w["b"], torch.full_like(w["b"], 2.0))}
    assert weights_fingerprint(bumped) != weights_fingerprint(w)
    assert weights_fingerprint({"a": w["a"].reshape(3, 4), "b": w["b"]}) != weights_fingerprint(w)


def test_export_hf_roundtrip(tmp_path):
    be = make_backend()
    be.forward_backward(make_batch(), pg_loss), be.optimizer_step()
    out = be.export_hf(tmp_path / "hf")
    assert (out / "config.json").is_file()
    assert weights_fingerprint(load_hf(out).state_dict()) == be.fingerprint()


def test_load_rejects_missing_or_corrupt_files(tmp_path):
    a = make_backend()
    a.forward_backward(make_batch(), pg_loss), a.optimizer_step()
    ckpt = tmp_path / "ckpt"
    a.save(ckpt)
    fresh = make_backend(model_seed=5)
    untouched = fresh.fingerprint()

    def broken(name: str, mutate) -> Path:
        d = tmp_path / f"broken_{name}_{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        for f in ckpt.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        mutate(d / name)
        return d

    with pytest.raises(FileNotFoundError, match="optimizer.safetensors"):
        fresh.load(broken("optimizer.safetensors", Path.unlink))
    with pytest.raises(ValueError, match="rng.safetensors"):
        fresh.load(broken("rng.safetensors", lambda p: p.write_bytes(p.read_bytes()[:10])))
    with pytest.raises(ValueError, match="trainer_state.json"):
        fresh.load(broken("trainer_state.json", lambda p: p.write_text("{not json")))

    def flip_last_byte(p: Path) -> None:  # header intact, one weight bit-flipped
        data = bytearray(p.read_bytes())
        data[-1] ^= 0x01
        p.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors.*fingerprint"):
        fresh.load(broken("model.safetensors", flip_last_byte))
    assert fresh.fingerprint() == untouched  # a rejected load changes nothing
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        fresh.load(tmp_path / "nowhere")


SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.test_train_backend import CONFIG, make_backend, run_updates
mode, ckpt = sys.argv[2], sys.argv[3]
be = make_backend(**CONFIG)
if mode == "resume":
    be.load(ckpt)
    rows = run_updates(be, 2, seed0=1)
else:
    rows = run_updates(be, 1, seed0=0)
    if mode == "save":
        be.save(ckpt)
    rows += run_updates(be, 2, seed0=1)
print(json.dumps(rows))
"""


def test_two_processes_are_bitwise_identical(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def start(mode: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", SCRIPT, str(REPO), mode, str(tmp_path / "ckpt")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)

    def result(p: subprocess.Popen) -> list[list[str]]:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    procs = [start("save"), start("plain")]  # two independent processes, same seed and batches
    first, second = (result(p) for p in procs)
    assert len(first) == 3 and first == second
    assert len({row[2] for row in first}) == 3  # weights changed every update
    # A third process resumes from the checkpoint the first wrote after update 1.
    assert result(start("resume")) == first[1:]


# ---------------------------------------------------------------- partial R3, per-tensor grad norms, token columns

def test_partial_r3_replays_only_its_layers_and_loss_tokens():
    from axrl.train.protocol import R3Scope

    be = make_backend(micro_batch_size=2)
    b, forced, rb = forced_routing_batch(be)
    plain, full = be.forward(rb), be.forward(rb, r3=True)
    # a scope covering everything is full R3, bit for bit
    same = be.forward(rb, r3=R3Scope(layers=(0, 1)))
    assert torch.equal(same.logprobs, full.logprobs) and torch.equal(same.routed_experts, forced)
    # layer 1 only: layer 0 routes as without R3 (nothing before it changed), layer 1 replays
    only1 = be.forward(rb, r3=R3Scope(layers=(1,)))
    assert torch.equal(only1.routed_experts[:, 0], plain.routed_experts[:, 0])
    assert torch.equal(only1.routed_experts[:, 1], forced[:, 1])
    assert torch.equal(be.forward(rb, r3=R3Scope(exclude_layers=(0,))).logprobs, only1.logprobs)
    # loss tokens only: those rows replay, the others route on their own (layer 0 sees only embeddings)
    loss_only = be.forward(rb, r3=R3Scope(loss_tokens_only=True))
    m = b.loss_mask > 0
    assert torch.equal(loss_only.routed_experts[m], forced[m])
    assert torch.equal(loss_only.routed_experts[~m][:, 0], plain.routed_experts[~m][:, 0])
    for lp in (only1.logprobs, loss_only.logprobs):
        assert not torch.equal(lp, full.logprobs) and not torch.equal(lp, plain.logprobs)
    # the train forward follows the same scope: gradients differ from full R3's
    be.forward_backward(rb, pg_loss, r3=R3Scope(loss_tokens_only=True))
    g_partial = grads(be)
    be.optimizer.zero_grad(set_to_none=True)
    be.forward_backward(rb, pg_loss, r3=True)
    assert any(not torch.equal(g_partial[n], g) for n, g in grads(be).items())
    with pytest.raises(ValueError, match="not MoE layers"):
        be.forward(rb, r3=R3Scope(layers=(5,)))


def test_per_tensor_grad_norms_make_up_the_total():
    be = make_backend()
    b = make_batch()
    be.forward_backward(b, pg_loss)
    want = {n: float(p.grad.float().norm()) for n, p in be.model.named_parameters() if p.grad is not None}
    stats = be.optimizer_step()
    assert list(stats.param_grad_norm) == [n for n, p in be.model.named_parameters() if p.requires_grad]
    for n, v in want.items():
        assert stats.param_grad_norm[n] == pytest.approx(v, rel=1e-6)
    total = math.sqrt(sum(v * v for v in stats.param_grad_norm.values()))
    assert total == pytest.approx(stats.grad_norm, rel=1e-6)


def test_loss_token_columns_come_back_in_batch_order():
    from axrl.algo import PolicyLossConfig, make_policy_loss

    be = make_backend(micro_batch_tokens=16)
    b = make_batch()
    b = replace(b, old_logprobs=be.forward(b).logprobs + 0.3 * torch.randn(b.num_tokens),
                rollout_logprobs=torch.where(b.loss_mask > 0, torch.randn(b.num_tokens) * 0.2 - 2, torch.nan))
    loss = make_policy_loss(PolicyLossConfig(correction={"tis": {"cap": 1.1}}, tis=False))
    m = be.forward_backward(b, loss)
    assert len(m.micro_batches) > 1 and set(m.tokens) == {"is_weight", "loss_rule"}
    # the columns over the whole batch equal the loss evaluated on the whole batch at once
    fwd = be.forward(b)
    _, direct = loss(fwd.logprobs, fwd.entropy, b, LossContext(int(b.loss_mask.sum()), b.num_samples, b.num_samples))
    torch.testing.assert_close(m.tokens["is_weight"], direct["tokens/is_weight"])
    assert torch.equal(m.tokens["loss_rule"], direct["tokens/loss_rule"])
    assert (m.tokens["is_weight"][b.loss_mask > 0] < 1.1 + 1e-6).all()


def test_packed_batch_to_moves_every_tensor_once():
    b = make_batch()
    b.old_logprobs = torch.zeros(b.num_tokens)
    assert b.to("cpu") is b and b.to(torch.device("cpu")) is b  # already there: no copy, no re-validation
    if torch.cuda.is_available():
        moved = b.to("cuda")
        assert all(t.device.type == "cuda" for t in (moved.input_ids, moved.offsets, moved.loss_mask,
                                                     moved.advantages, moved.old_logprobs))
        assert moved.ref_logprobs is None and moved.to("cuda") is moved and moved.to("cpu").input_ids.is_cpu
        assert torch.equal(moved.to("cpu").advantages, b.advantages)


def test_shared_backend_modules_and_config():
    """The backends share settings, optimizer arithmetic, the R3 check and checkpoint files through
    neutral modules: megatron/ never imports the torch backend."""
    from axrl.train.settings import BackendConfig

    for path in (REPO / "axrl" / "train" / "megatron").glob("*.py"):
        assert "torch_backend" not in path.read_text(), path
    assert issubclass(TorchBackendConfig, BackendConfig)
    assert TorchBackendConfig.from_dict(TorchBackendConfig(lr=0.5).to_dict()) == TorchBackendConfig(lr=0.5)
    with pytest.raises(ValueError, match=r"unknown TorchBackendConfig field\(s\) \['tensor_parallel'\]"):
        TorchBackendConfig.from_dict({"tensor_parallel": 2})


def test_an_update_with_its_own_adam_settings_equals_a_backend_configured_with_them():
    """`optimizer_step(adam=...)` (the Tinker API's per-call AdamW settings) steps exactly as a
    backend configured with those settings, and the next plain update is back on the config's."""
    from axrl.train.protocol import AdamHyper

    hyper = AdamHyper(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, grad_clip=0.5)
    own, configured, plain = make_backend(), make_backend(betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1,
                                                           grad_clip=0.5), make_backend()
    for b in (own, configured, plain):
        b.forward_backward(make_batch(seed=0), pg_loss)
    own.optimizer_step(lr=1e-2, adam=hyper)
    configured.optimizer_step(lr=1e-2)
    plain.optimizer_step(lr=1e-2)
    assert own.fingerprint() == configured.fingerprint() != plain.fingerprint()
    group = own.optimizer.param_groups[0]
    own.forward_backward(make_batch(seed=1), pg_loss)
    own.optimizer_step(lr=1e-2)
    c = own.config  # back on the config's (its defaults: the YAML's, weight_decay 0)
    assert (group["betas"], group["eps"], group["weight_decay"]) == (c.betas, c.eps, c.weight_decay) == \
        ((0.9, 0.999), 1e-8, 0.0)
