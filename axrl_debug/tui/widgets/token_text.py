"""The tokens of one sample in reading order, coloured by |Δ| (struck through where a correction
masked the token, italic + overlined where the objective hard-clipped it), with a token cursor.

Rendered with Textual's line API (``render_line``) over a layout computed here: the widget wraps
the token pieces itself, so it knows which cell belongs to which token — what the cursor keys
(up/down by visual line), mouse clicks and "scroll the cursor into view" need — and it renders
only the visible lines, so a 30,000-token agent trajectory moves as fast as a short answer.

Segments (the prompt, each assistant turn, each tool/environment output) start on a new line
under a rule that names them, so trained and untrained text are never mixed on one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.events import Click, Resize
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ..data import SampleTokens, display_piece
from ..metrics import delta_bins, worst_order

# Background per |Δ| bin (0 calm .. 4 worst); foreground switches to white on the dark reds.
BIN_STYLES = [
    Style(),
    Style(bgcolor="#4a4a00"),
    Style(bgcolor="#875f00", color="white"),
    Style(bgcolor="#af3a00", color="white", bold=True),
    Style(bgcolor="#d70000", color="white", bold=True),
]
PROMPT_STYLE = Style(color="grey58")
ENV_STYLE = Style(color="#5fafd7", italic=True)        # tool / environment output
UNSCORED_STYLE = Style(color="magenta")                # trained but no rollout logprob to compare
DISAGREE_STYLE = Style(underline=True)                 # MoE routing differs (rollout vs trainer)
MASKED_STYLE = Style(strike=True, dim=True)            # a correction gave the token weight 0 (MIS, veto, IcePop)
CLIPPED_STYLE = Style(italic=True, overline=True)      # the objective hard-clipped it (no gradient)
CURSOR_STYLE = Style(reverse=True, bold=True)
HEADER_STYLES = {"prompt": Style(color="grey70", bgcolor="grey23", bold=True),
                 "assistant": Style(color="black", bgcolor="#87af87", bold=True),
                 "tool/env": Style(color="black", bgcolor="#5fafd7", bold=True)}


@dataclass
class _Line:
    """One visual line: a segment rule (``header``) or token pieces ``(token, text, column)``."""

    header: str | None = None
    kind: str = ""
    pieces: list[tuple[int, str, int]] = field(default_factory=list)


def split_cells(text: str, width: int) -> list[str]:
    """``text`` cut into pieces of at most ``width`` cells (a token longer than the screen)."""
    out, cur, n = [], "", 0
    for ch in text:
        w = cell_len(ch)
        if n + w > width and cur:
            out.append(cur)
            cur, n = "", 0
        cur += ch
        n += w
    return out + [cur] if cur else out or [""]


class TokenText(ScrollView, can_focus=True):
    """Token cursor over one sample. Posts ``CursorMoved`` whenever the cursor changes."""

    BINDINGS = [
        Binding("left,h", "move(-1)", "←", show=False),
        Binding("right,l", "move(1)", "→", show=False),
        Binding("up,k", "line(-1)", "↑", show=False),
        Binding("down,j", "line(1)", "↓", show=False),
        Binding("pageup", "line(-10)", show=False),
        Binding("pagedown", "line(10)", show=False),
        Binding("home,g", "first", show=False),
        Binding("end,G", "last", show=False),
        Binding("w", "worst(1)", "worst"),
        Binding("W", "worst(-1)", "prev worst", show=False),
        Binding("d", "disagree(1)", "route≠"),
        Binding("D", "disagree(-1)", "prev route≠", show=False),
        Binding("t", "segment(1)", "turn"),
        Binding("T", "segment(-1)", "prev turn", show=False),
        Binding("c", "scale", "colours"),
    ]

    cursor: reactive[int] = reactive(0, always_update=True)

    class CursorMoved(Message):
        """The token under the cursor changed; ``note`` says why (e.g. "worst #2 of 57")."""

        def __init__(self, index: int, note: str = "") -> None:
            super().__init__()
            self.index = index
            self.note = note

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.tokens: SampleTokens | None = None
        self.scale = "abs"
        self._lines: list[_Line] = []
        self._token_line = np.zeros(0, np.int64)
        self._token_col = np.zeros(0, np.int64)
        self._styles: list[Style] = []
        self._layout_width = 0
        self._worst = np.zeros(0, np.int64)
        self._worst_pos = -1
        self._disagree = np.zeros(0, np.int64)
        self._seg_starts = np.zeros(0, np.int64)
        self._note = ""

    # ---- content
    def set_tokens(self, tokens: SampleTokens, cursor: int = 0) -> None:
        self.tokens = tokens
        self._worst = worst_order(tokens.delta)
        self._worst_pos = -1
        self._disagree = np.flatnonzero(tokens.disagrees())
        seg = tokens.segments()
        self._seg_starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]]) if seg.size else seg
        self._restyle()
        self._layout(self._text_width())
        self._note = ""
        self.cursor = min(max(cursor, 0), max(tokens.n - 1, 0))

    def _restyle(self) -> None:
        """Per-token styles (computed once per sample / colour scale, not per frame)."""
        t = self.tokens
        if t is None:
            self._styles = []
            return
        bins = delta_bins(t.delta, self.scale)
        lm = t.data.get("loss_mask", np.zeros(t.n, np.uint8)) != 0
        turn = t.data.get("turn", np.zeros(t.n, np.int16))
        dis = t.disagrees()
        masked, clipped = t.objective_marks()
        styles = []
        for i in range(t.n):
            if bins[i] >= 0:
                s = BIN_STYLES[int(bins[i])]
            elif lm[i]:
                s = UNSCORED_STYLE
            elif turn[i] == 0:
                s = PROMPT_STYLE
            else:
                s = ENV_STYLE
            if masked[i]:
                s = s + MASKED_STYLE
            elif clipped[i]:
                s = s + CLIPPED_STYLE
            styles.append(s + DISAGREE_STYLE if dis[i] else s)
        self._styles = styles

    def _header(self, i: int) -> tuple[str, str]:
        t = self.tokens
        assert t is not None
        kind = t.segment_kind(i)
        turn = int(t.get("turn", i, 0))
        if kind == "prompt":
            return "prompt · not trained", kind
        if kind == "assistant":
            pv = int(t.get("policy_version", i, -1))
            return f"turn {turn} · assistant · trained" + (f" · policy v{pv}" if pv >= 0 else ""), kind
        return f"turn {turn} · tool/env output · not trained", kind

    def _layout(self, width: int) -> None:
        """Wrap the pieces at ``width`` cells; a '\\n' in a token ends its line after the ↵ mark."""
        t = self.tokens
        self._layout_width = width
        self._lines = []
        if t is None or width <= 0:
            self.virtual_size = Size(max(width, 0), 0)
            return
        n = t.n
        line_of = np.zeros(n, np.int64)
        col_of = np.zeros(n, np.int64)
        lines: list[_Line] = []
        cur: _Line | None = None
        col = 0
        starts = set(self._seg_starts.tolist())
        for i in range(n):
            if i in starts:
                title, kind = self._header(i)
                lines.append(_Line(header=title, kind=kind))
                cur, col = None, 0
            raw = t.text[i]
            piece = display_piece(raw)
            breaks = raw.endswith("\n")
            w = cell_len(piece)
            if cur is None or (col + w > width and col > 0):
                cur = _Line()
                lines.append(cur)
                col = 0
            first = True
            for part in (split_cells(piece, width) if w > width else [piece]):
                if not first:
                    cur = _Line()
                    lines.append(cur)
                    col = 0
                if first:
                    line_of[i], col_of[i] = len(lines) - 1, col
                    first = False
                cur.pieces.append((i, part, col))
                col += cell_len(part)
            if breaks:
                cur, col = None, 0
        self._lines = lines
        self._token_line, self._token_col = line_of, col_of
        self.virtual_size = Size(width, len(lines))
        self.refresh()

    def _text_width(self) -> int:
        """Cells available for text: the content width minus the (always reserved) scrollbar
        gutter, so that a scrollbar appearing never changes the wrapping."""
        return max(self.scrollable_content_region.width, 0)

    def on_resize(self, event: Resize) -> None:
        width = self._text_width()
        if width != self._layout_width:
            self._layout(width)
            self._scroll_to_cursor(center=False)

    # ---- rendering
    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self._layout_width
        base = self.rich_style
        idx = scroll_y + y
        if idx >= len(self._lines):
            return Strip.blank(width, base)
        line = self._lines[idx]
        if line.header is not None:
            text = f"── {line.header} "
            text = text + "─" * max(0, width - cell_len(text))
            return Strip([Segment(text, base + HEADER_STYLES.get(line.kind, Style()))]).crop_extend(0, width, base)
        cursor = self.cursor
        segs = []
        for i, piece, _ in line.pieces:
            style = base + self._styles[i]
            if i == cursor:
                style = style + CURSOR_STYLE
            segs.append(Segment(piece, style))
        return Strip(segs).crop_extend(scroll_x, scroll_x + width, base)

    # ---- cursor
    def watch_cursor(self, old: int, new: int) -> None:
        if self.tokens is None:
            return
        self._scroll_to_cursor(center=bool(self._note))
        self.refresh()
        self.post_message(self.CursorMoved(new, self._note))
        self._note = ""

    def _scroll_to_cursor(self, center: bool) -> None:
        if self.tokens is None or not self.tokens.n or not len(self._token_line):
            return
        i = self.cursor
        region = Region(int(self._token_col[i]), int(self._token_line[i]), 1, 1)
        self.scroll_to_region(region, animate=False, center=center, immediate=True)

    def _go(self, index: int, note: str = "") -> None:
        if self.tokens is None or not self.tokens.n:
            return
        self._note = note
        self.cursor = int(min(max(index, 0), self.tokens.n - 1))

    def action_move(self, step: int) -> None:
        self._go(self.cursor + step)

    def action_first(self) -> None:
        self._go(0)

    def action_last(self) -> None:
        self._go(self.tokens.n - 1 if self.tokens else 0)

    def action_line(self, delta: int) -> None:
        """Up/down by visual lines, landing on the token nearest the cursor's column."""
        if self.tokens is None or not self.tokens.n:
            return
        line = int(self._token_line[self.cursor]) + delta
        col = int(self._token_col[self.cursor])
        step = 1 if delta > 0 else -1
        while 0 <= line < len(self._lines) and self._lines[line].header is not None:
            line += step  # rules hold no tokens
        if not 0 <= line < len(self._lines):
            self._go(self.tokens.n - 1 if delta > 0 else 0)
            return
        self._go(self._nearest_on_line(line, col))

    def _nearest_on_line(self, line: int, col: int) -> int:
        pieces = self._lines[line].pieces
        for i, text, c in pieces:
            if c <= col < c + cell_len(text):
                return i
        return pieces[-1][0] if col >= pieces[-1][2] else pieces[0][0]

    def action_worst(self, direction: int) -> None:
        """Walk the analysed tokens by |Δ|, worst first: w → next worse-ranked, W → back."""
        n = len(self._worst)
        if n == 0:
            self.notify("no analysed tokens (loss_mask = 1 with both logprobs) in this sample",
                        severity="warning", timeout=3)
            return
        self._worst_pos = (self._worst_pos + direction) % n if self._worst_pos >= 0 or direction > 0 \
            else n - 1
        self._go(int(self._worst[self._worst_pos]), f"worst #{self._worst_pos + 1} of {n}")

    def action_disagree(self, direction: int) -> None:
        """Next (d) / previous (D) token whose MoE routing differs between rollout and trainer."""
        rows = self._disagree
        if rows.size == 0:
            msg = "no routing disagreement in this sample" if self.tokens is not None and \
                self.tokens.layer_agree is not None else "no MoE routing recorded for this sample"
            self.notify(msg, severity="warning", timeout=3)
            return
        if direction > 0:
            nxt = rows[rows > self.cursor]
            target = int(nxt[0]) if nxt.size else int(rows[0])
        else:
            prv = rows[rows < self.cursor]
            target = int(prv[-1]) if prv.size else int(rows[-1])
        k = int(np.searchsorted(rows, target)) + 1
        self._go(target, f"routing differs #{k} of {rows.size}")

    def action_segment(self, direction: int) -> None:
        """Start of the next (t) / previous (T) segment: prompt, assistant turn, tool output."""
        s = self._seg_starts
        if s.size == 0:
            return
        if direction > 0:
            nxt = s[s > self.cursor]
            self._go(int(nxt[0]) if nxt.size else int(s[-1]))
        else:
            prv = s[s < self.cursor]
            self._go(int(prv[-1]) if prv.size else 0)

    def action_scale(self) -> None:
        """Toggle the colour scale: absolute |Δ| bins ↔ relative to this sample's max |Δ|."""
        self.scale = "rel" if self.scale == "abs" else "abs"
        self._restyle()
        self.refresh()
        self.post_message(self.CursorMoved(self.cursor, f"colour scale: {self.scale}"))

    # ---- mouse
    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or self.tokens is None:
            return
        scroll_x, scroll_y = self.scroll_offset
        line = offset.y + scroll_y
        if 0 <= line < len(self._lines) and self._lines[line].pieces:
            self._go(self._nearest_on_line(line, offset.x + scroll_x))
