"""Policy objectives, selected by `algo.loss` (formulas, defaults and sources: docs/algorithms.md).

Adding one: a module here with a function decorated by `@objective(name, ...)` and its import
below. The config, replay and the dumps find it through `OBJECTIVES`; nothing else changes.
"""

from axrl.algo.objectives.registry import OBJECTIVES, Objective, objective

# registrations (one line per objective module)
from axrl.algo.objectives import ppo  # noqa: E402,F401
from axrl.algo.objectives import grpo2  # noqa: E402,F401
from axrl.algo.objectives import gspo  # noqa: E402,F401
from axrl.algo.objectives import cispo  # noqa: E402,F401
from axrl.algo.objectives import topr  # noqa: E402,F401

__all__ = ["OBJECTIVES", "Objective", "objective"]
