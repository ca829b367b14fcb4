"""The embedded engine's computation of recorded token streams: prefill + KV-cache decode, teacher-forced.

Each *context* is one engine request of a recorded sample: turn k's prompt (the stream up to the
turn's first generated token) is prefilled, then the turn's recorded tokens are fed one decode
step at a time, exactly as the engine's scheduler does (`axrl.inference.embedded._Scheduler`):
the fused prefill over packed prompts, one `FusedDecoder.step` per iteration over slots [0, n)
(idle rows fed token 0 at position 0), `lm_head` on the running rows, and the sampler's logprob
`log_softmax(logits.float() / T)` at the recorded token. Contexts of the same turn run as one
batch (the clock submits them together), so the GEMM shapes are those of a batch admitted at once.

What it cannot reproduce: requests admitted into slots freed mid-batch (a turn-2 request joining
while other turn-1 requests still decode) and continuations of requests interrupted by a weight
update. `EnginePath.fidelity` says how far the re-computed logprobs are from the recorded ones.

Used by mismatch attribution (replay/explain.py, with an `ActivationProbe` capturing every hook
point) and by the teacher-forced rollout check of SGLang runs (replay/rollout.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from axrl.inference.decode import FusedDecoder
from axrl.inference.kv_cache import StaticKVCache
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

    def at(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        layout = self.final_rows if point == "final" else self.rows
        for r, where in enumerate(layout):
            if where is None:
                continue
            c, pos = where
            if self.wanted is None or c in self.wanted:
                self._store(c, (point, layer), pos, x[r])
        return x

    def _store(self, c: int, key: tuple[str, int], pos: int, row: torch.Tensor) -> None:
        buf = self.buffers[c].get(key)
        if buf is None:
            buf = self.buffers[c][key] = torch.full((self.contexts[c].end, row.shape[-1]), float("nan"),
                                                     dtype=row.dtype)
        buf[pos] = row.detach().cpu()

    def logits(self, c: int, pos: int, row: torch.Tensor) -> None:
        if self.wanted is None or c in self.wanted:
            self._store(c, ("logits", -1), pos, row)


@dataclass
class EnginePath:
    """The engine's re-computation of some contexts."""

    contexts: list[Context]
    logprob: list[np.ndarray]                    # per context: float32 [end], NaN outside its generated tokens
    routing: list[np.ndarray | None]             # per context: int [end, L, k] rows the engine computed (MoE)
    states: list[dict[tuple[str, int], torch.Tensor]] = field(default_factory=list)  # captured hook points

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
                "mean_abs_diff": float(d.mean()) if d.size else 0.0}


def run_engine_path(model: Qwen3ForCausalLM, contexts: list[Context], *, temperature: float, max_seq_len: int,
                    max_batch_size: int, capture: bool | set[int] = False,
                    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS) -> EnginePath:
    """Teacher-force `contexts` through the engine's fused prefill and decode (see the module doc).
    `capture`: True keeps every hook point of every context (`EnginePath.states`), a set of context
    indices only theirs."""
    probe = _Capture(contexts, None if capture is True else set(capture)) if capture else None
    logprob = [np.full(c.end, np.nan, dtype=np.float32) for c in contexts]
    routing: list[np.ndarray | None] = [None] * len(contexts)
    model = model.eval()
    cfg = model.config
    weight = model.lm_head.weight
    decoder = FusedDecoder(model, max_seq_len, max_batch_size)
    cache = StaticKVCache(cfg.num_hidden_layers, max_batch_size, cfg.num_key_value_heads, max_seq_len,
                          cfg.head_dim, dtype=weight.dtype, device=weight.device)
    scale = float(temperature) if temperature > 0 else 1.0
    order = list(range(len(contexts)))
    batches: list[list[int]] = []
    for i in order:  # contexts of one turn together, at most max_batch_size at a time
        if batches and contexts[batches[-1][0]].turn == contexts[i].turn and len(batches[-1]) < max_batch_size:
            batches[-1].append(i)
        else:
            batches.append([i])
    with torch.inference_mode():
        for batch in batches:
            _run_batch(model, decoder, cache, contexts, batch, scale, probe, logprob, routing, cfg.is_moe,
                       max_prefill_tokens)
    return EnginePath(contexts, logprob, routing, probe.buffers if probe is not None else [])


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
