"""The training config: YAML validated by pydantic, one section per component.

Sections map 1:1 onto the components they configure. Unknown keys, wrong types and impossible
values stop `axrl train` before any work starts, with the dotted key path in the message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, model_serializer, model_validator

from axrl.algo.distill import DistillSettings
from axrl.algo.loss_config import PolicyLossConfig
from axrl.core.settings import Section
from axrl.core.errors import ConfigError
from axrl.inference.sglang.settings import SGLangSettings
from axrl.inference.vllm.settings import VLLMSettings
from axrl.model.device import DEVICE_PATTERN
from axrl.ray_executor.settings import RaySettings
from axrl.runtime.recording.tiers import TierSettings
from axrl.runtime.recording.trackers import MlflowSettings, WandbSettings
from axrl.rollout.blackbox import AgentSettings
from axrl.inference.embedded.settings import EngineSettings
from axrl.runtime.evaluator import EvalSettings
from axrl.runtime.faults import Faults
from axrl.runtime.spike_trigger import SpikeSettings
from axrl.runtime.warmup import WarmupSettings
from axrl.train.torch.lora import LoRAConfig
from axrl.train.megatron.settings import MegatronLayout
from axrl.train.protocol import R3Scope
from axrl.train.settings import TrainSettings
from axrl.sync.settings import SyncSettings


class ModelSection(Section):
    preset: str | None = Field("tiny-moe", description="random-init preset (ignored when `path` is set)")
    path: str | None = Field(None, description="HF model directory to start from")
    init_seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    tool_parser: str | None = Field(None, description="tool-call parser by its vLLM/SGLang name (hermes, llama3_json, "
                                    "mistral, deepseek_v3, deepseek_v31, qwen3_coder, pythonic, openai, kimi_k2, "
                                    "glm45); default: read off the chat template")


class DataSection(Section):
    task: str = Field("calculator", description="env, reward and demonstrations: a built-in task, "
                      "'package.module:make_task' (or 'file.py:make_task'), or an `axrl.tasks` entry point")
    path: str | None = Field(None, description="JSONL/Parquet prompt file; default: the task's generator")
    reward: str | None = Field(None, description="'package.module:score' scoring single-turn replies to the "
                               "prompts of `path`; it replaces the task (`task` and `task_args` are not used)")
    prompts_per_step: int = Field(8, ge=1)
    task_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the task")

    @model_validator(mode="after")
    def _reward_needs_prompts(self) -> "DataSection":
        if self.reward is not None and self.path is None:
            raise ValueError("reward: a reward function scores the prompts of a file; set data.path")
        return self


_ROLLOUT_KEY_ORDER = ("engine", "sglang", "vllm", "group_size", "temperature", "top_p", "top_k", "max_new_tokens",
                      "max_turns", "max_context_len", "max_batch_size", "prefix_cache", "prefix_cache_tokens",
                      "weight_dtype", "precision", "kv_dtype", "exact")


class RolloutSection(EngineSettings):
    """`rollout`: the embedded engine's keys are its `EngineSettings` (axrl/inference/embedded/settings.py),
    plus the engine choice, the servers' sections, sampling, episode limits and the async policy."""

    engine: Literal["embedded", "sglang", "vllm"] = "embedded"
    sglang: SGLangSettings = Field(default_factory=SGLangSettings)
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="rollout.engine: vllm (docs/vllm.md)")
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO group)")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(48, ge=1, description="per assistant turn")
    max_turns: int = Field(4, ge=1)
    # -- asynchronous runs (runtime.mode: async; docs/train.md "Asynchronous runs")
    max_staleness: int = Field(1, ge=1, description="η: no trained token was generated more than η versions "
                                                     "before the weights it is trained with (async)")
    partial_rollout: Literal["continue", "recompute", "drop"] = Field(
        "continue", description="episodes running at a weight update: keep decoding, re-prefill under the "
                                "new weights, or drop their groups")
    stale_policy: Literal["rerun", "drop"] = Field("rerun", description="a complete group too stale to train")
    max_reruns: int = Field(2, ge=0, description="re-runs of a stale group before it is dropped")
    max_live_episodes: int = Field(0, ge=0, description="episodes running at once (0 = max_batch_size); new "
                                                        "groups start as places free up")
    release_memory: bool = Field(False, description="free the engine's KV cache (SGLang: its memory occupation) "
                                                     "while it waits for the trainer's next weights, for an engine "
                                                     "sharing a device with the trainer (runtime.mode: sync)")
    clock: Literal["auto", "iterations", "rounds"] = Field(
        "auto", description="deterministic runs: schedule rollout by engine iterations (embedded engine) or by "
                            "request rounds (any engine; auto picks iterations for embedded, rounds for a server)")

    @model_serializer(mode="wrap")
    def _key_order(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # run_dir/config.yaml keeps the documented order, as before the engine keys moved to the base class
        d = handler(self)
        return {k: d[k] for k in _ROLLOUT_KEY_ORDER if k in d} | d

    @model_validator(mode="after")
    def _top_k_not_zero(self) -> "RolloutSection":
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return self


class DynamicSamplingSection(Section):
    """DAPO dynamic sampling: roll out more prompts than a step trains and keep the first
    `data.prompts_per_step` groups whose rewards are not all equal (all-equal groups have zero
    advantage and only dilute the loss)."""

    enabled: bool = False
    oversample: float = Field(2.0, ge=1.0, description="prompts rolled out = ceil(prompts_per_step × oversample)")


class OverlongPenaltySection(Section):
    """DAPO soft overlong punishment, added to the reward: 0 up to max_len − cache_len generated
    tokens, then linearly down to −1 at max_len (and −1 beyond)."""

    max_len: int = Field(..., ge=2, description="L_max: generated tokens at which the penalty reaches −1")
    cache_len: int = Field(..., ge=1, description="L_cache: length of the linear ramp before max_len")

    @model_validator(mode="after")
    def _ramp(self) -> "OverlongPenaltySection":
        if self.cache_len >= self.max_len:
            raise ValueError(f"cache_len ({self.cache_len}) must be < max_len ({self.max_len})")
        return self


class AlgoSection(PolicyLossConfig):
    """The policy loss's own schema (`axrl.algo.loss_config.PolicyLossConfig`: one type, defaults and
    validation for the YAML and the loss) plus how advantages come from rewards."""

    advantage: Literal["grpo", "reinforce", "gae"] = Field(
        "grpo", description="grpo / reinforce: critic-free, from each sample's reward; gae: PPO's GAE over the "
                            "trained tokens from the `critic`'s values (axrl.algo.gae)")
    normalize_std: bool = True
    advantage_clip: float | None = Field(None, gt=0, description="clip sample advantages to [−c, c]")
    advantage_balance: bool = Field(False, description="scale negative advantages so their token mass "
                                                       "equals the positive mass")
    dynamic_sampling: DynamicSamplingSection = Field(default_factory=DynamicSamplingSection)
    overlong_penalty: OverlongPenaltySection | None = None
    credit: Literal["outcome", "turn"] = Field(
        "outcome", description="outcome: one advantage per sample from its total reward; turn: per-turn "
                               "discounted returns, group-normalised per turn index (axrl.algo.turn_credit)")
    gamma: float = Field(1.0, ge=0, le=1, description="per-turn discount of the returns of credit: turn (and of gae)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE's λ, per trained token (advantage: gae)")

    @model_validator(mode="after")
    def _turn_credit(self) -> "AlgoSection":
        if self.advantage == "gae" and self.advantage_balance:
            raise ValueError("algo.advantage_balance weighs per-sample advantages; advantage: gae gives per-token "
                             "ones (whitened over the batch): remove advantage_balance")
        if self.credit == "turn" and self.advantage not in ("grpo", "gae"):
            raise ValueError(f"credit: turn normalises returns per (group, turn index) and needs "
                             f"advantage: grpo (normalize_std: false for Dr. GRPO), got {self.advantage!r}")
        return self


_TRAIN_KEY_ORDER = ("backend", "megatron", "lr", "weight_decay", "betas", "grad_clip", "lr_schedule", "warmup_steps",
                    "updates_per_step", "micro_batch_tokens", "prefix_merge", "lora")


class TrainSection(TrainSettings):
    """`train`: the optimizer, schedule and micro-batching keys are the backends' own
    `TrainSettings` (axrl/train/settings.py: one type, defaults and validation for the YAML and
    `BackendConfig`), plus which backend trains, Megatron's layout, LoRA and updates per step."""

    backend: Literal["torch", "megatron"] = "torch"
    megatron: MegatronLayout = Field(default_factory=MegatronLayout)
    updates_per_step: int = Field(1, ge=1, description="optimizer updates per step (mini-batches)")
    lora: LoRAConfig | None = Field(None, description="train LoRA adapters instead of all weights (null = off)")

    @model_serializer(mode="wrap")
    def _key_order(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # run_dir/config.yaml keeps the order docs/config.md lists (backend first), as before the
        # optimizer keys moved into the base class
        d = handler(self)
        return {k: d[k] for k in _TRAIN_KEY_ORDER if k in d} | d

    @model_validator(mode="after")
    def _lora_needs_torch(self) -> "TrainSection":
        if self.lora is not None and self.backend != "torch":
            raise ValueError(f"train.lora is implemented by the torch backend only; set train.backend: torch "
                             f"(or remove train.lora), got train.backend: {self.backend}")
        return self


class CriticSection(Section):
    """PPO's learned value function (`algo.advantage: gae`; docs/algorithms.md "PPO with a critic"):
    the policy's architecture with a scalar value head instead of the LM head, its own AdamW."""

    model: str | None = Field(None, description="initial weights: null = the policy at RL start (after the warm-up; "
                                                "the head starts at 0); else a Hugging Face directory or a run's checkpoints/step_N")
    lr: float = Field(1e-5, gt=0, description="the critic's AdamW learning rate (constant)")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max total grad norm of the critic (0 = off)")
    updates_per_step: int = Field(1, ge=1, description="critic optimizer updates (mini-batches) per step")
    warmup_steps: int = Field(0, ge=0, description="first RL steps in which only the critic learns (the policy's "
                                                   "updates run and are recorded, then the policy's weights, optimizer "
                                                   "state and schedule are restored)")
    value_clip: float | None = Field(0.2, gt=0, description="PPO value clipping: V_old ± value_clip (null = off)")
    micro_batch_tokens: int = Field(0, ge=0, description="tokens per critic micro-batch counting padding "
                                                         "(0 = train.micro_batch_tokens)")


class CheckpointSection(Section):
    every: int = Field(5, ge=1, description="save every K steps (and at the end)")
    keep: int = Field(0, ge=0, description="keep the newest K checkpoints (0 = all)")
    quiescent: bool = Field(True, description="deterministic async runs drain the rollout pipeline at each "
                                              "checkpoint, so --resume continues the uninterrupted schedule bit for "
                                              "bit (costs one synchronous step per `every` steps); false: resume "
                                              "restarts the groups in flight under the checkpoint's weights")


_TRACE_KEY_ORDER = ("enabled", "routing", "write_queue", "routing_encoding", "sharded", "level", "routing_every",
                    "keep_full", "behaviour_logprob", "spike_ratio", "spike_window", "spike_min_history")


class TraceSection(TierSettings, SpikeSettings):
    """`trace`: `level`, `routing_every` and `keep_full` are the recorder's `TierSettings`
    (axrl/runtime/recording/tiers.py), `spike_*` the spike trigger's `SpikeSettings`
    (axrl/runtime/spike_trigger.py), plus what else is recorded."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    enabled: bool = True
    routing: bool = True
    write_queue: int = Field(2, ge=0, description="step files are written by a background thread, at most this "
                                                  "many steps queued (a full queue makes the step wait: "
                                                  "time_record_wait); 0 = write in the step")
    routing_encoding: Literal["raw", "packed"] = Field(
        "raw", description="raw: routing as [T, L, k] ids (one byte each); packed: the engine's ids bit-packed "
                           "(⌈log2 E⌉ bits) and the trainer's as its difference from them (about 2x smaller at "
                           "top-8 of 128; decoded on read, slower to analyse): for large MoE steps")
    sharded: bool | Literal["auto"] = Field("auto", description="ray: train ranks write their rows' routing to shard "
                                            "files, the learner an index; auto: 2+ train ranks or megatron")
    behaviour_logprob: bool = Field(False, description="also record each token's trainer logprob under the "
                                                       "weights that generated it (async: splits the mismatch "
                                                       "into engine and staleness parts)")

    @model_serializer(mode="wrap")
    def _key_order(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # run_dir/config.yaml keeps the documented order, as before the tier keys moved to the base class
        d = handler(self)
        return {k: d[k] for k in _TRACE_KEY_ORDER if k in d} | d

    @model_validator(mode="after")
    def _recording(self) -> "TraceSection":
        if self.sharded is True and not (self.routing and self.enabled):
            raise ValueError("sharded: true needs enabled and routing")
        if self.keep_full and self.spike_ratio is None:
            raise ValueError("keep_full: the ring is written when the spike trigger fires; set spike_ratio "
                             "(e.g. 2.0), or keep_full: 0")
        return self


class LoggingSection(Section):
    tensorboard: bool = Field(False, description="also write metrics as TensorBoard event files (RUN/tensorboard)")
    wandb: WandbSettings | None = Field(None, description="also log to a Weights & Biases run (null: off)")
    mlflow: MlflowSettings | None = Field(None, description="also log to an MLflow run (null: off)")


class RuntimeSection(Section):
    executor: Literal["local", "ray"] = Field("local", description="local: every component in this process; "
                                              "ray: rollout, engine, learner and train ranks as Ray actors "
                                              "(pip install 'axrl[ray]')")
    ray: RaySettings = Field(default_factory=RaySettings)
    threads: int = Field(1, ge=1, description="torch threads per process")
    deterministic: bool = Field(True, description="bitwise reproducible: fixed seeds and threads, and rollout "
                                                  "scheduled by counts (decode steps, finished groups), "
                                                  "never by wall time")
    mode: Literal["sync", "async"] = Field("sync", description="sync: roll out, then train; async: the engine "
                                                               "keeps generating while the trainer trains")
    device: str = Field("cpu", pattern=DEVICE_PATTERN, description="cpu, cuda or cuda:N: where the torch "
                        "trainer and the embedded engine hold the model")


class Config(Section):
    steps: int = Field(20, ge=1)
    seed: int = 0
    r3: bool = Field(False, description="replay rollout routing in the trainer (MoE only)")
    r3_scope: R3Scope | None = Field(None, description="partial R3: layers / loss tokens only")
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    algo: AlgoSection = Field(default_factory=AlgoSection)
    train: TrainSection = Field(default_factory=TrainSection)
    warmup: WarmupSettings = Field(default_factory=WarmupSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    trace: TraceSection = Field(default_factory=TraceSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    faults: Faults = Field(default_factory=Faults)
    sync: SyncSettings = Field(default_factory=SyncSettings, description="the sync sentinel: verify the engine "
                               "after every weight sync and resume (docs/debugging.md \"Sync sentinel\")")
    agent: AgentSettings | None = Field(None, description="a black-box agent plays the episodes (else the task's env)")
    distill: DistillSettings | None = Field(None, description="on-policy distillation from a teacher (off: None)")
    critic: CriticSection | None = Field(None, description="PPO's value model, for algo.advantage: gae (off: None)")

    @model_validator(mode="after")
    def _critic(self) -> "Config":
        if (self.algo.advantage == "gae") != (self.critic is not None):
            raise ValueError("algo.advantage: gae needs a `critic` section (its values), and a `critic` section is "
                             "used only by algo.advantage: gae; set both or neither")
        if self.critic is not None and self.train.lora is not None:
            raise ValueError("critic with train.lora is not supported (the critic trains all its weights): remove "
                             "train.lora or the critic")
        return self

    @model_validator(mode="after")
    def _model_source(self) -> "Config":
        if not self.model.preset and not self.model.path:
            raise ValueError("model: set `preset` or `path`")
        if self.runtime.device != "cpu" and self.train.backend != "torch":
            raise ValueError(f"runtime.device {self.runtime.device!r} places the torch backend and the embedded "
                             "engine; train.backend: megatron places its ranks itself (docs/megatron.md)")
        if self.r3_scope is not None and not self.r3:
            raise ValueError("r3_scope: set only with r3: true (it narrows which routing R3 replays); "
                             "remove r3_scope or set r3: true")
        return self

    @model_validator(mode="after")
    def _exact_mode(self) -> "Config":
        r = self.rollout
        if not r.exact:
            return self
        why = None
        if r.engine != "embedded":
            why = (f"rollout.engine: {r.engine} runs the server's own kernels, which this trainer cannot reproduce "
                   "bitwise; use rollout.engine: embedded")
        elif self.train.backend != "torch":
            why = (f"train.backend: {self.train.backend} computes with its own (tensor-parallel) kernels, not the "
                   "embedded model's exact op set; use train.backend: torch")
        elif r.weight_dtype != "fp32" or r.kv_dtype != "auto":
            why = ("rollout.weight_dtype / rollout.kv_dtype quantise the engine's weights or K/V, so it computes "
                   "with other numbers than the trainer; leave them fp32 / auto (model.dtype sets the precision)")
        elif self.train.lora is not None:
            why = "train.lora: the LoRA adapters' forward is not in the exact op set; set train.lora: null"
        elif self.runtime.mode == "async" and r.partial_rollout == "continue":
            why = ("rollout.partial_rollout: continue keeps decoding across a weight update over K/V computed "
                   "under the old weights, which no single version's forward reproduces; set "
                   "rollout.partial_rollout: recompute (or drop)")
        if why is not None:
            raise ValueError(f"rollout.exact: true cannot be exact here: {why}")
        return self

    @model_validator(mode="after")
    def _rollout_precision(self) -> "Config":
        r = self.rollout
        if r.engine != "embedded" and r.kv_dtype != "auto":
            raise ValueError(f"rollout.kv_dtype: {r.kv_dtype!r} is an embedded-engine setting; with rollout.engine: "
                             f"{r.engine} leave it 'auto' (pass the server's own KV flag in its server_args)")
        if r.precision == "fp8_w8a8" and r.weight_dtype == "bf16":
            raise ValueError("rollout.precision: fp8_w8a8 holds the weights in block fp8; rollout.weight_dtype: bf16 "
                             "contradicts it (leave weight_dtype at fp32 or set it to fp8)")
        if r.engine == "embedded" or (r.weight_dtype == "fp32" and r.precision == "auto"):
            return self
        if r.weight_dtype == "bf16":
            raise ValueError(f"rollout.weight_dtype: bf16 is an embedded-engine setting; an {r.engine} server "
                             "computes in model.dtype (set model.dtype: bfloat16)")
        if self.runtime.device == "cpu":
            what = "rollout.precision: fp8_w8a8" if r.precision == "fp8_w8a8" else "rollout.weight_dtype: fp8"
            raise ValueError(f"{what} with rollout.engine: {r.engine} needs a GPU: the server's "
                             "`--quantization fp8` has no CPU kernels; on CPU use rollout.engine: embedded "
                             "(which computes with the fp8-quantised weights) or rollout.weight_dtype: fp32")
        return self

    @model_validator(mode="after")
    def _server_engine(self) -> "Config":
        if self.rollout.clock == "iterations" and self.rollout.engine != "embedded":
            raise ValueError(f"rollout.clock: 'iterations' needs the embedded engine (an {self.rollout.engine} server "
                             "schedules its own iterations); use 'rounds' or 'auto'")
        if self.rollout.engine == "vllm":  # what vLLM cannot do in this run
            self.rollout.vllm.check_run(r3=self.r3, cpu=self.runtime.device == "cpu",
                                        release_memory=self.rollout.release_memory,
                                        asynchronous=self.runtime.mode == "async")
        return self

    @model_validator(mode="after")
    def _ray_scope(self) -> "Config":
        if self.runtime.executor != "ray":
            if self.trace.sharded is True:
                raise ValueError("trace.sharded: true needs runtime.executor: ray; set it to auto or false")
            return self
        if self.train.backend == "megatron" and self.runtime.ray.train_ranks != 1:
            raise ValueError("runtime.ray.train_ranks counts torch data-parallel ranks; the megatron backend's "
                             "ranks are train.megatron.tensor_parallel × data_parallel (leave train_ranks at 1)")
        p = self.runtime.ray.placement
        if self.runtime.device != "cpu" and (p.train_gpus <= 0 or (self.rollout.engine == "embedded"
                                                                    and p.engine_gpus <= 0)):
            raise ValueError(f"runtime.device {self.runtime.device!r} under runtime.executor: ray needs GPUs for the "
                             "actors that compute on it: set runtime.ray.placement.train_gpus (and engine_gpus for the "
                             "embedded engine), e.g. 0.5 each to colocate them on one GPU")
        if self.runtime.device == "cpu" and (p.train_gpus or p.engine_gpus):
            raise ValueError("runtime.ray.placement.train_gpus / engine_gpus reserve GPUs that a runtime.device: cpu "
                             "run would not use; set runtime.device: cuda")
        return self

    @model_validator(mode="after")
    def _agent(self) -> "Config":
        if self.agent is not None and self.runtime.deterministic:
            raise ValueError("agent: a black-box agent's calls arrive when its process makes them, not as a function "
                             "of counts; set runtime.deterministic: false")
        return self

    @model_validator(mode="after")
    def _release_memory(self) -> "Config":
        if self.rollout.release_memory and self.runtime.mode != "sync":
            raise ValueError("rollout.release_memory frees the engine's memory while the trainer trains, which needs "
                             "an idle engine: runtime.mode: sync (an async engine keeps generating)")
        return self

    @model_validator(mode="after")
    def _decoupled(self) -> "Config":
        # the loss of an asynchronous run is decoupled PPO unless algo.decoupled: false; refuse here,
        # before any work, what would drop or silently re-cap its behaviour weight
        self.algo.resolved(self.runtime.mode == "async")
        return self

    @model_validator(mode="after")
    def _async_rollout(self) -> "Config":
        if (self.runtime.mode == "async" and self.rollout.engine != "embedded" and not self.runtime.deterministic
                and self.rollout.partial_rollout == "continue"):
            raise ValueError("rollout.partial_rollout: 'continue' needs per-token weight versions, which AxRL does "
                             "not take from a server, when requests run across a weight update (runtime.deterministic: "
                             f"false); use 'recompute' (or 'drop') with rollout.engine={self.rollout.engine}")
        return self


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {path}: unknown key (check spelling; see docs/config.md)")
            continue
        got = e.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {path}: {e['msg']}{got_s}")
    return "\n".join(lines)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set rollout.group_size=4")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {e}") from e
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` strings (values parsed as YAML) to a nested dict."""
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a config file (None = all defaults)."""
    data: dict[str, Any] = {}
    source = "(defaults)"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain YAML-safe dict of the fully resolved config (what run_dir/config.yaml holds)."""
    return cfg.model_dump(mode="json")
