"""How a chat's model calls become one token stream: the pieces both builders of trajectories use.

Two places turn model calls into a `Trajectory`: the white-box agent loop
(`axrl.rollout.agent_loop`), which drives the conversation itself, and the black-box proxy session
(`axrl.agents.proxy.session`), which stitches the calls an agent made. Both keep the engine's own
output ids, close a reply the way the chat template does, split a reply at weight-version changes
and give every token one routing row; these functions are that shared part.
"""

from __future__ import annotations

import difflib
from typing import Any, Protocol, Sequence

import numpy as np

from axrl.core.trajectory import Trajectory


class ChatRenderer(Protocol):
    """What the helpers need of a tokenizer (`axrl.tokenizer.Tokenizer` is one)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def encode(self, text: str) -> list[int]: ...


def assistant_close_ids(tokenizer: ChatRenderer) -> list[int]:
    """Ids the chat template puts after an assistant message's text: its end-of-turn token (which
    the model generates) followed by glue the model never generates (ChatML: ``<|im_end|>`` and a
    newline)."""
    marker = "\x00"  # a character no template emits on its own
    # After a user turn: templates that check role alternation (Mistral) refuse a lone reply.
    text = str(tokenizer.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}],
                                             tokenize=False))
    return tokenizer.encode(text[text.rindex(marker) + 1:])


def reply_glue(close_ids: Sequence[int], closed: bool) -> list[int]:
    """Ids that follow a model reply in the stream, before the next message: the rest of
    ``close_ids`` when the model ended its own turn (``closed``: it generated ``close_ids[0]``),
    all of them when the reply was cut off (the end-of-turn token is then added, masked)."""
    return list(close_ids[1:] if closed else close_ids)


def token_versions(reported: Sequence[int], final: int, n: int) -> list[int]:
    """The weight version of each of a reply's ``n`` output tokens: the engine's per-token
    versions, or ``final`` (the version the request finished under) for every token when the
    engine reports no per-token versions."""
    versions = list(reported)
    return versions if len(versions) == n else [final] * n


def append_generated(traj: Trajectory, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                     *, turn: int) -> None:
    """Append a model reply as generated tokens, one segment per run of equal weight versions
    (a reply spans several versions when the weights were updated while it was generated)."""
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or versions[end] != versions[start]:
            traj.append(ids[start:end], generated=True, turn=turn, version=int(versions[start]),
                        logprobs=logprobs[start:end])
            start = end


def routing_rows(chunks: Sequence[np.ndarray], num_tokens: int) -> np.ndarray:
    """One routing row per token of a ``num_tokens`` stream from the engine's row chunks, in stream
    order. Tokens that never went through the model (the last one, and anything appended after the
    last request) get zero rows."""
    rows = np.concatenate(chunks)
    pad = np.zeros((num_tokens - rows.shape[0], *rows.shape[1:]), dtype=rows.dtype)
    return np.concatenate([rows, pad])


def drift_tokens(stream: Sequence[int], rendered: Sequence[int]) -> int:
    """How many tokens of an episode's ``stream`` the chat template would not render the same
    for its finished conversation (``rendered``): 0 when the stream is a prefix of the rendering
    (the rendering may add the close after the last reply). Re-rendered history (reasoning
    stripped from earlier turns, trimmed replies) counts the stream tokens it leaves unmatched."""
    if list(rendered[:len(stream)]) == list(stream):
        return 0
    matcher = difflib.SequenceMatcher(None, list(stream), list(rendered), autojunk=False)
    return len(stream) - sum(block.size for block in matcher.get_matching_blocks())
