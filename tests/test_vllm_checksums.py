"""The vLLM worker extension's checksums and expert re-packing (axrl/inference/vllm/checksum_extension.py,
and its use after TRL's colocated weight push, axrl/integrations/trl_vllm_cpu.py) on a stand-in
worker whose modules are laid out as vLLM lays out a Qwen3-MoE layer (fused q/k/v, stacked and
re-packed experts, a linear emptied for an opaque kernel handle): what the extension reads, how the
sentinel pairs it with the trainer's tensors, and that reading never touches the live layer. The
same path on a real vLLM server: tests/test_sync_sentinel_vllm.py (`-m vllm`)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from axrl.inference.vllm.checksum_extension import ChecksumExtension
from axrl.inference.vllm.checksums import vllm_checksum_pair
from axrl.integrations.trl_vllm_cpu import colocated_model, needs_expert_repack, repack_after_sync
from axrl.sync.checksums import compare_checksums

E, I, H = 3, 4, 8   # experts, expert intermediate size, hidden size


class _PackingKernel:
    """A CPU experts kernel: re-packs both expert tensors at load (reverses each row) and keeps
    state of its own, as vLLM's does."""

    def __init__(self) -> None:
        self.loads = 0

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.loads += 1
        for name in ("w13_weight", "w2_weight"):
            setattr(layer, name, torch.nn.Parameter(getattr(layer, name).flip(-1).contiguous(), requires_grad=False))


_PackingKernel.__name__ = "FakeCPUExperts"   # the extension finds the kernel by vLLM's naming


class _Experts(torch.nn.Module):
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        self.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        self.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=_PackingKernel()))
        self.quant_method.moe_kernel.fused_experts.process_weights_after_loading(self)


class _Model(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, hf: dict[str, torch.Tensor]) -> None:
        super().__init__()
        p = "model.layers.0."
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(16, H)
        self.model.embed_tokens.weight.data = hf["model.embed_tokens.weight"].clone()
        layer = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = torch.nn.Linear(H, 16, bias=False)
        layer.self_attn.qkv_proj.weight.data = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        layer.self_attn.o_proj = torch.nn.Linear(H, H, bias=False)
        layer.self_attn.o_proj.weight = torch.nn.Parameter(torch.empty(0))    # an opaque kernel handle
        layer.mlp = torch.nn.Module()
        w13 = torch.stack([torch.cat([hf[p + f"mlp.experts.{e}.{x}_proj.weight"] for x in ("gate", "up")])
                           for e in range(E)])
        w2 = torch.stack([hf[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.routed_experts = _Experts(w13, w2)     # vLLM nests them one module deeper


def _hf() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (16, H), p + "self_attn.q_proj.weight": (8, H),
              p + "self_attn.k_proj.weight": (4, H), p + "self_attn.v_proj.weight": (4, H),
              p + "self_attn.o_proj.weight": (H, H)}
    for e in range(E):
        shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (I, H), p + f"mlp.experts.{e}.up_proj.weight": (I, H),
                       p + f"mlp.experts.{e}.down_proj.weight": (H, I)})
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()}


class _Worker(ChecksumExtension):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=model)


class _Engine:
    """What `vllm_checksum_pair` asks of a `VLLMEngine`."""

    def __init__(self, worker: _Worker, weights_dir: Path) -> None:
        self.worker, self.weights_dir, self.urls = worker, weights_dir, ["http://127.0.0.1:9"]

    def worker_call(self, server: int, method: str, *args: str) -> Any:
        return {"results": [getattr(self.worker, method)(*args)]}


def _setup(tmp_path: Path) -> tuple[dict[str, torch.Tensor], _Model, _Engine]:
    hf = _hf()
    save_file(hf, str(tmp_path / "model.safetensors"))
    model = _Model(hf)
    return hf, model, _Engine(_Worker(model), tmp_path)


def test_a_fresh_load_compares_clean_and_every_tensor_is_accounted_for(tmp_path: Path) -> None:
    hf, model, engine = _setup(tmp_path)
    experts = model.model.layers[0].mlp.experts.routed_experts
    before = (experts.w13_weight, experts.w13_weight.clone(), experts.quant_method.moe_kernel.fused_experts.loads)
    pair = vllm_checksum_pair(engine, 0, hf)
    assert compare_checksums(pair.expected, pair.held) == []
    p = "model.layers.0."
    assert pair.unreadable == (p + "self_attn.o_proj.weight",)
    assert {p + f"self_attn.{x}_proj.weight" for x in "qkv"} <= set(pair.held)      # fused, split back
    assert {p + f"mlp.experts.{e}.gate_up_proj.weight" for e in range(E)} <= set(pair.held)  # re-packed pairs
    # reading re-packed the directory's experts on a stand-in: the live layer and kernel are untouched
    assert experts.w13_weight is before[0] and torch.equal(experts.w13_weight, before[1])
    assert experts.quant_method.moe_kernel.fused_experts.loads == before[2]


def test_a_stale_packed_expert_is_named_with_its_layer_and_expert(tmp_path: Path) -> None:
    hf, model, engine = _setup(tmp_path)
    experts = model.model.layers[0].mlp.experts.routed_experts
    experts.w13_weight.data[1] = experts.w13_weight.data[1].flip(-1)   # expert 1 left unpacked by a reload
    bad = compare_checksums(*(lambda p: (p.expected, p.held))(vllm_checksum_pair(engine, 0, hf)))
    assert [(m.name, m.layer, m.expert) for m in bad] == [("model.layers.0.mlp.experts.1.gate_up_proj.weight", 0, 1)]


def test_the_trainer_side_is_the_trainers_tensor_not_the_directory(tmp_path: Path) -> None:
    # the server and its directory agree, the trainer posted something else: a skipped export
    hf, model, engine = _setup(tmp_path)
    posted = dict(hf)
    posted["model.layers.0.self_attn.k_proj.weight"] = hf["model.layers.0.self_attn.k_proj.weight"] + 1
    bad = compare_checksums(*(lambda p: (p.expected, p.held))(vllm_checksum_pair(engine, 0, posted)))
    assert [m.name for m in bad] == ["model.layers.0.self_attn.k_proj.weight"]


def test_the_extension_answers_json_a_server_can_send(tmp_path: Path) -> None:
    _, model, _ = _setup(tmp_path)
    got = json.loads(_Worker(model).axrl_weight_checksums(str(tmp_path)))
    assert set(got) == {"held", "expected", "unreadable", "packed", "dtype"} and got["dtype"] == "torch.float32"


def test_repacking_after_a_reload_restores_a_fresh_load_and_never_packs_twice(tmp_path: Path) -> None:
    hf, model, engine = _setup(tmp_path)
    experts = model.model.layers[0].mlp.experts.routed_experts
    fresh = {k: experts._parameters[k].detach().clone() for k in ("w13_weight", "w2_weight")}
    for k in fresh:   # what vLLM's CPU reload leaves: the same weights, unpacked
        experts._parameters[k].data.copy_(experts._parameters[k].data.flip(-1))
    assert compare_checksums(*(lambda p: (p.expected, p.held))(vllm_checksum_pair(engine, 0, hf)))
    worker = engine.worker
    assert json.loads(worker.axrl_repack_experts(str(tmp_path))) == {"repacked": 1, "already_packed": 0, "neither": 0}
    assert all(torch.equal(experts._parameters[k], fresh[k]) for k in fresh)
    assert compare_checksums(*(lambda p: (p.expected, p.held))(vllm_checksum_pair(engine, 0, hf))) == []
    assert json.loads(worker.axrl_repack_experts(str(tmp_path))) == {"repacked": 0, "already_packed": 1, "neither": 0}
    assert all(torch.equal(experts._parameters[k], fresh[k]) for k in fresh)


# -- TRL's colocated push (axrl/integrations/trl_vllm_cpu.py) ------------------------------------------

class _TrainerModel(torch.nn.Module):
    """A transformers 5 Qwen3-MoE's expert parameters: fused `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.model = torch.nn.Module()
        layer = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g))
        layer.mlp.experts.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=g))


def _colocated(engine_model: _Model, policy: _TrainerModel) -> tuple[SimpleNamespace, list[int]]:
    """A trainer as TRL 1.16 builds it in colocate mode, whose push writes every expert tensor in
    vLLM's plain layout, as `load_weights` does on the CPU build."""
    resets: list[int] = []
    runner = SimpleNamespace(model=engine_model)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(
        driver_worker=SimpleNamespace(model_runner=runner))), reset_prefix_cache=lambda: resets.append(1))
    experts = engine_model.model.layers[0].mlp.experts.routed_experts

    def push() -> None:
        src = policy.model.layers[0].mlp.experts
        experts.w13_weight.data.copy_(src.gate_up_proj.detach())
        experts.w2_weight.data.copy_(src.down_proj.detach())
        llm.reset_prefix_cache()

    return SimpleNamespace(vllm_generation=SimpleNamespace(mode="colocate", llm=llm, sync_weights=push),
                           model=policy), resets


def test_trls_colocated_push_is_repacked_after_every_sync(tmp_path: Path) -> None:
    policy = _TrainerModel(seed=1)
    trainer, resets = _colocated(_Model(_hf()), policy)
    experts = colocated_model(trainer).model.layers[0].mlp.experts.routed_experts
    src = policy.model.layers[0].mlp.experts
    assert needs_expert_repack(trainer)
    trainer.vllm_generation.sync_weights()          # TRL alone: the kernel is left with plain bytes
    assert torch.equal(experts.w13_weight, src.gate_up_proj) and not torch.equal(experts.w13_weight,
                                                                                   src.gate_up_proj.flip(-1))
    totals = repack_after_sync(trainer)
    for update in range(2):                          # each push after an update is re-packed again
        with torch.no_grad():
            src.gate_up_proj.add_(0.5)
            src.down_proj.mul_(1.5)
        trainer.vllm_generation.sync_weights()
        assert torch.equal(experts.w13_weight, src.gate_up_proj.detach().flip(-1))   # as a fresh load packs
        assert torch.equal(experts.w2_weight, src.down_proj.detach().flip(-1))
        assert totals == {"repacked": update + 1, "already_packed": 0, "neither": 0}
    assert len(resets) == 5                           # TRL's reset per push, and one after each re-pack


def test_a_module_holding_other_weights_is_never_repacked() -> None:
    trainer, _ = _colocated(_Model(_hf()), _TrainerModel(seed=1))
    experts = colocated_model(trainer).model.layers[0].mlp.experts.routed_experts
    totals = repack_after_sync(trainer)
    trainer.model = _TrainerModel(seed=2)            # the push wrote seed 1's experts, the trainer now holds others
    trainer.vllm_generation.sync_weights()
    held = experts.w13_weight.detach().clone()
    assert totals == {"repacked": 0, "already_packed": 0, "neither": 1}
    assert torch.equal(held, _TrainerModel(seed=1).model.layers[0].mlp.experts.gate_up_proj.detach())


def test_no_colocated_engine_needs_no_repack() -> None:
    plain = SimpleNamespace(model=_TrainerModel(seed=0))    # TRL's default: transformers' generate
    assert not needs_expert_repack(plain)
    server = SimpleNamespace(vllm_generation=SimpleNamespace(mode="server"), model=plain.model)
    assert not needs_expert_repack(server)
    with pytest.raises(ValueError, match="vllm_mode='colocate'"):
        repack_after_sync(server)


def _recordable(trainer: SimpleNamespace) -> SimpleNamespace:
    """``trainer`` with what `record_grpo` wraps and reads of a trl GRPOTrainer (never called here)."""
    from axrl.integrations.trl_grpo import _WRAPPED

    for name in _WRAPPED:
        setattr(trainer, name, lambda *a, **k: None)
    trainer.model.config = SimpleNamespace(_name_or_path="policy")
    trainer.accelerator, trainer.use_vllm, trainer.reward_weights = SimpleNamespace(num_processes=1), True, None
    trainer.add_callback = lambda callback: None
    return trainer


def test_record_grpo_warns_about_the_cpu_builds_push_and_repacks_when_asked(tmp_path: Path) -> None:
    from axrl.integrations.trl_grpo import record_grpo

    trainer, _ = _colocated(_Model(_hf()), _TrainerModel(seed=1))
    with pytest.warns(UserWarning, match="repack_vllm_cpu_experts=True"):
        record_grpo(_recordable(trainer), tmp_path / "warned")
    trainer, _ = _colocated(_Model(_hf()), _TrainerModel(seed=1))
    experts = colocated_model(trainer).model.layers[0].mlp.experts.routed_experts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record_grpo(_recordable(trainer), tmp_path / "repacked", repack_vllm_cpu_experts=True)
    trainer.vllm_generation.sync_weights()
    assert torch.equal(experts.w13_weight, trainer.model.model.layers[0].mlp.experts.gate_up_proj.detach().flip(-1))
    manifest = json.loads((tmp_path / "repacked" / "manifest.json").read_text())
    assert manifest["source"]["vllm_cpu_expert_repack"] is True
    engine_dtype = next(experts.parameters()).dtype       # the sampler's dtype sizes doctor's envelope
    config = yaml.safe_load((tmp_path / "repacked" / "config.yaml").read_text())
    assert config["rollout"]["dtype"] == str(engine_dtype).removeprefix("torch.") == "float32"
