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
from torch.func import functional_call

from axrl.model import ModelConfig, Qwen3ForCausalLM

FLOOR_FACTOR = 4.0      # a clean engine's Δ moves with the weights; 4× its calibrated value is still clean
ABS_MARGIN = 1e-4       # logprob: above a floor of 0 (bitwise engines), what a stale tensor shows at least
ROUTING_MARGIN = 0.02   # share of (token, layer) rows whose expert set may differ beyond the floor's
WORST_TOKENS = 5        # probe tokens named in a failure
PROBE_TOKENS = 128      # a probe sample is cut to its first tokens: the cost is one short forward a side


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


def score_with_model(model: torch.nn.Module, sequences: Sequence[np.ndarray],
                     weights: dict[str, torch.Tensor] | None = None) -> list[ProbeScore]:
    """Teacher-forced logprobs (temperature 1) and routing of each sequence by `model`'s own
    forward — with `weights` in place of its parameters when given (`functional_call`: no copy) —
    in one right-padded batch (the same batch on both sides, so padding cannot tell them apart)."""
    device = next(model.parameters()).device
    n = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), n, dtype=torch.int64, device=device)
    mask = torch.zeros(len(sequences), n, dtype=torch.int64, device=device)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.as_tensor(np.asarray(seq, dtype=np.int64))
        mask[i, :len(seq)] = 1
    kwargs = {"attention_mask": mask, "return_routing": model.config.is_moe}
    with torch.inference_mode():
        o = model(ids, **kwargs) if weights is None else functional_call(model, weights, (ids,), kwargs)
        lp = torch.log_softmax(o.logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        lp, routing = lp.double().cpu().numpy(), None if o.routed_experts is None else o.routed_experts.cpu().numpy()
    return [ProbeScore(np.concatenate([[np.nan], lp[i, :len(seq) - 1]]),
                       None if routing is None else routing[i, :len(seq)]) for i, seq in enumerate(sequences)]


class TrainerScorer:
    """The trainer's side of the probe: the trainer's forward (`Qwen3ForCausalLM`) run on the
    weights as posted to the sync (their dtype and device) — a private module, so the rollout
    thread scores while the trainer trains, and no copy of the weights."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.model: Qwen3ForCausalLM | None = None

    def score(self, weights: dict[str, torch.Tensor], sequences: Sequence[np.ndarray]) -> list[ProbeScore]:
        """Score `sequences` with `weights` (HF names, as posted)."""
        first = next(iter(weights.values()))
        if self.model is None:
            # its initial values are never used (the posted weights replace them), but drawing
            # them must not move the process' RNG: a run with the sentinel on or off is the same
            with torch.random.fork_rng(devices=[]):
                self.model = Qwen3ForCausalLM(self.config).to(first.device, first.dtype).eval()
        if self.config.tie_word_embeddings:
            weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
        return score_with_model(self.model, sequences, weights)


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
