"""A forward_backward call's datums as one `PackedBatch` (the learner's batch protocol), and the
per-datum outputs back out of the packed rows.

Row i + 1 of a sequence carries datum position i (`wire.Datum`); each sequence's row 0 predicts
nothing. Columns: `advantages` holds the datum's advantages (RL losses) or its weights
(cross_entropy: −Σ w·lp is REINFORCE with A = w); `rollout_logprobs` the sampler's logprobs the
client sent (NaN where it sent none, or 0 on a position not trained, i.e. prompt positions; a 0.0
on a trained position is a token sampled with p = 1 and is kept); `loss_mask` the positions the
loss trains on (weight ≠ 0, or advantage / sampler logprob ≠ 0).
"""

from __future__ import annotations

import numpy as np
import torch

from axrl.tinker_api.errors import UserError
from axrl.tinker_api.losses import NEEDS
from axrl.tinker_api.wire import Datum
from axrl.train.protocol import PackedBatch


def pack(data: list[Datum], loss_fn: str, vocab_size: int | None = None,
         max_positions: int | None = None) -> PackedBatch:
    """The call's datums as a PackedBatch; UserError names a datum that lacks an input `loss_fn`
    reads, or (given `vocab_size`, `max_positions`) a token id the model has no embedding for or a
    sequence longer than its positions — checked here, before any gradient, so a refused call
    leaves the accumulated gradients as they were."""
    if not data:
        raise UserError("forward_backward: data is empty (send at least one datum)")
    for i, d in enumerate(data):
        if vocab_size is not None:
            _check_vocab(i, d, vocab_size)
        if max_positions is not None and d.tokens.size > max_positions:
            raise UserError(f"data[{i}] is {d.tokens.size} tokens (model_input + the last target), more than the "
                            f"model's max_position_embeddings {max_positions}: shorten or split it")
        missing = [k for k in NEEDS[loss_fn] if k not in d.inputs]
        if missing:
            raise UserError(f"data[{i}].loss_fn_inputs: {loss_fn} needs {missing[0]!r} (it reads {list(NEEDS[loss_fn])})")
    ids, adv, q, mask = [], [], [], []
    for d in data:
        n = d.n
        zero = np.zeros(1, np.float32)
        a = d.inputs["weights"] if loss_fn == "cross_entropy" else d.inputs["advantages"]
        lp = d.inputs.get("logprobs", np.zeros(n, np.float32))
        ids.append(d.tokens)
        adv.append(np.concatenate([zero, a]))
        trained = (a != 0) | (lp != 0)
        if "mask" in d.inputs:
            trained &= d.inputs["mask"] != 0
        # A sampler logprob of exactly 0.0 on a trained position is a token sampled with p = 1 in
        # float32, not a missing value: keep it (else it leaves the mismatch statistics). NaN
        # ("unknown") only where no logprobs were sent, or at an untrained 0 (the prompt's filler).
        known = ((lp != 0) | trained) if "logprobs" in d.inputs else np.zeros(n, bool)
        if "logprobs" in d.inputs and "mask" in d.inputs:
            known |= d.inputs["mask"] != 0
        q.append(np.concatenate([[np.nan], np.where(known, lp, np.nan)]).astype(np.float32))
        mask.append(np.concatenate([zero, trained.astype(np.float32)]))
    offsets = np.cumsum([0] + [x.size for x in ids]).astype(np.int64)
    return PackedBatch(input_ids=torch.from_numpy(np.concatenate(ids)), offsets=torch.from_numpy(offsets),
                       loss_mask=torch.from_numpy(np.concatenate(mask)),
                       advantages=torch.from_numpy(np.concatenate(adv)),
                       rollout_logprobs=torch.from_numpy(np.concatenate(q)))


def _check_vocab(i: int, d: Datum, vocab_size: int) -> None:
    outside = np.nonzero((d.tokens < 0) | (d.tokens >= vocab_size))[0]
    if outside.size:
        j = int(outside[0])
        # the packed sequence is model_input + the last target (wire.Datum)
        field = f"model_input[{j}]" if j < d.n else f"loss_fn_inputs['target_tokens'][{d.n - 1}]"
        raise UserError(f"data[{i}].{field} = {int(d.tokens[j])} is outside the model's vocabulary "
                        f"[0, {vocab_size})")


def per_datum(batch: PackedBatch, column: torch.Tensor) -> list[np.ndarray]:
    """Column [T] split into each datum's positions (rows 1.. of each sequence), float32."""
    values = column.detach().float().cpu().numpy()
    off = batch.offsets.tolist()
    return [values[a + 1:b].copy() for a, b in zip(off[:-1], off[1:])]
