"""The numpy path: the analysed tokens of one step with their breakdown keys (``step_tokens``,
array arithmetic on the CSR columns), and the block view ``MismatchAccumulator.add`` folds in
(``numpy_view``). Smaller traces take this path; it is also the per-token view the TUI uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from axrl.trace.quantities import analysed_mask, delta

from .blocks import _StepView
from .breakdowns import _Dim, _joint_hist
from .config import ENTROPY_LABELS, POSITION_LABELS, PROB_LABELS, ROUTING_DELTA_LABELS, SPLIT_COLUMN, MismatchConfig
from .keys import _entropy_digits, _int_digits, _position_digits, _prob_digits, _sample_starts, _segment_positions
from .routing import StepRouting, routing_agreement, routing_classes
from .split import split_sums
from .top import TopToken, split_fields


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
    routing: StepRouting | None = None
    behaviour_lp: np.ndarray | None = None  # float64 behaviour_train_logprob (NaN: not computed)


def step_tokens(step: int, policy_version: int, cols: Mapping[str, Any], cfg: MismatchConfig) -> StepTokens:
    """Select the analysed tokens of one step (``axrl.trace.quantities.analysed_mask``) and derive
    their breakdown keys (no Python loop over tokens or samples: everything is array arithmetic on
    the CSR layout)."""
    off = np.asarray(cols["/samples/offsets"], dtype=np.int64)
    lm = np.asarray(cols["/tokens/loss_mask"])
    lr = np.asarray(cols["/tokens/rollout_logprob"])
    lt = np.asarray(cols["/tokens/old_logprob"])
    t = lm.shape[0]
    gen = lm != 0
    idx = np.flatnonzero(analysed_mask(lm, lr, lt))
    r = lr[idx].astype(np.float64)
    o = lt[idx].astype(np.float64)
    st = StepTokens(step=step, policy_version=policy_version, num_tokens=t, num_generated=int(np.count_nonzero(gen)),
                    idx=idx, delta=delta(r, o), rollout_lp=r, old_lp=o, offsets=off)
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
        cls = routing_classes(idx, starts, np.logical_and.reduce(agree, axis=0), valid)
        st.routing = StepRouting(layer_rows=int(np.count_nonzero(valid)), layer_agree=layer_agree,
                                 layer_hits=layer_hits, topk=int(rr.shape[2]), token_class=cls)
    if SPLIT_COLUMN in cols:
        st.behaviour_lp = np.asarray(cols[SPLIT_COLUMN])[idx].astype(np.float64)
    return st


def numpy_view(st: StepTokens, cfg: MismatchConfig) -> _StepView:
    """The block view of a whole step from its analysed tokens: breakdown histograms by
    ``_joint_hist`` over the digits of ``keys``."""
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
    split = None
    if st.behaviour_lp is not None:
        split = split_sums(d, st.rollout_lp, st.old_lp, st.behaviour_lp, st.lag)

    def opt(a: np.ndarray | None, i: int, conv: Any) -> Any:
        return None if a is None else conv(a[i])

    def top(sel: np.ndarray) -> list[TopToken]:
        cls = st.routing.token_class if st.routing is not None else None
        b = st.behaviour_lp
        # sample row: the last offset <= token (side="right" skips empty samples sharing an offset)
        rows = np.searchsorted(st.offsets, st.idx[sel], side="right") - 1
        return [TopToken(
            step=st.step, token=int(st.idx[i]), sample=int(row), delta=float(st.delta[i]),
            rollout_logprob=float(st.rollout_lp[i]), old_logprob=float(st.old_lp[i]),
            position=opt(st.position, i, int), turn=opt(st.turn, i, int),
            policy_version=opt(st.token_version, i, int), lag=opt(st.lag, i, int),
            entropy=opt(st.entropy, i, float),
            routing=None if cls is None else ROUTING_DELTA_LABELS[int(cls[i])],
            **({} if b is None else split_fields(st.rollout_lp[i], st.old_lp[i], b[i])))
            for i, row in zip(sel.tolist(), rows.tolist())]

    return _StepView(num_tokens=st.num_tokens, num_generated=st.num_generated, d=d, r=st.rollout_lp,
                     o=st.old_lp, joint=joint, routing=routing, top=top, lag=lag, split=split)

