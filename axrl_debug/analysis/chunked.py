"""Running an analysis over steps one open step file at a time (for the chunked readers of
``axrl.trace.chunks``): a step that turns out unreadable half-way is reported, not fatal."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from axrl.trace import StepFile, TraceError


def for_each_step(reader: Any, steps: Iterable[int], fold: Callable[[StepFile], Any]) -> None:
    """Call ``fold(sf)`` with each of ``steps`` of ``reader`` open. A step whose data cannot be
    read (``TraceError``: a checksum failure, a truncated chunk; ``KeyError``: a required dataset
    missing) is skipped and added to ``reader.problems``, as ``TraceReader.iter_columns`` does;
    ``fold`` must leave its aggregate as it was when it raises (``MismatchAccumulator.add_chunks``
    does)."""
    for step in steps:
        path = reader.step_path(step)
        try:
            with StepFile(path) as sf:
                fold(sf)
        except (TraceError, KeyError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            reader.report_problem(path, str(msg))
