"""Request bodies of AxRL's HTTP servers (`axrl serve`, the black-box agent proxy)."""

from __future__ import annotations

import json
from typing import Any


def parse_json_body(raw: bytes) -> Any:
    """A request body as JSON, ``{}`` when it is empty; ValueError saying why it is not JSON (each
    server turns it into its own 400)."""
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"request body is not valid JSON: {e}") from None
