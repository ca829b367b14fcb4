"""Training–inference mismatch over the generated tokens of a trace, streamed over CSR arrays.

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

Numerics and exactness
----------------------
Every sum is float64 over the float64 values of the stored float32 logprobs (Δ is exact in
float64). ``p50_abs`` / ``p99_abs`` are exact: numpy's default (linear) percentile of the
float32 |Δ| of every analysed token, found without a full partition — a histogram of the top
16 bits of each |Δ| (monotone in the value for non-negative floats) locates the histogram bins
that hold the needed order statistics, and only the values inside those bins are partitioned.
A step is processed in blocks of whole samples (``_BLOCK_TOKENS``, so that the work arrays stay
small whatever the step size) whose sums are added (Chan's update for the correlation's centred
moments). Breakdown sums are accumulated in joint histograms (every breakdown key plus the sign
of Δ as the digits of one bin index), marginalised once at the end. On large traces the per-token
loops (token selection, breakdown keys and histograms, routing comparison, moment sums) run compiled
with numba (``kernels``; ``MismatchConfig.compiled``, ``resolve_compiled``); smaller ones take the
numpy path (``step_tokens`` + ``add``), which answers sooner there because it skips numba's
start-up. The two agree up to float summation order (~1e-13 relative: the compiled moment sums
are vectorised, i.e. re-associated; each is deterministic on a given machine). Ties among the worst
tokens are broken by (step, token) ascending.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from axrl.trace.schema import TraceError

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


def _ceil_f32(edge: float) -> np.float32:
    """The smallest float32 >= ``edge``: for a float32 x, ``x >= _ceil_f32(e)`` ⇔ ``float64(x) >= e``,
    so float32 columns are bucketed exactly without widening them to float64."""
    f = np.float32(edge)
    if float(f) < edge:
        f = np.nextafter(f, np.float32(np.inf))
    return f


_LOG_PROB_INNER_F32 = np.array([_ceil_f32(float(e)) for e in _LOG_PROB_INNER], dtype=np.float32)
_ENT_DROP = len(ENTROPY_LABELS)        # digit of a non-finite entropy (left out of that breakdown)
_ENT_LUT: np.ndarray | None = None     # float16 bit pattern -> entropy digit


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
    per_step_percentiles: bool = False  # p50/p99 of each step too (step tables only)
    # Compiled per-token passes (``kernels``, numba) or the numpy per-token path (``step_tokens`` +
    # ``add``): the same answer. None: decided by ``resolve_compiled`` from the size of the steps.
    compiled: bool | None = None

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
    k experts of a row are distinct, which top-k guarantees. (The whole-step analysis counts the
    same in its compiled pass, ``kernels.breakdown_block``.)"""
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


class _Scratch:
    """Named work arrays reused from step to step (grown as needed).

    Every temporary of the kernel lives here: a fresh multi-megabyte numpy array per operation
    and step costs more in page faults (glibc hands freed blocks of that size back to the OS) than
    the arithmetic on it: ~40 of ~90 ns per token in a first version of this kernel without it."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def arange(self, n: int) -> np.ndarray:
        """0, 1, …, n − 1 (intp), kept."""
        buf = self._bufs.get("arange")
        if buf is None or buf.size < n:
            buf = self._bufs["arange"] = np.arange(n + n // 4, dtype=np.intp)
        return buf[:n]

    def __call__(self, name: str, n: int, dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = np.empty(n + n // 4, dtype=dtype)
            self._bufs[name] = buf
        return buf[:n]


def _sample_starts(off: np.ndarray, t: int, ws: _Scratch | None = None) -> np.ndarray:
    """bool [T]: token t is the first token of its sample."""
    starts = (ws or _Scratch())("starts", t + 1, bool)
    starts[:] = False
    starts[off[:-1]] = True                  # index t only for trailing empty samples
    return starts[:t]


def _segment_positions(gen: np.ndarray, starts: np.ndarray, turn: np.ndarray,
                       ws: _Scratch | None = None) -> np.ndarray:
    """Index of each token inside its response segment (a maximal run of loss-mask tokens of one
    sample and one turn); meaningful on loss-mask tokens only (others get any value)."""
    ws = ws or _Scratch()
    t = gen.shape[0]
    seg = ws("seg", t, bool)
    seg[:] = gen
    if t > 1:
        brk = np.logical_not(gen[:-1], out=ws("brk", t - 1, bool))
        brk |= starts[1:]
        brk |= np.not_equal(turn[1:], turn[:-1], out=ws("brk2", t - 1, bool))
        seg[1:] &= brk
    if t:
        seg[0] = True                  # tokens before the first segment: any value will do
    ss = np.flatnonzero(seg)
    # each token minus the start of its segment: one repeat, no prefix sum or binary search
    pos = np.repeat(ss, np.diff(ss, append=t))
    return np.subtract(ws.arange(t), pos, out=pos)


_POS_LUT = np.minimum(np.frexp(np.arange(POSITION_EDGES[-1] + 1, dtype=np.float64))[1],
                      len(POSITION_LABELS) - 1).astype(np.uint8)


def _position_digits(pos: np.ndarray, ws: _Scratch | None = None) -> np.ndarray:
    """0 → 0, 1 → 1, 2–3 → 2, 4–7 → 3, … (the bit length), capped at the last POSITION bucket: a
    table lookup whose index clipping does the capping (negative values → 0)."""
    ws = ws or _Scratch()
    out = ws("dig_pos", pos.shape[0], np.uint8)
    return np.take(_POS_LUT, pos.astype(np.intp, copy=False), out=out, mode="clip")


def _prob_digits(lp: np.ndarray, ws: _Scratch | None = None) -> np.ndarray:
    """rollout_prob bucket of each logprob (NaN → 0), comparing in log space."""
    ws = ws or _Scratch()
    n = lp.shape[0]
    out = ws("dig_prob", n, np.uint8)
    out[:] = 0
    if lp.dtype == np.float32:
        edges: Any = _LOG_PROB_INNER_F32
    else:
        lp = lp.astype(np.float64, copy=False)
        edges = _LOG_PROB_INNER
    ge = ws("ge", n, bool)
    for e in edges:
        out += np.greater_equal(lp, e, out=ge)
    return out


def _ent_lut() -> np.ndarray:
    global _ENT_LUT
    if _ENT_LUT is None:
        h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)
        lut = np.zeros(h.shape, dtype=np.uint8)
        for e in _ENT_INNER:
            lut += h >= e
        lut[~np.isfinite(h)] = _ENT_DROP
        _ENT_LUT = lut
    return _ENT_LUT


def _entropy_digits(ent: np.ndarray, ws: _Scratch | None = None) -> np.ndarray:
    """entropy bucket of each value (as float32, like the recorded float16), ``_ENT_DROP`` where
    not finite. float16 columns go through a 65536-entry table of their bit patterns."""
    ws = ws or _Scratch()
    n = ent.shape[0]
    out = ws("dig_ent", n, np.uint8)
    if ent.dtype == np.float16:
        bits = ws("ent_bits", n, np.intp)
        bits[:] = ent.view(np.uint16)
        return np.take(_ent_lut(), bits, out=out, mode="clip")
    e32 = ent.astype(np.float32, copy=False)
    out[:] = 0
    for e in _ENT_INNER:
        out += e32 >= e
    out[~np.isfinite(e32)] = _ENT_DROP
    return out


def _int_digits(values: np.ndarray, idx: np.ndarray, span_max: int = 64, ws: _Scratch | None = None,
                name: str = "dig_int", reverse: bool = False,
                bounds: tuple[int, int] | None = None) -> tuple[np.ndarray, int, int]:
    """(digits in [0, size), lo, size) for an integer key column: digit = value − lo (``reverse``:
    hi − value), clipped to the range of the analysed tokens (rows ``idx``; or ``bounds`` when the
    caller knows it). The range of all rows is used when it is small (no gather); clipped values
    only ever belong to rows that are not analysed. The digits keep the column's dtype (signed,
    ≥ 32 bits for wide ranges)."""
    ws = ws or _Scratch()
    lo, hi = bounds if bounds is not None else (int(values.min()), int(values.max()))
    if bounds is None and hi - lo + 1 > span_max:
        sel = np.take(values, idx, out=ws(name + "_sel", idx.size, values.dtype), mode="clip")
        lo, hi = (int(sel.min()), int(sel.max())) if sel.size else (0, 0)
    dt = values.dtype if values.dtype.kind == "i" and np.iinfo(values.dtype).max >= hi - lo else np.int64
    out = ws(name, values.shape[0], dt)
    if reverse:
        np.subtract(hi, values, out=out, casting="unsafe")
    else:
        np.subtract(values, lo, out=out, casting="unsafe")
    np.clip(out, 0, hi - lo, out=out)
    return out, lo, hi - lo + 1


# Stand-ins for absent columns, so the compiled kernels see arrays of fixed types.
_NO_INTS = np.zeros(1, np.int64)
_NO_BYTES = np.zeros(1, np.uint8)
_NO_FLAGS = np.zeros(1, bool)
_NO_ROUTING = np.zeros((1, 0, 1), np.uint8)
assert len(_LOG_PROB_INNER) == 5, "kernels.breakdown_block unrolls five rollout-prob edges"


def _kernels() -> Any:
    """The compiled loops (imports numba on first use; see ``kernels``)."""
    from axrl_debug.analysis import kernels
    return kernels


def _position_of(i: int, s0: int, lm: np.ndarray, turn: np.ndarray) -> int:
    """Index of token ``i`` inside its response segment (``_segment_positions``, for one token of
    the sample starting at ``s0``)."""
    j = np.arange(s0 + 1, i + 1)
    brk = j[(lm[j - 1] == 0) | (turn[j] != turn[j - 1])]
    return i - (int(brk[-1]) if brk.size else s0)


def _routing_class(i: int, s0: int, rollout: np.ndarray, train: np.ndarray, valid: Any) -> int:
    """``routing_delta`` digit of token ``i`` (its sample starts at ``s0``): from row i − 1, 0 when
    every layer's expert sets agree, 1 when one differs, 2 when unknown."""
    if i == s0 or (valid is not None and not valid[i - 1]):
        return 2
    a, b = rollout[i - 1], train[i - 1]
    same = all(set(a[layer].tolist()) == set(b[layer].tolist()) for layer in range(a.shape[0]))
    return 0 if same else 1


_JOINT_LIMIT = 1 << 17   # bins of one joint histogram (counts and sums stay in L2)

# A breakdown dimension: (name, digit per row in [0, size), size, key of digit 0 for keyed
# breakdowns (turn, lag: digit j is key lo + j) or None for the fixed-label ones).
_Dim = tuple[str, np.ndarray, int, "int | None"]
# The identity of a joint histogram: its dimensions as (name, size, lo).
_Sig = tuple[tuple[str, int, "int | None"], ...]


def _group_dims(sizes: list[int]) -> list[list[int]]:
    """Split breakdown dimensions (their sizes, in order) into consecutive groups whose joint
    histogram (× 3 classes) has at most ``_JOINT_LIMIT`` bins."""
    groups: list[list[int]] = []
    cur: list[int] = []
    prod = 1
    for i, size in enumerate(sizes):
        if cur and prod * size * 3 > _JOINT_LIMIT:
            groups.append(cur)
            cur, prod = [], 1
        cur.append(i)
        prod *= size
    if cur:
        groups.append(cur)
    return groups


def _joint_hist(dims: list[_Dim], cls: np.ndarray, weights: np.ndarray,
                ws: _Scratch | None = None) -> list[tuple[_Sig, np.ndarray, np.ndarray]]:
    """Joint histograms of the breakdown digits: [(signature, counts, Δ sums)], the arrays flat
    over the cells of ``signature``'s dimensions × 3 classes.

    ``cls`` is 0 (analysed, Δ ≥ 0), 1 (analysed, Δ < 0) or 2 (not analysed: kept out of every
    figure) per row and ``weights`` the Δ of each row. The digits are combined into one bin index
    per row (mixed radix, in the narrowest integer type that holds it so far), so a whole set of
    breakdowns costs two bincounts instead of two per breakdown; each breakdown's count, S⁺ and S⁻
    are marginals of the cells (``_marginals``), taken once per run rather than per step.
    Dimensions are grouped by ``_group_dims``. (The whole-step path, ``MismatchAccumulator._block``,
    builds the same histograms in one compiled pass: ``kernels.breakdown_block``.)"""
    ws = ws or _Scratch()
    n = cls.shape[0]
    out = []
    for g in _group_dims([dim[2] for dim in dims]):
        sizes = [dims[i][2] for i in g] + [3]
        digits = [dims[i][1] for i in g] + [cls]
        key = None
        bound = 1
        for dig, size in zip(digits, sizes):
            bound *= size
            dt = np.uint16 if bound <= 1 << 16 else np.int32 if bound < 1 << 31 else np.intp
            if key is None:
                key = ws(f"key_{np.dtype(dt).name}", n, dt)
                key[:] = dig
                continue
            if key.dtype != dt:
                wider = ws(f"key_{np.dtype(dt).name}", n, dt)
                wider[:] = key
                key = wider
            np.multiply(key, size, out=key, casting="unsafe")
            np.add(key, dig, out=key, casting="unsafe")
        if key.dtype != np.intp:               # bincount wants intp (it would convert anyway)
            wide = ws("key_intp", n, np.intp)
            wide[:] = key
            key = wide
        total = int(np.prod(sizes))
        sig = tuple((dims[i][0], dims[i][2], dims[i][3]) for i in g)
        out.append((sig, np.bincount(key, minlength=total), np.bincount(key, weights=weights, minlength=total)))
    return out


def _marginals(sig: _Sig, counts: np.ndarray, sums: np.ndarray,
               ) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]:
    """Per dimension of a joint histogram: (name, count, S⁺, S⁻, keys or None) per digit."""
    shape = [size for _, size, _ in sig] + [3]
    c = counts.reshape(shape)
    sm = sums.reshape(shape)
    ca, sp, sn = c[..., 0] + c[..., 1], sm[..., 0], sm[..., 1]
    out = []
    for j, (name, size, lo) in enumerate(sig):
        axes = tuple(a for a in range(len(sig)) if a != j)
        out.append((name, ca.sum(axis=axes), sp.sum(axis=axes), sn.sum(axis=axes),
                    None if lo is None else lo + np.arange(size)))
    return out


def step_tokens(step: int, policy_version: int, cols: Mapping[str, Any], cfg: MismatchConfig) -> StepTokens:
    """Select the analysed tokens of one step and derive their breakdown keys (no Python loop
    over tokens or samples: everything is array arithmetic on the CSR layout).

    ``MismatchAccumulator.add_columns`` does not go through this (it works on the whole-step
    arrays directly); it is the per-token view for callers that want the analysed tokens."""
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
    starts = _sample_starts(off, t)
    if cfg.breakdowns and "/tokens/turn" in cols:
        turn = np.asarray(cols["/tokens/turn"])
        st.position = _segment_positions(gen, starts, turn)[idx].astype(np.int64)
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


def _moment_sums(d: np.ndarray, em1: np.ndarray, x: np.ndarray, y: np.ndarray, log_clip_high: float,
                 log_clip_low: float, log_tis_cap: float) -> tuple[Any, ...]:
    """``kernels.moment_sums`` in numpy reductions (the numpy path; no numba import): the same
    sums, in numpy's pairwise summation order. Overwrites ``x`` and ``y`` (centred)."""
    ad = np.abs(d)
    mx, my = float(x.mean()), float(y.mean())
    xc, yc = np.subtract(x, mx, out=x), np.subtract(y, my, out=y)
    neg = d < 0
    mult = np.where(neg, -em1 / (1.0 + em1), em1)            # expm1(|Δ|) = −(ρ − 1)/ρ for Δ < 0
    return (float(ad.sum()), float(d.sum()), float(ad.max()), _sumsq(d), float((em1 - d).sum()),
            float(em1.sum()), _sumsq(em1), float(mult.sum()), float(em1.min()), float(em1.max()),
            int(np.count_nonzero(d > log_clip_high)), int(np.count_nonzero(d < log_clip_low)),
            int(np.count_nonzero(d > log_tis_cap)), mx, my, _sumsq(xc), _sumsq(yc),
            float(np.einsum("i,i->", xc, yc)))


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
            ws: _Scratch | None = None) -> None:
        """``d`` float64 Δ; ``r``, ``o`` the rollout / trainer logprobs (any float dtype: the
        probabilities are computed in float64 from their exact float64 values). The exponentials
        are numpy's (SIMD); the sums one compiled pass (``kernels.moment_sums``), or numpy's
        reductions (``_moment_sums``) on the numpy path."""
        n = d.size
        if n == 0:
            return
        ws = ws or _Scratch()
        em1 = np.expm1(d, out=ws("em1", n, np.float64))
        x, y = ws("x", n, np.float64), ws("y", n, np.float64)
        x[:] = r                       # widen first: exp's own float64 loop beats a casting one
        y[:] = o
        np.exp(x, out=x)
        np.exp(y, out=y)
        # compare in log space: ρ > 1 + ε  ⇔  Δ > log1p(ε)
        log_low = math.log1p(-cfg.clip_low) if cfg.clip_low < 1 else -math.inf
        (s_abs, s_d, max_abs, s_d2, s_k3, s_e, s_e2, s_mult, e_min, e_max, n_high, n_low, n_tis,
         mx, my, sxx, syy, sxy) = (_kernels().moment_sums if cfg.compiled is not False else _moment_sums)(
            d, em1, x, y, math.log1p(cfg.clip_high), log_low, math.log(cfg.tis_cap))
        self.merge(_Moments(
            n=n, sum_abs=s_abs, sum_d=s_d, max_abs=max_abs, sum_k2=0.5 * s_d2, sum_k3=s_k3, sum_em1=s_e,
            sum_em1_sq=s_e2, sum_mult=s_mult, rho_min=e_min + 1.0, rho_max=e_max + 1.0,
            n_clip_high=int(n_high), n_clip_low=int(n_low), n_tis=int(n_tis),
            mx=mx, my=my, sxx=sxx, syy=syy, sxy=sxy))

    def merge(self, m: "_Moments") -> None:
        """Fold in the sums of other tokens (exact for counts and sums; Chan's update for the
        centred moments of the correlation)."""
        if m.n == 0:
            return
        if self.n == 0:
            self.__dict__.update(m.__dict__)
            return
        n0, n1 = self.n, m.n
        tot = n0 + n1
        dx, dy = m.mx - self.mx, m.my - self.my
        f = n0 * n1 / tot
        self.sxx += m.sxx + dx * dx * f
        self.syy += m.syy + dy * dy * f
        self.sxy += m.sxy + dx * dy * f
        self.mx += dx * n1 / tot
        self.my += dy * n1 / tot
        for name in ("sum_abs", "sum_d", "sum_k2", "sum_k3", "sum_em1", "sum_em1_sq", "sum_mult",
                     "n_clip_high", "n_clip_low", "n_tis"):
            setattr(self, name, getattr(self, name) + getattr(m, name))
        self.max_abs = max(self.max_abs, m.max_abs)
        self.rho_min = min(self.rho_min, m.rho_min)
        self.rho_max = max(self.rho_max, m.rho_max)
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
        """Bucket ``d`` by ``keys`` (fixed: 0..len(labels)−1; keyed: any ints)."""
        if keys.size == 0:
            return
        lo = 0 if self.fixed is not None else int(keys.min())
        size = self.fixed.shape[1] if self.fixed is not None else int(keys.max()) - lo + 1
        (sig, counts, sums), = _joint_hist([("b", keys - lo, size, None if self.fixed is not None else lo)],
                                           (d < 0).view(np.uint8), d)
        (_, count, s_pos, s_neg, names), = _marginals(sig, counts, sums)
        self.add_sums(count, s_pos, s_neg, names)

    def add_sums(self, count: np.ndarray, s_pos: np.ndarray, s_neg: np.ndarray,
                 keys: np.ndarray | None = None) -> None:
        """Per-digit count and sums of the positive / negative Δ (ΣΔ = S⁺ + S⁻, Σ|Δ| = S⁺ − S⁻);
        ``keys`` names each digit of a keyed breakdown."""
        if self.fixed is not None:
            self.fixed += np.stack([count, s_pos - s_neg, s_pos + s_neg])
            return
        for i in np.flatnonzero(count):
            acc = self.keyed.setdefault(int(keys[i]), np.zeros(3))
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
class _StepView:
    """What ``MismatchAccumulator`` folds in for one block of a step (a run of whole samples, or the
    whole step), whichever way it was derived."""

    num_tokens: int
    num_generated: int
    d: np.ndarray                          # float64 Δ of the analysed tokens, in token order
    r: np.ndarray                          # their rollout logprobs (stored dtype)
    o: np.ndarray                          # their trainer logprobs
    joint: list[tuple[_Sig, np.ndarray, np.ndarray]]          # breakdown histograms (``_joint_hist``)
    routing: tuple[int, np.ndarray, np.ndarray, int] | None   # valid rows, agree [L], hits [L], k
    top: Callable[[np.ndarray], list[TopToken]]               # analysed positions -> TopToken
    lag: tuple[int, int, int | None] | None = None            # (tokens, Σ lag, max lag) when recorded


@dataclass
class _StepSums:
    """One step's figures while its blocks are folded in."""

    step: int
    tokens: int = 0
    generated: int = 0
    moments: _Moments = field(default_factory=_Moments)
    lag: list[Any] | None = None                              # [tokens, Σ lag (exact), max lag]
    routing: list[Any] | None = None                          # [rows, agree, hits]
    abs_parts: list[np.ndarray] = field(default_factory=list)  # |Δ| (per-step percentiles only)


def _top_positions(ad: np.ndarray, k: int, threshold: float | None, ws: _Scratch | None = None) -> np.ndarray:
    """Positions (ascending) of the ≤ k largest values of ``ad`` that are ≥ ``threshold``; among
    equal values the first positions win, so the overall top-K is (|Δ| desc, step, token)."""
    if threshold is None:
        cand, vals = None, ad
    else:
        cand = np.flatnonzero(np.greater_equal(ad, threshold, out=(ws or _Scratch())("flag", ad.size, bool)))
        vals = ad[cand]
    if vals.size > k:
        kth = np.partition(vals, vals.size - k)[vals.size - k]
        above = np.flatnonzero(vals > kth)
        ties = np.flatnonzero(vals == kth)[: k - above.size]
        pick = np.sort(np.concatenate([above, ties]))
    else:
        pick = np.arange(vals.size)
    return pick if cand is None else cand[pick]


_HIST_SIZE = 1 << 16


def _top_bits(a: np.ndarray) -> np.ndarray:
    """The top 16 bits of each non-negative float: an increasing function of its value."""
    if a.dtype == np.float32:
        return a.view(np.uint32) >> np.uint32(16)
    return (a.astype(np.float64, copy=False).view(np.uint64) >> np.uint64(48)).view(np.int64)


def _bin_edges(b: int, dtype: Any) -> tuple[Any, Any]:
    """The smallest value of top-16-bit bin ``b`` and of the next one (None past the last)."""
    if np.dtype(dtype) == np.float32:
        ut, ft, shift = np.uint32, np.float32, 16
    else:
        ut, ft, shift = np.uint64, np.float64, 48
    lo = np.array([b << shift], dtype=ut).view(ft)[0]
    hi = np.array([(b + 1) << shift], dtype=ut).view(ft)[0] if b + 1 < _HIST_SIZE else None
    return lo, (None if hi is None or np.isnan(hi) else hi)      # the +inf bin: everything from lo


def _abs_hist(a: np.ndarray, ws: _Scratch | None = None) -> np.ndarray:
    if a.dtype == np.float32 and ws is not None:     # shift straight into bincount's intp input
        bits = np.right_shift(a.view(np.uint32), np.uint32(16), out=ws("hist_bits", a.size, np.intp))
        return np.bincount(bits, minlength=_HIST_SIZE)
    return np.bincount(_top_bits(a), minlength=_HIST_SIZE)


def _percentile_ranks(n: int, qs: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy's linear percentile: the ranks of the order statistics it interpolates between and
    the weight (``numpy.lib._function_base_impl._quantile``: index −1, the maximum, past the end)."""
    q = np.true_divide(np.asarray(qs, dtype=np.float64), 100)
    virtual = (n - 1) * q
    prev = np.floor(virtual)
    above = virtual >= n - 1
    prev_i = np.where(above, n - 1, prev).astype(np.int64)
    next_i = np.where(above, n - 1, prev + 1).astype(np.int64)
    return prev_i, next_i, virtual - np.where(above, -1.0, prev)


def _percentile_bins(hist: np.ndarray, qs: tuple[float, ...] = (50.0, 99.0)) -> list[int]:
    """The histogram bins that hold the order statistics of the percentiles ``qs``."""
    n = int(hist.sum())
    if n == 0:
        return []
    prev_i, next_i, _ = _percentile_ranks(n, qs)
    cum = np.cumsum(hist)
    ranks = sorted(set(prev_i.tolist()) | set(next_i.tolist()))
    return sorted({int(b) for b in np.searchsorted(cum, ranks, side="right")})


def _values_in_bins(parts: list[np.ndarray], bins: list[int]) -> list[np.ndarray]:
    """The values of ``parts`` that fall in each of ``bins`` (one array per bin, in ``bins`` order).
    A bin's values lie between its first bit pattern and the next bin's (bit order is value order
    for non-negative floats): two comparisons, no integer view of every value."""
    out = []
    for b in bins:
        chunks = []
        for p in parts:
            lo, hi = _bin_edges(b, p.dtype)
            chunks.append(p[(p >= lo) & (p < hi)] if hi is not None else p[p >= lo])
        out.append(np.concatenate(chunks) if chunks else np.zeros(0))
    return out


def _exact_percentiles(parts: list[np.ndarray], hist: np.ndarray | None = None,
                       qs: tuple[float, ...] = (50.0, 99.0),
                       in_bins: dict[int, list[np.ndarray]] | None = None) -> tuple[float, ...]:
    """``np.percentile(np.concatenate(parts), qs)`` (linear interpolation, numpy's default), bit
    for bit, for non-negative floats of one dtype — without concatenating or partitioning them all.

    ``hist`` (``_abs_hist`` summed over the parts) says which top-16-bit bin holds each needed order
    statistic; only the values of those bins are gathered and partitioned. The interpolation is
    numpy's own arithmetic (``numpy.lib._function_base_impl._lerp``). ``in_bins`` adds values held
    elsewhere (by worker processes): counted in ``hist`` and given only for ``_percentile_bins``."""
    n = int(hist.sum()) if hist is not None else sum(int(p.size) for p in parts)
    if n == 0:
        return tuple(math.nan for _ in qs)
    if n <= _HIST_SIZE and not in_bins:   # small: a partition is cheaper than a 65536-bin histogram
        return tuple(float(v) for v in np.percentile(np.concatenate(parts), list(qs)))
    if hist is None:
        hist = sum(_abs_hist(p) for p in parts)
    prev_i, next_i, gamma = _percentile_ranks(n, qs)
    cum = np.cumsum(hist)
    by_bin: dict[int, list[int]] = {}
    for rank in sorted(set(prev_i.tolist()) | set(next_i.tolist())):
        by_bin.setdefault(int(np.searchsorted(cum, rank, side="right")), []).append(rank)
    value: dict[int, Any] = {}
    dtype = parts[0].dtype if parts else next(iter(in_bins.values()))[0].dtype
    local = dict(zip(by_bin, _values_in_bins(parts, list(by_bin))))
    for b, ranks in by_bin.items():
        below = int(cum[b - 1]) if b else 0
        sub = np.concatenate([local[b], *(in_bins or {}).get(b, [])])
        kth = [rank - below for rank in ranks]
        sub.partition(kth)
        for rank, k in zip(ranks, kth):
            value[rank] = sub[k]
    a = np.array([value[i] for i in prev_i.tolist()], dtype=dtype)
    b = np.array([value[i] for i in next_i.tolist()], dtype=dtype)
    with np.errstate(invalid="ignore"):      # inf − inf: NaN, as numpy's own percentile gives
        diff = b - a
        res = np.add(a, diff * gamma)
        np.subtract(b, diff * (1 - gamma), out=res, where=gamma >= 0.5, casting="unsafe", dtype=type(res.dtype))
    return tuple(float(v) for v in res)


def _percentiles(ad: np.ndarray) -> tuple[float, float]:
    p50, p99 = _exact_percentiles([ad])
    return p50, p99


_BLOCK_TOKENS = 1 << 18   # tokens per block of a step (work arrays ~200 B per token of a block)


def _sample_blocks(off: np.ndarray, t: int, block: int) -> list[tuple[int, int]]:
    """Consecutive runs of whole samples (sample index ranges) of about ``block`` tokens; a longer
    sample is a block of its own. One block for the whole step when it is small."""
    n = off.size - 1
    if t <= block + block // 2 or n <= 1:
        return [(0, n)]
    cuts = np.unique(np.searchsorted(off, np.arange(block, t, block), side="right") - 1)
    cuts = cuts[(cuts > 0) & (cuts < n)].tolist()
    bounds = [0] + cuts + [n]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class MismatchAccumulator:
    """Streams steps (``add_columns`` / ``add``) and produces the mismatch report (``result``).
    Memory is O(analysed tokens) only for the exact percentiles (``keep_abs``); everything else is
    a fixed-size sum."""

    cfg: MismatchConfig = field(default_factory=MismatchConfig)

    def __post_init__(self) -> None:
        self.total = _Moments()
        self.num_tokens = 0
        self.num_generated = 0
        self.abs_parts: list[np.ndarray] = []
        self.abs_hist: np.ndarray | None = None
        self._hist_done = 0              # abs_parts[:_hist_done] are counted in abs_hist
        self._abs_elsewhere = 0          # |Δ| counted in abs_hist but held by worker processes
        self._abs_in_bins: dict[int, list[np.ndarray]] = {}   # … those of them that percentiles need
        self.per_step: list[dict[str, Any]] = []
        self.buckets = {"position": _Buckets(POSITION_LABELS), "turn": _Buckets(),
                        "rollout_prob": _Buckets(PROB_LABELS), "entropy": _Buckets(ENTROPY_LABELS),
                        "version_lag": _Buckets()}
        self.routing_delta = _Buckets(ROUTING_DELTA_LABELS)
        self._joint: dict[_Sig, list[np.ndarray]] = {}   # breakdown histograms not yet marginalised
        self.layer_rows = 0
        self.layer_agree: np.ndarray | None = None
        self.layer_hits: np.ndarray | None = None
        self.topk = 0
        self.top: list[TopToken] = []
        self.plot_x: list[np.ndarray] = []
        self.plot_y: list[np.ndarray] = []
        self.steps: list[int] = []
        self._ws = _Scratch()
        self._block_tokens = _BLOCK_TOKENS

    def __getstate__(self) -> dict[str, Any]:
        self._flush()
        state = dict(self.__dict__)
        state["_ws"] = None             # work arrays are not part of the result (nor pickled back)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ws = _Scratch()

    # ---- streaming
    def add_columns(self, step: int, policy_version: int, cols: Mapping[str, Any]) -> dict[str, Any]:
        """Fold in one step from its datasets (``{path: array}``, as ``TraceReader.iter_columns``
        yields them); returns that step's headline metrics. The arrays are only read during the
        call (a reader may reuse their buffers for the next step).

        The step is processed in blocks of whole samples of about ``_BLOCK_TOKENS`` tokens (every
        per-token quantity depends on its own sample only), so the work arrays stay a few tens of
        MB whatever the step size; see ``_block`` for the arithmetic."""
        if self.cfg.compiled is False:
            return self.add(step_tokens(step, policy_version, cols, self.cfg))
        off = np.asarray(cols["/samples/offsets"], dtype=np.int64)
        t = int(np.asarray(cols["/tokens/loss_mask"]).shape[0])
        ss = _StepSums(step)
        for s0, s1 in _sample_blocks(off, t, self._block_tokens):
            a, b = int(off[s0]), int(off[s1])
            if (a, b) == (0, t):
                sub, sub_off = cols, off
            else:
                sub = {k: (np.asarray(v)[a:b] if k.startswith(("/tokens/", "/routing/")) else v)
                       for k, v in cols.items()}
                sub_off = off[s0:s1 + 1] - a
            self._fold_block(ss, self._block(step, policy_version, sub, sub_off, a, s0), t)
        return self._finish_step(ss)

    def _block(self, step: int, policy_version: int, cols: Mapping[str, Any], off: np.ndarray,
               token0: int = 0, sample0: int = 0) -> _StepView:
        """One block of whole samples (``off``: its offsets from 0; ``token0`` / ``sample0``: where
        it starts in the step). Two compiled passes (``kernels``): the analysed tokens are compacted
        (Δ and both logprobs, for the vectorised moments in ``_fold_block``), then every breakdown
        key, the joint histograms (``_joint_hist``'s layout) and the routing agreement come out of
        one loop over the block's tokens."""
        kern = _kernels()
        cfg = self.cfg
        ws = self._ws
        lm = np.asarray(cols["/tokens/loss_mask"])
        lr = np.asarray(cols["/tokens/rollout_logprob"])
        lt = np.asarray(cols["/tokens/old_logprob"])
        if lm.dtype == bool:
            lm = lm.view(np.uint8)
        if lr.dtype not in (np.float32, np.float64) or lt.dtype not in (np.float32, np.float64):
            lr, lt = lr.astype(np.float64), lt.astype(np.float64)     # e.g. float16 exports
        t = int(lm.shape[0])
        has_keys = cfg.breakdowns and "/tokens/turn" in cols
        turn = np.asarray(cols["/tokens/turn"]) if has_keys else _NO_INTS
        pver = np.asarray(cols["/tokens/policy_version"]) if has_keys else _NO_INTS
        ent = np.asarray(cols["/tokens/entropy"]) if has_keys else None
        idx, d = ws("idx", t, np.int64), ws("d", t, np.float64)
        r, o = ws("r", t, lr.dtype), ws("o", t, lt.dtype)
        n, num_gen, vlo, vhi, vsum, tlo, thi = kern.select_analysed(lm, lr, lt, pver, turn, has_keys, idx, d, r, o)
        idx, d, r, o = idx[:n], d[:n], r[:n], o[:n]

        sizes: list[int] = []
        names: list[tuple[str, int | None]] = []          # (dimension, key of digit 0 or None)
        lag = None
        if has_keys:
            lag = (0, 0, None) if n == 0 else (n, n * policy_version - int(vsum), policy_version - int(vlo))
            tsize, vsize = int(thi - tlo) + 1, int(vhi - vlo) + 1
            sizes += [len(POSITION_LABELS), len(PROB_LABELS), len(ENTROPY_LABELS) + 1, tsize, vsize]
            # version digit j = vhi − version: lag policy_version − vhi + j
            names += [("position", None), ("rollout_prob", None), ("entropy", None), ("turn", int(tlo)),
                      ("version_lag", policy_version - int(vhi))]
        has_routing = cfg.routing and "/routing/rollout" in cols and "/routing/train" in cols
        rr = rt = _NO_ROUTING
        vcol = None
        if has_routing:
            rr, rt = np.asarray(cols["/routing/rollout"]), np.asarray(cols["/routing/train"])
            if rr.ndim != 3 or rr.shape != rt.shape or rr.shape[0] != t:
                raise ValueError(f"step {step}: /routing/rollout {rr.shape} and /routing/train {rt.shape} "
                                 f"must both be [tokens={t}, layers, top_k]")
            vcol = cols.get("/routing/rollout_valid")
            if vcol is not None:
                vcol = np.asarray(vcol)
                vcol = vcol.view(np.uint8) if vcol.dtype == bool else vcol
            sizes.append(len(ROUTING_DELTA_LABELS))
            names.append(("routing_delta", None))
        layer_agree = np.zeros(rr.shape[1], np.int64)
        layer_hits = np.zeros(rr.shape[1], np.int64)
        # one histogram per group of dimensions; kernel slot of each dimension (see breakdown_block)
        slots = ([0, 1, 2, 3, 4] if has_keys else []) + ([5] if has_routing else [])
        groups = _group_dims(sizes) if n else []
        mult = np.zeros((len(groups), 6), np.int64)
        totals = []
        for g, members in enumerate(groups):
            stride = 3
            for i in reversed(members):
                mult[g, slots[i]] = stride
                stride *= sizes[i]
            totals.append(stride)
        counts = np.zeros((len(groups), max(totals, default=1)), np.int64)
        sums = np.zeros(counts.shape, np.float64)
        if n or has_routing:
            ent_digit = _entropy_digits(ent, ws) if has_keys and groups else _NO_BYTES
            prob_edges = _LOG_PROB_INNER_F32 if lr.dtype == np.float32 else _LOG_PROB_INNER
            valid = _NO_BYTES if vcol is None else vcol
            row_agree = ws("row_agree", t, bool) if has_routing else _NO_FLAGS
            if has_routing:
                kern.routing_rows(rr, rt, valid, vcol is not None, row_agree, layer_agree, layer_hits)
            if groups:
                kern.breakdown_block(lm, lr, lt, off, turn, pver, ent_digit, has_keys, prob_edges, _POS_LUT,
                                     int(tlo), int(thi - tlo) + 1, int(vhi), int(vhi - vlo) + 1,
                                     row_agree, valid, has_routing, vcol is not None, mult, counts, sums)
        joint = []
        for g, members in enumerate(groups):
            sig = tuple((names[i][0], sizes[i], names[i][1]) for i in members)
            joint.append((sig, counts[g, :totals[g]], sums[g, :totals[g]]))
        routing = None
        if has_routing:
            rows = t if vcol is None else int(np.count_nonzero(vcol))
            routing = (rows, layer_agree, layer_hits, int(rr.shape[2]))

        def top(sel: np.ndarray) -> list[TopToken]:
            tok = idx[sel]
            sample = np.searchsorted(off, tok, side="right") - 1
            out = []
            for p, i, row in zip(sel.tolist(), tok.tolist(), sample.tolist()):
                out.append(TopToken(
                    step=step, token=token0 + i, sample=sample0 + row, delta=float(d[p]), rollout_logprob=float(r[p]),
                    old_logprob=float(o[p]),
                    position=None if not has_keys else _position_of(i, int(off[row]), lm, turn),
                    turn=None if not has_keys else int(turn[i]),
                    policy_version=None if not has_keys else int(pver[i]),
                    lag=None if not has_keys else policy_version - int(pver[i]),
                    entropy=None if ent is None else float(np.float32(ent[i])),
                    routing=None if not has_routing else
                    ROUTING_DELTA_LABELS[_routing_class(i, int(off[row]), rr, rt, vcol)]))
            return out

        return _StepView(num_tokens=t, num_generated=int(num_gen), d=d, r=r, o=o,
                         joint=joint, routing=routing, top=top, lag=lag)

    def add(self, st: StepTokens) -> dict[str, Any]:
        """Fold one step in from its analysed tokens (``step_tokens``); returns that step's headline
        metrics (also kept in ``per_step``)."""
        cfg = self.cfg
        d = st.delta
        n = d.size
        dims: list[_Dim] = []
        everything = np.arange(n)
        if cfg.breakdowns and st.position is not None and n:
            tdig, tlo, tsize = _int_digits(np.asarray(st.turn), everything, span_max=1 << 62)
            ldig, llo, lsize = _int_digits(np.asarray(st.lag), everything, span_max=1 << 62, name="dig_lag")
            dims += [("position", _position_digits(np.asarray(st.position)), len(POSITION_LABELS), None),
                     ("rollout_prob", _prob_digits(np.asarray(st.rollout_lp, dtype=np.float64)),
                      len(PROB_LABELS), None),
                     ("entropy", _entropy_digits(np.asarray(st.entropy, dtype=np.float32)),
                      len(ENTROPY_LABELS) + 1, None),
                     ("turn", tdig, tsize, tlo),
                     ("version_lag", ldig, lsize, llo)]
        routing = None
        if st.routing is not None:
            sr = st.routing
            routing = (sr.layer_rows, sr.layer_agree, sr.layer_hits, sr.topk)
            if n:
                dims.append(("routing_delta", sr.token_class.astype(np.uint8), len(ROUTING_DELTA_LABELS), None))
        joint = _joint_hist(dims, (d < 0).view(np.uint8), d) if dims else []
        lag = None
        if st.lag is not None:
            lag = (int(st.lag.size), int(st.lag.sum()), int(st.lag.max()) if st.lag.size else None)

        def opt(a: np.ndarray | None, i: int, conv: Any) -> Any:
            return None if a is None else conv(a[i])

        def top(sel: np.ndarray) -> list[TopToken]:
            cls = st.routing.token_class if st.routing is not None else None
            # sample row: the last offset <= token (side="right" skips empty samples sharing an offset)
            rows = np.searchsorted(st.offsets, st.idx[sel], side="right") - 1
            return [TopToken(
                step=st.step, token=int(st.idx[i]), sample=int(row), delta=float(st.delta[i]),
                rollout_logprob=float(st.rollout_lp[i]), old_logprob=float(st.old_lp[i]),
                position=opt(st.position, i, int), turn=opt(st.turn, i, int),
                policy_version=opt(st.token_version, i, int), lag=opt(st.lag, i, int),
                entropy=opt(st.entropy, i, float),
                routing=None if cls is None else ROUTING_DELTA_LABELS[int(cls[i])])
                for i, row in zip(sel.tolist(), rows.tolist())]

        ss = _StepSums(st.step)
        self._fold_block(ss, _StepView(num_tokens=st.num_tokens, num_generated=st.num_generated, d=d,
                                       r=st.rollout_lp, o=st.old_lp, joint=joint, routing=routing, top=top,
                                       lag=lag), st.num_tokens)
        return self._finish_step(ss)

    def _fold_block(self, ss: _StepSums, sv: _StepView, step_tokens: int) -> None:
        cfg = self.cfg
        ws = self._ws
        d = sv.d
        ad = np.abs(d, out=ws("ad", d.size, np.float64))
        m = _Moments()
        m.add(d, sv.r, sv.o, cfg, ws)
        ss.moments.merge(m)
        ss.tokens += sv.num_tokens
        ss.generated += sv.num_generated
        if cfg.keep_abs and d.size:
            # float32 halves the memory; |Δ| keeps 7 digits. A histogram of their top bits turns
            # the final percentiles into a selection inside a few bins (``_exact_percentiles``).
            self.abs_parts.append(ad.astype(np.float32))
            self._count_abs(final=False)
        if cfg.per_step_percentiles:
            ss.abs_parts.append(ad.copy())
        if sv.lag is not None:
            n, total, top = sv.lag
            if ss.lag is None:
                ss.lag = [0, 0, None]
            ss.lag[0] += n
            ss.lag[1] += total
            if top is not None:
                ss.lag[2] = top if ss.lag[2] is None else max(ss.lag[2], top)
        for sig, counts, sums in sv.joint:
            acc = self._joint.get(sig)
            if acc is None:
                self._joint[sig] = [counts, sums]
            else:
                acc[0] += counts
                acc[1] += sums
        if len(self._joint) > 16:        # ranges that keep changing: do not hoard histograms
            self._flush()
        if sv.routing is not None:
            rows, agree, hits, k = sv.routing
            self._add_routing(rows, agree, hits, k)
            if ss.routing is None:
                ss.routing = [0, np.zeros_like(agree), np.zeros_like(hits)]
            ss.routing[0] += rows
            ss.routing[1] += agree
        if cfg.top_k > 0 and d.size:
            threshold = abs(self.top[-1].delta) if len(self.top) >= cfg.top_k else None
            sel = _top_positions(ad, cfg.top_k, threshold, ws)
            if sel.size:
                self.top += sv.top(sel)
                self._trim_top()
        if cfg.plot_points > 0 and d.size:
            stride = max(1, step_tokens // max(1, cfg.plot_points // 4))
            self.plot_x.append(np.exp(sv.r[::stride], dtype=np.float64))
            self.plot_y.append(np.exp(sv.o[::stride], dtype=np.float64))

    def _finish_step(self, ss: _StepSums) -> dict[str, Any]:
        """The step's headline metrics (kept in ``per_step``) once its blocks are folded in."""
        m = ss.moments
        self.total.merge(m)
        self.num_tokens += ss.tokens
        self.num_generated += ss.generated
        self.steps.append(ss.step)
        head: dict[str, Any] = {"step": ss.step, "tokens": ss.tokens, "generated": ss.generated,
                                "analysed": m.n, **m.metrics()}
        if self.cfg.per_step_percentiles:
            head["p50_abs"], head["p99_abs"] = _exact_percentiles(ss.abs_parts) if ss.abs_parts else (math.nan, math.nan)
        if ss.lag is not None:
            n, total, top = ss.lag
            # an exact integer sum, then one division: the mean of the per-token lags
            head["version_lag_mean"] = float(total) / n if n else math.nan
            head["version_lag_max"] = top
        if ss.routing is not None:
            rows, agree, _ = ss.routing
            head["routing_agreement"] = float(agree.sum()) / (rows * agree.size) if rows else math.nan
        self.per_step.append(head)
        return head

    def _count_abs(self, final: bool) -> None:
        """Add the |Δ| parts not yet counted to ``abs_hist``, a few at a time: one bincount over
        ≥ 65536 values amortises its 65536-bin output (small steps would otherwise pay it each)."""
        pending = self.abs_parts[self._hist_done:]
        size = sum(p.size for p in pending)
        if not pending or (size < 1 << 16 and not final):
            return
        part = pending[0] if len(pending) == 1 else np.concatenate(pending)
        h = _abs_hist(part, self._ws)
        self.abs_hist = h if self.abs_hist is None else self.abs_hist + h
        self._hist_done = len(self.abs_parts)

    def _flush(self) -> None:
        """Marginalise the pending joint histograms into the breakdown tables."""
        for sig, (counts, sums) in self._joint.items():
            for name, count, s_pos, s_neg, keys in _marginals(sig, counts, sums):
                if name == "entropy":        # the last digit holds non-finite entropies: left out
                    count, s_pos, s_neg = count[:-1], s_pos[:-1], s_neg[:-1]
                bucket = self.routing_delta if name == "routing_delta" else self.buckets[name]
                bucket.add_sums(count, s_pos, s_neg, keys)
        self._joint = {}
        self._count_abs(final=True)

    def _add_routing(self, rows: int, agree: np.ndarray, hits: np.ndarray, topk: int) -> None:
        if self.layer_agree is None or self.layer_agree.shape != agree.shape:
            self.layer_agree = np.zeros_like(agree)
            self.layer_hits = np.zeros_like(hits)
        self.layer_agree += agree
        self.layer_hits += hits
        self.layer_rows += rows
        self.topk = topk

    def _trim_top(self) -> None:
        # stable order: |Δ| descending, then (step, token) ascending
        self.top.sort(key=lambda t: (-abs(t.delta), t.step, t.token))
        del self.top[self.cfg.top_k:]

    def merge(self, other: "MismatchAccumulator") -> None:
        """Fold in an accumulator built over other steps (e.g. by a worker process)."""
        self._flush()
        other._flush()
        self.total.merge(other.total)
        self.num_tokens += other.num_tokens
        self.num_generated += other.num_generated
        self.abs_parts += other.abs_parts
        self._hist_done = len(self.abs_parts)
        self._abs_elsewhere += other._abs_elsewhere
        for b, values in other._abs_in_bins.items():
            self._abs_in_bins.setdefault(b, []).extend(values)
        if other.abs_hist is not None:
            self.abs_hist = other.abs_hist if self.abs_hist is None else self.abs_hist + other.abs_hist
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
        self._flush()
        metrics = self.total.metrics()
        if self._abs_elsewhere and not self._abs_in_bins:
            raise RuntimeError("|Δ| values held by worker processes were not collected")
        p50, p99 = (_exact_percentiles(self.abs_parts, self.abs_hist, in_bins=self._abs_in_bins)
                    if self.cfg.keep_abs else (math.nan, math.nan))
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
        if self._abs_elsewhere:
            raise RuntimeError("|Δ| values are held by worker processes (plots keep them local)")
        return np.concatenate(self.abs_parts) if self.abs_parts else np.zeros(0)

    def plot_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.plot_x:
            return np.zeros(0), np.zeros(0)
        x, y = np.concatenate(self.plot_x), np.concatenate(self.plot_y)
        if x.size > self.cfg.plot_points > 0:
            keep = np.linspace(0, x.size - 1, self.cfg.plot_points).astype(np.int64)
            x, y = x[keep], y[keep]
        return x, y


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


# Loading the compiled kernels costs a process ~0.45 s (importing numba, loading their cached
# machine code); with two workers they then analyse ~27 M generated tokens/s against the numpy
# path's ~15 M (bench/analysis_throughput.py: break-even ~16 M generated tokens, start-up included;
# ~8 M with one worker). 512 MiB of step files hold ~15 M tokens at the default trace layout.
COMPILED_MIN_BYTES = 512 << 20


def resolve_compiled(cfg: MismatchConfig, paths: list[Any]) -> MismatchConfig:
    """``cfg`` with ``compiled`` decided when it is None: compiled kernels when the step files
    to analyse total at least ``COMPILED_MIN_BYTES``, else the numpy path (no numba import)."""
    if cfg.compiled is not None:
        return cfg
    size = sum(Path(p).stat().st_size for p in paths)
    return replace(cfg, compiled=size >= COMPILED_MIN_BYTES)


def _read_steps(reader: Any, steps: list[int], cfg: MismatchConfig) -> MismatchAccumulator:
    """Stream ``steps`` of ``reader`` (only the datasets the analysis needs, read into buffers that
    are reused from step to step) into an accumulator."""
    required, optional = cfg.columns()
    return analyse(reader.iter_columns(required, steps, optional=optional, reuse_buffers=True,
                                       fast_checksums=cfg.compiled is not False), cfg)


def _analyse_steps(run: str, steps: list[int], cfg: MismatchConfig) -> tuple["MismatchAccumulator", list[tuple[str, str]]]:
    """Analyse ``steps`` of ``run`` (already validated by the parent) with a fresh reader."""
    from axrl.trace import TraceReader

    reader = TraceReader(run, validate=False)
    acc = _read_steps(reader, steps, cfg)
    return acc, [(str(p.path), p.message) for p in reader.problems]


def _worker(channel: "_Forked", run: str, steps: list[int], cfg: MismatchConfig) -> None:
    """Worker process body: send the accumulator of ``steps`` without its |Δ| values (only their
    histogram), then, asked for the histogram bins that the exact percentiles need, the values in
    those bins — a few thousand numbers instead of 4 bytes per analysed token. With plots on
    (``plot_points``) the values travel with the accumulator (the |Δ| histogram plot needs them)."""
    acc, problems = _analyse_steps(run, steps, cfg)
    acc._flush()
    keep = cfg.keep_abs and cfg.plot_points == 0 and bool(acc.abs_parts)
    parts = acc.abs_parts
    if keep:
        acc._abs_elsewhere = sum(p.size for p in parts)
        acc.abs_parts, acc._hist_done = [], 0
    channel.send((acc, problems))
    bins = channel.recv() if keep else None
    if bins is not None:
        channel.send(dict(zip(bins, ([v] for v in _values_in_bins(parts, bins)))))


def auto_workers(paths: list[Any], *, min_bytes_per_worker: int = 48 << 20) -> int:
    """Processes worth using: one per ~48 MB of step files, at most one per usable CPU. Reading
    and analysing 48 MB of step files (~1.4 M tokens) takes ~0.1 s of one core; another process
    costs a fork, its own first-touch memory and a merge (~10–30 ms), so smaller selections stay
    in one process. (On a machine whose other cores are busy a second process buys nothing.)"""
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


_ALLOCATOR_TUNED = False


def keep_freed_memory() -> None:
    """Ask glibc's malloc to keep freed blocks of up to 32 MiB in the process (instead of handing
    each back to the OS and taking fresh, zero-filled pages for the next one). The analysis frees
    and re-allocates multi-megabyte arrays every step — numpy temporaries, HDF5 chunk buffers — and
    the page faults of fresh memory cost ~10–15 ns per token, ~15 % of its time. Process-wide
    and permanent (the process keeps its peak heap); a no-op without glibc."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED:
        return
    _ALLOCATOR_TUNED = True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 256 << 20)


class _Forked:
    """``fn(channel, *args)`` run in a forked copy of this process, with a pickle channel each way
    (``send`` / ``recv``). A bare fork and two pipes: the child inherits the imported modules; no
    pool, queues or management thread to start and tear down. An exception in the child is sent
    back and raised by the parent's next ``recv``."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        import os

        up_r, up_w = os.pipe()                             # child -> parent
        down_r, down_w = os.pipe()                         # parent -> child
        self._pid = os.fork()
        if self._pid == 0:                                 # pragma: no cover - child process
            code = 0
            try:
                os.close(up_r)
                os.close(down_w)
                self._in, self._out = os.fdopen(down_r, "rb"), os.fdopen(up_w, "wb")
                try:
                    fn(self, *args)
                except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
                    self.send(_Failure(e))
                self._out.close()
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        os.close(up_w)
        os.close(down_r)
        self._in, self._out = os.fdopen(up_r, "rb"), os.fdopen(down_w, "wb")

    def send(self, obj: Any) -> None:
        import pickle

        pickle.dump(obj, self._out, protocol=pickle.HIGHEST_PROTOCOL)
        self._out.flush()

    def recv(self) -> Any:
        import pickle

        try:
            obj = pickle.load(self._in)
        except EOFError:
            raise RuntimeError("an analysis worker process died without a result") from None
        if isinstance(obj, _Failure):
            raise obj.error
        return obj

    def close(self) -> None:
        """Reap the child (killing it if it is still running: the caller is done or failing)."""
        import os
        import signal

        if self._pid:
            for fh in (self._in, self._out):
                try:
                    fh.close()
                except OSError:
                    pass
            try:
                if os.waitpid(self._pid, os.WNOHANG) == (0, 0):
                    os.kill(self._pid, signal.SIGKILL)
                    os.waitpid(self._pid, 0)
            except OSError:
                pass
            self._pid = 0


@dataclass
class _Failure:
    error: BaseException


def _load_kernels(reader: Any, step: int, cfg: MismatchConfig) -> None:
    """Compile (or load from numba's cache) the kernels for this trace's column types by analysing
    the first sample of ``step``, so that forked workers inherit them instead of each paying the
    ~0.5 s load. A step that cannot be read is left to the analysis to report."""
    required, optional = cfg.columns()
    try:
        with reader.open(step) as sf:
            off = np.asarray(sf["/samples/offsets"], dtype=np.int64)
            if off.size < 2:
                return
            end = int(off[1])
            cols = {name: sf.read_slice(name, 0, end) for name in [*required, *optional]
                    if name != "/samples/offsets" and name in sf}
        cols["/samples/offsets"] = np.array([0, end], dtype=np.int64)
        MismatchAccumulator(cfg).add_columns(step, 0, cols)
    except (TraceError, KeyError, OSError, ValueError):
        return


def mismatch_report(reader: Any, steps: list[int] | None, cfg: MismatchConfig, *,
                    context: bool = True, workers: int = 1) -> tuple[dict[str, Any], MismatchAccumulator]:
    """What ``axrl-debug mismatch`` computes: stream the selected steps (only the datasets the
    analysis needs), build the report and decode the worst tokens' context.

    ``workers > 1`` splits the steps into that many contiguous groups of step files: the calling
    process analyses the first group itself while forked copies of it (``_Forked``; fork, so call
    it from the main thread) analyse the others; their accumulators come back without their |Δ|
    values, of which only those in the histogram bins of the exact percentiles follow
    (``_worker``). h5py serialises every call inside one process, so threads would not help.
    ``workers = 0`` picks ``auto_workers``. The result is the same as with one worker, up to float
    summation order. Tunes the process's allocator (``keep_freed_memory``)."""
    keep_freed_memory()
    steps = list(reader.steps if steps is None else steps)
    paths = [reader.step_path(s) for s in steps]
    cfg = resolve_compiled(cfg, paths)
    if workers == 0:
        workers = auto_workers(paths)
    groups = _partition(steps, [p.stat().st_size for p in paths], workers) if workers > 1 and len(steps) > 1 else [steps]
    children: list[_Forked] = []
    if len(groups) > 1 and cfg.compiled:
        _load_kernels(reader, groups[0][0], cfg)
    try:
        children += [_Forked(_worker, str(reader.path), g, cfg) for g in groups[1:]]
        acc = _read_steps(reader, groups[0], cfg)
        holding = []                                   # children that kept their |Δ| values
        for child in children:
            part, problems = child.recv()
            if part._abs_elsewhere:
                holding.append(child)
            acc.merge(part)
            for path, msg in problems:
                reader.report_problem(path, msg)
        if holding:
            acc._flush()
            bins = _percentile_bins(acc.abs_hist)
            for child in holding:
                child.send(bins)
            for child in holding:
                for b, values in child.recv().items():
                    acc._abs_in_bins.setdefault(b, []).extend(values)
    finally:
        for child in children:
            child.close()
    res = {"run": str(reader.path), **acc.result()}
    if context:
        attach_context(reader, res["top"])
    return res, acc
