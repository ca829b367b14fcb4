"""Micro-batching of packed batches, padding to [b, S] and the packed ↔ padded index maps.

Split order (fixed, so a step re-executes bit for bit): samples stay in batch order and each
micro-batch is a run of *consecutive* samples. A new micro-batch starts before sample i when
the current one is non-empty and adding sample i would make it exceed `micro_batch_tokens`
*padded* tokens (samples × longest sample: what the forward computes), or the current one
already holds `micro_batch_size` samples. 0 disables a limit. A sample longer than the token
budget therefore sits alone in its own micro-batch. Counting padding keeps a batch with a heavy
tail of long episodes from padding many short samples to the longest one's length (measured on
an 8-turn echo batch: 45k padded slots for 17k real tokens when real tokens were counted, 18k
now — half the forward time).

Alignment (PackedBatch's convention): the value at packed token t of a sample is about
log p(token_t | earlier tokens of that sample); position 0 of every sample has no prediction and
gets 0.0. The logits at padded position s predict token s + 1, hence the one-column shift below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from axrl.train.protocol import PackedBatch, R3Scope


def split_micro_batches(lengths: Sequence[int] | torch.Tensor, micro_batch_tokens: int = 0,
                        micro_batch_size: int = 0, *, shared: Sequence[int] | None = None) -> list[range]:
    """Sample-index ranges [start, end) of each micro-batch, in order (see the module doc).

    `shared[i]` (a prefix-merged forward, `axrl.train.prefix_tree`): how many leading tokens
    sample i shares with sample i - 1. The budget then counts tree slots instead of samples ×
    longest — a sample costs its length in a new micro-batch and length − shared + 1 after its
    predecessor (the fork token is duplicated; length if nothing is shared), an upper bound of
    what the tree computes."""
    if micro_batch_tokens < 0 or micro_batch_size < 0:
        raise ValueError("micro_batch_tokens and micro_batch_size must be >= 0 (0 = no limit)")
    lengths = [int(n) for n in lengths]
    ranges: list[range] = []
    start, longest, slots = 0, 0, 0
    for i, n in enumerate(lengths):
        added = n if shared is None or i == start else n - max(int(shared[i]) - 1, 0)
        cost = (i - start + 1) * max(longest, n) if shared is None else slots + added
        full = (micro_batch_tokens and cost > micro_batch_tokens) or \
               (micro_batch_size and i - start >= micro_batch_size)
        if i > start and full:
            ranges.append(range(start, i))
            start, longest, slots, added = i, 0, 0, n
        longest, slots = max(longest, n), slots + added
    if lengths:
        ranges.append(range(start, len(lengths)))
    return ranges


def shared_with_previous(batch: PackedBatch) -> list[int]:
    """[N]: how many leading tokens sample i shares with sample i - 1 (0 for the first)."""
    ids, off = batch.input_ids.tolist(), batch.offsets.tolist()
    out = [0]
    for i in range(1, len(off) - 1):
        a, b = ids[off[i - 1]:off[i]], ids[off[i]:off[i + 1]]
        lo, hi = 0, min(len(a), len(b))  # binary search on C-level list comparisons
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        out.append(lo)
    return out


def micro_batch_ranges(batch: PackedBatch, micro_batch_tokens: int = 0, micro_batch_size: int = 0, *,
                       merged: bool = False) -> list[range]:
    """The sample ranges of `micro_batches(batch, ...)`; `merged`: the budget counts prefix-tree
    slots (see `split_micro_batches`)."""
    shared = shared_with_previous(batch) if merged and micro_batch_tokens else None
    return split_micro_batches(batch.lengths, micro_batch_tokens, micro_batch_size, shared=shared)


def micro_batches(batch: PackedBatch, micro_batch_tokens: int = 0, micro_batch_size: int = 0, *,
                  merged: bool = False) -> list[PackedBatch]:
    """The batch cut into consecutive micro-batches (a single one is the batch itself)."""
    ranges = micro_batch_ranges(batch, micro_batch_tokens, micro_batch_size, merged=merged)
    if len(ranges) == 1:
        return [batch]
    return [batch.select(list(r)) for r in ranges]


@dataclass
class PaddedMicroBatch:
    """A micro-batch as right-padded [b, S] tensors; `rows`/`cols` [T] locate each packed token."""

    input_ids: torch.Tensor                # int64 [b, S]; padding = pad_id
    attention_mask: torch.Tensor           # int64 [b, S]; 1 = real token
    rows: torch.Tensor                     # int64 [T]: sample (row) of packed token t
    cols: torch.Tensor                     # int64 [T]: position of packed token t within its row
    forced_experts: torch.Tensor | None    # int64 [b, S, L, k] (R3), padding rows = expert 0; −1 = route freely

    def to(self, device: torch.device | str) -> "PaddedMicroBatch":
        """The same micro-batch with every tensor on `device`."""
        return PaddedMicroBatch(self.input_ids.to(device), self.attention_mask.to(device), self.rows.to(device),
                                self.cols.to(device),
                                None if self.forced_experts is None else self.forced_experts.to(device))


def pad_micro_batch(mb: PackedBatch, *, pad_id: int = 0, with_routing: bool = False,
                    device: torch.device | str | None = None, scope: R3Scope | None = None) -> PaddedMicroBatch:
    """Right-pad a micro-batch. Right padding keeps real tokens at positions 0..len-1, so causal
    attention never sees a pad and rotary positions equal those of an unpadded forward.

    With a partial R3 `scope`, the forced routing is −1 (route freely) in the layers it leaves out
    and, with `loss_tokens_only`, at every row that is not a loss token."""
    lengths = mb.lengths
    b, S = mb.num_samples, int(lengths.max())
    rows = mb.sample_index()
    cols = torch.arange(mb.num_tokens) - mb.offsets[:-1][rows]
    input_ids = torch.full((b, S), pad_id, dtype=torch.int64)
    input_ids[rows, cols] = mb.input_ids.long().cpu()  # built on CPU, moved once below
    attention_mask = torch.zeros(b, S, dtype=torch.int64)
    attention_mask[rows, cols] = 1
    forced = None
    if with_routing:
        if mb.routed_experts is None:
            raise ValueError("R3 needs PackedBatch.routed_experts, but the batch has none")
        re = mb.routed_experts
        forced = torch.zeros(b, S, *re.shape[1:], dtype=torch.int64)
        forced[rows, cols] = re.long().cpu()
        if scope is not None and not scope.full:
            restrict_routing_(forced, scope, rows, cols, mb.loss_mask.cpu() > 0)
    padded = PaddedMicroBatch(input_ids, attention_mask, rows, cols, forced)
    return padded if device is None else padded.to(device)


def restrict_routing_(forced: torch.Tensor, scope: R3Scope, rows: torch.Tensor, cols: torch.Tensor,
                      loss_tokens: torch.Tensor) -> None:
    """Set forced routing [b, S, L, k] to −1 (route freely) where `scope` does not replay."""
    keep = torch.tensor([scope.replays_layer(i) for i in range(forced.shape[2])], dtype=torch.bool)
    forced[:, :, ~keep] = -1
    if scope.loss_tokens_only:
        replayed = torch.zeros(forced.shape[:2], dtype=torch.bool)
        replayed[rows, cols] = loss_tokens
        forced[~replayed] = -1


def unpad(padded: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[b, S, ...] → packed [T, ...] (differentiable gather)."""
    return padded[rows, cols]


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position (logprob, entropy), both float32 [b, S], in PackedBatch alignment.

    logprob[:, s] = log_softmax(logits[:, s-1] / T)[input_ids[:, s]], entropy[:, s] = entropy of
    that same distribution; column 0 is 0.0. Computed in float32 whatever the logits dtype.
    """
    lp, ent = label_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], dim=1), torch.cat([zero, ent], dim=1)


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits / T)[label], entropy of that distribution), float32 [...], for logits
    [..., V] and labels [...]; a label of −1 (nothing to predict) gets logprob 0.0."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    if bool((labels < 0).any()):
        lp = torch.where(labels >= 0, lp, torch.zeros_like(lp))
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent
