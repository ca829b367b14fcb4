"""The teacher-forced prompt scorer of a rollout server, by engine: SGLang (and `axrl serve`)
score by a prefill-only `/generate`, vLLM by `/v1/completions` with `prompt_logprobs`.

Every vLLM server AxRL talks to runs with `--logprobs-mode processed_logprobs` (the launcher's flag,
and what the vLLM client requires of servers given by URL), so its prompt "logprobs" are logprobs,
never logits: `VLLMScorer(logits_mode=False)`.

It sits above `sglang/` and `vllm/` (and `remote/`, which both of them build on).
"""

from __future__ import annotations

from axrl.inference.scoring.base import Scorer

__all__ = ["server_scorer"]


def server_scorer(engine: str, url: str, vocab_size: int) -> Scorer:
    """The scorer of `engine` ("sglang" or "vllm") over the server at `url`."""
    if engine == "sglang":
        from axrl.inference.scoring.sglang import SGLangScorer

        return SGLangScorer(url, vocab_size=vocab_size)
    if engine == "vllm":
        from axrl.inference.scoring.vllm import VLLMScorer

        return VLLMScorer(url, vocab_size=vocab_size, logits_mode=False)
    raise ValueError(f"no server scorer for engine {engine!r} (sglang or vllm)")
