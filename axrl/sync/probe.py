"""The probe re-score of the sync sentinel: a few of the run's own earlier samples, scored
teacher-forced by the engine and by the trainer's forward on the weights just synced, compared
with the floor calibrated at the first verification (the same weights on both sides: the
numerics floor of this engine, precision and model).

The comparison: the largest |Δ logprob| over the probe tokens, and for MoE the share of
(token, layer) rows whose top-k expert sets differ. A later verification fails when either
exceeds `limit(floor)` = `FLOOR_FACTOR` × floor + `ABS_MARGIN` (for routing, + `ROUTING_MARGIN`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from axrl.model import ModelConfig, Qwen3ForCausalLM, load_weights_into

FLOOR_FACTOR = 4.0      # a clean engine's Δ moves with the weights; 4× its calibrated value is still clean
ABS_MARGIN = 1e-4       # logprob: above a floor of 0 (bitwise engines), what a stale tensor shows at least
ROUTING_MARGIN = 0.02   # share of (token, layer) rows whose expert set may differ beyond the floor's
WORST_TOKENS = 5        # probe tokens named in a failure


@dataclass
class ProbeScore:
    """One probe sequence as scored by one side: logprobs [n] (NaN at position 0) and, for MoE,
    the routed experts [n, layers, top_k] (None for dense models or engines that do not return them)."""

    logprobs: np.ndarray
    routing: np.ndarray | None


@dataclass(frozen=True)
class ProbeFloor:
    """The calibrated numerics floor: what engine and trainer differ by on the same weights."""

    logprob_max_abs: float
    routing_disagree: float
    version: int
    tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"logprob_max_abs": self.logprob_max_abs, "routing_disagree": self.routing_disagree,
                "calibrated_at_version": self.version, "probe_tokens": self.tokens,
                "limit_logprob": FLOOR_FACTOR * self.logprob_max_abs + ABS_MARGIN,
                "limit_routing": FLOOR_FACTOR * self.routing_disagree + ROUTING_MARGIN}


@torch.no_grad()
def score_with_model(model: Qwen3ForCausalLM, sequences: Sequence[np.ndarray]) -> list[ProbeScore]:
    """Teacher-forced logprobs (temperature 1) and routing of each sequence by `model`'s own
    forward, one sequence per forward (a sequence's values never depend on its neighbours)."""
    device = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for seq in sequences:
            ids = torch.as_tensor(np.asarray(seq, dtype=np.int64), device=device)[None]
            o = model(ids, return_routing=model.config.is_moe)
            lp = torch.log_softmax(o.logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            logprobs = np.concatenate([[np.nan], lp.double().cpu().numpy()])
            routing = None if o.routed_experts is None else o.routed_experts[0].cpu().numpy()
            out.append(ProbeScore(logprobs, routing))
    return out


class TrainerScorer:
    """The trainer's side of the probe: the trainer's forward (`Qwen3ForCausalLM`, the trainer's
    dtype) on the weights as posted to the sync — a private copy, so the rollout thread scores
    while the trainer trains."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.model: Qwen3ForCausalLM | None = None

    def score(self, weights: dict[str, torch.Tensor], sequences: Sequence[np.ndarray]) -> list[ProbeScore]:
        """Load `weights` into the private model and score `sequences`."""
        if self.model is None:
            first = next(iter(weights.values()))
            self.model = Qwen3ForCausalLM(self.config).to(first.device, first.dtype).eval()
        load_weights_into(self.model, weights, source="the posted weights")
        return score_with_model(self.model, sequences)


@dataclass
class ProbeComparison:
    """Engine vs trainer on the probe set."""

    logprob_max_abs: float
    routing_disagree: float
    tokens: int
    worst: list[dict[str, Any]]
    routing_layers: list[int]


def compare_scores(engine: Sequence[ProbeScore], trainer: Sequence[ProbeScore],
                   sequences: Sequence[np.ndarray]) -> ProbeComparison:
    """The largest |Δ logprob|, the routing disagreement and the worst tokens (probe index,
    position, token id, both logprobs), with the layers whose routing differs (first first)."""
    rows: list[tuple[float, int, int]] = []
    agree = total = 0
    layers: set[int] = set()
    for i, (e, t) in enumerate(zip(engine, trainer)):
        d = np.abs(np.asarray(e.logprobs, np.float64) - np.asarray(t.logprobs, np.float64))
        rows += [(float(d[p]), i, p) for p in range(1, len(d)) if np.isfinite(d[p])]
        if e.routing is not None and t.routing is not None:
            same = (np.sort(e.routing, axis=-1) == np.sort(t.routing, axis=-1)).all(axis=-1)  # [n, L]
            agree += int(same.sum())
            total += same.size
            layers.update(int(x) for x in np.nonzero(~same)[1])
    rows.sort(reverse=True)
    worst = [{"probe": i, "position": p, "token": int(sequences[i][p]),
              "engine_logprob": float(engine[i].logprobs[p]), "trainer_logprob": float(trainer[i].logprobs[p]),
              "delta": d} for d, i, p in rows[:WORST_TOKENS]]
    return ProbeComparison(rows[0][0] if rows else 0.0, 1.0 - agree / total if total else 0.0, len(rows), worst,
                           sorted(layers))


def exceeds(c: ProbeComparison, floor: ProbeFloor) -> bool:
    """Whether `c` is beyond the floor's limits (module docstring)."""
    return (c.logprob_max_abs > FLOOR_FACTOR * floor.logprob_max_abs + ABS_MARGIN
            or c.routing_disagree > FLOOR_FACTOR * floor.routing_disagree + ROUTING_MARGIN)
