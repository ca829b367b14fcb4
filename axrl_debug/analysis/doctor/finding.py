"""A doctor finding and the documented vocabulary of causes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: cause → one line: what it means (docs/axrl-debug.md, `doctor`)
CAUSES = {
    "weights_out_of_sync": "the whole engine ran other weights than the trainer's version (a sync skipped or late)",
    "stale_tensor": "one layer's tensor or one expert differs between engine and trainer",
    "kv_cache_precision": "the engine's KV cache holds keys/values at a lower precision: error grows with position",
    "prefill_decode": "the engine's prefill and decode paths differ: error on the first generated token of each turn",
    "routing_flips": "engine and trainer routed tokens to different experts (R3 off); the error sits on those tokens",
    "staleness": "asynchronous run: the policy drift since the generating version dominates the mismatch",
    "masking": "the loss mask trains tokens the engine did not generate (observations, tool results, NaN logprobs)",
    "context_mismatch": "the engine conditioned on other tokens than the trainer trains on (re-tokenisation, drift)",
    "logprob_semantics": "the engine's logprobs are of another distribution (temperature, top-p/top-k, penalties)",
    "precision": "low-precision rollout: a uniform error inside that precision's envelope",
    "within_envelope": "nothing wrong: every step's mismatch is inside the run's calibrated envelope",
    "unexplained": "outside the envelope, but no signature matches or every re-executed reading failed to "
                   "reproduce the recording: localise it with bisect",
}


@dataclass
class Finding:
    """One diagnosed cause with its evidence, a confidence in [0, 1] and the next command to run."""

    cause: str
    confidence: float
    evidence: dict[str, Any]
    summary: str
    next_command: str
    steps: list[int] = field(default_factory=list)
    proof: dict[str, Any] | None = None      # a re-execution that reproduced the recorded rollout bitwise
    validation: list[dict[str, Any]] | None = None   # doctor --validate: measured mitigations

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"unknown cause {self.cause!r}; the vocabulary is {sorted(CAUSES)}")
        self.confidence = float(min(max(self.confidence, 0.0), 1.0))

    @property
    def proven(self) -> bool:
        return bool(self.proof and self.proof.get("reproduced"))

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "confidence": round(self.confidence, 3), "proven": self.proven,
                "summary": self.summary, "steps": self.steps, "evidence": self.evidence,
                "next_command": self.next_command, "proof": self.proof, "validation": self.validation}


def rank(findings: list[Finding]) -> list[Finding]:
    """Proven findings first, then by confidence (stable for equal ones)."""
    return sorted(findings, key=lambda f: (not f.proven, -f.confidence))
