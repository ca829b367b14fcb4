"""The HTTP app of `axrl serve`: an SGLang-compatible server over the embedded engine.

The SGLang client (`axrl.inference.sglang`) drives this server and a real SGLang server the
same way, so the two are interchangeable; black-box agents get the OpenAI endpoints. The
endpoints, grouped by concern (SGLang field names and semantics, see docs/sglang.md and
`sglang.wire`):

- generation, abort, KV-cache memory, health and info: `sglang_routes`;
- weight sync (from disk, from the trainer's process group): `weight_routes`;
- OpenAI `/v1/completions`, `/v1/chat/completions`: `openai_routes`;
- Anthropic `/v1/messages`, OpenAI `/v1/responses` (translated into chat calls): `api_routes`.

Errors are SGLang's error object `{"object": "error", "message", "type", "code"}` with status
400 for bad input (404 for a model not served); the message names the offending field.
"""

from __future__ import annotations

from contextlib import ExitStack, asynccontextmanager
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from axrl.inference.openai.errors import sglang_error_body
from axrl.inference.openai.http import handle_api_errors
from axrl.inference.serve.api_routes import add_api_routes
from axrl.inference.serve.openai_routes import add_openai_routes
from axrl.inference.serve.sglang_routes import add_generation_routes, add_info_routes
from axrl.inference.serve.state import AxrlServer
from axrl.inference.serve.weight_routes import (add_disk_weight_routes, add_distributed_weight_routes,
                                                add_weight_group_routes)
from axrl.inference.remote import weight_sync
from axrl.inference.sglang.wire import WireError


def create_app(server: AxrlServer, on_shutdown: Sequence[Callable[[], None]] = ()) -> FastAPI:
    """The FastAPI app for `server`; shutting it down runs `on_shutdown` in order, then stops the
    engine and leaves weight groups. (With a lifespan, Starlette never runs `router.on_shutdown`:
    what a front built on this app must release at shutdown goes here.)"""

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        with ExitStack() as stack:   # run last-pushed first, each even after one fails
            stack.callback(lambda: [weight_sync.destroy_weights_group(g) for g in server.groups.values()])
            stack.callback(server.engine.shutdown)
            for release in reversed(on_shutdown):
                stack.callback(release)
            yield

    app = FastAPI(title="axrl serve", lifespan=lifespan)
    handle_api_errors(app, lambda e: sglang_error_body(str(e), e.status))

    @app.exception_handler(WireError)
    async def bad_wire(_request: Request, exc: WireError) -> JSONResponse:
        return JSONResponse(sglang_error_body(str(exc)), status_code=400)

    add_generation_routes(app, server)
    add_info_routes(app, server)
    add_disk_weight_routes(app, server)
    add_weight_group_routes(app, server)
    add_distributed_weight_routes(app, server)
    add_openai_routes(app, server)
    add_api_routes(app, server)
    return app
