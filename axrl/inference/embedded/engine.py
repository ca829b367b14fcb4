"""The embedded inference engine: in-process continuous batching over a static KV cache.

Threads and ownership
---------------------
`EmbeddedEngine` is the public, thread-safe facade: `generate` / `submit` / `abort` /
`update_weights` may be called from any thread or event loop. They only validate and hand work
to an `Inbox` (a lock + condition). One background thread runs the `Scheduler`, which alone
touches the model, the KV cache and the slots, so no model state is ever shared across threads.
A request is validated by itself (`GenerateRequest.validated`); the engine never modifies the
caller's request object — where it needs another form (e.g. `sampling_params` given as a dict)
it keeps a new request.

Where each job lives: `inbox.py` (what crosses between the threads, a request's in-flight
state), `scheduler.py` (the loop, control ops, admission into slots, finishing),
`batch_forward.py` (prefill, the decode step, sampling), `prefix_reuse.py` (the prefix cache
around a prefill), `weight_source.py` (checking an update before it is copied).

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
import threading
from typing import Any, Iterable, Literal, Sequence

import torch

from axrl.inference.embedded.inbox import ControlOp, Inbox, new_sequence
from axrl.inference.embedded.prefix_cache import DEFAULT_BLOCK_SIZE, pool_tokens
from axrl.inference.protocol import GenerateRequest, GenerateResult, settle_future, validate_submission
from axrl.inference.quant import (KVDtype, Precision, WeightDtype, apply_rollout_precision, check_weight_dtype,
                                  effective_weight_dtype, rollout_state_dict)
from axrl.inference.embedded.scheduler import Scheduler
from axrl.inference.embedded.weight_source import load_weight_source
from axrl.model import ModelConfig, Qwen3ForCausalLM, hf_state_dict

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
        decode_impl: "fused" (fast single-token path, `axrl.inference.embedded.decode`) or "model" (the
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
        weight_dtype: "fp32" | "bf16" | "fp8" — the precision of the weights the engine computes
            with (`axrl.inference.quant`): the model given and every update are quantised here.
        kv_dtype: "auto" (the model's dtype) or "fp8" (K/V rounded through e4m3 as they are cached).
        precision: "auto" (`weight_dtype` alone) or "fp8_w8a8": block-fp8 weights and the inputs of
            the quantised linear layers rounded through e4m3 per token and 128 channels (fused decoder).
    """

    def __init__(self, model: Qwen3ForCausalLM, *, max_batch_size: int = 64, max_seq_len: int = 1024,
                 eos_token_id: int | Sequence[int] | None = None, weight_version: int = 0, seed: int = 0,
                 decode_impl: Literal["fused", "model"] = "fused", max_prefill_tokens: int = 8192,
                 clocked: bool = False, prefix_cache: bool | None = None, prefix_cache_tokens: int = 0,
                 prefix_cache_block: int = DEFAULT_BLOCK_SIZE, weight_dtype: WeightDtype = "fp32",
                 kv_dtype: KVDtype = "auto", precision: Precision = "auto") -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        if decode_impl not in ("fused", "model"):
            raise ValueError(f"decode_impl must be 'fused' or 'model', got {decode_impl!r}")
        if prefix_cache_tokens < 0 or prefix_cache_block < 1:
            raise ValueError(f"prefix_cache_tokens must be >= 0 and prefix_cache_block >= 1, "
                             f"got {prefix_cache_tokens}, {prefix_cache_block}")
        check_weight_dtype(weight_dtype, kv_dtype, precision)
        if precision != "auto" and decode_impl != "fused":
            raise ValueError(f"precision={precision!r} needs decode_impl='fused' (the fp8 activations are applied "
                             "in the fused decoder; the model's own forward is the trainer's, unquantised)")
        self.weight_dtype: WeightDtype = effective_weight_dtype(weight_dtype, precision)
        self.precision: Precision = precision
        self.model = apply_rollout_precision(model.eval(), weight_dtype, precision)
        self.config: ModelConfig = model.config
        self.max_batch_size, self.max_seq_len, self.seed = max_batch_size, max_seq_len, seed
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_ids = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
        self._expected_shapes = {k: tuple(v.shape) for k, v in hf_state_dict(model).items()}
        self._inbox = Inbox()
        use_cache = decode_impl == "fused" if prefix_cache is None else prefix_cache
        cache_tokens = pool_tokens(prefix_cache_tokens, max_batch_size, max_seq_len)
        self._scheduler = Scheduler(self.model, self._inbox, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                    version=weight_version, decode_impl=decode_impl,
                                    max_prefill_tokens=max_prefill_tokens,
                                    prefix_cache=(cache_tokens, prefix_cache_block) if use_cache else None,
                                    kv_dtype=kv_dtype)
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
        """Validate all (or raise, enqueueing none), then queue them in order under the inbox lock."""
        validated = validate_submission(requests, vocab_size=self.config.vocab_size, max_seq_len=self.max_seq_len)
        inbox = self._inbox
        futures = []
        with inbox.cv:
            if inbox.stopping:
                raise RuntimeError("EmbeddedEngine is shut down")
            for req, _ in validated:
                if req.rid in inbox.live:
                    raise ValueError(f"rid: request {req.rid!r} is already in flight; wait for it or use another rid")
            for req, prompt in validated:
                inbox.submitted += 1
                seq = new_sequence(req, prompt, counter=inbox.submitted, engine_seed=self.seed,
                                   eos_token_ids=self.eos_token_ids, max_seq_len=self.max_seq_len)
                seq.future.add_done_callback(lambda f, rid=req.rid: f.cancelled() and self.abort(rid))
                inbox.live[req.rid] = seq
                inbox.waiting.append(seq)
                futures.append(seq.future)
            inbox.cv.notify()
        return futures

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
                inbox.control.append(ControlOp("abort", rid))
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
        state_dict = rollout_state_dict(load_weight_source(source, self.config, self._expected_shapes),
                                        self.weight_dtype)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._inbox.cv:
            if self._inbox.stopping:
                raise RuntimeError("EmbeddedEngine is shut down")
            self._inbox.control.append(ControlOp("weights", (state_dict, version), done))
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
        """Queue a release/resume for the scheduler (applied here when clocked) and wait for it."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("release/resume_memory would deadlock on the engine thread; call it from another thread")
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._inbox.cv:
            if release and (self._inbox.waiting or self._scheduler.num_running):
                raise RuntimeError("release_memory: the engine has requests in flight; release it when idle")
            self._inbox.control.append(ControlOp("memory", release, done))
            self._inbox.cv.notify()
        if self.clocked:
            with torch.inference_mode():
                self._scheduler.apply_pending_controls()
        done.result()


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
                "kv_cache_bytes": s.cache.nbytes(), "weight_dtype": self.weight_dtype,
                "precision": self.precision,
                "kv_dtype": s.cache.kv_dtype}

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
