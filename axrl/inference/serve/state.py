"""The state behind `axrl serve`: the engine, its tokenizer, /generate parsing and weight sync.

The route modules of this package (`sglang_routes`, `weight_routes`, `openai_routes`) put the
HTTP endpoints on it; each imports this module, none imports another's internals. Client errors
are `axrl.inference.openai.errors.ApiError` (status 400 unless said otherwise).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import torch

from axrl.inference.embedded import EmbeddedEngine
from axrl.inference.openai.errors import ApiError
from axrl.inference.openai.streaming import DONE, sse
from axrl.inference.protocol import GenerateRequest, GenerateResult
from axrl.inference.sglang.wire import parse_weight_version, result_to_wire, sampling_from_wire
from axrl.inference.token_stream import follow
from axrl.model import hf_state_dict, load_hf
from axrl.model.exact import set_exact
from axrl.tokenizer import Tokenizer

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
    disable_radix_cache: bool = False  # the engine's prefix cache (SGLang: --disable-radix-cache)
    exact: bool = False                # rollout.exact's op set (axrl/model/exact.py), set by `serve --training`
    threads: int = 1
    log_level: str = "warning"


class AxrlServer:
    """State behind the HTTP app: the engine, its tokenizer and the weight-sync machinery."""

    def __init__(self, engine: EmbeddedEngine, cfg: ServeConfig, tokenizer: Tokenizer | None) -> None:
        self.engine, self.cfg, self.tokenizer = engine, cfg, tokenizer
        self.model_name = cfg.served_model_name or Path(cfg.model_path).name or "axrl"
        self.tokenizer_path = cfg.model_path  # stays when weights are loaded from another directory
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
            raise ApiError(400, "the /generate body must be a JSON object")
        unknown = sorted(set(body) - _GENERATE_FIELDS)
        if unknown:
            raise ApiError(400, f"{unknown[0]}: unknown /generate field "
                           f"(supported: {sorted(_GENERATE_FIELDS - _IGNORED_GENERATE)})")
        ids, text = body.get("input_ids"), body.get("text")
        if ids is None and text is None:
            raise ApiError(400, "input_ids: a request needs input_ids (or text)")
        if ids is None:
            ids = self.encode_text(text)
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        n = len(prompts)
        if body.get("logprob_start_len") not in (None, -1) and not (isinstance(body["logprob_start_len"], list)
                                                                     and set(body["logprob_start_len"]) <= {-1}):
            raise ApiError(400, "logprob_start_len: axrl serve reports prompt logprobs only for prefill-only "
                           "requests (sampling_params.max_new_tokens: 0, logprob_start_len: 0); else use -1")
        if body.get("top_logprobs_num") not in (None, 0):
            raise ApiError(400, "top_logprobs_num: axrl serve reports top logprobs only for prefill-only requests "
                           "(sampling_params.max_new_tokens: 0, logprob_start_len: 0); else use 0")
        routed = body.get("return_routed_experts", False)
        if not isinstance(routed, bool):
            raise ApiError(400, f"return_routed_experts must be true or false, got {routed!r}")
        if routed and not self.cfg.enable_return_routed_experts:
            raise ApiError(400, "return_routed_experts: start the server with --enable-return-routed-experts")
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
                raise ApiError(400, f"return_logprob{at} must be true or false, got {logprob[i]!r}")
            start = starts[i]
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ApiError(400, f"routed_experts_start_len{at} must be an int >= 0, got {start!r}")
            if isinstance(prompts[i], list) and start > len(prompts[i]):
                raise ApiError(400, f"routed_experts_start_len{at}={start} is beyond the prompt's "
                               f"{len(prompts[i])} tokens")
            rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
            if not isinstance(rid, str) or not rid:
                raise ApiError(400, f"rid{at} must be a non-empty string, got {rid!r}")
            if not isinstance(prompts[i], list):
                raise ApiError(400, f"input_ids{at} must be a list of token ids")
            requests.append(GenerateRequest(input_ids=prompts[i], sampling_params=sp, return_logprob=logprob[i],
                                            return_routed_experts=routed, routed_experts_start_len=start, rid=rid))
            options.append({"skip_special_tokens": bool(raw_sp.get("skip_special_tokens", True)),
                            "text_in_logprobs": text_lp})
        return requests, options, batched

    @staticmethod
    def per_request(body: dict[str, Any], key: str, n: int, batched: bool, default: Any) -> list[Any]:
        """`body[key]` for each of the n requests: a batch gives one value per request, else one for all."""
        value = body.get(key, default)
        if batched and isinstance(value, list) and key != "input_ids":
            if len(value) != n:
                raise ApiError(400, f"{key}: {len(value)} values for a batch of {n} requests")
            return value
        if isinstance(value, list) and key in ("rid", "routed_experts_start_len", "return_logprob"):
            raise ApiError(400, f"{key}: a list is only valid for a batch (list-valued input_ids)")
        if batched and key == "rid" and value is not None:
            raise ApiError(400, "rid: a batch needs one rid per request (a list)")
        return [value] * n

    def encode_text(self, text: Any) -> Any:
        """Token ids of a text (or of each text of a list); a 400 without a tokenizer."""
        if self.tokenizer is None:
            raise ApiError(400, f"text: the model directory {self.cfg.model_path} has no tokenizer; send input_ids")
        if isinstance(text, str):
            return self.tokenizer.encode(text)
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            return [self.tokenizer.encode(t) for t in text]
        raise ApiError(400, "text must be a string or a list of strings")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` ("" without a tokenizer)."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if self.tokenizer else ""

    def to_wire(self, res: GenerateResult, req: GenerateRequest, opt: dict[str, Any]) -> dict[str, Any]:
        """`res` as SGLang's /generate reply (text, output_ids, meta_info) with the output options `opt`."""
        texts = None
        if opt["text_in_logprobs"] and self.tokenizer is not None:
            texts = [self.tokenizer.decode([t]) for t in res.output_ids]
        return result_to_wire(res, text=self.decode(res.output_ids, opt["skip_special_tokens"]),
                              weight_version=self.result_version(res), return_logprob=req.return_logprob,
                              id_texts=texts)

    def submit(self, requests: list[GenerateRequest]) -> list[asyncio.Future]:
        """Submit atomically (one admission, as in-process); ValueError → a 400."""
        try:
            futures = self.engine.submit_many(requests)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        for r in requests:
            self.live.add(r.rid)
        return [asyncio.wrap_future(f) for f in futures]

    def done(self, requests: list[GenerateRequest]) -> None:
        """Forget finished requests (abort_all no longer reaches them)."""
        for r in requests:
            self.live.discard(r.rid)

    def abort_all(self) -> int:
        """Abort every request in flight; how many were."""
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

    async def follow(self, requests: list[GenerateRequest],
                     is_disconnected: Any) -> AsyncIterator[list[GenerateResult | tuple[list[int], list[float]]]]:
        """Submit ``requests`` together and yield, after each poll, every request's state: its
        final result, or (output ids, logprobs) so far. Ends when all are final; requests still
        running when the client goes away or the consumer stops early are aborted."""
        futures = self.submit(requests)
        last_check = time.monotonic()
        try:
            while True:
                # one look at the futures per poll: a request that finishes between building the
                # states and checking for the end must not end the stream before its result is sent
                done = [f.done() for f in futures]
                states: list[GenerateResult | tuple[list[int], list[float]]] = [
                    future.result() if d else self.engine.progress(req.rid) or ([], [])
                    for req, future, d in zip(requests, futures, done)]
                yield states
                if all(done):
                    return
                pending = [f for f in futures if not f.done()]
                if not pending:   # all finished while the consumer held the last states: send them
                    continue
                await asyncio.wait(pending, timeout=_STREAM_POLL_S)
                if time.monotonic() - last_check > _DISCONNECT_POLL_S:
                    last_check = time.monotonic()
                    if await is_disconnected():
                        return
        finally:
            for req, future in zip(requests, futures):
                if not future.done():
                    self.engine.abort(req.rid)
            self.done(requests)

    async def stream(self, req: GenerateRequest, opt: dict[str, Any]) -> AsyncIterator[bytes]:
        """SSE: cumulative chunks as tokens arrive (`token_stream.follow`), the final result, then [DONE]."""
        (future,) = self.submit([req])
        try:
            async for snap in follow(self.engine, req.rid, future):
                if not isinstance(snap, GenerateResult):
                    snap = GenerateResult(rid=req.rid, output_ids=snap[0], output_logprobs=snap[1],
                                          routed_experts=None, finish_reason=None,  # type: ignore[arg-type]
                                          weight_version=self.engine.weight_version, prompt_tokens=len(req.input_ids))
                yield sse(self.to_wire(snap, req, opt))
            yield DONE
        except Exception as e:  # noqa: BLE001 — SGLang reports stream errors in-band
            yield sse({"error": {"message": f"{type(e).__name__}: {e}"}})
            yield DONE
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
            raise ApiError(400, f"weight_version must be a string, got {weight_version!r}")
        parsed = parse_weight_version(weight_version)
        if parsed is not None:
            return parsed, None
        return self.engine.weight_version + 1, str(weight_version)

    def full_state(self, updates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`updates` completed with the current values of every other weight (partial updates)."""
        unknown = sorted(set(updates) - set(self.shapes) - {"lm_head.weight"})
        if unknown:
            raise ApiError(400, f"names: {unknown[:5]} are not weights of this model")
        for name, t in updates.items():
            if name in self.shapes and tuple(t.shape) != self.shapes[name]:
                raise ApiError(400, f"shapes: '{name}' has shape {list(t.shape)}, "
                               f"the model's is {list(self.shapes[name])}")
        current = hf_state_dict(self.engine.model)
        return {**{k: v.clone() for k, v in current.items() if k not in updates}, **updates}

    async def apply(self, updates: dict[str, torch.Tensor] | str, weight_version: Any) -> None:
        """Load a state dict (possibly partial) or an HF directory into the engine, set the version."""
        version, label = self.engine_version(weight_version)
        source = updates if isinstance(updates, str) else self.full_state(updates)
        try:
            await asyncio.to_thread(self.engine.update_weights, source, version)
        except (ValueError, FileNotFoundError) as e:
            raise ApiError(400, str(e)) from None
        self.version_label = label


def build_server(cfg: ServeConfig) -> AxrlServer:
    """Load the model directory and start the engine behind the server."""
    torch.set_num_threads(cfg.threads)
    model = set_exact(load_hf(cfg.model_path, dtype=getattr(torch, cfg.dtype)), cfg.exact)
    tokenizer = Tokenizer.from_dir(cfg.model_path) if (Path(cfg.model_path) / "tokenizer.json").is_file() else None
    version = parse_weight_version(cfg.weight_version)
    engine = EmbeddedEngine(model, max_batch_size=cfg.max_running_requests, max_seq_len=cfg.context_length,
                            weight_version=version if version is not None else 0, seed=cfg.random_seed,
                            decode_impl=cfg.decode_impl,  # type: ignore[arg-type]
                            prefix_cache=False if cfg.disable_radix_cache else None)
    return AxrlServer(engine, cfg, tokenizer)

