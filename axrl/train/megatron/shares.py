"""How the backend cuts a batch for its ranks, so that each rank is sent only its own rows.

The batch is cut into the embedded backend's micro-batches (the same order and sizes, so the two
backends take the same optimizer steps); under data parallelism each micro-batch is then cut
into contiguous DP shares (`share_bounds`). A DP rank receives a `RankWork`: its share of every
micro-batch plus the few numbers all ranks must agree on — the row and sequence lengths every
rank pads to (the MoE dispatchers' collectives and gloo's all-gather need equal token counts),
the whole batch's `LossContext` (loss normalisation) and how to run it (dtype, prefix merge). The
TP ranks of one DP rank get the same `RankWork`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from axrl.train.micro_batch import micro_batches
from axrl.train.prefix_tree import PrefixTree, build_prefix_tree
from axrl.train.protocol import LossContext, PackedBatch


def share_bounds(num_samples: int, parts: int, index: int) -> range:
    """Samples of share `index` when `num_samples` consecutive samples are cut into `parts`
    contiguous shares, the first `num_samples % parts` one sample larger (some may be empty)."""
    q, r = divmod(num_samples, parts)
    start = index * q + min(index, r)
    return range(start, start + q + (index < r))


@dataclass
class StepKnobs:
    """The backend-config values of a step (read from the backend's live `config`, so replay
    what-ifs and faults that replace `backend.config` reach the ranks): how the batch is cut
    (micro_batch_*, prefix_merge) and how the ranks run it (dtype, prefix_merge: both reach the
    ranks inside their `RankWork`)."""

    dtype: str = "float32"
    micro_batch_tokens: int = 0
    micro_batch_size: int = 0
    prefix_merge: bool = False  # each share of a micro-batch as one prefix tree (train/prefix_tree.py)


@dataclass
class Share:
    """One DP rank's part of one micro-batch."""

    batch: PackedBatch | None   # its samples, in order (None: an empty share, which runs padding only)
    rows: int                   # samples every DP rank runs: the largest share's
    seq_len: int                # the micro-batch's longest sample: every DP rank pads to it
    tree: PrefixTree | None = None  # prefix-merged: the share's tree (built here, once, for `slots`)
    slots: int = 0              # prefix-merged: the largest share's tree slots (every rank pads to it)


@dataclass
class RankWork:
    """What one DP rank (and each of its TP ranks) is sent for a forward or forward_backward."""

    shares: list[Share]         # one per micro-batch, in micro-batch order
    ctx: LossContext            # the whole batch's counts
    temperature: float          # the batch's sampling temperature (an empty share has no batch)
    dtype: str                  # the step's compute dtype (StepKnobs.dtype)
    prefix_merge: bool          # each share runs as its prefix tree (`Share.tree`)


def split_for_ranks(batch: PackedBatch, data_parallel: int, knobs: StepKnobs) -> list[RankWork]:
    """One `RankWork` per DP rank, in dp_rank order. Concatenating the ranks' shares of each
    micro-batch in dp_rank order, micro-batch after micro-batch, gives the batch's sample order."""
    dp = data_parallel
    ctx = LossContext.of(batch)
    per_rank: list[list[Share]] = [[] for _ in range(dp)]
    for mb in micro_batches(batch, knobs.micro_batch_tokens, knobs.micro_batch_size, merged=knobs.prefix_merge):
        bounds = [share_bounds(mb.num_samples, dp, i) for i in range(dp)]
        parts = [mb] if dp == 1 else [mb.select(list(b)) if len(b) else None for b in bounds]
        trees = [build_prefix_tree(p) if knobs.prefix_merge and p is not None else None for p in parts]
        slots = max((t.num_slots for t in trees if t is not None), default=0)
        rows, seq_len = max(map(len, bounds)), int(mb.lengths.max())
        for part, tree, work in zip(parts, trees, per_rank):
            work.append(Share(part, rows, seq_len, tree, slots))
    return [RankWork(shares, ctx, batch.temperature, knobs.dtype, knobs.prefix_merge) for shares in per_rank]


def by_micro_batch(answers: list[Any]) -> list[list[Any]]:
    """Rank answers [(dp_rank, [result per micro-batch]) or None] → per micro-batch, the DP
    shares' results in dp_rank order (= sample order: shares are contiguous runs of samples)."""
    shares = sorted((a for a in answers if a is not None), key=lambda a: a[0])
    return [list(mb) for mb in zip(*(parts for _, parts in shares))]


__all__ = ["RankWork", "Share", "StepKnobs", "by_micro_batch", "share_bounds", "split_for_ranks"]
