"""The frozen reference policy of the KL penalty (`algo.kl_coef > 0`): the weights at RL start,
after the supervised warm-up — the state of checkpoint `step_000000` — held by the train backend
under `REFERENCE` (`TrainBackend.keep_weights`). Its logprobs are computed in the prepare phase,
on whichever backend trains, and recorded as `/tokens/ref_logprob`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from axrl.config import Config
from axrl.runtime.checkpoint import checkpoint_dir, load_checkpoint
from axrl.runtime.updates import routing_replay
from axrl.train.protocol import PackedBatch, TrainBackend

REFERENCE = "ref"

__all__ = ["REFERENCE", "keep_reference", "needs_reference", "restore_reference", "with_reference_logprobs"]


def needs_reference(cfg: Config) -> bool:
    return cfg.algo.kl_coef > 0


def keep_reference(backend: TrainBackend, cfg: Config) -> None:
    """At RL start (after the warm-up): keep the current weights as the reference."""
    if needs_reference(cfg):
        backend.keep_weights(REFERENCE)


def restore_reference(backend: TrainBackend, run_dir: Path, cfg: Config) -> None:
    """Keep the reference from the run's `step_000000` checkpoint (on resume, in replay), leaving
    the backend in that state: the caller loads the state it continues from afterwards."""
    if not needs_reference(cfg):
        return
    path = checkpoint_dir(Path(run_dir), 0)
    if not path.is_dir():
        raise FileNotFoundError(f"algo.kl_coef > 0 needs the reference policy, the weights at RL start, which "
                                f"are in {path}; that checkpoint is missing")
    load_checkpoint(path, backend)
    backend.keep_weights(REFERENCE)


def with_reference_logprobs(backend: TrainBackend, batch: PackedBatch, cfg: Config) -> PackedBatch:
    """The batch with the reference's logprobs (prepare phase; unchanged when no KL penalty)."""
    if not needs_reference(cfg):
        return batch
    ref = backend.forward(dataclasses.replace(batch, old_logprobs=None), r3=routing_replay(cfg), weights=REFERENCE)
    return dataclasses.replace(batch, ref_logprobs=ref.logprobs)
