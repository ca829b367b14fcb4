"""`axrl model check-template DIR`: what AxRL does with a model directory's chat template.

Loads the directory's tokenizer (the load-time probes refuse a template AxRL cannot follow),
renders a sample agent conversation with tools, compares it with what `transformers`'
``apply_chat_template`` renders for the same messages, and describes what AxRL read off the
template: the turn-end token, the generation prompt, the tool-call format, how the system prompt
and tool results are placed, and whether re-rendered history (reasoning stripped from earlier
turns) makes the agent loop record drift.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axrl.tokenizer.loader import load_tokenizer
from axrl.tokenizer.template_probe import PROBE_TOOL

_PROBE_NAME: str = PROBE_TOOL["function"]["name"]  # the sample's calls name the probe tool
from axrl.tokenizer.tokenizer import Message, Tokenizer, fold_system
from axrl.tokenizer.tool_calls import hf_tool_result

_SYS, _USR, _RESULT = "SYS@@", "@@USR", "@@RESULT@@"  # printable: some templates JSON-escape contents
SAMPLE_TOOLS = [PROBE_TOOL]


def sample(tok: Tokenizer, calls: int = 2) -> list[Message]:
    """An agent episode with everything templates treat differently: a system prompt, tools,
    ``calls`` parallel calls (arguments in the form the template wants), their results, a
    reasoning turn, then a new question. Tool-free templates get the episode without calls."""
    head: list[Message] = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 37 + 58?"}]
    tail: list[Message] = [{"role": "assistant", "content": "<think>\nadd them\n</think>\n\nThe answer is 95."},
                           {"role": "user", "content": "And 1 + 1?"}, {"role": "assistant", "content": "2"}]
    if tok.tool_call_format is None and tok.tool_parser is None:
        return head + tail
    args = [{"x": 37}, {"x": 58}][:calls]
    return head + [{"role": "assistant", "content": "", "tool_calls": [
        tok.tool_call_message(_PROBE_NAME, a, k + 1) for k, a in enumerate(args)]}] + \
        [hf_tool_result(str(a["x"]), k + 1) for k, a in enumerate(args)] + tail


@dataclass
class TemplateReport:
    """The outcome of checking one directory: ``ok`` is False on a refusal or a rendering that
    differs from transformers'; ``refused`` when AxRL cannot load it; ``lines`` say what AxRL does
    with the template."""

    ok: bool
    lines: list[str] = field(default_factory=list)
    refused: bool = False


def check_template(path: str | Path, tool_parser: str | None = None) -> TemplateReport:
    """Load ``path``'s tokenizer as ``model.path`` would and describe its chat template. Never
    raises on a template: whatever it raises becomes the verdict, quoting its error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the drift warning is reported below, in context
            tok = load_tokenizer(path, tool_parser)
    except Exception as e:  # a check must report on any template, however it fails
        return TemplateReport(False, [f"refused: {e}"], refused=True)
    report = TemplateReport(True, [f"chat template of {path}: AxRL can follow it"])
    try:
        report.ok = _describe(tok, Path(path), report.lines)
    except Exception as e:  # a template that renders the probes but raises on the sample
        report.ok = False
        report.lines.append(f"  sample         the template raised on the sample conversation: {type(e).__name__}: {e}")
    return report


def _describe(tok: Tokenizer, path: Path, lines: list[str]) -> bool:
    """Append what AxRL read off ``tok``'s template; True unless transformers renders it differently."""
    if len(tok.chat_templates) > 1:
        lines.append(f"  templates      named {sorted(tok.chat_templates)}: 'tool_use' renders when tools are given"
                     if "tool_use" in tok.chat_templates else f"  templates      named {sorted(tok.chat_templates)}")
    lines.append(f"  turn end       {tok.eos_token!r} (id {tok.eos_token_id}); generation stops at ids "
                 f"{tok.stop_token_ids}")
    lines.append(f"  reply opens    {tok.generation_prompt_text()!r}" if tok.generation_prompt_text()
                 else "  reply opens    (nothing: the reply follows the user turn directly)")
    if tok.reasoning_opened:
        lines.append("                 the generation prompt opens a reasoning block that re-rendered history never "
                     "shows: recorded as drift")
    lines.append(f"  system role    {_system_placement(tok)}")
    fmt = tok.tool_call_format
    calls = fmt.describe() if fmt else f"written in the {tok.tool_parser.name} format" if tok.tool_parser \
        else "not rendered"
    if tok.tool_free:
        calls = f"not rendered (tool-free tasks only): {tok.tool_free}"
    lines.append(f"  tool calls     {calls}; arguments passed as {'a JSON string' if tok.arguments_form == 'string' else 'a mapping'}")
    parser = tok.tool_parser.name if tok.tool_parser else "none (tool-free)" if tok.tool_free else \
        "the format read off the template (no known family)"
    lines.append(f"  tool parser    {parser} (override with model.tool_parser)")
    if not tok.tool_free:
        lines.append(f"  tool list      {_tool_list(tok)}")
        lines.append(f"  tool results   {_tool_result_placement(tok)}")
    conversation, note = _sample_for(tok)
    if note:
        lines.append(f"  parallel calls {note}")
    mismatch = tok.incremental_mismatch(conversation, SAMPLE_TOOLS)
    lines.append(f"  reasoning      {_reasoning(tok, conversation)}")
    lines.append("  history        " + (f"re-rendered differently from the agent loop's stream ({mismatch}): "
                                       "recorded as drift, never trained on" if mismatch else
                                       "rendered as the agent loop streams it: no drift"))
    same, detail = _compare_with_transformers(tok, path, conversation)
    lines.append(f"  transformers   {detail}")
    return same is not False


def _sample_for(tok: Tokenizer) -> tuple[list[Message], str]:
    """The sample with two parallel calls, or with one when the template allows one per turn."""
    two = sample(tok, 2)
    try:
        tok.apply_chat_template(two, tools=SAMPLE_TOOLS, tokenize=False)
        return two, ""
    except Exception as e:  # Llama 3.1: "This model only supports single tool-calls at once!"
        return sample(tok, 1), f"refused by the template ({e}): one call per turn"


def _system_placement(tok: Tokenizer) -> str:
    """Own turn (special tokens between the system text and the user's) or folded into a user turn."""
    if tok.fold_system:
        return "none in the template (it raises on one): AxRL folds the system prompt into the first user turn"
    text = str(tok.apply_chat_template([{"role": "system", "content": _SYS}, {"role": "user", "content": _USR}],
                                       tokenize=False))
    if _SYS not in text:
        return "dropped by the template (the system prompt never reaches the model)"
    between = text[text.index(_SYS) + len(_SYS):text.index(_USR)]
    if set(tok.encode(between)) & set(tok.special_token_ids):
        return "its own turn"
    return f"folded into a user turn (joined by {between!r})"


def _tool_list(tok: Tokenizer) -> str:
    """Whether the tools' schemas reach the prompt: DeepSeek-V3's published templates never render
    ``tools``, so a model trained with them sees calls and results but no schema."""
    chat = [{"role": "system", "content": _SYS}, {"role": "user", "content": _USR}]
    with_tools = str(tok.apply_chat_template(chat, tools=SAMPLE_TOOLS, tokenize=False))
    if with_tools != str(tok.apply_chat_template(chat, tokenize=False)):
        return "rendered into the prompt"
    return ("NOT rendered: the template never shows the tools' schemas to the model; describe them in the "
            "system prompt, or use a template that lists them")


def _tool_result_placement(tok: Tokenizer) -> str:
    """The text the template writes between a tool-call reply's close and the result's text."""
    call = [{"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [tok.tool_call_message(_PROBE_NAME, {"x": 1}, 1)]}]
    before = str(tok.apply_chat_template(call, tools=SAMPLE_TOOLS, tokenize=False))
    text = str(tok.apply_chat_template(call + [hf_tool_result(_RESULT, 1)], tools=SAMPLE_TOOLS, tokenize=False))
    if text.startswith(before):
        return f"role 'tool' rendered as {text[len(before):text.index(_RESULT)]!r} + result"
    common = len(os.path.commonprefix([before, text]))
    seg = text[:text.index(_RESULT)]
    prefix = seg[seg.rindex(tok.eos_token) + len(tok.eos_token):] if tok.eos_token in seg else seg[common:]
    return (f"role 'tool' rendered as {prefix!r} + result; once a result follows, the template rewrites the "
            f"call's turn (it had {before[common:common + 24]!r} there): recorded as drift")


def _reasoning(tok: Tokenizer, conversation: list[Message]) -> str:
    """Whether an earlier turn's <think> block survives a new question."""
    parser = f" ({tok.reasoning_parser} reasoning parser)" if tok.reasoning_parser else ""
    if not tok.reasoning_parser:
        return "no reasoning block in this template (replies are kept as the model wrote them)"
    if tok.reasoning_parser == "openai":  # harmony: reasoning is the analysis channel, not <think>
        return ("the analysis channel (<|channel|>analysis), separated from the answer by the openai reasoning "
                "parser; what the template re-renders of it in later turns is counted as drift")
    if tok.reasoning_parser == "gemma4":  # the thought channel, stripped from every model turn by the template
        return ("the thought channel (<|channel>thought … <channel|>), separated from the answer by the gemma4 "
                "reasoning parser; the template strips it from every earlier model turn: counted as drift")
    whole = str(tok.apply_chat_template(conversation, tools=SAMPLE_TOOLS, tokenize=False))
    if "add them" in whole:
        return f"<think>…</think> kept in every turn{parser}"
    return f"<think>…</think> stripped from turns before the last question{parser}: the model generated it, so " \
           "the agent loop keeps it and counts the difference as drift"


def _compare_with_transformers(tok: Tokenizer, path: Path, conversation: list[Message]) -> tuple[bool | None, str]:
    """(same?, what to print): AxRL's rendering of the sample against transformers' own."""
    try:
        import transformers
    except ImportError:
        return None, "not installed: rendering not compared"
    if tok.fold_system:
        conversation = fold_system(conversation)  # what AxRL renders; transformers would raise on the system turn
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    kw: dict[str, Any] = {"tools": SAMPLE_TOOLS, "add_generation_prompt": False, "tokenize": False}
    ours = str(tok.apply_chat_template(conversation, **kw))
    try:
        theirs = hf.apply_chat_template(conversation, **kw)
    except Exception as e:  # transformers' renderer raised where AxRL's did not
        return False, f"apply_chat_template raised {type(e).__name__}: {e}"
    if ours != theirs:
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        return False, f"DIFFERS at character {k}: AxRL {ours[k:k + 40]!r}, transformers {theirs[k:k + 40]!r}"
    ids = tok.encode(ours)
    if ids != hf.encode(theirs, add_special_tokens=False):
        return False, "same text, DIFFERENT token ids"
    return True, f"apply_chat_template renders the sample conversation identically ({len(ids)} tokens)"
