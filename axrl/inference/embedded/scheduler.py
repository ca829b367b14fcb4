"""The embedded engine's scheduler: the loop on the engine thread (or the caller's, when
clocked) that applies control ops, admits waiting requests into slots, runs the forward passes
(`SlotBatch`) and settles each request's future with its result.

Only this thread touches the model, the KV cache and the slots; it meets the API threads at the
`Inbox`, under its lock.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from axrl.inference.embedded.batch_forward import SlotBatch
from axrl.inference.embedded.inbox import ControlOp, Inbox, SequenceState
from axrl.inference.embedded.prefix_reuse import retire
from axrl.inference.protocol import GenerateResult, settle_future
from axrl.model import Qwen3ForCausalLM, load_weights_into


class Scheduler(SlotBatch):
    """The loop on the engine thread: owns the model, the KV cache and the slots (`SlotBatch`'s
    arguments, plus the `inbox` it serves)."""

    def __init__(self, model: Qwen3ForCausalLM, inbox: Inbox, *, max_batch_size: int, max_seq_len: int,
                 version: int, decode_impl: str, max_prefill_tokens: int,
                 prefix_cache: tuple[int, int] | None, kv_dtype: str = "auto") -> None:
        super().__init__(model, max_batch_size=max_batch_size, max_seq_len=max_seq_len, version=version,
                         decode_impl=decode_impl, max_prefill_tokens=max_prefill_tokens, prefix_cache=prefix_cache,
                         kv_dtype=kv_dtype)
        self.inbox = inbox
        # Read by other threads (health); plain attribute writes are atomic.
        self.num_running = 0
        self.iterations = 0
        self.last_error: str | None = None

    # -- loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        """The engine thread's body: iterate until shutdown."""
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
        """Apply the control ops queued so far, in order (between iterations, or from the owner's
        thread for a clocked engine)."""
        with self.inbox.cv:
            control = list(self.inbox.control)
            self.inbox.control.clear()
        for op in control:
            self.apply_control(op)

    def apply_control(self, op: ControlOp) -> None:
        """Abort a running request, release/resume memory, or load new weights."""
        if op.kind == "abort":
            seq = next((s for s in self.slots if s is not None and s.req.rid == op.payload), None)
            if seq is not None:
                self.finish(seq, {"type": "abort", "message": "aborted by client"})
            return
        if op.kind == "memory":
            self.set_memory(released=op.payload)
            settle_future(op.future, None)
            return
        self.apply_weights(op)

    def apply_weights(self, op: ControlOp) -> None:
        """Copy the (already validated) state dict into the model and bump the version; the
        prefix cache forgets K/V computed with the old weights."""
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

    def admit(self) -> list[SequenceState]:
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

    # -- finishing -------------------------------------------------------------------------------------
    def release(self, seq: SequenceState) -> None:
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

    def finish(self, seq: SequenceState, reason: dict[str, Any]) -> None:
        """Cache what the request's slot holds, free the slot and settle its future."""
        # Its slot holds K/V for the prompt and every output token but the last (never fed).
        retire(self.prefix_cache, seq, seq.prompt + seq.output_ids[:-1], self.slot_tokens, self.is_moe)
        self.release(seq)
        settle_future(seq.future, self.result(seq, reason))

    def result(self, seq: SequenceState, reason: dict[str, Any]) -> GenerateResult:
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
