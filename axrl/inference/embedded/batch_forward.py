"""The embedded engine's forward passes over its KV-cache slots: prefill of admitted requests
(fused or the model's own forward, reusing cached prefixes), one batched decode step, sampling.

`SlotBatch` owns the device state — model, KV cache, fused decoder, prefix cache, the slots — and
is used by exactly one thread (the scheduler's; `axrl.inference.embedded.scheduler.Scheduler` extends it
with the loop, control ops and finishing). Nothing here takes a lock.
"""

from __future__ import annotations

from typing import Any

import torch

from axrl.inference.embedded.decode import FusedDecoder
from axrl.inference.embedded.inbox import SequenceState
from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.inference.embedded.prefix_cache import PrefixCache
from axrl.inference.embedded.prefix_reuse import cache_sequence, split_shared, take_cached_prefix
from axrl.inference.sampling import sample
from axrl.model import Qwen3ForCausalLM


class SlotBatch:
    """The slots and what runs the model over them; see the module docstring.

    Args:
        model: the policy (its config gives the cache shape; its lm_head the dtype and device).
        max_batch_size, max_seq_len: KV-cache slots and their length.
        version: weight version the model holds now (recorded for every sampled token).
        decode_impl: "fused" (`FusedDecoder`) or "model" (the model's own forward).
        max_prefill_tokens: padded tokens per prefill forward.
        prefix_cache: (pool tokens, block size), or None for no prefix cache.
        kv_dtype: "auto" (the model's dtype) or "fp8" (`StaticKVCache`).
    """

    def __init__(self, model: Qwen3ForCausalLM, *, max_batch_size: int, max_seq_len: int, version: int,
                 decode_impl: str, max_prefill_tokens: int, prefix_cache: tuple[int, int] | None,
                 kv_dtype: str = "auto") -> None:
        self.model = model
        cfg = model.config
        self.is_moe = cfg.is_moe
        weight = self.model.lm_head.weight
        self.cache = StaticKVCache(cfg.num_hidden_layers, max_batch_size, cfg.num_key_value_heads,
                                   max_seq_len, cfg.head_dim, dtype=weight.dtype, device=weight.device,
                                   kv_dtype=kv_dtype)
        self.decoder = FusedDecoder(self.model, max_seq_len, max_batch_size) if decode_impl == "fused" else None
        self.device = weight.device
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache: PrefixCache | None = None
        # Tokens whose K/V (current weights) each free slot still holds from its last request.
        self.slot_tokens: list[list[int]] = [[] for _ in range(max_batch_size)]
        if prefix_cache is not None:
            self.prefix_cache = PrefixCache.for_pool(self.cache, cfg, prefix_cache)
        self.slots: list[SequenceState | None] = [None] * max_batch_size
        # Bumped whenever a slot is taken or freed; the next decode step's inputs are reused only
        # while it stands still (see `decode_step`).
        self.slot_epoch = 0
        self.next_inputs: tuple | None = None
        # Read by other threads (health, weight_version); plain attribute writes are atomic.
        self.version = version
        self.generated_tokens = 0

    def finish(self, seq: SequenceState, reason: dict[str, Any]) -> None:
        """End a request that stopped (called by `advance`); the scheduler implements it."""
        raise NotImplementedError

    def prefill(self, seqs: list[SequenceState]) -> None:
        """Prefill newly admitted requests in padded chunks of at most `max_prefill_tokens`.

        With the prefix cache: each request first takes its cached prefix; a request sharing a
        longer prefix with an earlier one of this admission (a GRPO group) waits for that one's
        prefill, which inserts its prompt, and is prefilled right after in the same iteration."""
        if self.prefix_cache is None:
            self.prefill_chunks(seqs)
            return
        first, after = split_shared(self.prefix_cache, seqs, self.is_moe) if len(seqs) > 1 else (seqs, [])
        for group in (first, after):
            for seq in group:
                take_cached_prefix(self.prefix_cache, seq, self.slot_tokens, self.is_moe)
            self.prefill_chunks(group)

    def prefill_chunks(self, seqs: list[SequenceState]) -> None:
        """Prefill in order, in chunks whose padded size stays within `max_prefill_tokens`."""
        chunk: list[SequenceState] = []
        for seq in seqs:
            longest = max([len(s.prompt) - s.cached_tokens for s in chunk] + [len(seq.prompt) - seq.cached_tokens])
            if chunk and longest * (len(chunk) + 1) > self.max_prefill_tokens:
                self.prefill_chunk(chunk)
                chunk = []
            chunk.append(seq)
        if chunk:
            self.prefill_chunk(chunk)

    def prefill_chunk(self, seqs: list[SequenceState]) -> None:
        """Prefill prompts, writing K/V into their slots: the fused path, or the model's full forward."""
        if self.decoder is not None:
            self.prefill_chunk_fused(seqs)
        else:
            self.prefill_chunk_model(seqs)

    def prefill_chunk_fused(self, seqs: list[SequenceState]) -> None:
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
            cache_sequence(self.prefix_cache, seq, seq.prompt, self.is_moe)
        self.start_decoding(seqs, hidden)

    def start_decoding(self, seqs: list[SequenceState], hidden: torch.Tensor) -> None:
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

    def prefill_chunk_model(self, seqs: list[SequenceState]) -> None:
        """The model's full forward over right-padded prompts, writing K/V into the slots; a prompt
        with a cached prefix (`cached_tokens` > 0) is prefilled alone, from there on."""
        if any(s.cached_tokens for s in seqs):
            fresh = [s for s in seqs if not s.cached_tokens]
            if fresh:
                self.prefill_chunk_model(fresh)
            for seq in seqs:
                if seq.cached_tokens:
                    self.prefill_suffix_model(seq)
            return
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
        for seq in seqs:  # as in the fused prefill: the other samples of a group reuse this prompt
            cache_sequence(self.prefix_cache, seq, seq.prompt, self.is_moe)

    def prefill_suffix_model(self, seq: SequenceState) -> None:
        """The model's forward over prompt[cached_tokens:] of one request, attending over the K/V
        its slot holds for the cached prefix (positions continue from there)."""
        start, length = seq.cached_tokens, len(seq.prompt)
        ids = torch.tensor([seq.prompt[start:]], device=self.device)
        positions = torch.arange(start, length, device=self.device)
        mask = (torch.arange(length, device=self.device)[None] <= positions[:, None])[None, None]
        want_routing = self.is_moe and seq.wants_routing
        out = self.model(ids, position_ids=positions[None], mask=mask,
                         kv_cache=self.cache.suffix_writer(seq.slot, start), return_routing=want_routing,
                         compute_logits=False)
        if want_routing:
            seq.routing.append(out.routed_experts[0].to(torch.int32).cpu().numpy().copy())
        cache_sequence(self.prefix_cache, seq, seq.prompt, self.is_moe)
        self.start_decoding([seq], out.hidden[:, -1])

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

    # -- sampling ---------------------------------------------------------------------------------------
    def advance(self, seqs: list[SequenceState], logits: torch.Tensor) -> torch.Tensor:
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

