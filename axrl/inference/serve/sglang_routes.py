"""`axrl serve`'s SGLang endpoints besides weight sync: generation, abort, memory, health, info.

- `POST /generate` — one request, or a batch (list-valued `input_ids`; admitted together, so
  a batch is scheduled exactly as `EmbeddedEngine.submit_many` would be in-process); `stream`
  sends cumulative SSE chunks then `data: [DONE]`. A client that disconnects aborts its requests.
  A prefill-only request (`max_new_tokens: 0`, `logprob_start_len: 0`) returns teacher-forced
  prompt logprobs instead (`score_route`).
- `POST /abort_request` {rid | abort_all}; `POST /flush_cache` (a no-op: every weight update
  clears the prefix cache); `POST /release_memory_occupation` (frees the KV cache while idle;
  400 with requests in flight), `POST /resume_memory_occupation`.
- `GET /health`, `/health_generate`, `/get_model_info` (= `/model_info`), `/get_weight_version`,
  `/get_server_info`, `/v1/models`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from axrl.inference.openai.errors import ApiError, bad
from axrl.inference.openai.http import json_body
from axrl.inference.protocol import GenerateRequest
from axrl.inference.serve.score_route import is_prefill_scoring, score_body
from axrl.inference.serve.state import AxrlServer


def add_generation_routes(app: FastAPI, server: AxrlServer) -> None:
    """`/generate`, `/abort_request` and the KV-cache endpoints."""

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await json_body(request)
        if is_prefill_scoring(body):  # teacher-forced prompt logprobs, nothing generated
            return JSONResponse(await score_body(server, body))
        requests, options, batched = server.parse_generate(body)
        if body.get("stream"):
            if batched:
                raise bad("stream", "streaming a batch is not supported by axrl serve; send one request")
            return StreamingResponse(server.stream(requests[0], options[0]), media_type="text/event-stream")
        results = await server.run(requests, request.is_disconnected)
        out = [server.to_wire(res, req, opt) for res, req, opt in zip(results, requests, options)]
        return JSONResponse(out if batched else out[0])

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(request)
        if body.get("abort_all"):
            server.abort_all()
        elif body.get("rid") is not None:
            rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
            for rid in rids:
                if not isinstance(rid, str):
                    raise bad("rid", f"must be a string, got {rid!r}")
                server.engine.abort(rid)
        else:
            raise bad("rid", "give the rid to abort (or abort_all: true)")
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        return PlainTextResponse("Nothing to flush: the prefix cache is cleared by every weight update.\n")

    @app.post("/release_memory_occupation")
    async def release_memory_occupation() -> JSONResponse:
        try:
            await asyncio.to_thread(server.engine.release_memory)
        except RuntimeError as e:
            raise ApiError(400, str(e)) from None
        return JSONResponse({"success": True, "message": "KV cache released"})

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation() -> JSONResponse:
        await asyncio.to_thread(server.engine.resume_memory)
        return JSONResponse({"success": True, "message": "KV cache resumed"})


def add_info_routes(app: FastAPI, server: AxrlServer) -> None:
    """Health checks and what the server serves (model, version, settings)."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if server.engine.health()["ok"] else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        req = GenerateRequest(input_ids=[0], rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        req.sampling_params.max_new_tokens, req.sampling_params.temperature = 1, 0.0
        try:
            (future,) = server.submit([req])
            await asyncio.wait_for(future, 20)
        except Exception:  # noqa: BLE001 — any failure means unhealthy
            return Response(status_code=503)
        finally:
            server.done([req])
        return Response(status_code=200)

    def model_info() -> dict[str, Any]:
        c = server.engine.config
        return {"model_path": server.cfg.model_path, "tokenizer_path": server.tokenizer_path,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": server.weight_version,
                "served_model_name": server.model_name, "server": "axrl",
                "num_hidden_layers": c.num_hidden_layers, "vocab_size": c.vocab_size,
                "num_experts_per_tok": c.num_experts_per_tok if c.is_moe else 0,
                "routed_experts_start_len_list": True}

    app.get("/get_model_info")(model_info)
    app.get("/model_info")(model_info)

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": server.weight_version}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        from axrl import __version__

        return {**vars(server.cfg), **server.engine.health(), "weight_version": server.weight_version,
                "version": f"axrl-{__version__}"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "axrl",
                                            "root": server.model_name,
                                            "max_model_len": server.cfg.context_length}]}
