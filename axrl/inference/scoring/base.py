"""Teacher-forced scoring: each token's logprob given the tokens before it, one prefill per stream.

    scorer.score([[5, 6, 7], [9, 10]], temperature=0.7)
    # [array([nan, lp(6|5), lp(7|5,6)]), array([nan, lp(10|9)])]   float32, index t = log p_T(x_t | x_<t)

The quantity is the trainer's and the sampler's: log_softmax(logits / T) at the given token, in
float32, with T the rollout temperature (`axrl.train.micro_batch.label_logprobs`). Position 0 has
no prediction (NaN). Used to re-score a recorded rollout on another engine (`axrl-debug replay
--rollout --engine sglang|vllm`) and to score the student's tokens with a served distillation
teacher (`distill.url`).

One implementation per engine: `EmbeddedScorer` (a model in this process: one causal forward per
stream), `axrl.inference.scoring.sglang.SGLangScorer` (SGLang or `axrl serve`, `/generate` prefill
only) and `axrl.inference.scoring.vllm.VLLMScorer` (`/v1/completions` with `prompt_logprobs`).

Temperature. Neither SGLang (0.5.23: `LogitsProcessor` takes log_softmax of the raw logits for
input tokens) nor vLLM (0.32: "prompt tokens skip sampling processors") applies the temperature to
prompt logprobs. At T = 1 the engine's own per-token value is used; at T ≠ 1 the servers are asked
for the whole distribution at every position (`top_logprobs_num` / `prompt_logprobs` = vocabulary
size) and `at_temperature` renormalises it: log_softmax(lp / T) = log_softmax(z / T) exactly, since
lp = z − logsumexp(z) differs from the logits z by a per-row constant. That costs vocab-size
numbers per token on the wire, so requests are cut to `full_vocab_budget` numbers each.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

__all__ = ["EmbeddedScorer", "Scorer", "ScoringError", "at_temperature", "request_groups", "check_sequences"]


class ScoringError(RuntimeError):
    """A scorer's server refused or answered something unusable; the message says what to do."""


class Scorer(Protocol):
    """Teacher-forced per-token logprobs of token streams (see the module docstring)."""

    name: str

    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> list[np.ndarray]:
        """float32 [len(seq)] per sequence: index t = log_softmax(logits_{t-1} / T)[seq[t]]; index 0 NaN."""
        ...

    def close(self) -> None:
        """Release what the scorer holds (HTTP connections; never the server it was given)."""
        ...


def check_sequences(sequences: Sequence[Sequence[int]], temperature: float, vocab_size: int | None) -> None:
    """Refuse empty streams, a temperature ≤ 0 and ids outside the vocabulary, naming the stream."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for scoring (log_softmax(logits / T)), got {temperature}")
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty: a scored stream needs at least one token")
        if vocab_size is not None and (min(seq) < 0 or max(seq) >= vocab_size):
            raise ValueError(f"sequence {i} holds token id {max(seq) if max(seq) >= vocab_size else min(seq)}, "
                             f"outside the scorer's vocabulary [0, {vocab_size})")


def at_temperature(full: np.ndarray, targets: np.ndarray, temperature: float) -> np.ndarray:
    """float32 [n]: log_softmax(full[i] / T)[targets[i]] for rows `full` [n, V] of logprobs (or
    logits: any per-row shift cancels), computed in float64."""
    x = np.asarray(full, dtype=np.float64) / float(temperature)
    m = x.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    return (x[np.arange(len(x)), np.asarray(targets, dtype=np.int64)] - lse).astype(np.float32)


def request_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive sequence indices in groups of at most `budget` tokens (a longer sequence alone)."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if groups and used + n <= budget:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups


class EmbeddedScorer:
    """Scores with a model held in this process: one causal forward per stream (no KV cache, no
    batching across streams, so a stream's values do not depend on its neighbours), the trainer's
    `label_logprobs` on its logits."""

    name = "embedded"

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = vocab_size

    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> list[np.ndarray]:
        """See `Scorer.score`."""
        from axrl.train.micro_batch import label_logprobs

        check_sequences(sequences, temperature, self.vocab_size)
        device = next(self.model.parameters()).device
        out = []
        with torch.inference_mode():
            for seq in sequences:
                lp = np.full(len(seq), np.nan, dtype=np.float32)
                if len(seq) > 1:
                    ids = torch.tensor([list(seq)], dtype=torch.int64, device=device)
                    logits = self.model(ids).logits[0, :-1]
                    lp[1:] = label_logprobs(logits, ids[0, 1:], temperature)[0].cpu().numpy()
                out.append(lp)
        return out

    def close(self) -> None:
        """Nothing to release (the model belongs to the caller)."""
