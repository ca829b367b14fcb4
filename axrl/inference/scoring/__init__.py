"""Teacher-forced scoring: each token's logprob given the tokens before it, by any engine.

The protocol and the in-process scorer are in `base.py`; `sglang.py` (SGLang or `axrl serve`,
prefill-only `/generate`) and `vllm.py` (`/v1/completions` with `prompt_logprobs`) score on a
server; `by_engine.py` picks the server scorer of a rollout engine. `axrl serve`'s side of the
prefill-only route is `axrl/inference/serve/score_route.py`."""

from axrl.inference.scoring.base import (EmbeddedScorer, Scorer, ScoringError, at_temperature, check_sequences,
                                         request_groups)

__all__ = ["EmbeddedScorer", "Scorer", "ScoringError", "at_temperature", "request_groups", "check_sequences"]
