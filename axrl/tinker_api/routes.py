"""The Tinker REST API (`tinker==0.38.0`) under `/api/v1`, on `axrl serve --training`.

Plain JSON except the `forward_backward` body and the `ForwardBackwardOutput` / `SampleResponse`
results of `retrieve_future`, which are protobuf (`wire`). The key arrives in `X-API-Key` and must
start with `tml-`. The client config asks the SDK for plain httpx, no JWT, no compression,
sequential forward_backward chunks and no stuck-request detection.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from axrl.tinker_api.errors import RefusedRequest, UserError
from axrl.tinker_api.futures import Result, error_result
from axrl.tinker_api.sampling import BASE, SampleSpec, parse_stop
from axrl.tinker_api.state import ServiceState
from axrl.tinker_api.wire import decode_forward_backward

PROTO = "application/x-protobuf"
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
                 "proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": False,
                 "sample_enable_stuck_detection": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}


def _future(rid: str, extra: dict[str, Any] | None = None, model_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": rid, **(extra or {})}
    if model_id is not None:
        out["model_id"] = model_id
    return out


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as e:
        raise UserError(f"{request.url.path}: the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise UserError(f"{request.url.path}: the body must be a JSON object")
    return body


def add_tinker_routes(app: FastAPI, state: ServiceState) -> None:
    """Put the `/api/v1` routes of the Tinker API on `app`."""

    @app.middleware("http")
    async def api_key(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/api/v1/") and not request.url.path.endswith("/healthz"):
            key = request.headers.get("x-api-key", "")
            if not key.startswith("tml-"):
                return JSONResponse({"error": "X-API-Key must start with 'tml-' (set TINKER_API_KEY=tml-…)",
                                     "category": "user"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(UserError)
    async def user_error(_request: Request, exc: UserError) -> JSONResponse:
        return JSONResponse({"error": str(exc), "category": "user"}, status_code=400)

    _add_session_routes(app, state)
    _add_training_routes(app, state)
    _add_weight_routes(app, state)
    _add_sampling_routes(app, state)
    _add_future_routes(app, state)


def _add_session_routes(app: FastAPI, state: ServiceState) -> None:
    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.api_route("/api/v1/healthz", methods=["GET", "POST"])
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        body = await _json(request)
        return {"type": "create_session", "session_id": state.new_session(list(body.get("tags") or []))}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        s = state.session(str((await _json(request)).get("session_id")))
        if s.finished:
            return JSONResponse({"error": "session finished"}, status_code=410)
        s.last_heartbeat = time.time()
        return JSONResponse({"type": "session_heartbeat"})

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        body = await _json(request)
        s = state.session(session_id)
        s.finished = s.finished or str((body.get("reason") or {}).get("type", "success"))
        return Response(status_code=200, content=b"null", media_type="application/json")

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}


def _add_training_routes(app: FastAPI, state: ServiceState) -> None:
    store = state.store

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        body = await _json(request)
        sid = str(body.get("session_id"))
        state.session(sid)
        state.check_base_model(body.get("base_model"))
        opt = body.get("optimizer_config") or {}
        if opt.get("type", "adamw") != "adamw":
            raise UserError(f"optimizer_config.type {opt.get('type')!r}: AxRL trains with AdamW only")
        lora = body.get("lora_config") or None
        rank = None if lora is None else int(lora.get("rank", 0)) or None
        model_id = f"{sid}:train:{int(body.get('model_seq_id', 0))}"

        def run() -> Result:
            state.create_model(model_id, rank)
            return "json", {"type": "create_model", "model_id": model_id}
        return _future(store.submit(run, state.train_pool), model_id=model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return state.info(state.model((await _json(request)).get("model_id")))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        try:
            call = decode_forward_backward(await request.body())
        except RefusedRequest as e:         # a bad datum / config: the header and its seq_id parsed
            return await _refuse(state, e.model_id, e.seq_id, e)
        except UserError as e:              # not a protobuf at all: there is no seq_id to consume
            return _future(store.complete(error_result(e)))
        try:
            model = state.model(call.model_id)
        except UserError as e:
            return await _refuse(state, call.model_id, call.seq_id, e)
        rid, _ = await store.submit_ordered(call.model_id, call.seq_id,
                                            lambda: ("proto", model.forward_backward(call)), state.train_pool)
        return _future(rid, model_id=call.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        body = await _json(request)
        params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params") or {}
        return await _ordered(state, body, lambda m: ("json", {"type": "optim_step", **m.optim_step(params)}))


async def _refuse(state: ServiceState, model_id: str, seq_id: int, e: UserError) -> dict[str, Any]:
    """Answer a refused request in its turn: it consumes its seq_id like a served one (else the
    model's next request would wait `gap_s` for it); a retried POST gets the same refusal."""
    rid, _ = await state.store.submit_ordered(str(model_id), seq_id, lambda: error_result(e), state.train_pool)
    return _future(rid, model_id=str(model_id))


async def _ordered(state: ServiceState, body: dict[str, Any], op: Any) -> dict[str, Any]:
    """Run `op(model)` in the model's seq_id order on the training thread; the future."""
    seq = body.get("seq_id")
    if not isinstance(seq, int) or isinstance(seq, bool):
        return _future(state.store.complete(error_result(UserError(f"seq_id must be an integer, got {seq!r}"))))
    try:
        model = state.model(body.get("model_id"))
    except UserError as e:
        return await _refuse(state, str(body.get("model_id")), seq, e)
    rid, _ = await state.store.submit_ordered(model.model_id, seq, lambda: op(model), state.train_pool)
    return _future(rid, model_id=model.model_id)


def _add_weight_routes(app: FastAPI, state: ServiceState) -> None:
    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        body = await _json(request)

        def op(model: Any) -> Result:
            name = body.get("path") or f"step_{model.step:06d}"
            path = f"tinker://{model.model_id}/weights/{name}"
            state.saved[path] = model.save_state()
            return "json", {"type": "save_weights", "path": path}
        return await _ordered(state, body, op)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await _json(request)
        path = str(body.get("path"))

        def op(model: Any) -> Result:
            model.load_state(state.checkpoint_of(path), bool(body.get("optimizer")))
            return "json", {"type": "load_weights", "path": path, "model_id": model.model_id}
        if body.get("model_id") is None:     # create-via-load (create_training_client_from_state*)
            return _future(state.store.submit(lambda: _create_via_load(state, body), state.train_pool))
        return await _ordered(state, body, op)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        body = await _json(request)

        def op(model: Any) -> Result:
            name = body.get("path")
            label = name or f"ephemeral-{model.step:06d}-{body.get('sampling_session_seq_id', 0)}"
            path = f"tinker://{model.model_id}/sampler_weights/{label}"
            state.sampler.add_snapshot(path, model.weights(), ephemeral=not name)
            if name:
                model.export(str(name))
                return "json", {"type": "save_weights_for_sampler", "path": path}
            return "json", {"type": "save_weights_for_sampler", "sampling_session_id": state.open_sampling_session(path)}
        return await _ordered(state, body, op)


def _create_via_load(state: ServiceState, body: dict[str, Any]) -> Result:
    """A new model `{session}:train:{model_seq_id}` with the LoRA rank of the model that saved
    `path`, loaded from it (with its AdamW moments when `optimizer`)."""
    sid, path = str(body.get("session_id")), str(body.get("path"))
    state.session(sid)
    state.check_base_model(body.get("base_model"))
    opt = body.get("optimizer_config") or {}
    if opt.get("type", "adamw") != "adamw":
        raise UserError(f"optimizer_config.type {opt.get('type')!r}: AxRL trains with AdamW only")
    checkpoint = state.checkpoint_of(path)
    model = state.create_model(f"{sid}:train:{int(body.get('model_seq_id') or 0)}", state.saved_by(path).lora_rank)
    model.load_state(checkpoint, bool(body.get("optimizer")))
    return "json", {"type": "load_weights", "path": path, "model_id": model.model_id}


def _add_sampling_routes(app: FastAPI, state: ServiceState) -> None:
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = await _json(request)
        state.session(str(body.get("session_id")))
        if body.get("model_path") is None:
            state.check_base_model(body.get("base_model"))
        return {"type": "create_sampling_session", "sampling_session_id": state.open_sampling_session(body.get("model_path"))}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        path = state.sampling_path(sampler_id)
        return {"sampler_id": sampler_id, "base_model": str(state.model_dir),
                "model_path": None if path == BASE else path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await _json(request)
        store = state.store
        try:
            path = state.sampling_path(body.get("sampling_session_id")) if body.get("sampling_session_id") \
                else (body.get("model_path") or BASE)
            spec = sample_spec(body)
        except UserError as e:
            return _future(store.complete(error_result(e)))
        key = (str(body.get("sampling_session_id")), body.get("seq_id"))
        if body.get("seq_id") is not None and key in store.by_seq:     # a retried POST
            rid = store.by_seq[key]
            return _future(rid, store.entries[rid].extra if rid in store.entries else {})
        extra = {"sample_sequence_ids": [f"{key[0]}:{key[1]}:{i}" for i in range(spec.num_samples)]}
        rid = store.submit(lambda: ("proto", state.sampler.sample(path, spec)), state.sample_pool, extra)
        if body.get("seq_id") is not None:
            store.by_seq[key] = rid
        return _future(rid, extra)


def sample_spec(body: dict[str, Any]) -> SampleSpec:
    """A SampleRequest body as a SampleSpec; UserError names the bad field."""
    chunks = (body.get("prompt") or {}).get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise UserError("prompt.chunks: a prompt needs at least one chunk of tokens")
    prompt: list[int] = []
    for i, c in enumerate(chunks):
        if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text":
            raise UserError(f"prompt.chunks[{i}]: only encoded_text (token) chunks are supported")
        prompt += [int(t) for t in c.get("tokens", [])]
    sp = body.get("sampling_params") or {}
    n, max_tokens = int(body.get("num_samples", 1)), sp.get("max_tokens")
    if n < 1:
        raise UserError(f"num_samples must be >= 1, got {n}")
    if max_tokens is None or int(max_tokens) < 1:
        raise UserError(f"sampling_params.max_tokens must be >= 1, got {max_tokens!r}")
    if int(body.get("topk_prompt_logprobs") or 0) or int(body.get("topk_sample_logprobs") or 0):
        raise UserError("topk_prompt_logprobs / topk_sample_logprobs are not supported by AxRL (use 0)")
    stop_ids, stop_strings = parse_stop(sp.get("stop"))
    return SampleSpec(prompt=prompt, num_samples=n, max_tokens=int(max_tokens),
                      temperature=float(sp.get("temperature", 1.0)), top_k=int(sp.get("top_k", -1)),
                      top_p=float(sp.get("top_p", 1.0)), seed=sp.get("seed"), stop_ids=stop_ids,
                      stop_strings=stop_strings, prompt_logprobs=bool(body.get("prompt_logprobs")))


def _add_future_routes(app: FastAPI, state: ServiceState) -> None:
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = await _json(request)
        kind, value = await state.store.retrieve(str(body.get("request_id")))
        if kind == "proto":
            return Response(content=value, media_type=PROTO)
        return JSONResponse(finite_json(value))


def finite_json(value: Any) -> Any:
    """`value` with every NaN / infinite float as the string "nan" / "inf" / "-inf": JSON has no such
    numbers (the SDK's orjson refuses them), and the SDK's pydantic models read these strings back
    as floats — so a diverged step's metrics reach the client instead of failing the response (a
    500 that the SDK would retry forever)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value
