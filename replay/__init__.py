"""Deterministic re-execution of recorded training steps (docs/design.md, docs/replay.md).

Rebuild the trainer state before step N from a checkpoint plus the recorded batches, re-run
step N and compare it bit for bit with the trace; optionally dump costly instrumentation of the
step (`RUN/replay/step_N.h5`) and re-run it under what-if config variants. Imports `axrl` only.

    from replay import replay_step
    result = replay_step("runs/demo", 12, dump=True, variants=[["algo.tis=false"]])
    print(result.verdict, result.first_divergence)

Also the rollout side: `replay_rollout` re-runs a step's rollout on the embedded engine bit for bit
(`teacher_forced_check` where that is impossible), and `explain_step` attributes a token's
engine/trainer mismatch to a layer and component by activation patching.
"""

from replay.compare import Divergence
from replay.dump import DUMP_FORMAT, DUMP_VERSION, DumpProbe, dump_path, read_dump
from replay.train_step import ReplayResult, StepReplay, replay_step
from replay.explain import explain_step
from replay.explain_report import ExplainResult, TokenExplanation
from replay.environment import REQUIREMENTS, current_environment, environment_warnings
from replay.plan import ReplayInputError, ReplayPlan, RunInventory
from replay.recorded import RecordedStep, RecordedUpdate, load_recorded_step
from replay.rollout import RolloutReplayResult, TeacherForcedResult, replay_rollout, teacher_forced_check
from replay.sweep import FAMILIES, Ranked, family_variants, rank_variants
from replay.whatif import SUMMARY_KEYS, Variant, VariantResult, parse_variant, run_variant

__all__ = [
    "DUMP_FORMAT", "DUMP_VERSION", "Divergence", "DumpProbe", "FAMILIES", "Ranked", "family_variants",
    "rank_variants", "REQUIREMENTS", "RecordedStep", "RecordedUpdate",
    "ReplayInputError", "ReplayPlan", "ReplayResult", "RunInventory", "SUMMARY_KEYS", "StepReplay", "Variant",
    "VariantResult", "current_environment", "dump_path", "environment_warnings", "load_recorded_step",
    "parse_variant", "read_dump", "replay_step", "run_variant",
    "ExplainResult", "RolloutReplayResult", "TeacherForcedResult", "TokenExplanation", "explain_step",
    "replay_rollout", "teacher_forced_check",
]
