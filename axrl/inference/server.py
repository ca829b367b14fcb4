"""`axrl serve`: an HTTP server over the embedded engine that speaks SGLang's API subset.

The SGLang client (`axrl.inference.sglang`) drives this server and a real SGLang server the
same way, so the two are interchangeable; black-box agents get the OpenAI endpoints.

Endpoints (SGLang field names and semantics, see docs/sglang.md and `sglang.wire`):

- `POST /generate` — one request, or a batch (list-valued `input_ids`; admitted together, so
  a batch is scheduled exactly as `EmbeddedEngine.submit_many` would be in-process); `stream`
  sends cumulative SSE chunks then `data: [DONE]`. A client that disconnects aborts its requests.
- `POST /abort_request` {rid | abort_all}; `POST /flush_cache` (a no-op: every weight update clears the prefix cache);
  `POST /release_memory_occupation` (frees the KV cache while idle; 400 with requests in flight),
  `POST /resume_memory_occupation`.
- Weight sync: `POST /update_weights_from_disk` {model_path, weight_version};
  `POST /init_weights_update_group` {master_address, master_port, rank_offset, world_size,
  group_name, backend="gloo"} joins the trainer's process group as rank `rank_offset`;
  `POST /update_weights_from_distributed` {names, dtypes, shapes, group_name, weight_version}
  receives the trainer's broadcasts (a subset of names is fine; the rest keep their values);
  `POST /begin_weight_update` … `/end_weight_update` stage several updates and apply them at
  once; `POST /update_weight_version` {new_version}; `POST /destroy_weights_update_group`;
  `GET|POST /get_weights_by_name` {name, truncate_size}.
- `GET /health`, `/health_generate`, `/get_model_info` (= `/model_info`), `/get_weight_version`,
  `/get_server_info`, `/v1/models`; `POST /v1/completions`, `/v1/chat/completions`
  (`axrl.inference.openai_compat`).

Errors are SGLang's error object `{"object": "error", "message", "type", "code"}` with status
400 for bad input; the message names the offending field.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from axrl.inference import openai_compat
from axrl.inference.http_body import parse_json_body
from axrl.inference.protocol import GenerateRequest
from axrl.inference.serving import AxrlServer, BadRequest, ServeConfig, build_server, error_body
from axrl.inference.sglang import weight_sync
from axrl.inference.sglang.wire import WireError
from axrl.model import hf_state_dict

__all__ = ["AxrlServer", "BadRequest", "ServeConfig", "build_server", "create_app", "serve"]


def _need(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in body:
        raise BadRequest(f"{key}: missing required field")
    value = body[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def create_app(server: AxrlServer) -> FastAPI:
    """The FastAPI app for `server`."""

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            server.engine.shutdown()
            for group in server.groups.values():
                weight_sync.destroy_weights_group(group)

    app = FastAPI(title="axrl serve", lifespan=lifespan)

    async def body_of(request: Request) -> Any:
        try:
            return parse_json_body(await request.body())
        except ValueError as e:
            raise BadRequest(str(e)) from None

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(exc), exc.code), status_code=exc.code)

    @app.exception_handler(WireError)
    async def bad_wire(_request: Request, exc: WireError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await body_of(request)
        requests, options, batched = server.parse_generate(body)
        if body.get("stream"):
            if batched:
                raise BadRequest("stream: streaming a batch is not supported by axrl serve; send one request")
            return StreamingResponse(server.stream(requests[0], options[0]), media_type="text/event-stream")
        results = await server.run(requests, request.is_disconnected)
        out = [server.to_wire(res, req, opt) for res, req, opt in zip(results, requests, options)]
        return JSONResponse(out if batched else out[0])

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await body_of(request)
        if body.get("abort_all"):
            server.abort_all()
        elif body.get("rid") is not None:
            rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
            for rid in rids:
                if not isinstance(rid, str):
                    raise BadRequest(f"rid must be a string, got {rid!r}")
                server.engine.abort(rid)
        else:
            raise BadRequest("rid: give the rid to abort (or abort_all: true)")
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        return PlainTextResponse("Nothing to flush: the prefix cache is cleared by every weight update.\n")

    @app.post("/release_memory_occupation")
    async def release_memory_occupation() -> JSONResponse:
        try:
            await asyncio.to_thread(server.engine.release_memory)
        except RuntimeError as e:
            raise BadRequest(str(e)) from None
        return JSONResponse({"success": True, "message": "KV cache released"})

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation() -> JSONResponse:
        await asyncio.to_thread(server.engine.resume_memory)
        return JSONResponse({"success": True, "message": "KV cache resumed"})

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
        return {"model_path": server.cfg.model_path, "tokenizer_path": server.cfg.model_path,
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

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Any:
        body = await body_of(request)
        name = _need(body, "name", str)
        size = body.get("truncate_size", 100)
        weights = hf_state_dict(server.engine.model)
        if name not in weights:
            raise BadRequest(f"name: {name!r} is not a weight of this model")
        return weights[name].reshape(-1)[: int(size)].tolist()

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await body_of(request)
        path = _need(body, "model_path", str)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format: {body['load_format']!r} is not supported (use auto/safetensors)")
        async with server.weights_lock:
            if body.get("abort_all_requests"):
                server.abort_all()
            try:
                await server.apply(path, body.get("weight_version"))
            except BadRequest as e:
                return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)
        return JSONResponse({"success": True, "num_paused_requests": 0,
                             "message": f"Loaded {path}. Weight version updated to {server.weight_version}."})

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await body_of(request)
        address, port = _need(body, "master_address", str), _need(body, "master_port", int)
        rank_offset, world = _need(body, "rank_offset", int), _need(body, "world_size", int)
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            raise BadRequest(f"backend: axrl serve runs on CPU and joins weight groups with 'gloo', not {backend!r}")
        if name in server.groups:
            raise BadRequest(f"group_name: this server is already in group {name!r}; destroy it first")
        try:
            server.groups[name] = await asyncio.to_thread(
                weight_sync.init_weights_group, master_address=address, master_port=port, rank=rank_offset,
                world_size=world, group_name=name, backend=backend)
        except Exception as e:  # noqa: BLE001 — rendezvous failures are reported, not raised
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, status_code=400)
        return JSONResponse({"success": True, "message": f"joined {name!r} as rank {rank_offset} of {world}"})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await body_of(request)
        name = body.get("group_name", "weight_update_group")
        group = server.groups.pop(name, None)
        if group is None:
            return JSONResponse({"success": False, "message": f"group_name: no group {name!r}"}, status_code=400)
        weight_sync.destroy_weights_group(group)
        return JSONResponse({"success": True, "message": f"left {name!r}"})

    @app.post("/begin_weight_update")
    async def begin_weight_update() -> JSONResponse:
        server.staged, server.staged_version = {}, None
        return JSONResponse({"success": True, "message": "staging weight updates until /end_weight_update"})

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        staged, version = server.staged, server.staged_version
        server.staged, server.staged_version = None, None
        if staged:
            async with server.weights_lock:
                await server.apply(staged, version)
        return JSONResponse({"success": True, "message": f"weight version {server.weight_version}"})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await body_of(request)
        names, dtypes, shapes = _need(body, "names", list), _need(body, "dtypes", list), _need(body, "shapes", list)
        name = body.get("group_name", "weight_update_group")
        group = server.groups.get(name)
        if group is None:
            raise BadRequest(f"group_name: no weight-update group {name!r}; call /init_weights_update_group first")
        try:
            for i, dt in enumerate(dtypes):
                weight_sync.dtype_from_name(dt, f"dtypes[{i}]")
        except ValueError as e:
            raise BadRequest(str(e)) from None
        async with server.weights_lock:
            # Receive even what will be rejected below: skipping the broadcasts would hang the sender.
            try:
                received = await asyncio.to_thread(weight_sync.receive_weights, group, names, dtypes, shapes)
            except (ValueError, RuntimeError) as e:
                return JSONResponse({"success": False, "message": f"receive failed: {e}"}, status_code=400)
            if body.get("abort_all_requests"):
                server.abort_all()
            if server.staged is not None:
                server.full_state(received)  # validates names and shapes now, applies at end_weight_update
                server.staged.update(received)
                if body.get("weight_version") is not None:
                    server.staged_version = body["weight_version"]
            else:
                await server.apply(received, body.get("weight_version"))
        return JSONResponse({"success": True, "message": f"received {len(names)} tensors; "
                                                         f"weight version {server.weight_version}"})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await body_of(request)
        new = _need(body, "new_version", (str, int))
        if body.get("abort_all_requests", True):
            server.abort_all()
        server.version_label = str(new)
        return JSONResponse({"success": True, "message": f"Weight version updated to {new}", "new_version": str(new)})

    def openai_reply(reply: dict[str, Any] | AsyncIterator[bytes]) -> Response:
        if isinstance(reply, dict):
            return JSONResponse(reply)
        return StreamingResponse(reply, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return openai_reply(await openai_compat.completions(server, await body_of(request), request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return openai_reply(await openai_compat.chat_completions(server, await body_of(request),
                                                                 request.is_disconnected))

    return app


def _exit_with_parent(parent: int) -> None:
    """A launched server must not outlive its trainer, even one killed with SIGKILL."""
    import os
    import signal
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown

    threading.Thread(target=watch, name="axrl-serve-parent-watch", daemon=True).start()


def serve(cfg: ServeConfig) -> None:
    """Run the server until SIGINT/SIGTERM (or until the launching process, AXRL_PARENT_PID, dies)."""
    import os

    import uvicorn

    if os.environ.get("AXRL_PARENT_PID", "").isdigit() and int(os.environ["AXRL_PARENT_PID"]) == os.getppid():
        _exit_with_parent(os.getppid())
    started = time.perf_counter()
    server = build_server(cfg)
    app = create_app(server)
    print(startup_message(server, time.perf_counter() - started), file=sys.stderr, flush=True)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False)


def startup_message(server: AxrlServer, load_seconds: float) -> str:
    """What `axrl serve` prints before it starts listening: the model, the address, the endpoints."""
    cfg, model = server.cfg, server.engine.config
    experts = f", {model.num_experts} experts top-{model.num_experts_per_tok}" if model.is_moe else ""
    params = sum(t.numel() for t in hf_state_dict(server.engine.model).values()) / 1e6
    tokenizer = ("its tokenizer and chat template" if server.tokenizer is not None
                 else "no tokenizer (send token ids: input_ids / prompt as ids)")
    base = f"http://{cfg.host}:{cfg.port}"
    return (f"axrl serve: model {server.model_name!r} from {cfg.model_path} ({model.model_type}, "
            f"{model.num_hidden_layers} layers{experts}, {params:.2f}M parameters, {cfg.dtype}; {tokenizer}; "
            f"loaded in {load_seconds:.1f} s)\n"
            f"  listening on {base}: OpenAI {base}/v1/chat/completions, {base}/v1/completions (model "
            f"{server.model_name!r}), SGLang {base}/generate; Ctrl-C stops")
