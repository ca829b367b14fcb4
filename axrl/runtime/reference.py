"""The frozen reference policy of the KL penalty (`algo.kl_coef > 0`): the weights at RL start,
after the supervised warm-up — the state of checkpoint `step_000000` — held by the train backend
under `REFERENCE` (`TrainBackend.keep_weights`). Its logprobs are computed in the prepare phase,
on whichever backend trains, and recorded as `/tokens/ref_logprob`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from axrl.runtime.checkpoint import checkpoint_dir, load_checkpoint
from axrl.train.protocol import R3, PackedBatch, TrainBackend

REFERENCE = "ref"

__all__ = ["REFERENCE", "keep_reference", "restore_reference", "with_reference_logprobs"]

# Each function takes `needed` — whether the run has a KL penalty (`algo.kl_coef > 0`) — and does
# nothing without one, so callers need no branch of their own.


def keep_reference(backend: TrainBackend, needed: bool) -> None:
    """At RL start (after the warm-up): keep the current weights as the reference."""
    if needed:
        backend.keep_weights(REFERENCE)


def restore_reference(backend: TrainBackend, run_dir: Path, needed: bool) -> None:
    """Keep the reference from the run's `step_000000` checkpoint (on resume, in replay), leaving
    the backend in that state: the caller loads the state it continues from afterwards."""
    if not needed:
        return
    path = checkpoint_dir(Path(run_dir), 0)
    if not path.is_dir():
        raise FileNotFoundError(f"algo.kl_coef > 0 needs the reference policy, the weights at RL start, which "
                                f"are in {path}; that checkpoint is missing")
    load_checkpoint(path, backend)
    backend.keep_weights(REFERENCE)


def with_reference_logprobs(backend: TrainBackend, batch: PackedBatch, needed: bool, r3: R3) -> PackedBatch:
    """The batch with the reference's logprobs (prepare phase; unchanged when no KL penalty)."""
    if not needed:
        return batch
    ref = backend.forward(dataclasses.replace(batch, old_logprobs=None), r3=r3, weights=REFERENCE)
    return dataclasses.replace(batch, ref_logprobs=ref.logprobs)
