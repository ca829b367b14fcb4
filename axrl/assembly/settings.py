"""Config → settings: each config section becomes the small settings object of the component it
configures. The one place (with `axrl.assembly.build`) that reads `axrl.config`; everything below
takes these objects, so a component can be built — in this process or in a Ray actor — without
knowing the YAML.
"""

from __future__ import annotations

import math
from typing import TypeVar

from axrl.algo.loss_config import PolicyLossConfig
from axrl.algo.processor import AdvantageSettings
from axrl.config import Config, config_to_dict
from axrl.inference.protocol import SamplingParams
from axrl.inference.quant import effective_weight_dtype, server_quantization_args
from axrl.inference.sglang.settings import ServedModel, SGLangSettings
from axrl.inference.remote.settings import ServerFleetSettings
from axrl.inference.vllm.settings import VLLMSettings
from axrl.rollout.runner import Clock
from axrl.rollout.schedule import Schedule
from axrl.rollout.worker import RolloutPolicy
from axrl.inference.embedded.settings import EngineSettings
from axrl.runtime.components import (BackendSettings, DataSettings, LearnerSettings, ModelSource,
                                     RolloutSideSettings, RunSettings)
from axrl.runtime.learner import RecordSettings
from axrl.runtime.loop import LoopSettings
from axrl.runtime.step_trainer import TrainStepSettings
from axrl.train import TorchBackendConfig
from axrl.train.critic import CriticConfig
from axrl.train.protocol import R3

__all__ = ["advantage_settings", "backend_settings", "data_settings", "engine_settings",
           "learner_settings", "loop_settings", "loss_config", "model_source", "prompts_to_roll_out",
           "rollout_clock", "rollout_settings", "routing_replay", "run_settings", "step_settings"]


def run_settings(cfg: Config) -> RunSettings:
    """Everything a run is built from."""
    return RunSettings(model=model_source(cfg), data=data_settings(cfg), backend=backend_settings(cfg),
                       rollout=rollout_settings(cfg), learner=learner_settings(cfg), threads=cfg.runtime.threads,
                       sync=cfg.sync)


# -- model and trainer ----------------------------------------------------------------------------

def model_source(cfg: Config, *, dtype: str | None = None) -> ModelSource:
    """`model` + `runtime.device`; `dtype` overrides `model.dtype` (a replay what-if)."""
    m = cfg.model
    return ModelSource(path=m.path, preset=m.preset, init_seed=m.init_seed, dtype=dtype or m.dtype,  # type: ignore[arg-type]
                       device=cfg.runtime.device, tool_parser=m.tool_parser)


def backend_settings(cfg: Config, *, compute_dtype: str | None = None) -> BackendSettings:
    """`train` (+ the run's seed, threads, determinism). `compute_dtype` ("float32" | "bfloat16")
    overrides the forward's compute dtype (a replay what-if); weights, gradients and optimizer
    state keep the model's dtype."""
    t = cfg.train
    common = dict(
        **t.train_settings(), total_steps=cfg.steps * t.updates_per_step, seed=cfg.seed,
        num_threads=cfg.runtime.threads, deterministic=cfg.runtime.deterministic)
    if compute_dtype is not None:
        common["dtype"] = compute_dtype
    critic, critic_model = critic_config(cfg, common), None if cfg.critic is None else cfg.critic.model
    if t.backend == "megatron":
        from axrl.train.megatron import MegatronBackendConfig  # imports no megatron-core

        return BackendSettings("megatron", MegatronBackendConfig(**common, **t.megatron.layout()),
                               critic=critic, critic_model=critic_model)
    return BackendSettings("torch", TorchBackendConfig(**common, lora=t.lora, exact=cfg.rollout.exact), critic=critic,
                           critic_model=critic_model)


def critic_config(cfg: Config, common: dict) -> CriticConfig | None:
    """`critic` (None when off): its own optimizer, the run's micro-batching, threads and determinism."""
    c = cfg.critic
    if c is None:
        return None
    return CriticConfig(**{**common, "lr": c.lr, "weight_decay": c.weight_decay, "grad_clip": c.grad_clip,
                           "lr_schedule": "constant", "warmup_steps": 0,
                           "micro_batch_tokens": c.micro_batch_tokens or common["micro_batch_tokens"]},
                        value_clip=c.value_clip, updates_per_step=c.updates_per_step)


# -- the train step ----------------------------------------------------------------------------------

def loss_config(cfg: Config) -> PolicyLossConfig:
    """The policy loss's knobs: the `algo` section without its advantage knobs (same type), for the
    run's mode (`algo.decoupled: null` is decoupled PPO in an asynchronous run)."""
    return cfg.algo.loss_fields().resolved(cfg.runtime.mode == "async")


def routing_replay(cfg: Config) -> R3:
    """The backends' `r3` argument from `r3` and `r3_scope`: off, full or a partial `R3Scope`."""
    if not cfg.r3 or cfg.r3_scope is None:
        return cfg.r3
    return cfg.r3_scope


def step_settings(cfg: Config) -> TrainStepSettings:
    """What the trainer does with each sealed batch."""
    behaviour = cfg.trace.behaviour_logprob
    return TrainStepSettings(
        loss=loss_config(cfg), r3=routing_replay(cfg), updates_per_step=cfg.train.updates_per_step,
        behaviour_logprob=behaviour,
        # Behaviour logprobs of tokens up to η versions old need those versions' weights.
        keep_versions=cfg.rollout.max_staleness if behaviour and cfg.runtime.mode == "async" else 0,
        faults=cfg.faults, seed=cfg.seed, critic_warmup_steps=0 if cfg.critic is None else cfg.critic.warmup_steps)


def advantage_settings(cfg: Config) -> AdvantageSettings:
    """How sample advantages come from rewards (`algo.advantage`, `normalize_std`, clip, balance,
    overlong penalty, `credit` and its `gamma`)."""
    a = cfg.algo
    estimator = "dr_grpo" if a.advantage == "grpo" and not a.normalize_std else a.advantage
    ol = a.overlong_penalty
    return AdvantageSettings(estimator, a.advantage_clip, a.advantage_balance,
                             None if ol is None else (ol.max_len, ol.cache_len), a.credit, a.gamma, a.lam)


def learner_settings(cfg: Config) -> LearnerSettings:
    """Advantages, the train step and what is recorded."""
    t = cfg.trace
    return LearnerSettings(
        advantages=advantage_settings(cfg),
        keep_groups=cfg.data.prompts_per_step if cfg.algo.dynamic_sampling.enabled else None,
        temperature=cfg.rollout.temperature, step=step_settings(cfg),
        record=RecordSettings(trace=t.enabled, routing=t.routing, write_queue=t.write_queue,
                              routing_encoding=t.routing_encoding, sharded=trace_sharded(cfg),
                              tiers=t.tier_settings(),
                              spike=t.spike_settings()),
        distill=cfg.distill)


def trace_sharded(cfg: Config) -> bool:
    """`trace.sharded` resolved: auto is on under the ray executor with several train processes
    (2+ torch ranks, or Megatron's head and ranks) recording routing (a `keep_full` ring's rows
    are then held by the ranks)."""
    t = cfg.trace
    if t.sharded != "auto":
        return bool(t.sharded)
    several = cfg.runtime.ray.train_ranks > 1 or cfg.train.backend == "megatron"
    return cfg.runtime.executor == "ray" and several and t.enabled and t.routing


# -- rollout -------------------------------------------------------------------------------------------

def rollout_clock(cfg: Config) -> Clock:
    """How rollout is scheduled (`axrl.rollout.clock`): free-running unless `runtime.deterministic`;
    then by engine iterations (the embedded engine, built clocked) or by request rounds (an SGLang
    server, or the embedded engine with `rollout.clock: rounds`, e.g. to compare the two)."""
    if not cfg.runtime.deterministic:
        return "free"
    if cfg.rollout.clock != "auto":
        return cfg.rollout.clock
    return "iterations" if cfg.rollout.engine == "embedded" else "rounds"


def prompts_to_roll_out(cfg: Config) -> int:
    """Prompts a step rolls out: `data.prompts_per_step`, more with dynamic sampling (its oversample)."""
    ds = cfg.algo.dynamic_sampling
    n = cfg.data.prompts_per_step
    return math.ceil(n * ds.oversample) if ds.enabled else n


def data_settings(cfg: Config) -> DataSettings:
    """`data` (+ whether the run warms up and evaluates: what the task must provide)."""
    d = cfg.data
    return DataSettings(task=d.task, path=d.path, reward=d.reward, task_args=dict(d.task_args), seed=cfg.seed,
                        warmup=cfg.warmup.steps > 0, evaluate=cfg.eval.every > 0)


def engine_settings(cfg: Config) -> EngineSettings:
    """The embedded engine's slots, context and prefix cache (`rollout.*`)."""
    return cfg.rollout.engine_settings()


ServerT = TypeVar("ServerT", bound=ServerFleetSettings)


def with_server_quantization(s: ServerT, weight_dtype: str) -> ServerT:
    """`rollout.sglang` / `rollout.vllm`, with `--quantization fp8` when `rollout.weight_dtype: fp8`
    (GPU only; the config refuses it on CPU). Unverified until a GPU run. Both servers' online
    `--quantization fp8` quantises activations dynamically as well, so `rollout.precision: fp8_w8a8`
    asks for the same flag."""
    extra = server_quantization_args(weight_dtype)
    if not extra or "--quantization" in s.server_args:  # the user's own flag wins
        return s
    return s.model_copy(update={"server_args": [*s.server_args, *extra]})


def sglang_settings(cfg: Config) -> SGLangSettings:
    """`rollout.sglang` with the run's server quantisation flags."""
    return with_server_quantization(cfg.rollout.sglang, effective_weight_dtype(cfg.rollout.weight_dtype,
                                                                               cfg.rollout.precision))


def vllm_settings(cfg: Config) -> VLLMSettings:
    """`rollout.vllm` with the run's server quantisation flags."""
    return with_server_quantization(cfg.rollout.vllm, effective_weight_dtype(cfg.rollout.weight_dtype,
                                                                             cfg.rollout.precision))


def rollout_settings(cfg: Config) -> RolloutSideSettings:
    """`rollout` (+ `agent`, `eval` and the run's mode, seed and threads): the rollout side."""
    r = cfg.rollout
    # Dynamic sampling (DAPO) rolls out more groups per step than it trains (the processor keeps
    # the informative ones): batches are sealed at that size.
    schedule = Schedule(cfg.runtime.mode, prompts_to_roll_out(cfg), r.max_staleness, clocked=cfg.runtime.deterministic,
                        drain_every=cfg.checkpoint.every if cfg.checkpoint.quiescent else 0)
    policy = RolloutPolicy(partial_rollout=r.partial_rollout, stale_policy=r.stale_policy, max_reruns=r.max_reruns,
                           max_live_episodes=r.max_live_episodes or r.max_batch_size, release_memory=r.release_memory)
    served = ServedModel(max_batch_size=r.max_batch_size, max_context_len=r.max_context_len, seed=cfg.seed,
                         threads=cfg.runtime.threads, dtype=cfg.model.dtype, prefix_cache=r.prefix_cache)
    return RolloutSideSettings(
        engine=r.engine, embedded=engine_settings(cfg), sglang=sglang_settings(cfg) if r.engine == "sglang" else None,
        vllm=vllm_settings(cfg) if r.engine == "vllm" else None,
        served=served, group_size=r.group_size,
        sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                top_k=r.top_k),
        max_turns=r.max_turns, schedule=schedule, policy=policy, clock=rollout_clock(cfg), seed=cfg.seed,
        threads=cfg.runtime.threads, agent=cfg.agent,
        eval=cfg.eval)


# -- the loop ---------------------------------------------------------------------------------------------

def loop_settings(cfg: Config) -> LoopSettings:
    """`steps`, `eval.every`, `checkpoint`, `warmup`, `logging` and what the run directory records."""
    return LoopSettings(
        steps=cfg.steps, seed=cfg.seed, eval_every=cfg.eval.every, checkpoint_every=cfg.checkpoint.every,
        checkpoint_keep=cfg.checkpoint.keep, warmup=cfg.warmup,
        needs_reference=cfg.algo.kl_coef > 0, tensorboard=cfg.logging.tensorboard,
        wandb=cfg.logging.wandb, mlflow=cfg.logging.mlflow,
        config=config_to_dict(cfg),
        manifest={"backend": cfg.train.backend, "engine": cfg.rollout.engine, "mode": cfg.runtime.mode,
                  "rollout_clock": rollout_clock(cfg), "rollout_weight_dtype": cfg.rollout.weight_dtype,
                  "rollout_kv_dtype": cfg.rollout.kv_dtype, "rollout_precision": cfg.rollout.precision,
                  "rollout_exact": cfg.rollout.exact,
                  "corrections": loss_config(cfg).effective_corrections()})
