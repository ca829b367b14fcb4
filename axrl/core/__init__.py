"""The ground floor: the types every layer shares, and nothing else.

`axrl.core` imports only numpy. `rollout/`, `agents/`, `trace/` and `runtime/` import it; it
imports none of them, so the shared sample type never pulls a layer into another:

* :mod:`axrl.core.outcomes`: the one list of finish reasons and sample statuses;
* :mod:`axrl.core.trajectory`: `Trajectory`, one sample as a token stream;
* :mod:`axrl.core.token_stream`: how a chat's model calls become that stream (assistant close
  ids, one segment per weight-version run, routing rows), shared by the white-box agent loop and
  the black-box proxy session.
"""

from axrl.core.outcomes import FINISH_REASONS, STATUSES
from axrl.core.token_stream import (
    append_generated, assistant_close_ids, reply_glue, routing_rows, token_versions,
)
from axrl.core.trajectory import Trajectory

__all__ = ["FINISH_REASONS", "STATUSES", "Trajectory", "append_generated", "assistant_close_ids", "reply_glue",
           "routing_rows", "token_versions"]
