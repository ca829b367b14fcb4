"""`axrl model check-template DIR`: what AxRL does with a model directory's chat template.

Loads the directory's tokenizer (the load-time probes refuse a template AxRL cannot follow),
renders a sample agent conversation with tools, compares it with what `transformers`'
``apply_chat_template`` renders for the same messages, and describes what AxRL read off the
template: the turn-end token, the generation prompt, the tool-call format, how the system prompt
and tool results are placed, and whether re-rendered history (reasoning stripped from earlier
turns) makes the agent loop record drift.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl.tokenizer.loader import load_tokenizer
from axrl.tokenizer.template_probe import PROBE_TOOL
from axrl.tokenizer.tokenizer import Message, Tokenizer
from axrl.tokenizer.tool_calls import hf_tool_call, hf_tool_result

_SYS, _USR, _RESULT = "SYS@@", "@@USR", "@@RESULT@@"  # printable: some templates JSON-escape contents
SAMPLE_TOOLS = [PROBE_TOOL]
# An agent episode with everything templates treat differently: a system prompt, tools, two calls
# (one with arguments already serialised), their results, a reasoning turn, then a new question.
SAMPLE: list[Message] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 37 + 58?"},
    {"role": "assistant", "content": "", "tool_calls": [hf_tool_call("probe", {"x": 37}, 1),
                                                        hf_tool_call("probe", '{"x": 58}', 2)]},
    hf_tool_result("37", 1), hf_tool_result("58", 2),
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nThe answer is 95."},
    {"role": "user", "content": "And 1 + 1?"},
    {"role": "assistant", "content": "2"},
]


@dataclass
class TemplateReport:
    """The outcome of checking one directory: ``ok`` is False on a refusal or a rendering that
    differs from transformers'; ``lines`` say what AxRL does with the template."""

    ok: bool
    lines: list[str] = field(default_factory=list)


def check_template(path: str | Path) -> TemplateReport:
    """Load ``path``'s tokenizer as ``model.path`` would and describe its chat template."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the drift warning is reported below, in context
            tok = load_tokenizer(path)
    except (FileNotFoundError, ValueError) as e:
        return TemplateReport(False, [f"refused: {e}"])
    report = TemplateReport(True, [f"chat template of {path}: AxRL can follow it"])
    lines = report.lines
    lines.append(f"  turn end       {tok.eos_token!r} (id {tok.eos_token_id}); generation stops at ids "
                 f"{tok.stop_token_ids}")
    lines.append(f"  reply opens    {tok.generation_prompt_text()!r}" if tok.generation_prompt_text()
                 else "  reply opens    (nothing: the reply follows the user turn directly)")
    lines.append(f"  system role    {_system_placement(tok)}")
    fmt = tok.tool_call_format
    lines.append(f"  tool calls     {fmt.describe() if fmt else 'not rendered (tool-free tasks only)'}")
    lines.append(f"  tool results   {_tool_result_placement(tok)}")
    mismatch = tok.incremental_mismatch(SAMPLE, SAMPLE_TOOLS)
    lines.append(f"  reasoning      {_reasoning(tok)}")
    lines.append("  history        " + (f"re-rendered differently from the agent loop's stream ({mismatch}): "
                                       "recorded as drift, never trained on" if mismatch else
                                       "rendered as the agent loop streams it: no drift"))
    same, detail = _compare_with_transformers(tok, Path(path))
    lines.append(f"  transformers   {detail}")
    report.ok = same is not False
    return report


def _system_placement(tok: Tokenizer) -> str:
    """Own turn (special tokens between the system text and the user's) or folded into a user turn."""
    text = str(tok.apply_chat_template([{"role": "system", "content": _SYS}, {"role": "user", "content": _USR}],
                                       tokenize=False))
    between = text[text.index(_SYS) + len(_SYS):text.index(_USR)]
    if set(tok.encode(between)) & set(tok.special_token_ids):
        return "its own turn"
    return f"folded into a user turn (joined by {between!r})"


def _tool_result_placement(tok: Tokenizer) -> str:
    """The text the template writes between a tool-call reply's close and the result's text."""
    call = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [hf_tool_call(
        "probe", {"x": 1}, 1)]}]
    before = str(tok.apply_chat_template(call, tokenize=False))
    text = str(tok.apply_chat_template(call + [hf_tool_result(_RESULT, 1)], tokenize=False))
    if not text.startswith(before):
        return "rendered into the call's turn (history re-rendered)"
    return f"role 'tool' rendered as {text[len(before):text.index(_RESULT)]!r} + result"


def _reasoning(tok: Tokenizer) -> str:
    """Whether an earlier turn's <think> block survives a new question."""
    whole = str(tok.apply_chat_template(SAMPLE, tools=SAMPLE_TOOLS, tokenize=False))
    if "add them" in whole:
        return "<think>…</think> kept in every turn"
    return "<think>…</think> stripped from turns before the last question: the model generated it, so the " \
           "agent loop keeps it and counts the difference as drift"


def _compare_with_transformers(tok: Tokenizer, path: Path) -> tuple[bool | None, str]:
    """(same?, what to print): AxRL's rendering of SAMPLE against transformers' own."""
    try:
        import transformers
    except ImportError:
        return None, "not installed: rendering not compared"
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    kw: dict[str, Any] = {"tools": SAMPLE_TOOLS, "add_generation_prompt": False, "tokenize": False}
    ours, theirs = str(tok.apply_chat_template(SAMPLE, **kw)), hf.apply_chat_template(SAMPLE, **kw)
    if ours != theirs:
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        return False, f"DIFFERS at character {k}: AxRL {ours[k:k + 40]!r}, transformers {theirs[k:k + 40]!r}"
    ids = tok.encode(ours)
    if ids != hf.encode(theirs, add_special_tokens=False):
        return False, "same text, DIFFERENT token ids"
    return True, f"apply_chat_template renders the sample conversation identically ({len(ids)} tokens)"
