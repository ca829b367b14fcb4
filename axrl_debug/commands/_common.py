"""Helpers shared by the analysis commands: opening a run with user-facing errors, step
selection, problem reporting and number formatting."""

from __future__ import annotations

import bisect
import math
from pathlib import Path
from typing import Any, Callable, Iterable

from rich import box
from rich.table import Table
from rich.text import Text

from axrl.runtime.recording.tiers import ATTR_TRACE_LEVEL
from axrl.trace import SchemaVersionError, TraceError, TraceReader
from axrl_debug.commands.base import BadInput, err, out

STEP_OPTION_HELP = "Analyse only step N."
STEPS_OPTION_HELP = "Analyse steps A:B (inclusive; either end may be left open, e.g. 10: or :5)."


def open_run(path: Path | str) -> TraceReader:
    """A ``TraceReader`` for ``path``, or ``BadInput`` (exit 2) with a clear reason: missing
    directory, not a run, unknown schema version, or no readable step file at all."""
    path = Path(path)
    try:
        reader = TraceReader(path)
    except SchemaVersionError as e:
        raise BadInput(str(e)) from None
    except (FileNotFoundError, NotADirectoryError) as e:
        raise BadInput(str(e)) from None
    except TraceError as e:
        raise BadInput(f"cannot read run {path}: {e}") from None
    if not reader.steps:
        report_problems(reader)
        why = " (every step file is damaged; see above)" if reader.problems else ""
        raise BadInput(f"no readable step files in {reader.trace_dir}{why}")
    return reader


def nearest_steps(available: list[int], step: int) -> list[int]:
    """The available steps closest to ``step`` from below and above (1 or 2 of them)."""
    i = bisect.bisect_left(available, step)
    return [s for s in (available[i - 1] if i > 0 else None, available[i] if i < len(available) else None)
            if s is not None]


def describe_steps(available: list[int]) -> str:
    """'0-4, 7, 9-12' style summary of a sorted step list."""
    runs: list[str] = []
    start = prev = None
    for s in available + [None]:  # type: ignore[operator]
        if s is not None and prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = s
    return ", ".join(runs)


def _missing_step(reader: TraceReader, step: int) -> BadInput:
    bad = [p for p in reader.problems if p.path.name.startswith(f"step_{step:06d}.")]
    if bad:
        return BadInput(f"step {step} is in the trace but its file is damaged: {bad[0]}")
    near = nearest_steps(reader.steps, step)
    return BadInput(f"step {step} is not in the trace of {reader.path} (nearest available: "
                    f"{', '.join(map(str, near))}; available: {describe_steps(reader.steps)})")


def parse_range(spec: str) -> tuple[int | None, int | None]:
    """'A:B' → (A, B); either side may be empty. Raises BadInput on anything else."""
    if ":" not in spec:
        raise BadInput(f"--steps expects A:B (e.g. 3:7, 10:, :5), got {spec!r}")
    a, b = spec.split(":", 1)
    try:
        lo = int(a) if a.strip() else None
        hi = int(b) if b.strip() else None
    except ValueError:
        raise BadInput(f"--steps expects integers A:B, got {spec!r}") from None
    if lo is not None and hi is not None and lo > hi:
        raise BadInput(f"--steps {spec}: start {lo} is after end {hi}")
    return lo, hi


def select_steps(reader: TraceReader, step: int | None = None, steps: str | None = None) -> list[int]:
    """The steps to analyse: all, one (``--step``) or a range (``--steps A:B``, inclusive)."""
    available = reader.steps
    if step is not None and steps is not None:
        raise BadInput("give either --step or --steps, not both")
    if step is not None:
        if step not in available:
            raise _missing_step(reader, step)
        return [step]
    if steps is not None:
        lo, hi = parse_range(steps)
        chosen = [s for s in available if (lo is None or s >= lo) and (hi is None or s <= hi)]
        if not chosen:
            probe = lo if lo is not None else hi
            near = nearest_steps(available, probe if probe is not None else 0)
            raise BadInput(f"no steps in {steps} in the trace of {reader.path} (nearest available: "
                           f"{', '.join(map(str, near))}; available: {describe_steps(available)})")
        return chosen
    return available


def report_problems(reader: TraceReader, _seen: set[str] | None = None) -> list[str]:
    """Print every problem of the reader once (stderr) and return them as strings (for --json)."""
    msgs = [str(p) for p in reader.problems]
    seen = getattr(reader, "_axrl_debug_reported", set())
    for m in msgs:
        if m not in seen:
            err.print(f"[yellow]warning:[/] skipped {m}", highlight=False, soft_wrap=True)
            seen.add(m)
    setattr(reader, "_axrl_debug_reported", seen)
    return msgs


def summary_steps(reader: TraceReader, steps: Iterable[int]) -> list[int]:
    """The steps among `steps` recorded at `trace.level: summary` (no per-token columns)."""
    out = []
    for s in steps:
        with reader.open(s) as sf:
            if sf.attrs.get(ATTR_TRACE_LEVEL) == "summary":
                out.append(s)
    return out


def summary_note(steps: list[int]) -> str:
    """What a per-token analysis tells the user about steps recorded at trace.level summary."""
    return (f"step{'s' if len(steps) > 1 else ''} {describe_steps(steps)} "
            f"{'were' if len(steps) > 1 else 'was'} recorded at trace.level summary: no per-token columns "
            "(per-sample and per-turn statistics are in /samples: mismatch_mean, turn_mismatch_mean, …)")


def fmt(x: Any, digits: int = 4) -> str:
    """Compact human formatting: 4 significant digits, '–' for missing/NaN."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "–"
    if v.is_integer() and abs(v) < 1e9:
        return str(int(v))
    text = f"{v:.{digits}g}"
    # "2.4e-05" → "2.4e-5": tables stay narrow enough for an 80-column terminal
    return text.replace("e-0", "e-").replace("e+0", "e+")


def fmt_number(x: Any, render: Callable[[float], str]) -> str:
    """`render(float(x))`, or "–" for a missing, non-numeric or NaN value."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "–"
    return "–" if math.isnan(v) else render(v)


def pct(x: Any) -> str:
    return fmt_number(x, lambda v: f"{100 * v:.1f}%")


def simple_table(title: str | None, columns: Iterable[str], rows: Iterable[Iterable[Any]],
                 justify_right: bool = True) -> Table:
    """A borderless rich table. Numeric (right-aligned) columns never wrap: each gets the width of
    its widest cell, so a narrow terminal scrolls instead of printing "0.00…" or folded digits;
    left-aligned text columns (explanations) wrap."""
    cells = [[v if isinstance(v, str) else fmt(v) for v in r] for r in rows]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for i, c in enumerate(columns):
        if justify_right or i == 0:
            width = max([len(Text.from_markup(r[i]).plain) for r in cells if i < len(r)] + [len(c)])
            # the first column names the row (a step, a metric): left-aligned, never wrapped
            table.add_column(c, justify="right" if justify_right and i > 0 else "left", no_wrap=True,
                             min_width=width)
        else:
            table.add_column(c, justify="left", overflow="fold")
    for r in cells:
        table.add_row(*r)
    return table


def show(table: Table) -> None:
    """Print a table at its natural width even on a narrow or non-terminal console (a pipe or CI
    log defaults to 80 columns), so no column is ever cropped; wide tables then simply run past the right edge."""
    from rich.measure import Measurement

    natural = Measurement.get(out, out.options.update(width=400), table).maximum
    if table.title and len(str(table.title)) > natural:
        # a title wider than its table would wrap into a narrow column: print it on its own line
        out.print(str(table.title), highlight=False, soft_wrap=True)
        table.title = None
    if natural > out.width:
        out.print(table, width=min(natural, 400), crop=False)
    else:
        out.print(table)
