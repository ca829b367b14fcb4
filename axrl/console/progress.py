"""Live training progress with rich: a bar with the current phase, and one table row per step."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterable, Iterator

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# (metrics key, header, format): one printed row per step, fits 80 columns.
_COLUMNS = [("step", "step", "d"), ("reward", "reward", ".3f"), ("loss", "loss", ".4f"),
            ("grad_norm", "gnorm", ".3f"), ("mismatch", "mismatch", ".1e"), ("samples", "samples", "d"),
            ("tokens_per_s", "tok/s", ".0f"), ("step_time", "sec", ".1f")]


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(int(value) if spec == "d" else value, spec)


class _ProgressWith(Progress):
    """A progress display with one more live renderable under its bars (e.g. the actors' health)."""

    def __init__(self, *columns: Any, below: Callable[[], RenderableType | None] | None = None, **kw: Any) -> None:
        self.below = below
        super().__init__(*columns, **kw)

    def get_renderables(self) -> Iterable[RenderableType]:
        yield from super().get_renderables()
        extra = self.below() if self.below is not None else None
        if extra is not None:
            yield extra


class TrainProgress:
    """`with TrainProgress(total_steps, first_step) as p: p.phase("rollout"); p.step_done(metrics)`.

    `below()`: a renderable kept live under the bar (a ray run's actor health table), or None."""

    def __init__(self, total_steps: int, first_step: int = 0, console: Console | None = None,
                 below: Callable[[], RenderableType | None] | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.progress = _ProgressWith(
            TextColumn("[bold]{task.fields[phase]:<9}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[summary]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, transient=False, below=below)
        self.task = self.progress.add_task("train", total=total_steps, completed=first_step,
                                           phase="start", summary="")
        self._header_printed = False

    def __enter__(self) -> "TrainProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def phase(self, name: str) -> None:
        self.progress.update(self.task, phase=name)

    @contextlib.contextmanager
    def stage(self, name: str, total: int) -> Iterator[Callable[[str], None]]:
        """A bar of its own for a stage before the steps (the warm-up): yields `advance(summary)`."""
        self.phase(name)
        task = self.progress.add_task(name, total=total, phase=name, summary="")

        def advance(summary: str) -> None:
            self.progress.update(task, advance=1, summary=summary)
        try:
            yield advance
        finally:
            self.progress.remove_task(task)

    def log(self, message: str) -> None:
        self.progress.console.print(message)

    def step_done(self, m: dict[str, Any]) -> None:
        """Print the step's row and advance the bar."""
        table = Table(show_header=not self._header_printed, box=None, pad_edge=False)
        for _, header, _ in _COLUMNS:
            # every row is its own table: a fixed width per column keeps the rows aligned under the header
            table.add_column(header, justify="right", min_width=max(7, len(header)))
        table.add_row(*(_fmt(m.get(key), spec) for key, _, spec in _COLUMNS))
        self._header_printed = True
        self.progress.console.print(table)
        summary = f"reward {_fmt(m.get('reward'), '.3f')}"
        for key in ("eval_reward", "eval_reward_final"):
            if key in m:
                self.progress.console.print(f"  {key.replace('_', ' ')}: {m[key]:.3f}")
        if m.get("spike"):  # the online spike trigger fired (axrl/runtime/spike_trigger.py)
            self.progress.console.print(f"  grad-norm spike: {m['spike_grad_norm_ratio']:.1f}× the rolling median; "
                                        f"dump ({m['spike_dump_verdict']}) in {m.get('spike_dump', '-')}")
        self.progress.update(self.task, advance=1, summary=summary, phase="done")


class PhaseTimer:
    """Wall time per phase of a step (recorded as attributes of the step file)."""

    def __init__(self, progress: TrainProgress | None = None) -> None:
        self.times: dict[str, float] = {}
        self._progress = progress
        self._name: str | None = None
        self._start = 0.0

    def __call__(self, name: str) -> "PhaseTimer":
        self._name = name
        self.show(name)
        return self

    def show(self, name: str) -> None:
        """Show `name` as the current phase without timing it (a phase timed elsewhere)."""
        if self._progress:
            self._progress.phase(name)

    def __enter__(self) -> "PhaseTimer":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._name is not None
        self.times[self._name] = self.times.get(self._name, 0.0) + time.perf_counter() - self._start
