"""What a replay of step N needs, checked before any work: the run, step N's file, a checkpoint at
or before N, and every step file between them — each file's datasets read back and their checksums
verified, target first, so a damaged file is reported before any step is re-run.

A step is *usable* (replayable) when some checkpoint K ≤ N exists and the step files K..N are all
readable. Every bad-input error names the usable step nearest to the one asked for, so the user
can retry at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from axrl.runtime.checkpoint import list_checkpoints
from axrl.trace import StepFile, TraceError, TraceReader
from axrl.runtime.recording.tiers import ATTR_TRACE_LEVEL
from replay.recorded import REQUIRED


class ReplayInputError(Exception):
    """The replay cannot start (or continue) because of its input; `nearest` is the usable step
    closest to the one asked for (None when no step of the run can be replayed)."""

    def __init__(self, message: str, nearest: int | None = None, *, about_step: bool = False) -> None:
        self.nearest = nearest
        if nearest is not None:
            message += f"; nearest usable step: {nearest}"
        elif about_step:
            message += "; no step of this run can be replayed"
        super().__init__(message)

    @classmethod
    def for_step(cls, message: str, inventory: "RunInventory", step: int) -> "ReplayInputError":
        """An error about `step`, naming the nearest usable step of the run."""
        return cls(message, inventory.nearest_usable(step), about_step=True)


@dataclass
class ReplayPlan:
    """Start from checkpoint `checkpoint_step`, re-run the steps before `step`, then `step`."""

    run: Path
    step: int
    checkpoint_step: int
    checkpoint_path: Path
    step_paths: dict[int, Path]                       # every step from checkpoint_step to step
    older_checkpoints: list[tuple[int, Path]] = field(default_factory=list)  # fall-backs, newest first


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}..{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) else ", ".join(map(str, steps))


def _not_replayable(run: Path, source: dict) -> str:
    """Why a run written by `axrl.trace.Recorder` (recorded or imported) cannot be replayed."""
    what = f"imported from {source['format']}" if source.get("format") else "recorded"
    return (f"{run} was {what} through {source.get('writer', 'axrl.trace.Recorder')} (manifest.json 'source'), "
            "not trained by `axrl train`: replay re-executes a step from AxRL's own checkpoints (weights, "
            "optimizer, data position and RNG state, under RUN/checkpoints/) with the run's resolved config.yaml, "
            "and such a run has neither. Its trace can still be analysed: summary, mismatch, spikes, check, tui")


class RunInventory:
    """The steps and checkpoints of a run directory, and which steps are usable."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = Path(run_dir)
        try:
            self.reader = TraceReader(self.run)
        except (FileNotFoundError, NotADirectoryError, TraceError) as e:
            raise ReplayInputError(f"{e}") from None
        source = self.reader.manifest.get("source")
        if isinstance(source, dict):
            raise ReplayInputError(_not_replayable(self.run, source))
        if self.reader.config is None:
            raise ReplayInputError(f"{self.run} has no config.yaml: cannot rebuild the trainer")
        self.files = self.reader.step_files()                 # every final step file
        self.valid = set(self.reader.steps)                   # structurally readable ones
        self.problems = {p.path.name: str(p) for p in self.reader.problems}
        self.bad: set[int] = set()                            # found damaged while reading
        self.reduced = self._reduced_levels()                 # step -> trace.level of steps not written full
        self.checkpoints = list_checkpoints(self.run)

    def _reduced_levels(self) -> dict[int, str]:
        """Steps written at `trace.level: summary` (no token columns): not re-executable. (A
        `standard` step re-executes; without its routing, not under R3: `_load_recorded` says so.)"""
        out: dict[int, str] = {}
        for s in self.valid:
            try:
                with StepFile(self.files[s]) as sf:
                    level = str(sf.attrs.get(ATTR_TRACE_LEVEL, "full"))
            except (TraceError, OSError):
                continue
            if level == "summary":
                out[s] = level
        return out

    def readable(self, step: int) -> bool:
        """The step file is whole and holds what re-execution needs (not trace.level summary)."""
        return step in self.valid and step not in self.bad and step not in self.reduced

    def usable_steps(self) -> list[int]:
        """Steps whose state can be rebuilt: a checkpoint K ≤ s and readable step files K..s."""
        out: set[int] = set()
        for k, _ in self.checkpoints:
            s = k
            while self.readable(s):
                out.add(s)
                s += 1
        return sorted(out)

    def nearest_usable(self, step: int) -> int | None:
        usable = [s for s in self.usable_steps() if s != step]
        return min(usable, key=lambda s: (abs(s - step), s)) if usable else None

    def mark_bad(self, step: int) -> None:
        self.bad.add(step)

    def verify_data(self, step: int) -> None:
        """Read every dataset of a step file (HDF5 verifies each chunk's checksum on read) and check
        that it holds what re-execution needs; a damaged file is marked bad and reported."""
        path = self.files[step]
        try:
            with StepFile(path) as sf:
                missing = [name for name in REQUIRED if name not in sf]
                sf.read_all()
        except (TraceError, ValueError, OSError, KeyError) as e:
            self.mark_bad(step)
            raise ReplayInputError.for_step(f"step {step}'s file is damaged: {e}", self, step) from None
        if missing:
            self.mark_bad(step)
            raise ReplayInputError.for_step(f"step {step}'s file {path} cannot be re-executed: it lacks "
                                            f"{', '.join(missing)}", self, step)

    def plan(self, step: int) -> ReplayPlan:
        """The replay plan of `step`, or ReplayInputError naming the nearest usable step."""
        if step < 0 or step not in self.files:
            raise ReplayInputError.for_step(f"step {step} is not in the trace of {self.run} "
                                            f"(recorded steps: {_span(sorted(self.files))})", self, step)
        if step in self.reduced:
            raise ReplayInputError.for_step(
                f"step {step} was recorded at trace.level {self.reduced[step]}: no per-token columns; replay "
                f"needs steps with them (trace.level full or standard; trace.keep_full keeps the steps before a "
                f"spike full)", self, step)
        if not self.readable(step):
            why = self.problems.get(self.files[step].name, f"{self.files[step]}: unreadable")
            raise ReplayInputError.for_step(f"step {step}'s file is damaged: {why}", self, step)
        self.verify_data(step)
        before = [c for c in self.checkpoints if c[0] <= step]
        if not before:
            have = ", ".join(str(k) for k, _ in self.checkpoints) or "none"
            raise ReplayInputError.for_step(f"no checkpoint at or before step {step} in {self.run / 'checkpoints'} "
                                            f"(checkpoints before steps: {have})", self, step)
        k, path = before[-1]
        gaps = [s for s in range(k, step) if not self.readable(s)]
        if gaps:
            g = gaps[-1]
            state = ("missing" if g not in self.files else
                     f"recorded at trace.level {self.reduced[g]}" if g in self.reduced else "damaged")
            raise ReplayInputError.for_step(f"cannot rebuild the state before step {step}: step {g} (between "
                                            f"checkpoint {k} and step {step}) is {state}", self, step)
        for s in range(step - 1, k - 1, -1):  # every file the catch-up reads, before it re-runs anything
            try:
                self.verify_data(s)
            except ReplayInputError:
                raise ReplayInputError.for_step(f"cannot rebuild the state before step {step}: step {s} (between "
                                                f"checkpoint {k} and step {step}) is damaged", self, step) from None
        return ReplayPlan(run=self.run, step=step, checkpoint_step=k, checkpoint_path=path,
                          step_paths={s: self.files[s] for s in range(k, step + 1)},
                          older_checkpoints=list(reversed(before[:-1])))
