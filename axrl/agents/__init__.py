"""Agents: the white-box env protocol and the built-in tasks (see ``axrl.agents.tasks``)."""

from axrl.agents.env import Env, Message, Prompt, StepOutcome, assistant_text, replay_conversation

__all__ = ["Env", "Message", "Prompt", "StepOutcome", "assistant_text", "replay_conversation"]
