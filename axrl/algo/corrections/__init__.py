"""Rollout↔trainer mismatch corrections, selected by `algo.correction` (a mapping name → params)
and combinable with any objective: their weights multiply (docs/algorithms.md).

Adding one: a module here with a function decorated by `@correction(name, ...)` and its import below.
"""

from axrl.algo.corrections.registry import CORRECTIONS, Correction, correction

# registrations (one line per correction module)
from axrl.algo.corrections import tis  # noqa: E402,F401
from axrl.algo.corrections import mis  # noqa: E402,F401
from axrl.algo.corrections import veto  # noqa: E402,F401
from axrl.algo.corrections import icepop  # noqa: E402,F401

__all__ = ["CORRECTIONS", "Correction", "correction"]
