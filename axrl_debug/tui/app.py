"""The Textual application behind `axrl-debug tui RUN`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual import work
from textual.app import App
from textual.binding import Binding
from textual.screen import Screen
from textual.worker import get_current_worker

from .data import RunModel, StepModel
from .helper import Helper
from .help import HelpScreen
from .screens import READ_ERRORS, SamplesScreen, StepsScreen, TokensScreen

SCAN_CHUNK = 16  # steps per helper-process call: one table update per chunk, progress visible


class DebugApp(App[None]):
    """Steps → samples → tokens of one run. ``scan=False`` skips the background computation of the
    step-file metrics (max |Δ|, k3, routing agreement, lag), leaving the metrics.jsonl columns."""

    CSS_PATH = "app.tcss"
    TITLE = "axrl-debug"
    ENABLE_COMMAND_PALETTE = False
    # Below 120 columns the token detail sits under the text, from 120 on beside it.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS = [
        # priority: also from the help screen (a modal screen hides the app's other bindings)
        Binding("q", "quit", "quit", priority=True),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(self, run: RunModel | str | Path, *, scan: bool = True, step: int | None = None,
                 sample: int | None = None) -> None:
        """``step`` / ``sample``: open that step's samples, and that sample (by sample id) at start."""
        super().__init__()
        self.run_model = run if isinstance(run, RunModel) else RunModel(run)
        self.scan = scan
        self.start_step = step
        self.start_sample = sample
        self.steps_screen = StepsScreen(self.run_model)
        self.samples_screen: SamplesScreen | None = None
        self.tokens_screen: TokensScreen | None = None
        self.sub_title = self.run_model.name
        self.background_started = False
        self.background_done = False
        self._helper: Helper | None = None

    def get_default_screen(self) -> Screen:
        return self.steps_screen

    def on_mount(self) -> None:
        # Start the helper process only once the first screen is painted: spawning it costs CPU
        # that the first screen should not share.
        self.call_after_refresh(self._start_background)
        if self.start_step is not None:
            self.call_after_refresh(self._open_start)

    def _open_start(self) -> None:
        assert self.start_step is not None
        self.steps_screen.table.select_key(self.start_step)
        model = self.open_step(self.start_step, list(self.steps_screen.table.order))
        if model is not None and self.start_sample is not None:
            rows = [int(i) for i in model.samples["sample_id"]]
            if self.start_sample in rows:
                self.open_sample(model, rows.index(self.start_sample), list(range(model.num_samples)))
            else:
                self.notify(f"step {model.step} has no sample id {self.start_sample} (its ids: "
                            f"{min(rows, default='-')}..{max(rows, default='-')})", severity="error", timeout=8)

    # ---- navigation (called by the screens)
    def load_step(self, step: int) -> StepModel | None:
        """Read one step file (cached); a damaged file becomes a notification, not a crash."""
        try:
            return self.run_model.step(step)
        except READ_ERRORS as e:
            self.notify(f"step {step}: {e}", severity="error", timeout=8)
            return None

    # The samples and tokens screens are built once and installed, then re-filled on each open:
    # composing a screen (header, footer, CSS) costs more than reading a step file.
    # A key typed ahead (enter, enter) can ask for a screen that was pushed a moment ago and is not
    # composed yet: it then gets the new model, shows it when it mounts, and is not pushed twice.
    def open_step(self, step: int, order: list[int]) -> StepModel | None:
        model = self.load_step(step)
        if model is None:
            return None
        screen = self.samples_screen
        if screen is None:
            screen = self.samples_screen = SamplesScreen(self.run_model, model, order)
            self.install_screen(screen, "samples")
        elif screen.is_mounted:
            screen.step_order = order
            screen.show_step(model)
        else:
            screen.model, screen.step_order = model, order
        if screen not in self.screen_stack:
            self.push_screen("samples")
        return model

    def open_sample(self, model: StepModel, row: int, order: list[int]) -> None:
        screen = self.tokens_screen
        if screen is None:
            screen = self.tokens_screen = TokensScreen(self.run_model, model, row, order)
            self.install_screen(screen, "tokens")
        elif screen.is_mounted:
            previous = screen.model, screen.row_order
            screen.model, screen.row_order = model, order
            if not screen.show_sample(row):
                screen.model, screen.row_order = previous
                return
        else:
            screen.model, screen.row, screen.row_order = model, row, order
        if screen not in self.screen_stack:
            self.push_screen("tokens")

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    # ---- background: spike flags, then the step-file metrics a few steps at a time
    def _start_background(self) -> None:
        if not self.background_started:
            self.background_started = True
            self._background()

    def _call_ui(self, fn: Any, *args: Any, **kwargs: Any) -> bool:
        """``call_from_thread`` that tolerates the app shutting down (returns False then)."""
        try:
            self.call_from_thread(fn, *args, **kwargs)
            return True
        except RuntimeError:
            return False

    @work(thread=True, exclusive=True, group="background", exit_on_error=False)
    def _background(self) -> None:
        """Spike flags, then the step-file metrics, computed in a helper *process*
        (``axrl_debug.tui.helper``); this thread only waits and hands results to the UI thread.
        Done in-process, reading step files and building pandas frames would hold the GIL and
        make every key press wait."""
        worker = get_current_worker()
        run = self.run_model
        try:
            helper = self._helper = Helper()
        except OSError as e:
            self._call_ui(self.notify, f"no background scan ({e})", severity="warning", timeout=8)
            return
        try:
            self._call_ui(self._spikes_ready, helper.spikes(run.steps, run.spike_series(), run.dtype))
            if self.scan:
                pending = [s for s in run.steps if s in run.files and s not in run.scanned]
                for i in range(0, len(pending), SCAN_CHUNK):
                    if worker.is_cancelled:
                        return
                    chunk = pending[i:i + SCAN_CHUNK]
                    rows = helper.scan(str(run.path), chunk)
                    if worker.is_cancelled or not self._call_ui(self._scan_progress, rows, chunk,
                                                                 i + len(chunk), len(pending)):
                        return
                self._call_ui(self._spikes_ready, helper.spikes(run.steps, run.spike_series(), run.dtype))
        except Exception as e:  # EOF after quit, or a helper error: the trace stays browsable
            if not worker.is_cancelled:
                self._call_ui(self.notify, f"background scan stopped: {e}", severity="warning", timeout=8)
            return
        finally:
            helper.close()
            self.background_done = True
        self._call_ui(self._scan_finished)

    def on_unmount(self) -> None:
        if self._helper is not None:
            self._helper.close()  # do not keep a helper process reading files after quit

    def _spikes_ready(self, spikes: dict[int, list[dict[str, Any]]]) -> None:
        self.run_model.spikes = spikes
        self.steps_screen.reload()

    def _scan_progress(self, rows: dict[int, dict[str, float]], chunk: list[int], done: int, total: int) -> None:
        run = self.run_model
        run.merge_scan(rows)
        run.scanned.update(chunk)
        run.unreadable.update(s for s in chunk if s not in rows)  # step_table skipped them
        self.steps_screen.scan_state = f"scan {done}/{total}"
        self.steps_screen.update_rows(list(rows))

    def _scan_finished(self) -> None:
        self.steps_screen.scan_state = ""
        self.steps_screen.update_status()
        bad = sorted(self.run_model.unreadable)
        if bad:
            self.notify(f"{len(bad)} step file(s) could not be read: step {', '.join(map(str, bad[:5]))}"
                        + (", …" if len(bad) > 5 else ""), severity="warning", timeout=8)


def run_tui(run: str | Path, **kwargs: Any) -> None:
    """Open ``run`` in the terminal (blocks until the user quits)."""
    DebugApp(run, **kwargs).run()
