"""`axrl serve`'s SGLang weight-sync endpoints.

- From disk: `POST /update_weights_from_disk` {model_path, weight_version};
  `POST /update_weight_version` {new_version}; `GET|POST /get_weights_by_name` {name, truncate_size}.
- From the trainer: `POST /init_weights_update_group` {master_address, master_port, rank_offset,
  world_size, group_name, backend="gloo"} joins the trainer's process group as rank
  `rank_offset`; `POST /update_weights_from_distributed` {names, dtypes, shapes, group_name,
  weight_version} receives the trainer's broadcasts (a subset of names is fine; the rest keep
  their values); `POST /begin_weight_update` … `/end_weight_update` stage several updates and
  apply them at once; `POST /destroy_weights_update_group`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from axrl.inference.openai.errors import ApiError
from axrl.inference.openai.http import json_body
from axrl.inference.serve.state import AxrlServer
from axrl.inference.remote import weight_sync
from axrl.model import hf_state_dict


def _need(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """`body[key]`, which must be there and of `kind` (a bool is no int)."""
    if key not in body:
        raise ApiError(400, f"{key}: missing required field")
    value = body[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ApiError(400, f"{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def add_disk_weight_routes(app: FastAPI, server: AxrlServer) -> None:
    """Load weights from a model directory, relabel the version, read a weight back."""

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Any:
        body = await json_body(request)
        name = _need(body, "name", str)
        size = body.get("truncate_size", 100)
        weights = hf_state_dict(server.engine.model)
        if name not in weights:
            raise ApiError(400, f"name: {name!r} is not a weight of this model")
        return weights[name].reshape(-1)[: int(size)].tolist()

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await json_body(request)
        path = _need(body, "model_path", str)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ApiError(400, f"load_format: {body['load_format']!r} is not supported (use auto/safetensors)")
        async with server.weights_lock:
            if body.get("abort_all_requests"):
                server.abort_all()
            try:
                await server.apply(path, body.get("weight_version"))
            except ApiError as e:
                return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)
            server.cfg.model_path = path  # /model_info names the loaded directory, as SGLang's does
        return JSONResponse({"success": True, "num_paused_requests": 0,
                             "message": f"Loaded {path}. Weight version updated to {server.weight_version}."})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await json_body(request)
        new = _need(body, "new_version", (str, int))
        if body.get("abort_all_requests", True):
            server.abort_all()
        server.version_label = str(new)
        return JSONResponse({"success": True, "message": f"Weight version updated to {new}", "new_version": str(new)})


def add_weight_group_routes(app: FastAPI, server: AxrlServer) -> None:
    """Join and leave the trainer's weight-update process group."""

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await json_body(request)
        address, port = _need(body, "master_address", str), _need(body, "master_port", int)
        rank_offset, world = _need(body, "rank_offset", int), _need(body, "world_size", int)
        name = body.get("group_name", "weight_update_group")
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            raise ApiError(400, f"backend: axrl serve runs on CPU and joins weight groups with 'gloo', not {backend!r}")
        if name in server.groups:
            raise ApiError(400, f"group_name: this server is already in group {name!r}; destroy it first")
        try:
            server.groups[name] = await asyncio.to_thread(
                weight_sync.init_weights_group, master_address=address, master_port=port, rank=rank_offset,
                world_size=world, group_name=name, backend=backend)
        except Exception as e:  # noqa: BLE001 — rendezvous failures are reported, not raised
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, status_code=400)
        return JSONResponse({"success": True, "message": f"joined {name!r} as rank {rank_offset} of {world}"})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await json_body(request)
        name = body.get("group_name", "weight_update_group")
        group = server.groups.pop(name, None)
        if group is None:
            return JSONResponse({"success": False, "message": f"group_name: no group {name!r}"}, status_code=400)
        weight_sync.destroy_weights_group(group)
        return JSONResponse({"success": True, "message": f"left {name!r}"})


def add_distributed_weight_routes(app: FastAPI, server: AxrlServer) -> None:
    """Receive weights from the trainer's process group, staged or applied at once."""

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
        body = await json_body(request)
        names, dtypes, shapes = _need(body, "names", list), _need(body, "dtypes", list), _need(body, "shapes", list)
        name = body.get("group_name", "weight_update_group")
        group = server.groups.get(name)
        if group is None:
            raise ApiError(400, f"group_name: no weight-update group {name!r}; call /init_weights_update_group first")
        try:
            for i, dt in enumerate(dtypes):
                weight_sync.dtype_from_name(dt, f"dtypes[{i}]")
        except ValueError as e:
            raise ApiError(400, str(e)) from None
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
