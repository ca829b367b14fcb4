"""What is known about the token under the cursor: logprobs, Δ, ratio, its engine / staleness
parts (traces with behaviour_train_logprob), entropy, advantage, policy version, MoE experts per
layer (rollout vs trainer) and the replay dump's contributions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from axrl.trace.schema import LOSS_RULE_CODES

from ..data import SampleTokens, display_piece

LABEL = "bold"
# Replay dump columns (replay/dump.py) in the order a spike investigation reads them.
REPLAY_ORDER = ("loss_contribution", "ratio", "pg_loss", "is_weight", "tis_weight", "clipped", "loss_rule", "update",
                "logprob")
DIFF = "bold red"


def _num(v: Any, digits: int = 5) -> str:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "–"
    if math.isnan(f):
        return "–"
    return f"{f:.{digits}g}"


def _delta_style(d: float) -> str:
    """Red from |Δ| ≥ 0.1 (a ratio beyond ~1.1, the edge of any clip band)."""
    return DIFF if not math.isnan(d) and abs(d) >= 0.1 else ""


def _experts(row: np.ndarray) -> str:
    return ",".join(str(int(e)) for e in row)


def _replay_value(a: np.ndarray) -> str:
    """A replay per-token value: a scalar, or one value per update as a short list."""
    if np.ndim(a) == 0:
        return _num(a)
    flat = np.asarray(a).ravel()
    return "[" + ", ".join(_num(v, 4) for v in flat[:6]) + (", …" if flat.size > 6 else "") + "]"


def detail_text(t: SampleTokens, i: int, note: str = "") -> Text:
    """The detail of token ``i`` of sample ``t`` as Rich text (also what the tests assert on)."""
    out = Text()
    if t.n == 0:
        return Text("this sample has no tokens (a failed rollout records none)")
    step = t.step
    kind = t.segment_kind(i)
    tid = int(t.get("ids", i, -1))
    if note:
        out.append(note, "bold yellow").append(" │ ")
    out.append(f"#{i}/{t.n} ", LABEL)
    out.append(repr(display_piece(t.text[i])), "bold cyan")
    out.append(f" id {tid} · turn {int(t.get('turn', i, 0))} · {kind}")
    out.append("\n")
    _comparison(out, t, i)
    if t.engine_delta is not None:
        _split(out, t, i)
    pv = int(t.get("policy_version", i, -1))
    out.append("entropy ", LABEL).append(_num(t.get("entropy", i), 4))
    out.append("  advantage ", LABEL).append(_num(t.get("advantage", i), 4))
    out.append("  policy ", LABEL)
    if pv >= 0:
        lag = step.policy_version - pv
        out.append(f"v{pv}" + (f" (step v{step.policy_version}, lag {lag})" if lag else ""),
                   DIFF if lag else "")
    else:
        out.append("– (prompt / env token)")
    out.append("\n")
    _objective(out, t, i)
    if t.replay:
        out.append("replay ", "bold magenta")
        names = [k for k in REPLAY_ORDER if k in t.replay] + sorted(k for k in t.replay if k not in REPLAY_ORDER)
        out.append("  ".join(f"{k} {_replay_value(t.replay[k][i])}" for k in names))
        out.append("\n")
    _routing(out, t, i)
    return out


def _comparison(out: Text, t: SampleTokens, i: int) -> None:
    """The line Δ comes from, as the run was opened (`--against`): trainer − rollout logprob and
    the ratio; teacher − rollout (a distillation run: the trainer's logprob stays shown, and
    exp(Δ) is π_T/μ); or the critic's V − return."""
    d, against = float(t.delta[i]), t.step.run.against
    if against == "value":
        out.append("value ", LABEL).append(_num(t.get("value", i)))
        out.append("  return ", LABEL).append(_num(t.get("return", i)))
        out.append("  V − return ", LABEL).append(_num(d, 3), _delta_style(d)).append("\n")
        return
    out.append("rollout lp ", LABEL).append(_num(t.get("rollout_logprob", i)))
    if against == "teacher":
        out.append("  teacher lp ", LABEL).append(_num(t.get("teacher_logprob", i)))
    out.append("  trainer lp ", LABEL).append(_num(t.get("old_logprob", i)))
    out.append("  Δ teacher " if against == "teacher" else "  Δ ", LABEL).append(_num(d, 3), _delta_style(d))
    ratio = math.exp(d) if not math.isnan(d) else math.nan
    out.append("  π_T/μ " if against == "teacher" else "  ratio ", LABEL).append(_num(ratio))
    out.append("\n")


def _split(out: Text, t: SampleTokens, i: int) -> None:
    """Δ = Δ_engine + Δ_staleness: which part of this token's mismatch is the engine's (at the
    weights that generated it) and which the policy's drift since."""
    engine, stale = float(t.engine_delta[i]), float(t.staleness_delta[i])
    out.append("Δ engine ", LABEL).append(_num(engine, 3), _delta_style(engine))
    out.append("  Δ staleness ", LABEL).append(_num(stale, 3), _delta_style(stale))
    out.append("  behaviour lp ", LABEL).append(_num(t.get("behaviour_train_logprob", i)))
    if math.isnan(engine):
        out.append("  (not split: no behaviour_train lp)", "dim")


def _objective(out: Text, t: SampleTokens, i: int) -> None:
    """What the objective and corrections did to a trained token (`/tokens/loss_rule`, `is_weight`)."""
    if "loss_rule" not in t.data or not t.get("loss_mask", i, 0):
        return
    code = int(t.get("loss_rule", i, 0))
    names = [name for bit, (name, _) in LOSS_RULE_CODES.items() if code & bit]
    w = t.get("is_weight", i)
    out.append("objective ", LABEL).append("weight ").append(_num(w, 4), DIFF if w == 0 else "")
    out.append("  rules ").append(", ".join(names) if names else "none (trained plainly)", DIFF if names else "")
    out.append("\n")


def _routing(out: Text, t: SampleTokens, i: int) -> None:
    if t.routing_rollout is None or t.routing_train is None or t.layer_agree is None:
        out.append("routing ", LABEL).append("– (dense model, or routing not recorded)")
        return
    rr, rt, ok = t.routing_rollout[i], t.routing_train[i], t.layer_agree[i]
    valid = bool(t.routing_valid[i]) if t.routing_valid is not None else True
    layers = rr.shape[0]
    # Row i is the token *as input* (the forward that predicts token i+1); row i-1 is the
    # forward that predicted this token, i.e. the one its Δ came from.
    out.append("experts rollout→trainer", LABEL)
    if valid:
        bad = int((~ok).sum())
        out.append(f" {bad}/{layers} layers differ" if bad else f" all {layers} layers agree",
                   DIFF if bad else "green")
    else:
        out.append(" no rollout row (never fed to the engine)", "yellow")
    if i > 0 and t.routing_valid is not None:
        prev = "unknown" if not t.routing_valid[i - 1] else ("differs" if not t.layer_agree[i - 1].all() else "agrees")
        out.append(" · predicted by routing that ")
        out.append(prev, DIFF if prev == "differs" else "")
    out.append("\n")
    for layer in range(layers):
        if valid and not ok[layer]:
            out.append(f"L{layer} {_experts(rr[layer])}≠{_experts(rt[layer])}", DIFF)
        elif valid:
            out.append(f"L{layer} {_experts(rr[layer])}", "dim")
        else:
            out.append(f"L{layer} ?→{_experts(rt[layer])}", "dim")
        out.append("  ")


class TokenDetail(VerticalScroll, can_focus=False):
    """Scrollable panel (MoE models with many layers need more lines than 80×24 leaves)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.text = Text()

    def compose(self) -> ComposeResult:
        yield Static("", id="detail-body")

    def show(self, tokens: SampleTokens, index: int, note: str = "") -> None:
        self.text = detail_text(tokens, index, note)
        self.query_one("#detail-body", Static).update(self.text)

    @property
    def plain(self) -> str:
        """The panel's text without styles (what tests and scripts assert on)."""
        return self.text.plain
