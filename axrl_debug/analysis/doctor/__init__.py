"""`axrl-debug doctor`: name the cause of a run's training–inference mismatch.

    report = diagnose(Path("runs/demo"))
    report["findings"][0]["cause"]     # one of finding.CAUSES, best first

Steps: (1) the run's calibrated envelope (axrl_debug/analysis/envelope.py); (2) every step's
engine mismatch judged against it (steps outside it are *flagged*); (3) trace-only signatures, one
module per family (masking, context_mismatch, staleness, prefill_decode, routing_flips,
stale_tensor, weights_out_of_sync, kv_cache_precision, logprob_semantics, precision /
within_envelope) read the flagged steps' profile (profile.py); (4) for AxRL's own replayable runs,
the suspected causes are re-executed (hypotheses.py): a hypothesis that reproduces the recorded
rollout bitwise is a proof; (5) with `validate`, mitigations are measured on the flagged step
(validate.py). Signatures read the trace, never the config: a fault injected in code is found the
same way as one in the wild.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
from axrl.trace import TraceReader
from axrl_debug.analysis.doctor import (context_mismatch, kv_cache_precision, logprob_semantics, masking, precision,
                                        prefill_decode, routing_flips, sentinel_events, stale_tensor, staleness,
                                        weights_out_of_sync)
from axrl_debug.analysis.doctor.context import Context, engine_abs_delta
from axrl_debug.analysis.doctor.data import load_step, step_stats
from axrl_debug.analysis.doctor.finding import CAUSES, Finding, rank
from axrl_debug.analysis.doctor.profile import build as build_profile
from axrl_debug.analysis.envelope import Envelope, load_or_calibrate

__all__ = ["CAUSES", "Finding", "diagnose", "judge_steps"]

#: the confidence of `unexplained`: a reading below it (e.g. one refuted by re-execution) is not named
UNEXPLAINED_CONFIDENCE = 0.4

#: the signature families, in the order they are asked (ranking is by confidence afterwards)
FAMILIES = (sentinel_events, masking, context_mismatch, staleness, prefill_decode, routing_flips, stale_tensor,
            weights_out_of_sync, kv_cache_precision, logprob_semantics)


def judge_steps(reader: TraceReader, steps: list[int], envelope: Envelope) -> tuple[dict, dict[int, dict[str, Any]]]:
    """(views, per-step rows): each step's mismatch, its engine part where the trace splits Δ, and
    the envelope's verdict on the engine part (the staleness part is judged by `staleness`)."""
    views, rows = {}, {}
    for s in steps:
        v = load_step(reader.step_path(s), s)
        views[s] = v
        row = {"step": s, "policy_version": v.policy_version, **step_stats(v)}
        sp = staleness.split(Context(reader.path, {s: v}, {}, envelope), s)
        if sp:
            row["split"] = sp
        eng = engine_abs_delta(v)
        eng = eng[np.isfinite(eng)]
        row["engine_mean_abs"] = float(eng.mean()) if len(eng) else float("nan")
        row["engine_max_abs"] = float(eng.max()) if len(eng) else float("nan")
        row.update(envelope.judge({"mean_abs": row["engine_mean_abs"], "max_abs": row["engine_max_abs"]}))
        rows[s] = row
    return views, rows


def diagnose(run: Path, *, step: int | None = None, rescore: bool = True, reexec: bool = True,
             validate: bool = False, refresh: bool = False,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The doctor's report of `run` (of `step` alone when given): envelope, per-step verdicts,
    ranked findings. `rescore`: calibrate the envelope by re-execution; `reexec`: test the suspected
    causes by re-running the rollout; `validate`: measure mitigations on the flagged step."""
    say = progress or (lambda msg: None)
    reader = TraceReader(run)
    steps = reader.steps if step is None else [step]
    say("calibrating the envelope")
    envelope = load_or_calibrate(reader.path, reader.config, reader.manifest, reader.steps, rescore=rescore,
                                 refresh=refresh)
    views, rows = judge_steps(reader, steps, envelope)
    ctx = Context(reader.path, views, rows, envelope)
    if ctx.flagged:
        ctx.profile = build_profile(ctx, ctx.flagged)
    findings: list[Finding] = []
    for family in FAMILIES:
        findings += family.detect(ctx)
    if not findings:
        findings = precision.detect(ctx)
    if not findings:  # flagged steps whose signature matches no family: say so rather than guess
        findings = [_unexplained(ctx)]
    findings = rank(findings)
    if reexec:
        from axrl_debug.analysis.doctor.hypotheses import test_hypotheses
        say("testing the suspected causes by re-execution")
        findings = rank(test_hypotheses(ctx, findings, say))
        if ctx.flagged and not findings[0].proven and findings[0].confidence < UNEXPLAINED_CONFIDENCE:
            findings = [_unexplained(ctx, findings), *findings]   # every reading refuted or weak: say so
    if isinstance(reader.manifest.get("source"), dict):
        findings = [_imported_next(f) for f in findings]
    if validate:
        from axrl_debug.analysis.doctor.validate import validate_findings
        say("measuring mitigations")
        validate_findings(ctx, findings, say)
    return {"run": str(reader.path), "steps": steps, "envelope": envelope.to_dict(),
            "flagged_steps": ctx.flagged, "per_step": [rows[s] for s in steps],
            "profile": ctx.profile.to_dict() if ctx.profile else None,
            "findings": [f.to_dict() for f in findings], "top": findings[0].cause}


def _imported_next(f: Finding) -> Finding:
    """An imported run (another trainer's, `axrl.trace.Recorder`) has no checkpoints to re-execute:
    a finding's `bisect` becomes `mismatch`, which reads the trace (bisect refuses such a run)."""
    if f.next_command.startswith("axrl-debug bisect "):
        f.next_command = "axrl-debug mismatch " + f.next_command[len("axrl-debug bisect "):]
    return f


def _unexplained(ctx: Context, refuted: list[Finding] | None = None) -> Finding:
    """Flagged steps no family explains (or whose readings re-execution refuted): say so and point at
    the localising tool rather than name a guess."""
    s = ctx.flagged[0]
    if refuted:
        why = ("the best readings were re-executed and not reproduced: "
               + ", ".join(f"{f.cause} ({f.confidence:.2f})" for f in refuted[:3]))
    else:
        why = "no family's signature matched"
    return Finding("unexplained", UNEXPLAINED_CONFIDENCE, {"flagged_steps": ctx.flagged, "profile": why},
                   f"steps {ctx.flagged} are outside the envelope and {why}; localise with bisect",
                   f"axrl-debug bisect {ctx.run} --step {s}", ctx.flagged)
