"""A served distillation teacher (`distill.url`): an SGLang server or `axrl serve` scores the
student's sampled tokens, teacher-forced, through prefill-only `/generate` requests batched over
the step's samples (`axrl.inference.scoring.sglang.SGLangScorer`), at the rollout temperature:
log_softmax(logits / T) at each token, T the batch's temperature — the quantity a local teacher
(axrl/runtime/teacher.py) computes. SGLang's prompt logprobs are at temperature 1, so at T ≠ 1 the
scorer renormalises the whole distribution of each position (slime #2085: scoring the teacher at
T = 1 against a student sampled at T ≠ 1 biases the KL).

The teacher must speak the student's tokenizer: the server's `GET /model_info` names its tokenizer
directory (`tokenizer_path`), which is loaded and compared with the student's (`tokenizer_difference`);
a server whose tokenizer cannot be read from here, or differs, is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from axrl.core.errors import ConfigError
from axrl.inference.scoring import ScoringError
from axrl.inference.scoring.sglang import SGLangScorer, server_info
from axrl.tokenizer import Tokenizer, load_tokenizer
from axrl.train.protocol import PackedBatch

__all__ = ["ServedTeacher", "connect_teacher"]


class ServedTeacher:
    """Scores packed batches with a teacher behind an SGLang-compatible URL (see the module docstring)."""

    def __init__(self, url: str, scorer: SGLangScorer) -> None:
        self.url, self.scorer = url, scorer

    def score(self, batch: PackedBatch) -> torch.Tensor:
        """float32 [T]: the teacher's log_softmax(logits / batch.temperature) at each token given its
        sample's earlier tokens (position 0 of each sample: 0, as the local teacher's)."""
        ids = batch.input_ids.cpu().numpy()
        off = batch.offsets.cpu().numpy()
        seqs = [ids[int(off[i]):int(off[i + 1])].tolist() for i in range(len(off) - 1)]
        try:
            scores = self.scorer.score(seqs, batch.temperature)
        except ScoringError as e:
            raise RuntimeError(f"distill.url: the teacher failed to score the step's samples: {e}") from None
        lp = np.nan_to_num(np.concatenate(scores), nan=0.0)  # position 0 of each sample has no prediction
        return torch.from_numpy(lp.astype(np.float32)).to(batch.input_ids.device)

    def close(self) -> None:
        """Close the connections (the server is the user's)."""
        self.scorer.close()


def _teacher_tokenizer(url: str, info: dict) -> tuple[Tokenizer, int | None]:
    """The served model's tokenizer (from the directory /model_info names) and its logit count."""
    path = info.get("tokenizer_path") or info.get("model_path")
    if not path or not Path(path).is_dir():
        raise ConfigError(f"distill.url {url}: the server's tokenizer directory {path!r} (GET /model_info "
                          "tokenizer_path) cannot be read from here, so the teacher's tokenizer cannot be checked "
                          "against the student's; serve the teacher from a directory this machine can read too")
    try:
        tokenizer = load_tokenizer(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"distill.url {url}: the server's tokenizer {path}: {e}") from None
    vocab = info.get("vocab_size")
    config = Path(info.get("model_path") or path) / "config.json"
    if not isinstance(vocab, int) and config.is_file():
        vocab = json.loads(config.read_text()).get("vocab_size")
    return tokenizer, vocab if isinstance(vocab, int) else None


def connect_teacher(url: str, student: Tokenizer,
                    tokenizer_difference: Callable[[Tokenizer, Tokenizer], str | None]) -> ServedTeacher:
    """The served teacher at `url`, after checking its tokenizer equals the student's
    (`tokenizer_difference`: axrl.runtime.teacher's, passed in so that neither module imports the other)."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"distill.url {url!r}: an http(s) URL of an SGLang server or `axrl serve`, "
                          "e.g. http://127.0.0.1:30000")
    try:
        info = server_info(url)
    except ScoringError as e:
        raise ConfigError(f"distill.url: {e}") from None
    tokenizer, vocab = _teacher_tokenizer(url, info)
    diff = tokenizer_difference(student, tokenizer)
    if diff is not None:
        raise ConfigError(f"distill.url {url}: the served teacher's tokenizer ({info.get('tokenizer_path')}) differs "
                          f"from the student's: {diff}; the teacher scores the student's token ids, so both need "
                          "the same tokenizer")
    return ServedTeacher(url, SGLangScorer(url, vocab_size=vocab or tokenizer.vocab_size))
