"""The compiled path: one block of whole samples through the numba passes of ``kernels`` (loaded
on first use: importing numba and loading the cached machine code costs a process ~0.45 s, which
the numpy path of small traces never pays)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from axrl.trace.routing_stream import RoutingRange

from .blocks import _StepView
from .breakdowns import _group_dims
from .config import ENTROPY_LABELS, POSITION_LABELS, PROB_LABELS, ROUTING_DELTA_LABELS, SPLIT_COLUMN, MismatchConfig
from .keys import _LOG_PROB_INNER, _LOG_PROB_INNER_F32, _POS_LUT, _entropy_digits
from .routing import row_class, token_routing_class
from .routing_pass import NO_COUNTS, compare_rows, compare_stream
from .scratch import _Scratch
from .split import split_sums
from .top import TopToken, split_fields, token_position

# Stand-ins for absent columns, so the compiled kernels see arrays of fixed types.
_NO_INTS = np.zeros(1, np.int64)
_NO_BYTES = np.zeros(1, np.uint8)
_NO_FLAGS = np.zeros(1, bool)
_NO_ROUTING = np.zeros((1, 0, 1), np.uint8)
assert len(_LOG_PROB_INNER) == 5, "kernels.breakdown_block unrolls five rollout-prob edges"


def _kernels() -> Any:
    """The compiled loops (imports numba on first use; see ``kernels``)."""
    from . import kernels
    return kernels


def compiled_block(cfg: MismatchConfig, ws: _Scratch, step: int, policy_version: int, cols: Mapping[str, Any],
                   off: np.ndarray, token0: int = 0, sample0: int = 0, routing: RoutingRange | None = None) -> _StepView:
    """One block of whole samples (``off``: its offsets from 0; ``token0`` / ``sample0``: where
    it starts in the step). Two compiled passes (``kernels``): the analysed tokens are compacted
    (Δ and both logprobs, for the vectorised moments in ``_fold_block``), then every breakdown
    key, the joint histograms (``_joint_hist``'s layout) and the routing agreement come out of
    one loop over the block's tokens. ``routing``: the block's routing pair streamed as stored
    (``iter_chunks(stream_routing=True)``) instead of arrays in ``cols``."""
    kern = _kernels()
    c = _Block.of(cfg, cols, step, routing)
    a = _Analysed.of(kern, ws, c)
    sizes, names, lag = _key_dims(c, a, policy_version)
    if c.has_routing:
        sizes.append(len(ROUTING_DELTA_LABELS))
        names.append(("routing_delta", None))
    # one histogram per group of dimensions; kernel slot of each dimension (see breakdown_block)
    slots = ([0, 1, 2, 3, 4] if c.has_keys else []) + ([5] if c.has_routing else [])
    h = _Histograms.of(_group_dims(sizes) if a.n else [], sizes, slots, c.layers)
    if a.n or c.has_routing:
        _breakdown_pass(kern, ws, c, a, off, h)
    joint = []
    for g, members in enumerate(h.groups):
        sig = tuple((names[i][0], sizes[i], names[i][1]) for i in members)
        joint.append((sig, h.counts[g, :h.totals[g]], h.sums[g, :h.totals[g]]))
    routing = None
    if c.has_routing:
        rows = c.t if c.vcol is None else int(np.count_nonzero(c.vcol))
        routing = (rows, h.layer_agree, h.layer_hits, c.topk)
    behaviour = cols.get(SPLIT_COLUMN)
    split = None
    if behaviour is not None:
        behaviour = np.asarray(behaviour)
        split = split_sums(a.d, a.r, a.o, behaviour[a.idx],
                           policy_version - c.pver[a.idx].astype(np.int64) if c.has_keys else None)
    return _StepView(num_tokens=c.t, num_generated=int(a.num_gen), d=a.d, r=a.r, o=a.o, joint=joint, routing=routing,
                     top=_top_tokens(c, a, off, step, policy_version, token0, sample0, behaviour), lag=lag, split=split)


@dataclass
class _Block:
    """A block's columns as the kernels take them (stand-ins where a column is absent)."""

    t: int                      # tokens in the block
    lm: np.ndarray              # uint8 [t] loss mask
    lr: np.ndarray              # float32|float64 [t] rollout logprob
    lt: np.ndarray              # same dtype [t] trainer (old) logprob
    has_keys: bool              # breakdowns on and the key columns present
    turn: np.ndarray
    pver: np.ndarray
    ent: np.ndarray | None
    has_routing: bool           # routing agreement on and both routing columns present
    rr: np.ndarray              # [t, layers, top_k] rollout routing
    rt: np.ndarray              # same, trainer routing
    vcol: np.ndarray | None     # uint8 [t] rows with valid rollout routing, when recorded
    stream: RoutingRange | None = None   # the routing pair as stored, instead of ``rr`` / ``rt``
    row_agree: np.ndarray | None = None  # bool [t] every layer agrees (``_breakdown_pass``)

    @property
    def layers(self) -> int:
        return self.stream.layers if self.stream is not None else int(self.rr.shape[1])

    @property
    def topk(self) -> int:
        return self.stream.k if self.stream is not None else int(self.rr.shape[2])

    @classmethod
    def of(cls, cfg: MismatchConfig, cols: Mapping[str, Any], step: int,
           stream: RoutingRange | None = None) -> "_Block":
        lm = np.asarray(cols["/tokens/loss_mask"])
        lr = np.asarray(cols["/tokens/rollout_logprob"])
        lt = np.asarray(cols["/tokens/old_logprob"])
        if lm.dtype == bool:
            lm = lm.view(np.uint8)
        if lr.dtype not in (np.float32, np.float64) or lt.dtype not in (np.float32, np.float64):
            lr, lt = lr.astype(np.float64), lt.astype(np.float64)     # e.g. float16 exports
        t = int(lm.shape[0])
        has_keys = cfg.breakdowns and "/tokens/turn" in cols
        stream = stream if cfg.routing else None
        has_routing = stream is not None or (cfg.routing and "/routing/rollout" in cols and "/routing/train" in cols)
        rr = rt = _NO_ROUTING
        vcol = None
        if has_routing and stream is None:
            rr, rt = np.asarray(cols["/routing/rollout"]), np.asarray(cols["/routing/train"])
            if rr.ndim != 3 or rr.shape != rt.shape or rr.shape[0] != t:
                raise ValueError(f"step {step}: /routing/rollout {rr.shape} and /routing/train {rt.shape} "
                                 f"must both be [tokens={t}, layers, top_k]")
        if has_routing:
            vcol = cols.get("/routing/rollout_valid")
            if vcol is not None:
                vcol = np.asarray(vcol)
                vcol = vcol.view(np.uint8) if vcol.dtype == bool else vcol
        return cls(t=t, lm=lm, lr=lr, lt=lt, has_keys=has_keys,
                   turn=np.asarray(cols["/tokens/turn"]) if has_keys else _NO_INTS,
                   pver=np.asarray(cols["/tokens/policy_version"]) if has_keys else _NO_INTS,
                   ent=np.asarray(cols["/tokens/entropy"]) if has_keys else None,
                   has_routing=has_routing, rr=rr, rt=rt, vcol=vcol, stream=stream)


@dataclass
class _Analysed:
    """The first compiled pass: the analysed tokens compacted, and the key columns' ranges."""

    n: int                      # analysed tokens
    idx: np.ndarray             # [n] their index in the block
    d: np.ndarray               # [n] Δ = old − rollout (float64)
    r: np.ndarray               # [n] rollout logprob
    o: np.ndarray               # [n] old logprob
    num_gen: int                # generated tokens (a rollout logprob)
    vlo: int                    # policy versions [vlo, vhi] of the analysed tokens, and their sum
    vhi: int
    vsum: int
    tlo: int                    # turns [tlo, thi]
    thi: int

    @classmethod
    def of(cls, kern: Any, ws: _Scratch, c: _Block) -> "_Analysed":
        t = c.t
        idx, d = ws("idx", t, np.int64), ws("d", t, np.float64)
        r, o = ws("r", t, c.lr.dtype), ws("o", t, c.lt.dtype)
        n, num_gen, vlo, vhi, vsum, tlo, thi = kern.select_analysed(c.lm, c.lr, c.lt, c.pver, c.turn, c.has_keys,
                                                                     idx, d, r, o)
        return cls(n=n, idx=idx[:n], d=d[:n], r=r[:n], o=o[:n], num_gen=num_gen, vlo=vlo, vhi=vhi, vsum=vsum,
                   tlo=tlo, thi=thi)


def _key_dims(c: _Block, a: _Analysed, policy_version: int) -> tuple[list[int], list[tuple[str, int | None]], Any]:
    """The breakdown dimensions' sizes and (name, key of digit 0 or None), and the version-lag sums
    (count, Σ lag, max lag); empty / None without the key columns."""
    sizes: list[int] = []
    names: list[tuple[str, int | None]] = []
    if not c.has_keys:
        return sizes, names, None
    n = a.n
    lag = (0, 0, None) if n == 0 else (n, n * policy_version - int(a.vsum), policy_version - int(a.vlo))
    tsize, vsize = int(a.thi - a.tlo) + 1, int(a.vhi - a.vlo) + 1
    sizes += [len(POSITION_LABELS), len(PROB_LABELS), len(ENTROPY_LABELS) + 1, tsize, vsize]
    # version digit j = vhi − version: lag policy_version − vhi + j
    names += [("position", None), ("rollout_prob", None), ("entropy", None), ("turn", int(a.tlo)),
              ("version_lag", policy_version - int(a.vhi))]
    return sizes, names, lag


@dataclass
class _Histograms:
    """What the second compiled pass fills: one flat joint histogram (counts, Δ sums) per group of
    breakdown dimensions, and the routing agreement per layer."""

    groups: list[list[int]]     # the dimensions of each group (``_group_dims``)
    mult: np.ndarray            # [groups, 6] each kernel slot's stride into its group's histogram
    totals: list[int]           # each group's histogram length
    counts: np.ndarray          # int64 [groups, max total]
    sums: np.ndarray            # float64, same shape
    layer_agree: np.ndarray     # int64 [layers]
    layer_hits: np.ndarray      # int64 [layers]

    @classmethod
    def of(cls, groups: list[list[int]], sizes: list[int], slots: list[int], layers: int) -> "_Histograms":
        """Zeroed histograms; strides are 3 cells per key (``breakdown_block``'s layout) times the
        sizes of the group's later dimensions."""
        mult = np.zeros((len(groups), 6), np.int64)
        totals = []
        for g, members in enumerate(groups):
            stride = 3
            for i in reversed(members):
                mult[g, slots[i]] = stride
                stride *= sizes[i]
            totals.append(stride)
        counts = np.zeros((len(groups), max(totals, default=1)), np.int64)
        return cls(groups=groups, mult=mult, totals=totals, counts=counts, sums=np.zeros(counts.shape, np.float64),
                   layer_agree=np.zeros(layers, np.int64), layer_hits=np.zeros(layers, np.int64))


def _breakdown_pass(kern: Any, ws: _Scratch, c: _Block, a: _Analysed, off: np.ndarray, h: _Histograms) -> None:
    """The second compiled pass: routing agreement per row and layer, then every breakdown key into
    the joint histograms (``h`` filled in place)."""
    ent_digit = _entropy_digits(c.ent, ws) if c.has_keys and h.groups else _NO_BYTES
    prob_edges = _LOG_PROB_INNER_F32 if c.lr.dtype == np.float32 else _LOG_PROB_INNER
    valid = _NO_BYTES if c.vcol is None else c.vcol
    row_agree = ws("row_agree", c.t, bool) if c.has_routing else _NO_FLAGS
    if c.stream is not None:
        compare_stream(c.stream, valid, c.vcol is not None, row_agree, h.layer_agree, h.layer_hits)
        c.row_agree = row_agree
    elif c.has_routing:
        compare_rows(c.rr, c.rt, valid, c.vcol is not None, row_agree, h.layer_agree, h.layer_hits, NO_COUNTS)
    if h.groups:
        kern.breakdown_block(c.lm, c.lr, c.lt, off, c.turn, c.pver, ent_digit, c.has_keys, prob_edges, _POS_LUT,
                             int(a.tlo), int(a.thi - a.tlo) + 1, int(a.vhi), int(a.vhi - a.vlo) + 1,
                             row_agree, valid, c.has_routing, c.vcol is not None, h.mult, h.counts, h.sums)


def agreeing_layers(rr: np.ndarray, rt: np.ndarray) -> np.ndarray:
    """int32 [T]: layers whose expert sets agree, per routing row (compiled)."""
    t, layers = rr.shape[0], rr.shape[1]
    out = np.zeros(t, np.int32)
    if t:
        compare_rows(rr, rt, _NO_BYTES, False, np.empty(t, bool), np.zeros(layers, np.int64),
                     np.zeros(layers, np.int64), out)
    return out


def streamed_agreeing_layers(rng: RoutingRange, valid: np.ndarray | None) -> np.ndarray:
    """``agreeing_layers`` of a chunk's routing pair streamed as stored (``compare_stream``: packed
    routing compared from its marks, only the marked rows decoded) — for the valid rows (``valid``:
    uint8 [T], None for every row); an invalid row's count is not compared, to be weighted out (the
    TUI's per-sample routing column of a large step)."""
    t = rng.token1 - rng.token0
    out = np.zeros(t, np.int32)
    if t:
        compare_stream(rng, _NO_BYTES if valid is None else valid, valid is not None, np.empty(t, bool),
                       np.zeros(rng.layers, np.int64), np.zeros(rng.layers, np.int64), out)
    return out


def _top_tokens(c: _Block, a: _Analysed, off: np.ndarray, step: int, policy_version: int, token0: int,
                sample0: int, behaviour: np.ndarray | None) -> Callable[[np.ndarray], list[TopToken]]:
    """The block's ``_StepView.top``: `TopToken`s of the analysed tokens picked by ``sel``."""

    def top(sel: np.ndarray) -> list[TopToken]:
        tok = a.idx[sel]
        sample = np.searchsorted(off, tok, side="right") - 1
        out = []
        for p, i, row in zip(sel.tolist(), tok.tolist(), sample.tolist()):
            out.append(TopToken(
                step=step, token=token0 + i, sample=sample0 + row, delta=float(a.d[p]), rollout_logprob=float(a.r[p]),
                old_logprob=float(a.o[p]),
                position=None if not c.has_keys else token_position(i, int(off[row]), c.lm, c.turn),
                turn=None if not c.has_keys else int(c.turn[i]),
                policy_version=None if not c.has_keys else int(c.pver[i]),
                lag=None if not c.has_keys else policy_version - int(c.pver[i]),
                entropy=None if c.ent is None else float(np.float32(c.ent[i])),
                routing=None if not c.has_routing else ROUTING_DELTA_LABELS[
                    row_class(i, int(off[row]), c.row_agree, c.vcol) if c.stream is not None else
                    token_routing_class(i, int(off[row]), c.rr, c.rt, c.vcol)],
                **({} if behaviour is None else split_fields(a.r[p], a.o[p], behaviour[i]))))
        return out

    return top
