"""Request fields of the OpenAI endpoints and the validators that reject a bad one with a 400
naming it (the translation modules build engine requests from what passes).

Each server accepts OpenAI's own fields plus its extensions: `axrl serve` SGLang's (token ids
in and out, engine sampling knobs), the proxy a few that OpenAI SDKs send and it ignores.
"""

from __future__ import annotations

from typing import Any, Collection

from axrl.inference.openai.errors import ApiError, bad

# OpenAI's fields of both endpoints, of chat only, of completions only.
OPENAI_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                           "stream_options", "user", "logprobs", "frequency_penalty", "presence_penalty"})
OPENAI_CHAT = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
                         "top_logprobs", "response_format"})
OPENAI_COMPLETION = frozenset({"prompt", "echo", "suffix", "best_of", "logit_bias"})
# SGLang's extensions of both endpoints (engine sampling, token ids and meta_info out), and of chat.
SGLANG_COMMON = frozenset({"top_k", "stop_token_ids", "ignore_eos", "skip_special_tokens", "return_token_ids",
                           "return_meta_info", "repetition_penalty", "min_p", "no_stop_trim", "rid",
                           "return_routed_experts"})
SGLANG_CHAT = frozenset({"input_ids", "chat_template_kwargs"})
TOOL_CHOICES = (None, "auto", "none", "required")


def check_body(body: Any, allowed: Collection[str], endpoint: str) -> dict[str, Any]:
    """`body` as a JSON object with no field outside `allowed` (the first unknown one is named)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the {endpoint} body must be a JSON object")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad(unknown[0], f"unknown {endpoint} field")
    return body


def check_model(body: dict[str, Any], served: str | None) -> None:
    """`model` is a string and, when `served` is given, that name (another one is OpenAI's 404)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad("model", f"must be a string, got {model!r}")
    if served is not None and model != served:
        raise ApiError(404, f"model: {model!r} is not served here; this server serves {served!r} (GET /v1/models)",
                       param="model", code="model_not_found")


def number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    """`body[key]` as a float in [lo, hi]; None when absent."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(key, f"must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def integer(body: dict[str, Any], key: str, lo: int, hi: int, why: str = "") -> int | None:
    """`body[key]` as an int in [lo, hi]; None when absent. `why` says where the bounds come from."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(key, f"must be an integer in [{lo}, {hi}]{why}, got {v!r}")
    return v


def token_ids(value: Any, field: str) -> list[int] | None:
    """`value` as a list of token ids; None when it is not one (an empty list is a 400)."""
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list) and not value:
        raise bad(field, "is empty")
    return None


def include_usage(body: dict[str, Any], known: Collection[str] | None = ("include_usage",)) -> bool:
    """`stream_options.include_usage`; `known`: the options accepted (None: any, ignored)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or known is not None and set(options) - set(known):
        raise bad("stream_options", f"only {{{', '.join(repr(k) + ': bool' for k in known or ())}}} is supported"
                  if known is not None else "must be an object")
    return bool(options.get("include_usage"))


def check_messages(body: dict[str, Any], roles: Collection[str] | None = None, alternative: str = "") -> list[Any]:
    """`messages`: a non-empty list of objects whose role is a string (one of `roles` if given);
    `alternative` names what may replace them (e.g. pre-tokenized input)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"a non-empty list of {{role, content}} messages is required{alternative}")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or roles is not None and role not in roles:
            raise bad(f"messages[{i}]", "must be an object with " +
                      ("a string role" if roles is None else "role " + "|".join(roles)))
    return messages


def check_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """`tools` (a list of tool definitions) and `tool_choice` (OpenAI's values or an object)."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise bad("tools", "must be a list of tool definitions")
    choice = body.get("tool_choice")
    if choice not in TOOL_CHOICES and not isinstance(choice, dict):
        raise bad("tool_choice", f"must be 'auto', 'none', 'required' or an object, got {choice!r}")
    return tools
