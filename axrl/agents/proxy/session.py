"""One black-box agent session: every model call it made, stitched into token-level samples.

The proxy never re-tokenises what the model generated. Each call becomes a *turn*: the prompt ids
the engine was given and the ids, logprobs, weight versions and routing it generated.

A chat call *extends* an earlier turn when its messages extend that turn's conversation — the
turn's request messages followed by the reply the proxy returned, compared as messages (role,
text, tool calls by name and parsed arguments; see :func:`normalize`), not as rendered text. Its
prompt is then that turn's token stream (prompt + generated ids), the glue the template puts after
a reply, and the rendering of the appended messages only (`axrl.agents.proxy.stitch`) — whatever
the template does to the earlier messages when it renders them again (Qwen3 drops the reasoning of
earlier assistant turns). Where the stitched prompt differs from the template's rendering of the
same conversation is the prompt's *drift*: recorded (token spans, their turns, a count) and never
trained away — the generated ids are what the model conditioned on and what is trained.

The turns form a tree. A *fork* — a call that does not extend the session's newest conversation
but an earlier point of it, or nothing — happens only for a reason, recorded as its cause
(`FORK_CAUSES`): the agent edited its history (rewrote, dropped or summarised messages, or sent a
call again), changed its tools (the prompt's tool block changes: a new root, rendered whole), asked
for ``n > 1`` choices, or the template renders the appended messages differently depending on
the earlier ones (they cannot be stitched: a new root). Every root-to-leaf path becomes one sample;
a turn shared by several paths is trained once, on the first path that holds it (loss mask 0 on
later copies). The primary path is the one ending in the session's last turn; the others are
forks of it.

Turn numbering in a sample (`Trajectory.turn`): the prompt is turn 0, the i-th model reply on the
path is turn i, and the tokens the agent added after reply i (tool results, user messages, glue)
belong to turn i — the layout of the white-box agent loop.
"""

from __future__ import annotations

import bisect
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from axrl.agents.env import Message
from axrl.agents.proxy.stitch import Drift, appended_text, drift_spans, render
from axrl.core.token_stream import append_generated, assistant_close_ids, reply_glue, routing_rows, token_versions
from axrl.core.trajectory import Trajectory
from axrl.inference.protocol import GenerateResult
from axrl.tokenizer import Tokenizer

# Fork paths of sample s get ids s + k · FORK_ID_STRIDE (k ≥ 1): unique while sample ids stay
# below 2^32, and the original sample id is s % FORK_ID_STRIDE.
FORK_ID_STRIDE = 1 << 32

# Why a call forked (`Turn.fork_cause`, `Trajectory.fork_cause`, /samples/fork_cause).
HISTORY_EDITED = "history edited"      # the messages extend an earlier point of the session, or none
TOOLS_CHANGED = "tools changed"        # they extend a conversation held under other tools
N_CHOICES = "n > 1"                    # a further choice of the same call
TEMPLATE_UNSTABLE = "template not prefix-stable"  # the appended messages cannot be rendered alone
FORK_CAUSES = (HISTORY_EDITED, TOOLS_CHANGED, N_CHOICES, TEMPLATE_UNSTABLE)
REASONING_END = "</think>"  # what ends a reasoning block in a reply's text (Qwen3, DeepSeek-R1)


class SessionError(ValueError):
    """A call the session cannot serve (the message says which field); the session stays open."""


def normalize(message: Message) -> dict[str, Any]:
    """What makes two chat messages the same turn: role, stripped text, tool calls by name and
    parsed arguments (SDKs re-serialise argument JSON and may send content None or "")."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append({"name": fn.get("name"), "arguments": args})
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: the text parts are the message
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": message.get("role"), "content": (content or "").strip(), "tool_calls": calls,
            "name": message.get("name")}


def same_reply(sent: dict[str, Any], reply: dict[str, Any]) -> bool:
    """Whether the normalised assistant message an agent sent back is the ``reply`` the proxy
    returned: equal, or equal once the reasoning (``<think>…</think>``) is left out of both —
    agents and SDKs that drop the reasoning from the history they keep still continue the turn
    (the stream keeps the generated reasoning; the difference is drift)."""
    return sent == reply or _without_reasoning(sent) == _without_reasoning(reply)


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A normalised message with the text up to its last ``</think>`` left out."""
    return {**message, "content": message["content"].rsplit(REASONING_END, 1)[-1].strip()}


@dataclass
class Turn:
    """One model call's choice: what the engine got and what it generated."""

    index: int                       # 1-based, in the order the session made them
    parent: int | None               # the turn it continues (None: a root)
    messages: list[dict[str, Any]]   # normalised request messages (empty for /v1/completions)
    tools_key: str                   # the tools of the request, as sorted JSON
    prompt_ids: list[int]
    start_len: int                   # routing rows already held by the ancestors
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routing: np.ndarray | None
    finish: str                      # "stop" | "length" | "abort"
    closed: bool                     # the model ended its own turn (last id is the turn end)
    reply: dict[str, Any] | None = None  # normalised assistant message returned (chat)
    text: str = ""                   # the text returned (completions: prompt text + reply)
    rendered: str = ""               # the template's text for the call ("": the prompt is that text)
    drift: Drift | None = None       # where the prompt differs from `rendered` (Session.drift: on use)
    drift_turns: tuple[int, ...] = ()  # the turn (in the sample) of each drift span
    fork_cause: str = ""             # why this turn is a fork (FORK_CAUSES); "" when it is none
    reward: float = 0.0              # per-turn reward (POST /sessions/{id}/reward with "turn")
    children: list[int] = field(default_factory=list)

    @property
    def stream(self) -> list[int]:
        return list(self.prompt_ids) + list(self.output_ids)

    @property
    def drift_tokens(self) -> int:
        return self.drift.tokens if self.drift is not None else 0


@dataclass
class Prepared:
    """A call's prompt: the ids to send and where it attaches in the tree."""

    prompt_ids: list[int]
    parent: int | None
    start_len: int
    messages: list[dict[str, Any]]
    tools_key: str
    text: str = ""
    cause: str = ""       # the fork cause when the call is attached other than as a continuation
    rendered: str = ""    # the template's text for the call when the prompt is stitched
    choices: int = 0      # choices of the call recorded so far (n > 1: the later ones are forks)


@dataclass
class SessionEvent:
    """A fork or a drift, for `GET /sessions/{id}` and the logs."""

    kind: str            # "fork" | "drift"
    turn: int            # the new turn (a fork, or the turn whose prompt drifted)
    detail: str
    cause: str = ""      # a fork's cause (FORK_CAUSES)


def _drift_detail(turn: Turn) -> str:
    """A drift event's text: the spans of the prompt that differ, with their turns."""
    assert turn.drift is not None
    spans = ", ".join(f"{a}-{b} (turn {t})" for (a, b), t in zip(turn.drift.spans, turn.drift_turns))
    return (f"turn {turn.index}: its prompt differs from the template's rendering of its {len(turn.messages)} "
            f"messages in {turn.drift.tokens} token(s), at tokens {spans}; the stream keeps the generated ids")


def _span_turn(starts: list[int], start: int, end: int) -> int:
    """The turn holding most tokens of [start, end) when reply i starts at ``starts[i - 1]`` (a
    token diff may shift a span by a token across a turn boundary: "\n<think>…</think>" for
    "<think>…</think>\n")."""
    turns = [bisect.bisect_right(starts, i) for i in range(start, end)]
    return max(set(turns), key=lambda t: (turns.count(t), -t))


def _path_fork_cause(path: list[Turn], primary: list[Turn]) -> str:
    """Why ``path`` is a path of its own: the cause of its deepest forked turn (where it last
    branched off); for the path that was there first and others branched from, the cause of the
    later-made of the two turns where it parts from the primary path."""
    own = [t.fork_cause for t in path if t.fork_cause]
    if own:
        return own[-1]
    for mine, theirs in zip(path, primary):
        if mine.index != theirs.index:
            return max(mine, theirs, key=lambda t: t.index).fork_cause or HISTORY_EDITED
    return HISTORY_EDITED  # unreachable: a leaf is never on another path


class Session:
    """State of one session; thread-safe (HTTP handlers and the rollout thread both touch it)."""

    def __init__(self, session_id: str, tokenizer: Tokenizer, *, max_context_len: int,
                 submit: Callable[..., Any], meta: dict[str, Any] | None = None) -> None:
        self.id, self.tokenizer, self.max_context_len = session_id, tokenizer, max_context_len
        self.api_key = "sk-axrl-" + secrets.token_urlsafe(24)
        self.submit = submit            # GenerateRequest -> concurrent.futures.Future[GenerateResult]
        self.meta = dict(meta or {})
        self.turns: dict[int, Turn] = {}
        self.events: list[SessionEvent] = []
        self.final_reward: float | None = None
        self.state = "open"             # "open" | "ended" | "failed"
        self.error = ""
        self.calls = 0
        self.last_activity = time.monotonic()
        self.ended = threading.Event()
        self._lock = threading.Lock()
        self._close_ids = assistant_close_ids(tokenizer)
        self._anchors = frozenset(tokenizer.special_token_ids)  # message boundaries, for the drift diff

    # -- lifecycle ---------------------------------------------------------------------------------
    def end(self, *, failed: bool = False, error: str = "") -> None:
        with self._lock:
            if self.state == "open":
                self.state, self.error = ("failed", error) if failed else ("ended", "")
        self.ended.set()

    def set_reward(self, reward: float, turn: int | None = None) -> None:
        with self._lock:
            if turn is None:
                self.final_reward = float(reward)
            elif turn not in self.turns:
                raise SessionError(f"turn: no turn {turn} in session {self.id} (it has {len(self.turns)})")
            else:
                self.turns[turn].reward = float(reward)

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    # -- stitching ---------------------------------------------------------------------------------
    def prepare_chat(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> Prepared:
        """The prompt ids of a chat call: stitched onto the turn whose conversation its messages
        extend, else a new root with the fork cause (see the module doc)."""
        tok = self.tokenizer
        norm = [normalize(m) for m in messages]
        tools_key = json.dumps(tools or [], sort_keys=True)
        try:
            full = render(tok, messages, tools, generation=True)
        except Exception as e:  # noqa: BLE001 — a template error is the request's fault
            raise SessionError(f"messages: cannot render the chat template: {e}") from None
        with self._lock:
            parent, cause = self._extended_turn(norm, tools_key)
        if parent is None:
            return Prepared(tok.encode(full), None, 0, norm, tools_key, cause=cause)
        appended = appended_text(tok, messages, len(parent.messages) + 1, tools, full)
        if appended is None:
            return Prepared(tok.encode(full), None, 0, norm, tools_key, cause=TEMPLATE_UNSTABLE)
        # After the generated ids: the rest of the template's turn close (the whole close, masked,
        # when the reply was cut before the model ended its turn), then the new messages.
        prompt = parent.stream + reply_glue(self._close_ids, parent.closed) + tok.encode(appended)
        return Prepared(prompt, parent.index, len(parent.stream) - 1, norm, tools_key, cause=cause, rendered=full)

    def prepare_completion(self, prompt: str | list[int]) -> Prepared:
        """The prompt ids of a /v1/completions call: token ids as given; text stitched onto the
        deepest turn whose prompt text + reply it extends (the rest encoded alone)."""
        if isinstance(prompt, list):
            with self._lock:
                best = max((t for t in self.turns.values() if t.output_ids and prompt[:len(t.stream)] == t.stream),
                           key=lambda t: (len(t.stream), t.index), default=None)
            return Prepared(list(prompt), best.index if best else None, len(best.stream) - 1 if best else 0, [], "")
        with self._lock:
            best = max((t for t in self.turns.values() if not t.messages and t.text and prompt.startswith(t.text)),
                       key=lambda t: (len(t.text), t.index), default=None)
            if best is not None:
                rest = self.tokenizer.encode(prompt[len(best.text):])
                return Prepared(best.stream + rest, best.index, len(best.stream) - 1, [], "", text=prompt)
        return Prepared(self.tokenizer.encode(prompt), None, 0, [], "", text=prompt)

    def _extended_turn(self, norm: list[dict[str, Any]], tools_key: str) -> tuple[Turn | None, str]:
        """The deepest turn whose conversation ``norm`` extends under the same tools, and the fork
        cause if ``norm`` extends a deeper one under other tools (or nothing at all)."""
        extended = [t for t in self.turns.values()
                    if t.reply is not None and len(norm) > len(t.messages)
                    and same_reply(norm[len(t.messages)], t.reply) and norm[:len(t.messages)] == t.messages]
        deepest = max(extended, key=lambda t: (len(t.messages), t.index), default=None)
        same = max((t for t in extended if t.tools_key == tools_key),
                   key=lambda t: (len(t.messages), t.index), default=None)
        if deepest is not None and (same is None or len(deepest.messages) > len(same.messages)):
            return same, TOOLS_CHANGED
        return same, ("" if same is not None or not self.turns else HISTORY_EDITED)

    def _chain(self, turn: Turn | None) -> list[Turn]:
        """The turns from the root to ``turn`` (empty for None)."""
        chain: list[Turn] = []
        while turn is not None:
            chain.append(turn)
            turn = self.turns[turn.parent] if turn.parent is not None else None
        return chain[::-1]

    # -- recording ---------------------------------------------------------------------------------
    def record(self, prep: Prepared, result: GenerateResult, *, reply: Message | None, text: str,
               output_ids: list[int] | None = None) -> Turn:
        """Keep one choice of a call (``output_ids``: the ids kept after a stop-string cut)."""
        ids = list(result.output_ids if output_ids is None else output_ids)
        n = len(ids)
        versions = token_versions(result.output_weight_versions, result.weight_version, len(result.output_ids))
        routing = result.routed_experts
        if routing is not None:  # rows of the prompt and of the kept outputs but the last
            routing = np.asarray(routing[: len(prep.prompt_ids) + n - 1 - prep.start_len], np.int32)
        eos = set(self.tokenizer.stop_token_ids)
        finish = result.finish_type if result.finish_type in ("stop", "length") else "abort"
        with self._lock:
            index = len(self.turns) + 1
            turn = Turn(index, prep.parent, prep.messages, prep.tools_key, list(prep.prompt_ids), prep.start_len,
                        ids, list(result.output_logprobs)[:n], versions[:n], routing, finish,
                        closed=bool(ids) and ids[-1] in eos,
                        reply=normalize(reply) if reply is not None else None,
                        text=(prep.text + text) if not prep.messages else text, rendered=prep.rendered)
            siblings = self.turns[prep.parent].children if prep.parent is not None else self.roots()
            if siblings:
                turn.fork_cause = N_CHOICES if prep.choices else (prep.cause or HISTORY_EDITED)
                where = (f"continues turn {prep.parent}, which already has {len(siblings)} continuation(s)"
                         if prep.parent is not None else f"starts a new root beside {len(siblings)} other(s)")
                self.events.append(SessionEvent("fork", index, f"turn {index} {where}: {turn.fork_cause}",
                                                turn.fork_cause))
            prep.choices += 1
            if prep.parent is not None:
                self.turns[prep.parent].children.append(index)
            self.turns[index] = turn
            self.calls += 1
        return turn

    def drift(self, turn: Turn) -> Drift:
        """Where ``turn``'s prompt differs from the template's rendering of its conversation, with
        the turn of each span; a drift event the first time it is found. Computed on first use
        and kept (a sample's drift is its last prompt's, so most turns never need it, and the
        agent's calls do not wait for it)."""
        with self._lock:
            if turn.drift is not None:
                return turn.drift
            chain = self._chain(turn)
        drift = (drift_spans(turn.prompt_ids, self.tokenizer.encode(turn.rendered), anchors=self._anchors)
                 if turn.rendered else Drift())
        starts = [len(t.prompt_ids) for t in chain[:-1]]  # where reply i of the path starts
        turns = tuple(_span_turn(starts, a, b) for a, b in drift.spans)
        with self._lock:
            if turn.drift is None:
                turn.drift, turn.drift_turns = drift, turns
                if drift:
                    self.events.append(SessionEvent("drift", turn.index, _drift_detail(turn)))
        return turn.drift

    def roots(self) -> list[int]:
        return [t.index for t in self.turns.values() if t.parent is None]

    @property
    def forks(self) -> int:
        return sum(e.kind == "fork" for e in self.events)

    # -- samples -----------------------------------------------------------------------------------
    def trajectories(self, *, sample_id: int, group_id: int, prompt_id: str,
                     reward: Callable[[list[Turn]], float] | None = None) -> list[Trajectory]:
        """One trajectory per root-to-leaf path, the primary (ending in the last turn) first.

        ``reward(path)`` scores a path (a verifier); by default a path's reward is the session's
        final reward plus the per-turn rewards of its turns. Shared turns are trained on the
        first path that holds them only.
        """
        with self._lock:
            turns = dict(self.turns)
        leaves = sorted((t for t in turns.values() if not t.children), key=lambda t: -t.index)
        trained: set[int] = set()
        out: list[Trajectory] = []
        primary: list[Turn] = []
        for k, leaf in enumerate(leaves):
            path = [leaf]
            while path[-1].parent is not None:
                path.append(turns[path[-1].parent])
            path.reverse()
            primary = primary or path
            traj = self._path_sample(path, trained, sample_id=sample_id + k * FORK_ID_STRIDE, group_id=group_id,
                                     prompt_id=prompt_id)
            traj.fork_of = -1 if k == 0 else sample_id
            traj.fork_cause = "" if k == 0 else _path_fork_cause(path, primary)
            traj.turn_rewards = [t.reward for t in path]   # per turn, for algo.credit: turn
            if reward is not None:
                traj.reward = float(reward(path))
            else:
                traj.reward = (self.final_reward or 0.0) + sum(t.reward for t in path)
            out.append(traj)
        return out

    def _path_sample(self, path: list[Turn], trained: set[int], *, sample_id: int, group_id: int,
                     prompt_id: str) -> Trajectory:
        """The sample of one root-to-leaf path; turns already in ``trained`` are masked (and the
        path's turns are added to it). Its drift is its last prompt's: that prompt holds the
        whole sample but the last reply."""
        traj = Trajectory(sample_id=sample_id, group_id=group_id, prompt_id=prompt_id)
        held = 0
        rows: list[np.ndarray] = []
        for depth, t in enumerate(path, start=1):
            traj.append(t.prompt_ids[held:], generated=False, turn=depth - 1)
            if t.index in trained or not t.output_ids:
                traj.append(t.output_ids, generated=False, turn=depth)
            else:
                trained.add(t.index)
                append_generated(traj, t.output_ids, t.logprobs, t.versions, turn=depth)
            held = len(t.stream)
            if t.routing is not None:
                rows.append(t.routing)
        leaf = path[-1]
        traj.prompt_len = len(path[0].prompt_ids)
        traj.num_turns = len(path)
        traj.finish_reason = leaf.finish
        traj.session_id = self.id
        drift = self.drift(leaf)
        traj.drift_tokens, traj.drift_spans = drift.tokens, list(drift.spans)
        traj.info["turns"] = [t.index for t in path]
        if rows and len(rows) == len(path):
            traj.routed_experts = routing_rows(rows, traj.num_tokens)
        traj.check()
        return traj

    def conversation(self, path: list[Turn]) -> list[dict[str, Any]]:
        """The normalised messages of a path: the last request's messages + the last reply."""
        leaf = path[-1]
        return list(leaf.messages) + ([leaf.reply] if leaf.reply is not None else
                                      [{"role": "assistant", "content": leaf.text, "tool_calls": []}])
