"""Context variants: other token streams an engine may have been given than the one the trainer
trains on, each a same-length rewrite of a later turn's request (the stream so far), so the
engine's routing rows and logprobs still line up with the recorded tokens.

`doctor` re-runs a step's rollout with the recorded context (the trainer's own tokens: the clean
replay) and with each variant, and reports which reproduces the recorded rollout bitwise
(hypotheses.py). tests/fault_zoo.py injects the same rewrites through the same engine hook, the way
a template re-rendering or a re-tokenising proxy would change what the engine sees.

| variant | what the engine was given at every turn after the first |
|---|---|
| generation_prompt_rerendered | the last token of the context (the end of the generation prompt, where a re-rendered template differs) replaced by the stream's first token |
| previous_reply_close_rerendered | the token before that (the previous turn's close / observation end) replaced by the stream's first token |
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

Rewrite = Callable[[list[int]], list[int]]


def _replace(back: int) -> Rewrite:
    """Replace the token `back` places from the end by the stream's first token."""
    def rewrite(ids: list[int]) -> list[int]:
        if len(ids) <= back:
            return ids
        out = list(ids)
        out[-back] = ids[0]
        return out
    return rewrite


VARIANTS: dict[str, Rewrite] = {
    "generation_prompt_rerendered": _replace(1),
    "previous_reply_close_rerendered": _replace(2),
}


@contextlib.contextmanager
def engine_given(variant: str) -> Iterator[None]:
    """While the block runs, the embedded engine is given `variant`'s rewrite of every later turn's
    request (a request that continues a stream: its routing rows start after earlier ones, or its
    stream was seen before); the caller's trajectory, hence the trace, keeps the original tokens."""
    from axrl.inference.embedded.engine import EmbeddedEngine

    if variant not in VARIANTS:
        raise ValueError(f"context variant {variant!r}: known ones are {sorted(VARIANTS)}")
    rewrite, original = VARIANTS[variant], EmbeddedEngine._enqueue
    seen: set[str] = set()

    def _enqueue(self, requests):
        out = []
        for r in requests:
            later = r.routed_experts_start_len > 0 or (r.sticky_key is not None and r.sticky_key in seen)
            if r.sticky_key is not None:
                seen.add(r.sticky_key)
            out.append(dataclasses.replace(r, input_ids=rewrite(list(r.input_ids))) if later else r)
        return original(self, out)
    EmbeddedEngine._enqueue = _enqueue  # type: ignore[method-assign]
    try:
        yield
    finally:
        EmbeddedEngine._enqueue = original  # type: ignore[method-assign]
