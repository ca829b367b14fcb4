"""`axrl serve`: an HTTP server over the embedded engine that speaks SGLang's API subset.

The SGLang client (`axrl.inference.sglang`) drives this server and a real SGLang server the
same way, so the two are interchangeable; black-box agents get the OpenAI endpoints.

Endpoints (SGLang field names and semantics, see shared/ENGINES.md and `sglang.wire`):

- `POST /generate` — one request, or a batch (list-valued `input_ids`; admitted together, so
  a batch is scheduled exactly as `EmbeddedEngine.submit_many` would be in-process); `stream`
  sends cumulative SSE chunks then `data: [DONE]`. A client that disconnects aborts its requests.
- `POST /abort_request` {rid | abort_all}; `POST /flush_cache` (no prefix cache: a no-op).
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
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.sglang import weight_sync
from axrl.inference.sglang.wire import WireError, parse_weight_version, result_to_wire, sampling_from_wire
from axrl.model import hf_state_dict, load_hf
from axrl.tokenizer import Tokenizer

log = logging.getLogger("axrl.serve")

# /generate fields accepted and ignored (scheduling hints and features that do not change ids).
_IGNORED_GENERATE = {"log_metrics", "priority", "return_hidden_states", "lora_path", "custom_logit_processor",
                     "image_data", "audio_data", "video_data", "modalities", "session_params", "bootstrap_host",
                     "bootstrap_port", "bootstrap_room", "data_parallel_rank", "background", "extra_key", "no_logs"}
_GENERATE_FIELDS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
                    "top_logprobs_num", "return_text_in_logprobs", "stream", "rid", "return_routed_experts",
                    "routed_experts_start_len"} | _IGNORED_GENERATE
_STREAM_POLL_S = 0.02
_DISCONNECT_POLL_S = 0.25


@dataclass
class ServeConfig:
    """`axrl serve` settings; flag names follow `sglang.launch_server` where it has one."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    max_running_requests: int = 64     # engine slots (SGLang: --max-running-requests)
    context_length: int = 1024         # longest prompt + output (SGLang: --context-length)
    enable_return_routed_experts: bool = False
    random_seed: int = 0
    dtype: str = "float32"
    served_model_name: str | None = None
    weight_version: str = "0"
    decode_impl: str = "fused"
    threads: int = 1
    log_level: str = "warning"


class BadRequest(ValueError):
    """Client error → HTTP 400 with this message."""


def error_body(message: str, code: int = 400) -> dict[str, Any]:
    """SGLang's (OpenAI-style) error object."""
    return {"object": "error", "message": message, "type": "BadRequest" if code == 400 else "InternalServerError",
            "code": code}


class AxrlServer:
    """State behind the HTTP app: the engine, its tokenizer and the weight-sync machinery."""

    def __init__(self, engine: EmbeddedEngine, cfg: ServeConfig, tokenizer: Tokenizer | None) -> None:
        self.engine, self.cfg, self.tokenizer = engine, cfg, tokenizer
        self.model_name = cfg.served_model_name or Path(cfg.model_path).name or "axrl"
        # SGLang's weight_version is a free string; a numeric one *is* the engine's int version.
        self.version_label: str | None = None if parse_weight_version(cfg.weight_version) is not None \
            else cfg.weight_version
        self.shapes = {k: tuple(v.shape) for k, v in hf_state_dict(engine.model).items()}
        self.live: set[str] = set()
        self.groups: dict[str, Any] = {}
        self.staged: dict[str, torch.Tensor] | None = None
        self.staged_version: str | None = None
        self.weights_lock = asyncio.Lock()

    # -- versions ------------------------------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self.version_label if self.version_label is not None else str(self.engine.weight_version)

    def result_version(self, res: GenerateResult) -> str:
        return self.version_label if self.version_label is not None else str(res.weight_version)

    # -- requests ------------------------------------------------------------------------------
    def parse_generate(self, body: Any) -> tuple[list[GenerateRequest], list[dict[str, Any]], bool]:
        """Requests of a /generate body, per-request output options, and whether it was a batch."""
        if not isinstance(body, dict):
            raise BadRequest("the /generate body must be a JSON object")
        unknown = sorted(set(body) - _GENERATE_FIELDS)
        if unknown:
            raise BadRequest(f"{unknown[0]}: unknown /generate field (supported: {sorted(_GENERATE_FIELDS - _IGNORED_GENERATE)})")
        ids, text = body.get("input_ids"), body.get("text")
        if ids is None and text is None:
            raise BadRequest("input_ids: a request needs input_ids (or text)")
        if ids is None:
            ids = self.encode_text(text)
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        n = len(prompts)
        if body.get("logprob_start_len") not in (None, -1) and not (isinstance(body["logprob_start_len"], list)
                                                                     and set(body["logprob_start_len"]) <= {-1}):
            raise BadRequest("logprob_start_len: only -1 (output tokens only) is supported by axrl serve")
        if body.get("top_logprobs_num") not in (None, 0):
            raise BadRequest("top_logprobs_num: top logprobs are not supported by axrl serve (use 0)")
        routed = body.get("return_routed_experts", False)
        if not isinstance(routed, bool):
            raise BadRequest(f"return_routed_experts must be true or false, got {routed!r}")
        if routed and not self.cfg.enable_return_routed_experts:
            raise BadRequest("return_routed_experts: start the server with --enable-return-routed-experts")
        sampling = self.per_request(body, "sampling_params", n, batched, default=None)
        logprob = self.per_request(body, "return_logprob", n, batched, default=False)
        starts = self.per_request(body, "routed_experts_start_len", n, batched, default=0)
        rids = self.per_request(body, "rid", n, batched, default=None)
        text_lp = bool(body.get("return_text_in_logprobs", False))
        requests, options = [], []
        for i in range(n):
            at = f"[{i}]" if batched else ""
            raw_sp = sampling[i] or {}
            sp = sampling_from_wire(raw_sp, f"sampling_params{at}")
            if not isinstance(logprob[i], bool):
                raise BadRequest(f"return_logprob{at} must be true or false, got {logprob[i]!r}")
            start = starts[i]
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise BadRequest(f"routed_experts_start_len{at} must be an int >= 0, got {start!r}")
            if isinstance(prompts[i], list) and start > len(prompts[i]):
                raise BadRequest(f"routed_experts_start_len{at}={start} is beyond the prompt's {len(prompts[i])} tokens")
            rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
            if not isinstance(rid, str) or not rid:
                raise BadRequest(f"rid{at} must be a non-empty string, got {rid!r}")
            if not isinstance(prompts[i], list):
                raise BadRequest(f"input_ids{at} must be a list of token ids")
            requests.append(GenerateRequest(input_ids=prompts[i], sampling_params=sp, return_logprob=logprob[i],
                                            return_routed_experts=routed, routed_experts_start_len=start, rid=rid))
            options.append({"skip_special_tokens": bool(raw_sp.get("skip_special_tokens", True)),
                            "text_in_logprobs": text_lp})
        return requests, options, batched

    @staticmethod
    def per_request(body: dict[str, Any], key: str, n: int, batched: bool, default: Any) -> list[Any]:
        value = body.get(key, default)
        if batched and isinstance(value, list) and key != "input_ids":
            if len(value) != n:
                raise BadRequest(f"{key}: {len(value)} values for a batch of {n} requests")
            return value
        if isinstance(value, list) and key in ("rid", "routed_experts_start_len", "return_logprob"):
            raise BadRequest(f"{key}: a list is only valid for a batch (list-valued input_ids)")
        if batched and key == "rid" and value is not None:
            raise BadRequest("rid: a batch needs one rid per request (a list)")
        return [value] * n

    def encode_text(self, text: Any) -> Any:
        if self.tokenizer is None:
            raise BadRequest(f"text: the model directory {self.cfg.model_path} has no tokenizer; send input_ids")
        if isinstance(text, str):
            return self.tokenizer.encode(text)
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            return [self.tokenizer.encode(t) for t in text]
        raise BadRequest("text must be a string or a list of strings")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if self.tokenizer else ""

    def to_wire(self, res: GenerateResult, req: GenerateRequest, opt: dict[str, Any]) -> dict[str, Any]:
        texts = None
        if opt["text_in_logprobs"] and self.tokenizer is not None:
            texts = [self.tokenizer.decode([t]) for t in res.output_ids]
        return result_to_wire(res, text=self.decode(res.output_ids, opt["skip_special_tokens"]),
                              weight_version=self.result_version(res), return_logprob=req.return_logprob,
                              id_texts=texts)

    def submit(self, requests: list[GenerateRequest]) -> list[asyncio.Future]:
        """Submit atomically (one admission, as in-process); ValueError → BadRequest."""
        try:
            futures = self.engine.submit_many(requests)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        for r in requests:
            self.live.add(r.rid)
        return [asyncio.wrap_future(f) for f in futures]

    def done(self, requests: list[GenerateRequest]) -> None:
        for r in requests:
            self.live.discard(r.rid)

    def abort_all(self) -> int:
        return sum(self.engine.abort(rid) for rid in list(self.live))

    async def run(self, requests: list[GenerateRequest], is_disconnected: Any) -> list[GenerateResult]:
        """Run requests to completion; abort them if the HTTP client goes away meanwhile."""
        futures = self.submit(requests)
        try:
            gathered = asyncio.gather(*futures)
            while True:
                done, _ = await asyncio.wait([gathered], timeout=_DISCONNECT_POLL_S)
                if done:
                    return gathered.result()
                if await is_disconnected():
                    for r in requests:
                        self.engine.abort(r.rid)
        finally:
            self.done(requests)

    async def stream(self, req: GenerateRequest, opt: dict[str, Any]) -> AsyncIterator[bytes]:
        """SSE: cumulative chunks as tokens arrive, the final result, then [DONE]."""
        (future,) = self.submit([req])
        sent = -1
        try:
            while not future.done():
                snap = self.engine.progress(req.rid)
                if snap is not None and len(snap[0]) > sent:
                    sent = len(snap[0])
                    partial = GenerateResult(rid=req.rid, output_ids=snap[0], output_logprobs=snap[1],
                                             routed_experts=None, finish_reason=None,  # type: ignore[arg-type]
                                             weight_version=self.engine.weight_version,
                                             prompt_tokens=len(req.input_ids))
                    yield _sse(self.to_wire(partial, req, opt))
                await asyncio.wait([future], timeout=_STREAM_POLL_S)
            yield _sse(self.to_wire(future.result(), req, opt))
            yield b"data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 — SGLang reports stream errors in-band
            yield _sse({"error": {"message": f"{type(e).__name__}: {e}"}})
            yield b"data: [DONE]\n\n"
        finally:
            if not future.done():  # the client went away mid-stream
                self.engine.abort(req.rid)
            self.done([req])

    # -- weights -------------------------------------------------------------------------------
    def engine_version(self, weight_version: Any) -> tuple[int, str | None]:
        """(engine int version, label) for a requested SGLang weight_version (None: unchanged)."""
        if weight_version is None:
            return self.engine.weight_version, self.version_label
        if not isinstance(weight_version, (str, int)) or isinstance(weight_version, bool):
            raise BadRequest(f"weight_version must be a string, got {weight_version!r}")
        parsed = parse_weight_version(weight_version)
        if parsed is not None:
            return parsed, None
        return self.engine.weight_version + 1, str(weight_version)

    def full_state(self, updates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`updates` completed with the current values of every other weight (partial updates)."""
        unknown = sorted(set(updates) - set(self.shapes) - {"lm_head.weight"})
        if unknown:
            raise BadRequest(f"names: {unknown[:5]} are not weights of this model")
        for name, t in updates.items():
            if name in self.shapes and tuple(t.shape) != self.shapes[name]:
                raise BadRequest(f"shapes: '{name}' has shape {list(t.shape)}, the model's is {list(self.shapes[name])}")
        current = hf_state_dict(self.engine.model)
        return {**{k: v.clone() for k, v in current.items() if k not in updates}, **updates}

    async def apply(self, updates: dict[str, torch.Tensor] | str, weight_version: Any) -> None:
        """Load a state dict (possibly partial) or an HF directory into the engine, set the version."""
        version, label = self.engine_version(weight_version)
        source = updates if isinstance(updates, str) else self.full_state(updates)
        try:
            await asyncio.to_thread(self.engine.update_weights, source, version)
        except (ValueError, FileNotFoundError) as e:
            raise BadRequest(str(e)) from None
        self.version_label = label


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _need(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in body:
        raise BadRequest(f"{key}: missing required field")
    value = body[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def create_app(server: AxrlServer) -> FastAPI:
    """The FastAPI app for `server`."""
    from axrl.inference import openai_compat

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
        raw = await request.body()
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

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
        return PlainTextResponse("Cache flushed (axrl serve keeps no prefix cache).\n")

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

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return JSONResponse(await openai_compat.completions(server, await body_of(request), request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        return JSONResponse(await openai_compat.chat_completions(server, await body_of(request),
                                                                 request.is_disconnected))

    return app


def build_server(cfg: ServeConfig) -> AxrlServer:
    """Load the model directory and start the engine behind the server."""
    torch.set_num_threads(cfg.threads)
    model = load_hf(cfg.model_path, dtype=getattr(torch, cfg.dtype))
    tokenizer = Tokenizer.from_dir(cfg.model_path) if (Path(cfg.model_path) / "tokenizer.json").is_file() else None
    version = parse_weight_version(cfg.weight_version)
    engine = EmbeddedEngine(model, max_batch_size=cfg.max_running_requests, max_seq_len=cfg.context_length,
                            weight_version=version if version is not None else 0, seed=cfg.random_seed,
                            decode_impl=cfg.decode_impl)  # type: ignore[arg-type]
    return AxrlServer(engine, cfg, tokenizer)


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
    server = build_server(cfg)
    started = time.perf_counter()
    app = create_app(server)
    log.info("axrl serve: %s on http://%s:%d (%.1f s to load)", cfg.model_path, cfg.host, cfg.port,
             time.perf_counter() - started)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False)
