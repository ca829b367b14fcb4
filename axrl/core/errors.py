"""Errors every layer may raise, defined below all of them."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config problem, already phrased for the user (key path, what was expected, what to do)."""
