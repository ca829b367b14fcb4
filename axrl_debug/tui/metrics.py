"""Small per-sample and per-token quantities the TUI needs and ``axrl_debug.analysis`` does not
expose as functions (the analysis layer works per step and over whole runs).

Everything builds on the analysis definitions instead of restating them:

* Δ, "analysed token": ``axrl_debug.analysis.mismatch.step_tokens`` (Δ = old − rollout logprob on
  tokens with loss_mask = 1 and both logprobs finite).
* routing agreement per (token, layer) as expert *sets*: ``analysis.mismatch.routing_agreement``.
* Δ = Δ_engine + Δ_staleness where ``/tokens/behaviour_train_logprob`` is recorded:
  ``axrl.trace.quantities.split_mask`` / ``split_deltas``.

What is added here is only the grouping by sample (bincount over the CSR offsets) and the
per-token views of one sample that the token screen colours and navigates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from axrl.trace.quantities import split_deltas, split_mask
from axrl_debug.analysis.mismatch import MismatchConfig, routing_agreement, step_tokens
from axrl_debug.analysis.mismatch.compiled import agreeing_layers, streamed_agreeing_layers

# Columns of a step file needed for the per-sample table (routing is optional: MoE only).
SAMPLE_STAT_COLUMNS = ("/samples/offsets", "/tokens/loss_mask", "/tokens/rollout_logprob",
                       "/tokens/old_logprob")
SAMPLE_ROUTING_COLUMNS = ("/routing/rollout", "/routing/train", "/routing/rollout_valid")

# The analysis config that computes only what the samples table shows (no breakdowns, no top-K).
_SAMPLE_CFG = MismatchConfig(breakdowns=False, routing=False, top_k=0, keep_abs=False)


@dataclass
class SampleStats:
    """Per-sample mismatch figures of one step (all arrays length N)."""

    analysed: np.ndarray        # int64: analysed tokens of the sample
    mean_abs: np.ndarray        # float64: mean |Δ| (NaN without analysed tokens)
    max_abs: np.ndarray         # float64: max |Δ| (NaN without analysed tokens)
    seq_log_ratio: np.ndarray   # float64: Σ Δ, the sequence-level log importance weight
    routing_agree: np.ndarray   # float64: share of valid (row, layer) pairs whose expert sets agree; NaN if dense


def sample_stats(step: int, policy_version: int, cols: Mapping[str, Any]) -> SampleStats:
    """Group the analysed tokens of one step by sample.

    ``cols`` holds ``SAMPLE_STAT_COLUMNS`` and, for MoE traces, ``SAMPLE_ROUTING_COLUMNS``
    (``rollout_valid`` optional) — the datasets of one step file by absolute path."""
    off = np.asarray(cols["/samples/offsets"], dtype=np.int64)
    n = off.size - 1
    st = step_tokens(step, policy_version, cols, _SAMPLE_CFG)
    ad = np.abs(st.delta)
    # sample row of each analysed token: the last offset <= idx (side="right" skips empty samples)
    sample = np.searchsorted(off, st.idx, side="right") - 1
    count = np.bincount(sample, minlength=n).astype(np.int64)
    total = np.bincount(sample, weights=ad, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_abs = np.where(count > 0, total / np.maximum(count, 1), math.nan)
    max_abs = np.full(n, -np.inf)
    if ad.size:
        np.maximum.at(max_abs, sample, ad)
    max_abs[count == 0] = math.nan
    seq = np.bincount(sample, weights=st.delta, minlength=n)
    agree = _routing_agree(off, cols)
    return SampleStats(analysed=count, mean_abs=mean_abs, max_abs=max_abs, seq_log_ratio=seq,
                       routing_agree=agree)


def _routing_agree(off: np.ndarray, cols: Mapping[str, Any], compiled: bool = False) -> np.ndarray:
    """Per sample: the share of valid (row, layer) pairs whose expert sets agree (NaN: dense).
    ``compiled``: count them with the analysis's compiled pass (loads numba)."""
    if "/routing/rollout" not in cols or "/routing/train" not in cols:
        return np.full(off.size - 1, math.nan)
    rr, rt = np.asarray(cols["/routing/rollout"]), np.asarray(cols["/routing/train"])
    if not rr.shape[0]:
        return np.full(off.size - 1, math.nan)
    per_row = agreeing_layers(rr, rt) if compiled else layer_agreement(rr, rt).sum(axis=1)
    return _share_per_sample(off, per_row, _valid_rows(cols, rr.shape[0]), int(rr.shape[1]))


def _valid_rows(cols: Mapping[str, Any], t: int) -> np.ndarray:
    """bool [t]: rows with valid rollout routing (every row where ``rollout_valid`` is not recorded)."""
    valid = cols.get("/routing/rollout_valid")
    return np.ones(t, dtype=bool) if valid is None else np.asarray(valid) != 0


def _share_per_sample(off: np.ndarray, per_row: np.ndarray, valid: np.ndarray, layers: int) -> np.ndarray:
    """Per sample: Σ agreeing layers over its valid rows / (valid rows · layers); NaN without valid
    rows. ``per_row``: agreeing layers of each row (an invalid row's is weighted out, never read)."""
    n = off.size - 1
    sample_of = np.repeat(np.arange(n), np.diff(off))
    rows = np.bincount(sample_of, weights=valid, minlength=n)
    agreeing = np.bincount(sample_of, weights=per_row * valid, minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rows > 0, agreeing / (np.maximum(rows, 1) * layers), math.nan)


def chunked_sample_stats(sf: Any, *, routing: bool) -> tuple[SampleStats, np.ndarray]:
    """``sample_stats`` of a whole step (and its loss-mask tokens per sample) read in chunks of
    whole samples (``axrl.trace.chunks``): every figure is per sample, so it is the same as from
    the whole columns. ``routing=False`` leaves ``routing_agree`` NaN (``chunked_routing_agree``)."""
    from axrl.trace.chunks import iter_chunks

    n = sf.num_samples
    stats = SampleStats(analysed=np.zeros(n, np.int64), mean_abs=np.full(n, math.nan), max_abs=np.full(n, math.nan),
                        seq_log_ratio=np.zeros(n), routing_agree=np.full(n, math.nan))
    generated = np.zeros(n, np.int64)
    buffers: dict[str, np.ndarray] = {}
    for ch in iter_chunks(sf, SAMPLE_STAT_COLUMNS, optional=SAMPLE_ROUTING_COLUMNS if routing else (),
                          buffers=buffers):
        part = sample_stats(sf.step, sf.policy_version, ch.data)
        rows = slice(ch.sample0, ch.sample1)
        for name in ("analysed", "mean_abs", "max_abs", "seq_log_ratio", "routing_agree"):
            getattr(stats, name)[rows] = getattr(part, name)
        off = np.asarray(ch["/samples/offsets"], dtype=np.int64)
        lm = np.asarray(ch["/tokens/loss_mask"]) != 0
        sample_of = np.repeat(np.arange(off.size - 1), np.diff(off))
        generated[rows] = np.bincount(sample_of, weights=lm, minlength=off.size - 1).astype(np.int64)
    return stats, generated


def chunked_routing_agree(sf: Any, chunk_tokens: int | None = None) -> np.ndarray:
    """The ``routing_agree`` column of ``sample_stats`` alone, chunk by chunk, compiled (it runs
    after the first screen, where loading numba no longer delays anything). The routing pair is
    streamed as stored, as ``mismatch`` reads it (``streamed_agreeing_layers``: packed routing
    compared from its marks, only the marked rows decoded); a layout the stream does not take is
    decoded. ``chunk_tokens``: ``iter_chunks``'s (None: its default)."""
    from axrl.trace.chunks import DEFAULT_CHUNK_TOKENS, iter_chunks

    agree = np.full(sf.num_samples, math.nan)
    buffers: dict[str, np.ndarray] = {}
    for ch in iter_chunks(sf, ("/samples/offsets", *SAMPLE_ROUTING_COLUMNS[:2]), optional=SAMPLE_ROUTING_COLUMNS[2:],
                          chunk_tokens=chunk_tokens or DEFAULT_CHUNK_TOKENS, buffers=buffers, fast_checksums=True,
                          stream_routing=True):
        off = np.asarray(ch["/samples/offsets"], dtype=np.int64)
        rows = slice(ch.sample0, ch.sample1)
        if ch.routing is None:
            agree[rows] = _routing_agree(off, ch.data, compiled=True)
        elif ch.num_tokens:
            valid = _valid_rows(ch.data, ch.num_tokens)
            per_row = streamed_agreeing_layers(ch.routing, None if "/routing/rollout_valid" not in ch.data
                                               else valid.view(np.uint8))
            agree[rows] = _share_per_sample(off, per_row, valid, ch.routing.layers)
    return agree


def token_delta(loss_mask: np.ndarray, rollout_lp: np.ndarray, old_lp: np.ndarray) -> np.ndarray:
    """Δ per token of one sample, NaN where the token is not analysed.

    Uses ``step_tokens`` on a one-sample CSR so the selection rule stays the analysis layer's."""
    t = int(np.asarray(loss_mask).shape[0])
    cols = {"/samples/offsets": np.array([0, t], dtype=np.int64), "/tokens/loss_mask": loss_mask,
            "/tokens/rollout_logprob": rollout_lp, "/tokens/old_logprob": old_lp}
    st = step_tokens(0, -1, cols, _SAMPLE_CFG)
    out = np.full(t, math.nan)
    out[st.idx] = st.delta
    return out


def token_split(loss_mask: np.ndarray, rollout_lp: np.ndarray, old_lp: np.ndarray,
                behaviour_lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Δ_engine, Δ_staleness) per token of one sample, NaN where Δ does not split (not analysed,
    or no behaviour_train logprob)."""
    keep = split_mask(loss_mask, rollout_lp, old_lp, behaviour_lp)
    engine, stale = split_deltas(rollout_lp, old_lp, behaviour_lp)
    return np.where(keep, engine, np.nan), np.where(keep, stale, np.nan)


def layer_agreement(rollout: np.ndarray, train: np.ndarray) -> np.ndarray:
    """[T, L] bool: the expert sets of each (token, layer) agree (see ``routing_agreement``)."""
    if rollout.shape[0] == 0:
        return np.zeros(rollout.shape[:2], dtype=bool)
    res = routing_agreement(rollout, train)
    # (agree [L, T], per-layer counts, hits) in the current analysis API; an earlier one returned
    # (agree [T, L], hits) — accept both while that module settles.
    return res[0].T if len(res) == 3 else res[0]


def worst_order(delta: np.ndarray) -> np.ndarray:
    """Indices of analysed tokens by |Δ| descending (ties: reading order) — the "next worst" walk."""
    ad = np.abs(delta)
    idx = np.flatnonzero(np.isfinite(ad))
    return idx[np.lexsort((idx, -ad[idx]))]


# |Δ| colour scale of the token screen. "abs" bins are absolute nats of |log π − log μ| so that
# colours mean the same thing in every run (1e-3 ≈ fp32 noise of a bf16-free CPU run is below the
# first bin; 0.5 ≈ a ratio of 1.65, beyond any PPO clip band). "rel" bins are fractions of the
# sample's own max |Δ|, to find the worst tokens of a run whose mismatch is uniformly tiny.
ABS_EDGES = (1e-3, 1e-2, 1e-1, 0.5)
REL_EDGES = (0.1, 0.25, 0.5, 0.75)


def delta_bins(delta: np.ndarray, scale: str = "abs") -> np.ndarray:
    """Colour bin per token: -1 not analysed, 0 (calm) .. 4 (worst)."""
    ad = np.abs(np.asarray(delta, dtype=np.float64))
    finite = np.isfinite(ad)
    if scale == "rel":
        top = float(ad[finite].max()) if finite.any() else 0.0
        edges = np.asarray(REL_EDGES) * top if top > 0 else np.full(len(REL_EDGES), np.inf)
        bins = np.searchsorted(edges, ad, side="right") if top > 0 else np.zeros(ad.shape, np.int64)
    else:
        bins = np.searchsorted(np.asarray(ABS_EDGES), ad, side="right")
    return np.where(finite, bins, -1).astype(np.int8)
