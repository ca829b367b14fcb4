"""Teacher-forced scoring on an SGLang server (or `axrl serve`, which speaks the same route).

One prefill-only `POST /generate` per group of streams: list-valued `input_ids`,
`sampling_params.max_new_tokens: 0`, `return_logprob: true`, `logprob_start_len: 0`; each reply's
`meta_info.input_token_logprobs` holds `[logprob, token_id, text]` per input position, the first
`[null, …]`. SGLang computes those at temperature 1 whatever `sampling_params.temperature` says
(measured on 0.5.23: the values equal log_softmax(logits) to the bit, not log_softmax(logits / T)),
so at T ≠ 1 the request adds `top_logprobs_num` = the vocabulary size and the scorer renormalises
the whole distribution (`axrl.inference.scoring.at_temperature`); a reply whose distribution is not
complete (a server whose model has more logits than the scorer's vocabulary) is refused. Replies on
that route are kept to `FULL_VOCAB_BUDGET` numbers by windows of positions: `logprob_start_len` = s
on the stream cut after the window reports positions s + 1 onwards (SGLang reports null at s), so a
long stream at a large vocabulary is several requests whose prefixes SGLang's radix cache shares.
"""

from __future__ import annotations

from typing import Any, Sequence

import httpx
import numpy as np

from axrl.inference.scoring.base import ScoringError, at_temperature, check_sequences, request_groups

__all__ = ["SGLangScorer", "server_info"]

# Numbers per /generate reply on the full-vocabulary route (T ≠ 1): ~20 bytes of JSON each.
FULL_VOCAB_BUDGET = 4_000_000


def server_info(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The server's `GET /model_info` (SGLang and `axrl serve`: model_path, tokenizer_path, …)."""
    try:
        r = httpx.get(url.rstrip("/") + "/model_info", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ScoringError(f"{url}: cannot reach the server ({type(e).__name__}: {e}); is it running?") from None
    if r.status_code != 200:
        raise ScoringError(f"{url}/model_info answered {r.status_code}: {r.text[:300]} (an SGLang server or "
                           "`axrl serve` is expected)")
    return r.json()


class SGLangScorer:
    """`axrl.inference.scoring.Scorer` over one SGLang-compatible server at `url`.

    vocab_size: the model's number of logits (for the T ≠ 1 route and the id check);
    max_batch_tokens: tokens per request at T = 1; timeout_s: per request."""

    name = "sglang"

    def __init__(self, url: str, *, vocab_size: int, max_batch_tokens: int = 16384, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.vocab_size, self.max_batch_tokens = vocab_size, max_batch_tokens
        self.client = httpx.Client(timeout=timeout_s)

    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> list[np.ndarray]:
        """See `axrl.inference.scoring.Scorer.score`."""
        check_sequences(sequences, temperature, self.vocab_size)
        full = float(temperature) != 1.0
        pieces = self._pieces(sequences, full)
        budget = max(1, FULL_VOCAB_BUDGET // self.vocab_size) if full else self.max_batch_tokens
        out = [np.full(len(s), np.nan, dtype=np.float32) for s in sequences]
        costs = [end - start - 1 if full else end for _, start, end in pieces]
        for group in request_groups(costs, budget):
            chosen = [pieces[g] for g in group]
            replies = self._generate([list(map(int, sequences[i][:end])) for i, _, end in chosen],
                                     [start for _, start, _ in chosen], temperature, full)
            for (i, start, end), reply in zip(chosen, replies):
                out[i][start + 1:end] = self._logprobs(sequences[i][start:end], reply, temperature, full)
        return out

    def _pieces(self, sequences: Sequence[Sequence[int]], full: bool) -> list[tuple[int, int, int]]:
        """(sequence, logprob_start_len, end) requests: request `seq[:end]` reports positions
        start + 1 .. end − 1 (SGLang reports null at `start`). At T = 1 one per sequence; on the
        whole-distribution route windows of positions whose replies fit the budget (each window's
        prefix is prefilled again, from SGLang's radix cache when it holds it)."""
        window = max(1, FULL_VOCAB_BUDGET // self.vocab_size)
        pieces = []
        for i, seq in enumerate(sequences):
            if len(seq) < 2:
                continue
            if not full:
                pieces.append((i, 0, len(seq)))
                continue
            pieces += [(i, a - 1, min(len(seq), a + window)) for a in range(1, len(seq), window)]
        return pieces

    def _generate(self, ids: list[list[int]], starts: list[int], temperature: float,
                  full: bool) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"input_ids": ids, "return_logprob": True, "logprob_start_len": starts,
                                "sampling_params": {"max_new_tokens": 0, "temperature": float(temperature)}}
        if full:
            body["top_logprobs_num"] = self.vocab_size
        try:
            r = self.client.post(self.url + "/generate", json=body)
        except httpx.HTTPError as e:
            raise ScoringError(f"{self.url}/generate: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise ScoringError(f"{self.url}/generate answered {r.status_code} to a prefill-only scoring request "
                               f"(max_new_tokens 0, logprob_start_len set): {r.text[:500]}")
        replies = r.json()
        if not isinstance(replies, list) or len(replies) != len(ids):
            raise ScoringError(f"{self.url}/generate: expected {len(ids)} replies to a batch, got {str(replies)[:200]}")
        return replies

    def _logprobs(self, ids: Sequence[int], reply: dict[str, Any], temperature: float, full: bool) -> np.ndarray:
        """float32 [len(ids) − 1]: the logprobs of ids[1:] from a reply whose logprobs start at ids[0]."""
        meta = reply.get("meta_info") or {}
        entries = meta.get("input_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise ScoringError(f"{self.url}/generate: input_token_logprobs has "
                               f"{len(entries) if isinstance(entries, list) else 'no'} entries where "
                               f"{len(ids)} were asked for (was logprob_start_len honoured?)")
        if [int(e[1]) for e in entries] != [int(t) for t in ids]:
            raise ScoringError(f"{self.url}/generate: the server scored other token ids than it was sent")
        if not full:
            return np.array([e[0] for e in entries[1:]], dtype=np.float32)
        top = meta.get("input_top_logprobs")
        if not isinstance(top, list) or len(top) != len(ids):
            raise ScoringError(f"{self.url}/generate: no input_top_logprobs for the positions asked (needed at "
                               f"temperature {temperature:g}: the server's prompt logprobs are at temperature 1)")
        rows = np.full((len(ids) - 1, self.vocab_size), -np.inf, dtype=np.float64)
        for r, pos in enumerate(top[1:]):
            where = np.fromiter((e[1] for e in pos), dtype=np.int64, count=len(pos))
            rows[r, where] = [e[0] for e in pos]
        mass = np.exp(rows).sum(axis=1)
        if np.any(np.abs(mass - 1.0) > 1e-3):
            raise ScoringError(f"{self.url}: the top {self.vocab_size} logprobs of a position hold only "
                               f"{float(mass.min()):.4f} of its probability: the served model has more logits than "
                               f"the vocabulary ({self.vocab_size}) the scorer was given")
        return at_temperature(rows, np.asarray(ids[1:]), temperature)

    def close(self) -> None:
        """Close the HTTP connections (the server keeps running)."""
        self.client.close()
