"""The components of a run, built from settings objects (never from the config: `axrl.assembly`
maps config sections onto these settings, then calls the factories here — in this process, or
inside the Ray actors of `axrl.ray_executor`, which are handed the same settings).

Each factory takes the small settings object of what it builds; `RunSettings` is only their
bundle, so a Ray actor can be handed the parts it builds from.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

from axrl.agents.proxy import ProxyServer
from axrl.agents.proxy.trajectories import AgentService
from axrl.agents.tasks import Task
from axrl.agents.tasks.resolve import resolve_task
from axrl.algo.processor import AdvantageSettings, AlgorithmProcessor
from axrl.algo.distill import DistillSettings
from axrl.data import PromptLoader
from axrl.core.errors import ConfigError
from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.protocol import InferenceEngine, SamplingParams
from axrl.inference.embedded.settings import EngineSettings
from axrl.inference.sglang.settings import ServedModel, SGLangSettings
from axrl.inference.vllm.settings import VLLMSettings
from axrl.model import (ModelConfig, Qwen3ForCausalLM, build_model, hf_state_dict, load_hf, load_weights_into,
                        preset_config)
from axrl.model.device import resolve_device
from axrl.model.exact import set_exact
from axrl.rollout.blackbox import AgentSettings, BlackBoxPlayer
from axrl.rollout.control import BatchSource, RolloutControl
from axrl.rollout.pool import TrajectoryPool
from axrl.rollout.runner import Clock, RolloutSettings
from axrl.rollout.schedule import Schedule
from axrl.rollout.worker import RolloutPolicy, RolloutWorker
from axrl.runtime.evaluator import EvalSettings, Evaluator
from axrl.runtime.recording.events import EventLog
from axrl.runtime.learner import Learner, RecordSettings, StepLearner
from axrl.runtime.step_trainer import TrainStepSettings, StepTrainer
from axrl.sync import WeightSync
from axrl.sync.engine_side import engine_side
from axrl.sync.settings import SyncSettings
from axrl.sync.verify import SyncSentinel
from axrl.tokenizer import Tokenizer, load_tokenizer
from axrl.trace import RunDir
from axrl.train import TorchBackend, TorchBackendConfig
from axrl.train.critic import Critic, CriticConfig
from axrl.train.protocol import TrainBackend

if TYPE_CHECKING:
    from axrl.runtime.teacher import Teacher


# -- settings ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSource:
    """Where the policy comes from and where it lives: `path` (an HF directory, with its own
    tokenizer) or a random-init `preset`; dtype and device of the trainer and the embedded engine."""

    path: str | None = None
    preset: str | None = "tiny-moe"
    init_seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"
    tool_parser: str | None = None  # model.tool_parser: overrides the parser read off the chat template

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class BackendSettings:
    """The train backend: which one, and its constructor's config (`TorchBackendConfig`, or
    `MegatronBackendConfig` for `kind="megatron"`)."""

    kind: Literal["torch", "megatron"]
    config: TorchBackendConfig
    critic: CriticConfig | None = None      # PPO's value model (algo.advantage: gae), on either backend
    critic_model: str | None = None         # its initial weights (None: the policy's initial model)


@dataclass(frozen=True)
class DataSettings:
    """The task and its prompt stream: a built-in or user task (`task`, `task_args`), or a prompt
    file scored by a `reward` function; whether the run needs demonstrations (warm-up) and held-out
    prompts (evaluation)."""

    task: str = "calculator"
    path: str | None = None
    reward: str | None = None
    task_args: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    warmup: bool = False
    evaluate: bool = False


@dataclass(frozen=True)
class RolloutSideSettings:
    """Everything around the rollout engine: sampling, episode limits, the schedule and what it
    does with episodes caught by weight updates, the agent (if black-box) and the evaluator."""

    engine: Literal["embedded", "sglang", "vllm"]
    embedded: EngineSettings
    sglang: SGLangSettings | None
    vllm: VLLMSettings | None
    served: ServedModel
    group_size: int
    sampling: SamplingParams            # stop_token_ids: the tokenizer's, added where it is built
    max_turns: int
    schedule: Schedule
    policy: RolloutPolicy
    clock: Clock
    seed: int
    threads: int
    agent: AgentSettings | None = None
    eval: EvalSettings = field(default_factory=EvalSettings)


@dataclass(frozen=True)
class LearnerSettings:
    """The learner: advantages and packing, the train step, and what is recorded."""

    advantages: AdvantageSettings
    keep_groups: int | None          # dynamic sampling: groups trained of those rolled out
    temperature: float               # the rollout's: the trainer's logprobs use it too
    step: TrainStepSettings
    record: RecordSettings
    distill: DistillSettings | None = None   # on-policy distillation's teacher (off: None)


@dataclass(frozen=True)
class RunSettings:
    """The bundle a run is built from (`axrl.assembly.run_settings(cfg)`)."""

    model: ModelSource
    data: DataSettings
    backend: BackendSettings
    rollout: RolloutSideSettings
    learner: LearnerSettings
    threads: int = 1
    sync: SyncSettings = field(default_factory=SyncSettings)   # the sync sentinel (YAML section `sync`)


# -- the components --------------------------------------------------------------------------------

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
    trainer: StepTrainer | None
    evaluator: Evaluator | None
    events: EventLog = field(default_factory=EventLog)   # faults and recoveries (RUN/events.jsonl)
    executor: Any = None                                 # runtime.executor: ray — its RayExecutor
    proxy: ProxyServer | None = None   # the black-box agent's recording proxy (config `agent`)
    record: RecordSettings = field(default_factory=RecordSettings)   # what the local learner records

    def open_learner(self, run: RunDir) -> StepLearner:
        """The run's learner, recording into `run`: in-process, or the Ray learner actor's handle."""
        if self.executor is not None:
            return self.executor.start_learner(run.path, self.backend, self.rollout)
        assert self.trainer is not None
        return Learner(self.trainer, run, self.record)

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


def build_local(s: RunSettings, tokenizer: Tokenizer, task: Task, loader: PromptLoader) -> Components:
    """Every component of a run in this process (`runtime.executor: local`), around the run's
    tokenizer and prompt stream (`make_tokenizer(s.model)`, `make_data(s.data)`)."""
    backend = make_train_backend(s.model, s.backend, tokenizer)
    engine = make_engine(s.model, s.rollout, backend, tokenizer)
    side = make_rollout_side(s.rollout, tokenizer, task, loader, engine, backend.model_config,
                             lambda clocked: make_embedded_engine(s.model, s.rollout.embedded, backend, tokenizer,
                                                                  clocked=clocked))
    trainer = make_step_trainer(s.learner, backend, side.sync)
    c = Components(tokenizer, task, loader, backend, engine, side.sync, side.pool, side.rollout, trainer,
                   side.evaluator, proxy=side.proxy, record=s.learner.record)
    side.rollout.sentinel = make_sentinel(s.sync, engine, backend.model_config, c.events)
    return c


def make_sentinel(s: SyncSettings, engine: InferenceEngine, model_config: ModelConfig,
                  events: EventLog) -> SyncSentinel | None:
    """The sync sentinel of `engine` (None when `sync.verify: off`, or for an engine it cannot read:
    said once in the events), recording its findings in `events`."""
    if s.verify == "off":
        return None
    side = engine_side(engine, model_config.vocab_size)
    if side is None:
        events.record("sync_unverified", engine=type(engine).__name__, verify=s.verify,
                      why="the sync sentinel cannot read this engine's weights (docs/engines.md)")
        return None
    return SyncSentinel(s, side, model_config, record=events.record, run_path=lambda: events.run_path)


def make_processor(s: LearnerSettings) -> AlgorithmProcessor:
    """Rewards → advantages → the packed batch, as the learner builds it."""
    return AlgorithmProcessor(temperature=s.temperature, settings=s.advantages, keep_groups=s.keep_groups)


def make_step_trainer(s: LearnerSettings, backend: TrainBackend, sync: WeightSync) -> StepTrainer:
    """The trainer side of a step over `backend`, posting new weights to `sync` (with the
    distillation teacher when `distill` is set)."""
    return StepTrainer(backend, make_processor(s), s.step, sync, backend.model_config.num_experts,
                       distill=s.distill, teacher=make_distill_teacher(s.distill, backend),
                       critic=getattr(backend, "critic", None))  # the backend's value model (gae)


def make_distill_teacher(s: DistillSettings | None, backend: TrainBackend) -> Teacher | None:
    """On-policy distillation's teacher (None when off), on
    the torch trainer's device and dtype, micro-batched like it; beside a Megatron backend (whose
    ranks hold the policy elsewhere) on the CPU in float32."""
    if s is None:
        return None
    from axrl.runtime.teacher import make_teacher  # loads model weights: only for distillation runs

    if isinstance(backend, TorchBackend):
        param = next(backend.model.parameters())
        return make_teacher(s, backend.config, backend.tokenizer, device=param.device, dtype=param.dtype)
    # one micro-batch per batch (no token limit), as before BackendConfig took the YAML's 4096
    return make_teacher(s, TorchBackendConfig(micro_batch_tokens=0), backend.tokenizer, device=torch.device("cpu"),
                        dtype=torch.float32)


def make_rollout_side(s: RolloutSideSettings, tokenizer: Tokenizer, task: Task, loader: PromptLoader,
                      engine: InferenceEngine, model_config: ModelConfig,
                      eval_engine: Callable[[bool], InferenceEngine]) -> RolloutSide:
    """Everything around the rollout engine (in the run's process, or in the Ray rollout actor):
    the black-box agent's proxy and its agent service, the rollout worker, and the evaluator on an
    engine of its own (`eval_engine(clocked)`)."""
    proxy, player = make_agent(s.agent, tokenizer, s.embedded.max_context_len)
    rollout, sync, pool = make_rollout(s, tokenizer, task, loader, engine, model_config, player=player)
    if proxy is not None:  # agents with their own engine push into the same pool
        proxy.registry.service = AgentService(
            tokenizer, pool.add, current_version=lambda: sync.version, max_context_len=s.embedded.max_context_len,
            routing_shape=model_config.routing_shape())
    evaluator = None
    if s.eval.every:
        eval_settings = RolloutSettings(group_size=s.eval.samples_per_prompt, sampling=rollout.settings.sampling,
                                        max_turns=s.max_turns, max_context_len=s.embedded.max_context_len,
                                        return_routing=False)
        eval_clock: Clock = "free" if s.clock == "free" else "iterations"
        evaluator = Evaluator(eval_engine(eval_clock == "iterations"), tokenizer, task, eval_settings,
                              prompts=s.eval.prompts, seed=s.seed, clock=eval_clock, player=player)
    return RolloutSide(rollout, sync, pool, proxy, evaluator)


def make_rollout(s: RolloutSideSettings, tokenizer: Tokenizer, task: Task, loader: PromptLoader,
                 engine: InferenceEngine, model_config: ModelConfig, player: BlackBoxPlayer | None = None,
                 ) -> tuple[RolloutWorker, WeightSync, TrajectoryPool]:
    """The rollout worker of a run on `engine`, with the weight sync it listens to and the pool it
    fills (rollout replay builds them the same way); `player`: a black-box agent plays the episodes."""
    sampling = SamplingParams(max_new_tokens=s.sampling.max_new_tokens, temperature=s.sampling.temperature,
                              top_p=s.sampling.top_p, top_k=s.sampling.top_k, stop_token_ids=tokenizer.stop_token_ids)
    settings = RolloutSettings(group_size=s.group_size, sampling=sampling, max_turns=s.max_turns,
                               max_context_len=s.embedded.max_context_len, return_routing=model_config.is_moe)
    sync = WeightSync(version=0)
    pool = TrajectoryPool(s.group_size)
    rollout = RolloutWorker(engine, tokenizer, task.make_env, loader, settings, s.schedule, s.policy, sync, pool,
                            clock=s.clock, seed=s.seed, threads=s.threads, player=player)
    return rollout, sync, pool


def make_data(s: DataSettings) -> tuple[Task, PromptLoader]:
    """The run's task and its prompt stream (position p = group p)."""
    task = resolve_task(s, warmup=s.warmup, evaluate=s.evaluate)
    loader = (PromptLoader.from_file(s.path, seed=s.seed) if s.path else PromptLoader.from_task(task, seed=s.seed))
    return task, loader


def make_agent(a: AgentSettings | None, tokenizer: Tokenizer,
               max_context_len: int) -> tuple[ProxyServer | None, BlackBoxPlayer | None]:
    """The black-box agent: its proxy (started) and the episode player (None, None without one).
    A ConfigError names the `agent.*` key at fault."""
    if a is None:
        return None, None
    try:
        proxy = ProxyServer(tokenizer, model_name=a.model_name, host=a.host, port=a.port,
                            allow_remote=a.allow_remote, coalesce_window_s=a.coalesce_ms / 1000)
        player = BlackBoxPlayer(a, proxy, max_context_len=max_context_len)  # imports `function` / `verifier`
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return proxy.start(), player


def make_tokenizer(source: ModelSource) -> Tokenizer:
    """The run's tokenizer and chat template: `model.path`'s own, else the built-in one."""
    return load_tokenizer(source.path, source.tool_parser)


def initial_model(source: ModelSource, tokenizer: Tokenizer) -> Qwen3ForCausalLM:
    """The policy before any training: `path` loaded, or a random-init `preset`."""
    device = resolve_device(source.device)
    if source.path:
        return load_hf(source.path, dtype=source.torch_dtype).to(device)
    model_cfg = preset_config(source.preset, vocab_size=tokenizer.vocab_size,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return build_model(model_cfg, seed=source.init_seed, dtype=source.torch_dtype).to(device)


def make_train_backend(source: ModelSource, s: BackendSettings, tokenizer: Tokenizer, *,
                       megatron_group: Callable[..., Any] | None = None) -> TrainBackend:
    """The RL trainer of a run, before any state is loaded (replay builds it the same way).
    `megatron_group` builds the Megatron backend's ranks (Ray actors under `runtime.executor: ray`)."""
    model = initial_model(source, tokenizer)
    if s.kind == "megatron":
        # Imported here: `import axrl` and the torch path never import megatron-core (2-6 s).
        from axrl.train.megatron import MegatronBackend

        body = None if s.critic is None or s.critic_model is None else critic_body(source, s.critic_model, tokenizer)
        if body is not None and body.config != model.config:  # said before any rank starts
            raise ConfigError(f"critic.model {s.critic_model}: train.backend megatron builds the critic with the "
                              "policy's architecture and parallel layout, and this model's config differs; give "
                              "a model of the policy's architecture (or use train.backend: torch)")
        backend = MegatronBackend(model, s.config, tokenizer=tokenizer, group=megatron_group)
        if s.critic is not None:  # the value model on the backend's ranks (axrl/train/megatron/critic.py)
            backend.attach_critic(s.critic, None if body is None else hf_state_dict(body),
                                  source=f"critic.model {s.critic_model}")
        return backend
    critic = None if s.critic is None else make_critic(source, s, tokenizer, model)
    backend = TorchBackend(model, s.config, tokenizer=tokenizer)
    backend.critic = critic
    return backend


def make_critic(source: ModelSource, s: BackendSettings, tokenizer: Tokenizer, policy: Qwen3ForCausalLM) -> Critic:
    """PPO's value model: the policy's architecture (its weights at RL start are copied in after
    the warm-up, `Critic.copy_policy`), or `critic.model` (a Hugging Face directory or a run's
    checkpoints/step_N, with the policy's tokenizer)."""
    assert s.critic is not None
    if s.critic_model is None:
        return Critic(copy.deepcopy(policy), s.critic)
    body = critic_body(source, s.critic_model, tokenizer)
    return Critic(body.to(resolve_device(source.device)), s.critic, from_policy=False)


def critic_body(source: ModelSource, path: str, tokenizer: Tokenizer) -> Qwen3ForCausalLM:
    """`critic.model`'s decoder (a Hugging Face directory or a run's checkpoints/step_N), which must
    read the policy's tokens (same tokenizer)."""
    from axrl.runtime.teacher import load_teacher, tokenizer_difference

    body, its_tokenizer = load_teacher(path, source.torch_dtype)
    diff = tokenizer_difference(tokenizer, its_tokenizer)
    if diff is not None:
        raise ConfigError(f"critic.model {path}: its tokenizer differs from the policy's ({diff}); "
                          "the critic reads the policy's tokens: give a model with the same tokenizer")
    return body


def make_engine(source: ModelSource, s: RolloutSideSettings, backend: TrainBackend,
                tokenizer: Tokenizer) -> InferenceEngine:
    """The rollout engine of a run, holding the trainer's current weights."""
    if s.engine == "sglang":
        # Launches (or connects to) SGLang / `axrl serve` servers holding an exported copy of the model.
        from axrl.inference.sglang.factory import build_sglang_engine

        assert s.sglang is not None
        return build_sglang_engine(s.sglang, s.served, backend, tokenizer)
    if s.engine == "vllm":
        from axrl.inference.vllm.factory import build_vllm_engine

        assert s.vllm is not None
        return build_vllm_engine(s.vllm, s.served, backend)
    return make_embedded_engine(source, s.embedded, backend, tokenizer, clocked=s.clock == "iterations")


def fresh_engine_model(source: ModelSource, model_config: ModelConfig) -> Qwen3ForCausalLM:
    """A model of the policy's shape on the run's device and dtype, for an engine to load weights into."""
    return Qwen3ForCausalLM(model_config).to(resolve_device(source.device), source.torch_dtype).eval()


def make_engine_model(source: ModelSource, model_config: ModelConfig,
                      weights: dict[str, torch.Tensor]) -> Qwen3ForCausalLM:
    """The embedded engine's own copy of the policy (device and dtype of the run), holding `weights`."""
    model = fresh_engine_model(source, model_config)
    load_weights_into(model, weights, source="the trainer's weights")
    return model


def make_embedded_engine(source: ModelSource, s: EngineSettings, backend: TrainBackend, tokenizer: Tokenizer, *,
                         clocked: bool) -> EmbeddedEngine:
    """An in-process engine with its own copy of the trainer's weights, as a remote server would
    hold; weight sync copies into it. A clocked engine is stepped by its rollout driver."""
    model = make_engine_model(source, backend.model_config, dict(backend.named_weights()))
    return embedded_engine_for(s, model, tokenizer, clocked=clocked)


def embedded_engine_for(s: EngineSettings, model: Qwen3ForCausalLM, tokenizer: Tokenizer, *,
                        clocked: bool) -> EmbeddedEngine:
    """The embedded engine of a run around `model` (also what a Ray engine actor builds)."""
    if s.exact:  # true on-policy: the fused decoder runs the trainer's op set (axrl/model/exact.py)
        set_exact(model, True)
    return EmbeddedEngine(model.eval(), max_batch_size=s.max_batch_size, max_seq_len=s.max_context_len,
                          decode_impl="fused",
                          eos_token_id=tokenizer.eos_token_id, clocked=clocked, prefix_cache=s.prefix_cache,
                          prefix_cache_tokens=s.prefix_cache_tokens, weight_dtype=s.weight_dtype,
                          kv_dtype=s.kv_dtype, precision=s.precision)
