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
`axrl.agents.proxy.openai_routes` (over a recording session). A new shape (Anthropic
`/v1/messages`, OpenAI `/v1/responses`) adds its own module beside them and reuses the rest.
This package never imports `axrl.agents` (the proxy imports it, not the other way round).
"""
