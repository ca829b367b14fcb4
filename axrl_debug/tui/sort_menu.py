"""The sort menu (`s`): every column of a table behind one key, so any sort is two key presses.

Picking the column the table is already sorted by reverses it; any other column sorts in its
natural direction ("bigger is more interesting" first, step and ids ascending).
"""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from .widgets.sortable_table import SortableTable

HOTKEYS = "1234567890abcdefghijklmnoprstuvwxyz"  # no q: q quits everywhere


class SortMenu(ModalScreen[str | None]):
    """Columns of ``table`` with their keys; dismisses with the chosen column's key (None: esc)."""

    BINDINGS = [Binding("escape,s", "close", "close")]

    def __init__(self, table: SortableTable) -> None:
        super().__init__()
        self.columns = table.spec[:len(HOTKEYS)]
        self.current = table.sort_key
        arrow = "↓" if table.sort_desc else "↑"
        self.options = [Option(f"{HOTKEYS[i]}  {c.label.strip()}"
                               + (f"  {arrow} (again: reverse)" if c.key == self.current else ""), id=c.key)
                        for i, c in enumerate(self.columns)]

    def compose(self) -> ComposeResult:
        menu = OptionList(*self.options, id="sort-menu")
        menu.border_title = "sort by"
        yield menu

    def on_mount(self) -> None:
        menu = self.query_one(OptionList)
        menu.highlighted = next(i for i, c in enumerate(self.columns) if c.key == self.current)
        menu.focus()

    def on_key(self, event: events.Key) -> None:
        if event.character and event.character in HOTKEYS[:len(self.columns)]:
            event.stop()
            self.dismiss(self.columns[HOTKEYS.index(event.character)].key)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_close(self) -> None:
        self.dismiss(None)
