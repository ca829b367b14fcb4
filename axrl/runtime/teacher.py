"""The teacher of on-policy distillation (`distill`, axrl/algo/distill.py): load it, check it
speaks the student's tokenizer, and score the step's packed samples.

A local teacher (`distill.teacher`: a Hugging Face directory, or an AxRL checkpoint
`RUN/checkpoints/step_N` rebuilt from its run's config.yaml) is held by a `TorchBackend` of its
own, so scoring is the trainer's logprob path itself — one batched, no-grad, teacher-forced
forward per micro-batch (`TorchBackend.forward`), log_softmax(logits / T) at each sampled token
with T the batch's (the rollout's) temperature, the quantity the engine reports for the student.
The teacher may be a different size; it must share the student's tokenizer, since it scores the
student's token ids. A served teacher (`distill.url`: SGLang or `axrl serve`) is scored over HTTP
by `axrl.runtime.served_teacher.ServedTeacher`, which this module's `make_teacher` builds too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import torch
import yaml

from axrl.algo.distill import DistillSettings
from axrl.core.errors import ConfigError
from axrl.model import Qwen3ForCausalLM, build_model, load_hf, load_weights_into, preset_config
from axrl.runtime.checkpoint import checkpoint_of
from axrl.tokenizer import Tokenizer, load_tokenizer
from axrl.train import TorchBackend, TorchBackendConfig
from axrl.train.checkpoint_files import read_checkpoint
from axrl.train.protocol import PackedBatch

__all__ = ["LocalTeacher", "Teacher", "load_teacher", "make_teacher", "tokenizer_difference"]


def tokenizer_difference(student: Tokenizer, teacher: Tokenizer) -> str | None:
    """What differs between two tokenizers, for the teacher to score the student's ids (None:
    nothing): the id count, the special tokens (id → text), then the first regular id whose text
    differs."""
    if student.vocab_size != teacher.vocab_size:
        return f"vocab_size {teacher.vocab_size} (the student's: {student.vocab_size})"
    s_special = {i: student.id_to_token(i) for i in student.special_token_ids}
    t_special = {i: teacher.id_to_token(i) for i in teacher.special_token_ids}
    if s_special != t_special:
        diff = sorted(set(s_special.items()) ^ set(t_special.items()))[:3]
        return f"special tokens differ, e.g. (id, token) {diff}"
    for i in range(student.vocab_size):
        if student.id_to_token(i) != teacher.id_to_token(i):
            return f"token id {i} is {teacher.id_to_token(i)!r} (the student's: {student.id_to_token(i)!r})"
    return None


def _checkpoint_run(path: Path) -> Path | None:
    """The run directory when `path` is an AxRL checkpoint (`RUN/checkpoints/step_N`)."""
    found = checkpoint_of(path)
    return None if found is None else found[0]


def _checkpoint_model(path: Path, run: Path, dtype: torch.dtype) -> tuple[Qwen3ForCausalLM, Tokenizer]:
    """The checkpoint's policy weights in the model its run's config.yaml describes (`model.path`
    or `model.preset`); only the weights: its optimizer and RNG states are the teacher run's."""
    recorded = yaml.safe_load((run / "config.yaml").read_text()) or {}
    model_cfg, train_cfg = recorded.get("model") or {}, recorded.get("train") or {}
    if train_cfg.get("lora") is not None:
        raise ConfigError(f"distill.teacher {path}: a LoRA checkpoint; export it first "
                          f"(axrl model export {run} --out DIR) and give that directory")
    tokenizer = load_tokenizer(model_cfg.get("path"))
    if model_cfg.get("path"):
        model = load_hf(model_cfg["path"], dtype=dtype)
    else:
        cfg = preset_config(model_cfg.get("preset") or "tiny-moe", vocab_size=tokenizer.vocab_size,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        model = build_model(cfg, seed=int(model_cfg.get("init_seed", 0)), dtype=dtype)
    state, sources = read_checkpoint(path)
    load_weights_into(model, state["model"], source=sources["model"])
    return model, tokenizer


def load_teacher(path: str, dtype: torch.dtype) -> tuple[Qwen3ForCausalLM, Tokenizer]:
    """The teacher model and its tokenizer from `distill.teacher`."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"distill.teacher {p}: no such directory (a Hugging Face model directory, as "
                          "`axrl model export` writes, or a run's checkpoints/step_N)")
    run = _checkpoint_run(p)
    if run is not None:
        return _checkpoint_model(p, run, dtype)
    try:
        tokenizer = load_tokenizer(p)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"distill.teacher: {str(e).removeprefix('model.path: ')}") from None
    return load_hf(p, dtype=dtype), tokenizer


class Teacher(Protocol):
    """What the step trainer asks of a teacher: `score(batch)` → float32 [T], 0 at each sample's
    position 0; `close()`."""

    def score(self, batch: PackedBatch) -> torch.Tensor: ...

    def close(self) -> None: ...


class LocalTeacher:
    """Scores packed batches with a teacher held in this process (see the module docstring)."""

    def __init__(self, model: Qwen3ForCausalLM, config: TorchBackendConfig) -> None:
        # No LoRA, and no process-global seeding or thread setting at construction: the student's
        # backend owns those, and building the teacher must not move the run's RNG state.
        own = config.model_copy(update=dict(lora=None, deterministic=False, num_threads=0, prefix_merge=False))
        # Its optimizer is never stepped (no state allocated); forward runs under no_grad.
        self.backend = TorchBackend(model, own)

    def score(self, batch: PackedBatch) -> torch.Tensor:
        """float32 [T]: the teacher's log_softmax(logits / batch.temperature) at each token given
        its sample's earlier tokens (position 0 of each sample: 0, it has no prediction)."""
        plain = dataclasses.replace(batch, old_logprobs=None, ref_logprobs=None, routed_experts=None)
        return self.backend.forward(plain).logprobs.float()

    def close(self) -> None:
        self.backend.close()


def make_teacher(s: DistillSettings, config: TorchBackendConfig, student: Tokenizer, *, device: torch.device,
                 dtype: torch.dtype) -> "Teacher":
    """The run's teacher, on the student's device (or behind `distill.url`), after checking the two
    tokenizers agree."""
    if s.url is not None:
        from axrl.runtime.served_teacher import connect_teacher  # httpx client: only for served teachers

        return connect_teacher(s.url, student, tokenizer_difference)
    assert s.teacher is not None
    model, tokenizer = load_teacher(s.teacher, dtype)
    diff = tokenizer_difference(student, tokenizer)
    if diff is not None:
        raise ConfigError(f"distill.teacher {s.teacher}: its tokenizer differs from the student's "
                          f"(model.path's): {diff}; the teacher scores the student's token ids, so both "
                          "need the same tokenizer")
    return LocalTeacher(model.to(device), config)
