"""OpenAI `/v1/completions` and `/v1/chat/completions` for `axrl serve` (black-box agents).

Prompts may be text, chat messages or token ids (`prompt` as ids; chat `input_ids`, as SGLang
accepts). Token-level data comes back the SGLang way: `return_token_ids` adds
`prompt_token_ids` / `response_token_ids` to each choice, `return_meta_info` adds the engine's
`meta_info` (logprobs with token ids, routed experts, weight_version). Chat replies are parsed
for `<tool_call>` blocks into OpenAI `tool_calls` when the request declares `tools`.
Non-streaming only; `n` must be 1 (ask several times, or send a batch to `/generate`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.sglang.wire import sampling_from_wire
from axrl.tokenizer import parse_tool_calls

if TYPE_CHECKING:
    from axrl.inference.server import AxrlServer

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
           "ignore_eos", "skip_special_tokens", "return_token_ids", "return_meta_info", "user", "logprobs",
           "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "no_stop_trim", "rid",
           "return_routed_experts", "stream_options"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of", "logit_bias"}
_CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "top_logprobs", "max_completion_tokens",
                          "input_ids", "chat_template_kwargs", "parallel_tool_calls", "response_format"}


def _bad(message: str) -> Exception:
    from axrl.inference.server import BadRequest

    return BadRequest(message)


def _check_fields(body: Any, allowed: set[str], endpoint: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _bad(f"the {endpoint} body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(f"{unknown[0]}: unknown {endpoint} field")
    if body.get("stream"):
        raise _bad(f"stream: {endpoint} streaming is not supported by axrl serve; use /generate with stream")
    if body.get("n", 1) != 1:
        raise _bad(f"n={body['n']!r}: axrl serve returns one choice per request (n=1)")
    return body


def _request(server: "AxrlServer", body: dict[str, Any], ids: list[int], max_tokens_key: str,
             want_logprob: bool) -> GenerateRequest:
    """A GenerateRequest from the OpenAI sampling fields (validated by the SGLang parser)."""
    sampling: dict[str, Any] = {"max_new_tokens": body.get(max_tokens_key) or body.get("max_tokens") or 16}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "sampling_seed"),
                     ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"), ("min_p", "min_p"),
                     ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                     ("repetition_penalty", "repetition_penalty")):
        if body.get(src) is not None:
            sampling[dst] = body[src]
    if body.get("stop"):
        raise _bad("stop: stop strings are not supported by axrl serve; use stop_token_ids")
    sp = sampling_from_wire(sampling, "request")
    routed = bool(body.get("return_routed_experts"))
    if routed and not server.cfg.enable_return_routed_experts:
        raise _bad("return_routed_experts: start the server with --enable-return-routed-experts")
    return GenerateRequest(input_ids=ids, sampling_params=sp, return_logprob=want_logprob or
                           bool(body.get("return_meta_info")), return_routed_experts=routed,
                           rid=body.get("rid") or uuid.uuid4().hex)


def _ids(value: Any, field: str) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list) and not value:
        raise _bad(f"{field} is empty")
    return None


def _finish(res: GenerateResult, tool_calls: bool = False) -> tuple[str, Any]:
    kind = res.finish_type
    if tool_calls and kind == "stop":
        return "tool_calls", res.finish_reason.get("matched")
    return {"stop": "stop", "length": "length"}.get(kind, "abort"), res.finish_reason.get("matched")


def _extras(server: "AxrlServer", choice: dict[str, Any], body: dict[str, Any], req: GenerateRequest,
            res: GenerateResult) -> dict[str, Any]:
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = list(req.input_ids)
        choice["response_token_ids"] = list(res.output_ids)
    if body.get("return_meta_info"):
        choice["meta_info"] = server.to_wire(res, req, {"skip_special_tokens": True,
                                                        "text_in_logprobs": False})["meta_info"]
    return choice


def _usage(reqs: list[GenerateRequest], results: list[GenerateResult]) -> dict[str, int]:
    prompt = sum(len(r.input_ids) for r in reqs)
    completion = sum(len(r.output_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def completions(server: "AxrlServer", body: Any, is_disconnected: Any) -> dict[str, Any]:
    """`POST /v1/completions`: `prompt` is text, token ids, or a list of either (one choice each)."""
    body = _check_fields(body, _COMPLETION_FIELDS, "/v1/completions")
    if body.get("echo"):
        raise _bad("echo: echoing the prompt is not supported by axrl serve")
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt: missing required field")
    single = _ids(prompt, "prompt")
    if single is not None or isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise _bad("prompt must be a string, a list of token ids, or a list of those")
    ids = [(_ids(p, f"prompt[{i}]") if isinstance(p, list) else server.encode_text(p)) for i, p in enumerate(prompts)]
    if any(i is None for i in ids):
        raise _bad("prompt: lists must hold integer token ids")
    logprobs = body.get("logprobs")
    reqs = [_request(server, body, p, "max_tokens", logprobs is not None) for p in ids]
    if len(reqs) > 1:
        for i, r in enumerate(reqs):
            r.rid = f"{r.rid}-{i}"
    results = await server.run(reqs, is_disconnected)
    choices = []
    for i, (req, res) in enumerate(zip(reqs, results)):
        reason, matched = _finish(res)
        choice: dict[str, Any] = {"index": i, "text": server.decode(res.output_ids, bool(body.get("skip_special_tokens",
                                                                                                  True))),
                                  "logprobs": None, "finish_reason": reason, "matched_stop": matched}
        if logprobs is not None:
            tokens = [server.decode([t], False) for t in res.output_ids]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(res.output_logprobs),
                                  "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, res.output_logprobs)],
                                  "text_offset": [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]}
        choices.append(_extras(server, choice, body, req, res))
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices, "usage": _usage(reqs, results)}


def _chat_ids(server: "AxrlServer", body: dict[str, Any]) -> list[int]:
    ids = body.get("input_ids")
    if ids is not None:
        parsed = _ids(ids, "input_ids")
        if parsed is None:
            raise _bad("input_ids must be a list of integer token ids")
        return parsed
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: a non-empty list of {role, content} messages is required (or input_ids)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string role")
    if server.tokenizer is None:
        raise _bad(f"messages: the model directory {server.cfg.model_path} has no tokenizer; send input_ids")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be a list of tool definitions")
    try:
        return list(server.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True))
    except Exception as e:  # noqa: BLE001 — a template error is the request's fault
        raise _bad(f"messages: cannot render the chat template: {e}") from None


async def chat_completions(server: "AxrlServer", body: Any, is_disconnected: Any) -> dict[str, Any]:
    """`POST /v1/chat/completions` over the model's chat template (or pre-tokenized `input_ids`)."""
    body = _check_fields(body, _CHAT_FIELDS, "/v1/chat/completions")
    want_logprobs = bool(body.get("logprobs"))
    req = _request(server, body, _chat_ids(server, body), "max_completion_tokens", want_logprobs)
    (res,) = await server.run([req], is_disconnected)
    out = res.output_ids
    eos = server.tokenizer.eos_token_id if server.tokenizer else None
    text = server.decode(out[:-1] if out and out[-1] == eos else out, skip_special_tokens=False)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = parse_tool_calls(text) if body.get("tools") else []
    good = [c for c in calls if c["error"] is None]
    if good:
        message["content"] = text.split("<tool_call>")[0].strip() or None
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                 for c in good]
    reason, matched = _finish(res, tool_calls=bool(good))
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason,
                              "matched_stop": matched}
    if want_logprobs:
        choice["logprobs"] = {"content": [
            {"token": server.decode([t], False), "logprob": lp, "bytes": list(server.decode([t], False).encode()),
             "top_logprobs": []} for t, lp in zip(out, res.output_logprobs)]}
    _extras(server, choice, body, req, res)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": server.model_name, "choices": [choice], "usage": _usage([req], [res])}
