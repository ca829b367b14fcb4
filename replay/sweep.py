"""`--sweep`: a named family of what-if variants of a spiking step, ranked by how much each
reduces the spike (the largest update grad norm, then the largest update size ‖Δθ‖).

Families (the mitigations AxisRL's spike-replay workflow tries, one what-if each):

    mitigations   tis_cap + r3 + advantage + aggregation (below), together
    tis_cap       the token train/rollout weight truncated harder: correction.tis.cap 1.5, 1.0
    r3            R3 off / on, on loss tokens only, on all MoE layers but the first (MoE runs
                  with recorded routing only)
    advantage     advantages clipped to [−1, 1]; negative advantage mass balanced against positive
    aggregation   the other loss aggregations
    objectives    the other registered objectives (gspo with its paper band)
    corrections   IcePop, MIS (token, geometric), a veto at 1e-3, sequence-level TIS
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from axrl.algo import CORRECTIONS, OBJECTIVES
from axrl.config import Config
from axrl.model.config import ModelConfig
from replay.plan import ReplayInputError
from replay.whatif import VariantResult

Family = Callable[[Config, ModelConfig, bool], list[list[str]]]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _tis_cap(cfg: Config, model: ModelConfig, routing: bool) -> list[list[str]]:
    return [[f"algo.correction.tis.cap={cap}"] for cap in (1.5, 1.0)]


def _r3(cfg: Config, model: ModelConfig, routing: bool) -> list[list[str]]:
    if not model.is_moe or not routing:
        return []
    moe = [i for i in range(model.num_hidden_layers) if model.is_moe_layer(i)]
    out = [["r3=false", "r3_scope=null"]] if cfg.r3 else [["r3=true", "r3_scope=null"]]
    out.append(["r3=true", "r3_scope={loss_tokens_only: true}"])
    if len(moe) > 1:
        out.append(["r3=true", f"r3_scope={{exclude_layers: [{moe[0]}]}}"])
    return out


def _advantage(cfg: Config, model: ModelConfig, routing: bool) -> list[list[str]]:
    return [["algo.advantage_clip=1.0"], ["algo.advantage_balance=true"]]


def _aggregation(cfg: Config, model: ModelConfig, routing: bool) -> list[list[str]]:
    return [[f"algo.loss_agg={m}"] for m in AGGREGATIONS if m != cfg.algo.loss_agg]


def _objectives(cfg: Config, model: ModelConfig, routing: bool) -> list[list[str]]:
    out = []
    for name in OBJECTIVES.names():
        if name == cfg.algo.loss:
            continue
        band = ["algo.clip_low=0.0003", "algo.clip_high=0.0004"] if name.startswith("gspo") else []
        out.append([f"algo.loss={name}", "algo.loss_args={}", *band])
    return out


def _corrections(cfg: Config, model: ModelConfig, routing: bool) -> list[list[str]]:
    wanted = [["algo.correction.icepop={}"], ["algo.correction.mis={level: token}"],
              ["algo.correction.mis={level: geometric}"], ["algo.correction.veto={threshold: 0.001}"],
              ["algo.correction.tis={level: sequence, cap: 2.0}"]]
    return [v for v in wanted if v[0].split("=")[0].split(".")[2] in CORRECTIONS]


FAMILIES: dict[str, Family] = {"tis_cap": _tis_cap, "r3": _r3, "advantage": _advantage,
                               "aggregation": _aggregation, "objectives": _objectives, "corrections": _corrections}
FAMILIES["mitigations"] = lambda cfg, model, routing: [v for name in ("tis_cap", "r3", "advantage", "aggregation")
                                                       for v in FAMILIES[name](cfg, model, routing)]


def family_variants(name: str, cfg: Config, model: ModelConfig, routing: bool) -> list[list[str]]:
    """The what-if assignments of family `name` for this run (ReplayInputError for an unknown one)."""
    if name not in FAMILIES:
        raise ReplayInputError(f"--family {name!r}: unknown sweep family; choose from {sorted(FAMILIES)}")
    return FAMILIES[name](cfg, model, routing)


@dataclass
class Ranked:
    rank: int
    label: str
    grad_norm: float             # largest update grad norm of the variant
    grad_norm_change: float      # relative to the baseline: −0.4 = 40 % lower
    update_norm: float
    update_norm_change: float
    loss: float                  # mean update loss

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _peak(rows: Sequence[dict[str, float]], key: str) -> float:
    values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return max(values) if values else math.nan


def _change(value: float, base: float) -> float:
    return value / base - 1.0 if base > 0 and math.isfinite(value) else math.nan


def rank_variants(baseline: Sequence[dict[str, float]], variants: Sequence[VariantResult]) -> list[Ranked]:
    """Variants ordered by the largest update grad norm (lowest first), then the update size."""
    g0, u0 = _peak(baseline, "grad_norm"), _peak(baseline, "update_norm")
    rows = []
    for v in variants:
        g, u = _peak(v.updates, "grad_norm"), _peak(v.updates, "update_norm")
        losses = [r["loss"] for r in v.updates if "loss" in r]
        rows.append(Ranked(0, v.label, g, _change(g, g0), u, _change(u, u0),
                           sum(losses) / len(losses) if losses else math.nan))
    key = lambda r: (math.inf if math.isnan(r.grad_norm) else r.grad_norm,  # noqa: E731
                     math.inf if math.isnan(r.update_norm) else r.update_norm)
    rows.sort(key=key)
    for i, r in enumerate(rows, 1):
        r.rank = i
    return rows
