"""The proxy's live sessions, each with what it lets a request choose, and who may call them."""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from axrl.agents.proxy.trajectories import AgentService
from axrl.agents.proxy.session import Session
from axrl.inference.openai.errors import ApiError
from axrl.inference.protocol import SamplingParams


@dataclasses.dataclass
class SessionPolicy:
    """What a session lets a request choose."""

    sampling: SamplingParams            # defaults (a training run: the run's sampling)
    honour_sampling: bool = True        # temperature / top_p from the request (off in training)
    max_tokens: int = 256               # per-turn cap
    seed: int | None = None             # base of per-call seeds (training: the sample's seed)
    render_tools: bool = True           # False: parse tool calls but keep the schema out of the prompt


class SessionRegistry:
    """The live sessions of a proxy, with each one's policy; thread-safe."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._sessions: dict[str, tuple[Session, SessionPolicy]] = {}
        self._lock = threading.Lock()
        # None: admit; a number: refuse the call, retry after that many seconds (HTTP 429).
        self.gate: Callable[[Session], float | None] = lambda _s: None
        self.service: AgentService | None = None   # POST /v1/trajectories (agents with their own engine)

    def add(self, session: Session, policy: SessionPolicy) -> None:
        with self._lock:
            if session.id in self._sessions:
                raise ValueError(f"session {session.id!r} exists")
            self._sessions[session.id] = (session, policy)

    def remove(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def get(self, session_id: str) -> tuple[Session, SessionPolicy] | None:
        with self._lock:
            return self._sessions.get(session_id)

    def items(self) -> list[tuple[Session, SessionPolicy]]:
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def authorize(self, session_id: str, authorization: str, *, calls: bool = False) -> tuple[Session, SessionPolicy]:
        """The session a request names, checked: it exists (404), the `Authorization` header holds
        its key (401) and, for a model call (`calls`), it is open (409) and the admission gate lets
        the call in (429 with Retry-After). Marks the session active."""
        found = self.get(session_id)
        if found is None:
            raise ApiError(404, f"no session {session_id!r} (ended and collected, or never created)",
                           code="session_not_found")
        session, policy = found
        if authorization != f"Bearer {session.api_key}":
            raise ApiError(401, "Incorrect API key provided for this session: use the session's own key "
                           "(OPENAI_API_KEY of the agent's environment)", code="invalid_api_key")
        if calls and session.state != "open":
            raise ApiError(409, f"session {session_id!r} has ended ({session.state}); it takes no more calls",
                           code="session_ended")
        if calls:
            wait = self.gate(session)
            if wait is not None:
                raise ApiError(429, "the trainer is behind (staleness bound): retry later", retry_after=wait,
                               code="staleness_bound")
        session.touch()
        return session, policy

    def authorize_agent(self, authorization: str) -> None:
        """Check that a request not addressed to one session (`POST /v1/trajectories`) comes from
        the run's agents: its `Authorization` header holds the agent service's key or the key of
        a live session (what every agent of the run is given); 401 otherwise. Without it any local
        process could push samples into training."""
        keys = {f"Bearer {s.api_key}" for s, _ in self.items()}
        if self.service is not None:
            keys.add(f"Bearer {self.service.api_key}")
        if not authorization or authorization not in keys:
            raise ApiError(401, "Incorrect API key provided: POST /v1/trajectories needs the run's agent key "
                           "(the agent service's key, or a live session's: OPENAI_API_KEY of an agent)",
                           code="invalid_api_key")
