"""Anthropic Messages (`POST /v1/messages`) and OpenAI Responses (`POST /v1/responses`) of
`axrl serve`.

Each request is translated into a chat-completions call (`axrl.inference.openai.anthropic_messages`,
`.responses`) and answered by `axrl serve`'s own chat path (`openai_routes.chat_completions`):
the same template, sampling and stop-string rule; `stream: true` streams the chat call and
translates its chunks as the tokens arrive. `model` must be the served name, as for
chat. Errors are each API's own error object (not SGLang's, as the rest of `axrl serve`): these
routes answer Anthropic and OpenAI SDKs.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from axrl.inference.openai import anthropic_messages
from axrl.inference.openai.errors import ApiError, openai_error_body
from axrl.inference.openai.http import error_response, json_body, json_or_sse
from axrl.inference.openai.responses import create_response
from axrl.inference.openai.translate import ChatFn
from axrl.inference.serve.openai_routes import chat_completions
from axrl.inference.serve.state import AxrlServer
from axrl.inference.sglang.wire import WireError

# Path, translation (body, chat, model -> reply), error body.
_ROUTES = (("/v1/messages", anthropic_messages.create_message, anthropic_messages.error_body),
           ("/v1/responses", create_response, openai_error_body))


def add_api_routes(app: FastAPI, server: AxrlServer) -> None:
    """`POST /v1/messages` and `POST /v1/responses` of `server` on `app`."""
    for path, translate, error_body in _ROUTES:
        _add_route(app, server, path, translate, error_body)


def _add_route(app: FastAPI, server: AxrlServer, path: str, translate: Callable[..., Any],
               error_body: Callable[[ApiError], dict[str, Any]]) -> None:
    @app.post(path, name=path)
    async def route(request: Request) -> Response:
        async def run(body: dict[str, Any]) -> Any:  # the reply, or its chunks when streamed
            return await chat_completions(server, body, request.is_disconnected)

        chat: ChatFn = run
        try:
            return json_or_sse(await translate(await json_body(request), chat, server.model_name))
        except ApiError as e:
            return error_response(e, error_body)
        except WireError as e:  # a sampling value the engine refuses (the message names it)
            return error_response(ApiError(400, str(e)), error_body)
