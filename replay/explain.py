"""Mismatch attribution: where the engine's and the trainer's computations of a token part ways.

    result = explain_step("runs/walk", 4, top=5)
    for tok in result.tokens:
        print(tok.headline(), tok.named)

For each chosen token (a generated token t of some sample) two computations of log p(t | …) are
run with hooks on the model's explicit hook points (`axrl.model.ActivationProbe`):

* the **engine path** — the embedded engine's prefill of the turn's request and its KV-cache decode
  steps, teacher-forced with the recorded tokens, in the batches the engine ran them in (the
  clock's schedule replayed on synchronous deterministic runs; replay/engine_path.py); it
  reproduces the recorded rollout logprob (bit for bit there, reported as `engine_reproduces_rollout`);
* the **trainer path** — the packed micro-batch as trained, through `TrainBackend.probe_forward`
  (the same split and padding as the prepare-phase forward; reproduces `old_logprob`).

Correlation: at the predicting position t − 1 every hook point is compared (relative L2 distance of
the residual stream entering and leaving each layer, of the attention and expert outputs — the
differences of consecutive residual states — of the final norm and the logits; the router logits,
both top-k sets, whether they flip, and the margin between the k-th and (k+1)-th expert's
probability).

Causation: activation patching. The engine's residual stream at one hook point (every position of
the token's request up to t − 1; positions the engine took from its prefix cache keep the trainer's
states, so a cause that acted only in an earlier turn shows up where those positions are read) replaces
the trainer's, the trainer computes the rest, and the gap
gap(P) = trainer logprob − engine logprob that remains is measured. Points run in depth order —
layer 0's input, then after each layer's attention ("mid") and after the layer ("out"), the final
norm, the logits — so each component's **share** of the gap is (gap(before it) − gap(after it)) /
gap; the component with the largest share is named, and `removed_at` is the first point from which
the remaining gap stays below 10 %. Patching the logits leaves the log-softmax alone: the gap is
then exactly 0 (the method's sanity check). Routing: the trainer's forward is run under R3 with the engine's routing, in every MoE layer ("with R3 this
token's gap would be X") and in each MoE layer alone. A routing flip is named when the two top-k
sets differ at a position of the request in a layer whose R3 alone removes at least half of the gap.

Imports `axrl` only, never `axrl_debug`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from axrl.assembly.build import make_engine_model
from axrl.assembly.settings import routing_replay
from axrl.model import ModelConfig
from axrl.trace import StepFile
from axrl.train.micro_batch import label_logprobs, split_micro_batches
from axrl.train.protocol import R3, ForwardResult, PackedBatch, R3Scope, TrainBackend
from replay.engine_path import Context, EnginePath, contexts_of, run_engine_path
from replay.plan import ReplayInputError
from replay.explain_batch import _Layout
from replay.explain_report import (ExplainResult, LayerRow, TokenExplanation, named_component, removed_at,
                                   routing_flip)
from replay.policy import PolicyState, policy_before
from replay.rollout import clock_schedule, engine_prefix_cache, rolled_out
from replay.recorded import require_full

Progress = Callable[[str], None]
WeightsHook = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def patch_points(num_layers: int) -> list[tuple[str, int]]:
    """Hook points in depth order (layer l's input equals layer l − 1's output, so only layer 0's)."""
    points = [("in", 0)]
    for layer in range(num_layers):
        points += [("mid", layer), ("out", layer)]
    return points + [("final", -1), ("logits", -1)]


def component_name(after: tuple[str, int], moe: set[int]) -> str:
    """The computation that ends at patch point `after` (the one before it in depth order)."""
    point, layer = after
    if point == "mid":
        return f"layer {layer} attention"
    if point == "out":
        return f"layer {layer} {'moe' if layer in moe else 'mlp'}"
    return "final norm" if point == "final" else "lm head"


# ------------------------------------------------------------------------------------------ probes
class _TrainerProbe:
    """A `ForwardProbe` on the trainer: copies the hook points of some samples (`capture`: batch
    row → positions kept) and/or replaces, per batch row, one point's first positions with given
    values (`patches`: batch row → (hook point, tensor [P, dim] for positions 0..P−1)) — rows of one
    forward may each be patched at a different point (the batched patch variants)."""

    def __init__(self, capture: set[int] | None = None,
                 patches: dict[int, tuple[tuple[str, int], torch.Tensor]] | None = None) -> None:
        self.capture, self.patches = capture or set(), patches or {}
        self.states: dict[int, dict[tuple[str, int], torch.Tensor]] = {}
        self.samples: list[int] = []
        self._at: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = {}

    def begin(self, samples: list[int], rows: torch.Tensor, cols: torch.Tensor) -> None:
        self.samples = samples
        self._at = {}
        for i, s in enumerate(samples):
            if s in self.patches:
                point, values = self.patches[s]
                self._at.setdefault(point, []).append((i, values))

    def at(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        B = len(self.samples)
        view = x.view(B, -1, x.shape[-1])  # the router's logits come flattened [B*S, E]
        for i, s in enumerate(self.samples):
            if s in self.capture:
                self.states.setdefault(s, {})[(point, layer)] = view[i].detach().cpu().clone()
        patches = self._at.get((point, layer))
        if not patches:
            return x
        out = view.clone()
        for i, values in patches:
            # Positions the engine never computed at this point (NaN rows) keep the trainer's own.
            have = torch.isfinite(values.float()).all(-1).nonzero()[:, 0]
            have = have[have < out.shape[1]]
            out[i, have.to(out.device)] = values[have].to(out.device, out.dtype)
        return out.view(x.shape)


@dataclass
class _Step:
    off: np.ndarray
    sids: np.ndarray
    gids: np.ndarray
    ids: np.ndarray
    turn: np.ndarray
    rollout: np.ndarray
    old: np.ndarray
    loss_mask: np.ndarray
    routing: np.ndarray | None


def _read(path: Path) -> _Step:
    with StepFile(path) as sf:
        require_full(sf, path)
        return _Step(sf["/samples/offsets"].astype(np.int64), sf["/samples/sample_id"].astype(np.int64),
                     sf["/samples/group_id"].astype(np.int64),
                     sf["/tokens/ids"].astype(np.int64), sf["/tokens/turn"].astype(np.int64),
                     sf["/tokens/rollout_logprob"], sf["/tokens/old_logprob"], sf["/tokens/loss_mask"],
                     sf.get("/routing/rollout"))


def select_tokens(st: _Step, tokens: list[tuple[int, int]] | None, top: int | None) -> list[tuple[int, int]]:
    """(sample row, token index) of the tokens to explain: given as (sample id, token index), or the
    `top` analysed tokens (loss_mask 1, a rollout logprob) by |old − rollout|."""
    gen = np.isfinite(st.rollout)
    if tokens:
        out = []
        rows = {int(s): r for r, s in enumerate(st.sids)}
        for sid, t in tokens:
            if sid not in rows:
                raise ReplayInputError(f"--sample {sid}: not a sample of this step (sample ids "
                                       f"{int(st.sids.min())}..{int(st.sids.max())})")
            r = rows[sid]
            n = int(st.off[r + 1] - st.off[r])
            if not 0 <= t < n or not gen[st.off[r] + t]:
                gen_idx = np.flatnonzero(gen[st.off[r]:st.off[r + 1]])
                raise ReplayInputError(f"--token {t}: sample {sid} has {n} tokens and generated tokens at "
                                       f"{_ranges(gen_idx)}; pick a generated one")
            out.append((r, t))
        return out
    analysed = np.flatnonzero((st.loss_mask > 0) & gen & np.isfinite(st.old))
    delta = np.abs(st.old[analysed].astype(np.float64) - st.rollout[analysed].astype(np.float64))
    pick = analysed[np.argsort(-delta, kind="stable")[:top or 10]]
    rows = np.searchsorted(st.off, pick, side="right") - 1
    return [(int(r), int(p - st.off[r])) for r, p in zip(rows, pick)]


def token_index(run_dir: str | Path, step: int, sample_id: int, turn: int, position: int) -> int:
    """The stream index of the `position`-th generated token of `turn` in sample `sample_id` (the
    `pos` and `turn` columns of `axrl-debug mismatch`'s top tokens)."""
    from replay.plan import RunInventory

    inv = RunInventory(run_dir)
    if step not in inv.files:
        raise ReplayInputError.for_step(f"step {step} is not in the trace of {inv.run}", inv, step)
    st = _read(inv.files[step])
    rows = np.flatnonzero(st.sids == sample_id)
    if rows.size == 0:
        raise ReplayInputError(f"--sample {sample_id}: not a sample of step {step}")
    a, b = int(st.off[rows[0]]), int(st.off[rows[0] + 1])
    gen = np.flatnonzero(np.isfinite(st.rollout[a:b]) & (st.turn[a:b] == turn))
    if not 0 <= position < gen.size:
        raise ReplayInputError(f"--pos {position}: turn {turn} of sample {sample_id} has {gen.size} generated tokens")
    return int(gen[position])


def _ranges(idx: np.ndarray) -> str:
    if idx.size == 0:
        return "none"
    parts, start = [], int(idx[0])
    for a, b in zip(idx[:-1], idx[1:]):
        if b != a + 1:
            parts.append(f"{start}..{int(a)}")
            start = int(b)
    parts.append(f"{start}..{int(idx[-1])}")
    return ", ".join(parts)


def explain_step(run_dir: str | Path, step: int, *, tokens: list[tuple[int, int]] | None = None,
                 top: int | None = None, engine_weights: WeightsHook | None = None, engine_dtype: str | None = None,
                 progress: Progress | None = None) -> ExplainResult:
    """Explain the engine/trainer mismatch of some tokens of `step` (see the module doc): `tokens` as
    (sample id, token index), else the `top` (default 10) tokens by |Δ|. `engine_weights` transforms
    the engine's copy of the weights (tests plant a cause with it); `engine_dtype` ("bfloat16" |
    "float32") runs the engine path in another dtype than the run's (a what-if: a bf16 engine beside
    an fp32 trainer). Raises ReplayInputError."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    threads_before = torch.get_num_threads()
    state = policy_before(run_dir, step, progress=say)
    try:
        return _explain(state, step, tokens, top, engine_weights, engine_dtype, say, t0)
    finally:
        state.close()
        torch.set_num_threads(threads_before)


def _explain(state: PolicyState, step: int, tokens: list[tuple[int, int]] | None, top: int | None,
             hook: WeightsHook | None, engine_dtype: str | None, say: Progress, t0: float) -> ExplainResult:
    cfg, backend = state.cfg, state.backend
    mcfg = backend.model_config
    timings = {"rebuild_seconds": time.perf_counter() - t0}
    rec = state.recorded(step)
    st = _read(state.inventory.files[step])
    chosen = select_tokens(st, tokens, top)
    notes = list(state.notes) + [m.describe() for m in state.mismatches]
    with StepFile(state.inventory.files[step]) as sf:
        version = sf["/tokens/policy_version"]
        ro = rolled_out(sf)   # + the samples dynamic sampling dropped (/pool): they shared the engine's batches
    lagged = [(r, t) for r, t in chosen if int(version[st.off[r] + t]) != step]
    if lagged:
        # Both paths run the policy of this step; a token generated by an older version was not.
        notes.append(f"{len(lagged)} chosen token(s) were generated by an older policy version than step {step}'s "
                     "(asynchronous run): both paths use the step's policy, so the engine path does not reproduce their "
                     "rollout logprob and their Δ includes the policy's drift (see Δ_staleness in "
                     "`axrl-debug mismatch`)")
    # Engine path: every request of the step (the batches it ran in), hook points of the chosen ones.
    contexts = contexts_of(ro.off, ro.ids, ro.turn, np.isfinite(ro.rollout_logprob))
    index = {(c.sample, c.turn): i for i, c in enumerate(contexts)}
    of_token = {(r, t): index[(r, int(st.turn[st.off[r] + t]))] for r, t in chosen}
    wanted = set(of_token.values())
    weights = {k: v.detach().clone() for k, v in backend.named_weights()}
    engine_cfg = cfg
    if engine_dtype is not None and engine_dtype != cfg.model.dtype:
        engine_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": engine_dtype})})
        notes.append(f"what-if: the engine path runs in {engine_dtype}, the run's model.dtype is {cfg.model.dtype}")
    model = make_engine_model(engine_cfg, mcfg, hook(weights) if hook else weights)
    t1 = time.perf_counter()
    say(f"engine path: {len(contexts)} request(s), prefill + KV-cache decode")
    ep = run_engine_path(model, contexts, temperature=cfg.rollout.temperature, max_seq_len=cfg.rollout.max_context_len,
                         max_batch_size=cfg.rollout.max_batch_size, capture=wanted,
                         schedule=clock_schedule(cfg, ro.sids, ro.gids), prefix_cache=engine_prefix_cache(cfg),
                               kv_dtype=cfg.rollout.kv_dtype)
    timings["engine_seconds"] = time.perf_counter() - t1
    # Trainer path: the consecutive micro-batches (as trained) that hold the chosen tokens.
    ranges = split_micro_batches(rec.batch.lengths, cfg.train.micro_batch_tokens)
    needed = sorted({next(i for i, rg in enumerate(ranges) if r in rg) for r, _ in chosen})
    rows = list(range(ranges[needed[0]].start, ranges[needed[-1]].stop))
    sub = rec.batch if len(rows) == rec.batch.num_samples else rec.batch.select(rows)
    sub_row = {r: i for i, r in enumerate(rows)}
    t2 = time.perf_counter()
    explained = _trainer_side(state, _Chosen(st, sub, sub_row, chosen, contexts, of_token, ep), say, timings)
    timings["trainer_seconds"] = time.perf_counter() - t2
    timings["total_seconds"] = time.perf_counter() - t0
    fid = ep.fidelity(ro.rollout_logprob, ro.off)
    fidelity = {"engine_path_vs_rollout_logprob": fid,
                "trainer_path_reproduces_old_logprob": all(t.trainer_reproduces_old for t in explained)}
    if cfg.rollout.engine != "embedded":
        notes.append(f"the run's engine was {cfg.rollout.engine}: the engine path is the embedded engine's decode "
                     "path on the recorded token streams, not the recorded engine's kernels")
    return ExplainResult(state.inventory.run, step, explained, fidelity, notes, timings)


def _gap_at(logprobs: torch.Tensor, sub: PackedBatch, tokens: list[tuple[int, int]], engine: dict) -> dict:
    off = sub.offsets
    return {key: float(logprobs[int(off[i]) + t]) - engine[key] for key, (i, t) in zip(engine, tokens)}


Key = tuple[int, int]   # a chosen token: (sample row in the step, token index in the sample)


@dataclass
class _Chosen:
    """The tokens being explained and where they sit on both paths."""

    st: _Step                     # the step's recorded columns
    sub: PackedBatch              # the trainer path's input: the micro-batches holding the chosen tokens
    sub_row: dict[int, int]       # step row → row of `sub`
    keys: list[Key]               # the chosen tokens, in order
    contexts: list[Context]       # the engine path's requests
    of_token: dict[Key, int]      # chosen token → its request (index into `contexts`)
    ep: EnginePath                # the engine path's results
    engine_lp: dict[Key, float] = field(init=False)   # the engine path's logprob of each chosen token

    def __post_init__(self) -> None:
        self.engine_lp = {(r, t): float(self.ep.logprob[self.of_token[(r, t)]][t]) for r, t in self.keys}

    def in_sub(self, keys: list[Key]) -> list[Key]:
        """`keys` as (row of `sub`, token index)."""
        return [(self.sub_row[r], t) for r, t in keys]


@dataclass
class _TrainerRun:
    """The trainer path's baseline (as trained) and the gaps left under each intervention."""

    base: ForwardResult                           # the baseline forward (as trained)
    states: dict[int, dict[tuple[str, int], torch.Tensor]]  # sub row → hook point → captured rows
    gap0: dict[Key, float]                        # trainer − engine logprob, unpatched
    remaining: dict[tuple[str, int], dict[Key, float]] = field(default_factory=dict)  # gap after each patch point
    r3_gap: dict[Key, float] = field(default_factory=dict)            # with the engine's routing everywhere
    router_gap: dict[int, dict[Key, float]] = field(default_factory=dict)  # with it in one MoE layer


def _trainer_side(state: PolicyState, ch: _Chosen, say: Progress,
                  timings: dict[str, float] | None = None) -> list[TokenExplanation]:
    """Run the trainer path's baseline, the activation patches and the routing replays, then explain
    each chosen token from them (their times into `timings`: baseline, patches, routing)."""
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    backend, mcfg = state.backend, state.backend.model_config
    moe = {i for i in range(mcfg.num_hidden_layers) if mcfg.is_moe_layer(i)}
    # Baseline: the trainer as trained, capturing the chosen samples' hook points.
    say(f"trainer path: {ch.sub.num_samples} sample(s) in {len(ch.sub_row)} row(s), baseline + patches")
    base_probe = _TrainerProbe(capture={ch.sub_row[r] for r, _ in ch.keys})
    r3 = routing_replay(state.cfg)  # the trainer's forward as the loop ran it (R3 runs replay routing)
    base = None if getattr(backend, "probe_observes_only", False) else backend.probe_forward(ch.sub, base_probe, r3=r3)
    if base is None:
        raise ReplayInputError("the run's train backend cannot hook its model (explain needs train.backend: torch)")
    run = _TrainerRun(base, base_probe.states, _gap_at(base.logprobs, ch.sub, ch.in_sub(ch.keys), ch.engine_lp))
    t1 = time.perf_counter()
    layout = _Layout.of(backend, ch.sub, state.cfg)
    _patch_gaps(backend, ch, run, patch_points(mcfg.num_hidden_layers), r3, layout)
    t2 = time.perf_counter()
    _routing_gaps(backend, ch, run, moe, layout, per_sample=not r3)
    t3 = time.perf_counter()
    out = [_explain_token(state, ch, run, key, moe) for key in ch.keys]
    timings.update({"trainer_baseline_seconds": t1 - t0, "patch_seconds": t2 - t1, "routing_seconds": t3 - t2,
                    "rows_seconds": time.perf_counter() - t3})
    return out


LOGITS = ("logits", -1)


def _logits_patched(ch: _Chosen, trainer: torch.Tensor, values: torch.Tensor, keys: list[Key],
                    device: torch.device | str) -> dict[Key, float]:
    """The gap of `keys` with the engine's logits `values` patched in (NaN rows: the trainer's own)."""
    rows = []
    for _, t in keys:
        v = values[t - 1] if t - 1 < values.shape[0] else None
        rows.append(v if v is not None and bool(torch.isfinite(v.float()).all()) else trainer[t - 1])
    labels = torch.tensor([int(ch.st.ids[int(ch.st.off[r]) + t]) for r, t in keys], dtype=torch.int64)
    logits = torch.stack(rows).to(device=device, dtype=trainer.dtype)
    lp, _ = label_logprobs(logits, labels.to(device), ch.sub.temperature)
    return {key: float(x) - ch.engine_lp[key] for key, x in zip(keys, lp.tolist())}


def _patch_gaps(backend: TrainBackend, ch: _Chosen, run: _TrainerRun, points: list[tuple[str, int]], r3: R3,
                layout: _Layout) -> None:
    """`run.remaining`: the gap left with the engine's states patched in at each point.

    A variant is one (request, patch point): a copy of the request's sample, cut after its last
    chosen token of that request (a token's logprob depends on its own sample's earlier positions
    only), with the engine's states at that point (the positions of the request it computed)
    patched in. A sample's chosen tokens of one request share that request's states, so they share
    a variant; its tokens of another turn get their own copy (their patches would interact within
    one row). All variants are stacked along the batch dimension and run in a few batched
    forwards, each holding copies of one padded length and padded to it (`_Layout`): every
    variant then computes the bits one forward of its whole micro-batch per patch point did.
    Skipped, with the same result: a variant whose engine states equal the trainer's there (the
    baseline: the unpatched gap) and the logits point (only the log-softmax follows it; computed
    directly on the patched rows)."""
    device = getattr(backend, "device", None)
    by_request: dict[int, list[Key]] = {}
    for key in ch.keys:
        by_request.setdefault(ch.of_token[key], []).append(key)
    variants: list[tuple[int, int, tuple[str, int], torch.Tensor, list[Key]]] = []  # sub row, length, point, values, keys
    for c, keys in by_request.items():
        i = ch.sub_row[keys[0][0]]
        n = max(t for _, t in keys) + 1
        for point in points:
            buf = ch.ep.states[c].get(point)
            values = None if buf is None else buf[:min(ch.contexts[c].end - 1, n)]  # positions the engine computed
            if values is None or _same_states(values, run.states[i].get(point)):
                run.remaining.setdefault(point, {}).update({key: run.gap0[key] for key in keys})
                continue
            if point == LOGITS and device is not None and run.states[i].get(point) is not None:
                # Only the log-softmax follows the logits: computed here on the patched rows, as the
                # patched forward's would be (same function, same device, the trainer's logits dtype).
                run.remaining.setdefault(point, {}).update(_logits_patched(ch, run.states[i][point], values, keys, device))
                continue
            variants.append((i, n, point, values, keys))
    for ks, batch in layout.batches(ch.sub, [(v[0], v[1]) for v in variants]):
        part = [variants[k] for k in ks]
        probe = _TrainerProbe(patches={row: (point, values) for row, (_, _, point, values, _) in enumerate(part)})
        logprobs = backend.probe_forward(batch, probe, r3=r3).logprobs
        for row, (_, _, point, _, keys) in enumerate(part):
            a = int(batch.offsets[row])
            run.remaining.setdefault(point, {}).update(
                {(r, t): float(logprobs[a + t]) - ch.engine_lp[(r, t)] for r, t in keys})


def _routing_gaps(backend: TrainBackend, ch: _Chosen, run: _TrainerRun, moe: set[int], layout: _Layout, *,
                  per_sample: bool = True) -> None:
    """`run.r3_gap` / `run.router_gap`: the gap under R3 with the engine's routing (rows from the first
    request that computed each position), in every MoE layer and in each one alone (does that
    layer's expert choice carry the gap?); NaN without MoE layers or recorded routing."""
    sub, base = ch.sub, run.base
    run.r3_gap = {key: float("nan") for key in ch.keys}
    run.router_gap = {layer: dict(run.r3_gap) for layer in moe}
    if not moe or sub.routed_experts is None:
        return
    routed = sub.routed_experts.clone()
    for c, rt in zip(ch.contexts, ch.ep.routing):
        if rt is None or c.sample not in ch.sub_row:
            continue
        a = int(sub.offsets[ch.sub_row[c.sample]])
        earlier = [o for o in ch.contexts if o.sample == c.sample and o.turn < c.turn]
        first = max([o.end - 1 for o in earlier], default=0)
        routed[a + first:a + rt.shape[0]] = torch.from_numpy(rt[first:].astype(np.int64))
    # The forwards run the chosen samples only, each cut after its last chosen token (a token's
    # logprob depends on its own sample's earlier positions only). A sample where the engine chose
    # exactly the baseline's experts (same order) at each replayed layer up to there replays nothing
    # new: R3 there is the baseline computation, so its gap is the unpatched one, no forward needed.
    # Not `per_sample` (the run itself replays routing, so the baseline forced the layers a
    # one-layer R3 leaves free): every chosen sample runs when one of them differs, as a layer.
    need: dict[int, int] = {}
    for r, t in ch.keys:
        need[ch.sub_row[r]] = max(need.get(ch.sub_row[r], 0), t + 1)
    forced = dataclasses.replace(sub, routed_experts=routed)
    # compared up to the last chosen token per sample, or over the whole sample (as a layer was)
    spans = {i: (int(sub.offsets[i]), int(sub.offsets[i]) + need[i] if per_sample else int(sub.offsets[i + 1]))
             for i in need}
    differs = {(i, layer): base.routed_experts is None or not torch.equal(routed[a:b, layer],
                                                                         base.routed_experts[a:b, layer])
               for i, (a, b) in spans.items() for layer in moe}

    def gaps(layers: list[int], r3: R3) -> dict[Key, float]:
        rows = [i for i in sorted(need) if any(differs[(i, layer)] for layer in layers)]
        if rows and not per_sample:
            rows = sorted(need)
        out = {key: run.gap0[key] for key in ch.keys}
        if not rows:
            return out
        start: dict[int, tuple[torch.Tensor, int]] = {}
        for ks, batch in layout.batches(forced, [(i, need[i]) for i in rows]):
            logprobs = backend.forward(batch, r3=r3).logprobs
            start.update({rows[k]: (logprobs, int(batch.offsets[j])) for j, k in enumerate(ks)})
        for r, t in ch.keys:
            if ch.sub_row[r] in start:
                logprobs, a = start[ch.sub_row[r]]
                out[(r, t)] = float(logprobs[a + t]) - ch.engine_lp[(r, t)]
        return out

    run.r3_gap = gaps(sorted(moe), True)
    for layer in sorted(moe):
        run.router_gap[layer] = gaps([layer], R3Scope(layers=(layer,)))


def _explain_token(state: PolicyState, ch: _Chosen, run: _TrainerRun, key: Key, moe: set[int]) -> TokenExplanation:
    """One chosen token's explanation from the trainer run: its per-component rows, the named cause,
    the logits at the predicting position and whether each path reproduces its recording."""
    r, t = key
    st, ctx = ch.st, ch.contexts[ch.of_token[key]]
    g0, a, p = run.gap0[key], int(st.off[r]), t - 1
    est, tst = ch.ep.states[ch.of_token[key]], run.states[ch.sub_row[r]]
    rows_out, norms = _layer_rows(state.backend.model_config, run, key, (est, tst), moe, ctx.end - 1)
    tid = int(st.ids[a + t])
    e_logit, t_logit = float(est[("logits", -1)][p, tid]), float(tst[("logits", -1)][p, tid])
    ulp = float(torch.finfo(est[("logits", -1)].dtype).eps) * 2.0 ** np.floor(np.log2(max(abs(t_logit), 1e-30)))
    engine_lp = ch.engine_lp[key]
    trainer_old = run.base.logprobs[int(ch.sub.offsets[ch.sub_row[r]]) + t]
    return TokenExplanation(
        sample_id=int(st.sids[r]), sample_row=r, token=t, turn=ctx.turn, position=t - ctx.start, token_id=tid,
        text=state.tokenizer.decode([tid]), rollout_logprob=float(st.rollout[a + t]), old_logprob=float(st.old[a + t]),
        engine_logprob=engine_lp, trainer_logprob=engine_lp + g0, gap=g0,
        engine_reproduces_rollout=bool(np.float32(engine_lp).view(np.uint32)
                                       == np.float32(st.rollout[a + t]).view(np.uint32)),
        trainer_reproduces_old=bool(np.float32(trainer_old).view(np.uint32)
                                    == np.float32(st.old[a + t]).view(np.uint32)),
        rows=rows_out, r3_gap=run.r3_gap[key], named=named_component(rows_out, g0), token_logit=[e_logit, t_logit],
        logit_ulp=ulp, removed_at=removed_at(rows_out, g0), flip=routing_flip(rows_out, g0, run.r3_gap[key]),
        hidden_norms=norms)


def _layer_rows(mcfg: ModelConfig, run: _TrainerRun, key: Key, paths: tuple[dict, dict], moe: set[int],
                end: int) -> tuple[list[LayerRow], dict[str, list[float]]]:
    """Per component in depth order, the engine/trainer divergence at the predicting position and the
    gap patching leaves right after it; and per hook point both paths' hidden-state norms there.
    `paths`: the engine's and the trainer's captured states; `end`: positions of the token's request."""
    est, tst = paths
    g0, p = run.gap0[key], key[1] - 1
    first = ("in", 0)
    emb_diff = _diff(est[first][p], tst[first][p])
    rows_out = [LayerRow("embedding", emb_diff[0], emb_diff[1], run.remaining[first][key],
                         _share(g0, g0, run.remaining[first][key]))]
    norms = {"in 0": [_norm(est[first][p]), _norm(tst[first][p])]}
    prev, prev_point = run.remaining[first][key], first
    for point in patch_points(mcfg.num_hidden_layers)[1:]:
        e_now, t_now = _state(est, point, p), _state(tst, point, p)
        if point[0] in ("mid", "out"):  # the component's own output: the residual update it made
            e_out, t_out = e_now - _state(est, prev_point, p), t_now - _state(tst, prev_point, p)
        else:
            e_out, t_out = e_now, t_now
        rel, mx = _diff(e_out, t_out)
        g = run.remaining[point][key]
        router = None
        if point[0] == "out" and point[1] in moe:
            router = _router(est, tst, point[1], p, end, mcfg.num_experts_per_tok)
            router["r3_layer_gap"] = run.router_gap[point[1]][key]
        rows_out.append(LayerRow(component_name(point, moe), rel, mx, g, _share(g0, prev, g), router))
        norms[f"{point[0]} {point[1]}" if point[1] >= 0 else point[0]] = [_norm(e_now), _norm(t_now)]
        prev, prev_point = g, point
    return rows_out, norms


def _same_states(engine: torch.Tensor, trainer: torch.Tensor | None) -> bool:
    """Whether the engine's rows (NaN where it computed none: those are not patched) equal the trainer's."""
    if trainer is None:
        return False
    have = torch.isfinite(engine.float()).all(-1)
    t = trainer[:engine.shape[0]]
    return bool(torch.equal(engine[have], t[have].to(engine.dtype))) if t.dtype == engine.dtype else False


def _state(states: dict, point: tuple[str, int], p: int) -> torch.Tensor:
    return states[point][p].float()


def _norm(x: torch.Tensor) -> float:
    return float(x.float().norm())


def _diff(e: torch.Tensor, t: torch.Tensor) -> tuple[float, float]:
    e, t = e.double(), t.double()
    d = e - t
    denom = float(t.norm())
    return (float(d.norm()) / denom if denom > 0 else float(d.norm())), float(d.abs().max())


def _share(g0: float, before: float, after: float) -> float:
    return 0.0 if g0 == 0 else (before - after) / g0


def _router(est: dict, tst: dict, layer: int, p: int, end: int, k: int) -> dict[str, Any]:
    """Both paths' router decisions at the predicting position `p` and how many positions of the
    request (0..end−1) picked a different expert set."""
    e_logits, t_logits = est[("router", layer)][:end].float(), tst[("router", layer)][:end].float()
    e_probs, t_probs = torch.softmax(e_logits, -1), torch.softmax(t_logits, -1)
    e_top, t_top = torch.topk(e_probs, k + 1, dim=-1), torch.topk(t_probs, k + 1, dim=-1)
    e_sets = [set(row[:k].tolist()) for row in e_top.indices]
    t_sets = [set(row[:k].tolist()) for row in t_top.indices]
    flips = [i for i in range(end) if e_sets[i] != t_sets[i]]
    return {"engine_experts": sorted(e_sets[p]), "trainer_experts": sorted(t_sets[p]), "flip": e_sets[p] != t_sets[p],
            "engine_margin": float(e_top.values[p, k - 1] - e_top.values[p, k]),
            "trainer_margin": float(t_top.values[p, k - 1] - t_top.values[p, k]),
            "max_abs_logit_diff": float((e_logits[p] - t_logits[p]).abs().max()),
            "flipped_positions": flips}
