"""The `?` help screen; ``KEYS`` is also the table docs/tui.md documents."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: list[tuple[str, list[tuple[str, str]]]] = [
    ("Everywhere", [
        ("?", "this help (esc closes it)"),
        ("q", "quit"),
        ("esc / backspace", "back to the previous view"),
        ("mouse", "click a row to select it, click it again to open it; click a header to sort; "
                  "wheel scrolls; click a token to put the cursor on it"),
    ]),
    ("Steps", [
        ("↑ ↓ / j k, pgup pgdn", "move"),
        ("enter", "open the step's samples"),
        ("s / r", "sort menu: a key per column (the sorted one again reverses) / reverse the sort"),
        ("x / X", "next / previous step with a spike (red; L loss, G grad norm, Δ mismatch, R reward)"),
    ]),
    ("Samples of a step", [
        ("enter", "open the sample's tokens"),
        ("s / r", "sort menu: a key per column (the sorted one again reverses) / reverse the sort"),
        ("f", "filter: all → failed only → worst 10 by max |Δ| → all"),
        ("] / [", "next / previous step (in the steps table's order)"),
    ]),
    ("Tokens of a sample", [
        ("← → / h l", "previous / next token"),
        ("↑ ↓ / k j, pgup pgdn", "line up / down"),
        ("home end / g G", "first / last token"),
        ("w / W", "next / previous worst token by |Δ| (worst first)"),
        ("d / D", "next / previous token whose MoE routing differs (rollout vs trainer)"),
        ("t / T", "next / previous segment: prompt, assistant turn, tool/env output"),
        ("c", "colour scale: absolute |Δ| ↔ relative to the sample's max |Δ|"),
        ("] / [", "next / previous sample (in the samples table's order)"),
        ("e", "explain the token: where engine and trainer part ways, per layer and component "
              "(`axrl-debug explain`; takes seconds)"),
        ("b", "bisect the sample: the first layer and op where engine and trainer part "
              "(`axrl-debug bisect --sample`; tens of seconds)"),
    ]),
]

LEGEND = [
    ("Δ", "trainer logprob − rollout logprob (old_logprob − rollout_logprob) of a trained token"),
    ("ratio", "exp(Δ) = π/μ, the importance weight before any TIS cap"),
    ("colours", "|Δ| bins, absolute: <1e-3 plain, 1e-3, 1e-2, 0.1, ≥0.5 (darkest red); "
                "grey = prompt, blue italic = tool/env output, magenta = trained without a rollout logprob, "
                "underlined = MoE routing differs for this token"),
]


def help_renderable() -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for title, rows in KEYS:
        table.add_row(Text(title, style="bold underline"), "")
        for key, what in rows:
            table.add_row(key, what)
        table.add_row("", "")
    table.add_row(Text("Legend", style="bold underline"), "")
    for key, what in LEGEND:
        table.add_row(key, what)
    return table


class HelpScreen(ModalScreen[None]):
    """Keys of every view; esc or ? closes it (q still quits, as everywhere)."""

    BINDINGS = [Binding("escape,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(help_renderable(), id="help-body")

    def action_close(self) -> None:
        self.dismiss(None)
