"""Small hand-made traces with values you choose (tests, docs, demos).

``TinySample`` lists one sample's tokens with explicit fields; ``tiny_record`` concatenates
samples into a ``StepRecord`` (CSR offsets, routing, a 2-update composition); ``write_run``
writes a complete run directory (manifest, config.yaml, metrics.jsonl, step files) through the
real writer, so everything the analysis sees went through the public format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from axrl.trace import RunDir, StepRecord

NAN = float("nan")


@dataclass
class TinyToken:
    """One token. ``rollout`` / ``old`` are logprobs (NaN where not generated), ``behaviour`` the
    trainer's logprob under the generating weights (``/tokens/behaviour_train_logprob``; NaN: not
    computed); ``route`` and ``train_route`` are the per-layer expert lists (rollout / trainer) of
    the token *as input*."""

    id: int = 5
    loss_mask: int = 0
    turn: int = 0
    version: int = -1
    rollout: float = NAN
    old: float = -1.0
    advantage: float = 0.0
    entropy: float = 1.0
    route: Sequence[Sequence[int]] | None = None
    train_route: Sequence[Sequence[int]] | None = None
    route_valid: int = 1
    behaviour: float = NAN


@dataclass
class TinySample:
    tokens: list[TinyToken]
    reward: float = 0.0
    prompt_len: int = 1
    num_turns: int = 1
    group_id: int = 0
    status: str = "ok"


def gen(rollout_p: float, delta: float, *, turn: int = 1, version: int = 0, advantage: float = 0.0,
        entropy: float = 1.0, id: int = 7, **kw: Any) -> TinyToken:
    """A generated token whose rollout probability is ``rollout_p`` and whose trainer logprob is
    ``log(rollout_p) + delta`` (so Δ ≈ delta up to float32 rounding of the stored values)."""
    r = math.log(rollout_p)
    return TinyToken(id=id, loss_mask=1, turn=turn, version=version, rollout=r, old=r + delta,
                     advantage=advantage, entropy=entropy, **kw)


def tiny_record(step: int, policy_version: int, samples: Sequence[TinySample], *,
                num_layers: int = 2, topk: int = 2, num_experts: int = 4, routing: bool = True,
                updates: Sequence[Sequence[int]] | None = None,
                update_metrics: Mapping[str, Sequence[float]] | None = None,
                fingerprint: str = "fp") -> StepRecord:
    """Concatenate samples into a StepRecord. Tokens without a route get experts (0, 1) per layer
    in both rollout and train. ``updates`` lists the sample rows of each update (default: one
    update over all samples). ``/tokens/behaviour_train_logprob`` is written when a token has a
    ``behaviour`` logprob."""
    toks = [t for s in samples for t in s.tokens]
    lengths = [len(s.tokens) for s in samples]
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = len(samples)
    default = [list(range(topk))] * num_layers

    def routes(attr: str) -> np.ndarray:
        return np.array([getattr(t, attr) or (t.route if attr == "train_route" and t.route else None) or default
                         for t in toks], dtype=np.int64).reshape(len(toks), num_layers, topk)

    updates = [list(range(n))] if updates is None else [list(u) for u in updates]
    u = len(updates)
    metrics = dict(update_metrics or {})
    metrics.setdefault("loss", [0.0] * u)
    metrics.setdefault("grad_norm", [0.0] * u)
    metrics.setdefault("lr", [1e-4] * u)
    return StepRecord(
        step=step, policy_version=policy_version, sample_offsets=off,
        sample_id=np.arange(n) + 100 * step, group_id=[s.group_id for s in samples],
        prompt_id=[f"tiny/{i}" for i in range(n)], prompt_len=[s.prompt_len for s in samples],
        num_turns=[s.num_turns for s in samples], reward=[s.reward for s in samples],
        finish_reason=["stop"] * n, status=[s.status for s in samples],
        token_ids=[t.id for t in toks], loss_mask=[t.loss_mask for t in toks], turn=[t.turn for t in toks],
        token_policy_version=[t.version for t in toks], rollout_logprob=[t.rollout for t in toks],
        old_logprob=[t.old for t in toks], advantage=[t.advantage for t in toks],
        entropy=[t.entropy for t in toks],
        behaviour_train_logprob=([t.behaviour for t in toks]
                                 if any(math.isfinite(t.behaviour) for t in toks) else None),
        update_sample_offsets=np.concatenate([[0], np.cumsum([len(x) for x in updates])]),
        update_samples=[i for x in updates for i in x], update_metrics=metrics,
        weights_fingerprint_before=f"{fingerprint}-{step}", weights_fingerprint_after=f"{fingerprint}-{step + 1}",
        num_experts=num_experts if routing else None,
        routing_rollout=routes("route") if routing else None,
        routing_rollout_valid=[t.route_valid for t in toks] if routing else None,
        routing_train=routes("train_route") if routing else None,
    )


def write_run(path: Path | str, records: Sequence[StepRecord], *,
              metrics: Sequence[Mapping[str, Any]] | None = None,
              config: Mapping[str, Any] | None = None, routing_encoding: str = "raw") -> RunDir:
    """A complete run directory from records (+ optional metrics.jsonl rows and config; routing
    stored ``routing_encoding``: 'raw' or 'packed')."""
    rd = RunDir(path)
    rd.write_manifest(seed=0, backend="synthetic", engine="synthetic", threads=1, command=["synthetic"])
    rd.write_config(config or {"algo": {"clip_low": 0.2, "clip_high": 0.28, "tis": True, "tis_cap": 2.0,
                                        "loss_agg": "token-mean"}})
    for rec in records:
        rd.write_step(rec, routing_encoding=routing_encoding)
    for row in metrics or []:
        rd.append_metrics(row)
    return rd

