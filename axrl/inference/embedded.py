"""The embedded inference engine: in-process continuous batching over a static KV cache.

Threads and ownership
---------------------
`EmbeddedEngine` is the public, thread-safe facade: `generate` / `submit` / `abort` /
`update_weights` may be called from any thread or event loop. They only validate and hand work
to an `_Inbox` (a lock + condition). One background thread runs the `_Scheduler`, which alone
touches the model, the KV cache and the slots, so no model state is ever shared across threads.

One scheduler iteration
-----------------------
1. apply control ops (aborts of running requests, weight updates) — between iterations, so a
   forward never sees half-updated weights;
2. admit waiting requests into free slots (FIFO) and prefill them: batched, through the fast
   path (`FusedDecoder.prefill`: the model's math on the packed prompt tokens; the model's own
   full forward with decode_impl="model"), writing their K/V into their slots; sample each
   one's first token;
3. one decode step for every running slot: slots [0, n) are fed their last token at once
   (idle rows in that range are computed and ignored, which beats gathering rows), attending
   over the cache view with a per-slot length mask; sample; finish what stopped.

Results use SGLang semantics (see `axrl.inference.protocol`). Running requests keep going across
a weight update (their earlier KV entries came from the old weights, as with SGLang's in-place
pause); `output_weight_versions` records which version produced each token.

Determinism: fixed weights, thread count and batch composition give bitwise-identical results.
Batch composition depends on arrival timing under continuous batching; it changes GEMM shapes
and hence the last bits of the logits, never the random streams (each request owns its
generator, seeded from `seed` or from the engine seed and the submission counter).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import operator
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from axrl.inference.decode import FusedDecoder
from axrl.inference.kv_cache import StaticKVCache
from axrl.inference.prefix_cache import CacheMatch, PrefixCache
from axrl.inference.protocol import GenerateRequest, GenerateResult, SamplingParams, settle_future
from axrl.inference.sampling import RowParams, derive_seed, sample
from axrl.model import ModelConfig, Qwen3ForCausalLM, hf_state_dict, load_config, load_weights_into
from axrl.model.io import WEIGHTS_NAME

# Config fields that do not change the computation; an update from a directory may differ there.
_NON_ARCH_FIELDS = {"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "max_position_embeddings"}


@dataclass(eq=False)
class _Sequence:
    """One request's state, from submission to its result."""

    req: GenerateRequest
    prompt: list[int]
    stop_ids: frozenset[int]
    limit: int  # most output tokens: max_new_tokens, capped so prompt + output <= max_seq_len
    row: RowParams
    future: concurrent.futures.Future
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted: bool = False
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)  # int32 chunks [rows, layers, top_k]
    cache_match: CacheMatch | None = None  # its prefix in the prefix cache (locked while running)
    cached_tokens: int = 0                 # prompt tokens taken from the prefix cache (SGLang's cached_tokens)

    @property
    def wants_routing(self) -> bool:
        return self.req.return_routed_experts


@dataclass
class _Control:
    kind: Literal["abort", "weights", "memory"]
    payload: Any
    future: concurrent.futures.Future | None = None


class _Inbox:
    """The hand-over between API threads and the scheduler thread; every field is guarded by `cv`."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.waiting: deque[_Sequence] = deque()
        self.control: deque[_Control] = deque()
        self.live: dict[str, _Sequence] = {}
        self.stopping = False
        self.submitted = 0


class EmbeddedEngine:
    """In-process `InferenceEngine` for the AxRL policy (Qwen3 / Qwen3-MoE).

    Args:
        model: the policy; the engine owns it from now on (update it through `update_weights`).
        max_batch_size: KV-cache slots, i.e. requests decoded concurrently.
        max_seq_len: longest prompt + output a request may reach.
        eos_token_id: id(s) that end generation unless `ignore_eos`; default: the model config's.
        weight_version: version of the weights the model holds now.
        seed: engine seed; requests without `sampling_params.seed` get a private seed derived
            from it and their submission index.
        decode_impl: "fused" (fast single-token path, `axrl.inference.decode`) or "model" (the
            model's own forward with the KV cache; a reference for debugging mismatches).
        max_prefill_tokens: padded tokens per prefill forward; bigger admissions are split.
        clocked: no scheduler thread; the owner runs each iteration with `step()` (a
            `ClockedEngine`), so the schedule is a function of what was submitted between steps.
        prefix_cache: reuse the K/V of cached prompt prefixes (`prefix_cache.py`: earlier turns of
            an episode, a GRPO group's shared prompt); None = on with decode_impl="fused" (the
            only path that supports it).
        prefix_cache_tokens: pool size of the prefix cache in tokens; 0 = as many as the KV
            cache's slots hold (max_batch_size × max_seq_len).
        prefix_cache_block: tokens per cached block (prefixes are reused in whole blocks).
    """

    def __init__(self, model: Qwen3ForCausalLM, *, max_batch_size: int = 64, max_seq_len: int = 1024,
                 eos_token_id: int | Sequence[int] | None = None, weight_version: int = 0, seed: int = 0,
                 decode_impl: Literal["fused", "model"] = "fused", max_prefill_tokens: int = 8192,
                 clocked: bool = False, prefix_cache: bool | None = None, prefix_cache_tokens: int = 0,
                 prefix_cache_block: int = 16) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        if decode_impl not in ("fused", "model"):
            raise ValueError(f"decode_impl must be 'fused' or 'model', got {decode_impl!r}")
        if prefix_cache and decode_impl != "fused":
            raise ValueError("prefix_cache needs decode_impl='fused' (the model's own forward has no suffix prefill)")
        if prefix_cache_tokens < 0 or prefix_cache_block < 1:
            raise ValueError(f"prefix_cache_tokens must be >= 0 and prefix_cache_block >= 1, "
                             f"got {prefix_cache_tokens}, {prefix_cache_block}")
        self.model = model.eval()
        self.config: ModelConfig = model.config
        self.max_batch_size, self.max_seq_len, self.seed = max_batch_size, max_seq_len, seed
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_ids = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
        self._expected_shapes = {k: tuple(v.shape) for k, v in hf_state_dict(model).items()}
        self._inbox = _Inbox()
        use_cache = decode_impl == "fused" if prefix_cache is None else prefix_cache
        cache_tokens = prefix_cache_tokens or max_batch_size * max_seq_len
        self._scheduler = _Scheduler(self, weight_version, decode_impl, max_prefill_tokens,
                                     (cache_tokens, prefix_cache_block) if use_cache else None)
        self.clocked = clocked
        self._thread: threading.Thread | None = None
        if not clocked:
            self._thread = threading.Thread(target=self._scheduler.run, name="axrl-embedded-engine", daemon=True)
            self._thread.start()

    def step(self) -> bool:
        """One scheduler iteration in the caller's thread (clocked engines only); False when there
        was nothing to do."""
        if not self.clocked:
            raise RuntimeError("step() drives a clocked engine; this one runs its own scheduler thread")
        with torch.inference_mode():
            return self._scheduler.iterate(block=False)

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Run one request to completion (stop, length or abort). Works from any event loop;
        cancelling the awaiting task aborts the request and frees its slot."""
        return await asyncio.wrap_future(self.submit(request))

    def submit(self, request: GenerateRequest) -> concurrent.futures.Future:
        """Enqueue one request; the future resolves to its `GenerateResult`. Raises ValueError on
        invalid input (naming the field) and RuntimeError after `shutdown`."""
        return self._enqueue([request])[0]

    def submit_many(self, requests: Iterable[GenerateRequest]) -> list[concurrent.futures.Future]:
        """Enqueue several requests atomically: the scheduler sees them together and admits them
        in this order, which makes batch composition (hence the last bits of logits) reproducible."""
        return self._enqueue(list(requests))

    def generate_batch(self, requests: Iterable[GenerateRequest], timeout: float | None = None) -> list[GenerateResult]:
        """Submit all requests at once (they are admitted together), wait for all; results in order."""
        futures = self._enqueue(list(requests))
        return [f.result(timeout=timeout) for f in futures]

    def _enqueue(self, requests: list[GenerateRequest]) -> list[concurrent.futures.Future]:
        validated = [self._validate(r) for r in requests]  # all or nothing
        if len({r.rid for r in requests}) != len(requests):
            raise ValueError("rid: duplicate request ids in one submission")
        inbox = self._inbox
        futures = []
        with inbox.cv:
            if inbox.stopping:
                raise RuntimeError("EmbeddedEngine is shut down")
            for req, _ in validated:
                if req.rid in inbox.live:
                    raise ValueError(f"rid: request {req.rid!r} is already in flight")
            for req, prompt in validated:
                inbox.submitted += 1
                sp = req.sampling_params
                generator = None
                if sp.temperature > 0:
                    seed = sp.seed if sp.seed is not None else derive_seed(self.seed, inbox.submitted)
                    generator = torch.Generator().manual_seed(seed)
                stop = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self.eos_token_ids)
                limit = min(sp.max_new_tokens, self.max_seq_len - len(prompt))
                seq = _Sequence(req=req, prompt=prompt, stop_ids=stop, limit=limit, future=concurrent.futures.Future(),
                                row=RowParams(sp.temperature, sp.top_k, sp.top_p, generator, req.return_logprob))
                seq.future.add_done_callback(lambda f, rid=req.rid: f.cancelled() and self.abort(rid))
                inbox.live[req.rid] = seq
                inbox.waiting.append(seq)
                futures.append(seq.future)
            inbox.cv.notify()
        return futures

    def _validate(self, req: GenerateRequest) -> tuple[GenerateRequest, list[int]]:
        """Check a request against the model and the engine limits; ValueError names the field."""
        if not isinstance(req, GenerateRequest):
            raise ValueError(f"request must be a GenerateRequest, got {type(req).__name__}")
        if isinstance(req.sampling_params, Mapping):  # accept SGLang-style dicts too
            try:
                req.sampling_params = SamplingParams(**req.sampling_params)
            except TypeError as e:
                raise ValueError(f"sampling_params: {e}") from None
        vocab = self.config.vocab_size
        try:
            prompt = list(map(operator.index, req.input_ids))  # C-level loop: ~3x the comprehension
        except TypeError:
            raise ValueError("input_ids must be a sequence of integer token ids") from None
        if not prompt:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        if len(prompt) > self.max_seq_len:
            raise ValueError(f"input_ids has {len(prompt)} tokens, more than the engine's "
                             f"max_seq_len={self.max_seq_len}")
        if min(prompt) < 0 or max(prompt) >= vocab:
            bad = next(t for t in prompt if not 0 <= t < vocab)
            raise ValueError(f"input_ids contains token id {bad}, outside the vocabulary [0, {vocab})")
        sp = req.sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        for name in ("max_new_tokens", "top_k"):
            if isinstance(getattr(sp, name), bool) or not isinstance(getattr(sp, name), int):
                raise ValueError(f"sampling_params.{name} must be an int, got {getattr(sp, name)!r}")
        for name in ("temperature", "top_p"):
            value = getattr(sp, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"sampling_params.{name} must be a finite number, got {value!r}")
        sp.validate()
        if not isinstance(sp.stop_token_ids, (list, tuple, set, frozenset)) or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in sp.stop_token_ids):
            raise ValueError(f"sampling_params.stop_token_ids must be token ids in [0, {vocab}), "
                             f"got {sp.stop_token_ids!r}")
        if sp.seed is not None and (isinstance(sp.seed, bool) or not isinstance(sp.seed, int)
                                    or not -(2 ** 63) <= sp.seed < 2 ** 64):
            raise ValueError(f"sampling_params.seed must be None or a 64-bit int, got {sp.seed!r}")
        if not isinstance(req.routed_experts_start_len, int) or req.routed_experts_start_len < 0:
            raise ValueError(f"routed_experts_start_len must be an int >= 0, got {req.routed_experts_start_len!r}")
        if not isinstance(req.rid, str) or not req.rid:
            raise ValueError(f"rid must be a non-empty string, got {req.rid!r}")
        return req, prompt

    # -- control -------------------------------------------------------------------------------
    def abort(self, rid: str) -> bool:
        """Abort a waiting or running request; it finishes with finish_reason type "abort" and
        keeps its partial output. Returns whether the request was found (still in flight)."""
        inbox = self._inbox
        with inbox.cv:
            seq = inbox.live.get(rid)
            if seq is None:
                return False
            if not seq.admitted:  # still queued: finish it right here
                inbox.waiting.remove(seq)
                del inbox.live[rid]
            else:  # running: the scheduler finishes it between iterations
                inbox.control.append(_Control("abort", rid))
                inbox.cv.notify()
                return True
        settle_future(seq.future, self._scheduler.result(seq, {"type": "abort", "message": "aborted by client"}))
        return True

    def progress(self, rid: str) -> tuple[list[int], list[float]] | None:
        """Snapshot of the tokens (and logprobs, if requested) a request in flight has generated so
        far, or None when it is not in flight (finished or unknown). For streaming servers."""
        with self._inbox.cv:
            seq = self._inbox.live.get(rid)
            if seq is None:
                return None
            ids, logprobs = list(seq.output_ids), list(seq.logprobs)
        # The scheduler appends ids and logprobs without the lock: trim a half-appended token.
        if seq.req.return_logprob and len(logprobs) < len(ids):
            ids = ids[:len(logprobs)]
        return ids, logprobs[:len(ids)]

    def update_weights(self, source: Any, version: int | None = None) -> int:
        """Load new weights and return the new version (`version`, else the previous one + 1).

        `source` is an HF-named state dict, a path to an HF model directory (its config must
        describe the same architecture) or a `Qwen3ForCausalLM`. Names and shapes are checked
        here; the copy happens on the scheduler thread between two iterations, and this call
        blocks until it has. Running requests continue on the new weights.
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ValueError(f"version must be an int or None, got {version!r}")
        if threading.current_thread() is self._thread:  # e.g. from a future's done-callback
            raise RuntimeError("update_weights would deadlock on the engine thread; call it from another thread")
        state_dict = self._load_source(source)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._inbox.cv:
            if self._inbox.stopping:
                raise RuntimeError("EmbeddedEngine is shut down")
            self._inbox.control.append(_Control("weights", (state_dict, version), done))
            self._inbox.cv.notify()
        if self.clocked:  # the caller owns the clock: apply now, between two of its steps
            with torch.inference_mode():
                self._scheduler.apply_pending_controls()
        return done.result()

    def release_memory(self) -> None:
        """Free the KV cache (and the prefix cache's blocks, forgetting them) while no request is
        running; `resume_memory` allocates them again. Outputs after a resume equal outputs
        without the release: a slot's stale columns are never read."""
        self._memory_control(release=True)

    def resume_memory(self) -> None:
        """Allocate the KV cache (and prefix-cache blocks) that `release_memory` freed."""
        self._memory_control(release=False)

    def _memory_control(self, release: bool) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError("release/resume_memory would deadlock on the engine thread; call it from another thread")
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._inbox.cv:
            if release and (self._inbox.waiting or self._scheduler.num_running):
                raise RuntimeError("release_memory: the engine has requests in flight; release it when idle")
            self._inbox.control.append(_Control("memory", release, done))
            self._inbox.cv.notify()
        if self.clocked:
            with torch.inference_mode():
                self._scheduler.apply_pending_controls()
        done.result()

    def _load_source(self, source: Any) -> dict[str, torch.Tensor]:
        if isinstance(source, Qwen3ForCausalLM):
            source = hf_state_dict(source)
        if isinstance(source, (str, Path)):
            path = Path(source)
            cfg = load_config(path)
            diff = [f.name for f in fields(ModelConfig) if f.name not in _NON_ARCH_FIELDS
                    and getattr(cfg, f.name) != getattr(self.config, f.name)]
            if diff:
                raise ValueError(f"{path}: config.json does not match the engine's model (fields {diff})")
            if not (path / WEIGHTS_NAME).is_file():
                raise FileNotFoundError(f"{path / WEIGHTS_NAME} not found")
            return self._check_state_dict(load_file(str(path / WEIGHTS_NAME)), str(path))
        if isinstance(source, Mapping):
            return self._check_state_dict(dict(source), "state dict")
        raise ValueError(f"update_weights source must be a state dict, a model directory or a model, "
                         f"got {type(source).__name__}")

    def _check_state_dict(self, sd: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        # Validate fully before handing over, so a bad update never leaves half-copied weights.
        missing = sorted(set(self._expected_shapes) - set(sd))
        unexpected = sorted(set(sd) - set(self._expected_shapes) - {"lm_head.weight"})
        if missing or unexpected:
            raise ValueError(f"{where}: weight names do not match the model (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
        for name, shape in self._expected_shapes.items():
            if tuple(sd[name].shape) != shape:
                raise ValueError(f"{where}: '{name}' has shape {tuple(sd[name].shape)}, expected {shape}")
        return sd

    def health(self) -> dict[str, Any]:
        """{"ok", "weight_version", "running", "waiting", ...} — cheap, callable from any thread."""
        s = self._scheduler
        with self._inbox.cv:
            waiting, stopping = len(self._inbox.waiting), self._inbox.stopping
        alive = self.clocked or (self._thread is not None and self._thread.is_alive())
        return {"ok": alive and not stopping, "weight_version": s.version,
                "running": s.num_running, "waiting": waiting, "max_batch_size": self.max_batch_size,
                "max_seq_len": self.max_seq_len, "iterations": s.iterations,
                "generated_tokens": s.generated_tokens, "last_error": s.last_error,
                "prefix_cache": None if s.prefix_cache is None else s.prefix_cache.stats(),
                "kv_cache_bytes": s.cache.nbytes()}

    @property
    def weight_version(self) -> int:
        return self._scheduler.version

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the scheduler thread; waiting and running requests finish with an abort."""
        with self._inbox.cv:
            self._inbox.stopping = True
            self._inbox.cv.notify()
            if self.clocked:  # no thread to do it: finish everything here
                self._scheduler.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "EmbeddedEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class _Scheduler:
    """The loop on the engine thread: owns the model, the KV cache and the slots."""

    def __init__(self, engine: EmbeddedEngine, version: int, decode_impl: str, max_prefill_tokens: int,
                 prefix_cache: tuple[int, int] | None = None) -> None:
        self.engine, self.inbox, self.model = engine, engine._inbox, engine.model
        cfg = engine.config
        self.is_moe = cfg.is_moe
        weight = self.model.lm_head.weight
        self.cache = StaticKVCache(cfg.num_hidden_layers, engine.max_batch_size, cfg.num_key_value_heads,
                                   engine.max_seq_len, cfg.head_dim, dtype=weight.dtype, device=weight.device)
        self.decoder = FusedDecoder(self.model, engine.max_seq_len, engine.max_batch_size) if decode_impl == "fused" else None
        self.device = weight.device
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache: PrefixCache | None = None
        # Tokens whose K/V (current weights) each free slot still holds from its last request.
        self.slot_tokens: list[list[int]] = [[] for _ in range(engine.max_batch_size)]
        if prefix_cache is not None:
            tokens, block = prefix_cache
            self.prefix_cache = PrefixCache(
                self.cache, num_blocks=max(1, tokens // block), block_size=block,
                routing_shape=cfg.routing_shape()[:2] if self.is_moe else None)
        self.slots: list[_Sequence | None] = [None] * engine.max_batch_size
        # Bumped whenever a slot is taken or freed; the next decode step's inputs are reused only
        # while it stands still (see `decode_step`).
        self.slot_epoch = 0
        self.next_inputs: tuple | None = None
        # Read by other threads (health, weight_version); plain attribute writes are atomic.
        self.version = version
        self.num_running = 0
        self.iterations = 0
        self.generated_tokens = 0
        self.last_error: str | None = None

    # -- loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        with torch.inference_mode():
            while self.iterate():
                pass

    def iterate(self, block: bool = True) -> bool:
        """One scheduler iteration; returns False once the engine is shutting down (or, with
        `block=False`, when there was nothing to do)."""
        inbox = self.inbox
        with inbox.cv:
            while block and not (inbox.waiting or inbox.control or inbox.stopping or self.num_running):
                inbox.cv.wait()
            if inbox.stopping:
                self.stop()
                return False
            if not (inbox.waiting or inbox.control or self.num_running):
                return False
        self.apply_pending_controls()
        admitted = self.admit()
        try:
            if admitted:
                self.prefill(admitted)
            if self.num_running:
                self.decode_step()
        except Exception as e:  # noqa: BLE001 — a failed forward fails its requests, not the engine
            self.last_error = f"{type(e).__name__}: {e}"
            for seq in [s for s in self.slots if s is not None]:
                self.release(seq)
                settle_future(seq.future, error=e)
        self.iterations += 1
        return True

    def apply_pending_controls(self) -> None:
        with self.inbox.cv:
            control = list(self.inbox.control)
            self.inbox.control.clear()
        for op in control:
            self.apply_control(op)

    def apply_control(self, op: _Control) -> None:
        if op.kind == "abort":
            seq = next((s for s in self.slots if s is not None and s.req.rid == op.payload), None)
            if seq is not None:
                self.finish(seq, {"type": "abort", "message": "aborted by client"})
            return
        if op.kind == "memory":
            self.set_memory(released=op.payload)
            settle_future(op.future, None)
            return
        state_dict, version = op.payload
        try:
            with torch.inference_mode(False), torch.no_grad():
                load_weights_into(self.model, state_dict)
                if self.decoder is not None:
                    self.decoder.repack()
        except Exception as e:  # noqa: BLE001 — report to the caller of update_weights
            settle_future(op.future, error=e)
            return
        self.version = self.version + 1 if version is None else version
        if self.prefix_cache is not None:  # K/V of the old weights must not be reused
            self.prefix_cache.clear()
            self.slot_tokens = [[] for _ in self.slots]
        settle_future(op.future, self.version)

    def set_memory(self, released: bool) -> None:
        """Free (or allocate again) the KV cache and the prefix cache's blocks; nothing cached survives."""
        buffers = [self.cache] + ([self.prefix_cache.blocks] if self.prefix_cache is not None else [])
        if released:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self.slot_tokens = [[] for _ in self.slots]
            for b in buffers:
                b.release()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            for b in buffers:
                b.resume()

    def admit(self) -> list[_Sequence]:
        """Move waiting requests (FIFO) into free slots, lowest slot first (keeps [0, n) dense)."""
        if self.cache.released and self.inbox.waiting:  # a request after release_memory, without resume
            self.set_memory(released=False)
        free = [i for i, s in enumerate(self.slots) if s is None]
        admitted = []
        with self.inbox.cv:
            while free and self.inbox.waiting:
                seq = self.inbox.waiting.popleft()
                seq.admitted, seq.slot = True, free.pop(0)
                self.slots[seq.slot] = seq
                admitted.append(seq)
        self.num_running += len(admitted)
        self.slot_epoch += bool(admitted)
        return admitted

    # -- forward passes ----------------------------------------------------------------------------
    def prefill(self, seqs: list[_Sequence]) -> None:
        """Prefill newly admitted requests in padded chunks of at most `max_prefill_tokens`.

        With the prefix cache: each request first takes its cached prefix; a request sharing a
        longer prefix with an earlier one of this admission (a GRPO group) waits for that one's
        prefill, which inserts its prompt, and is prefilled right after in the same iteration."""
        if self.prefix_cache is None:
            self.prefill_chunks(seqs)
            return
        first, after = self.split_shared(seqs) if len(seqs) > 1 else (seqs, [])
        for group in (first, after):
            for seq in group:
                self.take_cached_prefix(seq)
            self.prefill_chunks(group)

    def split_shared(self, seqs: list[_Sequence]) -> tuple[list[_Sequence], list[_Sequence]]:
        """(prefill now, prefill after them): a request goes second when an earlier first-round
        request of this admission shares more whole blocks of its prompt than the cache holds."""
        pc = self.prefix_cache
        B = pc.block_size
        trie: dict = {}
        first, after = [], []
        for seq in seqs:
            need = self.is_moe and seq.wants_routing
            cached = pc.match_length(seq.prompt, need_routing=need)
            node, shared = trie, 0
            for i in range(0, len(seq.prompt) - 1 - (len(seq.prompt) - 1) % B, B):
                node = node.get(tuple(seq.prompt[i:i + B]))
                if node is None:
                    break
                shared += B
            if shared > cached:
                after.append(seq)
                continue
            first.append(seq)
            node = trie
            for i in range(0, len(seq.prompt) - 1 - (len(seq.prompt) - 1) % B, B):
                node = node.setdefault(tuple(seq.prompt[i:i + B]), {})
        return first, after

    def take_cached_prefix(self, seq: _Sequence) -> None:
        """Lock the request's cached prefix and copy its K/V (and routing rows) into its slot."""
        pc = self.prefix_cache
        m = pc.match(seq.prompt, need_routing=self.is_moe and seq.wants_routing)
        seq.cache_match, seq.cached_tokens = m, m.num_tokens
        held, self.slot_tokens[seq.slot] = self.slot_tokens[seq.slot], []
        c = m.num_tokens
        # The slot may still hold these tokens' K/V from its previous request (the last turn of
        # the same episode, usually): then there is nothing to copy.
        if not (len(held) >= c and held[:c] == seq.prompt[:c]):
            pc.load(m, seq.slot)
        if m.num_tokens and self.is_moe and seq.wants_routing:
            seq.routing.append(pc.routing_of(m))

    def cache_sequence(self, seq: _Sequence, tokens: list[int]) -> None:
        """Insert `tokens` (a prefix of what the request's slot holds K/V for) into the prefix
        cache, unless the weights changed since the request was admitted."""
        pc, m = self.prefix_cache, seq.cache_match
        if pc is None or m is None or m.generation != pc.generation:
            return
        routing = None
        if self.is_moe and seq.wants_routing and seq.routing:
            routing = np.concatenate(seq.routing)[:len(tokens)]
            if len(routing) < len(tokens):
                routing = None
        pc.insert(tokens, seq.slot, routing, owner=m)

    def prefill_chunks(self, seqs: list[_Sequence]) -> None:
        chunk: list[_Sequence] = []
        for seq in seqs:
            longest = max([len(s.prompt) - s.cached_tokens for s in chunk] + [len(seq.prompt) - seq.cached_tokens])
            if chunk and longest * (len(chunk) + 1) > self.max_prefill_tokens:
                self.prefill_chunk(chunk)
                chunk = []
            chunk.append(seq)
        if chunk:
            self.prefill_chunk(chunk)

    def prefill_chunk(self, seqs: list[_Sequence]) -> None:
        """Prefill prompts, writing K/V into their slots: the fused path, or the model's full forward."""
        if self.decoder is not None:
            self.prefill_chunk_fused(seqs)
        else:
            self.prefill_chunk_model(seqs)

    def prefill_chunk_fused(self, seqs: list[_Sequence]) -> None:
        want_routing = self.is_moe and any(s.wants_routing for s in seqs)
        hidden, routing = self.decoder.prefill([s.prompt for s in seqs], [s.slot for s in seqs], self.cache,
                                               want_routing, starts=[s.cached_tokens for s in seqs])
        if routing is not None:
            routing = routing.to(torch.int32).cpu().numpy()
            start = 0
            for seq in seqs:
                computed = len(seq.prompt) - seq.cached_tokens
                if seq.wants_routing:
                    seq.routing.append(routing[start:start + computed].copy())
                start += computed
        for seq in seqs:  # the other samples of a group (or a retry) reuse this prefill
            self.cache_sequence(seq, seq.prompt)
        self.start_decoding(seqs, hidden)

    def start_decoding(self, seqs: list[_Sequence], hidden: torch.Tensor) -> None:
        """Sample the first token of each prefilled sequence from its last prompt position's hidden
        state [len(seqs), hidden]. A request that may not generate (max_new_tokens 0, or its prompt
        fills max_seq_len) ends here with an empty output."""
        go = [i for i, s in enumerate(seqs) if s.limit > 0]
        for i, seq in enumerate(seqs):
            if seq.limit <= 0:
                self.finish(seq, {"type": "length", "length": 0})
        if go:
            if len(go) < len(seqs):
                hidden = hidden[torch.tensor(go, device=self.device)]
            self.advance([seqs[i] for i in go], self.model.lm_head(hidden))

    def prefill_chunk_model(self, seqs: list[_Sequence]) -> None:
        """The model's full forward over right-padded prompts, writing K/V into the slots."""
        lens = [len(s.prompt) for s in seqs]
        width = max(lens)
        ids = torch.tensor([s.prompt + [0] * (width - len(s.prompt)) for s in seqs], device=self.device)
        pad_mask = None
        if min(lens) < width:
            pad_mask = (torch.arange(width)[None] < torch.tensor(lens)[:, None]).to(self.device)
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        want_routing = self.is_moe and any(s.wants_routing for s in seqs)
        out = self.model(ids, attention_mask=pad_mask, kv_cache=self.cache.prefill_writer(slots),
                         return_routing=want_routing, compute_logits=False)
        if want_routing:
            routing = out.routed_experts.to(torch.int32).cpu().numpy()
            for i, seq in enumerate(seqs):
                if seq.wants_routing:
                    seq.routing.append(routing[i, :lens[i]].copy())
        self.start_decoding(seqs, out.hidden[torch.arange(len(seqs)), torch.tensor(lens) - 1])  # last prompt token

    def decode_step(self) -> None:
        """Feed every running request its last token; one forward over slots [0, n)."""
        epoch = self.slot_epoch
        if self.next_inputs is not None and self.next_inputs[0] == epoch:
            _, n, running, tokens_t, positions_t, kv_len, want_routing = self.next_inputs
        else:
            n = max(i for i, s in enumerate(self.slots) if s is not None) + 1
            running = [s for s in self.slots[:n] if s is not None]
            # Idle rows in [0, n) get token 0 at position 0 of their own (free) slot: harmless,
            # except that the K/V such a slot kept from its last request are stale from now on.
            tokens = [s.output_ids[-1] if s is not None else 0 for s in self.slots[:n]]
            for i in range(n) if len(running) < n else ():
                if self.slots[i] is None:
                    self.slot_tokens[i] = []
            positions = [len(s.prompt) + len(s.output_ids) - 1 if s is not None else 0 for s in self.slots[:n]]
            kv_len = max(positions) + 1
            tokens_t = torch.tensor(tokens, device=self.device)
            positions_t = torch.tensor(positions, device=self.device)
            want_routing = self.is_moe and any(s.wants_routing for s in running)
        if self.decoder is not None:
            hidden, routing = self.decoder.step(tokens_t, positions_t, self.cache, kv_len, want_routing)
        else:
            mask = (torch.arange(kv_len, device=self.device)[None] <= positions_t[:, None])[:, None, None, :]
            out = self.model(tokens_t[:, None], position_ids=positions_t[:, None], mask=mask,
                             kv_cache=self.cache.decode_writer(n, positions_t, kv_len),
                             return_routing=want_routing, compute_logits=False)
            hidden = out.hidden[:, 0]
            routing = out.routed_experts[:, 0] if want_routing else None
        if len(running) < n:
            hidden = hidden[torch.tensor([s.slot for s in running], device=self.device)]
        if routing is not None:
            rows = routing.to(torch.int32).cpu().numpy()
            for seq in running:
                if seq.wants_routing:
                    seq.routing.append(rows[seq.slot][None].copy())
        sampled = self.advance(running, self.model.lm_head(hidden))
        # Steady state (slots [0, n) all running, none finished or admitted since): the next step
        # feeds exactly these samples one position further, so skip rebuilding its inputs from
        # Python lists (~45 us a step at batch 16, ~90 us at 64, measured in the scheduler).
        if self.slot_epoch == epoch and len(running) == n:
            self.next_inputs = (epoch, n, running, sampled, positions_t + 1, kv_len + 1, want_routing)
        else:
            self.next_inputs = None

    # -- sampling and finishing ------------------------------------------------------------------
    def advance(self, seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token for each sequence (logits [len(seqs), V]) and finish those that stop;
        returns the sampled tokens as a tensor [len(seqs)]."""
        tokens_t, tokens, logprobs = sample(logits, [s.row for s in seqs])
        self.generated_tokens += len(tokens)
        for i, seq in enumerate(seqs):
            tok = tokens[i]
            seq.output_ids.append(tok)
            seq.versions.append(self.version)
            if seq.req.return_logprob:
                seq.logprobs.append(logprobs[i])
            if tok in seq.stop_ids:
                self.finish(seq, {"type": "stop", "matched": tok})
            elif len(seq.output_ids) >= seq.limit:
                self.finish(seq, {"type": "length", "length": len(seq.output_ids)})
        return tokens_t

    def release(self, seq: _Sequence) -> None:
        """Free the request's slot (and its lock on the prefix cache) and forget it."""
        if seq.cache_match is not None:
            self.prefix_cache.release(seq.cache_match)
            seq.cache_match = None
        if seq.slot >= 0 and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
            self.num_running -= 1
            self.slot_epoch += 1
        with self.inbox.cv:
            self.inbox.live.pop(seq.req.rid, None)

    def finish(self, seq: _Sequence, reason: dict[str, Any]) -> None:
        # Its slot holds K/V for the prompt and every output token but the last (never fed).
        held = seq.prompt + seq.output_ids[:-1]
        self.cache_sequence(seq, held)
        m = seq.cache_match
        if m is not None and m.generation == self.prefix_cache.generation and 0 <= seq.slot:
            self.slot_tokens[seq.slot] = held  # still valid K/V until the slot's next request writes
        self.release(seq)
        settle_future(seq.future, self.result(seq, reason))

    def result(self, seq: _Sequence, reason: dict[str, Any]) -> GenerateResult:
        """Build the SGLang-shaped result from a sequence's state."""
        routed = None
        if seq.wants_routing and self.is_moe and seq.routing:
            rows = np.concatenate(seq.routing)[: len(seq.prompt) + len(seq.output_ids) - 1]
            routed = np.ascontiguousarray(rows[seq.req.routed_experts_start_len:])
        return GenerateResult(
            rid=seq.req.rid, output_ids=list(seq.output_ids), output_logprobs=list(seq.logprobs),
            routed_experts=routed, finish_reason=reason, weight_version=self.version,
            output_weight_versions=list(seq.versions), prompt_tokens=len(seq.prompt),
            meta={"completion_tokens": len(seq.output_ids), "cached_tokens": seq.cached_tokens,
                  "e2e_latency": time.perf_counter() - seq.submitted_at})

    def stop(self) -> None:
        """Shutdown (called with the inbox lock held): abort everything, fail pending controls."""
        inbox = self.inbox
        pending = [s for s in self.slots if s is not None] + list(inbox.waiting)
        inbox.waiting.clear()
        inbox.live.clear()
        for seq in pending:
            if seq.slot >= 0:
                self.slots[seq.slot] = None
            settle_future(seq.future, self.result(seq, {"type": "abort", "message": "engine shut down"}))
        self.num_running = 0
        for op in inbox.control:
            if op.future is not None:
                settle_future(op.future, error=RuntimeError("EmbeddedEngine is shut down"))
        inbox.control.clear()
