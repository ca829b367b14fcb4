"""Bisect: the first layer and operation where the engine's and the trainer's computations part.

    result = bisect_step("runs/walk", 4, sample=12)
    print(result.first)          # PointDiff(layer=1, op="expert_out", over=[7, 9], ...) or None

For one recorded sample of a step, both computations of its tokens are captured at every probe
point of `axrl.model.probe_points` (replay/bisect_capture.py: the embedded engine's teacher-forced
prefill and KV-cache decode in the batches it ran, the trainer's forward of the micro-batch as
trained, routing replayed as recorded), and again in float64. The points are walked in forward
order; the first (layer, op) with a position whose difference exceeds that op's numerics floor
(replay/bisect_compare.py: each side's own rounding there, measured against its float64 run) is
the first divergence. Reported with it: the positions (token indices of the sample) where it
appears, its size and floor, how the difference grows at every later point, whether routing
diverged in that layer (ids, slot order and weights separately) and, at the sample's predicting
positions, a full-vocabulary comparison of the two distributions.

Imports `axrl` only, never `axrl_debug`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from axrl.assembly.build import make_engine_model
from axrl.assembly.settings import routing_replay
from axrl.model.probe_points import forward_order
from axrl.trace import StepFile
from replay.bisect_capture import (ENGINE_HOW, CacheFactory, engine_cache, engine_side, sample_contexts,
                                   trainer64_side, trainer_how, trainer_side, unquantised)
from replay.bisect_compare import PointDiff, Sides, agreeing_slots, compare_float, compare_ids, vocab_compare
from replay.bisect_sglang import (FLOOR_HOW, SGLANG_HOW, dump_server_args, new_dump_dir, rewrite_weights,
                                   sglang_side)
from replay.bisect_vllm import VLLM_HOW, vllm_side
from replay.bisect_vllm import server_args as vllm_args
from replay.bisect_vllm import server_environment as vllm_environment
from replay.engine_path import contexts_of, run_engine_path
from replay.plan import ReplayInputError
from replay.policy import PolicyState, policy_before
from replay.recorded import require_full
from replay.rollout import clock_schedule, engine_prefix_cache, rolled_out
from replay.server_rescore import PYTHON_ENV, ServerOptions, model_dir_for, scoring_server

Progress = Callable[[str], None]
WeightsHook = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class BisectResult:
    """What `bisect_step` found (see the module doc); `to_json` is `axrl-debug bisect --json`."""

    run: str
    step: int
    sample_id: int
    engine: str
    r3: bool
    points: list[PointDiff]                  # every point compared, in forward order
    first: PointDiff | None                  # the first one over its floor
    routing: dict[str, Any] | None           # routing at the first divergence's layer (MoE layers)
    vocab: list[dict[str, Any]]              # full-vocabulary comparison per predicting position
    how: dict[str, str]                      # how each side's value of each point was obtained
    generated: list[int] = field(default_factory=list)       # the sample's generated positions
    fidelity: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def first_divergence(self) -> dict[str, Any] | None:
        """`{layer, op, tokens, size, floor}` of the first divergence, or None."""
        f = self.first
        if f is None:
            return None
        out = {"layer": f.layer, "op": f.op, "tokens": f.over, "size": f.size, "floor": f.floor}
        if f.experts:
            out["experts"] = f.experts
        return out

    def growth(self) -> list[PointDiff]:
        """The points after the first divergence (how the difference grows)."""
        if self.first is None:
            return []
        return self.points[self.points.index(self.first) + 1:]

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "sample": self.sample_id, "engine": self.engine, "r3": self.r3,
                "first_divergence": self.first_divergence(), "routing": self.routing,
                "points": [p.to_json() for p in self.points], "vocab": self.vocab, "how": self.how,
                "generated": self.generated, "fidelity": self.fidelity, "notes": self.notes, "timings": self.timings}


def bisect_step(run_dir: str | Path, step: int, *, sample: int | None = None, engine: str = "embedded",
                engine_weights: WeightsHook | None = None, engine_kv: CacheFactory | None = None,
                server: ServerOptions | None = None, progress: Progress | None = None) -> BisectResult:
    """Bisect sample `sample` (a sample id; default: the one with the largest |old − rollout|
    logprob gap) of recorded step `step`. `engine_weights` transforms the engine's copy of the
    weights and `engine_kv` builds its KV caches (what-ifs; tests plant causes with them).
    `engine="sglang"` launches an SGLang server (`server.python`) with its tensor dump on
    (replay/bisect_sglang.py). Raises ReplayInputError on bad input."""
    if engine not in ("embedded", "sglang", "vllm"):
        raise ReplayInputError(f"--engine {engine}: one of embedded, sglang, vllm")
    if engine != "embedded" and (server is None or not server.python or server.url):
        raise ReplayInputError(f"--engine {engine}: bisect launches its own {engine} server (its capture is set up at "
                               f"launch): give the {engine} environment's interpreter (--engine-python or "
                               f"{PYTHON_ENV[engine]}); --url is not accepted")
    if engine != "embedded" and not Path(server.python).is_file():
        raise ReplayInputError(f"--engine-python {server.python}: no such interpreter (build the {engine} environment "
                               f"with scripts/{engine}-cpu-env.sh DIR)")
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    state = policy_before(run_dir, step, progress=say)
    try:
        if engine != "embedded":
            return _bisect_server(engine, state, step, sample, server, engine_weights, say, t0)
        return _bisect(state, step, sample, engine_weights, engine_kv, say, t0)
    finally:
        state.close()
        torch.set_num_threads(threads)


def _pick_sample(path: Path, sample: int | None) -> tuple[int, int]:
    """(row, sample id): the given sample id's row, or the row of the largest analysed gap."""
    with StepFile(path) as sf:
        require_full(sf, path)
        sids = sf["/samples/sample_id"].astype(np.int64)
        off = sf["/samples/offsets"].astype(np.int64)
        rollout, old, mask = sf["/tokens/rollout_logprob"], sf["/tokens/old_logprob"], sf["/tokens/loss_mask"]
    if sample is not None:
        rows = np.flatnonzero(sids == sample)
        if rows.size == 0:
            raise ReplayInputError(f"--sample {sample}: not a sample of this step (sample ids "
                                   f"{int(sids.min())}..{int(sids.max())})")
        return int(rows[0]), int(sample)
    ok = (mask > 0) & np.isfinite(rollout) & np.isfinite(old)
    gap = np.where(ok, np.abs(old.astype(np.float64) - rollout.astype(np.float64)), -1.0)
    row = int(np.searchsorted(off, int(np.argmax(gap)), side="right") - 1)
    return row, int(sids[row])


def _bisect(state: PolicyState, step: int, sample: int | None, hook: WeightsHook | None,
            kv: CacheFactory | None, say: Progress, t0: float) -> BisectResult:
    cfg, backend = state.cfg, state.backend
    mcfg = backend.model_config
    path = state.inventory.files[step]
    row, sid = _pick_sample(path, sample)
    rec = state.recorded(step)
    timings = {"rebuild_seconds": time.perf_counter() - t0}
    with StepFile(path) as sf:
        ro = rolled_out(sf)
    contexts = contexts_of(ro.off, ro.ids, ro.turn, np.isfinite(ro.rollout_logprob))
    mine = sample_contexts(contexts, row)
    if not mine:
        raise ReplayInputError(f"--sample {sid}: the engine generated no token of it at step {step}")
    weights = {k: v.detach().clone() for k, v in backend.named_weights()}
    weights = hook(weights) if hook else weights
    t1 = time.perf_counter()
    say(f"engine path: {len(contexts)} request(s) of step {step} as batched, capturing sample {sid}")
    e32, e_ref, e64, ep = _engine_sides(cfg, mcfg, weights, contexts, mine, ro, kv)
    t2 = time.perf_counter()
    say("trainer path: the micro-batch as trained, then the sample alone in float64")
    r3 = routing_replay(cfg)
    t32 = trainer_side(backend, rec.batch, row, cfg.train.micro_batch_tokens, r3)
    t64 = trainer64_side(backend, rec.batch, row, r3)
    t3 = time.perf_counter()
    sides = Sides(e32, t32, e_ref, e64, t64)
    moe = {i for i in range(mcfg.num_hidden_layers) if mcfg.is_moe_layer(i)}
    points = walk(sides, mcfg.num_hidden_layers, moe)
    first = next((p for p in points if p.diverged), None)
    ids = rec.batch.input_ids.numpy()[int(rec.batch.offsets[row]):int(rec.batch.offsets[row + 1])]
    generated = sorted({p for c in mine for p in contexts[c].generated})
    vocab = vocab_compare(sides, ids)
    timings.update({"engine_seconds": t2 - t1, "trainer_seconds": t3 - t2,
                    "compare_seconds": time.perf_counter() - t3, "total_seconds": time.perf_counter() - t0})
    result = BisectResult(
        run=str(state.inventory.run), step=step, sample_id=sid, engine="embedded", r3=bool(r3), points=points,
        first=first, routing=routing_at(points, first.layer) if first is not None and first.layer in moe else None,
        vocab=vocab, how={"engine": ENGINE_HOW, "trainer": trainer_how(backend)},
        generated=generated, notes=list(state.notes), timings=timings)
    result.fidelity = _fidelity(ep, ro)
    f = result.fidelity["engine_path_vs_rollout_logprob"]
    if f["bitwise_equal"] < f["tokens"]:
        result.notes.append(f"the engine path reproduces {f['bitwise_equal']} of {f['tokens']} rollout logprobs bit "
                            f"for bit (max |diff| {f['max_abs_diff']:.3g}): the engine side is a re-computation, not "
                            "exactly the rollout (an asynchronous run, or a schedule replay cannot mirror)")
    return result


def _engine_sides(cfg, mcfg, weights: dict[str, torch.Tensor], contexts: list, mine: list[int], ro,
                  kv: CacheFactory | None) -> tuple:
    """The engine as it ran (every request of the step, the sample's captured), and its references:
    the sample alone with K/V and activations unquantised (storage precision is then a divergence,
    not a floor) in float64 and, when the run rounds them, in fp32 too (else the run itself)."""
    temperature = float(cfg.rollout.temperature)
    r = cfg.rollout
    with engine_cache(kv):
        model = make_engine_model(cfg, mcfg, weights)
        ep = run_engine_path(model, contexts, temperature=temperature, max_seq_len=r.max_context_len,
                             max_batch_size=r.max_batch_size, capture=set(mine),
                             schedule=clock_schedule(cfg, ro.sids, ro.gids), prefix_cache=engine_prefix_cache(cfg),
                             kv_dtype=r.kv_dtype)
    e32 = engine_side("engine", model, ep, mine, temperature)
    rounded = kv is not None or r.kv_dtype != "auto" or r.precision == "fp8_w8a8"
    refs = {"engine64": torch.float64, **({"engine_ref": torch.float32} if rounded else {})}
    sides = {}
    for name, dtype in refs.items():
        ref_model = unquantised(make_engine_model(cfg, mcfg, weights)).to(dtype)
        ref_ep = run_engine_path(ref_model, [contexts[i] for i in mine], temperature=temperature,
                                 max_seq_len=r.max_context_len, max_batch_size=r.max_batch_size, capture=True)
        sides[name] = engine_side(name, ref_model, ref_ep, list(range(len(mine))), temperature)
    return e32, sides.get("engine_ref", e32), sides["engine64"], ep


def _bisect_server(engine: str, state: PolicyState, step: int, sample: int | None, opts: ServerOptions,
                   hook: WeightsHook | None, say: Progress, t0: float) -> BisectResult:
    """The sample's tokens on a dedicated SGLang / vLLM server with its capture on (one
    teacher-forced prefill) vs the trainer's micro-batch as trained; floors from the trainer's own
    rounding (a server cannot run float64)."""
    cfg, backend = state.cfg, state.backend
    mcfg = backend.model_config
    row, sid = _pick_sample(state.inventory.files[step], sample)
    rec = state.recorded(step)
    timings = {"rebuild_seconds": time.perf_counter() - t0}
    a, b = int(rec.batch.offsets[row]), int(rec.batch.offsets[row + 1])
    ids = rec.batch.input_ids.numpy()[a:b]
    weights = {k: v.detach().clone() for k, v in backend.named_weights()}
    model_dir = model_dir_for(state.inventory.run, step)
    say(f"exporting the policy of step {step} to {model_dir}")
    backend.export_hf(model_dir)
    if hook is not None:
        rewrite_weights(model_dir, hook)
    served = hook(weights) if hook else weights
    dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    temperature = float(cfg.rollout.temperature)
    t1 = time.perf_counter()
    with new_dump_dir(state.inventory.run, step, engine) as work:
        extra = dump_server_args(Path(work)) if engine == "sglang" else vllm_args()
        launch = ServerOptions(python=opts.python, cpu_compat=opts.cpu_compat, log_dir=opts.log_dir,
                               startup_timeout_s=opts.startup_timeout_s, server_args=[*opts.server_args, *extra])
        env = vllm_environment() if engine == "vllm" else contextlib.nullcontext()
        with env, scoring_server(engine, launch, model_dir, cfg, dtype, say) as (url, _):
            t_up = time.perf_counter()
            capture = sglang_side if engine == "sglang" else vllm_side
            side = capture(url, Path(work), [int(t) for t in ids], served, mcfg, temperature, say)
            t_cap = time.perf_counter()
    t2 = time.perf_counter()
    say("trainer path: the micro-batch as trained, then the sample alone in float64")
    r3 = routing_replay(cfg)
    t32 = trainer_side(backend, rec.batch, row, cfg.train.micro_batch_tokens, r3)
    t64 = trainer64_side(backend, rec.batch, row, r3)
    t3 = time.perf_counter()
    sides = Sides(side, t32, t32, t64, t64)   # the server's rounding is not measurable: the trainer's twice
    moe = {i for i in range(mcfg.num_hidden_layers) if mcfg.is_moe_layer(i)}
    points = walk(sides, mcfg.num_hidden_layers, moe)
    first = next((p for p in points if p.diverged), None)
    timings.update({"server_start_seconds": t_up - t1, "capture_seconds": t_cap - t_up, "engine_seconds": t2 - t1,
                    "trainer_seconds": t3 - t2, "compare_seconds": time.perf_counter() - t3,
                    "total_seconds": time.perf_counter() - t0})
    generated = np.flatnonzero(rec.batch.loss_mask.numpy()[a:b] > 0).tolist()
    notes = [*state.notes, FLOOR_HOW.replace("SGLang", engine), f"the {engine} side is one teacher-forced prefill "
             "of the whole stream, not the engine's decode path (KV cache, one token at a time): a decode-only "
             "cause does not show here"]
    return BisectResult(
        run=str(state.inventory.run), step=step, sample_id=sid, engine=engine, r3=bool(r3), points=points,
        first=first, routing=routing_at(points, first.layer) if first is not None and first.layer in moe else None,
        vocab=vocab_compare(sides, ids), how={"engine": SGLANG_HOW if engine == "sglang" else VLLM_HOW,
                                              "trainer": trainer_how(backend)},
        generated=generated, notes=notes, timings=timings)

def walk(sides: Sides, num_layers: int, moe: set[int]) -> list[PointDiff]:
    """Every probe point's comparison, in forward order (points neither side has are left out)."""
    out = []
    for layer, op in forward_order(num_layers, moe):
        if op == "topk_ids":
            diff = compare_ids(layer, sides)
        elif op in ("topk_weights", "expert_out"):
            diff = compare_float(layer, op, sides, mask=agreeing_slots(layer, sides), per_slot=op == "expert_out")
        else:
            diff = compare_float(layer, op, sides)
        if diff is not None:
            out.append(diff)
    return out


def routing_at(points: list[PointDiff], layer: int) -> dict[str, Any]:
    """Whether routing diverged in `layer`: expert sets, slot order and weights, separately."""
    ids = next((p for p in points if p.layer == layer and p.op == "topk_ids"), None)
    w = next((p for p in points if p.layer == layer and p.op == "topk_weights"), None)
    return {"layer": layer,
            "ids_differ": ids.detail.get("set_differs", []) if ids else None,
            "slot_order_differs": ids.detail.get("slot_order_differs", []) if ids else None,
            "rounding_flips": ids.detail.get("rounding_flips", []) if ids else None,
            "weights_over_floor": w.over if w else None}


def _fidelity(ep, ro) -> dict[str, Any]:
    """Whether the engine path reproduces the recorded rollout logprobs (bit for bit on synchronous
    deterministic runs): the engine side is then the computation the run really made."""
    return {"engine_path_vs_rollout_logprob": ep.fidelity(ro.rollout_logprob, ro.off)}
