"""Spike detection on per-step metrics and attribution of a spike to samples and tokens.

Detection
---------
For each watched metric x (default: loss, grad_norm, mismatch, reward) and each step i, the
baseline is the *trailing* window of the previous ``window`` finite values (the current value is
excluded, so a spike cannot hide itself):

    med_i   = median(window)          MAD_i = median(|window − med_i|)
    scale_i = max(1.4826 · MAD_i, rel_floor · |med_i|, abs_floor)
    z_i     = (x_i − med_i) / scale_i

(for grad norm and the mismatch metrics only upward: z_i > threshold, unless ``two_sided``).
On a trace that splits the mismatch (``mismatch_engine`` / ``mismatch_staleness``, asynchronous
runs) the watched mismatch is the engine part: stale tokens make the total move with the policy's
own drift, which is no engine disagreement (watch ``mismatch_staleness`` explicitly for that).

1.4826·MAD is the normal-consistent robust standard deviation. Steps with fewer than
``min_history`` finite values before them (5; the whole window when it is shorter) are never
flagged: the MAD of three or four values is no scale (a quickstart-shaped run's loss at step 4
scored z = 5.8 on one CPU from noise, against the MAD of steps 0–3).

A large z alone is not a spike: ten steps of a quantity that is almost constant give a tiny MAD,
and then noise scores z = 13 (the healthy quickstart's loss moves by ±5e-4 around 0; its mismatch
is fp32 rounding, 2e-8..1.1e-7). So a step is flagged only when |z_i| > threshold **and** the
deviation is large in its own units:

* positive scale metrics (grad norm, mismatch, ratio max, …, ``ONE_SIDED_UP``): x_i ≥ ``min_ratio``
  × med_i (default 3.5: the healthy quickstart's grad norm has reached 3.1× its trailing median once
  in 40 steps, with z = 5.3, on one CPU, 2.7× on another; the learning-rate fault of
  ``examples/spike_lr.yaml`` takes it to 3.9–4.2×);
* the mismatch metrics (mean, p99 and max |Δ|) also x_i ≥ ``rounding_ulps`` · eps(dtype), eps
  the machine epsilon of the run's ``model.dtype`` (fp32 1.19e-7, bf16 7.8e-3): a mean |Δ| below
  4 ulps is rounding, not a disagreement (healthy fp32 runs measure 0.2–1.3 ulps);
* the loss: |x_i − med_i| ≥ ``loss_floor`` · E|A|_i, E|A| the step's mean |advantage| over its
  loss tokens (``advantage_abs_mean``). The PPO loss at ratio 1 is −E[w·A] ≈ 0 (advantages are
  centred); what moves it is E[(ratio − 1)·A], so a deviation under 1 % of E|A| is a policy
  change under 1 % per token — noise next to a 20 % clip band. Without the column (metrics.jsonl
  only, before the TUI's scan) the loss is not flagged.

Attribution
-----------
The loss proxy of token t (analysed from recorded data only, no model needed) is its policy-
gradient contribution to the loss of the update that trained it, evaluated at the start of the
update (PPO ratio π/π_old = 1, so nothing is clipped):

    c_t = −A_t · w_t · g_t

with A_t the recorded advantage, w_t = min(exp(old − rollout), tis_cap) the TIS weight when
``algo.tis`` is on (1 otherwise, and 1 where the rollout logprob is missing) and g_t the token's
weight in ``algo.loss_agg`` over its update's batch (``/train/update_samples``): 1/M (token-mean),
1/(S·n_i) (seq-mean-token-mean), 1/S (seq-mean-token-sum), with M loss tokens, S samples with loss
tokens in the update and n_i the loss tokens of sample i. For the first update of a step Σ c_t is
the update's policy-gradient loss exactly (KL/entropy terms aside); for later updates it ignores
the ratio drift (replay gives the exact value). When ``RUN/replay/step_XXXXXX.h5`` exists (written
by ``axrl-debug replay --dump``) its ``/tokens/loss_contribution`` (summed over any update axis)
replaces the proxy and its ``/tokens/ratio`` (π/π_old in the re-executed update) is reported,
with ``source = "replay"`` (layout: ``replay/dump.py``).

The importance-weight side ranks tokens by |Δ| = |old − rollout| (|log w| before truncation) and
samples by their sequence-level log importance weight Σ_t Δ_t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

import h5py

from axrl.algo.loss_config import PolicyLossConfig
from axrl.trace import TraceReader

DEFAULT_SPIKE_METRICS = ("loss", "grad_norm", "mismatch", "reward")
# Which deviations count by default: a grad norm or mismatch that *drops* is not a spike worth
# attributing; loss (signed, either way can be a blow-up) and reward (a collapse matters) are two-sided.
ONE_SIDED_UP = frozenset({"grad_norm", "mismatch", "mismatch_max", "mismatch_p99", "mismatch_engine",
                          "mismatch_staleness", "kl_k3", "ratio_max", "frac_above_tis_cap", "version_lag_mean",
                          "version_lag_max"})
MAD_TO_SIGMA = 1.4826


# Machine epsilon of the dtypes a run may compute in (`model.dtype`).
DTYPE_EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
# |Δ| metrics whose values below a few ulps of the run's dtype are rounding.
ROUNDING_METRICS = frozenset({"mismatch", "mismatch_p99", "mismatch_max", "mismatch_engine"})
# On a trace that splits the mismatch (asynchronous runs with /tokens/behaviour_train_logprob), the
# watched "mismatch" is its engine part: the staleness part is policy drift the run asked for (how
# far the weights moved since the tokens were generated), not an engine disagreeing with the trainer.
SPLIT_MISMATCH = "mismatch_engine"
# The step-table column that scales the loss floor.
ADVANTAGE_SCALE = "advantage_abs_mean"


@dataclass(frozen=True)
class SpikeConfig:
    metrics: tuple[str, ...] = DEFAULT_SPIKE_METRICS
    window: int = 10
    threshold: float = 5.0
    min_history: int = 5          # a robust scale needs more than a handful of values
    rel_floor: float = 0.1
    abs_floor: float = 1e-12
    two_sided: bool = False       # True: flag drops of the ONE_SIDED_UP metrics too
    min_ratio: float = 3.5        # ONE_SIDED_UP metrics: value ≥ min_ratio × baseline (or ≤ 1/min_ratio ×)
    rounding_ulps: float = 4.0    # mismatch metrics: value ≥ rounding_ulps × eps(dtype)
    loss_floor: float = 0.01      # loss: |value − baseline| ≥ loss_floor × mean |advantage| of the step
    dtype: str = "float32"        # the run's model.dtype (``for_run`` reads it from config.yaml)

    @classmethod
    def for_run(cls, run_config: Mapping[str, Any] | None, **options: Any) -> "SpikeConfig":
        """The config for a run: its ``model.dtype`` sets the rounding floor."""
        dtype = ((run_config or {}).get("model") or {}).get("dtype") or "float32"
        return cls(dtype=str(dtype), **options)

    @property
    def rounding_floor(self) -> float:
        """The smallest mean |Δ| that is not rounding: ``rounding_ulps`` · eps(dtype)."""
        return self.rounding_ulps * DTYPE_EPS.get(self.dtype, DTYPE_EPS["float32"])


def robust_z(values: np.ndarray, cfg: SpikeConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(baseline median, scale, z) per position of ``values`` from the trailing window (see module
    docstring). Vectorised with a sliding window view; NaN where there is too little history."""
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    med = np.full(n, np.nan)
    scale = np.full(n, np.nan)
    if n == 0:
        return med, scale, np.full(0, np.nan)
    w = max(1, int(cfg.window))
    padded = np.concatenate([np.full(w, np.nan), x[:-1]])       # value i sees x[i-w : i]
    win = np.lib.stride_tricks.sliding_window_view(padded, w)    # [n, w]
    finite = np.isfinite(win)
    enough = finite.sum(axis=1) >= max(1, min(cfg.min_history, w))   # a full short window is enough
    if enough.any():
        wv = win[enough]
        m = np.nanmedian(wv, axis=1)
        mad = np.nanmedian(np.abs(wv - m[:, None]), axis=1)
        med[enough] = m
        scale[enough] = np.maximum.reduce([MAD_TO_SIGMA * mad, cfg.rel_floor * np.abs(m),
                                           np.full(m.shape, cfg.abs_floor)])
    with np.errstate(invalid="ignore", divide="ignore"):
        z = (x - med) / scale
    return med, scale, z


def large_enough(metric: str, x: np.ndarray, med: np.ndarray, df: pd.DataFrame, cfg: SpikeConfig) -> np.ndarray:
    """Whether each deviation x − med is large in the metric's own units (see the module docstring);
    the robust z decides whether it is unusual."""
    with np.errstate(invalid="ignore"):
        ok = np.ones(x.shape, dtype=bool)
        if metric in ONE_SIDED_UP:
            up = x >= cfg.min_ratio * med
            ok &= np.where(x >= med, up, x * cfg.min_ratio <= med) | (med <= 0)
        if metric in ROUNDING_METRICS:
            ok &= x >= cfg.rounding_floor
        if metric == "loss":
            scale = df[ADVANTAGE_SCALE].to_numpy(dtype=np.float64) if ADVANTAGE_SCALE in df else np.full(x.shape, np.nan)
            ok &= np.abs(x - med) >= cfg.loss_floor * scale   # NaN scale: never a spike
    return ok


def detect(df: pd.DataFrame, cfg: SpikeConfig) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """Add ``spike_<metric>_z`` columns and a ``spikes`` column (comma-separated metric names) to a
    copy of the step table; return it and the list of spikes (one entry per step and metric)."""
    out = df.sort_values("step").reset_index(drop=True).copy()
    flagged: list[list[str]] = [[] for _ in range(len(out))]
    spikes: list[dict[str, Any]] = []
    split = SPLIT_MISMATCH in out.columns and bool(out[SPLIT_MISMATCH].notna().any())
    for metric in dict.fromkeys(SPLIT_MISMATCH if m == "mismatch" and split else m for m in cfg.metrics):
        if metric not in out.columns:
            continue
        x = out[metric].to_numpy(dtype=np.float64)
        med, scale, z = robust_z(x, cfg)
        out[f"{metric}_z"] = z
        zz = np.nan_to_num(z, nan=0.0)
        unusual = zz > cfg.threshold if (metric in ONE_SIDED_UP and not cfg.two_sided) else np.abs(zz) > cfg.threshold
        for i in np.flatnonzero(unusual & large_enough(metric, x, med, out, cfg)):
            flagged[i].append(metric)
            spikes.append({"step": int(out["step"].iloc[i]), "metric": metric, "value": float(x[i]),
                           "baseline": float(med[i]), "scale": float(scale[i]), "z": float(z[i]),
                           "direction": "up" if z[i] > 0 else "down"})
    out["spikes"] = [",".join(f) for f in flagged]
    spikes.sort(key=lambda s: (s["step"], -abs(s["z"])))
    return out, spikes


# ============================================================================ attribution
_ATTR_COLUMNS = ["/samples/offsets", "/samples/sample_id", "/samples/group_id", "/samples/reward",
                 "/samples/num_turns", "/tokens/loss_mask", "/tokens/advantage", "/tokens/rollout_logprob",
                 "/tokens/old_logprob", "/tokens/turn", "/tokens/policy_version",
                 "/train/update_samples", "/train/updates/sample_offsets"]


def replay_dump_path(run: Path, step: int) -> Path | None:
    """``RUN/replay/step_XXXXXX.h5`` (or ``step_N.h5``) if the replay tool dumped this step."""
    for name in (f"step_{step:06d}.h5", f"step_{step}.h5"):
        p = Path(run) / "replay" / name
        if p.is_file():
            return p
    return None


def _per_token(a: np.ndarray, t: int) -> np.ndarray:
    """A replay dataset as [T]: sums any extra axis (e.g. one column per update)."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 1:
        return a
    if a.shape[0] == t:
        return np.nansum(a.reshape(t, -1), axis=1)
    if a.shape[-1] == t:
        return np.nansum(a.reshape(-1, t), axis=0)
    raise ValueError(f"shape {a.shape} does not have a token axis of length {t}")


def loss_proxy(cols: Mapping[str, Any], algo: Mapping[str, Any]) -> np.ndarray:
    """c_t = −A_t · w_t · g_t per token (0 outside the loss mask); see the module docstring."""
    off = np.asarray(cols["/samples/offsets"], dtype=np.int64)
    lm = np.asarray(cols["/tokens/loss_mask"]) != 0
    adv = np.asarray(cols["/tokens/advantage"], dtype=np.float64)
    delta = np.asarray(cols["/tokens/old_logprob"], dtype=np.float64) - \
        np.asarray(cols["/tokens/rollout_logprob"], dtype=np.float64)
    t, n = lm.size, off.size - 1
    # the run's token TIS as its loss resolved it (algo.tis: null = on unless a correction is named)
    short_form = PolicyLossConfig.model_construct(tis=algo.get("tis", True), correction=algo.get("correction") or {})
    if short_form.tis_short_form():
        w = np.where(lm & np.isfinite(delta), np.minimum(np.exp(np.where(np.isfinite(delta), delta, 0.0)),
                                                         float(algo.get("tis_cap", 2.0))), 1.0)
    else:
        w = np.ones(t)
    lengths = np.diff(off)
    sample_of = np.repeat(np.arange(n), lengths)
    n_i = np.bincount(sample_of, weights=lm, minlength=n)          # loss tokens per sample
    mode = algo.get("loss_agg", "token-mean")
    us = np.asarray(cols["/train/update_samples"], dtype=np.int64)
    uo = np.asarray(cols["/train/updates/sample_offsets"], dtype=np.int64)
    # g per sample, summed over the updates that trained it (a sample may be trained more than once)
    g_sample = np.zeros(n)
    g_token_mean = np.zeros(n)
    for u in range(uo.size - 1):                                     # loop over updates (few), not tokens
        rows = us[uo[u]:uo[u + 1]]
        m_u = n_i[rows].sum()
        s_u = np.count_nonzero(n_i[rows] > 0)
        if mode == "token-mean":
            np.add.at(g_token_mean, rows, 1.0 / max(m_u, 1))
        elif mode == "seq-mean-token-mean":
            np.add.at(g_sample, rows, 1.0 / (max(s_u, 1) * np.maximum(n_i[rows], 1)))
        else:  # seq-mean-token-sum (and -norm, whose constant length only rescales)
            np.add.at(g_sample, rows, 1.0 / max(s_u, 1))
    g = (g_token_mean + g_sample)[sample_of] if t else np.zeros(0)
    return np.where(lm, -adv * w * g, 0.0)


def attribute(reader: TraceReader, step: int, *, top: int = 5) -> dict[str, Any]:
    """The samples and tokens that carry a step's loss and importance weights (module docstring)."""
    cols = next(reader.iter_columns(_ATTR_COLUMNS, [step]), None)
    if cols is None:
        return {"step": step, "error": "step file unreadable (see problems)"}
    d = cols.data
    algo = (reader.config or {}).get("algo") or {}
    lm = np.asarray(d["/tokens/loss_mask"]) != 0
    dump = replay_dump_path(reader.path, step)
    contrib, source, ratio = _loss_contribution(reader, dump, d, algo, lm)
    at = _Attribution.of(d, int(cols.attrs.get("policy_version", -1)), lm, contrib, ratio)
    return {
        "step": step, "policy_version": at.pv, "source": source,
        "replay_dump": str(dump) if dump is not None else None,
        "loss_proxy_total": float(contrib.sum()),
        "samples_by_loss": [at.sample_row(i) for i in _top_idx(at.s_abs, top)],
        "tokens_by_loss": [at.token_row(j) for j in _top_idx(at.abs_c, top)],
        "samples_by_weight": [at.sample_row(i) for i in _top_idx(np.abs(at.s_logw), top)],
        "tokens_by_weight": [at.token_row(j) for j in _top_idx(np.abs(at.delta0), top)],
    }


def _loss_contribution(reader: TraceReader, dump: Path | None, d: Mapping[str, Any], algo: Mapping[str, Any],
                       lm: np.ndarray) -> tuple[np.ndarray, str, np.ndarray | None]:
    """Each token's loss contribution, where it came from ("proxy" | "replay") and the replayed
    ratio: the replay dump's where it has them, else the proxy (module docstring)."""
    contrib, source, ratio = loss_proxy(d, algo), "proxy", None
    if dump is None:
        return contrib, source, ratio
    t = lm.size
    try:
        # plain h5py: a dump need not be a full step file (numeric datasets only, nothing unpickled)
        with h5py.File(dump, "r") as f:
            if "/tokens/loss_contribution" in f:
                contrib = np.where(lm, np.nan_to_num(_per_token(f["/tokens/loss_contribution"][()], t)), 0.0)
                source = "replay"
            if "/tokens/ratio" in f:
                ratio = _per_token(f["/tokens/ratio"][()], t)
    except Exception as e:  # a damaged dump must not hide the proxy answer
        reader.report_problem(dump, f"{dump}: replay dump unreadable, using the proxy ({e})")
    return contrib, source, ratio


def _top_idx(score: np.ndarray, k: int) -> list[int]:
    """The indices of the `k` largest positive scores, largest first (ties: lower index first)."""
    order = np.lexsort((np.arange(score.size), -score))   # stable: score desc, then index
    return [int(i) for i in order[:k] if score[i] > 0]


@dataclass
class _Attribution:
    """One step's columns for `attribute`: per token (T) and per sample (N), with the loss
    contribution's and the importance weights' per-sample sums."""

    pv: int                      # the step's policy version
    off: np.ndarray              # [N + 1] sample offsets
    lm: np.ndarray               # bool [T] loss mask
    sample_of: np.ndarray        # [T] sample row of each token
    delta: np.ndarray            # float64 [T] old − rollout logprob
    analysed: np.ndarray         # bool [T] loss tokens with a finite Δ
    delta0: np.ndarray           # [T] Δ at analysed tokens, else 0
    contrib: np.ndarray          # [T] loss contribution
    abs_c: np.ndarray            # [T] |contrib|
    total_abs: float             # Σ |contrib|
    ratio: np.ndarray | None     # [T] replayed π/π_old, when a replay dump has it
    tv: np.ndarray               # [T] policy version that generated each token
    turn: np.ndarray             # [T]
    adv: np.ndarray              # [T] advantage
    sid: np.ndarray              # [N] sample ids
    gid: np.ndarray              # [N] group ids
    reward: np.ndarray           # [N]
    nturns: np.ndarray           # [N]
    s_contrib: np.ndarray        # [N] Σ contrib
    s_abs: np.ndarray            # [N] Σ |contrib|
    s_logw: np.ndarray           # [N] Σ Δ over the sample's analysed tokens (sequence log weight)
    s_maxabs: np.ndarray         # [N] max |Δ| over them

    @classmethod
    def of(cls, d: Mapping[str, Any], pv: int, lm: np.ndarray, contrib: np.ndarray,
           ratio: np.ndarray | None) -> "_Attribution":
        off = np.asarray(d["/samples/offsets"], dtype=np.int64)
        t, n = lm.size, off.size - 1
        sample_of = np.repeat(np.arange(n), np.diff(off))
        delta = np.asarray(d["/tokens/old_logprob"], dtype=np.float64) - \
            np.asarray(d["/tokens/rollout_logprob"], dtype=np.float64)
        analysed = lm & np.isfinite(delta)
        delta0 = np.where(analysed, delta, 0.0)
        abs_c = np.abs(contrib)
        s_maxabs = np.zeros(n)
        if t:
            np.maximum.at(s_maxabs, sample_of, np.abs(delta0))
        return cls(pv=pv, off=off, lm=lm, sample_of=sample_of, delta=delta, analysed=analysed, delta0=delta0,
                   contrib=contrib, abs_c=abs_c, total_abs=float(abs_c.sum()), ratio=ratio,
                   tv=np.asarray(d["/tokens/policy_version"], dtype=np.int64),
                   turn=np.asarray(d["/tokens/turn"], dtype=np.int64),
                   adv=np.asarray(d["/tokens/advantage"], dtype=np.float64),
                   sid=np.asarray(d["/samples/sample_id"]), gid=np.asarray(d["/samples/group_id"]),
                   reward=np.asarray(d["/samples/reward"], dtype=np.float64),
                   nturns=np.asarray(d["/samples/num_turns"]),
                   s_contrib=np.bincount(sample_of, weights=contrib, minlength=n),
                   s_abs=np.bincount(sample_of, weights=abs_c, minlength=n),
                   s_logw=np.bincount(sample_of, weights=delta0, minlength=n), s_maxabs=s_maxabs)

    def _share(self, abs_contrib: float) -> float:
        return abs_contrib / self.total_abs if self.total_abs > 0 else math.nan

    def sample_row(self, i: int) -> dict[str, Any]:
        """Sample row `i`'s attribution entry."""
        a, b = int(self.off[i]), int(self.off[i + 1])
        gen_v = np.where(self.lm[a:b], self.tv[a:b], -1)  # versions of the generated (loss) tokens
        versions = sorted({int(v) for v in np.unique(gen_v) if v >= 0})
        return {"sample_id": int(self.sid[i]), "row": i, "group_id": int(self.gid[i]), "reward": float(self.reward[i]),
                "num_turns": int(self.nturns[i]), "tokens": b - a, "loss_tokens": int(self.lm[a:b].sum()),
                "loss_contribution": float(self.s_contrib[i]), "loss_share": self._share(float(self.s_abs[i])),
                "seq_log_weight": float(self.s_logw[i]), "max_abs_delta": float(self.s_maxabs[i]),
                "policy_versions": versions,
                "max_version_lag": (self.pv - min(versions)) if versions else None}

    def token_row(self, j: int) -> dict[str, Any]:
        """Token `j`'s attribution entry."""
        i = int(self.sample_of[j])
        row = {"token": j, "sample_id": int(self.sid[i]), "row": i, "position": j - int(self.off[i]),
               "turn": int(self.turn[j]), "policy_version": int(self.tv[j]), "version_lag": self.pv - int(self.tv[j]),
               "advantage": float(self.adv[j]), "delta": float(self.delta[j]) if self.analysed[j] else math.nan,
               "loss_contribution": float(self.contrib[j]), "loss_share": self._share(float(self.abs_c[j]))}
        if self.ratio is not None:
            row["ratio"] = float(self.ratio[j])
        return row
