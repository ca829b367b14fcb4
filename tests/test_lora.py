"""LoRA (`train.lora`): adapters on a frozen base in the torch backend — zero-init B is the base
model, merged weights reach the engine, only adapters train, checkpoints resume bit for bit, the
PEFT export loads with `peft`, and a short `axrl train` + train-step replay stay bitwise."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from axrl.config import ConfigError, load_config
from axrl.model import build_model, load_hf, preset_config, save_hf
from axrl.train import LossContext, PackedBatch, TorchBackend, TorchBackendConfig
from axrl.train.torch.lora import LoRAConfig, target_group
from tests.backend_util import make_backend, make_batch
from train_util import axrl, debug, train

torch.set_num_threads(1)
# micro-moe with a dense first layer: attention, a dense MLP and MoE experts all present.
MODEL = preset_config("micro-moe", mlp_only_layers=[0])
LORA = LoRAConfig(rank=4, alpha=8.0)


def pg_loss(logprobs, entropy, mb: PackedBatch, ctx: LossContext):
    return -(mb.advantages * logprobs * mb.loss_mask).sum() / ctx.num_loss_tokens, {}


def lora_backend(lora: LoRAConfig | None = LORA, seed: int = 0, **cfg) -> TorchBackend:
    """`make_backend` on MODEL (model seed 0) with `lora` adapters and the config's `seed`."""
    return make_backend(MODEL, 0, seed=seed, lora=lora, **cfg)


def train_steps(backend: TorchBackend, steps: int, first_seed: int = 0) -> None:
    for i in range(steps):
        backend.forward_backward(make_batch(seed=first_seed + i), pg_loss)
        backend.optimizer_step()


def engine_logprobs(weights: dict[str, torch.Tensor], batch: PackedBatch) -> torch.Tensor:
    """Logprobs of a plain model (no adapters) holding `weights`: what the engine computes."""
    plain = TorchBackend(build_model(MODEL, seed=1), TorchBackendConfig(num_threads=1))
    plain.load_state_dict({**plain.state_dict(), "model": weights, "optimizer": {}})
    return plain.forward(batch).logprobs


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("override, message", [
    ("train.lora={rank: 0}", "train.lora.rank"),
    ("train.lora={alpha: -1}", "train.lora.alpha"),
    ("train.lora={dropout: 1.5}", "train.lora.dropout"),
    ("train.lora={targets: [attn, lm_head]}", "train.lora.targets: Value error, unknown target(s) ['lm_head']"),
    ("train.lora={targets: []}", "train.lora.targets"),
    ("train.lora={rnak: 8}", "train.lora.rnak: unknown key"),
])
def test_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_megatron_refuses_lora_at_config_time():
    with pytest.raises(ConfigError, match="train.lora is implemented by the torch backend only; set train.backend: torch"):
        load_config(None, ["train.lora={rank: 8}", "train.backend=megatron"])


def test_config_reaches_the_backend():
    from axrl.assembly.settings import backend_settings

    cfg = load_config(None, ["train.lora={rank: 8, alpha: 16, targets: [attn]}"])
    assert backend_settings(cfg).config.lora == LoRAConfig(rank=8, alpha=16.0, targets=("attn",))
    assert backend_settings(load_config(None, [])).config.lora is None
    # The checkpoint's JSON config round-trips.
    c = backend_settings(cfg).config
    assert TorchBackendConfig.from_dict(c.to_dict()) == c


# ---------------------------------------------------------------- adapters


def test_targets_choose_the_modules():
    assert target_group("model.layers.0.self_attn.q_proj") == "attn"
    assert target_group("model.layers.0.mlp.up_proj") == "mlp"
    assert target_group("model.layers.1.mlp.experts.3.down_proj") == "experts"
    assert target_group("model.layers.1.mlp.gate") is None          # the router stays frozen
    assert target_group("lm_head") is None
    names = lambda targets: list(lora_backend(LoRAConfig(targets=targets)).lora.modules)  # noqa: E731
    assert len(names(("attn",))) == 2 * 4
    assert names(("mlp",)) == [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    assert len(names(("experts",))) == MODEL.num_experts * 3
    with pytest.raises(ValueError, match="has none of these modules"):
        TorchBackend(build_model(preset_config("tiny-dense"), seed=0), TorchBackendConfig(lora=LoRAConfig(targets=("experts",))))


def test_zero_b_is_the_base_model_and_a_is_seeded():
    batch = make_batch()
    base, lora = lora_backend(lora=None), lora_backend()
    assert all(torch.count_nonzero(p) == 0 for n, p in lora.lora.named_parameters() if "lora_B" in n)
    a, b = base.forward(batch), lora.forward(batch)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy)
    assert torch.equal(a.routed_experts, b.routed_experts)
    assert base.fingerprint() == lora.fingerprint()   # merged with B = 0: the base weights exactly
    same, other = lora_backend().lora.state_dict(), lora_backend(seed=1).lora.state_dict()
    assert all(torch.equal(v, same[k]) for k, v in lora.lora.state_dict().items())
    assert not torch.equal(other["model.layers.0.self_attn.q_proj.lora_A.weight"],
                           same["model.layers.0.self_attn.q_proj.lora_A.weight"])


def test_only_adapters_train_and_hold_optimizer_state():
    backend, full = lora_backend(), lora_backend(lora=None)
    base_before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    backend.forward_backward(make_batch(), pg_loss)
    assert all(p.grad is None for p in backend.model.parameters())
    assert all(p.grad is not None for _, p in backend.lora.named_parameters())
    backend.optimizer_step()
    train_steps(full, 1)
    assert all(torch.equal(v, base_before[k]) for k, v in backend.model.state_dict().items())
    adapters = dict(backend.lora.named_parameters())
    state = {p: s for p, s in backend.optimizer.state.items()}
    assert set(map(id, state)) == set(map(id, adapters.values()))
    moments = lambda b: sum(s[k].numel() * s[k].element_size() for s in b.optimizer.state.values()  # noqa: E731
                            for k in ("exp_avg", "exp_avg_sq"))
    assert moments(backend) == 2 * 4 * sum(p.numel() for p in adapters.values())
    assert moments(backend) < moments(full) / 5
    assert all(torch.count_nonzero(p) > 0 for p in adapters.values())  # B moved off zero


def test_merged_weights_reach_the_engine():
    backend = lora_backend()
    train_steps(backend, 2)
    base = dict(backend.model.state_dict())
    merged = dict(backend.named_weights())
    for name in backend.lora.modules:
        A = backend.lora.A[name]
        B = backend.lora.B[name]
        assert torch.equal(merged[f"{name}.weight"], base[f"{name}.weight"] + (B @ A).detach() * LORA.scale)
    untouched = set(merged) - {f"{n}.weight" for n in backend.lora.modules}
    assert all(torch.equal(merged[k], base[k]) for k in untouched)
    assert backend.sync_source().keys() == merged.keys()
    # The engine runs the merged weights without adapters: same logprobs up to float rounding.
    batch = make_batch(seed=7)
    diff = (engine_logprobs(merged, batch) - backend.forward(batch).logprobs).abs().max()
    assert 0 < diff < 1e-5


def test_export_hf_writes_the_merged_model(tmp_path):
    backend = lora_backend()
    train_steps(backend, 1)
    before = backend.model.state_dict()["model.layers.0.self_attn.q_proj.weight"].clone()
    backend.export_hf(tmp_path / "merged")
    exported = load_hf(tmp_path / "merged").state_dict()
    assert all(torch.equal(exported[k], v) for k, v in backend.named_weights())
    assert torch.equal(backend.model.state_dict()["model.layers.0.self_attn.q_proj.weight"], before)


def test_keep_weights_swaps_the_adapters():
    backend = lora_backend()
    batch = make_batch(seed=3)
    start = backend.forward(batch).logprobs
    backend.keep_weights("ref")
    train_steps(backend, 1)
    assert not torch.equal(backend.forward(batch).logprobs, start)
    assert torch.equal(backend.forward(batch, weights="ref").logprobs, start)


def test_inspect_reports_the_adapters_gradients_and_leaves_the_run_alone():
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.1)
    batch = make_batch(seed=4)
    inspected = lora_backend(lora)    # (each backend re-seeds the global RNG: run one after the other)
    train_steps(inspected, 1)
    batch.old_logprobs = inspected.forward(batch).logprobs
    report = inspected.inspect(batch, pg_loss)
    assert report.param_names == [n for n, _ in inspected.lora.named_parameters()]
    assert bool((report.param_grad_norm > 0).any()) and bool(torch.isfinite(report.sample_grad_norm).all())
    train_steps(inspected, 1, first_seed=1)
    plain = lora_backend(lora)
    train_steps(plain, 2)
    # Dropout draws from the global RNG; the inspection did not shift the next step's masks.
    assert inspected.fingerprint() == plain.fingerprint()


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpoint_resume_is_bitwise(tmp_path, dropout):
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=dropout)
    straight = lora_backend(lora)
    train_steps(straight, 3)
    first = lora_backend(lora)
    train_steps(first, 1)
    first.save(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert saved["config"]["lora"] == {"rank": 4, "alpha": 8.0, "dropout": dropout,
                                       "targets": ["attn", "mlp", "experts"]}
    resumed = TorchBackend(build_model(MODEL, seed=5), TorchBackendConfig(lr=1e-2, num_threads=1, lora=lora))
    resumed.load(tmp_path / "ckpt")
    train_steps(resumed, 2, first_seed=1)
    assert resumed.fingerprint() == straight.fingerprint()
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    for name, s in a["optimizer"].items():
        assert all(torch.equal(t, b["optimizer"][name][k]) for k, t in s.items())


def test_checkpoint_mismatch_is_refused(tmp_path):
    lora_backend().save(tmp_path / "lora")
    lora_backend(lora=None).save(tmp_path / "full")
    with pytest.raises(ValueError, match="unexpected.*lora_A"):
        lora_backend(lora=None).load(tmp_path / "lora")
    with pytest.raises(ValueError, match="LoRA adapters do not match train.lora"):
        lora_backend().load(tmp_path / "full")
    with pytest.raises(ValueError, match="a different rank"):
        lora_backend(LoRAConfig(rank=2)).load(tmp_path / "lora")


# ---------------------------------------------------------------- PEFT export


@pytest.mark.parametrize("model, targets", [
    (preset_config("micro-moe"), ("attn", "experts")),              # experts: PEFT fuses them as transformers does
    (preset_config("micro-moe", num_experts=0), ("attn", "mlp")),   # a dense Qwen3
])
def test_peft_export_loads_with_peft(tmp_path, model, targets):
    import peft  # the test extra installs both: a broken import must fail, never skip
    import transformers
    base_dir = save_hf(build_model(model, seed=0), tmp_path / "base")
    backend = TorchBackend(load_hf(base_dir), TorchBackendConfig(lr=1e-2, num_threads=1,
                                                                 lora=LoRAConfig(rank=4, alpha=8.0, targets=targets)))
    train_steps(backend, 2)
    backend.export_hf(tmp_path / "merged")
    out = backend.export_adapter(tmp_path / "adapter", base_model=str(base_dir))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    ids = make_batch().input_ids[None, :24]
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(load(base_dir), out).eval()(ids).logits
        merged, base = load(tmp_path / "merged")(ids).logits, load(base_dir)(ids).logits
    assert (adapted - base).abs().max() > 1e-2    # the adapters were applied …
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-5)   # … as the merged model has them


def test_peft_export_refuses_what_peft_cannot_place(tmp_path):
    with pytest.raises(ValueError, match="dense MLP of an MoE model.*without --adapter-only"):
        lora_backend().export_adapter(tmp_path / "adapter")
    with pytest.raises(ValueError, match="train.lora is null"):
        lora_backend(lora=None).export_adapter(tmp_path / "adapter")


# ---------------------------------------------------------------- a short run: trace, replay, export

COMMON = ["model.preset=micro-moe", "data.task=echo", "data.task_args={}", "data.prompts_per_step=2",
          "rollout.group_size=4", "eval.every=0", "runtime.threads=1", "algo.loss_agg=token-mean"]
# A random-init model's frozen LM head keeps adapters from reaching any reward, so the base is a
# model warmed up by full fine-tuning (echo demonstrations), exported, then trained with LoRA.
WARM_BASE = ["steps=1", "warmup.steps=100", "checkpoint.every=1"]
LORA_RUN = ["steps=3", "warmup.steps=0", "checkpoint.every=2", "train.lr=1e-3", "train.micro_batch_tokens=120",
            "train.lora={rank: 8, alpha: 16, dropout: 0.1}"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from axrl.cli.export import export_checkpoint

    tmp = tmp_path_factory.mktemp("lora")
    train(tmp / "warm", COMMON + WARM_BASE)
    base = export_checkpoint(tmp / "warm", tmp / "base", step=0).out
    train(tmp / "run", COMMON + LORA_RUN + [f"model.path={base}"])
    return tmp / "run"


def test_run_trains_adapters_and_the_engine_agrees(run):
    import h5py

    from axrl.train.checkpoint_files import read_checkpoint

    state, _ = read_checkpoint(run / "checkpoints" / "step_000002")
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in state["optimizer"])
    assert any(k.endswith(".lora_B.weight") and torch.count_nonzero(v) for k, v in state["model"].items())
    worst = 0.0
    for step in range(3):
        with h5py.File(run / "trace" / f"step_{step:06d}.h5") as f:
            fingerprints = f["train/weights_fingerprint_before"][()], f["train/weights_fingerprint_after"][()]
            generated = f["tokens/loss_mask"][:] > 0
            diff = abs(f["tokens/old_logprob"][:] - f["tokens/rollout_logprob"][:])[generated]
        assert fingerprints[0] != fingerprints[1]        # the merged weights moved
        worst = max(worst, float(diff.max()))
    # The engine runs the merged weights, the trainer base + adapters: float rounding apart.
    assert worst < 1e-4


@pytest.mark.parametrize("step", [1, 2])
def test_replay_of_a_step_is_bitwise(run, step):
    result = debug("replay", run, "--step", step, "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 0, doc["first_divergence"]
    assert doc["verdict"] == "bitwise-equal" and doc["steps"][-1]["fingerprint_after"]["equal"]


def test_replay_cannot_vary_lora(run):
    result = debug("replay", run, "--step", 1, "--set", "train.lora.rank=4")
    assert result.exit_code == 2 and "train.lora.rank: cannot be varied in a replay" in " ".join(result.output.split())


def test_export_merged_and_adapter_only(run, tmp_path):
    import peft  # the test extra installs both: a broken import must fail, never skip
    import transformers

    for args in (["--out", tmp_path / "merged"], ["--out", tmp_path / "adapter", "--adapter-only"]):
        result = axrl("model", "export", run, "--step", 2, *args)
        assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    base = Path(config["base_model_name_or_path"])
    assert base == (run.parent / "base").resolve()      # the run's model.path
    ids = make_batch().input_ids[None, :24]
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(load(base), tmp_path / "adapter")(ids).logits
        merged = load(tmp_path / "merged")(ids).logits
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-5)


def test_adapter_of_a_preset_run_comes_with_its_base(tmp_path):
    from axrl.cli.export import export_adapter

    backend = lora_backend(LoRAConfig(targets=("attn",)))
    train_steps(backend, 1)
    export_adapter(backend, None, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "out" / "base").resolve())
    base = load_hf(tmp_path / "out" / "base").state_dict()
    assert all(torch.equal(base[k], v) for k, v in backend.model.state_dict().items())   # unmerged


def test_adapter_only_needs_a_lora_run(tmp_path):
    from axrl.cli.export import export_checkpoint

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000000").mkdir(parents=True)
    (run / "checkpoints" / "step_000000" / "state.json").write_text("{}")
    (run / "config.yaml").write_text("steps: 1\nmodel: {preset: micro-moe}\n")
    with pytest.raises(ValueError, match="--adapter-only: .* trained no LoRA adapters"):
        export_checkpoint(run, tmp_path / "out", adapter_only=True)
