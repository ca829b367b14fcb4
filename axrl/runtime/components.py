"""Build a run's components from its config: the one place that maps config sections onto
constructors.

Used by the loop (`axrl train`) and by replay, which must build the trainer exactly as training
did — so replay imports this module, never the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from axrl.agents.proxy import ProxyServer
from axrl.agents.proxy.service import AgentService
from axrl.agents.tasks import Task
from axrl.agents.tasks.resolve import resolve_task
from axrl.algo.processor import AlgorithmProcessor, prompts_to_roll_out
from axrl.config import Config, ConfigError
from axrl.data import PromptLoader
from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.protocol import InferenceEngine, SamplingParams
from axrl.model import ModelConfig, Qwen3ForCausalLM, build_model, load_hf, load_weights_into, preset_config
from axrl.model.device import resolve_device
from axrl.rollout.agent_loop import opening
from axrl.rollout.blackbox import AgentSpec, BlackBoxPlayer, load_callable
from axrl.rollout.control import BatchSource, RolloutControl
from axrl.rollout.pool import TrajectoryPool
from axrl.rollout.runner import Clock, RolloutSettings
from axrl.rollout.schedule import Schedule
from axrl.rollout.worker import RolloutPolicy, RolloutWorker
from axrl.runtime.evaluator import Evaluator
from axrl.runtime.events import EventLog
from axrl.runtime.learner import Learner, StepLearner
from axrl.runtime.train_worker import TrainWorker
from axrl.sync import WeightSync
from axrl.tokenizer import Tokenizer, load_tokenizer
from axrl.trace import RunDir
from axrl.train import TorchBackend, TorchBackendConfig
from axrl.train.protocol import TrainBackend


@dataclass
class Components:
    """The long-lived parts of a run (docs/architecture.md): data → rollout worker → pool →
    train worker, with the weights going back through `sync`; plus the evaluator.

    Under `runtime.executor: ray` the rollout side (engine, worker, pool, agent proxy, evaluator)
    lives in the rollout actor and the train worker in the learner actor: `rollout` and `pool`
    are then one driver-side handle, and `engine`, `sync`, `trainer` and `proxy` are None here."""

    tokenizer: Tokenizer
    task: Task
    loader: PromptLoader
    backend: TrainBackend
    engine: InferenceEngine | None
    sync: WeightSync | None
    pool: BatchSource
    rollout: RolloutControl
    trainer: TrainWorker | None
    evaluator: Evaluator | None
    events: EventLog = field(default_factory=EventLog)   # faults and recoveries (RUN/events.jsonl)
    executor: Any = None                                 # runtime.executor: ray — its RayExecutor
    proxy: ProxyServer | None = None   # the black-box agent's recording proxy (config `agent`)

    def attach(self, run_path: Path) -> None:
        """Record the run's events (this process' and its actors') into `run_path` from now on."""
        self.events.attach(run_path)
        if self.executor is not None:
            self.executor.attach(run_path)

    def close(self) -> None:
        """Stop the rollout worker, the engines and the trainer's workers (in that order)."""
        try:
            self.rollout.stop()
        finally:
            try:
                if self.proxy is not None:
                    self.proxy.stop()
                if self.engine is not None:
                    self.engine.shutdown()
                if self.evaluator is not None:
                    self.evaluator.close()
                self.backend.close()
            finally:
                if self.executor is not None:
                    self.executor.close()


@dataclass
class RolloutSide:
    """The rollout half of a run around its engine: worker, the weight sync it listens to, the
    pool it fills, the black-box agent's proxy (if any) and the evaluator (if `eval.every`)."""

    rollout: RolloutWorker
    sync: WeightSync
    pool: TrajectoryPool
    proxy: ProxyServer | None
    evaluator: Evaluator | None


def rollout_clock(cfg: Config) -> Clock:
    """How rollout is scheduled (`axrl.rollout.clock`): free-running unless `runtime.deterministic`;
    then by engine iterations (the embedded engine, built clocked) or by request rounds (an SGLang
    server, or the embedded engine with `rollout.clock: rounds`, e.g. to compare the two)."""
    if not cfg.runtime.deterministic:
        return "free"
    if cfg.rollout.clock != "auto":
        return cfg.rollout.clock
    return "iterations" if cfg.rollout.engine == "embedded" else "rounds"


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


def build_components(cfg: Config) -> Components:
    tokenizer = make_tokenizer(cfg)
    task, loader = make_data(cfg)
    check_context(cfg, tokenizer, task, loader)
    events = EventLog()
    if cfg.runtime.executor == "ray":
        # The same components as Ray actors behind the same protocols (axrl/runtime/ray/).
        from axrl.runtime.ray.executor import RayExecutor

        executor = RayExecutor(cfg, events)
        try:
            backend: TrainBackend = executor.start_train_group()
            rollout = executor.start_rollout()
            executor.start_monitor()
        except BaseException:
            executor.close()
            raise
        return Components(tokenizer, task, loader, backend, None, None, rollout, rollout, None,
                          rollout.evaluator, events=events, executor=executor)
    backend = make_train_backend(cfg, tokenizer)
    engine = make_engine(cfg, backend, tokenizer)
    side = make_rollout_side(cfg, tokenizer, task, loader, engine, backend.model_config,
                             lambda clocked: make_embedded_engine(cfg, backend, tokenizer, clocked=clocked))
    trainer = TrainWorker(backend, AlgorithmProcessor.from_config(cfg), cfg, side.sync,
                          backend.model_config.num_experts)
    return Components(tokenizer, task, loader, backend, engine, side.sync, side.pool, side.rollout, trainer,
                      side.evaluator, events=events, proxy=side.proxy)


def make_rollout_side(cfg: Config, tokenizer: Tokenizer, task: Task, loader: PromptLoader, engine: InferenceEngine,
                      model_config: ModelConfig, eval_engine: Callable[[bool], InferenceEngine]) -> RolloutSide:
    """Everything around the rollout engine (in the run's process, or in the Ray rollout actor):
    the black-box agent's proxy and its agent service, the rollout worker, and the evaluator on an
    engine of its own (`eval_engine(clocked)`)."""
    proxy, player = make_agent(cfg, tokenizer)
    rollout, sync, pool = make_rollout(cfg, tokenizer, task, loader, engine, model_config, player=player)
    if proxy is not None:  # agents with their own engine push into the same pool
        proxy.registry.service = AgentService(
            tokenizer, pool.add, current_version=lambda: sync.version, max_context_len=cfg.rollout.max_context_len,
            routing_shape=model_config.routing_shape())
    evaluator = None
    if cfg.eval.every:
        r, sampling = cfg.rollout, rollout.settings.sampling
        eval_settings = RolloutSettings(group_size=cfg.eval.samples_per_prompt, sampling=sampling,
                                        max_turns=r.max_turns, max_context_len=r.max_context_len, return_routing=False)
        eval_clock: Clock = "free" if rollout_clock(cfg) == "free" else "iterations"
        evaluator = Evaluator(eval_engine(eval_clock == "iterations"), tokenizer, task, eval_settings,
                              prompts=cfg.eval.prompts, seed=cfg.seed, clock=eval_clock, player=player)
    return RolloutSide(rollout, sync, pool, proxy, evaluator)


def open_learner(cfg: Config, c: Components, run: RunDir) -> StepLearner:
    """The run's learner, recording into `run`: in-process, or the Ray learner actor's handle."""
    if c.executor is not None:
        return c.executor.start_learner(run.path, c.backend, c.rollout)
    assert c.trainer is not None
    return Learner(cfg, c.trainer, run)


def make_rollout(cfg: Config, tokenizer: Tokenizer, task: Task, loader: PromptLoader, engine: InferenceEngine,
                 model_config: ModelConfig, player: BlackBoxPlayer | None = None,
                 ) -> tuple[RolloutWorker, WeightSync, TrajectoryPool]:
    """The rollout worker of a run on `engine`, with the weight sync it listens to and the pool it
    fills (rollout replay builds them the same way); `player`: a black-box agent plays the episodes."""
    r = cfg.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, stop_token_ids=tokenizer.stop_token_ids)
    settings = RolloutSettings(group_size=r.group_size, sampling=sampling, max_turns=r.max_turns,
                               max_context_len=r.max_context_len, return_routing=model_config.is_moe)
    # Dynamic sampling (DAPO) rolls out more groups per step than it trains (the processor keeps
    # the informative ones): batches are sealed at that size.
    schedule = Schedule(cfg.runtime.mode, prompts_to_roll_out(cfg), r.max_staleness, clocked=cfg.runtime.deterministic)
    policy = RolloutPolicy(partial_rollout=r.partial_rollout, stale_policy=r.stale_policy, max_reruns=r.max_reruns,
                           max_live_episodes=r.max_live_episodes or r.max_batch_size, release_memory=r.release_memory)
    sync = WeightSync(version=0)
    pool = TrajectoryPool(r.group_size)
    rollout = RolloutWorker(engine, tokenizer, task.make_env, loader, settings, schedule, policy, sync, pool,
                            clock=rollout_clock(cfg), seed=cfg.seed, threads=cfg.runtime.threads, player=player)
    return rollout, sync, pool


def make_data(cfg: Config) -> tuple[Task, PromptLoader]:
    """The run's task and its prompt stream (position p = group p)."""
    task = resolve_task(cfg.data, warmup=cfg.warmup.steps > 0, evaluate=cfg.eval.every > 0)
    loader = (PromptLoader.from_file(cfg.data.path, seed=cfg.seed) if cfg.data.path
              else PromptLoader.from_task(task, seed=cfg.seed))
    return task, loader


def make_agent(cfg: Config, tokenizer: Tokenizer) -> tuple[ProxyServer | None, BlackBoxPlayer | None]:
    """The black-box agent of config section `agent`: its proxy (started) and the episode player."""
    a = cfg.agent
    if a is None:
        return None, None
    try:
        spec = AgentSpec(command=a.command, function=load_callable(a.function, "agent.function"),
                         prompt_via=a.prompt_via, timeout_s=a.timeout_s, max_concurrent=a.max_concurrent,
                         verifier=load_callable(a.verifier, "agent.verifier"), env=dict(a.env),
                         model_name=a.model_name, render_tools=a.render_tools, fork_server=a.fork_server)
        proxy = ProxyServer(tokenizer, model_name=a.model_name, host=a.host, port=a.port,
                            allow_remote=a.allow_remote, coalesce_window_s=a.coalesce_ms / 1000).start()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return proxy, BlackBoxPlayer(spec, proxy, max_context_len=cfg.rollout.max_context_len)


def make_tokenizer(cfg: Config) -> Tokenizer:
    """The run's tokenizer and chat template: `model.path`'s own, else the built-in one."""
    return load_tokenizer(cfg.model.path)


def initial_model(cfg: Config, tokenizer: Tokenizer) -> Qwen3ForCausalLM:
    """The policy before any training: `model.path` loaded, or a random-init `model.preset`."""
    dtype = getattr(torch, cfg.model.dtype)
    device = resolve_device(cfg.runtime.device)
    if cfg.model.path:
        return load_hf(cfg.model.path, dtype=dtype).to(device)
    model_cfg = preset_config(cfg.model.preset, vocab_size=tokenizer.vocab_size,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return build_model(model_cfg, seed=cfg.model.init_seed, dtype=dtype).to(device)


def make_train_backend(cfg: Config, tokenizer: Tokenizer, *, compute_dtype: str | None = None,
                       megatron_group: Callable[..., Any] | None = None) -> TrainBackend:
    """The RL trainer of a run, before any state is loaded (replay builds it the same way).

    `compute_dtype` ("float32" | "bfloat16") overrides the forward's compute dtype (a replay
    what-if); the weights, gradients and optimizer state keep the model's dtype.
    `megatron_group` builds the Megatron backend's ranks (Ray actors under `runtime.executor: ray`).
    """
    model = initial_model(cfg, tokenizer)
    t = cfg.train
    common = dict(
        lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, total_steps=cfg.steps * t.updates_per_step,
        micro_batch_tokens=t.micro_batch_tokens, seed=cfg.seed, num_threads=cfg.runtime.threads,
        deterministic=cfg.runtime.deterministic, prefix_merge=t.prefix_merge)
    if compute_dtype is not None:
        common["dtype"] = compute_dtype
    if t.backend == "megatron":
        # Imported here: `import axrl` and the torch path never import megatron-core (2-6 s).
        from axrl.train.megatron import MegatronBackend, MegatronBackendConfig

        m = t.megatron
        return MegatronBackend(model, MegatronBackendConfig(
            **common, tensor_parallel=m.tensor_parallel, expert_parallel=m.expert_parallel,
            sequence_parallel=m.sequence_parallel, moe_dispatcher=m.moe_dispatcher,
            data_parallel=m.data_parallel), tokenizer=tokenizer, group=megatron_group)
    return TorchBackend(model, TorchBackendConfig(**common), tokenizer=tokenizer)


def make_engine(cfg: Config, backend: TrainBackend, tokenizer: Tokenizer) -> InferenceEngine:
    """The rollout engine of a run, holding the trainer's current weights."""
    if cfg.rollout.engine == "sglang":
        # Launches (or connects to) SGLang / `axrl serve` servers holding an exported copy of the model.
        from axrl.inference.sglang.factory import build_sglang_engine

        return build_sglang_engine(cfg, backend, tokenizer)
    return make_embedded_engine(cfg, backend, tokenizer, clocked=rollout_clock(cfg) == "iterations")


def fresh_engine_model(cfg: Config, model_config: ModelConfig) -> Qwen3ForCausalLM:
    """A model of the policy's shape on the run's device and dtype, for an engine to load weights into."""
    return Qwen3ForCausalLM(model_config).to(resolve_device(cfg.runtime.device), getattr(torch, cfg.model.dtype)).eval()


def make_engine_model(cfg: Config, model_config: ModelConfig, weights: dict[str, torch.Tensor]) -> Qwen3ForCausalLM:
    """The embedded engine's own copy of the policy (device and dtype of the run), holding `weights`."""
    model = fresh_engine_model(cfg, model_config)
    load_weights_into(model, weights, source="the trainer's weights")
    return model


def make_embedded_engine(cfg: Config, backend: TrainBackend, tokenizer: Tokenizer, *, clocked: bool) -> EmbeddedEngine:
    """An in-process engine with its own copy of the trainer's weights, as a remote server would
    hold; weight sync copies into it. A clocked engine is stepped by its rollout driver."""
    model = make_engine_model(cfg, backend.model_config, dict(backend.named_weights()))
    return embedded_engine_for(cfg, model, tokenizer, clocked=clocked)


def embedded_engine_for(cfg: Config, model: Qwen3ForCausalLM, tokenizer: Tokenizer, *, clocked: bool) -> EmbeddedEngine:
    """The embedded engine of a run around `model` (also what a Ray engine actor builds)."""
    return EmbeddedEngine(model.eval(), max_batch_size=cfg.rollout.max_batch_size,
                          max_seq_len=cfg.rollout.max_context_len, eos_token_id=tokenizer.eos_token_id,
                          clocked=clocked, prefix_cache=cfg.rollout.prefix_cache,
                          prefix_cache_tokens=cfg.rollout.prefix_cache_tokens)
