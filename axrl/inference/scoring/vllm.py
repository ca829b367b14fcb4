"""Teacher-forced scoring on a vLLM server: `POST /v1/completions` with token-id prompts and
`prompt_logprobs`.

Each choice's `prompt_logprobs` is `[null, {token_id: {logprob, rank, decoded_token}}, …]`: per
prompt position the prompt token's logprob (and, with `prompt_logprobs: k`, the k most likely).
vLLM computes prompt logprobs from the raw logits whatever `--logprobs-mode` (0.32: "prompt tokens
skip sampling processors, so processed_* and raw_* yield the same scores") and whatever the
request's temperature: they are at temperature 1. So at T = 1 the request asks `prompt_logprobs: 0`
(the prompt token only); at T ≠ 1 it asks `prompt_logprobs: -1` (the whole vocabulary, which the
server allows only when started with `--max-logprobs -1`) and the scorer renormalises
(`axrl.inference.scoring.at_temperature`). Under `--logprobs-mode raw_logits|processed_logits`
the values are logits, not logprobs: the T = 1 route would be wrong, so such a server is asked for
the whole distribution at every temperature (any per-row shift cancels in the renormalisation).
`max_tokens: 1`: vLLM generates at least one token; it is ignored.
"""

from __future__ import annotations

from typing import Any, Sequence

import httpx
import numpy as np

from axrl.inference.scoring.base import ScoringError, at_temperature, check_sequences, request_groups

__all__ = ["VLLMScorer"]

FULL_VOCAB_BUDGET = 4_000_000  # numbers per reply on the whole-vocabulary route
# vLLM has no logprob_start_len: one stream's prompt logprobs come whole. Past this many numbers
# (~1 GB of JSON) a stream is refused on the whole-vocabulary route instead of exhausting memory.
MAX_STREAM_NUMBERS = 50_000_000


class VLLMScorer:
    """`axrl.inference.scoring.Scorer` over one vLLM OpenAI-compatible server at `url`.

    vocab_size: the model's number of logits; logits_mode: the server was started with
    `--logprobs-mode raw_logits` or `processed_logits` (its prompt "logprobs" are logits)."""

    name = "vllm"

    def __init__(self, url: str, *, vocab_size: int, logits_mode: bool = False, max_batch_tokens: int = 16384,
                 timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.vocab_size, self.logits_mode, self.max_batch_tokens = vocab_size, logits_mode, max_batch_tokens
        self.client = httpx.Client(timeout=timeout_s)
        self.model = self._served_model()

    def _served_model(self) -> str:
        try:
            r = self.client.get(self.url + "/v1/models")
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ScoringError(f"{self.url}/v1/models: no served model ({type(e).__name__}: {e}); is a vLLM "
                               "server running there?") from None

    def score(self, sequences: Sequence[Sequence[int]], temperature: float) -> list[np.ndarray]:
        """See `axrl.inference.scoring.Scorer.score`."""
        check_sequences(sequences, temperature, self.vocab_size)
        full = self.logits_mode or float(temperature) != 1.0
        longest = max((len(s) for s in sequences), default=0)
        if full and longest * self.vocab_size > MAX_STREAM_NUMBERS:
            raise ScoringError(f"{self.url}: at temperature {temperature:g} a {longest}-token stream needs vLLM's "
                               f"whole prompt distribution ({longest} × {self.vocab_size} numbers in one reply: vLLM "
                               "applies no temperature to prompt logprobs and cannot report part of a prompt); "
                               "score it on SGLang, which the scorer asks in windows, or at temperature 1")
        budget = max(1, FULL_VOCAB_BUDGET // self.vocab_size) if full else self.max_batch_tokens
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(sequences)
        for group in request_groups([len(s) for s in sequences], budget):
            choices = self._complete([list(map(int, sequences[i])) for i in group], full)
            for i, choice in zip(group, choices):
                out[i] = self._logprobs(sequences[i], choice, temperature, full)
        return out

    def _complete(self, prompts: list[list[int]], full: bool) -> list[dict[str, Any]]:
        body = {"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": -1 if full else 0, "return_token_ids": True}
        r = self._post(body)
        if r.status_code == 404:
            # A server restarted on new weights (AxRL's CPU weight route) serves them under the new
            # directory's name: ask it again which model it serves.
            body["model"] = self.model = self._served_model()
            r = self._post(body)
        if r.status_code != 200:
            hint = (" (the whole distribution is needed at T != 1: start vLLM with --max-logprobs -1)"
                    if full and "max allowed" in r.text else "")
            raise ScoringError(f"{self.url}/v1/completions answered {r.status_code} to a prompt-logprob request"
                               f"{hint}: {r.text[:500]}")
        choices = sorted(r.json().get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise ScoringError(f"{self.url}/v1/completions: {len(choices)} choices for {len(prompts)} prompts")
        return choices

    def _post(self, body: dict[str, Any]) -> httpx.Response:
        try:
            return self.client.post(self.url + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise ScoringError(f"{self.url}/v1/completions: {type(e).__name__}: {e}") from None

    def _logprobs(self, seq: Sequence[int], choice: dict[str, Any], temperature: float, full: bool) -> np.ndarray:
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(seq):
            raise ScoringError(f"{self.url}/v1/completions: prompt_logprobs has "
                               f"{len(entries) if isinstance(entries, list) else 'no'} entries for a "
                               f"{len(seq)}-token prompt")
        sent = choice.get("prompt_token_ids")
        if sent is not None and [int(t) for t in sent] != [int(t) for t in seq]:
            raise ScoringError(f"{self.url}/v1/completions: the server scored other token ids than it was sent")
        lp = np.full(len(seq), np.nan, dtype=np.float32)
        if len(seq) < 2:
            return lp
        if not full:
            lp[1:] = [float(e[str(int(t))]["logprob"]) for e, t in zip(entries[1:], seq[1:])]
            return lp
        rows = np.full((len(seq) - 1, self.vocab_size), -np.inf, dtype=np.float64)
        for r, pos in enumerate(entries[1:]):
            ids = np.fromiter((int(k) for k in pos), dtype=np.int64, count=len(pos))
            rows[r, ids] = [float(v["logprob"]) for v in pos.values()]
        if np.isinf(rows).any():
            raise ScoringError(f"{self.url}: a position's prompt_logprobs miss part of the vocabulary "
                               f"({self.vocab_size} ids expected)")
        lp[1:] = at_temperature(rows, np.asarray(seq[1:]), temperature)
        return lp

    def close(self) -> None:
        """Close the HTTP connections (the server keeps running)."""
        self.client.close()
