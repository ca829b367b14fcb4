"""One black-box agent session: every model call it made, stitched into token-level samples.

The proxy never re-tokenises what the model generated. Each call becomes a *turn*: the prompt ids
the engine was given and the ids, logprobs, weight versions and routing it generated. A new chat
call is stitched onto the deepest earlier turn whose conversation (its request messages plus the
reply the proxy returned) is a prefix of the new messages: the new prompt is that turn's own token
stream (prompt + generated ids) + the template's glue + the rendering of the new messages only.
What the agent sent back for the earlier reply is compared, re-rendered, with what was generated:
a difference is a *drift* (counted in tokens, recorded, never trained on — the generated ids are
what the model conditioned on and what is trained).

The turns form a tree. A call that continues a turn which already has a continuation, or that
continues no turn at all (the agent rewrote, dropped or summarised its history), is a *fork*.
Every root-to-leaf path becomes one sample; a turn shared by several paths is trained once, on
the first path that holds it (loss mask 0 on later copies). The primary path is the one ending in
the session's last turn; the others are forks of it.

Turn numbering in a sample (`Trajectory.turn`): the prompt is turn 0, the i-th model reply on the
path is turn i, and the tokens the agent added after reply i (tool results, user messages, glue)
belong to turn i — the layout of the white-box agent loop.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from axrl.agents.env import Message
from axrl.core.token_stream import append_generated, assistant_close_ids, reply_glue, routing_rows, token_versions
from axrl.core.trajectory import Trajectory
from axrl.inference.protocol import GenerateResult
from axrl.tokenizer import Tokenizer

# Fork paths of sample s get ids s + k · FORK_ID_STRIDE (k ≥ 1): unique while sample ids stay
# below 2^32, and the original sample id is s % FORK_ID_STRIDE.
FORK_ID_STRIDE = 1 << 32


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


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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
    drift_tokens: int = 0            # tokens of the re-sent reply that differ from the generated ones
    reward: float = 0.0              # per-turn reward (POST /sessions/{id}/reward with "turn")
    children: list[int] = field(default_factory=list)

    @property
    def stream(self) -> list[int]:
        return list(self.prompt_ids) + list(self.output_ids)


@dataclass
class Prepared:
    """A call's prompt: the ids to send and where it attaches in the tree."""

    prompt_ids: list[int]
    parent: int | None
    start_len: int
    messages: list[dict[str, Any]]
    tools_key: str
    text: str = ""


@dataclass
class SessionEvent:
    """A fork or a drift, for the trace and `axrl-debug summary`."""

    kind: str            # "fork" | "drift"
    turn: int            # the new turn (fork) or the turn whose reply drifted
    detail: str


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
        """The prompt ids of a chat call, stitched onto the turn it continues (see module doc)."""
        tok = self.tokenizer
        norm = [normalize(m) for m in messages]
        tools_key = json.dumps(tools or [], sort_keys=True)
        try:
            full = str(tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                               tokenize=False))
        except Exception as e:  # noqa: BLE001 — a template error is the request's fault
            raise SessionError(f"messages: cannot render the chat template: {e}") from None
        with self._lock:
            parent = self._deepest_prefix(norm, tools_key)
            if parent is not None:
                k = len(parent.messages) + 1
                base = str(tok.apply_chat_template(messages[:k], tools=tools or None, tokenize=False))
                if full.startswith(base):
                    glue = reply_glue(self._close_ids, parent.closed)
                    prompt = parent.stream + glue + tok.encode(full[len(base):])
                    self._measure_drift(parent, messages, k, tools, base, glue)
                    return Prepared(prompt, parent.index, len(parent.stream) - 1, norm, tools_key)
        return Prepared(tok.encode(full), None, 0, norm, tools_key)

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

    def _deepest_prefix(self, norm: list[dict[str, Any]], tools_key: str) -> Turn | None:
        best: Turn | None = None
        for t in self.turns.values():
            k = len(t.messages)
            if (t.reply is not None and t.tools_key == tools_key and len(norm) > k
                    and norm[:k] == t.messages and norm[k] == t.reply
                    and (best is None or (k, t.index) > (len(best.messages), best.index))):
                best = t
        return best

    def _measure_drift(self, parent: Turn, messages: list[Message], k: int, tools: list[dict[str, Any]] | None,
                       base: str, glue: list[int]) -> None:
        """Compare the re-rendered reply the agent sent back with the ids the model generated."""
        before = str(self.tokenizer.apply_chat_template(messages[:k - 1], tools=tools or None,
                                                        add_generation_prompt=True, tokenize=False))
        if not base.startswith(before):
            return
        rendered = self.tokenizer.encode(base[len(before):])
        generated = list(parent.output_ids) + list(glue)
        drift = max(len(rendered), len(generated)) - _lcp(rendered, generated)
        if drift and drift > parent.drift_tokens:
            if parent.drift_tokens == 0:
                self.events.append(SessionEvent(
                    "drift", parent.index, f"turn {parent.index}: the reply sent back re-renders to "
                    f"{len(rendered)} tokens, {drift} differ from the {len(generated)} generated "
                    f"(first at +{_lcp(rendered, generated)}); trained on the generated ids"))
            parent.drift_tokens = drift

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
                        text=(prep.text + text) if not prep.messages else text)
            siblings = self.turns[prep.parent].children if prep.parent is not None else self.roots()
            if siblings:
                self.events.append(SessionEvent(
                    "fork", index, f"turn {index} continues {'turn ' + str(prep.parent) if prep.parent else 'no turn'}"
                    f" which already has {len(siblings)} continuation(s) (history rewritten or n > 1)"))
            if prep.parent is not None:
                self.turns[prep.parent].children.append(index)
            self.turns[index] = turn
            self.calls += 1
        return turn

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
        for k, leaf in enumerate(leaves):
            path = [leaf]
            while path[-1].parent is not None:
                path.append(turns[path[-1].parent])
            path.reverse()
            sid = sample_id + k * FORK_ID_STRIDE
            traj = Trajectory(sample_id=sid, group_id=group_id, prompt_id=prompt_id)
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
            traj.prompt_len = len(path[0].prompt_ids)
            traj.num_turns = len(path)
            traj.finish_reason = leaf.finish
            traj.session_id = self.id
            traj.fork_of = -1 if k == 0 else sample_id
            traj.drift_tokens = sum(t.drift_tokens for t in path)
            traj.info["turns"] = [t.index for t in path]
            if reward is not None:
                traj.reward = float(reward(path))
            else:
                traj.reward = (self.final_reward or 0.0) + sum(t.reward for t in path)
            if rows and len(rows) == len(path):
                traj.routed_experts = routing_rows(rows, traj.num_tokens)
            traj.check()
            out.append(traj)
        return out

    def conversation(self, path: list[Turn]) -> list[dict[str, Any]]:
        """The normalised messages of a path: the last request's messages + the last reply."""
        leaf = path[-1]
        return list(leaf.messages) + ([leaf.reply] if leaf.reply is not None else
                                      [{"role": "assistant", "content": leaf.text, "tool_calls": []}])
