"""The TUI marks what the objective and corrections did to a token (`/tokens/loss_rule`,
`/tokens/is_weight`): masked tokens struck through, hard-clipped ones italic + overlined, and the
token detail names the rules. On the known trace of test_tui_trace.py with the two columns added
as the training loop writes them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from test_tui_trace import WORST, build_run

import textual  # noqa: E402,F401  (a dependency of axrl: a broken import fails)

from axrl_debug.tui.app import DebugApp  # noqa: E402
from axrl_debug.tui.data import RunModel  # noqa: E402
from axrl_debug.tui.screens import TokensScreen  # noqa: E402
from axrl_debug.tui.widgets.token_text import CLIPPED_STYLE, MASKED_STYLE  # noqa: E402

MASKED, CLIPPED = 41, 16   # token 41: IcePop-masked (weight 0); token 16: clip_high (bit 1) + TIS truncated (32)


def add_objective_columns(run: Path, step: int = 0) -> None:
    path = run / "trace" / f"step_{step:06d}.h5"
    with h5py.File(path, "r+") as f:
        lm = f["tokens/loss_mask"][()] != 0
        w = np.where(lm, 1.0, np.nan).astype(np.float32)
        rule = np.zeros(lm.size, np.uint16)
        w[MASKED], rule[MASKED] = 0.0, 256
        w[CLIPPED], rule[CLIPPED] = 2.0, 1 | 32
        f["tokens/is_weight"], f["tokens/loss_rule"] = w, rule


def test_objective_marks_styles_and_detail(tmp_path: Path) -> None:
    run = build_run(tmp_path / "demo-run")
    add_objective_columns(run)
    tokens = RunModel(run).step(0).sample(0)
    masked, clipped = tokens.objective_marks()
    assert np.flatnonzero(masked).tolist() == [MASKED] and np.flatnonzero(clipped).tolist() == [CLIPPED]

    async def main() -> None:
        app = DebugApp(run, scan=False)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            await pilot.press("enter", "enter")
            screen = app.screen
            assert isinstance(screen, TokensScreen)
            styles = screen.text._styles
            assert styles[MASKED].strike and styles[CLIPPED].italic and styles[CLIPPED].overline
            assert not styles[WORST].strike and not styles[WORST].italic
            assert all(not s.strike for i, s in enumerate(styles) if i != MASKED)
            screen.text.cursor = CLIPPED
            await pilot.pause()
            assert "objective weight 2  rules clip_high, tis_truncated" in screen.detail.plain
            screen.text.cursor = MASKED
            await pilot.pause()
            assert "objective weight 0  rules icepop_masked" in screen.detail.plain
            screen.text.cursor = WORST
            await pilot.pause()
            assert "rules none (trained plainly)" in screen.detail.plain

    asyncio.run(main())
    assert MASKED_STYLE.strike and CLIPPED_STYLE.overline


def test_traces_without_the_columns_look_as_before(tmp_path: Path) -> None:
    tokens = RunModel(build_run(tmp_path / "demo-run")).step(0).sample(0)
    masked, clipped = tokens.objective_marks()
    assert not masked.any() and not clipped.any()
