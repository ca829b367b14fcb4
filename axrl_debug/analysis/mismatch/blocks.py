"""The blocks a step is folded in by: runs of whole samples, and what either path of the analysis
derives from one (``_StepView``, the protocol between the paths and ``MismatchAccumulator``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from axrl.trace.chunks import DEFAULT_CHUNK_TOKENS, sample_chunks

from .breakdowns import _Sig
from .split import BlockSplit
from .top import TopToken


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
    split: BlockSplit | None = None        # ``split.split_sums`` when the step has behaviour_train_logprob


# tokens per block of a step (work arrays ~200 B per token of a block): the chunk a step is read in
_BLOCK_TOKENS = DEFAULT_CHUNK_TOKENS
_sample_blocks = sample_chunks     # runs of whole samples of about that many tokens
