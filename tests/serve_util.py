"""Helpers shared by the `axrl serve` / SGLang client tests: a tiny model directory, real server
processes on free localhost ports, and an in-process engine on the same weights as reference."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from axrl.inference import EmbeddedEngine, GenerateRequest
from axrl.inference.sglang.launcher import SGLangLauncher, free_port
from axrl.model import build_model, load_hf, preset_config, save_hf
from axrl.tokenizer import Tokenizer

SERVE = [sys.executable, "-m", "axrl.cli", "serve"]
MAX_BATCH, MAX_SEQ = 16, 1024


def make_model_dir(path: Path, seed: int = 0) -> Path:
    """A random-init tiny MoE (4 layers, 8 experts, top-2) with the default tokenizer, as an HF dir."""
    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return save_hf(build_model(cfg, seed=seed), path, tokenizer=tok)


def launch(model_dir: Path, num_servers: int = 1, log_dir: Path | None = None) -> SGLangLauncher:
    """Start `axrl serve` processes (one torch thread each) and wait until they are healthy."""
    launcher = SGLangLauncher(model_dir, num_servers=num_servers, base_port=free_port(), command=SERVE,
                              server_args=["--enable-return-routed-experts", "--max-running-requests",
                                           str(MAX_BATCH), "--context-length", str(MAX_SEQ)],
                              env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=120, log_dir=log_dir)
    launcher.start()
    return launcher


def reference(model_dir: Path) -> EmbeddedEngine:
    """The in-process engine the servers must agree with (same weights, slots, context)."""
    return EmbeddedEngine(load_hf(model_dir), max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ)


def perturbed(state_dict: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Weights that visibly change the model's outputs."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state_dict.items()}


def copies(requests: list[GenerateRequest]) -> list[GenerateRequest]:
    return [copy.deepcopy(r) for r in requests]
