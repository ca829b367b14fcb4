"""Test-only kill points: the run SIGKILLs itself the moment it reaches a named point, so a test of
crash recovery kills it exactly there instead of racing it from outside (watching the run
directory, a poll that can land a moment early or late).

`AXRL_KILL_AT=NAME[,NAME…]` in the environment arms them (unset: a no-op, one environ lookup).
The points, for any atomically written trace step file or checkpoint directory NAME
(`step_000003.h5`, `step_000003`):

* `written:NAME` — its tmp is complete and synced, not yet renamed to NAME;
* `renamed:NAME` — renamed and its directory synced.
"""

from __future__ import annotations

import os
import signal

ENV = "AXRL_KILL_AT"


def kill_point(name: str) -> None:
    """SIGKILL this process (all its threads, no cleanup) when `name` is armed in AXRL_KILL_AT."""
    armed = os.environ.get(ENV)
    if armed and name in armed.split(","):
        os.kill(os.getpid(), signal.SIGKILL)
