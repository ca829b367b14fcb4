"""Per-token mismatch quantities over trace columns: one definition for the trainer and the analysis.

The training loop logs the headline mismatch of each step to ``metrics.jsonl`` (``mismatch``) and
``axrl-debug`` reports it from the step files (``mean_abs``); both call these functions, so the two
numbers are the same number. Inputs are the stored columns of one step or one sample (numpy
arrays, or anything ``np.asarray`` takes):

* a token is **analysed** when ``loss_mask != 0`` and both ``rollout_logprob`` and ``old_logprob``
  are finite (``analysed_mask``): the engine generated it, it is trained on, and both sides have a
  logprob for it;
* its mismatch is **Δ = old_logprob − rollout_logprob** (``delta``), in float64 from the stored
  values (the difference of two float32 logprobs is a float64 number unless their magnitudes are
  ~2^29 apart);
* the **headline mismatch** of a set of tokens is mean |Δ| over its analysed tokens
  (``mean_abs_delta``; NaN when there are none).

Only numpy: the trainer and every reader can import it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def analysed_mask(loss_mask: Any, rollout_logprob: Any, old_logprob: Any) -> np.ndarray:
    """bool [T]: the token is trained on (``loss_mask != 0``) and both logprobs are finite."""
    mask = np.isfinite(np.asarray(rollout_logprob))
    mask &= np.isfinite(np.asarray(old_logprob))
    mask &= np.asarray(loss_mask) != 0
    return mask


def delta(rollout_logprob: Any, old_logprob: Any) -> np.ndarray:
    """Δ = old − rollout per token, float64."""
    return np.subtract(old_logprob, rollout_logprob, dtype=np.float64)


def mean_abs_delta(loss_mask: Any, rollout_logprob: Any, old_logprob: Any) -> float:
    """The headline mismatch: mean |Δ| over the analysed tokens (NaN without any)."""
    rollout, old = np.asarray(rollout_logprob), np.asarray(old_logprob)
    mask = analysed_mask(loss_mask, rollout, old)
    if not mask.any():
        return math.nan
    return float(np.abs(delta(rollout[mask], old[mask])).mean())

