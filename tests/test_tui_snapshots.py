"""Snapshot tests (pytest-textual-snapshot) of the TUI's three views at 80×24 on the known trace
of test_tui_trace.py. The SVGs live in tests/__snapshots__/test_tui_snapshots/; after an
intended change of the screens, review and refresh them with
``python -m pytest tests/test_tui_snapshots.py --snapshot-update``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from test_tui_trace import build_run

import pytest_textual_snapshot  # noqa: E402,F401  (the test extra installs it)

from axrl_debug.tui.app import DebugApp  # noqa: E402


@pytest.fixture
def demo_run(tmp_path: Path) -> Path:
    # the run directory's name is in the header: keep it fixed for stable snapshots
    return build_run(tmp_path / "demo-run")


async def settled(pilot: Any) -> None:
    """Wait for the background scan (spike flags, scanned columns) so every snapshot sees the same
    table, whatever the speed of the machine."""
    app = pilot.app
    for _ in range(600):
        if app.background_done:
            break
        await pilot.pause(0.05)
    assert app.background_done
    await pilot.pause()


def test_snapshot_steps_view(snap_compare: Any, demo_run: Path) -> None:
    assert snap_compare(DebugApp(demo_run), press=["x"], terminal_size=(80, 24), run_before=settled)


def test_snapshot_samples_view(snap_compare: Any, demo_run: Path) -> None:
    assert snap_compare(DebugApp(demo_run), press=["enter"], terminal_size=(80, 24),
                        run_before=settled)


def test_snapshot_tokens_view(snap_compare: Any, demo_run: Path) -> None:
    assert snap_compare(DebugApp(demo_run), press=["enter", "enter", "w"], terminal_size=(80, 24),
                        run_before=settled)
