"""The on-disk contract of an AxRL run directory and of one per-step HDF5 trace file.

Everything here is public: other tools (``axrl_debug``, ``replay``, users' notebooks) read traces
by these names. Policy (see docs/trace-format.md): *add* datasets/attrs freely; never rename,
retype or change the meaning of an existing one without bumping ``SCHEMA_VERSION``.

This module only depends on numpy (and ``axrl.core``, numpy only) so that readers stay light.

Symbolic dimensions used in shapes:

====  =====================================================================
N     samples in the step (rows of ``/samples``)
T     tokens of all samples concatenated (rows of ``/tokens``)
L, k  decoder layers (rows of dense layers are zeros), experts per token (``/routing``)
U     optimizer updates taken in the step
S     entries of ``/train/update_samples`` (sum of samples over updates)
M     micro-batches over all updates
MS    entries of ``/train/micro_batch_samples``
P     parameter tensors (``/train/param_names``)
D, R  groups dropped / re-run while the step's batch was filled (``/pool``)
====  =====================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from axrl.core.outcomes import FINISH_REASONS, STATUSES

SCHEMA_VERSION = 1

# ----------------------------------------------------------------------------- run directory
TRACE_DIR = "trace"
CHECKPOINTS_DIR = "checkpoints"
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TMP_SUFFIX = ".tmp"
STEP_FILE_FORMAT = "step_{step:06d}.h5"
STEP_FILE_RE = re.compile(r"^step_(\d{6,})\.h5$")
CHECKPOINT_DIR_FORMAT = "step_{step:06d}"
SHARDS_DIR_FORMAT = "step_{step:06d}.shards"   # a sharded step's shard files (shards.py)
SHARDS_DIR_RE = re.compile(r"^step_(\d{6,})\.shards$")


def step_file_name(step: int) -> str:
    if int(step) < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return STEP_FILE_FORMAT.format(step=int(step))


def parse_step_file_name(name: str) -> int | None:
    """The step number of a *final* step file name, or None (tmp files and others)."""
    m = STEP_FILE_RE.match(name)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- errors
class TraceError(Exception):
    """Base class of every error raised by ``axrl.trace``."""


class TraceValidationError(TraceError, ValueError):
    """A StepRecord field has the wrong shape, dtype or values; the message names the field."""


class NotARunDirError(TraceError, FileNotFoundError):
    """The directory exists but holds neither ``manifest.json`` nor ``trace/``."""


class SchemaVersionError(TraceError):
    """The manifest or a step file declares a schema version this code does not know."""


class CorruptStepError(TraceError):
    """A step file cannot be opened or lacks its required structure (e.g. truncated by a crash)."""


# ----------------------------------------------------------------------------- root attributes
ATTR_STEP = "step"                        # int64
ATTR_SCHEMA_VERSION = "schema_version"    # int64
ATTR_POLICY_VERSION = "policy_version"    # int64: weight version trained on (before the step's updates)
ATTR_RNG_DIGEST = "rng_digest"            # str: digest of all RNG states at the start of the step
ATTR_AXRL_VERSION = "axrl_version"        # str
ATTR_CREATED_UNIX = "created_unix"        # float64: time the file was written (informational)
ATTR_NUM_SAMPLES = "num_samples"          # int64 N (convenience)
ATTR_NUM_TOKENS = "num_tokens"            # int64 T (convenience)
ATTR_NUM_UPDATES = "num_updates"          # int64 U (convenience)
ATTR_NUM_MICRO_BATCHES = "num_micro_batches"  # int64 M (convenience)
ATTR_SHARD_FILES = "shard_files"          # str[]: a sharded step's shard files, relative to trace/ (shards.py)
WALL_TIME_PREFIX = "wall_time_"           # float64 seconds per phase: wall_time_rollout, wall_time_train, ...
RESERVED_ROOT_ATTRS = frozenset({
    ATTR_STEP, ATTR_SCHEMA_VERSION, ATTR_POLICY_VERSION, ATTR_RNG_DIGEST, ATTR_AXRL_VERSION,
    ATTR_CREATED_UNIX, ATTR_NUM_SAMPLES, ATTR_NUM_TOKENS, ATTR_NUM_UPDATES, ATTR_NUM_MICRO_BATCHES,
    ATTR_SHARD_FILES,
})

# attrs of /routing (present iff a routing dataset is present)
ROUTING_ATTR_NUM_EXPERTS = "num_experts"  # int64
# trace.routing_encoding "packed" (axrl/trace/routing_codec.py): /routing/rollout and /routing/train
# are stored as the datasets below; the reader returns the same arrays under the same names.
ROUTING_ATTR_ENCODING = "encoding"        # str: absent (raw) or routing_codec.ENCODING
ROUTING_ATTR_BITS = "bits"                # int64: bits per expert id
ROUTING_ATTR_LAYERS = "layers"            # int64 L
ROUTING_ATTR_K = "k"                      # int64 k
ROUTING_PACKED = {"/routing/rollout": "/routing/rollout_packed"}
ROUTING_TRAIN_DIFFERS, ROUTING_TRAIN_ROWS = "/routing/train_differs", "/routing/train_rows"
# |A ∩ B| of each stored trainer row and the rollout's row it replaces (written since packed-v1 traces
# of 2026-12; older packed files lack it and the analysis decodes the rows instead)
ROUTING_TRAIN_HITS = "/routing/train_hits"

# ----------------------------------------------------------------------------- groups
G_SAMPLES = "/samples"
G_TOKENS = "/tokens"
G_ROUTING = "/routing"
G_TRAIN = "/train"
G_UPDATES = "/train/updates"
G_MICRO_BATCHES = "/train/micro_batches"
G_POOL = "/pool"

STR = "str"          # dtype marker: variable-length UTF-8 string
ROUTING = "routing"  # dtype marker: uint8 if num_experts <= 256 else uint16


@dataclass(frozen=True)
class DatasetSpec:
    path: str                 # absolute HDF5 path, the public name
    field: str                # StepRecord attribute holding it
    dtype: str                # numpy dtype name, STR or ROUTING
    shape: tuple[str, ...]    # symbolic shape; () for a scalar dataset
    required: bool
    doc: str

    @property
    def np_dtype(self) -> np.dtype | None:
        return None if self.dtype in (STR, ROUTING) else np.dtype(self.dtype)


DATASETS: tuple[DatasetSpec, ...] = (
    # --- samples
    DatasetSpec("/samples/offsets", "sample_offsets", "int64", ("N+1",), True,
                "CSR: tokens of sample i are offsets[i]:offsets[i+1] of every /tokens dataset"),
    DatasetSpec("/samples/sample_id", "sample_id", "int64", ("N",), True,
                "unique id of the sample (trajectory) within the run"),
    DatasetSpec("/samples/group_id", "group_id", "int64", ("N",), True,
                "group (same prompt, GRPO-style) the sample belongs to"),
    DatasetSpec("/samples/prompt_id", "prompt_id", STR, ("N",), True,
                "dataset-level prompt identifier, e.g. 'gsm8k/train/123'"),
    DatasetSpec("/samples/prompt_len", "prompt_len", "int32", ("N",), True,
                "number of leading tokens of the sample that are the initial prompt"),
    DatasetSpec("/samples/num_turns", "num_turns", "int32", ("N",), True,
                "assistant turns in the trajectory"),
    DatasetSpec("/samples/reward", "reward", "float64", ("N",), True,
                "scalar reward of the trajectory (NaN if it could not be scored)"),
    DatasetSpec("/samples/finish_reason", "finish_reason", STR, ("N",), True,
                " | ".join(map(repr, FINISH_REASONS))),
    DatasetSpec("/samples/status", "status", STR, ("N",), True,
                " | ".join(map(repr, STATUSES))),
    DatasetSpec("/samples/error", "error", STR, ("N",), True,
                "error message when status != 'ok', else ''"),
    DatasetSpec("/samples/session_id", "session_id", STR, ("N",), False,
                "black-box agent session the sample was stitched from ('' for white-box episodes)"),
    DatasetSpec("/samples/fork_of", "fork_of", "int64", ("N",), False,
                "sample id of the session path this one forks from (a rewritten history, n > 1); -1: none"),
    DatasetSpec("/samples/fork_cause", "fork_cause", STR, ("N",), False,
                "why the path forks: 'history edited' | 'tools changed' | 'n > 1' | "
                "'template not prefix-stable'; '' for a primary path"),
    DatasetSpec("/samples/drift_tokens", "drift_tokens", "int32", ("N",), False,
                "tokens where the sample differs from the chat template's rendering of its conversation "
                "(drift: e.g. reasoning the template drops from earlier turns, a non-canonical tokenisation; "
                "the generated ids are what is trained)"),
    # --- tokens
    DatasetSpec("/tokens/ids", "token_ids", "int32", ("T",), True, "token ids"),
    DatasetSpec("/tokens/loss_mask", "loss_mask", "uint8", ("T",), True,
                "1 = generated by the policy and trained on"),
    DatasetSpec("/tokens/turn", "turn", "int16", ("T",), True,
                "turn index of the token within its sample (0 = initial prompt)"),
    DatasetSpec("/tokens/policy_version", "token_policy_version", "int32", ("T",), True,
                "weight version that generated the token; -1 for prompt/env/tool tokens"),
    DatasetSpec("/tokens/rollout_logprob", "rollout_logprob", "float32", ("T",), True,
                "engine log p(token_t | earlier tokens of its sample); NaN where not generated"),
    DatasetSpec("/tokens/old_logprob", "old_logprob", "float32", ("T",), True,
                "trainer recompute before the step's first update (same convention)"),
    DatasetSpec("/tokens/advantage", "advantage", "float32", ("T",), True,
                "per-token advantage used by the loss"),
    DatasetSpec("/tokens/entropy", "entropy", "float16", ("T",), True,
                "trainer entropy of the distribution that predicted token t"),
    DatasetSpec("/tokens/drift", "drift", "uint8", ("T",), False,
                "1 where the token is in a drift span of its sample (black-box): the sample differs there "
                "from the chat template's rendering of its conversation; its turn is /tokens/turn"),
    DatasetSpec("/tokens/ref_logprob", "ref_logprob", "float32", ("T",), False,
                "frozen reference policy's logprob (the weights at RL start; KL penalty), same convention"),
    DatasetSpec("/tokens/is_weight", "is_weight", "float32", ("T",), False,
                "weight the rollout/trainer corrections applied to the token's policy loss "
                "(1 = none, 0 = masked); NaN where not trained"),
    DatasetSpec("/tokens/loss_rule", "loss_rule", "uint16", ("T",), False,
                "bits of what the objective and corrections did to the token (LOSS_RULE_CODES); 0 = trained plainly"),
    DatasetSpec("/tokens/behaviour_train_logprob", "behaviour_train_logprob", "float32", ("T",), False,
                "trainer logprob under the weights that generated the token (version /tokens/policy_version); NaN where not generated"),
    DatasetSpec("/tokens/turn_reward", "turn_reward", "float64", ("T",), False,
                "reward of the token's turn (/tokens/turn; the env's step reward or a black-box agent's "
                "per-turn reward), 0 on turn-0 tokens; written under algo.credit: turn or when a sample "
                "was rewarded before its last turn (absent: all of /samples/reward on the last turn)"),
    DatasetSpec("/tokens/value", "value", "float32", ("T",), False,
                "PPO critic (algo.advantage: gae): V of the state the token was sampled in, by the critic "
                "before the step's updates (the values GAE used); 0 off the loss mask"),
    DatasetSpec("/tokens/return", "returns", "float32", ("T",), False,
                "PPO critic: GAE's λ-return of the token (advantage before whitening + value), the critic's "
                "target; 0 off the loss mask"),
    # --- routing
    DatasetSpec("/routing/rollout", "routing_rollout", ROUTING, ("T", "L", "k"), False,
                "experts each token was routed to as *input* by the engine"),
    DatasetSpec("/routing/rollout_valid", "routing_rollout_valid", "uint8", ("T",), False,
                "1 where /routing/rollout holds data (0: token never fed as input, e.g. last token)"),
    DatasetSpec("/routing/train", "routing_train", ROUTING, ("T", "L", "k"), False,
                "experts each token was routed to as *input* by the trainer forward"),
    # --- train: batch composition (re-execution)
    DatasetSpec("/train/update_samples", "update_samples", "int64", ("S",), True,
                "row indices into /samples, update after update, in training order"),
    DatasetSpec("/train/updates/sample_offsets", "update_sample_offsets", "int64", ("U+1",), True,
                "CSR over /train/update_samples: update u trained on rows [o[u]:o[u+1]]"),
    DatasetSpec("/train/micro_batch_samples", "micro_batch_samples", "int64", ("MS",), False,
                "row indices into /samples, micro-batch after micro-batch, in execution order"),
    DatasetSpec("/train/micro_batches/sample_offsets", "micro_batch_sample_offsets", "int64", ("M+1",),
                False, "CSR over /train/micro_batch_samples"),
    DatasetSpec("/train/updates/weights_fingerprint_after", "update_fingerprints", STR, ("U",), False,
                "weights fingerprint after each update"),
    DatasetSpec("/train/param_names", "param_names", STR, ("P",), False,
                "parameter tensors (Hugging Face names) of /train/param_grad_norm's columns"),
    DatasetSpec("/train/param_grad_norm", "param_grad_norm", "float64", ("U", "P"), False,
                "L2 norm of each parameter tensor's gradient before clipping, per update"),
    DatasetSpec("/train/weights_fingerprint_before", "weights_fingerprint_before", STR, (), True,
                "digest of all parameters before the step's first update"),
    DatasetSpec("/train/weights_fingerprint_after", "weights_fingerprint_after", STR, (), True,
                "digest of all parameters after the step's last update"),
    # --- pool: groups that were meant for this step but are not in it (asynchronous runs)
    DatasetSpec("/pool/dropped_group_id", "pool_dropped_group_id", "int64", ("D",), False,
                "groups dropped while this step's batch was filled"),
    DatasetSpec("/pool/dropped_reason", "pool_dropped_reason", STR, ("D",), False,
                "'stale' | 'max_reruns' (too stale to train) | 'partial_drop' (running at a weight update) | "
                "'dynamic_sampling' (rolled out for this step, not selected by algo.dynamic_sampling)"),
    DatasetSpec("/pool/dropped_min_version", "pool_dropped_min_version", "int32", ("D",), False,
                "oldest weight version among the dropped group's generated tokens (-1: none generated yet)"),
    DatasetSpec("/pool/rerun_group_id", "pool_rerun_group_id", "int64", ("R",), False,
                "groups found too stale while this step's batch was filled and started again"),
    # --- pool samples: the complete samples of dropped groups (dynamic sampling), never trained;
    #     the columns of /samples and /tokens they share, same dtypes and alignment, own CSR
    DatasetSpec("/pool/samples/offsets", "pool_sample_offsets", "int64", ("DN+1",), False,
                "CSR: tokens of pool sample i are offsets[i]:offsets[i+1] of every /pool/tokens dataset"),
    DatasetSpec("/pool/samples/sample_id", "pool_sample_id", "int64", ("DN",), False, "as /samples/sample_id"),
    DatasetSpec("/pool/samples/group_id", "pool_group_id", "int64", ("DN",), False,
                "as /samples/group_id; every group is in /pool/dropped_group_id"),
    DatasetSpec("/pool/samples/prompt_id", "pool_prompt_id", STR, ("DN",), False, "as /samples/prompt_id"),
    DatasetSpec("/pool/samples/prompt_len", "pool_prompt_len", "int32", ("DN",), False, "as /samples/prompt_len"),
    DatasetSpec("/pool/samples/num_turns", "pool_num_turns", "int32", ("DN",), False, "as /samples/num_turns"),
    DatasetSpec("/pool/samples/reward", "pool_reward", "float64", ("DN",), False, "as /samples/reward"),
    DatasetSpec("/pool/samples/finish_reason", "pool_finish_reason", STR, ("DN",), False,
                "as /samples/finish_reason"),
    DatasetSpec("/pool/samples/status", "pool_status", STR, ("DN",), False, "as /samples/status"),
    DatasetSpec("/pool/tokens/ids", "pool_token_ids", "int32", ("DT",), False, "as /tokens/ids"),
    DatasetSpec("/pool/tokens/turn", "pool_turn", "int16", ("DT",), False, "as /tokens/turn"),
    DatasetSpec("/pool/tokens/policy_version", "pool_token_policy_version", "int32", ("DT",), False,
                "as /tokens/policy_version"),
    DatasetSpec("/pool/tokens/rollout_logprob", "pool_rollout_logprob", "float32", ("DT",), False,
                "as /tokens/rollout_logprob (NaN where not generated)"),
    DatasetSpec("/pool/routing/rollout", "pool_routing_rollout", ROUTING, ("DT", "L", "k"), False,
                "as /routing/rollout (rows never fed to the engine stored as zeros; num_experts: /routing's attr)"),
)
DATASETS_BY_PATH = {d.path: d for d in DATASETS}
DATASETS_BY_FIELD = {d.field: d for d in DATASETS}

# Per-update metric columns /train/updates/<name> [U] and per-micro-batch /train/micro_batches/<name> [M].
# Required columns with their dtypes; any other numeric column may be added (floats are stored as
# float64, integers/bools as int64).
UPDATE_REQUIRED: dict[str, str] = {"loss": "float64", "grad_norm": "float64", "lr": "float64"}
UPDATE_RECOMMENDED = ("clipfrac", "kl", "entropy", "num_tokens", "num_samples")
MICRO_BATCH_REQUIRED: dict[str, str] = {"update": "int32", "loss": "float64", "num_tokens": "int64"}
UPDATE_RESERVED = frozenset({"sample_offsets", "weights_fingerprint_after"})
MICRO_BATCH_RESERVED = frozenset({"sample_offsets"})

# /tokens/loss_rule bits (axrl.algo.LossRule mirrors this table; numpy-only readers use this one).
LOSS_RULE_CODES: dict[int, tuple[str, str]] = {
    1: ("clip_high", "ratio above the band's top with A >= 0: no gradient (ppo, gspo, grpo2)"),
    2: ("clip_low", "ratio below the band's floor with A < 0: no gradient (ppo, gspo, grpo2)"),
    4: ("dual_clip", "dual-clip bound -c*A taken (ppo, A < 0): no gradient"),
    8: ("soft_clip", "weight capped, gradient kept (grpo2 A < 0 above dual_soft_clip, cispo, topr)"),
    16: ("ratio_clamp", "|log ratio| beyond log_ratio_clamp (ratio clamped; or an untruncated behaviour weight's)"),
    32: ("tis_truncated", "train/rollout weight truncated at the TIS cap (or algo.behaviour_weight_cap)"),
    64: ("mis_masked", "train/rollout weight outside [lower, upper]: masked (MIS)"),
    128: ("veto", "sequence dropped: a token's train/rollout ratio below the veto threshold"),
    256: ("icepop_masked", "train/rollout ratio outside [low, high]: masked (IcePop)"),
    512: ("no_rollout", "loss token without a finite rollout logprob (corrections left it at weight 1)"),
}

G_POOL_SAMPLES = "/pool/samples"
G_POOL_TOKENS = "/pool/tokens"
G_POOL_ROUTING = "/pool/routing"

# Which datasets get chunked + compressed (the large per-token ones).
TOKEN_GROUPS = (G_TOKENS, G_ROUTING, G_POOL_TOKENS, G_POOL_ROUTING)

# The values /samples/finish_reason and /samples/status hold (one definition: axrl.core.outcomes).
KNOWN_FINISH_REASONS = FINISH_REASONS
KNOWN_STATUSES = STATUSES


def routing_dtype(num_experts: int) -> np.dtype:
    """uint8 when expert ids fit (num_experts <= 256), else uint16."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.uint16)
    raise ValueError(f"num_experts={num_experts} does not fit uint16")
