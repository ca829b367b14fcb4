"""``MismatchAccumulator``: folds steps, block by block, into fixed-size sums (moments, breakdown
histograms, routing counts, the Δ split, the worst tokens; every |Δ| only for the exact
percentiles) and turns them into the report (``result``)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

import numpy as np

from .blocks import _sample_blocks, _StepView
from .breakdowns import _Buckets, _marginals, _Sig
from .compiled import compiled_block
from .config import ENTROPY_LABELS, POSITION_LABELS, PROB_LABELS, ROUTING_DELTA_LABELS, MismatchConfig
from .moments import METRIC_NAMES, _Moments
from .percentiles import _abs_hist, _exact_percentiles
from .routing_pass import routing_arrays
from .scratch import _Scratch
from .split import SplitSums, split_figures, split_head
from .tokens import StepTokens, numpy_view, step_tokens
from .top import TopToken, _top_positions


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
    split: np.ndarray | None = None                           # split sums, when the step has the column


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
        self.split: SplitSums | None = None   # set by the first step with behaviour_train_logprob
        self._ws = _Scratch()
        self._block_tokens = self.cfg.chunk_tokens

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
        cols = self.cfg.compared(cols)
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
            self._fold_block(ss, compiled_block(self.cfg, self._ws, step, policy_version, sub, sub_off, a, s0), t)
        return self._finish_step(ss)

    def add_chunks(self, step: int, policy_version: int, chunks: Iterable[Any], num_tokens: int) -> dict[str, Any]:
        """Fold in one step read in runs of whole samples (``axrl.trace.chunks.iter_chunks`` with
        ``cfg.chunk_tokens``: the blocks ``add_columns`` would cut, so the sums are the same);
        ``num_tokens``: the step's token count. Returns that step's headline metrics. Only one
        chunk's columns are held at a time. A chunk that fails to read (the exception propagates)
        leaves the accumulator as it was before the step."""
        saved = self._checkpoint()
        try:
            ss = _StepSums(step)
            for ch in chunks:
                cols = self.cfg.compared(ch.data)
                routing = getattr(ch, "routing", None)
                if self.cfg.compiled is False:
                    if routing is not None:          # the numpy path compares arrays
                        cols = {**cols, **routing_arrays(routing)}
                    sv = numpy_view(step_tokens(step, policy_version, cols, self.cfg), self.cfg)
                    if ch.token0 or ch.sample0:
                        sv.top = _shifted(sv.top, ch.token0, ch.sample0)
                else:
                    off = np.asarray(cols["/samples/offsets"], dtype=np.int64)
                    sv = compiled_block(self.cfg, self._ws, step, policy_version, cols, off, ch.token0, ch.sample0,
                                        routing)
                self._fold_block(ss, sv, num_tokens)
            return self._finish_step(ss)
        except BaseException:
            self.__dict__.update(saved)
            raise

    def _checkpoint(self) -> dict[str, Any]:
        """The accumulator's state, to restore if a step fails half-way (lists copied, sums deep-copied)."""
        return {k: (v if k in ("cfg", "_ws") else list(v) if isinstance(v, list) else copy.deepcopy(v))
                for k, v in self.__dict__.items()}

    def add(self, st: StepTokens) -> dict[str, Any]:
        """Fold one step in from its analysed tokens (``step_tokens``); returns that step's headline
        metrics (also kept in ``per_step``)."""
        ss = _StepSums(st.step)
        self._fold_block(ss, numpy_view(st, self.cfg), st.num_tokens)
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
        if sv.split is not None:
            if self.split is None:
                self.split = SplitSums()
            self.split.add(sv.split)
            ss.split = sv.split[0].copy() if ss.split is None else ss.split + sv.split[0]
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
        if ss.split is not None:
            head.update(split_head(ss.split))
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
        if other.split is not None:
            if self.split is None:
                self.split = SplitSums()
            self.split.merge(other.split)
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
        if self.split is not None:
            out["delta_split"] = split_figures(self.split.total)
        total_abs = self.total.sum_abs
        if self.cfg.breakdowns:
            out["breakdowns"] = {name: b.rows(total_abs) for name, b in self.buckets.items()}
            if self.split is not None:
                for row in out["breakdowns"]["version_lag"]:
                    row["delta_split"] = self.split.lag(row["bucket"])
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


def _shifted(top: Any, token0: int, sample0: int) -> Any:
    """A block's ``top`` whose tokens and samples are numbered from the step's start."""
    return lambda sel: [replace(t, token=t.token + token0, sample=t.sample + sample0) for t in top(sel)]


def _read_steps(reader: Any, steps: list[int], cfg: MismatchConfig) -> MismatchAccumulator:
    """Stream ``steps`` of ``reader`` into an accumulator, chunk by chunk (``cfg.chunk_tokens``
    tokens of whole samples at a time, only the datasets the analysis needs, read into buffers
    reused from chunk to chunk; on the compiled path the routing pair streamed as stored, a stored
    chunk at a time, packed routing undecoded): memory does not grow with the step."""
    from axrl.trace.chunks import iter_chunks

    from ..chunked import for_each_step

    required, optional = cfg.columns()
    acc = MismatchAccumulator(cfg)
    buffers: dict[str, np.ndarray] = {}

    def fold(sf: Any) -> None:
        chunks = iter_chunks(sf, required, optional=optional, chunk_tokens=cfg.chunk_tokens, buffers=buffers,
                             fast_checksums=cfg.compiled is not False, stream_routing=cfg.compiled is not False)
        acc.add_chunks(sf.step, sf.policy_version, chunks, sf.num_tokens)

    for_each_step(reader, steps, fold)
    return acc
