"""Training–inference mismatch over the generated tokens of a trace, streamed over CSR arrays.

Definitions (docs/debugging.md explains them with examples)
------------------------------------------------------------
A token is *analysed* when ``/tokens/loss_mask == 1`` and both ``rollout_logprob`` and
``old_logprob`` are finite (``axrl.trace.quantities``, the definitions the training loop's logged
``mismatch`` uses too). For an analysed token

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

Engine mismatch vs staleness (traces with ``/tokens/behaviour_train_logprob``)
-------------------------------------------------------------------------------
Δ = Δ_engine + Δ_staleness with Δ_engine = behaviour_train − rollout (engine vs trainer at the
generating weights) and Δ_staleness = old − behaviour_train (policy drift since those weights), on
analysed tokens with a finite behaviour_train_logprob: count, mean |·| and mean of each part and its
exact share of Σ|Δ| (``split``), overall (``delta_split``), per version-lag bucket and per step.
Without the column the report is unchanged.

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
A step is read and processed in chunks of whole samples (``MismatchConfig.chunk_tokens``,
``axrl.trace.chunks``, so that the columns held and the work arrays stay one chunk's whatever the
step size; a chunk that fails to read drops its whole step) whose sums are added (Chan's update for the correlation's centred
moments). Breakdown sums are accumulated in joint histograms (every breakdown key plus the sign
of Δ as the digits of one bin index), marginalised once at the end. On large traces the per-token
loops (token selection, breakdown keys and histograms, routing comparison, moment sums) run compiled
with numba (``kernels``; ``MismatchConfig.compiled``, ``resolve_compiled``); smaller ones take the
numpy path (``step_tokens`` + ``add``), which answers sooner there because it skips numba's
start-up. The two agree up to float summation order (~1e-13 relative: the compiled moment sums
are vectorised, i.e. re-associated; each is deterministic on a given machine). Ties among the worst
tokens are broken by (step, token) ascending.

The package, one job per module: ``config`` (columns, buckets, ``MismatchConfig``), ``keys``
(breakdown keys per token: the numpy definitions), ``tokens`` (the numpy path), ``compiled`` +
``kernels`` (the compiled path), ``routing_pass`` + ``routing_kernels`` (its routing comparison:
arrays, or the chunk's routing streamed as stored — packed routing from its ``train_differs``
marks, only the marked rows unpacked), ``blocks`` (a block of whole samples, ``_StepView``: what
either path hands the accumulator), ``breakdowns``, ``moments``, ``percentiles``, ``routing``, ``split``,
``top`` (the worst tokens), ``accumulator`` (``MismatchAccumulator``), ``context`` (decoded
context), ``pool`` (forked workers), ``allocator``; this module: ``mismatch_report``, the entry
point of ``axrl-debug mismatch``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from axrl.trace.schema import TraceError

from .accumulator import MismatchAccumulator, _read_steps, analyse
from .allocator import keep_freed_memory
from .config import (BREAKDOWN_COLUMNS, CORE_COLUMNS, ENTROPY_EDGES, ENTROPY_LABELS, POSITION_EDGES, POSITION_LABELS,
                     PROB_EDGES, PROB_LABELS, ROUTING_COLUMNS, ROUTING_DELTA_LABELS, SPLIT_COLUMN, MismatchConfig)
from .context import attach_context
from .moments import METRIC_NAMES
from .percentiles import _abs_hist, _exact_percentiles, _percentile_bins
from .pool import _Forked, _partition, _worker, auto_workers
from .routing import StepRouting, routing_agreement
from .tokens import StepTokens, step_tokens
from .top import TopToken

__all__ = [
    "BREAKDOWN_COLUMNS", "COMPILED_MIN_BYTES", "COMPILED_MIN_ROUTING_ROWS", "CORE_COLUMNS", "ENTROPY_EDGES", "ENTROPY_LABELS", "METRIC_NAMES",
    "POSITION_EDGES", "POSITION_LABELS", "PROB_EDGES", "PROB_LABELS", "ROUTING_COLUMNS", "ROUTING_DELTA_LABELS",
    "SPLIT_COLUMN", "MismatchAccumulator", "MismatchConfig", "StepRouting", "StepTokens", "TopToken", "analyse",
    "attach_context", "auto_workers", "keep_freed_memory", "mismatch_report", "resolve_compiled",
    "routing_agreement", "step_tokens", "_abs_hist", "_exact_percentiles", "_load_kernels",
]


# Loading the compiled kernels costs a process ~0.45 s (importing numba, loading their cached
# machine code); with two workers they then analyse ~27 M generated tokens/s against the numpy
# path's ~15 M (bench/analysis_throughput.py: break-even ~16 M generated tokens, start-up included;
# ~8 M with one worker). 512 MiB of step files hold ~15 M tokens at the default trace layout.
COMPILED_MIN_BYTES = 512 << 20


# Routing comparisons ((token, layer) rows) above which the compiled pass pays for loading numba:
# numpy's comparison costs ~0.1 µs per row, the compiled one a tenth of that.
COMPILED_MIN_ROUTING_ROWS = 1 << 22


def resolve_compiled(cfg: MismatchConfig, paths: list[Any]) -> MismatchConfig:
    """``cfg`` with ``compiled`` decided when it is None: compiled kernels when the step files
    to analyse total at least ``COMPILED_MIN_BYTES`` or hold at least ``COMPILED_MIN_ROUTING_ROWS``
    routing rows (tokens × MoE layers; the same for raw and packed routing), else the numpy path
    (no numba import)."""
    if cfg.compiled is not None:
        return cfg
    size = sum(Path(p).stat().st_size for p in paths)
    return replace(cfg, compiled=size >= COMPILED_MIN_BYTES or
                   (cfg.routing and _routing_rows(paths, COMPILED_MIN_ROUTING_ROWS) >= COMPILED_MIN_ROUTING_ROWS))


def _routing_rows(paths: list[Any], enough: int) -> int:
    """Σ tokens × MoE layers over the step files (stops counting at ``enough``; unreadable: 0)."""
    from axrl.trace import StepFile

    total = 0
    for p in paths:
        try:
            with StepFile(p) as sf:
                if "/routing/rollout" in sf and sf.num_tokens:
                    total += sf.num_tokens * int(sf.read_slice("/routing/rollout", 0, 1).shape[1])
        except (TraceError, OSError, KeyError):
            continue
        if total >= enough:
            break
    return total


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
