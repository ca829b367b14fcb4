"""The training config: YAML validated by pydantic, one section per component.

Sections map 1:1 onto the components they configure. Unknown keys, wrong types and impossible
values stop `axrl train` before any work starts, with the dotted key path in the message.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from axrl.algo.loss_config import PolicyLossConfig
from axrl.config_faults import FaultsSection
from axrl.config_section import Section
from axrl.core.errors import ConfigError
from axrl.inference.sglang.settings import SGLangSettings
from axrl.inference.vllm.settings import VLLMSettings
from axrl.model.device import DEVICE_PATTERN
from axrl.ray_executor.settings import RaySettings
from axrl.runtime.recording.trackers import MlflowSettings, WandbSettings
from axrl.train.torch.lora import LORA_TARGETS


class ModelSection(Section):
    preset: str | None = Field("tiny-moe", description="random-init preset (ignored when `path` is set)")
    path: str | None = Field(None, description="HF model directory to start from")
    init_seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"


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


class RolloutSection(Section):
    engine: Literal["embedded", "sglang", "vllm"] = "embedded"
    sglang: SGLangSettings = Field(default_factory=SGLangSettings)
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="rollout.engine: vllm (docs/vllm.md)")
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO group)")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(48, ge=1, description="per assistant turn")
    max_turns: int = Field(4, ge=1)
    max_context_len: int = Field(512, ge=8)
    max_batch_size: int = Field(64, ge=1, description="engine slots (concurrent sequences)")
    prefix_cache: bool = Field(True, description="embedded engine: reuse the K/V of cached prompt prefixes "
                                                 "(earlier turns, a group's shared prompt); docs/prefix-merge.md")
    prefix_cache_tokens: int = Field(0, ge=0, description="embedded engine: prefix-cache pool in tokens "
                                                          "(0 = max_batch_size × max_context_len)")
    weight_dtype: Literal["fp32", "bf16", "fp8"] = Field(
        "fp32", description="precision of the rollout engine's linear weights, quantised from the trainer's at "
                            "every sync (fp8: e4m3, 128×128 block scales; router, lm_head, embeddings and norms "
                            "keep model.dtype); docs/debugging.md \"Low-precision rollout\"")
    kv_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="embedded engine: K/V cache precision (auto = model.dtype; fp8: e4m3, one scale per "
                            "token and head)")
    exact: bool = Field(False, description="true on-policy: the embedded engine and the torch trainer run one "
                                            "batch- and position-invariant op set (axrl/model/exact.py), so rollout "
                                            "logprobs and MoE routing equal the trainer's bitwise; docs/train.md "
                                            "\"True on-policy\"")
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


class MegatronSection(Section):
    """`train.backend: megatron` layout (docs/megatron.md): world size = tensor_parallel ×
    data_parallel worker processes on one machine (one in-process rank when 1)."""

    tensor_parallel: int = Field(1, ge=1, description="TP size (sequence parallel within it)")
    expert_parallel: int = Field(1, ge=1, description="EP size; must divide tensor_parallel × data_parallel")
    data_parallel: int = Field(0, ge=0, description="DP size; 0 = the smallest that fits expert_parallel: "
                                                    "EP / gcd(TP, EP)")
    sequence_parallel: bool = Field(True, description="required when tensor_parallel > 1")
    moe_dispatcher: Literal["alltoall", "allgather"] = "alltoall"

    @model_validator(mode="after")
    def _layout(self) -> "MegatronSection":
        tp, ep, dp = self.tensor_parallel, self.expert_parallel, self.data_parallel
        if dp and (tp * dp) % ep:  # Megatron's rule (expert TP 1): EP divides the world size
            raise ValueError(f"expert_parallel={ep} must divide tensor_parallel × data_parallel = {tp} × {dp} "
                             f"(the world size); set data_parallel to a multiple of {ep // math.gcd(tp, ep)}, "
                             "or 0 to derive it")
        if self.tensor_parallel > 1 and not self.sequence_parallel:
            raise ValueError("tensor_parallel > 1 needs sequence_parallel: true (Megatron MoE + TP training)")
        return self


class LoRASection(Section):
    """`train.lora`: LoRA adapters on a frozen base model (torch backend; docs/algorithms.md "LoRA")."""

    rank: int = Field(8, ge=1, description="r: the adapters' inner dimension")
    alpha: float = Field(16.0, gt=0, description="the adapter output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while training")
    targets: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1,
                               description="what gets adapters: attn (q/k/v/o_proj), mlp (dense layers' "
                                           "gate/up/down_proj), experts (each MoE expert's gate/up/down_proj)")

    @field_validator("targets")
    @classmethod
    def _known_targets(cls, targets: list[str]) -> list[str]:
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"unknown target(s) {unknown}; choose from {list(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets repeat a name: {targets}")
        return targets


class TrainSection(Section):
    backend: Literal["torch", "megatron"] = "torch"
    megatron: MegatronSection = Field(default_factory=MegatronSection)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    updates_per_step: int = Field(1, ge=1, description="optimizer updates per step (mini-batches)")
    micro_batch_tokens: int = Field(4096, ge=1, description="tokens per micro-batch counting padding (samples × longest)")
    prefix_merge: bool = Field(False, description="train each micro-batch as one prefix tree: shared prefixes "
                                                  "computed once (docs/prefix-merge.md); the budget then counts "
                                                  "tree slots")
    lora: LoRASection | None = Field(None, description="train LoRA adapters instead of all weights (null = off)")

    @model_validator(mode="after")
    def _lora_needs_torch(self) -> "TrainSection":
        if self.lora is not None and self.backend != "torch":
            raise ValueError(f"train.lora is implemented by the torch backend only; set train.backend: torch "
                             f"(or remove train.lora), got train.backend: {self.backend}")
        return self


class WarmupSection(Section):
    """Supervised warm-up on the task's demonstrations before RL (skipped on --resume)."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)


class EvalSection(Section):
    """Held-out evaluation: the same prompts and sampling seeds every time, so evaluations of
    successive policies differ only by the policy."""

    every: int = Field(0, ge=0, description="evaluate before every K-th step and after the last (0 = off)")
    prompts: int = Field(32, ge=1)
    samples_per_prompt: int = Field(2, ge=1)


class DistillSection(Section):
    """On-policy distillation (docs/algorithms.md): a teacher scores the student's sampled tokens
    and coef·(teacher − rollout logprob) is their advantage, alone or added to the task's."""

    teacher: str | None = Field(None, description="teacher model: a Hugging Face directory (as `axrl model export` "
                                "writes) or a run's checkpoints/step_N; same tokenizer as the student")
    url: str | None = Field(None, description="a served teacher: the URL of an SGLang server or `axrl serve` "
                        "(same tokenizer, its directory readable here); scored at the rollout temperature")
    coef: float = Field(1.0, gt=0, description="weight of the reverse-KL advantage coef·(teacher − rollout logprob)")
    mode: Literal["reverse_kl", "reverse_kl+reward"] = Field(
        "reverse_kl", description="'reverse_kl': the distillation advantage alone; 'reverse_kl+reward': "
        "added to the task's advantage")

    @model_validator(mode="after")
    def _one_teacher(self) -> "DistillSection":
        if (self.teacher is None) == (self.url is None):
            raise ValueError("distill: set exactly one of `teacher` (a model directory or checkpoint) or `url`")
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
                                                   "updates run at learning rate 0)")
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


class TraceSection(Section):
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
    level: Literal["full", "standard", "summary"] = Field(
        "full", description="full: every column every step; standard: token columns every step, routing only "
                            "every routing_every steps; summary: per-sample and per-turn statistics only (no "
                            "per-token columns; replay needs full steps)")
    routing_every: int = Field(1, ge=1, description="level standard: routing written on steps divisible by this")
    keep_full: int = Field(0, ge=0, description="level standard/summary: hold the last K steps at full resolution "
                                                "in memory; when the spike trigger fires they and the spike step "
                                                "are written in full (0 = off; the spike step is always full)")
    behaviour_logprob: bool = Field(False, description="also record each token's trainer logprob under the "
                                                       "weights that generated it (async: splits the mismatch "
                                                       "into engine and staleness parts)")
    spike_ratio: float | None = Field(None, gt=1, description="online spike trigger: a step whose largest update "
                                      "grad norm exceeds this × the rolling median gets its deep dump written "
                                      "(RUN/replay/step_N.h5) at the time; null = off")
    spike_window: int = Field(20, ge=1, description="steps in the spike trigger's rolling median")
    spike_min_history: int = Field(3, ge=1, description="steps needed before the trigger can fire")

    @model_validator(mode="after")
    def _tiers(self) -> "TraceSection":
        if self.routing_every != 1 and self.level != "standard":
            raise ValueError(f"routing_every: applies to level standard only (level is {self.level})")
        if self.keep_full and self.level == "full":
            raise ValueError("keep_full: at level full every step is already written in full; set level "
                             "standard or summary, or keep_full: 0")
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


class R3ScopeSection(Section):
    """Partial R3 (needs `r3: true`): replay the recorded routing only in some MoE layers and/or
    only at the loss tokens; elsewhere the trainer's routers choose."""

    layers: list[int] | None = Field(None, description="decoder layers that replay (null: every MoE layer)")
    exclude_layers: list[int] = Field(default_factory=list, description="decoder layers that do not replay")
    loss_tokens_only: bool = Field(False, description="replay only at loss tokens (generated tokens as inputs)")


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


class AgentSection(Section):
    """A black-box agent (docs/agents.md, "Bring your own agent"): the rollout workers run it once
    per episode against a session of the recording OpenAI-compatible proxy; `data.task` still
    provides the prompts (and the warm-up's demonstrations)."""

    command: list[str] | None = Field(None, description="the agent's command, started once per episode with "
                                      "OPENAI_BASE_URL / OPENAI_API_KEY set to its session")
    function: str | None = Field(None, description="or 'module:fn' / 'file.py:fn' called as fn(base_url, "
                                 "api_key, prompt) in a thread, once per episode")
    prompt_via: Literal["stdin", "argument"] = "stdin"
    timeout_s: float = Field(120.0, gt=0, description="per episode; past it the agent is killed, the episode failed")
    max_concurrent: int = Field(16, ge=1, description="agent processes running at once")
    verifier: str | None = Field(None, description="'module:fn' scoring a finished path: fn(prompt, messages) -> "
                                 "float; default: the rewards the agent posts to /sessions/{id}/reward")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the agent process")
    model_name: str = Field("axrl-policy", description="the model id the proxy serves (GET /v1/models)")
    host: str = Field("127.0.0.1", description="the proxy's bind address")
    port: int = Field(0, ge=0, le=65535, description="the proxy's port (0: a free one)")
    allow_remote: bool = Field(False, description="allow a non-loopback `host` (the proxy serves the policy)")
    render_tools: bool = Field(True, description="render the request's `tools` into the prompt (false: only "
                               "parse tool calls, for a policy that learnt its tools without the schema)")
    fork_server: bool = Field(True, description="fork `python script.py` agents from one interpreter that "
                              "imported the script's modules once (false: a fresh process per episode)")
    coalesce_ms: float = Field(0.0, ge=0, description="hold the proxy's model calls until none joined for this "
                               "long, then submit them together (0: off; docs/agents.md, \"What the proxy costs\")")

    @model_validator(mode="after")
    def _one_agent(self) -> "AgentSection":
        if (self.command is None) == (self.function is None):
            raise ValueError("agent: set exactly one of `command` (a list: [program, args...]) and `function`")
        if self.command is not None and not self.command:
            raise ValueError("agent.command: an empty command; give [program, args...]")
        return self


class Config(Section):
    steps: int = Field(20, ge=1)
    seed: int = 0
    r3: bool = Field(False, description="replay rollout routing in the trainer (MoE only)")
    r3_scope: R3ScopeSection | None = Field(None, description="partial R3: layers / loss tokens only")
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    algo: AlgoSection = Field(default_factory=AlgoSection)
    train: TrainSection = Field(default_factory=TrainSection)
    warmup: WarmupSection = Field(default_factory=WarmupSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    trace: TraceSection = Field(default_factory=TraceSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    faults: FaultsSection = Field(default_factory=FaultsSection)
    agent: AgentSection | None = Field(None, description="a black-box agent plays the episodes (else the task's env)")
    distill: DistillSection | None = Field(None, description="on-policy distillation from a teacher (off: None)")
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
        if r.engine == "embedded" or r.weight_dtype == "fp32":
            return self
        if r.weight_dtype == "bf16":
            raise ValueError(f"rollout.weight_dtype: bf16 is an embedded-engine setting; an {r.engine} server "
                             "computes in model.dtype (set model.dtype: bfloat16)")
        if self.runtime.device == "cpu":
            raise ValueError(f"rollout.weight_dtype: fp8 with rollout.engine: {r.engine} needs a GPU: the server's "
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
