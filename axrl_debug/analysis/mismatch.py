"""Training–inference mismatch over the generated tokens of a trace, vectorised over CSR arrays.

Definitions (docs/debugging.md explains them with examples)
------------------------------------------------------------
A token is *analysed* when ``/tokens/loss_mask == 1`` and both ``rollout_logprob`` and
``old_logprob`` are finite. For an analysed token

    Δ = old_logprob − rollout_logprob = log π(x) − log μ(x)

where μ is the rollout (inference-engine) policy that *sampled* x and π the trainer's recompute
with the same weights. ρ = exp(Δ) = π(x)/μ(x) is the importance ratio (the TIS weight before
truncation). Because the samples come from μ, every estimator below is an expectation under μ:

* ``k1`` = mean(−Δ)            unbiased estimate of KL(μ ‖ π) = E_μ[log μ − log π]; may be < 0.
* ``k2`` = mean(Δ² / 2)        biased (second-order) estimate of KL(μ ‖ π), always ≥ 0.
* ``k3`` = mean(ρ − 1 − Δ)     unbiased estimate of KL(μ ‖ π) (E_μ[ρ] = 1), always ≥ 0; computed
                               as expm1(Δ) − Δ in float64 so that Δ ≈ 1e-7 does not cancel away.
* ``chi2`` = mean((ρ − 1)²)    unbiased estimate of the χ² divergence χ²(π ‖ μ) = E_μ[(π/μ − 1)²].
* ``token_mult_prob_error`` = mean(exp|Δ|)  (≥ 1; 1 = no mismatch).
* ``ess`` = (Σρ)² / (n Σρ²)    normalised effective sample size of the importance weights, in (0, 1].
* ``frac_outside_clip`` = share of tokens with ρ outside [1 − clip_low, 1 + clip_high] (the run's
  PPO band, ``algo.clip_low/clip_high``); ``frac_above_tis_cap`` = share with ρ > ``algo.tis_cap``.
* ``pearson_prob`` = Pearson correlation of exp(rollout_logprob) and exp(old_logprob).

These are per-token, prefix-conditional quantities (each token's distribution given its own
sampled prefix), averaged over tokens — the same convention the trainer's loss uses. Note that the
engine's logprobs are of the temperature-scaled distribution *before* top-p/top-k (SGLang
semantics), so with top-p/top-k the sampler is not exactly μ.

Breakdowns (count, mean |Δ|, mean Δ and share of total |Δ| per bucket)
---------------------------------------------------------------------
* ``position``: index of the token inside its *response segment* — a maximal run of loss-mask
  tokens of one sample with one turn index (one assistant turn). Position 0 is the first
  generated token of the turn (computed by the engine's prefill rather than a decode step, hence
  its own bucket); then 1, 2–3, 4–7, … (powers of two).
* ``turn``: ``/tokens/turn``.
* ``rollout_prob``: exp(rollout_logprob) in [0, .01), [.01, .1), [.1, .5), [.5, .9), [.9, .99), [.99, 1].
* ``entropy``: trainer entropy (nats) in [0, .01), [.01, .1), [.1, .5), [.5, 1), [1, 2), [2, 4), [4, 8), ≥ 8.
* ``version_lag``: the step's ``policy_version`` attr − the token's ``/tokens/policy_version``.

Routing (MoE traces)
--------------------
Rows with ``/routing/rollout_valid == 1`` (all rows when it is absent) are compared with
``/routing/train`` per (token, layer) as expert *sets* (order-insensitive): ``agreement`` is the
share of rows whose sets are equal, ``overlap`` the mean |A ∩ B| / k. Row t is token t's routing
*as input*, i.e. the routing of the forward that predicted token t + 1; so the |Δ| split
``routing_delta`` classifies an analysed token t by row t − 1 of its sample: ``agrees`` when all
layers agree, ``differs`` when any layer differs, ``unknown`` when row t − 1 is not valid or t is
its sample's first token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

# Datasets each part of the analysis reads (the reader reads nothing else).
CORE_COLUMNS = ("/samples/offsets", "/tokens/loss_mask", "/tokens/rollout_logprob", "/tokens/old_logprob")
BREAKDOWN_COLUMNS = ("/tokens/turn", "/tokens/policy_version", "/tokens/entropy")
ROUTING_COLUMNS = ("/routing/rollout", "/routing/train", "/routing/rollout_valid")

POSITION_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PROB_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99)           # last bucket is [0.99, 1]
ENTROPY_EDGES = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0)  # last bucket is >= 8


def _range_labels(edges: tuple[float, ...], last: str) -> list[str]:
    labels = [f"[{_g(a)}, {_g(b)})" for a, b in zip(edges[:-1], edges[1:])]
    return labels + [last]


def _g(x: float) -> str:
    return f"{x:g}"


def _position_labels() -> list[str]:
    labels = ["0 (first)"]
    for a, b in zip(POSITION_EDGES[1:-1], POSITION_EDGES[2:]):
        labels.append(str(a) if b - a == 1 else f"{a}-{b - 1}")
    return labels + [f"{POSITION_EDGES[-1]}+"]


POSITION_LABELS = _position_labels()
PROB_LABELS = _range_labels(PROB_EDGES, "[0.99, 1]")
ENTROPY_LABELS = _range_labels(ENTROPY_EDGES, f">= {_g(ENTROPY_EDGES[-1])}")
ROUTING_DELTA_LABELS = ["agrees", "differs", "unknown"]
# bucket on the logprob itself (no exp per token): bucket i ⇔ log(edge_i) <= lp < log(edge_i+1)
_LOG_PROB_INNER = np.log(np.asarray(PROB_EDGES[1:], dtype=np.float64))
_ENT_INNER = np.asarray(ENTROPY_EDGES[1:], dtype=np.float64)


@dataclass(frozen=True)
class MismatchConfig:
    """Thresholds taken from the run's config.yaml (``algo.*``) plus analysis options."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    top_k: int = 10
    breakdowns: bool = True
    routing: bool = True
    keep_abs: bool = True            # keep every |Δ| (float32) for exact percentiles: 4 bytes per token
    plot_points: int = 0             # > 0: keep up to this many (rollout, trainer) prob pairs for plots
    per_step_percentiles: bool = False  # p50/p99 of each step too (a partition per step: step tables only)

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any] | None, **kw: Any) -> "MismatchConfig":
        algo = (config or {}).get("algo") or {}
        base = cls()
        return cls(clip_low=float(algo.get("clip_low", base.clip_low)),
                   clip_high=float(algo.get("clip_high", base.clip_high)),
                   tis_cap=float(algo.get("tis_cap", base.tis_cap)), **kw)

    def columns(self) -> tuple[list[str], list[str]]:
        """(required, optional) dataset paths for ``TraceReader.iter_columns``."""
        required = list(CORE_COLUMNS)
        if self.breakdowns:
            required += list(BREAKDOWN_COLUMNS)
        return required, (list(ROUTING_COLUMNS) if self.routing else [])


# ============================================================================ per-token pieces
@dataclass
class StepTokens:
    """The analysed tokens of one step, derived from its CSR arrays (all arrays length n)."""

    step: int
    policy_version: int
    num_tokens: int
    num_generated: int          # loss_mask == 1
    idx: np.ndarray             # int64 token index inside the step
    delta: np.ndarray           # float64 Δ = old − rollout
    rollout_lp: np.ndarray      # float64
    old_lp: np.ndarray          # float64
    offsets: np.ndarray         # int64 [N+1] (sample rows are looked up only for the top-K tokens)
    position: np.ndarray | None = None    # index inside its response segment
    turn: np.ndarray | None = None
    token_version: np.ndarray | None = None
    lag: np.ndarray | None = None
    entropy: np.ndarray | None = None     # float32
    routing: "StepRouting | None" = None


@dataclass
class StepRouting:
    layer_rows: int                   # valid rows compared
    layer_agree: np.ndarray           # int64 [L]: valid rows whose expert set agrees, per layer
    layer_hits: np.ndarray            # int64 [L]: Σ |A ∩ B| over valid rows, per layer
    topk: int                         # k (overlap = hits / (rows · k))
    token_class: np.ndarray           # int8 [n]: 0 agrees, 1 differs, 2 unknown (per analysed token)


def routing_agreement(rollout: np.ndarray, train: np.ndarray,
                      valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Compare expert sets per (token, layer), order-insensitively and without sorting.

    Returns ``agree`` ([L, T] bool: the sets are equal), per-layer counts of agreeing valid rows and
    per-layer Σ |A ∩ B| over valid rows. |A ∩ B| = Σ_i [a_i ∈ B] takes k² comparisons; the arrays
    are first transposed to [k, L, T] so that every comparison and count runs over one contiguous
    row (reductions over a short trailing axis of [T, L, k] are ~10× slower in numpy). Assumes the
    k experts of a row are distinct, which top-k guarantees."""
    t, nl, k = rollout.shape
    r = np.ascontiguousarray(rollout.transpose(2, 1, 0))
    s = np.ascontiguousarray(train.transpose(2, 1, 0))
    valid = np.ones(t, dtype=bool) if valid is None else valid
    agree = None
    hits = np.zeros(nl, dtype=np.int64)
    for i in range(k):
        found = r[i] == s[0]
        for j in range(1, k):
            found |= r[i] == s[j]
        hits += [np.count_nonzero(found[layer] & valid) for layer in range(nl)]
        agree = found if agree is None else (agree & found)
    layer_agree = np.array([np.count_nonzero(agree[layer] & valid) for layer in range(nl)], dtype=np.int64)
    return agree, layer_agree, hits


def step_tokens(step: int, policy_version: int, cols: Mapping[str, Any], cfg: MismatchConfig) -> StepTokens:
    """Select the analysed tokens of one step and derive their breakdown keys (no Python loop
    over tokens or samples: everything is array arithmetic on the CSR layout)."""
    off = np.asarray(cols["/samples/offsets"], dtype=np.int64)
    lm = np.asarray(cols["/tokens/loss_mask"])
    lr = np.asarray(cols["/tokens/rollout_logprob"])
    lt = np.asarray(cols["/tokens/old_logprob"])
    t = lm.shape[0]
    gen = lm != 0
    mask = gen & np.isfinite(lr) & np.isfinite(lt)
    idx = np.flatnonzero(mask)
    r = lr[idx].astype(np.float64)
    o = lt[idx].astype(np.float64)
    st = StepTokens(step=step, policy_version=policy_version, num_tokens=t, num_generated=int(np.count_nonzero(gen)),
                    idx=idx, delta=o - r, rollout_lp=r, old_lp=o, offsets=off)
    starts = np.zeros(t + 1, dtype=bool)
    starts[off[:-1]] = True                  # sample starts (index t only for trailing empty samples)
    starts = starts[:t]
    if cfg.breakdowns and "/tokens/turn" in cols:
        turn = np.asarray(cols["/tokens/turn"])
        # response segments: runs of loss-mask tokens within one sample and one turn
        seg_start = gen.copy()
        if t:
            seg_start[1:] &= ~gen[:-1] | starts[1:] | (turn[1:] != turn[:-1])
        ss = np.flatnonzero(seg_start)
        # segment of token t = number of segment starts at or before t (a prefix sum: O(T), no
        # binary search per token); its position = t − the start of that segment
        seg_of = np.cumsum(seg_start, dtype=np.int64)
        st.position = idx - ss[seg_of[idx] - 1] if idx.size else idx.copy()
        st.turn = turn[idx].astype(np.int64)
        tv = np.asarray(cols["/tokens/policy_version"])[idx].astype(np.int64)
        st.token_version = tv
        st.lag = policy_version - tv
        st.entropy = np.asarray(cols["/tokens/entropy"])[idx].astype(np.float32)
    if cfg.routing and "/routing/rollout" in cols and "/routing/train" in cols:
        rr, rt = np.asarray(cols["/routing/rollout"]), np.asarray(cols["/routing/train"])
        valid = cols.get("/routing/rollout_valid")
        valid = np.ones(t, dtype=bool) if valid is None else np.asarray(valid) != 0
        agree, layer_agree, layer_hits = routing_agreement(rr, rt, valid)
        row_agree = np.logical_and.reduce(agree, axis=0)       # [T]: every layer agrees
        prev = idx - 1
        has_prev = (idx > 0) & ~starts[idx]
        prev_c = np.where(has_prev, prev, 0)
        known = has_prev & valid[prev_c]
        cls = np.where(known, np.where(row_agree[prev_c], 0, 1), 2).astype(np.int8)
        st.routing = StepRouting(layer_rows=int(np.count_nonzero(valid)), layer_agree=layer_agree,
                                 layer_hits=layer_hits, topk=int(rr.shape[2]), token_class=cls)
    return st


# ============================================================================ accumulation
def _sumsq(a: np.ndarray) -> float:
    """Σ a² without BLAS: np.dot hands 1-D vectors to a multi-threaded BLAS whose thread wake-ups
    cost milliseconds per call on a busy machine; einsum's own loop is a single SIMD pass."""
    return float(np.einsum("i,i->", a, a))


@dataclass
class _Moments:
    """Sums over analysed tokens; merging two is adding (Chan's update for the correlation)."""

    n: int = 0
    sum_abs: float = 0.0
    sum_d: float = 0.0
    max_abs: float = 0.0
    sum_k2: float = 0.0
    sum_k3: float = 0.0
    sum_em1: float = 0.0          # Σ (ρ − 1), with ρ − 1 = expm1(Δ) (no cancellation near 0)
    sum_em1_sq: float = 0.0       # Σ (ρ − 1)²
    sum_mult: float = 0.0         # Σ expm1(|Δ|)
    rho_min: float = math.inf
    rho_max: float = -math.inf
    n_clip_high: int = 0
    n_clip_low: int = 0
    n_tis: int = 0
    # Pearson of p_rollout, p_train: count, means and centred (co)moments
    mx: float = 0.0
    my: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0

    def add(self, d: np.ndarray, r: np.ndarray, o: np.ndarray, cfg: MismatchConfig,
            ad: np.ndarray | None = None) -> None:
        n = d.size
        if n == 0:
            return
        ad = np.abs(d) if ad is None else ad
        em1 = np.expm1(d)
        self.sum_abs += float(ad.sum())
        self.sum_d += float(d.sum())
        self.max_abs = max(self.max_abs, float(ad.max()))
        self.sum_k2 += 0.5 * _sumsq(d)
        self.sum_k3 += float((em1 - d).sum())
        self.sum_em1 += float(em1.sum())
        self.sum_em1_sq += _sumsq(em1)
        self.sum_mult += float(np.expm1(ad).sum())
        self.rho_min = min(self.rho_min, float(em1.min()) + 1.0)
        self.rho_max = max(self.rho_max, float(em1.max()) + 1.0)
        # compare in log space: ρ > 1 + ε  ⇔  Δ > log1p(ε)
        self.n_clip_high += int(np.count_nonzero(d > math.log1p(cfg.clip_high)))
        self.n_clip_low += int(np.count_nonzero(d < math.log1p(-cfg.clip_low))) if cfg.clip_low < 1 else 0
        self.n_tis += int(np.count_nonzero(d > math.log(cfg.tis_cap)))
        x, y = np.exp(r), np.exp(o)
        mx, my = float(x.mean()), float(y.mean())
        xc, yc = x - mx, y - my
        sxx, syy, sxy = _sumsq(xc), _sumsq(yc), float(np.einsum("i,i->", xc, yc))
        n0 = self.n
        tot = n0 + n
        dx, dy = mx - self.mx, my - self.my
        f = n0 * n / tot
        self.sxx += sxx + dx * dx * f
        self.syy += syy + dy * dy * f
        self.sxy += sxy + dx * dy * f
        self.mx += dx * n / tot
        self.my += dy * n / tot
        self.n = tot

    def metrics(self) -> dict[str, float]:
        n = self.n
        nan = math.nan
        if n == 0:
            return {k: nan for k in METRIC_NAMES if k not in ("p50_abs", "p99_abs")}
        mean_em1 = self.sum_em1 / n
        chi2 = self.sum_em1_sq / n
        denom = math.sqrt(self.sxx * self.syy)
        # ESS = (Σρ)² / (n Σρ²) with Σρ = n + Σ(ρ−1), Σρ² = n + 2Σ(ρ−1) + Σ(ρ−1)²
        s1 = n + self.sum_em1
        s2 = n + 2 * self.sum_em1 + self.sum_em1_sq
        return {
            "mean_abs": self.sum_abs / n,
            "max_abs": self.max_abs,
            "mean": self.sum_d / n,
            "k1": -self.sum_d / n,
            "k2": self.sum_k2 / n,
            "k3": self.sum_k3 / n,
            "chi2": chi2,
            "token_mult_prob_error": 1.0 + self.sum_mult / n,
            "ratio_mean": 1.0 + mean_em1,
            "ratio_std": math.sqrt(max(chi2 - mean_em1 * mean_em1, 0.0)),
            "ratio_min": self.rho_min,
            "ratio_max": self.rho_max,
            "frac_outside_clip": (self.n_clip_high + self.n_clip_low) / n,
            "frac_above_clip_high": self.n_clip_high / n,
            "frac_below_clip_low": self.n_clip_low / n,
            "frac_above_tis_cap": self.n_tis / n,
            "ess": (s1 * s1) / (n * s2) if s2 > 0 else nan,
            "pearson_prob": self.sxy / denom if denom > 0 else nan,
        }


METRIC_NAMES = ("mean_abs", "max_abs", "p50_abs", "p99_abs", "mean", "k1", "k2", "k3", "chi2",
                "token_mult_prob_error", "ratio_mean", "ratio_std", "ratio_min", "ratio_max",
                "frac_outside_clip", "frac_above_clip_high", "frac_below_clip_low", "frac_above_tis_cap",
                "ess", "pearson_prob")


class _Buckets:
    """count / Σ|Δ| / ΣΔ per bucket key, keys either a fixed range or arbitrary ints (turn, lag)."""

    def __init__(self, labels: list[str] | None = None) -> None:
        self.labels = labels
        self.fixed = np.zeros((3, len(labels)), dtype=np.float64) if labels is not None else None
        self.keyed: dict[int, np.ndarray] = {}

    def add(self, keys: np.ndarray, d: np.ndarray) -> None:
        """Two bincounts instead of three: with key' = 2·key + [Δ < 0], the Δ-weighted bincount
        gives per key the sums of the positive (S⁺) and negative (S⁻) parts, so ΣΔ = S⁺ + S⁻ and
        Σ|Δ| = S⁺ − S⁻; the unweighted one gives the counts."""
        if keys.size == 0:
            return
        lo = 0 if self.fixed is not None else int(keys.min())
        comp = (keys - lo) * 2 + (d < 0)
        nb = 2 * (self.fixed.shape[1] if self.fixed is not None else int(keys.max()) - lo + 1)
        c = np.bincount(comp, minlength=nb)
        s = np.bincount(comp, weights=d, minlength=nb)
        count, s_pos, s_neg = c[0::2] + c[1::2], s[0::2], s[1::2]
        if self.fixed is not None:
            self.fixed += np.stack([count, s_pos - s_neg, s_pos + s_neg])
            return
        for i in np.flatnonzero(count):
            acc = self.keyed.setdefault(lo + int(i), np.zeros(3))
            acc += (count[i], s_pos[i] - s_neg[i], s_pos[i] + s_neg[i])

    def merge(self, other: "_Buckets") -> None:
        if self.fixed is not None:
            self.fixed += other.fixed
        for key, v in other.keyed.items():
            self.keyed.setdefault(key, np.zeros(3))[:] += v

    def rows(self, total_abs: float) -> list[dict[str, Any]]:
        if self.fixed is not None:
            items = [(lab, self.fixed[:, i]) for i, lab in enumerate(self.labels)]
        else:
            items = [(key, self.keyed[key]) for key in sorted(self.keyed)]
        out = []
        for key, (c, sa, sd) in items:
            out.append({"bucket": key, "count": int(c),
                        "mean_abs": sa / c if c else math.nan,
                        "mean": sd / c if c else math.nan,
                        "abs_share": sa / total_abs if total_abs > 0 else math.nan})
        return out


@dataclass
class TopToken:
    """One of the worst tokens (largest |Δ|); ``context`` is filled in by ``attach_context``."""

    step: int
    token: int          # index in the step's /tokens arrays
    sample: int         # row in /samples
    delta: float
    rollout_logprob: float
    old_logprob: float
    position: int | None = None
    turn: int | None = None
    policy_version: int | None = None
    lag: int | None = None
    entropy: float | None = None
    routing: str | None = None
    token_id: int | None = None
    text: str | None = None
    context: str | None = None
    sample_id: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["abs_delta"] = abs(self.delta)
        d["rollout_prob"] = math.exp(self.rollout_logprob)
        d["trainer_prob"] = math.exp(self.old_logprob)
        return d


@dataclass
class MismatchAccumulator:
    """Streams steps (``add``) and produces the mismatch report (``result``). Memory is O(analysed
    tokens) only for the exact percentiles (``keep_abs``); everything else is a fixed-size sum."""

    cfg: MismatchConfig = field(default_factory=MismatchConfig)

    def __post_init__(self) -> None:
        self.total = _Moments()
        self.num_tokens = 0
        self.num_generated = 0
        self.abs_parts: list[np.ndarray] = []
        self.per_step: list[dict[str, Any]] = []
        self.buckets = {"position": _Buckets(POSITION_LABELS), "turn": _Buckets(),
                        "rollout_prob": _Buckets(PROB_LABELS), "entropy": _Buckets(ENTROPY_LABELS),
                        "version_lag": _Buckets()}
        self.routing_delta = _Buckets(ROUTING_DELTA_LABELS)
        self.layer_rows = 0
        self.layer_agree: np.ndarray | None = None
        self.layer_hits: np.ndarray | None = None
        self.topk = 0
        self.top: list[TopToken] = []
        self.plot_x: list[np.ndarray] = []
        self.plot_y: list[np.ndarray] = []
        self.steps: list[int] = []

    # ---- streaming
    def add_columns(self, step: int, policy_version: int, cols: Mapping[str, Any]) -> dict[str, Any]:
        return self.add(step_tokens(step, policy_version, cols, self.cfg))

    def add(self, st: StepTokens) -> dict[str, Any]:
        """Fold one step in; returns that step's headline metrics (also kept in ``per_step``)."""
        cfg = self.cfg
        d = st.delta
        ad = np.abs(d)
        m = _Moments()
        m.add(d, st.rollout_lp, st.old_lp, cfg, ad)
        self._merge(m)
        self.num_tokens += st.num_tokens
        self.num_generated += st.num_generated
        self.steps.append(st.step)
        if cfg.keep_abs:
            # float32 halves the memory and the final partition's time; |Δ| keeps 7 digits
            self.abs_parts.append(ad.astype(np.float32))
        head: dict[str, Any] = {"step": st.step, "tokens": st.num_tokens, "generated": st.num_generated,
                                "analysed": int(d.size), **m.metrics()}
        if cfg.per_step_percentiles:
            head["p50_abs"], head["p99_abs"] = _percentiles(ad)
        if st.lag is not None:
            head["version_lag_mean"] = float(st.lag.mean()) if st.lag.size else math.nan
            head["version_lag_max"] = int(st.lag.max()) if st.lag.size else None
        if cfg.breakdowns and st.position is not None:
            b = self.buckets
            b["position"].add(_position_bucket(st.position), d)
            b["turn"].add(st.turn, d)
            b["rollout_prob"].add(_bucketize(st.rollout_lp, _LOG_PROB_INNER), d)
            ent = st.entropy
            ok = np.isfinite(ent)
            if ok.all():
                b["entropy"].add(_bucketize(ent, _ENT_INNER), d)
            else:
                b["entropy"].add(_bucketize(ent[ok], _ENT_INNER), d[ok])
            b["version_lag"].add(st.lag, d)
        if st.routing is not None:
            r = st.routing
            self.routing_delta.add(r.token_class.astype(np.int64), d)
            self._add_routing(r.layer_rows, r.layer_agree, r.layer_hits, r.topk)
            nl = r.layer_agree.size
            head["routing_agreement"] = float(r.layer_agree.sum()) / (r.layer_rows * nl) if r.layer_rows else math.nan
        if cfg.top_k > 0 and d.size:
            # once K tokens are known, only tokens beating the K-th best so far can enter: a cheap
            # comparison pass instead of a partition of the whole step
            cand = np.arange(d.size) if len(self.top) < cfg.top_k else np.flatnonzero(ad >= abs(self.top[-1].delta))
            k = min(cfg.top_k, cand.size)
            if k:
                sel = cand[np.argpartition(-ad[cand], k - 1)[:k]] if k < cand.size else cand
                self._merge_top(st, sel)
        if cfg.plot_points > 0 and d.size:
            stride = max(1, d.size // max(1, cfg.plot_points // 4))
            self.plot_x.append(np.exp(st.rollout_lp[::stride]))
            self.plot_y.append(np.exp(st.old_lp[::stride]))
        self.per_step.append(head)
        return head

    def _merge(self, m: _Moments) -> None:
        t = self.total
        if m.n == 0:
            return
        if t.n == 0:
            self.total = m
            return
        n0, n1 = t.n, m.n
        tot = n0 + n1
        dx, dy = m.mx - t.mx, m.my - t.my
        f = n0 * n1 / tot
        t.sxx += m.sxx + dx * dx * f
        t.syy += m.syy + dy * dy * f
        t.sxy += m.sxy + dx * dy * f
        t.mx += dx * n1 / tot
        t.my += dy * n1 / tot
        for name in ("sum_abs", "sum_d", "sum_k2", "sum_k3", "sum_em1", "sum_em1_sq", "sum_mult",
                     "n_clip_high", "n_clip_low", "n_tis"):
            setattr(t, name, getattr(t, name) + getattr(m, name))
        t.max_abs = max(t.max_abs, m.max_abs)
        t.rho_min = min(t.rho_min, m.rho_min)
        t.rho_max = max(t.rho_max, m.rho_max)
        t.n = tot

    def _add_routing(self, rows: int, agree: np.ndarray, hits: np.ndarray, topk: int) -> None:
        if self.layer_agree is None or self.layer_agree.shape != agree.shape:
            self.layer_agree = np.zeros_like(agree)
            self.layer_hits = np.zeros_like(hits)
        self.layer_agree += agree
        self.layer_hits += hits
        self.layer_rows += rows
        self.topk = topk

    def _merge_top(self, st: StepTokens, sel: np.ndarray) -> None:
        def opt(a: np.ndarray | None, i: int, conv: Any) -> Any:
            return None if a is None else conv(a[i])

        cls = st.routing.token_class if st.routing is not None else None
        # sample row: the last offset <= token (side="right" skips empty samples sharing an offset)
        rows = np.searchsorted(st.offsets, st.idx[sel], side="right") - 1
        for i, row in zip(sel.tolist(), rows.tolist()):
            self.top.append(TopToken(
                step=st.step, token=int(st.idx[i]), sample=int(row), delta=float(st.delta[i]),
                rollout_logprob=float(st.rollout_lp[i]), old_logprob=float(st.old_lp[i]),
                position=opt(st.position, i, int), turn=opt(st.turn, i, int),
                policy_version=opt(st.token_version, i, int), lag=opt(st.lag, i, int),
                entropy=opt(st.entropy, i, float),
                routing=None if cls is None else ROUTING_DELTA_LABELS[int(cls[i])]))
        self._trim_top()

    def _trim_top(self) -> None:
        # stable order: |Δ| descending, then (step, token) ascending
        self.top.sort(key=lambda t: (-abs(t.delta), t.step, t.token))
        del self.top[self.cfg.top_k:]

    def merge(self, other: "MismatchAccumulator") -> None:
        """Fold in an accumulator built over other steps (e.g. by a worker process)."""
        self._merge(other.total)
        self.num_tokens += other.num_tokens
        self.num_generated += other.num_generated
        self.abs_parts += other.abs_parts
        self.per_step += other.per_step
        self.per_step.sort(key=lambda h: h["step"])
        self.steps = sorted(self.steps + other.steps)
        for name, b in self.buckets.items():
            b.merge(other.buckets[name])
        self.routing_delta.merge(other.routing_delta)
        if other.layer_agree is not None:
            self._add_routing(other.layer_rows, other.layer_agree, other.layer_hits, other.topk)
        self.top += other.top
        self._trim_top()
        self.plot_x += other.plot_x
        self.plot_y += other.plot_y

    # ---- result
    def result(self) -> dict[str, Any]:
        metrics = self.total.metrics()
        ad = np.concatenate(self.abs_parts) if self.abs_parts else np.zeros(0)
        p50, p99 = _percentiles(ad) if self.cfg.keep_abs else (math.nan, math.nan)
        ordered = {name: metrics.get(name, math.nan) for name in METRIC_NAMES}
        ordered["p50_abs"], ordered["p99_abs"] = p50, p99
        out: dict[str, Any] = {
            "steps": list(self.steps),
            "thresholds": {"clip_low": self.cfg.clip_low, "clip_high": self.cfg.clip_high,
                           "tis_cap": self.cfg.tis_cap},
            "tokens": {"total": self.num_tokens, "generated": self.num_generated, "analysed": self.total.n},
            "metrics": ordered,
        }
        total_abs = self.total.sum_abs
        if self.cfg.breakdowns:
            out["breakdowns"] = {name: b.rows(total_abs) for name, b in self.buckets.items()}
        if self.layer_agree is not None:
            rows, k = self.layer_rows, max(self.topk, 1)
            layers = [{"layer": i, "rows": rows,
                       "agreement": float(a) / rows if rows else math.nan,
                       "overlap": float(h) / (rows * k) if rows else math.nan}
                      for i, (a, h) in enumerate(zip(self.layer_agree, self.layer_hits))]
            nl = len(layers)
            out["routing"] = {
                "rows": rows,
                "agreement": float(self.layer_agree.sum()) / (rows * nl) if rows and nl else math.nan,
                "overlap": float(self.layer_hits.sum()) / (rows * nl * k) if rows and nl else math.nan,
                "layers": layers,
                "delta": self.routing_delta.rows(total_abs),
            }
        else:
            out["routing"] = None
        out["top"] = [t.as_dict() for t in self.top]
        out["per_step"] = self.per_step
        return out

    def abs_deltas(self) -> np.ndarray:
        return np.concatenate(self.abs_parts) if self.abs_parts else np.zeros(0)

    def plot_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.plot_x:
            return np.zeros(0), np.zeros(0)
        x, y = np.concatenate(self.plot_x), np.concatenate(self.plot_y)
        if x.size > self.cfg.plot_points > 0:
            keep = np.linspace(0, x.size - 1, self.cfg.plot_points).astype(np.int64)
            x, y = x[keep], y[keep]
        return x, y


def _bucketize(x: np.ndarray, inner_edges: np.ndarray) -> np.ndarray:
    """Bucket i ⇔ inner_edges[i-1] <= x < inner_edges[i] (like searchsorted(side="right")), as a
    sum of a few comparisons: for ≤ 8 edges this beats a binary search per element several times."""
    out = np.zeros(x.shape, dtype=np.int64)
    for e in inner_edges:
        out += x >= e
    return out


def _position_bucket(pos: np.ndarray) -> np.ndarray:
    """0 → 0, 1 → 1, 2–3 → 2, 4–7 → 3, … (the bit length), capped at the last POSITION bucket:
    frexp's exponent is exactly the bit length of a non-negative integer."""
    return np.minimum(np.frexp(pos.astype(np.float64))[1], len(POSITION_LABELS) - 1).astype(np.int64)


def _percentiles(ad: np.ndarray) -> tuple[float, float]:
    if ad.size == 0:
        return math.nan, math.nan
    p50, p99 = np.percentile(ad, [50, 99])  # linear interpolation (numpy's default)
    return float(p50), float(p99)


def analyse(columns_by_step: Any, cfg: MismatchConfig) -> MismatchAccumulator:
    """Fold an iterable of ``StepColumns`` (``TraceReader.iter_columns``) into an accumulator."""
    acc = MismatchAccumulator(cfg)
    for sc in columns_by_step:
        acc.add_columns(sc.step, int(sc.attrs.get("policy_version", -1)), sc.data)
    return acc


def attach_context(reader: Any, top: list[dict[str, Any]], tokenizer: Any = None, *,
                   before: int = 12, after: int = 4) -> None:
    """Fill ``token_id``, ``text``, ``sample_id`` and ``context`` of the top tokens in place.

    Reads only the few ids around each token (``StepFile.read_slice``); the context is the decoded
    ``before`` tokens, the token itself marked as ⟦…⟧, then ``after`` tokens, all from its own sample.
    ``tokenizer`` defaults to ``Tokenizer.default()`` (traces store ids, not text)."""
    if not top:
        return
    if tokenizer is None:
        from axrl.tokenizer import Tokenizer
        tokenizer = Tokenizer.default()
    from axrl.trace import StepFile

    def dec(ids: np.ndarray) -> str:
        try:
            return tokenizer.decode([int(i) for i in ids])
        except Exception:  # ids outside this tokenizer's vocabulary: show them raw
            return " ".join(f"<{int(i)}>" for i in ids)

    by_step: dict[int, list[dict[str, Any]]] = {}
    for t in top:
        by_step.setdefault(int(t["step"]), []).append(t)
    for step, items in by_step.items():
        try:
            with StepFile(reader.step_path(step)) as sf:
                off = sf["/samples/offsets"]
                sid = sf["/samples/sample_id"]
                for t in items:
                    s0, s1 = int(off[t["sample"]]), int(off[t["sample"] + 1])
                    a, b = max(s0, t["token"] - before), min(s1, t["token"] + 1 + after)
                    ids = sf.read_slice("/tokens/ids", a, b)
                    j = t["token"] - a
                    t["token_id"] = int(ids[j])
                    t["sample_id"] = int(sid[t["sample"]])
                    t["text"] = dec(ids[j:j + 1])
                    ctx = ("…" if a > s0 else "") + dec(ids[:j]) + "⟦" + t["text"] + "⟧" + dec(ids[j + 1:]) \
                        + ("…" if b < s1 else "")
                    t["context"] = ctx.replace("\n", "⏎")
        except Exception as e:  # context is a nicety: never fail the analysis over it
            reader.report_problem(reader.step_path(step) if step in reader.steps else reader.path,
                                  f"cannot read token context of step {step}: {e}")


def _analyse_steps(run: str, steps: list[int], cfg: MismatchConfig) -> tuple["MismatchAccumulator", list[tuple[str, str]]]:
    """Worker body: analyse ``steps`` of ``run`` (already validated by the parent)."""
    from axrl.trace import TraceReader

    reader = TraceReader(run, validate=False)
    required, optional = cfg.columns()
    acc = analyse(reader.iter_columns(required, steps, optional=optional), cfg)
    return acc, [(str(p.path), p.message) for p in reader.problems]


def auto_workers(paths: list[Any], *, min_bytes_per_worker: int = 16 << 20) -> int:
    """Processes worth starting: one per ~16 MB of step files, at most one per usable CPU (a fork
    costs ~50 ms; decompressing 16 MB of gzip-1 costs ~0.5 s on the dev box)."""
    import os

    total = sum(p.stat().st_size for p in paths)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, len(paths), total // min_bytes_per_worker))


def _partition(steps: list[int], sizes: list[int], parts: int) -> list[list[int]]:
    """Contiguous groups of steps with roughly equal bytes."""
    total = float(sum(sizes)) or 1.0
    groups: list[list[int]] = [[] for _ in range(parts)]
    before = 0
    for step, size in zip(steps, sizes):
        groups[min(parts - 1, int(parts * (before + size / 2) / total))].append(step)
        before += size
    return [g for g in groups if g]


def mismatch_report(reader: Any, steps: list[int] | None, cfg: MismatchConfig, *,
                    context: bool = True, workers: int = 1) -> tuple[dict[str, Any], MismatchAccumulator]:
    """What ``axrl-debug mismatch`` computes: stream the selected steps (only the datasets the
    analysis needs), build the report and decode the worst tokens' context.

    ``workers > 1`` analyses contiguous groups of step files in that many processes and merges
    their accumulators (h5py serialises every call inside one process, so threads would not help;
    the work is dominated by gzip decompression, which scales with processes). ``workers = 0``
    picks ``auto_workers``. The result is the same as with one worker, up to float summation order."""
    steps = list(reader.steps if steps is None else steps)
    paths = [reader.step_path(s) for s in steps]
    if workers == 0:
        workers = auto_workers(paths)
    if workers > 1 and len(steps) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        groups = _partition(steps, [p.stat().st_size for p in paths], workers)
        # fork: children inherit the imported modules (numpy, h5py) instead of re-importing them
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=len(groups), mp_context=ctx) as pool:
            parts = list(pool.map(_analyse_steps, [str(reader.path)] * len(groups), groups,
                                  [cfg] * len(groups)))
        acc = MismatchAccumulator(cfg)
        for part, problems in parts:
            acc.merge(part)
            for path, msg in problems:
                reader.report_problem(path, msg)
    else:
        required, optional = cfg.columns()
        acc = analyse(reader.iter_columns(required, steps, optional=optional), cfg)
    res = {"run": str(reader.path), **acc.result()}
    if context:
        attach_context(reader, res["top"])
    return res, acc
