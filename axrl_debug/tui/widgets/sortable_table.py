"""A sortable table of records that renders only the rows on screen.

Why not Textual's ``DataTable``: it measures every cell of every row to size its columns, which
for a 1,000-step run (13,000 cells) costs ~0.5 s per (re)build on these CPUs — on every sort and
every time spike flags arrive — and grows with the run. Here columns have fixed widths, cells
are formatted when their line is drawn (Textual's line API, ``render_line``), and a sort is a
Python ``list.sort`` over the raw values. Opening a 100,000-step run costs the same as a
10-step one.

Sorting uses the raw record values, not the rendered text; missing values (None / NaN) always
sort last, in either direction, so "worst first" never starts with a page of dashes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.events import Click
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip


@dataclass(frozen=True)
class Column:
    """One table column: ``key`` into the record, header ``label``, cell formatter, width in cells
    and the direction a first sort uses (``descending=True``: "bigger is more interesting")."""

    key: str
    label: str
    fmt: Callable[[Any], str]
    width: int = 8
    descending: bool = True
    align: str = "left"


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _fit(text: str, width: int, align: str) -> str:
    """``text`` cut (with …) or padded to exactly ``width`` cells."""
    n = cell_len(text)
    if n > width:
        out, used = "", 0
        for ch in text:
            w = cell_len(ch)
            if used + w > width - 1:
                break
            out += ch
            used += w
        return out + "…" + " " * (width - used - 1)
    pad = " " * (width - n)
    return pad + text if align == "right" else text + pad


class SortableTable(ScrollView, can_focus=True):
    """Row-cursor table over ``records`` (dicts) keyed by a hashable id; header always visible."""

    GAP = 2  # cells between columns

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "sortable-table--header", "sortable-table--cursor", "sortable-table--zebra",
    }
    DEFAULT_CSS = """
    SortableTable {
        height: 1fr;
        padding: 0 0 0 1;
        background: $surface;
    }
    SortableTable > .sortable-table--header {
        text-style: bold;
        background: $panel;
        color: $foreground;
    }
    SortableTable > .sortable-table--cursor {
        background: $block-cursor-blurred-background;
    }
    SortableTable:focus > .sortable-table--cursor {
        background: $block-cursor-background;
        color: $block-cursor-foreground;
        text-style: bold;
    }
    SortableTable > .sortable-table--zebra {
        background: $surface-lighten-1;
    }
    """

    BINDINGS = [
        Binding("up,k", "cursor(-1)", "up", show=False),
        Binding("down,j", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", show=False),
        Binding("pagedown", "page(1)", show=False),
        Binding("home", "first", show=False),
        Binding("end", "last", show=False),
        Binding("left", "scroll_left", show=False),
        Binding("right", "scroll_right", show=False),
        Binding("enter", "select", "open"),
    ]

    cursor: reactive[int] = reactive(0, always_update=True)

    class SortChanged(Message):
        """The sort column or direction changed (the screen updates its status line)."""

        def __init__(self, table: "SortableTable") -> None:
            super().__init__()
            self.table = table

    class RowSelected(Message):
        """Enter (or a click on the cursor row): open ``key``."""

        def __init__(self, table: "SortableTable", key: Hashable) -> None:
            super().__init__()
            self.table = table
            self.key = key

    class RowHighlighted(Message):
        """The cursor moved to ``key``."""

        def __init__(self, table: "SortableTable", key: Hashable | None) -> None:
            super().__init__()
            self.table = table
            self.key = key

    def __init__(self, columns: list[Column], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.spec = columns
        self.records: dict[Hashable, dict[str, Any]] = {}
        self.order: list[Hashable] = []          # keys as displayed (after sort and filter)
        self.sort_key: str = columns[0].key
        self.sort_desc: bool = False
        self.row_filter: Callable[[Hashable, dict[str, Any]], bool] | None = None
        self._starts: list[int] = []
        x = 0
        for c in columns:
            self._starts.append(x)
            x += c.width + self.GAP
        self._total_width = x

    # ---- hooks for subclasses
    def cell_style(self, key: Hashable, column: Column, record: dict[str, Any]) -> Style | None:
        """Extra style of a cell (e.g. spikes in red); None for the row's default."""
        return None

    # ---- data
    def set_records(self, records: dict[Hashable, dict[str, Any]], *, keep: Hashable | None = None) -> None:
        """Replace every row; the cursor stays on ``keep`` (default: the current row) if shown."""
        if keep is None:
            keep = self.current_key
        self.records = records
        self._rebuild(keep)

    def _sorted_keys(self) -> list[Hashable]:
        keys = [k for k, r in self.records.items() if self.row_filter is None or self.row_filter(k, r)]
        col = self.sort_key
        have = [k for k in keys if not _missing(self.records[k].get(col))]
        missing = [k for k in keys if _missing(self.records[k].get(col))]

        def value(k: Hashable) -> Any:
            v = self.records[k].get(col)
            return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))

        # list.sort is stable even with reverse=True: ties keep record order (ascending step / row)
        have.sort(key=value, reverse=self.sort_desc)
        return have + missing

    def _rebuild(self, keep: Hashable | None) -> None:
        self.order = self._sorted_keys()
        self.virtual_size = Size(self._total_width, len(self.order) + 1)  # + the header line
        if keep is not None and keep in self.order:
            self.cursor = self.order.index(keep)
        else:
            self.cursor = 0
        self.refresh()

    def refresh_rows(self, keys: Any = None) -> None:
        """Redraw after records changed in place (no re-sort: rows do not jump under the cursor
        while a background scan fills values in). Only visible lines are drawn anyway."""
        self.refresh()

    # ---- cursor
    @property
    def current_key(self) -> Hashable | None:
        if not self.order or not 0 <= self.cursor < len(self.order):
            return None
        return self.order[self.cursor]

    @property
    def cursor_row(self) -> int:
        return self.cursor

    def select_key(self, key: Hashable) -> bool:
        if key in self.order:
            self.cursor = self.order.index(key)
            return True
        return False

    def move_cursor(self, row: int) -> None:
        self.cursor = row

    def validate_cursor(self, value: int) -> int:
        return max(0, min(value, len(self.order) - 1)) if self.order else 0

    def watch_cursor(self, old: int, new: int) -> None:
        self._scroll_to_cursor()
        self.refresh()
        self.post_message(self.RowHighlighted(self, self.current_key))

    def _scroll_to_cursor(self) -> None:
        # row r is virtual line r + 1; keep it below the (fixed) header line
        height = self.scrollable_content_region.height
        top = self.scroll_offset.y
        line = self.cursor + 1
        if line < top + 1:
            self.scroll_to(y=line - 1, animate=False, immediate=True)
        elif line > top + height - 1:
            self.scroll_to(y=line - height + 1, animate=False, immediate=True)

    def on_resize(self) -> None:
        self._scroll_to_cursor()

    def action_cursor(self, delta: int) -> None:
        self.cursor = self.cursor + delta

    def action_page(self, direction: int) -> None:
        self.cursor = self.cursor + direction * max(1, self.scrollable_content_region.height - 2)

    def action_first(self) -> None:
        self.cursor = 0

    def action_last(self) -> None:
        self.cursor = len(self.order) - 1

    def action_select(self) -> None:
        key = self.current_key
        if key is not None:
            self.post_message(self.RowSelected(self, key))

    # ---- sorting / filtering
    def sort_by(self, key: str, descending: bool | None = None) -> None:
        """Sort by column ``key``: ``descending`` as given, else the reverse of the current sort when
        ``key`` is the sort column already, else the column's natural direction. Cursor to the top."""
        col = next(c for c in self.spec if c.key == key)
        if descending is None:
            descending = (not self.sort_desc) if key == self.sort_key else col.descending
        self.sort_key, self.sort_desc = key, descending
        self._rebuild(None)  # the cursor goes to the top: a fresh sort is read from its first row
        self.post_message(self.SortChanged(self))

    def reverse_sort(self) -> None:
        self.sort_by(self.sort_key, not self.sort_desc)

    def set_filter(self, fn: Callable[[Hashable, dict[str, Any]], bool] | None) -> None:
        self.row_filter = fn
        self._rebuild(self.current_key)

    def sort_label(self) -> str:
        col = next(c for c in self.spec if c.key == self.sort_key)
        return f"{col.label.strip()}{'↓' if self.sort_desc else '↑'}"

    # ---- rendering
    def _line_text(self, cells: list[tuple[str, Style | None]], base: Style) -> Strip:
        segs: list[Segment] = []
        gap = " " * self.GAP
        for text, style in cells:
            segs.append(Segment(text, base + style if style is not None else base))
            segs.append(Segment(gap, base))
        return Strip(segs)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        base = self.rich_style
        if y == 0:  # header: fixed vertically, scrolls horizontally with the rows
            hs = base + self.get_component_rich_style("sortable-table--header")
            cells = []
            for c in self.spec:
                label = c.label + (("↓" if self.sort_desc else "↑") if c.key == self.sort_key else "")
                cells.append((_fit(label, c.width, c.align), None))
            return self._line_text(cells, hs).crop_extend(scroll_x, scroll_x + width, hs)
        row = scroll_y + y - 1
        if row >= len(self.order):
            return Strip.blank(width, base)
        key = self.order[row]
        rec = self.records[key]
        if row == self.cursor:
            style = base + self.get_component_rich_style("sortable-table--cursor")
        elif row % 2:
            style = base + self.get_component_rich_style("sortable-table--zebra")
        else:
            style = base
        cells = [(_fit(c.fmt(rec.get(c.key)), c.width, c.align), self.cell_style(key, c, rec)) for c in self.spec]
        return self._line_text(cells, style).crop_extend(scroll_x, scroll_x + width, style)

    # ---- mouse
    def on_click(self, event: Click) -> None:
        """Header: sort by that column (again: reverse). Row: move the cursor; on the cursor row:
        open it (so a double click opens too)."""
        offset = event.get_content_offset(self)
        if offset is None:
            return
        scroll_x, scroll_y = self.scroll_offset
        if offset.y == 0:
            x = offset.x + scroll_x
            for c, start in zip(self.spec, self._starts):
                if start <= x < start + c.width + self.GAP:
                    self.sort_by(c.key)
                    break
            return
        row = scroll_y + offset.y - 1
        if 0 <= row < len(self.order):
            if row == self.cursor or event.chain >= 2:
                self.cursor = row
                self.action_select()
            else:
                self.cursor = row

    def region_of_row(self, row: int) -> Region:
        return Region(0, row + 1, self._total_width, 1)
