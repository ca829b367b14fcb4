"""Errors of the Tinker-compatible service."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the client's request (unknown loss, datum shapes, unknown model id): the
    future fails with `{"error": message, "category": "user"}`; the server carries on."""
