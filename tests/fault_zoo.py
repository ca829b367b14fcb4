"""The fault zoo: faults injected through CODE hooks (never config keys `axrl-debug doctor` could
read), so the doctor must find each one from the trace the way it would find it in the wild.

Every injector is a context manager that patches one piece of the rollout side (the embedded
engine's weight load, its KV cache, its router, the first-token path) or of the trajectory builder
(the loss mask) for as long as it is active, and restores it on exit. `train_run` trains a small
run in this process, so the patches apply to it. Used by tests/test_doctor*.py and
bench/doctor_zoo.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
#: The zoo's small run: a micro MoE on the multi-turn echo task, a checkpoint per step (replay).
SMALL = ["model.preset=micro-moe", "warmup.steps=30", "data.task=echo", "data.task_args={}",
         "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "runtime.threads=1",
         "checkpoint.every=1", "rollout.max_new_tokens=12", "train.lr=1e-3",
         "algo.entropy_coef=0.01"]  # an entropy bonus: the weights move every step, whatever the reward


def train_run(path: Path, *settings: str, steps: int = 3) -> Path:
    """Train a small run at `path` in this process (active injectors apply) and return it."""
    from typer.testing import CliRunner

    from axrl.cli import app as axrl_app

    args = ["train", str(QUICKSTART), "--run-dir", str(path)]
    for s in [*SMALL, f"steps={steps}", *settings]:
        args += ["--set", s]
    result = CliRunner().invoke(axrl_app, args)
    if result.exit_code != 0:
        raise RuntimeError(f"training {path} failed: {result.output}\n{result.exception!r}")
    return path


@contextlib.contextmanager
def patched(owner: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace `owner.name` by `make(original)` while the block runs."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _engine_loads(transform: Callable[[dict[str, torch.Tensor], int, dict], dict[str, torch.Tensor]]):
    """Patch `EmbeddedEngine.update_weights` so every state dict it loads goes through
    `transform(weights, load_index, memory)` first (memory: a dict the transform may keep state in)."""
    from axrl.inference.embedded.engine import EmbeddedEngine

    memory: dict[str, Any] = {"loads": 0}

    def make(original):
        def update_weights(self, source, version=None):
            if isinstance(source, dict):
                source = transform(dict(source), memory["loads"], memory)
                memory["loads"] += 1
            return original(self, source, version)
        return update_weights
    return patched(EmbeddedEngine, "update_weights", make)


def stale_expert(layer: int, expert: int, *, scale: float = 1.0):
    """One expert of one layer is never updated by a weight sync: the engine keeps the tensors of
    the first load (scaled by `scale` towards it: 1.0 = fully stale, 0.1 = 10 % of the update lost)."""
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."

    def transform(w, n, memory):
        if n == 0:
            memory["first"] = {k: v.clone() for k, v in w.items() if k.startswith(prefix)}
            return w
        for k, v0 in memory["first"].items():
            w[k] = torch.lerp(w[k], v0, scale)  # exactly v0 at scale 1
        return w
    return _engine_loads(transform)


def stale_tensor(name: str, *, scale: float = 1.0):
    """One named (HF) tensor is never updated by a weight sync (attention, norm, router…)."""
    def transform(w, n, memory):
        if n == 0:
            memory["first"] = w[name].clone()
        else:
            w[name] = torch.lerp(w[name], memory["first"], scale)
        return w
    return _engine_loads(transform)


def skipped_sync(version_load: int, *, scale: float = 1.0):
    """The engine's `version_load`-th weight load (0 = the initial one) silently keeps the previous
    weights (the version number still advances): its step rolls out a version behind."""
    def transform(w, n, memory):
        prev = memory.get("prev")
        memory["prev"] = {k: v.clone() for k, v in w.items()}
        if n == version_load and prev is not None:
            return {k: torch.lerp(w[k], prev[k], scale) for k in w}  # exactly prev at scale 1
        return w
    return _engine_loads(transform)


def kv_cache_dtype(dtype: torch.dtype = torch.bfloat16):
    """The engine's KV cache holds keys and values rounded through `dtype` (a bf16 cache under an
    fp32 trainer)."""
    from axrl.inference.embedded.kv_cache import StaticKVCache

    def make(original):
        def stored(self, x):
            return original(self, x).to(dtype).to(x.dtype)
        return stored
    return patched(StaticKVCache, "stored", make)


def prefill_perturbation(eps: float = 1e-3):
    """The prefill path's last hidden state (what the first generated token of each turn is sampled
    from) is scaled by 1 + eps: a prefill kernel that differs from decode."""
    from axrl.inference.embedded.batch_forward import SlotBatch

    def make(original):
        def start_decoding(self, seqs, hidden):
            return original(self, seqs, hidden * (1.0 + eps))
        return start_decoding
    return patched(SlotBatch, "start_decoding", make)


def logprob_temperature(temperature: float = 1.0):
    """The engine samples at the request's temperature but reports the sampled tokens' logprobs at
    `temperature` (1.0: of the raw logits), another distribution than the one it sampled from."""
    from axrl_debug.analysis.doctor.hypotheses import logprobs_at
    return logprobs_at(temperature)


def context_drift(variant: str = "generation_prompt_rerendered"):
    """The engine is given another context than the trainer trains on: at every turn after the
    first, the request's tokens are rewritten by `variant` (axrl_debug/analysis/doctor/
    context_variants.py, e.g. the generation prompt re-rendered) while the trajectory, hence the
    trace, keeps the original stream."""
    from axrl_debug.analysis.doctor.context_variants import engine_given
    return engine_given(variant)


class _RouterNoise:
    """An activation probe that adds Gaussian noise to router logits (every other point untouched)."""

    def __init__(self, sigma: float, seed: int = 0) -> None:
        self.sigma, self.gen = sigma, torch.Generator().manual_seed(seed)

    def at(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        if point != "router":
            return x
        return x + self.sigma * torch.randn(x.shape, generator=self.gen, dtype=torch.float32).to(x.dtype)


@contextlib.contextmanager
def router_noise(sigma: float = 0.05, seed: int = 0) -> Iterator[None]:
    """The engine's router logits get Gaussian noise of std `sigma` (engine only: the trainer's
    forward is untouched), so with R3 off some tokens are routed differently."""
    from axrl.inference.embedded.decode import FusedDecoder
    from axrl.model.qwen3 import SparseMoeBlock

    noise = _RouterNoise(sigma, seed)

    def make_ffn(original):
        def _ffn(self, x, w, routing, probe=None, li=-1):
            return original(self, x, w, routing, probe or noise, li)
        return _ffn

    def make_moe(original):
        def forward(self, x, forced_experts=None, probe=None, layer=-1):
            if torch.is_inference_mode_enabled() and probe is None:
                probe = noise
            return original(self, x, forced_experts, probe, layer)
        return forward

    with patched(FusedDecoder, "_ffn", make_ffn), patched(SparseMoeBlock, "forward", make_moe):
        yield


def unmasked_observations(tokens: int | None = None):
    """The trainer's loss mask includes observation tokens (tokens after a trajectory's first
    generated one that the engine did not generate): the trainer trains tokens the engine never
    sampled. `tokens`: only the first that many observation tokens of each trajectory (None: all)."""
    from axrl.runtime.step_trainer import StepTrainer

    def make(original):
        def step(self, batch, step, timer):
            for traj in batch.trajectories:
                gen = traj.policy_version >= 0
                if gen.any():
                    mask = traj.loss_mask.copy()
                    obs = np.flatnonzero(mask[int(np.argmax(gen)):] == 0) + int(np.argmax(gen))
                    mask[obs if tokens is None else obs[:tokens]] = 1
                    traj.loss_mask = mask
            return original(self, batch, step, timer)
        return step
    return patched(StepTrainer, "step", make)


#: name → (injector factory of magnitude, the cause `doctor` must name, the default magnitude)
FAULTS: dict[str, tuple[Callable[[float], Any], str, float]] = {
    "stale_expert": (lambda m: stale_expert(1, 2, scale=m), "stale_tensor", 1.0),
    "skipped_sync": (lambda m: skipped_sync(2, scale=m), "weights_out_of_sync", 1.0),
    "bf16_kv_cache": (lambda m: kv_cache_dtype(torch.bfloat16), "kv_cache_precision", 1.0),
    "prefill_decode": (lambda m: prefill_perturbation(m), "prefill_decode", 1e-3),
    "router_noise": (lambda m: router_noise(m), "routing_flips", 0.05),
    "unmasked_observations": (lambda m: unmasked_observations(), "masking", 1.0),
    "logprob_temperature": (lambda m: logprob_temperature(m), "logprob_semantics", 1.0),
    "context_drift": (lambda m: context_drift(), "context_mismatch", 1.0),
}


def no_fault(_: float = 0.0):
    """A clean control."""
    return contextlib.nullcontext()


def finite(a: np.ndarray) -> np.ndarray:
    return a[np.isfinite(a)]


def graded_reward():
    """Not a fault: the echo task's final reward becomes graded ((len(reply) mod 4) / 3) so a tiny
    model's groups have non-zero advantages and a policy gradient (`doctor --validate` measures it)."""
    from axrl.agents.env import StepOutcome
    from axrl.agents.tasks.echo import EchoEnv

    def make(original):
        def step(self, action):
            outcome = original(self, action)
            if outcome.done:
                return StepOutcome(outcome.observation, (len(action) % 4) / 3, True, outcome.info)
            return outcome
        return step
    return patched(EchoEnv, "step", make)
