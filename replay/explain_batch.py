"""How `axrl-debug explain` batches its patched forwards bit for bit: each variant is a copy of
its sample cut after the request's last chosen token, grouped by the padded length of the
micro-batch it had in the baseline and padded to it, so every row gets exactly the baseline's bits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from axrl.train.micro_batch import micro_batch_ranges
from axrl.train.protocol import PackedBatch, TrainBackend

# Padded positions (rows × longest) per batched forward of copies: bounds the activations (the
# attention scores grow with rows × longest²) where the run's micro-batches have no token limit.
VARIANT_TOKENS = 8192

def _truncated(batch: PackedBatch, rows: list[tuple[int, int]]) -> PackedBatch:
    """A batch of copies of `batch`'s samples cut to their first tokens: `rows` as (sample, length);
    a sample may appear several times (one copy per patch variant)."""
    starts = batch.offsets[:-1]
    idx = torch.cat([torch.arange(int(starts[i]), int(starts[i]) + n) for i, n in rows])
    lengths = torch.tensor([n for _, n in rows], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    per_token = {f.name: getattr(batch, f.name)[idx] for f in dataclasses.fields(batch)
                 if isinstance(getattr(batch, f.name), torch.Tensor) and f.name != "offsets"}
    return dataclasses.replace(batch, offsets=offsets, **per_token)


@dataclass
class _Layout:
    """The trainer path's padding, to run cut copies of `sub`'s samples as the baseline ran them:
    a sample's positions compute bitwise as in its own micro-batch when the copy's micro-batch is
    padded to the same length (on CPU, how many rows a micro-batch has and what they hold do not
    change a row's bits; its padded length does, through the attention's blocking)."""

    padded: dict[int, int]     # sub row → its micro-batch's padded length
    longest: dict[int, int]    # sub row → its micro-batch's longest row (the filler that pads a copy batch)
    rows_cap: dict[int, int]   # padded length → rows a copy batch of it may hold (one backend micro-batch)

    @classmethod
    def of(cls, backend: TrainBackend, sub: PackedBatch, cfg: Any) -> "_Layout":
        bc = getattr(backend, "config", None)
        tokens = int(getattr(bc, "micro_batch_tokens", cfg.train.micro_batch_tokens) or 0)
        size = int(getattr(bc, "micro_batch_size", 0) or 0)
        merged = bool(getattr(bc, "prefix_merge", cfg.train.prefix_merge))
        lengths = sub.lengths.tolist()
        padded, longest, cap = {}, {}, {}
        for rg in micro_batch_ranges(sub, tokens, size, merged=merged):
            top = max(rg, key=lambda i: lengths[i])
            S = lengths[top]
            for i in rg:
                padded[i], longest[i] = S, top
            # rows × S within the token budget: the backend runs a copy batch as one micro-batch
            cap[S] = max(1, min(tokens // S if tokens else VARIANT_TOKENS // S, size or 1 << 30))
        return cls(padded, longest, cap)

    def batches(self, source: PackedBatch, items: list[tuple[int, int]]) -> list[tuple[list[int], PackedBatch]]:
        """`items` (sub row, length to keep) as batches of copies cut from `source` (`sub` or a
        variant of it with the same offsets), each padded like its rows' micro-batches:
        (indices into `items`, the batch, whose row j is item j; an unused filler row may follow)."""
        by_padded: dict[int, list[int]] = {}
        for k, (i, _) in enumerate(items):
            by_padded.setdefault(self.padded[i], []).append(k)
        out = []
        for S, ks in sorted(by_padded.items()):
            filler = self.longest[items[ks[0]][0]]
            per = max(1, self.rows_cap[S] - 1)
            for j in range(0, len(ks), per):
                part = ks[j:j + per]
                # the filler's own copies keep their full length: the batch is then padded to S already
                spec = [(items[k][0], S if items[k][0] == filler else items[k][1]) for k in part]
                if all(n < S for _, n in spec):
                    spec.append((filler, S))
                out.append((part, _truncated(source, spec)))
        return out


