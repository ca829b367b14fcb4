"""The compiled path: one block of whole samples through the numba passes of ``kernels`` (loaded
on first use: importing numba and loading the cached machine code costs a process ~0.45 s, which
the numpy path of small traces never pays)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .blocks import _StepView
from .breakdowns import _group_dims
from .config import ENTROPY_LABELS, POSITION_LABELS, PROB_LABELS, ROUTING_DELTA_LABELS, SPLIT_COLUMN, MismatchConfig
from .keys import _LOG_PROB_INNER, _LOG_PROB_INNER_F32, _POS_LUT, _entropy_digits
from .routing import token_routing_class
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
                   off: np.ndarray, token0: int = 0, sample0: int = 0) -> _StepView:
    """One block of whole samples (``off``: its offsets from 0; ``token0`` / ``sample0``: where
    it starts in the step). Two compiled passes (``kernels``): the analysed tokens are compacted
    (Δ and both logprobs, for the vectorised moments in ``_fold_block``), then every breakdown
    key, the joint histograms (``_joint_hist``'s layout) and the routing agreement come out of
    one loop over the block's tokens."""
    kern = _kernels()
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
    behaviour = cols.get(SPLIT_COLUMN)
    split = None
    if behaviour is not None:
        behaviour = np.asarray(behaviour)
        split = split_sums(d, r, o, behaviour[idx],
                           policy_version - pver[idx].astype(np.int64) if has_keys else None)

    def top(sel: np.ndarray) -> list[TopToken]:
        tok = idx[sel]
        sample = np.searchsorted(off, tok, side="right") - 1
        out = []
        for p, i, row in zip(sel.tolist(), tok.tolist(), sample.tolist()):
            out.append(TopToken(
                step=step, token=token0 + i, sample=sample0 + row, delta=float(d[p]), rollout_logprob=float(r[p]),
                old_logprob=float(o[p]),
                position=None if not has_keys else token_position(i, int(off[row]), lm, turn),
                turn=None if not has_keys else int(turn[i]),
                policy_version=None if not has_keys else int(pver[i]),
                lag=None if not has_keys else policy_version - int(pver[i]),
                entropy=None if ent is None else float(np.float32(ent[i])),
                routing=None if not has_routing else
                ROUTING_DELTA_LABELS[token_routing_class(i, int(off[row]), rr, rt, vcol)],
                **({} if behaviour is None else split_fields(r[p], o[p], behaviour[i]))))
        return out

    return _StepView(num_tokens=t, num_generated=int(num_gen), d=d, r=r, o=o,
                     joint=joint, routing=routing, top=top, lag=lag, split=split)
