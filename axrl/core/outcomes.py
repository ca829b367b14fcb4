"""How a sample ended: the one definition of finish reasons and statuses.

Every producer of trajectories (the agent loop, the proxy session, the agent service that accepts
pushed trajectories) and every reader of the trace (`/samples/finish_reason`, `/samples/status`)
uses these names.
"""

from __future__ import annotations

# Trajectory.finish_reason:
#   stop       the episode ended after a complete assistant turn
#   length     the last turn hit the per-turn token limit
#   context    the stream reached rollout.max_context_len
#   max_turns  max_turns assistant turns were generated and the env had not ended
#   abort      the engine aborted a request (the partial turn is kept)
#   failed     the env, tool or agent failed (status "failed")
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "context", "max_turns", "abort", "failed")

# Trajectory.status: "failed" samples are kept in the trace and never trained on.
STATUSES: tuple[str, ...] = ("ok", "failed")
