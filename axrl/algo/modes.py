"""The names of the loss's modes, shared by the schema (`loss_config`) and the maths
(`aggregation`, `kl`) without either importing the other."""

from __future__ import annotations

from typing import Literal

__all__ = ["KLEstimator", "LOSS_AGG_MODES", "LossAgg"]

KLEstimator = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                   "seq-mean-token-sum-norm")
