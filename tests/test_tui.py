"""`axrl-debug tui` driven headless with Textual's Pilot: navigation, sorting, filtering, jumping
to the worst token / routing disagreement, the token detail of a known trace, mouse, help, quit,
and the command's bad-input exits. The trace is the one described in test_tui_trace.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
from typer.testing import CliRunner

from test_tui_trace import DISAGREE, SECOND, WORST, build_run, write_replay_dump

import textual  # noqa: E402,F401  (a dependency of axrl: a broken import fails)

from axrl_debug.tui.app import DebugApp  # noqa: E402
from axrl_debug.tui.help import HelpScreen  # noqa: E402
from axrl_debug.tui.screens import SamplesScreen, StepsScreen, TokensScreen  # noqa: E402

SIZE = (80, 24)


@pytest.fixture
def known_run(tmp_path: Path) -> Path:
    return build_run(tmp_path / "demo-run")


def drive(run: Path, body: Callable[[DebugApp, Any], Awaitable[None]], *, scan: bool = True,
          size: tuple[int, int] = SIZE, **kw: Any) -> DebugApp:
    """Run ``body(app, pilot)`` inside ``App.run_test`` once the background work has finished
    (so spike flags and scanned columns are deterministic)."""
    app = DebugApp(run, scan=scan, **kw)

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            for _ in range(600):                    # ≤ 30 s: the helper process imports pandas
                if app.background_done:
                    break
                await pilot.pause(0.05)
            assert app.background_done, "background scan did not finish"
            await pilot.pause()
            await body(app, pilot)

    asyncio.run(main())
    return app


def test_steps_view_spikes_and_scan(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        screen = app.screen
        assert isinstance(screen, StepsScreen)
        table = screen.table
        assert table.order == [0, 1, 2, 3, 4, 5]
        assert table.records[5]["spikes"] == "L▲" and table.spiked == {5: {"loss"}}
        assert table.records[0]["mismatch_max"] == pytest.approx(0.7, abs=1e-6)   # from the scan
        assert table.records[0]["routing_agreement"] < 1.0
        await pilot.press("x")                                                  # next spike
        assert table.current_key == 5
        await pilot.press("home", "down")
        assert table.current_key == 1

    drive(known_run, body)


def test_sorting_keys_and_header_click(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        from axrl_debug.tui.sort_menu import SortMenu

        table = app.steps_screen.table
        await pilot.press("down", "down")                                       # cursor on step 2
        await pilot.press("s")                                                  # the sort menu
        assert isinstance(app.screen, SortMenu)
        await pilot.press("2")                                                  # → spikes column
        assert table.sort_key == "spikes" and table.order[0] == 5
        assert table.cursor == 0 and table.current_key == 5                     # the cursor goes to the top
        await pilot.press("s", "3")                                             # → reward, biggest first
        assert table.sort_key == "reward" and table.order == [5, 4, 3, 2, 1, 0] and table.sort_desc
        await pilot.press("down", "s", "3")                                     # the same column: reversed
        assert table.order == [0, 1, 2, 3, 4, 5] and "reward↑" in table.sort_label() and table.cursor == 0
        await pilot.press("r")
        assert table.order == [5, 4, 3, 2, 1, 0]
        await pilot.press("s", "escape")                                        # esc: nothing changes
        assert table.sort_key == "reward" and app.screen is app.steps_screen
        # every column is two presses away: the last one too
        last = table.spec[-1]
        await pilot.press("s", "0" if len(table.spec) == 10 else "abcdefghijklmnop"[len(table.spec) - 11])
        assert table.sort_key == last.key
        # mouse: click the "loss" header (x = left padding + start of the column), twice
        loss = next(i for i, c in enumerate(table.spec) if c.key == "loss")
        x = 1 + table._starts[loss] + 1
        await pilot.press("down")
        await pilot.click(table, offset=(x, 0))
        assert table.sort_key == "loss" and table.order[0] == 5 and table.sort_desc and table.cursor == 0
        await pilot.click(table, offset=(x, 0))
        assert not table.sort_desc and table.order[0] == 2                      # smallest loss 0.49

    drive(known_run, body)


def test_navigation_steps_samples_tokens(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        await pilot.press("down", "enter")
        samples = app.screen
        assert isinstance(samples, SamplesScreen) and samples.model.step == 1
        assert samples.table.order == [0, 1, 2]
        await pilot.press("right_square_bracket")                              # next step, same screen
        assert samples.model.step == 2
        await pilot.press("left_square_bracket", "left_square_bracket")
        assert samples.model.step == 0
        await pilot.press("enter")
        tokens = app.screen
        assert isinstance(tokens, TokensScreen) and tokens.row == 0 and tokens.tokens.n == 46
        await pilot.press("right_square_bracket")                              # next sample in table order
        assert tokens.row == 1 and tokens.tokens.n == 15
        await pilot.press("escape")
        assert app.screen is samples
        await pilot.press("escape")
        assert isinstance(app.screen, StepsScreen) and app.screen.table.current_key == 1
        # opening again re-uses the installed screens
        await pilot.press("enter", "down", "down", "enter")
        assert app.screen is tokens and tokens.row == 2 and tokens.model.step == 1
        # mouse: a click on a row moves the cursor there, a second click opens it
        await pilot.press("escape", "escape")
        steps = app.screen.table
        await pilot.click(steps, offset=(3, 1 + 3))                             # line 0 is the header
        assert isinstance(app.screen, StepsScreen) and steps.current_key == 3
        await pilot.click(steps, offset=(3, 1 + 3))
        assert isinstance(app.screen, SamplesScreen) and app.screen.model.step == 3

    drive(known_run, body)


def test_samples_filter_failed_and_worst(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, SamplesScreen)
        await pilot.press("f")
        assert screen.filter == "failed" and screen.table.order == [1]
        await pilot.press("f")
        # worst: by max |Δ|, largest first; sample 1 has no analysed token, so no |Δ| to rank
        assert screen.filter == "worst" and screen.table.order == [0, 2] and screen.table.sort_key == "max_abs"
        await pilot.press("f")
        assert screen.filter == "all" and len(screen.table.order) == 3

    drive(known_run, body)


def test_jump_to_worst_and_token_detail(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        await pilot.press("enter", "enter")
        screen = app.screen
        assert isinstance(screen, TokensScreen)
        text, detail = screen.text, screen.detail
        assert text.cursor == 0 and "prompt" in detail.plain
        await pilot.press("w")
        assert text.cursor == WORST
        d = detail.plain
        assert "worst #1 of 19" in d and "' answer'" in d and "turn 2 · assistant" in d
        assert "rollout lp -1.5" in d and "trainer lp -0.8" in d and "Δ 0.7" in d
        assert "ratio 2.0138" in d                                              # exp(0.7)
        assert "entropy 0.5" in d and "advantage 1.25" in d and "policy v0" in d
        assert "all 2 layers agree" in d and "L0 1,2" in d
        await pilot.press("w")
        assert text.cursor == SECOND and "worst #2 of 19" in detail.plain and "Δ -0.25" in detail.plain
        await pilot.press("W")
        assert text.cursor == WORST
        await pilot.press("d")                                                  # next routing disagreement
        assert text.cursor == DISAGREE
        d = detail.plain
        assert "routing differs #1 of 1" in d and "1/2 layers differ" in d and "L1 3,4≠3,5" in d
        await pilot.press("right")                                              # the token it predicted
        assert "predicted by routing that differs" in detail.plain
        await pilot.press("t")                                                  # next segment start
        await pilot.press("end")
        assert text.cursor == 45 and "no rollout row" in detail.plain

    drive(known_run, body)


def test_token_text_segments_lag_and_mouse(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        await pilot.press("down", "down", "enter", "enter")                     # step 2: tool call from v1
        text = app.screen.text
        headers = [line.header for line in text._lines if line.header]
        assert headers == ["prompt · not trained", "turn 1 · assistant · trained · policy v1",
                           "turn 1 · tool/env output · not trained", "turn 2 · assistant · trained · policy v2"]
        await pilot.press("t")
        assert text.cursor == 15 and "lag 1" in app.screen.detail.plain         # generated by v1, step v2
        # mouse: click the first token of the answer line (scrolled into view first)
        line = int(text._token_line[39])
        text.scroll_to(y=line - 1, animate=False, immediate=True)
        await pilot.pause()
        await pilot.click(text, offset=(1 + int(text._token_col[39]), line - text.scroll_offset.y))
        assert text.cursor == 39
        await pilot.press("c")                                                  # colour scale toggles
        assert text.scale == "rel"

    drive(known_run, body)


def test_replay_dump_in_detail(known_run: Path) -> None:
    write_replay_dump(known_run, 0, 46 + 15 + 18)

    async def body(app: DebugApp, pilot: Any) -> None:
        await pilot.press("enter")
        assert app.screen.model.replay_path is not None
        assert app.screen.table.records[0]["replay_loss"] == 0.25
        await pilot.press("enter", "w")
        d = app.screen.detail.plain
        assert "replay loss_contribution 0.04 " in d and "ratio 1.5" in d and "ids" not in d

    drive(known_run, body)


def test_help_and_quit(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, StepsScreen)
        await pilot.press("enter", "question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("q")

    app = drive(known_run, body)
    assert not app.is_running and app.return_code == 0


def test_start_at_step_and_sample(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        await pilot.pause()
        assert isinstance(app.screen, TokensScreen) and app.screen.model.step == 4 and app.screen.row == 2

    drive(known_run, body, scan=False, step=4, sample=142)      # sample id 142 is row 2 of step 4


def test_damaged_step_file_is_a_notification(tmp_path: Path) -> None:
    run = build_run(tmp_path / "demo-run")
    (run / "trace" / "step_000002.h5").write_bytes(b"not hdf5")

    async def body(app: DebugApp, pilot: Any) -> None:
        assert app.run_model.unreadable == {2}                                  # found by the scan
        shown: list[str] = []
        app.notify = lambda message, **kw: shown.append(str(message))           # type: ignore[method-assign]
        await pilot.press("down", "down", "enter")
        assert isinstance(app.screen, StepsScreen)                              # stayed; error shown
        assert any(m.startswith("step 2:") and "cannot open as HDF5" in m for m in shown)

    drive(run, body)


def test_wide_terminal_puts_detail_beside_text(known_run: Path) -> None:
    async def body(app: DebugApp, pilot: Any) -> None:
        await pilot.press("enter", "enter")
        text, detail = app.screen.text, app.screen.detail
        assert detail.region.x > text.region.x and detail.region.y == text.region.y

    drive(known_run, body, size=(140, 30))


def test_cli_bad_input_exits_2(tmp_path: Path, known_run: Path) -> None:
    from axrl_debug.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["tui", str(tmp_path / "nope")])
    assert res.exit_code == 2
    res = runner.invoke(app, ["tui", str(known_run), "--step", "99"])
    assert res.exit_code == 2 and "nearest" in res.output
    res = runner.invoke(app, ["tui", str(known_run), "--sample", "1"])
    assert res.exit_code == 2
    # --sample is a sample id (as everywhere a user types one), not a row number
    res = runner.invoke(app, ["tui", str(known_run), "--step", "4", "--sample", "2"])
    assert res.exit_code == 2 and "no sample id 2" in res.output and "140-142" in res.output
    # a good command line, but no terminal: refused instead of drawing to nowhere
    res = runner.invoke(app, ["tui", str(known_run), "--step", "4", "--sample", "142"])
    assert res.exit_code == 2 and "needs a terminal" in res.output
