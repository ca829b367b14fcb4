"""Wire a run from its config and run it: settings from the config (`axrl.assembly.settings`),
then the components — in this process or as Ray actors; this is the one place that chooses —
then the loop (`axrl.runtime.loop`).

The config-level helpers below (`make_tokenizer(cfg)`, `make_train_backend(cfg, …)`, …) are what
replay and the debugger use to rebuild a recorded run's pieces exactly as training built them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from axrl.agents.tasks import Task
from axrl.algo import PolicyLoss
from axrl.algo.processor import AlgorithmProcessor
from axrl.assembly import settings as S
from axrl.config import Config
from axrl.data import PromptLoader
from axrl.core.errors import ConfigError
from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.quant import apply_rollout_precision
from axrl.model import ModelConfig, Qwen3ForCausalLM
from axrl.runtime.recording.events import EventLog
from axrl.rollout.agent_loop import opening
from axrl.rollout.pool import TrajectoryPool
from axrl.rollout.worker import RolloutWorker
from axrl.runtime import components as factories
from axrl.runtime.components import Components, RunSettings
from axrl.runtime.loop import check_run_dir
from axrl.runtime.loop import train as run_loop
from axrl.sync import WeightSync
from axrl.tokenizer import Tokenizer
from axrl.train.protocol import TrainBackend

__all__ = ["build_components", "check_context", "make_data", "make_embedded_engine", "make_engine_model",
           "make_processor", "make_rollout", "make_tokenizer", "make_train_backend", "policy_loss", "train"]


def train(cfg: Config, run_dir: str | Path, resume: bool = False) -> Path:
    """Run (or resume) a training run from its config; returns the run directory. Under
    `runtime.executor: ray` a lost train group resumes the run from its last checkpoint."""
    def once(resume: bool) -> Path:
        check_run_dir(Path(run_dir), resume)
        components = build_components(cfg)  # a config that cannot run fails before the run directory exists
        return run_loop(S.loop_settings(cfg), components, run_dir, resume=resume)

    if cfg.runtime.executor == "ray":
        from axrl.ray_executor.recovery import train_with_recovery

        return train_with_recovery(run_dir, resume, once, max_restarts=cfg.runtime.ray.train_restarts)
    return once(resume)


def build_components(cfg: Config) -> Components:
    """A run's long-lived components, in this process or as Ray actors (`runtime.executor`)."""
    settings = S.run_settings(cfg)
    tokenizer = factories.make_tokenizer(settings.model)
    task, loader = factories.make_data(settings.data)
    check_context(cfg, tokenizer, task, loader)
    if cfg.runtime.executor == "ray":
        return _build_on_ray(cfg, settings, tokenizer, task, loader)
    return factories.build_local(settings, tokenizer, task, loader)


def _build_on_ray(cfg: Config, settings: RunSettings, tokenizer: Tokenizer, task: Task,
                  loader: PromptLoader) -> Components:
    """The same components as Ray actors behind the same protocols (axrl/ray_executor/)."""
    from axrl.ray_executor.executor import RayExecutor

    events = EventLog()
    executor = RayExecutor(settings, cfg.runtime.ray, events)
    try:
        backend = executor.start_train_group()
        rollout = executor.start_rollout()
        executor.start_monitor()
    except BaseException:
        executor.close()
        raise
    return Components(tokenizer, task, loader, backend, None, None, rollout, rollout, None, rollout.evaluator,
                      events=events, executor=executor, record=settings.learner.record)


def check_context(cfg: Config, tokenizer: Tokenizer, task: Task, loader: PromptLoader, probe: int = 16) -> None:
    """Refuse a `rollout.max_context_len` that cannot hold the task's prompts with room to
    generate (the run would train on nothing), naming the prompt and its length."""
    r = cfg.rollout
    longest, where = max((len(opening(tokenizer, task.make_env(), loader.prompt_at(i))[1]),
                          loader.prompt_at(i).prompt_id) for i in range(probe))
    if longest >= r.max_context_len:
        raise ConfigError(f"rollout.max_context_len={r.max_context_len} cannot hold the task's prompts: prompt "
                          f"{where!r} renders to {longest} tokens, leaving no room to generate; set "
                          f"rollout.max_context_len to at least {longest + r.max_new_tokens} "
                          f"(the prompt + rollout.max_new_tokens={r.max_new_tokens})")


# -- a recorded run's pieces, rebuilt from its config (replay, the debugger, benchmarks) ------------

def make_tokenizer(cfg: Config) -> Tokenizer:
    """The run's tokenizer and chat template: `model.path`'s own, else the built-in one."""
    return factories.make_tokenizer(S.model_source(cfg))


def make_data(cfg: Config) -> tuple[Task, PromptLoader]:
    """The run's task and its prompt stream (position p = group p)."""
    return factories.make_data(S.data_settings(cfg))


def make_train_backend(cfg: Config, tokenizer: Tokenizer, *, compute_dtype: str | None = None,
                       megatron_group: Callable[..., Any] | None = None) -> TrainBackend:
    """The run's trainer before any state is loaded; `compute_dtype` overrides the forward's."""
    return factories.make_train_backend(S.model_source(cfg), S.backend_settings(cfg, compute_dtype=compute_dtype),
                                        tokenizer, megatron_group=megatron_group)


def make_engine_model(cfg: Config, model_config: ModelConfig, weights: dict[str, torch.Tensor]) -> Qwen3ForCausalLM:
    """The embedded engine's own copy of the policy (device and dtype of the run), holding `weights`."""
    model = factories.make_engine_model(S.model_source(cfg), model_config, weights)
    # The teacher-forced engine path (replay, explain) computes with the rollout's precision.
    return apply_rollout_precision(model, cfg.rollout.weight_dtype, cfg.rollout.precision)


def make_embedded_engine(cfg: Config, backend: TrainBackend, tokenizer: Tokenizer, *, clocked: bool) -> EmbeddedEngine:
    """An in-process engine of the run with its own copy of the trainer's weights."""
    return factories.make_embedded_engine(S.model_source(cfg), S.engine_settings(cfg), backend, tokenizer,
                                          clocked=clocked)


def make_engine(cfg: Config, tokenizer: Tokenizer, backend: TrainBackend) -> Any:
    """The run's `rollout.engine` (embedded, SGLang or vLLM), holding `backend`'s current weights."""
    return factories.make_engine(S.model_source(cfg), S.rollout_settings(cfg), backend, tokenizer)


def make_rollout(cfg: Config, tokenizer: Tokenizer, task: Task, loader: PromptLoader, engine: Any,
                 model_config: ModelConfig) -> tuple[RolloutWorker, WeightSync, TrajectoryPool]:
    """The run's rollout worker on `engine`, with its weight sync and pool (rollout replay)."""
    return factories.make_rollout(S.rollout_settings(cfg), tokenizer, task, loader, engine, model_config)


def make_processor(cfg: Config) -> AlgorithmProcessor:
    """The run's `AlgorithmProcessor` (rewards → advantages → packed batch)."""
    return factories.make_processor(S.learner_settings(cfg))


def policy_loss(cfg: Config) -> PolicyLoss:
    """The run's `LossFn`, from the `algo` section."""
    return S.step_settings(cfg).loss_fn
