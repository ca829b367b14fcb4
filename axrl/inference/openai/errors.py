"""One client-error type for the OpenAI-compatible front-ends, and the bodies it is sent as.

A handler raises `ApiError` (the HTTP status, a message that names the field, OpenAI's `param`
and `code`); the app turns it into a response. Two bodies, because the two servers answer two
kinds of clients: the proxy answers OpenAI SDKs with OpenAI's `{"error": {...}}`, `axrl serve`
answers SGLang clients (and OpenAI ones, as SGLang does) with SGLang's flat error object.
"""

from __future__ import annotations

import math
from typing import Any

# OpenAI's `error.type` per status (what the SDKs map to their exception classes).
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 409: "invalid_request_error", 429: "rate_limit_error"}
# SGLang's `type` per status (its ErrorResponse).
_SGLANG_TYPES = {400: "BadRequest", 404: "NotFoundError"}


class ApiError(Exception):
    """A client error: HTTP `status`, `param` (the offending field), OpenAI `code`, and for a 429
    how many seconds to wait (`Retry-After`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after

    @property
    def headers(self) -> dict[str, str] | None:
        """`Retry-After` (whole seconds, at least 1) when the client should come back later."""
        if self.retry_after is None:
            return None
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


def bad(field: str, message: str) -> ApiError:
    """A 400 about `field`: the message starts with the field's name."""
    return ApiError(400, f"{field}: {message}", param=field)


def openai_error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}`."""
    kind = _OPENAI_TYPES.get(error.status, "server_error")
    return {"error": {"message": str(error), "type": kind, "param": error.param, "code": error.code}}


def sglang_error_body(message: str, status: int = 400) -> dict[str, Any]:
    """SGLang's error object: `{"object": "error", "message", "type", "code": status}`."""
    return {"object": "error", "message": message, "type": _SGLANG_TYPES.get(status, "InternalServerError"),
            "code": status}
