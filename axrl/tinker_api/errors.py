"""Errors of the Tinker-compatible service."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the client's request (unknown loss, datum shapes, unknown model id): the
    future fails with `{"error": message, "category": "user"}`; the server carries on."""


class RefusedRequest(UserError):
    """A refused request whose (model_id, seq_id) is known: the refusal still takes its turn in the
    model's seq_id order (`FutureStore.submit_ordered`), so the model's next request does not wait
    out the gap limit for a sequence number that will never run."""

    def __init__(self, message: str, model_id: str, seq_id: int) -> None:
        super().__init__(message)
        self.model_id, self.seq_id = model_id, seq_id
