"""The embedded engine's computation of recorded token streams: prefill + KV-cache decode, teacher-forced.

Each *context* is one engine request of a recorded sample: turn k's prompt (the stream up to the
turn's first generated token) is prefilled, then the turn's recorded tokens are fed one decode
step at a time, exactly as the engine's scheduler does (`axrl.inference.embedded.scheduler.Scheduler`):
the fused prefill over packed prompts, one `FusedDecoder.step` per iteration over slots [0, n)
(idle rows fed token 0 at position 0), `lm_head` on the running rows, and the sampler's logprob
`log_softmax(logits.float() / T)` at the recorded token.

With a `ClockSchedule` (a synchronous deterministic run) the batching is the clock's own, replayed
iteration by iteration: the step's episodes are admitted group by group under the worker's
`max_live_episodes` rule, each turn's request is submitted after the iteration that finished the
previous turn (all submissions between two iterations in sample-id order), the engine admits them
into the lowest free slots, prefills them and decodes slots [0, n) — so every GEMM has the shape it
had. A run with the embedded engine's prefix cache (`prefix_cache`) is mirrored on that schedule by
a real `PrefixCache` with the run's pool, driven by the engine's own functions
(`axrl.inference.embedded.prefix_reuse`) where the engine calls them: cached K/V copied into the slots, only
suffixes prefilled, the same inserts and evictions (docs/prefix-merge.md, "Debugging a cached run").
Without a schedule, the requests of one turn run as one batch with whole prompts prefilled (an
approximation). Neither covers
continuations of requests interrupted by a weight update (asynchronous runs). Groups dynamic
sampling dropped are recorded under /pool (`replay.rollout.rolled_out` appends them to the step's
samples), so the schedule holds every episode the engine ran. `EnginePath.fidelity` says how far
the re-computed logprobs are from the recorded ones.

Used by mismatch attribution (replay/explain.py, with an `ActivationProbe` capturing every hook
point) and by the teacher-forced rollout check of SGLang runs (replay/rollout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from axrl.inference.embedded.decode import FusedDecoder
from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.inference.embedded.prefix_cache import CacheMatch, PrefixCache
from axrl.inference.embedded.prefix_reuse import cache_sequence, retire, split_shared, take_cached_prefix
from axrl.model import Qwen3ForCausalLM

DEFAULT_MAX_PREFILL_TOKENS = 8192  # EmbeddedEngine's default (make_embedded_engine keeps it)


@dataclass
class Context:
    """One engine request of a recorded sample: prefill `tokens[:start]`, decode up to `end`."""

    sample: int            # row of the sample in the step file
    turn: int
    start: int             # the turn's first generated token = the request's prompt length
    end: int               # one past the turn's last generated token
    tokens: np.ndarray     # the sample's token ids [:end]

    @property
    def generated(self) -> range:
        return range(self.start, self.end)


def contexts_of(offsets: np.ndarray, ids: np.ndarray, turn: np.ndarray, generated: np.ndarray,
                rows: list[int] | None = None) -> list[Context]:
    """Every (sample, turn) context of a step's samples `rows` (default: all), in (turn, sample) order.
    `generated` marks tokens the engine generated (a finite rollout logprob)."""
    out = []
    rows = range(len(offsets) - 1) if rows is None else rows
    for r in rows:
        a, b = int(offsets[r]), int(offsets[r + 1])
        gen = np.flatnonzero(generated[a:b])
        for k in sorted(set(turn[a:b][gen].tolist())):
            where = gen[turn[a:b][gen] == k]
            start, end = int(where.min()), int(where.max()) + 1
            out.append(Context(int(r), int(k), start, end, ids[a:a + end].astype(np.int64)))
    return sorted(out, key=lambda c: (c.turn, c.sample))


class _Capture:
    """The engine-side `ActivationProbe`: copies every hook point's rows into per-context buffers
    [end, dim] by position (the forward's own dtype, so a patch substitutes exactly these bits)."""

    def __init__(self, contexts: list[Context], wanted: set[int] | None) -> None:
        self.contexts, self.wanted = contexts, wanted
        self.buffers: list[dict[tuple[str, int], torch.Tensor]] = [{} for _ in contexts]
        self.rows: list[tuple[int, int] | None] = []        # row -> (context, position)
        self.final_rows: list[tuple[int, int] | None] = []  # the same for the "final" point
        self._grouped: tuple[list | None, dict[int, tuple[torch.Tensor, torch.Tensor]]] = (None, {})

    def _groups(self, layout: list[tuple[int, int] | None]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per wanted context, the rows of the forward it has and their positions (a position held
        by several rows: the last one, as row-by-row copies in order would leave it)."""
        if self._grouped[0] is not layout:
            by: dict[int, dict[int, int]] = {}
            for r, where in enumerate(layout):
                if where is not None and (self.wanted is None or where[0] in self.wanted):
                    by.setdefault(where[0], {})[where[1]] = r
            self._grouped = (layout, {c: (torch.tensor(list(m.values()), dtype=torch.int64),
                                          torch.tensor(list(m), dtype=torch.int64)) for c, m in by.items()})
        return self._grouped[1]

    def at(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        layout = self.final_rows if point == "final" else self.rows
        for c, (src, dst) in self._groups(layout).items():
            self._store(c, (point, layer), dst, x[src.to(x.device)])
        return x

    def _store(self, c: int, key: tuple[str, int], pos: int | torch.Tensor, row: torch.Tensor) -> None:
        """`row` [dim] at position `pos`, or rows [n, dim] at positions `pos` [n]."""
        buf = self.buffers[c].get(key)
        if buf is None:
            buf = self.buffers[c][key] = torch.full((self.contexts[c].end, row.shape[-1]), float("nan"),
                                                     dtype=row.dtype)
        buf[pos] = row.detach().cpu()

    def logits(self, c: int, pos: int, row: torch.Tensor) -> None:
        if self.wanted is None or c in self.wanted:
            self._store(c, ("logits", -1), pos, row)


@dataclass
class ClockSchedule:
    """How a synchronous deterministic run's rollout admitted its episodes (axrl/rollout/worker.py)."""

    groups: list[list[int]]        # sample rows of each group, in stream (admission) order
    sample_ids: list[int]          # sample id of each row (the clock's submission key)
    group_size: int
    max_live_episodes: int


@dataclass
class EnginePath:
    """The engine's re-computation of some contexts."""

    contexts: list[Context]
    logprob: list[np.ndarray]                    # per context: float32 [end], NaN outside its generated tokens
    routing: list[np.ndarray | None]             # per context: int [end, L, k] rows the engine computed (MoE)
    states: list[dict[tuple[str, int], torch.Tensor]] = field(default_factory=list)  # captured hook points
    cached: list[int] = field(default_factory=list)  # per context: prompt tokens taken from the prefix cache

    def fidelity(self, recorded: np.ndarray, offsets: np.ndarray) -> dict[str, float]:
        """Re-computed vs recorded rollout logprobs over the contexts' generated tokens."""
        diffs, same = [], 0
        for c, lp in zip(self.contexts, self.logprob):
            rec = recorded[int(offsets[c.sample]) + c.start:int(offsets[c.sample]) + c.end]
            got = lp[c.start:c.end]
            diffs.append(np.abs(got.astype(np.float64) - rec.astype(np.float64)))
            same += int(np.sum(got.view(np.uint32) == rec.astype(np.float32).view(np.uint32)))
        d = np.concatenate(diffs) if diffs else np.zeros(0)
        return {"tokens": int(d.size), "bitwise_equal": same, "max_abs_diff": float(d.max()) if d.size else 0.0,
                "mean_abs_diff": float(d.mean()) if d.size else 0.0, "cached_prompt_tokens": int(sum(self.cached))}


def run_engine_path(model: Qwen3ForCausalLM, contexts: list[Context], *, temperature: float, max_seq_len: int,
                    max_batch_size: int, capture: bool | set[int] = False, schedule: ClockSchedule | None = None,
                    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                    prefix_cache: tuple[int, int] | None = None, kv_dtype: str = "auto") -> EnginePath:
    """Teacher-force `contexts` through the engine's fused prefill and decode (see the module doc).
    `capture`: True keeps every hook point of every context (`EnginePath.states`), a set of context
    indices only theirs. `prefix_cache`: the run's prefix cache (pool tokens, block size), mirrored
    on the `schedule` (without one, every prompt is prefilled whole). `kv_dtype`: the run's
    `rollout.kv_dtype` (the model given already holds `rollout.weight_dtype` weights)."""
    probe = _Capture(contexts, None if capture is True else set(capture)) if capture else None
    logprob = [np.full(c.end, np.nan, dtype=np.float32) for c in contexts]
    routing: list[np.ndarray | None] = [None] * len(contexts)
    model = model.eval()
    cfg = model.config
    weight = model.lm_head.weight
    decoder = FusedDecoder(model, max_seq_len, max_batch_size)
    cache = StaticKVCache(cfg.num_hidden_layers, max_batch_size, cfg.num_key_value_heads, max_seq_len,
                          cfg.head_dim, dtype=weight.dtype, device=weight.device, kv_dtype=kv_dtype)
    scale = float(temperature) if temperature > 0 else 1.0
    order = list(range(len(contexts)))
    batches: list[list[int]] = []
    for i in order:  # contexts of one turn together, at most max_batch_size at a time
        if batches and contexts[batches[-1][0]].turn == contexts[i].turn and len(batches[-1]) < max_batch_size:
            batches[-1].append(i)
        else:
            batches.append([i])
    with torch.inference_mode():
        if schedule is not None:
            clocked = _Clocked(model, decoder, cache, contexts, scale, probe, logprob, routing, cfg.is_moe,
                               max_prefill_tokens, max_batch_size, prefix_cache)
            clocked.run(schedule)
            cached = [getattr(clocked.requests.get(i), "cached_tokens", 0) for i in range(len(contexts))]
        else:
            cached = [0] * len(contexts)
            for batch in batches:
                _run_batch(model, decoder, cache, contexts, batch, scale, probe, logprob, routing, cfg.is_moe,
                           max_prefill_tokens)
    return EnginePath(contexts, logprob, routing, probe.buffers if probe is not None else [], cached)


def _logprobs(model: Qwen3ForCausalLM, hidden: torch.Tensor, scale: float, targets: list[int],
              probe: _Capture | None, where: list[tuple[int, int]]) -> list[float]:
    """The sampler's logprobs of `targets` from final hidden rows, as `axrl.inference.sampling.sample`."""
    logits = model.lm_head(hidden)
    if probe is not None:
        for r, (c, pos) in enumerate(where):
            probe.logits(c, pos, logits[r])
    logits = logits.float()
    temps = torch.full((logits.shape[0], 1), scale, dtype=torch.float32, device=logits.device)
    t = torch.tensor(targets, device=logits.device)
    return torch.log_softmax(logits / temps, dim=-1).gather(1, t[:, None])[:, 0].tolist()


def _run_batch(model: Qwen3ForCausalLM, decoder: FusedDecoder, cache: StaticKVCache, contexts: list[Context],
               batch: list[int], scale: float, probe: _Capture | None, logprob: list[np.ndarray],
               routing: list[np.ndarray | None], is_moe: bool, max_prefill_tokens: int) -> None:
    dev = model.lm_head.weight.device
    slots = {c: s for s, c in enumerate(batch)}
    route_rows: dict[int, list[np.ndarray]] = {c: [] for c in batch}
    # Prefill, chunked as the engine chunks an admission (padded tokens per forward).
    chunks: list[list[int]] = []
    chunk: list[int] = []
    for c in batch:
        longest = max([contexts[i].start for i in chunk] + [contexts[c].start])
        if chunk and longest * (len(chunk) + 1) > max_prefill_tokens:
            chunks.append(chunk)
            chunk = []
        chunk.append(c)
    if chunk:
        chunks.append(chunk)
    for chunk in chunks:
        prompts = [contexts[c].tokens[:contexts[c].start].tolist() for c in chunk]
        if probe is not None:
            probe.rows = [(c, p) for c in chunk for p in range(contexts[c].start)]
            probe.final_rows = [(c, contexts[c].start - 1) for c in chunk]
        hidden, rows = decoder.prefill(prompts, [slots[c] for c in chunk], cache, is_moe, probe)
        if rows is not None:
            start = 0
            for c in chunk:
                route_rows[c].append(rows[start:start + contexts[c].start].to(torch.int32).cpu().numpy())
                start += contexts[c].start
        where = [(c, contexts[c].start - 1) for c in chunk]
        lps = _logprobs(model, hidden, scale, [int(contexts[c].tokens[contexts[c].start]) for c in chunk], probe,
                        where)
        for c, lp in zip(chunk, lps):
            logprob[c][contexts[c].start] = lp
    # Decode: feed each context its recorded tokens; slot s feeds position pos[s].
    pos = {c: contexts[c].start for c in batch}
    while True:
        running = [c for c in batch if pos[c] + 1 < contexts[c].end]
        if not running:
            break
        n = max(slots[c] for c in running) + 1
        by_slot: list[int | None] = [None] * n
        for c in running:
            by_slot[slots[c]] = c
        tokens = [int(contexts[c].tokens[pos[c]]) if c is not None else 0 for c in by_slot]
        positions = [pos[c] if c is not None else 0 for c in by_slot]
        if probe is not None:
            probe.rows = [(c, pos[c]) if c is not None else None for c in by_slot]
            probe.final_rows = probe.rows
        hidden, rows = decoder.step(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), cache,
                                    max(positions) + 1, is_moe, probe)
        live = [c for c in by_slot if c is not None]
        if len(live) < n:
            hidden = hidden[torch.tensor([slots[c] for c in live], device=dev)]
        if rows is not None:
            np_rows = rows.to(torch.int32).cpu().numpy()
            for c in live:
                route_rows[c].append(np_rows[slots[c]][None])
        lps = _logprobs(model, hidden, scale, [int(contexts[c].tokens[pos[c] + 1]) for c in live], probe,
                        [(c, pos[c]) for c in live])
        for c, lp in zip(live, lps):
            logprob[c][pos[c] + 1] = lp
            pos[c] += 1
    for c in batch:
        if route_rows[c]:
            routing[c] = np.concatenate(route_rows[c])


@dataclass(eq=False)
class _Request:
    """A teacher-forced request of `_Clocked`: the fields of `SequenceState` that the engine's
    prefix-reuse functions (`axrl.inference.embedded.prefix_reuse`) read and write, so the engine's own
    cache code runs on it."""

    context: int
    prompt: list[int]
    wants_routing: bool                 # the run's workers ask for routing on an MoE model
    slot: int = -1
    routing: list[np.ndarray] = field(default_factory=list)  # int32 rows from position 0 on
    cache_match: CacheMatch | None = None
    cached_tokens: int = 0


class _Clocked:
    """The engine clock and scheduler of a synchronous step, teacher-forced (see the module doc).

    Mirrors `RolloutWorker._main` / `EngineClock` / `Scheduler.iterate`: after each engine
    iteration the worker admits groups with the live count it had *before* the iteration's finished
    episodes left (their tasks run only in the settle that follows), again with the fresh count if
    that admitted anything; then everything requested is submitted in sample-id order; the next
    iteration admits FIFO into the lowest free slots, prefills (chunked as the engine chunks), samples
    each admitted request's first token, then decodes every running slot.

    With the run's prefix cache (`prefix_cache`: pool tokens, block size) a real `PrefixCache` over
    this path's KV cache makes the engine's decisions at the same points (`SlotBatch.prefill`,
    `Scheduler.finish`): matches, group splits, inserts, evictions, and the copies into slots."""

    def __init__(self, model: Qwen3ForCausalLM, decoder: FusedDecoder, cache: StaticKVCache, contexts: list[Context],
                 scale: float, probe: _Capture | None, logprob: list[np.ndarray], routing: list[np.ndarray | None],
                 is_moe: bool, max_prefill_tokens: int, max_batch_size: int,
                 prefix_cache: tuple[int, int] | None = None) -> None:
        self.model, self.decoder, self.cache, self.contexts = model, decoder, cache, contexts
        self.scale, self.probe, self.logprob, self.routing = scale, probe, logprob, routing
        self.is_moe, self.max_prefill_tokens = is_moe, max_prefill_tokens
        self.slots: list[int | None] = [None] * max_batch_size
        self.n_out: dict[int, int] = {}
        self.requests: dict[int, _Request] = {}
        self.dev = model.lm_head.weight.device
        # As `SlotBatch` builds it; empty, as the weight update before the step left the run's.
        self.pc = None if prefix_cache is None else PrefixCache.for_pool(cache, model.config, prefix_cache)
        # Tokens whose K/V each free slot still holds from its last request (`SlotBatch.slot_tokens`).
        self.slot_tokens: list[list[int]] = [[] for _ in range(max_batch_size)]

    def run(self, sch: ClockSchedule) -> None:
        by_sample: dict[int, list[int]] = {}
        for i, c in enumerate(self.contexts):
            by_sample.setdefault(c.sample, []).append(i)
        for v in by_sample.values():
            v.sort(key=lambda i: self.contexts[i].turn)
        next_turn = {r: 0 for r in by_sample}
        groups = list(sch.groups)
        live: set[int] = set()
        room = max(sch.max_live_episodes, sch.group_size)
        pending: list[int] = []             # samples whose next request is submitted before the next iteration
        waiting: list[int] = []             # the engine's inbox (context indices, FIFO)

        def admit_groups(count: int) -> bool:
            admitted = False
            while groups and count + sch.group_size <= room:
                group = groups.pop(0)
                live.update(group)
                count += sch.group_size
                pending.extend(r for r in group if r in by_sample)  # an episode without a request ends at once
                live.difference_update(r for r in group if r not in by_sample)
                admitted = True
            return admitted

        admit_groups(len(live))
        while pending or waiting or any(s is not None for s in self.slots) or groups:
            for r in sorted(pending, key=lambda r: sch.sample_ids[r]):
                waiting.append(by_sample[r][next_turn[r]])
                next_turn[r] += 1
            pending.clear()
            finished = self.iterate(waiting)
            done = [self.contexts[c].sample for c in finished]
            stale = len(live)
            ended = [r for r in done if next_turn[r] >= len(by_sample[r])]
            pending.extend(r for r in done if next_turn[r] < len(by_sample[r]))
            if admit_groups(stale):
                live.difference_update(ended)
                admit_groups(len(live))
            else:
                live.difference_update(ended)
            if not (pending or waiting or any(s is not None for s in self.slots)) and groups:
                admit_groups(len(live))  # nothing in flight: the worker's next pass admits
        for c, req in self.requests.items():
            if req.routing:
                self.routing[c] = np.concatenate(req.routing)

    def iterate(self, waiting: list[int]) -> list[int]:
        """One scheduler iteration; returns the contexts whose request finished in it."""
        finished: list[int] = []
        free = [i for i, s in enumerate(self.slots) if s is None]
        admitted = []
        while free and waiting:
            c = waiting.pop(0)
            slot = free.pop(0)
            self.slots[slot] = c
            ctx = self.contexts[c]
            self.requests[c] = _Request(c, ctx.tokens[:ctx.start].tolist(), self.is_moe, slot)
            self.n_out[c] = 0
            admitted.append(self.requests[c])
        if admitted:
            self.prefill_admitted(admitted, finished)
        if any(s is not None for s in self.slots):
            self.decode(finished)
        return finished

    def prefill_admitted(self, admitted: list[_Request], finished: list[int]) -> None:
        """`SlotBatch.prefill`: with the prefix cache, a request sharing more of its prompt with an
        earlier one of this admission than the cache holds waits for that one's prefill (which
        inserts its prompt); each request first takes its cached prefix into its slot."""
        if self.pc is None:
            self.prefill_chunks(admitted, finished)
            return
        first, after = split_shared(self.pc, admitted, self.is_moe) if len(admitted) > 1 else (admitted, [])
        for group in (first, after):
            for req in group:
                take_cached_prefix(self.pc, req, self.slot_tokens, self.is_moe)
            self.prefill_chunks(group, finished)

    def prefill_chunks(self, reqs: list[_Request], finished: list[int]) -> None:
        """`SlotBatch.prefill_chunks`: in order, padded computed tokens within `max_prefill_tokens`."""
        chunk: list[_Request] = []
        for req in reqs:
            longest = max(len(r.prompt) - r.cached_tokens for r in [*chunk, req])
            if chunk and longest * (len(chunk) + 1) > self.max_prefill_tokens:
                self.prefill(chunk, finished)
                chunk = []
            chunk.append(req)
        if chunk:
            self.prefill(chunk, finished)

    def slot_of(self, c: int) -> int:
        return self.slots.index(c)

    def emit(self, cs: list[int], hidden: torch.Tensor, finished: list[int]) -> None:
        """Logprobs of each context's next token from its final hidden row; finish those at their end."""
        ctx = self.contexts
        where = [(c, ctx[c].start + self.n_out[c] - 1) for c in cs]
        targets = [int(ctx[c].tokens[ctx[c].start + self.n_out[c]]) for c in cs]
        lps = _logprobs(self.model, hidden, self.scale, targets, self.probe, where)
        for c, lp in zip(cs, lps):
            self.logprob[c][ctx[c].start + self.n_out[c]] = lp
            self.n_out[c] += 1
            if ctx[c].start + self.n_out[c] >= ctx[c].end:
                self.finish(c)
                finished.append(c)

    def finish(self, c: int) -> None:
        """`Scheduler.finish`: the slot holds K/V for every token but the last (never fed); cache
        them, then free the slot."""
        req = self.requests[c]
        retire(self.pc, req, self.contexts[c].tokens[:self.contexts[c].end - 1].tolist(), self.slot_tokens,
               self.is_moe)
        self.slots[req.slot] = None

    def prefill(self, chunk: list[_Request], finished: list[int]) -> None:
        """`SlotBatch.prefill_chunk_fused`: the prompts past their cached prefix, then the prompts
        are cached (the other samples of a group reuse them) before the first tokens are sampled."""
        probe = self.probe
        if probe is not None:  # positions a cached prefix covers were computed by an earlier request
            probe.rows = [(r.context, p) for r in chunk for p in range(r.cached_tokens, len(r.prompt))]
            probe.final_rows = [(r.context, len(r.prompt) - 1) for r in chunk]
        hidden, rows = self.decoder.prefill([r.prompt for r in chunk], [r.slot for r in chunk], self.cache,
                                            self.is_moe, probe, starts=[r.cached_tokens for r in chunk])
        if rows is not None:
            rows = rows.to(torch.int32).cpu().numpy()
            start = 0
            for r in chunk:
                computed = len(r.prompt) - r.cached_tokens
                r.routing.append(rows[start:start + computed].copy())
                start += computed
        for r in chunk:
            cache_sequence(self.pc, r, r.prompt, self.is_moe)
        self.emit([r.context for r in chunk], hidden, finished)

    def decode(self, finished: list[int]) -> None:
        ctx, probe = self.contexts, self.probe
        n = max(i for i, s in enumerate(self.slots) if s is not None) + 1
        by_slot = self.slots[:n]
        live = [c for c in by_slot if c is not None]
        pos = {c: ctx[c].start + self.n_out[c] - 1 for c in live}  # the last output token's position
        tokens = [int(ctx[c].tokens[pos[c]]) if c is not None else 0 for c in by_slot]
        positions = [pos[c] if c is not None else 0 for c in by_slot]
        for i, c in enumerate(by_slot):
            if c is None:  # fed token 0 at position 0: the K/V that slot kept are stale from now on
                self.slot_tokens[i] = []
        if probe is not None:
            probe.rows = [(c, pos[c]) if c is not None else None for c in by_slot]
            probe.final_rows = probe.rows
        hidden, rows = self.decoder.step(torch.tensor(tokens, device=self.dev), torch.tensor(positions, device=self.dev),
                                         self.cache, max(positions) + 1, self.is_moe, probe)
        if len(live) < n:
            hidden = hidden[torch.tensor([i for i, c in enumerate(by_slot) if c is not None], device=self.dev)]
        if rows is not None:
            np_rows = rows.to(torch.int32).cpu().numpy()
            for i, c in enumerate(by_slot):
                if c is not None:
                    self.requests[c].routing.append(np_rows[i][None].copy())
        self.emit(live, hidden, finished)
