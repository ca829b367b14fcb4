"""Hypotheses tested by re-execution (AxRL's own replayable runs): re-run a flagged step's rollout
(replay/rollout.py, bit for bit) under each suspected cause and compare with the recorded rollout.
A hypothesis that reproduces the recorded tokens, rollout logprobs and routing bitwise is a proof;
the finding says so (`proof.reproduced`) and ranks first.

First the clean re-run: if the clean code on the right weights reproduces the recording, the engine
did what it should (the cause is on the trainer's side: masking, context); if it diverges, the
engine that recorded the step ran something else, and each hypothesis says what:

| cause | hypothesis re-executed |
|---|---|
| weights_out_of_sync | the engine holds the previous version's weights (N − 1), or the first ones |
| stale_tensor | the named expert (or the layer) held at the first version, or at N − 1 |
| kv_cache_precision | keys/values rounded through bf16 (then fp16) as they are stored |
| logprob_semantics | the same tokens sampled, their logprobs reported at temperature 1 (the raw logits) |
| context_mismatch | the recorded context (the trainer's own tokens: the clean re-run) vs each context variant (context_variants.py) given to the engine at every later turn |
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from axrl_debug.analysis.doctor.context import Context
from axrl_debug.analysis.doctor.finding import Finding

Say = Callable[[str], None]
REEXECUTED = ("weights_out_of_sync", "stale_tensor", "kv_cache_precision", "logprob_semantics", "context_mismatch")
#: the logprob temperatures tried for `logprob_semantics` (1.0: logprobs of the unscaled logits, the
#: common bug of an engine that applies the temperature only when it samples)
LOGPROB_TEMPERATURES = (1.0,)
#: the share of its trace-only confidence a reading keeps when its re-execution was tried and failed
#: (below UNEXPLAINED_CONFIDENCE for a weak reading: e.g. kv_cache_precision 0.65 → 0.39)
FAILED_KEEP = 0.6


def weights_at(run, step: int) -> dict[str, torch.Tensor]:
    """The trainer's HF-named weights at the start of `step` (version `step` of a synchronous run)."""
    from replay.policy import policy_before

    state = policy_before(run, step)
    try:
        return {k: v.detach().clone() for k, v in state.backend.named_weights()}
    finally:
        state.close()


@contextlib.contextmanager
def kv_rounded(dtype: torch.dtype) -> Iterator[None]:
    """The embedded engine's KV cache stores keys/values rounded through `dtype` while the block runs."""
    from axrl.inference.embedded.kv_cache import StaticKVCache

    original = StaticKVCache.stored
    StaticKVCache.stored = lambda self, x: original(self, x).to(dtype).to(x.dtype)  # type: ignore[method-assign]
    try:
        yield
    finally:
        StaticKVCache.stored = original  # type: ignore[method-assign]


@contextlib.contextmanager
def logprobs_at(temperature: float) -> Iterator[None]:
    """The embedded engine samples as it should but reports each sampled token's logprob at
    `temperature` while the block runs (the same formula as axrl.inference.sampling.sample)."""
    from axrl.inference.embedded import batch_forward

    original = batch_forward.sample

    def sample(logits, rows):
        tokens_t, tokens, logprobs = original(logits, rows)
        if logprobs is None:
            return tokens_t, tokens, logprobs
        lp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, tokens_t[:, None])[:, 0]
        return tokens_t, tokens, lp.tolist()
    batch_forward.sample = sample
    try:
        yield
    finally:
        batch_forward.sample = original


def _replay(ctx: Context, step: int, hook=None, patch=None) -> dict[str, Any]:
    from replay.rollout import replay_rollout

    with patch if patch is not None else contextlib.nullcontext():
        res = replay_rollout(ctx.run, step, engine_weights=hook)
    d = res.first_divergence
    return {"reproduced": res.verdict == "bitwise-equal", "verdict": res.verdict,
            "first_divergence": d.describe() if d is not None else None}


def _hypotheses(ctx: Context, f: Finding, step: int) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """(description, runner) of each re-execution that would prove `f` at `step`."""
    version = ctx.views[step].policy_version
    earlier = sorted({v for v in (version - 1, 0) if 0 <= v < version}, reverse=True)
    out: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    if f.cause == "weights_out_of_sync":
        for v in earlier:
            out.append((f"the engine held version {v}'s weights at step {step}",
                        lambda v=v: _replay(ctx, step, hook=lambda w, old=weights_at(ctx.run, v): dict(old))))
    elif f.cause == "stale_tensor":
        layer, expert = f.evidence.get("layer"), f.evidence.get("expert")
        prefix = (f"model.layers.{layer}.mlp.experts.{expert}." if expert is not None else f"model.layers.{layer}.")
        for v in earlier:
            def held(v=v, prefix=prefix):
                old = weights_at(ctx.run, v)
                return _replay(ctx, step, hook=lambda w: {k: (old[k] if k.startswith(prefix) else t) for k, t in w.items()})
            out.append((f"the engine held {prefix}* at version {v}", held))
    elif f.cause == "kv_cache_precision":
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            out.append((f"the KV cache held keys/values in {name}", lambda dt=dt: _replay(ctx, step, patch=kv_rounded(dt))))
    elif f.cause == "logprob_semantics":
        for t in LOGPROB_TEMPERATURES:
            out.append((f"the engine reported logprobs at temperature {t:g} (sampling unchanged)",
                        lambda t=t: _replay(ctx, step, patch=logprobs_at(t))))
    elif f.cause == "context_mismatch":
        from axrl_debug.analysis.doctor.context_variants import VARIANTS, engine_given
        for name in VARIANTS:
            out.append((f"the engine was given the context variant {name} at every later turn "
                        "(the trainer's recorded context did not reproduce)",
                        lambda name=name: _replay(ctx, step, patch=engine_given(name))))
    return out


def test_hypotheses(ctx: Context, findings: list[Finding], say: Say) -> list[Finding]:
    """Re-execute the hypotheses of the findings that have one; record the outcome in each finding."""
    from replay import ReplayInputError

    todo = [f for f in findings if f.cause in REEXECUTED and f.steps]
    if not todo:
        return findings
    step = todo[0].steps[0]
    try:
        say(f"re-running step {step}'s rollout as recorded (clean code, the step's weights)")
        clean = _replay(ctx, step)
    except (ReplayInputError, FileNotFoundError, ValueError) as e:
        for f in todo:
            f.proof = {"reproduced": False, "tested": False, "why": f"not re-executable: {e}"}
        return findings
    for f in todo:
        tried = []
        for what, run in _hypotheses(ctx, f, step):
            say(f"hypothesis: {what}")
            try:
                outcome = run()
            except (ReplayInputError, FileNotFoundError, ValueError) as e:
                outcome = {"reproduced": False, "verdict": "not run", "first_divergence": str(e)}
            tried.append({"hypothesis": what, **outcome})
            if outcome["reproduced"]:
                break
        hit = next((t for t in tried if t["reproduced"]), None)
        f.proof = {"tested": True, "step": step, "clean_replay": clean, "hypotheses": tried,
                   "reproduced": hit is not None, "hypothesis": hit["hypothesis"] if hit else None}
        if hit:
            f.confidence = 1.0
            f.summary += f". PROVEN by re-execution: {hit['hypothesis']} reproduces the recorded rollout bit for bit"
        elif clean["reproduced"]:  # the clean code reproduced the recording: the engine did its job
            f.confidence *= 0.3
            f.summary += ". Disproved as an engine fault: the clean re-run reproduces the recorded rollout"
    from axrl_debug.analysis.doctor.expert_search import search
    findings = search(ctx, findings, step, clean, _replay, weights_at, say)
    if any(f.proven for f in findings):  # a proof explains the recording: the other readings are weaker
        for f in findings:
            if not f.proven and f.cause in REEXECUTED:
                f.confidence *= 0.5
    else:
        _demote_failed(findings)
    return findings


def failed(f: Finding) -> bool:
    """Re-executed and refuted: the engine ran something else than clean code (the clean re-run
    diverged), but not what this reading says (none of its hypotheses reproduced the recording)."""
    p = f.proof or {}
    return bool(p.get("tested") and p.get("hypotheses") and not p.get("reproduced")
                and not p.get("clean_replay", {}).get("reproduced"))


def _demote_failed(findings: list[Finding]) -> None:
    """A reading whose re-execution was tried and failed keeps FAILED_KEEP of its trace-only
    confidence and ranks below every trace-only reading (one with no re-executable hypothesis): the
    trace said "looks like X", the re-execution said "not X as far as tested" (router noise too small
    to flip a route reads as a low-precision KV cache until both KV re-runs diverge)."""
    others = [f.confidence for f in findings if not failed(f)]
    for f in findings:
        if failed(f):
            f.confidence = min([f.confidence * FAILED_KEEP, *(c - 0.01 for c in others)])
            f.summary += (". NOT reproduced by re-execution: " + "; ".join(
                f"{t['hypothesis']} → {t['verdict']}" for t in f.proof["hypotheses"]))
