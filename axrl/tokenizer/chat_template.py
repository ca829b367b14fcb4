"""The ChatML chat template and a renderer that behaves like transformers' own.

Format (Qwen-style ChatML):

    <|im_start|>{role}\\n{content}<|im_end|>\\n

* ``system``: rendered as above. When ``tools`` are given, the tool list is appended to the
  first message's system block (a system block holding only the tools is emitted when the
  conversation does not start with a system message).
* ``assistant``: content, then each tool call as ``<tool_call>\\n{json}\\n</tool_call>``,
  separated from the content and from each other by ``\\n``. A call may be given as
  ``{"function": {"name", "arguments"}}`` (OpenAI) or ``{"name", "arguments"}``;
  ``arguments`` may be a dict or an already-serialised JSON string.
* ``tool``: every tool message gets its *own* user block,
  ``<|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n``.
  Unlike Qwen, consecutive tool results are not merged into one block: merging would make
  a message's rendering depend on its neighbours, which breaks incremental encoding.
* ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``.

Every message renders independently of the others and starts with the special token
``<|im_start|>``, so rendering (and tokenizing) a conversation equals concatenating the
renderings of its messages. Multi-turn agents rely on that to grow a token stream turn by turn.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids (0..6); changing it changes every token id ever recorded in a trace.
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>")

# Raw string: the `\n` escapes are Jinja string-literal escapes, not Python ones.
CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + tool | tojson }}
{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not (tools and loop.first) %}
{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.content %}
{{- message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n{"name": ' + fn.name | tojson + ', "arguments": ' }}
{%- if fn.arguments is string %}
{{- fn.arguments }}
{%- else %}
{{- fn.arguments | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same as transformers' override: Jinja's built-in tojson HTML-escapes `<`, `>`, `&`, `'`,
    # which would change the rendered text (and the tokens) relative to HF.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> Template:
    """Compile ``source`` in an environment configured like transformers' chat renderer."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    # transformers' global, which Llama 3.2 templates call for "Today Date" when none is passed.
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


# Names an assistant message's reasoning arrives under (OpenAI-compatible servers and SDKs differ).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _drop_none(message: dict[str, Any]) -> dict[str, Any]:
    # transformers drops None-valued keys (OpenAI sends content=None next to tool_calls);
    # doing the same keeps both renderers byte-identical.
    return {k: v for k, v in message.items() if v is not None}


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its reasoning under every name templates read, as transformers 5 does:
    the first of ``REASONING_FIELDS`` that is set fills ``reasoning_content`` (what Qwen3 /
    DeepSeek templates read) and ``thinking`` (gpt-oss), so a client's choice of name never
    changes the prompt."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render(
    source: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with the Jinja chat template ``source``, as transformers does."""
    return compile_template(source).render(
        messages=[_alias_reasoning(_drop_none(dict(m))) for m in messages],
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
