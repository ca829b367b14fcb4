"""The stop-string rule of the OpenAI endpoints.

Engines stop on token ids only, so a stop string is applied to the decoded reply: the reply
ends right before the first stop string *completed* (the shortest prefix of the output whose
text holds one), and only the ids before the token that completed it are kept — the same cut
whether the engine was stopped there, aborted a few tokens later or ran to its end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from axrl.inference.openai.errors import bad

# What a multi-byte character decodes to while its other bytes are still to be generated.
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class StopCut:
    """Where a reply is cut: `keep` output ids, the reply `text`, the stop string `matched`."""

    keep: int
    text: str
    matched: str


def parse_stops(body: dict[str, Any], limit: int | None = None) -> list[str]:
    """The request's `stop` as a list: a non-empty string or a list of them (at most `limit`)."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (not isinstance(stops, list) or limit is not None and len(stops) > limit
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad("stop", f"must be a non-empty string or a list of {'them' if limit is None else f'up to {limit}'}, "
                  f"got {stop!r}")
    return stops


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(position, stop string) of the earliest stop string in `text`; None if it holds none."""
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None


def cut_at_stop(ids: list[int], text_of: Callable[[list[int]], str], stops: list[str]) -> StopCut | None:
    """The cut of output `ids` (rendered by `text_of`) at its first completed stop string; None
    when the reply holds none."""
    if not stops or first_stop(text_of(ids), stops) is None:
        return None
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop (monotone in the prefix length)
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(text_of(ids[:mid]), stops) is None:
            lo = mid + 1
        else:
            hi = mid
    text = text_of(ids[:lo])
    pos, matched = first_stop(text, stops)  # type: ignore[misc]
    return StopCut(keep=lo - 1, text=text[:pos], matched=matched)


def held_back(text: str, stops: list[str], hold_from: str | None = None) -> int:
    """How many characters at the end of a running reply may not be streamed yet: a possible start
    of a stop string or of `hold_from` (everything from `hold_from` on, once it is there: a tool
    call is sent whole), or a character whose bytes are still arriving."""
    markers = list(stops)
    if hold_from is not None:
        if hold_from in text:
            return len(text) - text.index(hold_from)
        markers.append(hold_from)
    hold = max((i for m in markers for i in range(1, len(m)) if text.endswith(m[:i])), default=0)
    if text.endswith(REPLACEMENT):
        hold = max(hold, len(text) - len(text.rstrip(REPLACEMENT)))
    return hold


def sendable(text: str, stops: list[str], hold_from: str | None = None) -> str:
    """What of a running reply's `text` may be streamed now: the text before its first stop string
    (the reply ends there), less what `held_back` keeps; with `hold_from` (a tool call's opening
    tag) also less trailing whitespace, which the reply's content loses if a tool call follows."""
    hit = first_stop(text, stops)
    if hit is not None:
        text = text[:hit[0]]
    text = text[:len(text) - held_back(text, stops, hold_from)]
    return text.rstrip() if hold_from is not None else text
