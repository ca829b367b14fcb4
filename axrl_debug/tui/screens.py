"""The three views — steps, samples of a step, tokens of a sample — as Textual screens.

Enter drills down (pushes the next screen), esc goes back (pops it), so the steps table keeps
its sort and cursor while the user looks at a step, and the samples table while they look at a
sample. Each screen reads only what it shows: the steps screen ``metrics.jsonl`` (already parsed
by ``RunModel``), the samples screen one step file, the tokens screen one sample's token range.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable

import numpy as np

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Container, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Header, Static

from axrl.trace import TraceError

from .data import RunModel, SampleTokens, StepModel
from .metrics import ABS_EDGES, REL_EDGES
from .widgets.samples_table import WORST_N, SamplesTable, sample_records
from .widgets.sortable_table import SortableTable
from .widgets.sparklines import SPARK_METRICS, MetricSparklines
from .widgets.steps_table import StepsTable, spike_text
from .widgets.token_detail import TokenDetail
from .widgets.token_text import BIN_STYLES, DISAGREE_STYLE, ENV_STYLE, PROMPT_STYLE, TokenText

if TYPE_CHECKING:
    from .app import DebugApp

# What reading a damaged or vanished step file can raise (shown as a notification, never a crash).
READ_ERRORS = (TraceError, OSError, KeyError, ValueError)


class _View(Screen):
    """Shared bits: the status line and the back key (esc / backspace)."""

    BINDINGS = [Binding("escape,backspace", "back", "back", show=False)]

    @property
    def debug_app(self) -> "DebugApp":
        return self.app  # type: ignore[return-value]

    def set_status(self, text: str | Text) -> None:
        self.query_one("#status", Static).update(text)

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 1:
            self.app.pop_screen()


# ============================================================================ steps
class _TableView(_View):
    """A screen around one SortableTable: sort keys, and enter/click opens the current row."""

    table: SortableTable

    def update_status(self) -> None:
        raise NotImplementedError

    def open_row(self, key: Hashable, order: list[Hashable]) -> None:
        raise NotImplementedError

    def on_sortable_table_sort_changed(self, event: SortableTable.SortChanged) -> None:
        self.update_status()

    def on_sortable_table_row_selected(self, event: SortableTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        key = self.table.current_key
        if key is not None:
            self.open_row(key, list(self.table.order))

    def action_sort(self) -> None:
        """The sort menu: one key per column (the sorted one again: reverse)."""
        from .sort_menu import SortMenu

        def chosen(key: str | None) -> None:
            if key is not None:
                self.table.sort_by(key)
            self.table.focus()

        self.app.push_screen(SortMenu(self.table), chosen)

    def action_reverse(self) -> None:
        self.table.reverse_sort()


class StepsScreen(_TableView):
    """All steps of the run: sparklines of the key metrics above a sortable table."""

    BINDINGS = [
        Binding("s", "sort", "sort"),
        Binding("r", "reverse", "reverse"),
        Binding("x", "spike(1)", "next spike"),
        Binding("X", "spike(-1)", "prev spike", show=False),
    ]

    def __init__(self, run: RunModel) -> None:
        super().__init__()
        self.run = run
        self.scan_state = ""

    def compose(self) -> ComposeResult:
        yield Header(icon="")
        yield Static("", id="status", classes="status")
        yield MetricSparklines(id="sparklines")
        yield StepsTable(id="steps")
        yield Footer()

    @property
    def table(self) -> StepsTable:
        return self.query_one("#steps", StepsTable)

    def on_mount(self) -> None:
        self.reload()
        self.table.focus()

    def _records(self) -> dict[Hashable, dict]:
        run = self.run
        return {s: {"step": s, **run.rows[s], "spikes": spike_text(run.spikes.get(s, []))} for s in run.steps}

    def reload(self) -> None:
        """(Re)build the table and sparklines from ``RunModel.rows`` (cursor stays on its step)."""
        run = self.run
        table = self.table
        table.spiked = {s: {sp["metric"] for sp in v} for s, v in run.spikes.items()}
        table.set_records(self._records())
        self.query_one(MetricSparklines).set_series({k: run.series(k) for k, _ in SPARK_METRICS})
        self.update_status()

    def update_rows(self, steps: list[int]) -> None:
        """Background scan results: refresh those rows in place (no re-sort under the cursor)."""
        table = self.table
        for s in steps:
            if s in table.records:
                table.records[s].update(self.run.rows[s])
        table.refresh_rows(steps)
        self.update_status()

    def update_status(self) -> None:
        run = self.run
        n = len(run.steps)
        spikes = len(run.spikes)
        # short: it must fit 80 columns with the scan progress
        status = Text()
        status.append(f"{n} steps", "bold")
        status.append(f" · by {self.table.sort_label()}")
        if spikes:
            status.append(f" · {spikes} with spikes (x)", "bold red")
        if self.scan_state:
            status.append(f" · {self.scan_state}", "dim")
        self.set_status(status)

    def open_row(self, step: Hashable, order: list[Hashable]) -> None:
        self.debug_app.open_step(int(step), [int(s) for s in order])  # type: ignore[arg-type]

    def action_spike(self, direction: int) -> None:
        """Next / previous row (in the table's order) whose step has a spike flag."""
        order = self.table.order
        flagged = [i for i, s in enumerate(order) if self.run.spikes.get(int(s))]  # type: ignore[arg-type]
        if not flagged:
            self.notify("no spikes detected (robust z > 5 on loss, grad norm, mismatch or reward)",
                        severity="information", timeout=3)
            return
        cur = self.table.cursor_row
        if direction > 0:
            nxt = [i for i in flagged if i > cur]
            target = nxt[0] if nxt else flagged[0]
        else:
            prv = [i for i in flagged if i < cur]
            target = prv[-1] if prv else flagged[-1]
        self.table.move_cursor(target)


# ============================================================================ samples
_FILTERS = ("all", "failed", "worst")


class SamplesScreen(_TableView):
    """The samples of one step; ] and [ move to the next / previous step without going back."""

    BINDINGS = [
        Binding("s", "sort", "sort"),
        Binding("r", "reverse", "reverse"),
        Binding("f", "filter", "filter"),
        Binding("right_square_bracket", "step(1)", "next step"),
        Binding("left_square_bracket", "step(-1)", "prev step", show=False),
        Binding("escape,backspace", "back", "back"),
    ]

    def __init__(self, run: RunModel, model: StepModel, step_order: list[int]) -> None:
        super().__init__()
        self.run = run
        self.model = model
        self.step_order = step_order
        self.filter = "all"

    def compose(self) -> ComposeResult:
        yield Header(icon="")
        yield Static("", id="status", classes="status")
        yield SamplesTable(replay=True, id="samples")
        yield Footer()

    @property
    def table(self) -> SamplesTable:
        return self.query_one("#samples", SamplesTable)

    def on_mount(self) -> None:
        self.show_step(self.model)
        self.table.focus()

    def show_step(self, model: StepModel) -> None:
        self.model = model
        self.table.set_records(sample_records(model), keep=0)
        self._apply_filter()
        for p in model.problems:
            self.notify(p, severity="warning", timeout=6)
        if model.routing_pending:       # a large MoE step: its routing column after the first screen
            self._fill_visible_routing()

    def _fill_visible_routing(self) -> None:
        """The routing column of the rows on screen, in a worker: only their routing is read (a
        1 M-token step's whole routing takes seconds); rows come in as the cursor brings them."""
        model, table = self.model, self.table
        if not model.routing_pending:
            return
        top = int(table.scroll_offset.y)
        rows = [int(k) for k in table.order[top:top + max(1, self.app.size.height)]]
        self.run_worker(lambda: self._fill_routing(model, rows), thread=True, exclusive=True, group="routing")

    def on_sortable_table_row_highlighted(self, event: SortableTable.RowHighlighted) -> None:
        self._fill_visible_routing()

    def _fill_routing(self, model: StepModel, rows: list[int]) -> None:
        try:
            if not model.fill_routing(rows=rows):
                return                  # nothing new on screen: the table stays as it is
        except READ_ERRORS as e:
            self.app.call_from_thread(self.notify, f"routing of step {model.step}: {e}", severity="warning", timeout=6)
            return
        self.app.call_from_thread(self._routing_filled, model)

    def _routing_filled(self, model: StepModel) -> None:
        if self.model is model:
            self.table.set_records(sample_records(model))
            self._apply_filter()

    def update_status(self) -> None:
        m = self.model
        failed = sum(1 for r in self.table.records.values() if r.get("status") not in ("ok", None, ""))
        status = Text()
        status.append(f"step {m.step}", "bold")
        status.append(f" · v{m.policy_version} · {m.num_samples} samples")
        if failed:
            status.append(f" ({failed} failed)", "bold red")
        status.append(f" · {m.num_tokens} tok · by {self.table.sort_label()}")
        if self.filter != "all":
            status.append(f" · {self.filter}: {len(self.table.order)} shown", "bold yellow")
        if m.replay_path is not None:
            status.append(" · replay", "bold magenta")
        self.set_status(status)

    def _apply_filter(self) -> None:
        table = self.table
        if self.filter == "failed":
            table.set_filter(lambda k, r: r.get("status") not in ("ok", None, ""))
        elif self.filter == "worst":
            ranked = sorted((r for r in table.records.values() if r["max_abs"] == r["max_abs"]),
                            key=lambda r: -r["max_abs"])[:WORST_N]
            keep = {r["row"] for r in ranked}
            table.sort_key, table.sort_desc = "max_abs", True
            table.set_filter(lambda k, r: k in keep)
        else:
            table.set_filter(None)
        self.update_status()

    def open_row(self, row: Hashable, order: list[Hashable]) -> None:
        self.debug_app.open_sample(self.model, int(row), [int(r) for r in order])  # type: ignore[arg-type]

    def action_filter(self) -> None:
        self.filter = _FILTERS[(_FILTERS.index(self.filter) + 1) % len(_FILTERS)]
        self._apply_filter()
        if not self.table.order:
            self.notify(f"no {self.filter} samples in step {self.model.step}", timeout=3)

    def action_step(self, direction: int) -> None:
        order = self.step_order
        if self.model.step not in order:
            return
        i = order.index(self.model.step) + direction
        if not 0 <= i < len(order):
            self.notify("first step" if direction < 0 else "last step", timeout=2)
            return
        model = self.debug_app.load_step(order[i])
        if model is not None:
            self.show_step(model)


# ============================================================================ tokens
def legend(scale: str) -> Text:
    """One-line colour key of the token view (fits 80 columns)."""
    t = Text()
    if scale == "abs":
        t.append("|Δ|:")
        labels = ["<1e-3"] + [f"≥{e:g}" for e in ABS_EDGES]
    else:
        t.append("|Δ|/max:")
        labels = ["<.1"] + [f"≥{e:g}" for e in REL_EDGES]
    for style, label in zip(BIN_STYLES, labels):
        t.append(" ")
        t.append(label, style)
    t.append(" │ ")
    t.append("prompt", PROMPT_STYLE)
    t.append(" ")
    t.append("tool/env", ENV_STYLE)
    t.append(" ")
    t.append("route≠", DISAGREE_STYLE)
    return t


class TokensScreen(_View):
    """One sample's tokens (left/top) and the detail of the token under the cursor."""

    BINDINGS = [
        Binding("right_square_bracket", "sample(1)", "next sample"),
        Binding("left_square_bracket", "sample(-1)", "prev sample", show=False),
        Binding("e", "explain", "explain"),
        Binding("b", "bisect", "bisect", show=False),
        Binding("escape,backspace", "back", "back"),
    ]

    def __init__(self, run: RunModel, model: StepModel, row: int, row_order: list[int]) -> None:
        super().__init__()
        self.run = run
        self.model = model
        self.row = row
        self.row_order = row_order
        self.tokens: SampleTokens | None = None

    def compose(self) -> ComposeResult:
        yield Header(icon="")
        yield Static("", id="status", classes="status")
        yield Static(legend("abs"), id="legend")
        with Container(id="token-body"):
            yield TokenText(id="tokens")
            yield TokenDetail(id="detail")
        yield Footer()

    @property
    def text(self) -> TokenText:
        return self.query_one("#tokens", TokenText)

    @property
    def detail(self) -> TokenDetail:
        return self.query_one("#detail", TokenDetail)

    def on_mount(self) -> None:
        self.show_sample(self.row)
        self.text.focus()

    def show_sample(self, row: int) -> bool:
        """Read and show sample ``row`` of ``self.model``; False (and a notification) if unreadable."""
        try:
            tokens = self.model.sample(row)
        except READ_ERRORS as e:
            self.notify(f"cannot read sample {row} of step {self.model.step}: {e}", severity="error", timeout=8)
            return False
        self.row, self.tokens = row, tokens
        self._status()
        self.text.set_tokens(tokens)
        if tokens.n == 0:
            self.detail.show(tokens, 0)
        return True

    def _status(self) -> None:
        m, t, row = self.model, self.tokens, self.row
        assert t is not None
        rec = m.samples
        status = Text()
        status.append(f"step {m.step} · sample {row}", "bold")
        if "sample_id" in rec:
            status.append(f" (id {int(rec['sample_id'][row])})")
        if "reward" in rec:
            status.append(f" · reward {float(rec['reward'][row]):.4g}")
        st = str(rec["status"][row]) if "status" in rec else "ok"
        fin = str(rec["finish_reason"][row]) if "finish_reason" in rec else ""
        status.append(f" · {st}" + (f"/{fin}" if fin else ""), "bold red" if st != "ok" else "")
        status.append(f" · {t.n} tok")
        if "session_id" in rec and rec["session_id"][row]:  # a black-box agent's session path
            status.append(f" · session {rec['session_id'][row]}")
            if "fork_of" in rec and int(rec["fork_of"][row]) >= 0:
                cause = str(rec["fork_cause"][row]) if "fork_cause" in rec else ""
                status.append(f" · fork of {int(rec['fork_of'][row])}" + (f" ({cause})" if cause else ""), "yellow")
            if "drift_tokens" in rec and int(rec["drift_tokens"][row]) > 0:
                status.append(f" · drift {int(rec['drift_tokens'][row])} tok", "bold yellow")
        mx = m.stats.max_abs[row]
        if mx == mx:
            status.append(f" · max|Δ| {mx:.3g}")
        if st != "ok" and "error" in rec and rec["error"][row]:
            status.append(f" · {rec['error'][row]}", "red")
        self.set_status(status)

    def on_token_text_cursor_moved(self, event: TokenText.CursorMoved) -> None:
        if self.tokens is not None:
            self.detail.show(self.tokens, event.index, event.note)
            self.query_one("#legend", Static).update(legend(self.text.scale))

    def action_explain(self) -> None:
        """Attribute the token under the cursor (`axrl-debug explain`): rebuilds the step's policy and
        runs both paths with patches, in a worker thread (seconds), then shows the same table."""
        t = self.tokens
        if t is None or t.n == 0:
            return
        index = self.text.cursor
        rollout = t.data.get("rollout_logprob")
        if rollout is None or not np.isfinite(rollout[index]):
            self.notify("explain: pick a generated token (one with a rollout logprob)", timeout=4)
            return
        rec = self.model.samples
        sample_id = int(rec["sample_id"][self.row]) if "sample_id" in rec else self.row
        step, run_path = self.model.step, self.run.path
        self.notify(f"explaining sample {sample_id}, token {index} of step {step}…", timeout=4)

        def work() -> None:
            from replay import ReplayInputError
            from replay.explain import explain_step

            try:
                doc = explain_step(run_path, step, tokens=[(sample_id, index)]).to_dict()
            except (ReplayInputError, OSError, ValueError) as e:
                self.app.call_from_thread(self.notify, f"explain: {e}", severity="error", timeout=10)
                return
            self.app.call_from_thread(self.app.push_screen, ExplainScreen(doc))

        self.run_worker(work, thread=True, exclusive=True, group="explain")

    def action_bisect(self) -> None:
        """Bisect this sample (`axrl-debug bisect --sample`): the first layer and op where the embedded
        engine's and the trainer's computations of its tokens part, in a worker thread (tens of seconds)."""
        if self.tokens is None:
            return
        rec = self.model.samples
        sample_id = int(rec["sample_id"][self.row]) if "sample_id" in rec else self.row
        step, run_path = self.model.step, self.run.path
        self.notify(f"bisecting sample {sample_id} of step {step} (tens of seconds)…", timeout=6)

        def work() -> None:
            from replay import ReplayInputError
            from replay.bisect import bisect_step

            try:
                doc = bisect_step(run_path, step, sample=sample_id).to_json()
            except (ReplayInputError, OSError, ValueError) as e:
                self.app.call_from_thread(self.notify, f"bisect: {e}", severity="error", timeout=10)
                return
            self.app.call_from_thread(self.app.push_screen, BisectScreen(doc))

        self.run_worker(work, thread=True, exclusive=True, group="bisect")

    def action_sample(self, direction: int) -> None:
        order = self.row_order
        if self.row not in order:
            return
        i = order.index(self.row) + direction
        if not 0 <= i < len(order):
            self.notify("first sample" if direction < 0 else "last sample", timeout=2)
            return
        self.show_sample(order[i])


class ExplainScreen(ModalScreen[None]):
    """The token's attribution table (`axrl-debug explain`'s); esc closes it."""

    BINDINGS = [Binding("escape,e", "close", "close")]

    def __init__(self, doc: dict) -> None:
        super().__init__()
        self.doc = doc

    def compose(self) -> ComposeResult:
        from rich.console import Group

        from axrl_debug.commands.explain import token_summary, token_table

        tok = self.doc["tokens"][0]
        lines = token_summary(tok)
        body = Group(*[Text(line) for line in lines[:3]], token_table(tok), *[Text(line) for line in lines[3:]])
        with VerticalScroll(id="explain-box"):
            yield Static(body, id="explain-body")

    def action_close(self) -> None:
        self.dismiss(None)


class BisectScreen(ModalScreen[None]):
    """The sample's bisect (`axrl-debug bisect`'s verdict and walk); esc closes it."""

    BINDINGS = [Binding("escape,b", "close", "close")]

    def __init__(self, doc: dict) -> None:
        super().__init__()
        self.doc = doc

    def compose(self) -> ComposeResult:
        from rich.console import Group

        from axrl_debug.commands.bisect import summary_lines, walk_table

        head = f"bisect step {self.doc['step']}, sample {self.doc['sample']} (engine {self.doc['engine']})"
        body = Group(Text(head), *[Text(line) for line in summary_lines(self.doc)], walk_table(self.doc))
        with VerticalScroll(id="explain-box"):
            yield Static(body, id="explain-body")

    def action_close(self) -> None:
        self.dismiss(None)

