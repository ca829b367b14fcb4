"""AxRL: agentic RL post-training with a debuggable, replayable trace."""

__version__ = "0.1.0"
