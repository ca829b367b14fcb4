"""The recording OpenAI-compatible proxy for black-box agents (docs/agents.md, "Bring your own agent")."""

from axrl.agents.proxy.registry import SessionPolicy
from axrl.agents.proxy.server import ProxyServer, engine_submit
from axrl.agents.proxy.session import FORK_CAUSES, FORK_ID_STRIDE, Session, Turn

__all__ = ["FORK_CAUSES", "FORK_ID_STRIDE", "ProxyServer", "Session", "SessionPolicy", "Turn", "engine_submit"]
