"""Tool-call parsers per model family, under the names vLLM and SGLang users pass
(``--tool-call-parser hermes`` …), so ``model.tool_parser`` takes the value a user already knows.

Each parser reads every call of one reply, in order, and never raises: a call it cannot read
becomes an entry with ``error`` set (see :func:`axrl.tokenizer.tool_calls.parse_tool_calls` for
the entry shape), so the environment can answer with an error and the reward can penalise it.
Reasoning is separated *before* parsing (:mod:`axrl.tokenizer.reasoning`): a call the model only
thought about is no call.

The formats (what the model writes after its generation prompt):

* ``hermes`` — ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (Qwen2.5/3, Hermes-3, ChatML);
* ``llama3_json`` — bare JSON ``{"name", "parameters"}`` opening the reply, optionally after
  ``<|python_tag|>``, calls separated by ``;`` or whitespace (Llama 3.1 / 3.2);
* ``mistral`` — ``[TOOL_CALLS]`` and a JSON list (v3 tokenizers) or ``[TOOL_CALLS]name[ARGS]{…}``
  per call (v11+: Small 3.2, Magistral);
* ``deepseek_v3`` — ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and a json fence;
* ``deepseek_v31`` — ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>``;
* ``qwen3_coder`` — ``<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>``;
* ``pythonic`` — a Python list of calls, ``[f(a=1), g(b="x")]`` (Llama 3.2 / 4 pythonic templates);
* ``openai`` — gpt-oss harmony: ``<|channel|>commentary to=functions.NAME … <|message|>{…}<|call|>``;
* ``kimi_k2`` — ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{…}<|tool_call_end|>``;
* ``glm45`` — ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>``;
* ``gemma4`` — ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>`` (:mod:`axrl.tokenizer.gemma4_calls`).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from axrl.tokenizer.gemma4_calls import CALL_START as _GEMMA4_START, parse_gemma4_calls
from axrl.tokenizer.tool_calls import _entry, _json_at, _parse_one, parse_tool_calls

Call = dict[str, Any]


@dataclass(frozen=True)
class ToolParser:
    """One family's tool-call format: ``start`` is the text that opens the first call (what a
    streaming reply holds back from, and where the prose before the calls ends)."""

    name: str
    start: str
    parse: Callable[..., list[Call]]  # parse(text), and parse(text, tools) where typed_by_schema

    typed_by_schema: bool = False  # XML formats: a value's type comes from the tool's JSON schema

    def parse_calls(self, text: str, tools: list[dict[str, Any]] | None = None) -> list[Call]:
        """The calls in ``text``; with ``tools``, XML values typed by each tool's parameter schema."""
        return self.parse(text, tools) if self.typed_by_schema and tools else self.parse(text)


def _named(raw: str, name: str, args: Any) -> Call:
    """An entry for a call whose name and arguments were read separately (args: JSON text or value)."""
    name = name.strip()
    if not name:
        return _entry(raw, error="tool call without a name")
    if isinstance(args, str):
        found = _json_at(args, 0)
        if found is None or args[found[1]:].strip():
            return _entry(raw, name=name, error="invalid JSON in arguments")
        args = found[0]
    if not isinstance(args, dict):
        return _entry(raw, name=name, error='"arguments" must be a JSON object')
    return _entry(raw, name=name, arguments=args)


def _blocks(text: str, start: str, end: str) -> list[tuple[str, bool]]:
    """(inner text, closed?) of every ``start`` … ``end`` block; an unclosed one runs to the end."""
    out, pos = [], 0
    while (at := text.find(start, pos)) >= 0:
        stop = text.find(end, at + len(start))
        out.append((text[at + len(start):stop if stop >= 0 else len(text)], stop >= 0))
        if stop < 0:
            break
        pos = stop + len(end)
    return out


def _hermes(text: str) -> list[Call]:
    """``<tool_call>`` blocks; the JSON is read first, so ``</tool_call>`` inside a string value
    does not end the block (the plain block reading is the fallback for malformed JSON)."""
    calls: list[Call] = []
    pos = 0
    while (at := text.find("<tool_call>", pos)) >= 0:
        begin = at + len("<tool_call>")
        found = _json_at(text, begin)
        if found is not None and text[found[1]:].lstrip().startswith("</tool_call>"):
            stop = found[1]
            calls.append(_parse_one(text[begin:stop].strip(), True, "<tool_call>"))
            pos = text.index("</tool_call>", stop) + len("</tool_call>")
            continue
        block = parse_tool_calls(text[at:])[:1]  # malformed: up to the next end tag, as before
        calls += block
        end = text.find("</tool_call>", begin)
        if end < 0:
            break
        pos = end + len("</tool_call>")
    return calls


def _json_calls(text: str, pos: int) -> list[Call]:
    """JSON call objects (or lists of them) one after another from ``pos``, separated by
    whitespace, ``,`` or ``;``; something that is not JSON ends the run (recorded as malformed)."""
    calls: list[Call] = []
    while pos < len(text):
        while pos < len(text) and (text[pos].isspace() or text[pos] in ",;"):
            pos += 1
        if pos >= len(text):
            break
        found = _json_at(text, pos)
        if found is None:
            return calls + [_entry(text[pos:].strip(), error="invalid JSON tool call")]
        value, stop = found
        raw = text[pos:stop].strip()
        for item in value if isinstance(value, list) else [value]:
            calls.append(_parse_one(json.dumps(item), True, "") | {"raw": raw})
        pos = stop
    return calls


def _llama3_json(text: str) -> list[Call]:
    body = text.lstrip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].lstrip()
    if not body.startswith(("{", "[")):
        return []  # prose that merely contains braces is no call
    return _json_calls(body, 0)


_MISTRAL_ARGS = "[ARGS]"


def _mistral(text: str) -> list[Call]:
    calls: list[Call] = []
    pos = 0
    while (at := text.find("[TOOL_CALLS]", pos)) >= 0:
        begin = at + len("[TOOL_CALLS]")
        rest = text[begin:].lstrip()
        begin = len(text) - len(rest)
        found = _json_at(text, begin) if rest.startswith(("[", "{")) else None
        if found is not None:  # v3: a JSON list of {"name", "arguments", "id"}
            value, pos = found
            calls += [_parse_one(json.dumps(v), True, "") | {"raw": text[begin:pos]}
                      for v in (value if isinstance(value, list) else [value])]
            continue
        head = rest.split("[TOOL_CALLS]", 1)[0]
        if not rest.startswith(("[", "{")) and _MISTRAL_ARGS in head:  # v11+: name[ARGS]{arguments}
            name, args = head.split(_MISTRAL_ARGS, 1)
            start = begin + len(name) + len(_MISTRAL_ARGS)
            found = _json_at(text, start)
            calls.append(_named(head, name, text[start:found[1]] if found else args))
            pos = found[1] if found else begin + len(head)
            continue
        calls.append(_entry(head.strip(), error="no JSON list or NAME[ARGS]{…} after [TOOL_CALLS]"))
        pos = begin + len(head)
    return calls


_DS_CALL, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def _deepseek(text: str, name_first: bool) -> list[Call]:
    calls: list[Call] = []
    for inner, closed in _blocks(text, _DS_CALL, _DS_CALL_END):
        if not closed:
            calls.append(_entry(inner.strip(), error=f"unterminated {_DS_CALL} block"))
            continue
        if _DS_SEP not in inner:
            calls.append(_entry(inner.strip(), error=f"no {_DS_SEP} in the tool call"))
            continue
        head, tail = inner.split(_DS_SEP, 1)
        if name_first:       # V3.1: NAME<sep>{arguments}
            calls.append(_named(inner, head, tail.strip()))
            continue
        name, _, args = tail.partition("\n")  # V3: function<sep>NAME\n```json\n{…}\n```
        fence = _FENCE.match(args)
        calls.append(_named(inner, name, fence.group(1) if fence else args.strip()))
    return calls


def _deepseek_v3(text: str) -> list[Call]:
    return _deepseek(text, name_first=False)


def _deepseek_v31(text: str) -> list[Call]:  # module-level, not a lambda: tokenizers are pickled
    return _deepseek(text, name_first=True)


_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?(</parameter>|$)", re.S)


def _xml_value(text: str) -> Any:
    """A parameter's value: JSON when it reads as JSON (numbers, lists, objects), else a Python
    literal of a non-string kind (``True``, ``None``, ``{'a': 1}``: Qwen3-Coder's published template
    writes non-string values with Jinja's ``string`` filter, i.e. Python's ``str``), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    literal = _python_literal(text)
    # Only what a template's ``string`` filter writes for a JSON value (True, None, a dict, a list)
    # and JSON can carry: not Python-only spellings of numbers (0x10, 1_000) nor sets or bytes.
    if isinstance(literal, (bool, dict, list)) or (literal is None and text.strip() == "None"):
        try:
            json.dumps(literal)
            return literal
        except (TypeError, ValueError):
            pass
    return text


_NOT_LITERAL = object()
_WORDS = {"true": True, "false": False, "null": None, "none": None}


def _python_literal(text: str) -> Any:
    """``text`` read as a Python literal (``ast.literal_eval``: no code runs), else ``_NOT_LITERAL``."""
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _NOT_LITERAL


def _typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's value typed by its JSON schema where the tool gives one: a ``string``
    parameter keeps its text ("95" stays "95"); a ``boolean`` or null reads ``true``/``True``,
    ``null``/``None`` (JSON's or Python's spelling: the published Qwen3-Coder template writes
    Python's); an ``object``/``array`` reads as JSON, else as a Python literal; other types as
    JSON. Without a schema, :func:`_xml_value`'s guess."""
    kind = schema.get("type") if schema else None
    if kind == "string":
        return text
    if kind in ("boolean", "null") and text.strip().lower() in _WORDS:
        return _WORDS[text.strip().lower()]
    return _xml_value(text)


def _param_schemas(tools: list[dict[str, Any]] | None, name: str | None) -> dict[str, Any]:
    """The JSON-schema ``properties`` of tool ``name`` among ``tools`` (OpenAI function form); {} if absent."""
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == (name or "").strip():
            props = (fn.get("parameters") or {}).get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def _qwen3_coder(text: str, tools: list[dict[str, Any]] | None = None) -> list[Call]:
    calls: list[Call] = []
    for inner, closed in _blocks(text, "<tool_call>", "</tool_call>"):
        fn = _FUNCTION.search(inner)
        if fn is None or not closed or not fn.group(3):
            calls.append(_entry(inner.strip(), name=fn.group(1) if fn else None,
                                error="unterminated <tool_call> / <function=…> block" if fn or not closed
                                else "no <function=NAME> in the tool call"))
            continue
        schemas = _param_schemas(tools, fn.group(1))
        params = {m.group(1): _typed_value(m.group(2), schemas.get(m.group(1).strip()))
                  for m in _PARAMETER.finditer(fn.group(2))}
        calls.append(_named(inner.strip(), fn.group(1), params))
    return calls


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _glm45(text: str, tools: list[dict[str, Any]] | None = None) -> list[Call]:
    calls: list[Call] = []
    for inner, closed in _blocks(text, "<tool_call>", "</tool_call>"):
        name = inner.split("<arg_key>", 1)[0]
        if not closed:
            calls.append(_entry(inner.strip(), name=name.strip() or None, error="unterminated <tool_call> block"))
            continue
        schemas = _param_schemas(tools, name)
        args = {m.group(1).strip(): _typed_value(m.group(2), schemas.get(m.group(1).strip()))
                for m in _GLM_ARG.finditer(inner)}
        calls.append(_named(inner.strip(), name, args))
    return calls


def _pythonic(text: str) -> list[Call]:
    body = text.strip()
    if body.startswith("<|python_start|>"):
        body = body[len("<|python_start|>"):].split("<|python_end|>")[0].strip()
    if not (body.startswith("[") and re.match(r"\[\s*[A-Za-z_][\w.]*\(", body)):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError as e:
        return [_entry(body, error=f"not a Python list of calls: {e.msg}")]
    calls: list[Call] = []
    for node in tree.elts if isinstance(tree, ast.List) else []:
        raw = ast.get_source_segment(body, node) or ""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            calls.append(_entry(raw, error="each item must be NAME(key=value, …)"))
            continue
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        except ValueError:
            calls.append(_entry(raw, name=node.func.id, error="arguments must be literals"))
            continue
        calls.append(_entry(raw, name=node.func.id, arguments=args))
    return calls


_HARMONY_CALL = re.compile(r"to=functions\.([^\s<]+)[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?"
                           r"<\|message\|>(.*?)(<\|call\|>|<\|end\|>|$)", re.S)


def _openai(text: str) -> list[Call]:
    calls: list[Call] = []
    for m in _HARMONY_CALL.finditer(text):
        # A reply's text ends where its stop token (<|call|>) was cut off: complete JSON there is a call.
        if not m.group(3) and _json_at(m.group(2).strip(), 0) is None:
            calls.append(_entry(m.group(2).strip(), name=m.group(1), error="unterminated call (no <|call|>)"))
            continue
        calls.append(_named(m.group(0), m.group(1), m.group(2).strip()))
    return calls


_KIMI_CALL, _KIMI_ARGS, _KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _kimi_k2(text: str) -> list[Call]:
    calls: list[Call] = []
    for inner, closed in _blocks(text, _KIMI_CALL, _KIMI_END):
        if not closed or _KIMI_ARGS not in inner:
            calls.append(_entry(inner.strip(), error=f"unterminated {_KIMI_CALL} block" if not closed
                                else f"no {_KIMI_ARGS} in the tool call"))
            continue
        ident, args = inner.split(_KIMI_ARGS, 1)
        # functions.NAME:INDEX — the name sits between the namespace and the call's index.
        name = ident.strip().split(":")[0].removeprefix("functions.")
        calls.append(_named(inner, name, args.strip()))
    return calls


PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    ToolParser("hermes", "<tool_call>", _hermes),
    ToolParser("llama3_json", "", _llama3_json),
    ToolParser("mistral", "[TOOL_CALLS]", _mistral),
    ToolParser("deepseek_v3", "<｜tool▁calls▁begin｜>", _deepseek_v3),
    ToolParser("deepseek_v31", "<｜tool▁calls▁begin｜>", _deepseek_v31),
    ToolParser("qwen3_coder", "<tool_call>", _qwen3_coder, typed_by_schema=True),
    ToolParser("pythonic", "", _pythonic),
    ToolParser("openai", "<|start|>assistant", _openai),
    ToolParser("kimi_k2", "<|tool_calls_section_begin|>", _kimi_k2),
    ToolParser("glm45", "<tool_call>", _glm45, typed_by_schema=True),
    ToolParser("gemma4", _GEMMA4_START, parse_gemma4_calls),
)}


def get_tool_parser(name: str, field: str = "model.tool_parser") -> ToolParser:
    """The parser registered as ``name``; a ValueError naming ``field`` and the choices otherwise."""
    if name not in PARSERS:
        raise ValueError(f"{field}: unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)} "
                         "(the names vLLM's --tool-call-parser takes)")
    return PARSERS[name]


def detect_tool_parser(call_text: str) -> str | None:
    """The parser for a template from its rendering of one probe call named ``probe`` with
    arguments ``{"x": 1}`` (``call_text``: the assistant turn's text); None when no family matches."""
    t = call_text
    if _GEMMA4_START + "call:probe" in t:
        return "gemma4"
    if "to=functions.probe" in t:
        return "openai"
    if "<|tool_call_begin|>" in t:
        return "kimi_k2"
    if "<arg_key>" in t:
        return "glm45"
    if "<function=probe>" in t:
        return "qwen3_coder"
    if _DS_CALL + "probe" + _DS_SEP in t:
        return "deepseek_v31"
    if _DS_SEP + "probe" in t:
        return "deepseek_v3"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if re.search(r"\[\s*probe\(x=1\)\s*\]", t):
        return "pythonic"
    if re.search(r'\{\s*"(?:name|type)"', t) and '"parameters"' in t:
        return "llama3_json"
    return None
