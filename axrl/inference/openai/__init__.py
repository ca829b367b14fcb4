"""The OpenAI-compatible front-end shared by `axrl serve` and the black-box agent proxy.

Shared pieces, each with one job (none knows where its tokens come from):

- `errors`: `ApiError`, the one client-error type, and its two error bodies (OpenAI's nested
  object for the proxy, SGLang's flat one that `axrl serve` answers like an SGLang server).
- `schema`: the request fields each endpoint accepts and the validators that turn a bad value
  into a 400 naming the field.
- `stops`: the one stop-string rule: which stop string a reply hit and where it is cut.
- `replies`: response shapes (choices, finish reasons, tool calls, usage, the envelope).
- `streaming`: the one SSE path: OpenAI's chunks from per-choice progress, then `[DONE]`.
- `http`: FastAPI glue (JSON bodies, JSON-or-SSE replies, error handlers).

An API shape is one module of routes + request/response translation over these pieces and a
backend: `axrl.inference.serve.openai_routes` (over `axrl serve`'s engine) and
`axrl.agents.proxy.openai_routes` (over a recording session). Other APIs are translations onto
the chat path, one module each (`translate` holds what they share):

- `anthropic_messages`: Anthropic's `/v1/messages` (request → chat body, chat reply → message,
  its SSE events, Anthropic's error object);
- `responses` (+ `responses_stream`, its events): OpenAI's `/v1/responses`.

Both backends serve them through their own chat handler (`axrl.agents.proxy.api_routes`,
`axrl.inference.serve.api_routes`), so generation and recording stay in one place.
This package never imports `axrl.agents` (the proxy imports it, not the other way round).
"""
