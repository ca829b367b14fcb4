"""The MoE routing of sequences the service sampled, for the trace of the steps that train on them.

A Tinker datum carries tokens, weights, advantages and sampler logprobs, but not the experts the
engine routed each token to. The sampler remembers, per sampled sequence (prompt + returned
tokens), the routing the engine reported; when a `forward_backward` datum is exactly such a
sequence — as an RL loop builds it: the prompt, then the completion — its rows become the step's
`/routing/rollout` (SGLang's layout: one row per token that went through the model, so the
sequence's last token has none). Datums that match nothing are recorded without rollout routing
(`routing_rollout_valid` 0), and `mismatch` compares routing on the rows that have it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

#: sampled sequences whose routing is kept (the oldest is forgotten first); an RL loop trains on
#: a batch shortly after sampling it, so a few thousand sequences cover any recipe's batch
KEEP_SEQUENCES = 4096


class RoutingMemory:
    """Bounded map: sampled token sequence → its engine routing (int16 [n − 1, L, k])."""

    def __init__(self, keep: int = KEEP_SEQUENCES) -> None:
        self.keep = keep
        self._rows: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()   # sampling and training run on different threads

    def remember(self, tokens: list[int], routing: np.ndarray) -> None:
        """Keep the routing of the sequence `tokens` (rows for its first len(tokens) − 1 tokens)."""
        rows = np.asarray(routing)[: len(tokens) - 1]
        if len(rows) != len(tokens) - 1:
            return  # the engine reported fewer rows (an aborted request): nothing trustworthy to keep
        with self._lock:
            self._rows[tuple(tokens)] = rows.astype(np.int16)
            self._rows.move_to_end(tuple(tokens))
            while len(self._rows) > self.keep:
                self._rows.popitem(last=False)

    def lookup(self, tokens: list[int]) -> np.ndarray | None:
        """The routing rows of exactly this sequence, or None if it was not sampled here (lately)."""
        with self._lock:
            return self._rows.get(tuple(tokens))

    def batch_rows(self, sequences: list[list[int]]) -> tuple[np.ndarray, np.ndarray] | None:
        """Routing [T, L, k] (int16; zeros where unknown) and valid uint8 [T] of the packed
        `sequences` (T = their total length): each matched sequence's rows but its last. None when
        no sequence was sampled here."""
        found = [self.lookup(seq) for seq in sequences]
        shapes = {rows.shape[1:] for rows in found if rows is not None}
        if len(shapes) != 1:
            return None   # none matched (or, impossibly, two routing shapes: record none)
        shape = shapes.pop()
        total = sum(len(s) for s in sequences)
        routing = np.zeros((total, *shape), np.int16)
        valid = np.zeros(total, np.uint8)
        at = 0
        for seq, rows in zip(sequences, found):
            if rows is not None:
                routing[at:at + len(rows)] = rows
                valid[at:at + len(rows)] = 1
            at += len(seq)
        return routing, valid
