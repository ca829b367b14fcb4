"""Rollout replay: re-run a recorded step's rollout on the embedded engine and compare it bit for bit.

    result = replay_rollout("runs/demo", 4)
    result.verdict            # "bitwise-equal" | "diverged"
    result.first_divergence   # RolloutDivergence(step, sample_id, turn, token, field, recorded, replayed)

How (deterministic runs, `rollout.engine: embedded`): the policy of the step is rebuilt as training
replay rebuilds it (replay/policy.py), the engine, rollout worker, pool and weight sync are built by
the factories `axrl train` uses (`axrl.runtime.components`), and the worker produces the batch again
with the recorded prompts (the data stream's positions), seeds (derived from the sample ids) and,
since the schedule is a function of counts, the same engine batch composition. A synchronous step's
rollout starts from an empty engine holding version N, so it is re-run alone. An asynchronous step's
engine batches mix episodes of neighbouring steps, so the rollout is re-run from step 0, the driver
standing in for the trainer: it re-executes each recorded step's updates (checked against the trace)
and posts version w + 1 as the loop would, and the worker loads it when its schedule says.

Every sample's token ids, rollout logprobs (float32 bits), per-token policy versions and routing rows
are compared with the trace; the first divergence is reported by (step, sample id, token), with the
turn and the position in its response. At token t the routing of row t − 1 (the position that
predicted t) is compared, so a planted change at input position p shows at token p + 1.

Runs that cannot be replayed bitwise (free-running schedules, SGLang engines) get a
`ReplayInputError` saying why and naming the nearest check: `teacher_forced_check` re-runs the
recorded token streams through the embedded engine's decode path (replay/engine_path.py) and sets its
logprobs beside the recorded engine's and the trainer's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from axrl.config import Config
from axrl.assembly.build import make_data, make_embedded_engine, make_engine_model, make_rollout
from axrl.assembly.settings import rollout_clock
from axrl.core.trajectory import Trajectory
from axrl.inference.embedded.prefix_cache import DEFAULT_BLOCK_SIZE, pool_tokens
from axrl.trace import StepFile
from replay.compare import Divergence
from replay.engine_path import ClockSchedule, contexts_of, run_engine_path
from replay.plan import ReplayInputError
from replay.policy import PolicyState, load_run_config, policy_before
from replay.recorded import require_full

Progress = Callable[[str], None]
WeightsHook = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

NEAREST_CHECK = ("the nearest check is `axrl-debug replay RUN --step N --rollout --engine embedded`: it re-runs "
                 "the recorded token streams through the embedded engine's decode path (teacher-forced) and "
                 "compares its logprobs with the recorded ones and the trainer's")


@dataclass
class RolloutDivergence:
    step: int
    sample_id: int
    turn: int | None
    token: int                # index in the sample's token stream
    position: int | None      # position in its turn's response (0 = first generated token)
    field: str                # token_id | rollout_logprob | policy_version | routing | length | samples
    recorded: Any
    replayed: Any

    def describe(self) -> str:
        where = f"step {self.step}, sample {self.sample_id}"
        if self.field != "samples":
            where += f", token {self.token}"
            if self.turn is not None:
                where += f" (turn {self.turn}" + (f", response position {self.position})" if self.position is not None
                                                  else ")")
        return f"{where}: {self.field} recorded {self.recorded} vs replayed {self.replayed}"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sample_id": self.sample_id, "turn": self.turn, "token": self.token,
                "position": self.position, "field": self.field, "recorded": _plain(self.recorded),
                "replayed": _plain(self.replayed)}


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    return v.item() if hasattr(v, "item") else v


@dataclass
class StepComparison:
    step: int
    samples: int
    tokens: int
    differing_samples: list[int]
    first: RolloutDivergence | None

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples": self.samples, "tokens": self.tokens,
                "differing_samples": self.differing_samples, "bitwise_equal": self.first is None,
                "first_divergence": None if self.first is None else self.first.to_dict()}


@dataclass
class RolloutReplayResult:
    run: Path
    step: int
    mode: str                              # sync | async
    checkpoint_step: int
    steps: list[StepComparison]
    train_mismatches: list[Divergence]     # while re-executing the training of the steps in between
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> RolloutDivergence | None:
        return next((s.first for s in self.steps if s.first is not None), None)

    @property
    def verdict(self) -> str:
        return "bitwise-equal" if self.first_divergence is None and not self.train_mismatches else "diverged"

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"run": str(self.run), "step": self.step, "kind": "rollout", "mode": self.mode,
                "verdict": self.verdict, "first_divergence": None if first is None else first.to_dict(),
                "checkpoint_step": self.checkpoint_step, "steps": [s.to_dict() for s in self.steps],
                "train_mismatches": [m.to_dict() for m in self.train_mismatches], "seconds": self.seconds,
                "notes": self.notes}


# ------------------------------------------------------------------------------------------ checks
def replayability(cfg: Config) -> str | None:
    """Why a run's rollouts cannot be re-run bit for bit (None: they can)."""
    if cfg.rollout.engine != "embedded":
        return (f"rollout.engine={cfg.rollout.engine}: the server schedules its own batches and its kernels are not "
                "reproducible here, so its rollouts cannot be re-run bit for bit")
    if not cfg.runtime.deterministic:
        return ("runtime.deterministic: false: the engine ran free, so which requests shared a decode batch depended "
                "on thread timing (batch composition changes the last bits of every logprob, and so sampled tokens)")
    if rollout_clock(cfg) != "iterations":
        return (f"rollout.clock={cfg.rollout.clock}: requests were clocked by rounds, not engine iterations; "
                "rollout replay re-runs the iteration-clocked schedule only")
    return None


def clock_schedule(cfg: Config, sample_ids: np.ndarray, group_ids: np.ndarray) -> ClockSchedule | None:
    """The engine-clock schedule of a step's rollout, for the teacher-forced engine path: only for a
    synchronous run that rollout replay could re-run bitwise (its step is a rollout of its own)."""
    if cfg.runtime.mode != "sync" or replayability(cfg) is not None:
        return None
    order = np.lexsort((sample_ids, group_ids))
    groups: dict[int, list[int]] = {}
    for r in order:
        groups.setdefault(int(group_ids[r]), []).append(int(r))
    r = cfg.rollout
    return ClockSchedule(groups=[groups[g] for g in sorted(groups)], sample_ids=[int(s) for s in sample_ids],
                         group_size=r.group_size, max_live_episodes=r.max_live_episodes or r.max_batch_size)


def engine_prefix_cache(cfg: Config) -> tuple[int, int] | None:
    """The run's embedded-engine prefix cache as the engine built it (pool tokens, block size), for
    the teacher-forced engine path to mirror; None when the run had none (an SGLang run's server
    keeps its own radix cache)."""
    r = cfg.rollout
    if r.engine != "embedded" or not r.prefix_cache:
        return None
    return pool_tokens(r.prefix_cache_tokens, r.max_batch_size, r.max_context_len), DEFAULT_BLOCK_SIZE


# ------------------------------------------------------------------------------------------ replay
def replay_rollout(run_dir: str | Path, step: int, *, engine_weights: WeightsHook | None = None,
                   progress: Progress | None = None) -> RolloutReplayResult:
    """Re-run step `step`'s rollout and compare it with the trace (see the module doc).
    `engine_weights` transforms the weights every time they are loaded into the engine (tests plant
    a divergence with it). Raises ReplayInputError when the run cannot be replayed bitwise."""
    say = progress or (lambda msg: None)
    inv, cfg = load_run_config(run_dir)
    inv.plan(step)  # the step exists and is readable
    why = replayability(cfg)
    if why is not None:
        raise ReplayInputError(f"step {step}'s rollout cannot be replayed bit for bit: {why}; {NEAREST_CHECK}")
    start = step if cfg.runtime.mode == "sync" else 0
    threads_before = torch.get_num_threads()
    t0 = time.perf_counter()
    state = policy_before(run_dir, step, start_at=start, progress=say)
    try:
        return _replay(state, cfg, step, start, engine_weights, say, t0)
    finally:
        state.close()
        torch.set_num_threads(threads_before)


def _replay(state: PolicyState, cfg: Config, step: int, start: int, hook: WeightsHook | None, say: Progress,
            t0: float) -> RolloutReplayResult:
    backend, tokenizer = state.backend, state.tokenizer
    weights = lambda: (hook or (lambda w: w))({k: v.detach().clone() for k, v in backend.named_weights()})  # noqa: E731
    task, loader = make_data(cfg)
    engine = make_embedded_engine(cfg, backend, tokenizer, clocked=True)
    engine.update_weights(weights(), version=start)
    rollout, sync, pool = make_rollout(cfg, tokenizer, task, loader, engine, backend.model_config)
    steps: list[StepComparison] = []
    train_mismatches: list[Divergence] = []
    notes = list(state.notes)
    noise = cfg.faults.rollout_logprob_noise
    try:
        rollout.start(start)
        for w in range(start, step + 1):
            say(f"re-running the rollout of step {w}")
            batch = pool.take(w)
            ignore_logprobs = noise is not None and noise.step == w
            if ignore_logprobs:
                notes.append(f"step {w}: faults.rollout_logprob_noise added noise to the recorded rollout logprobs; "
                             "they are not compared")
            steps.append(compare_batch(state.inventory.files[w], w, batch.trajectories,
                                       compare_logprobs=not ignore_logprobs,
                                       dynamic_sampling=cfg.algo.dynamic_sampling.enabled))
            if w < step:
                say(f"re-executing the training of step {w} to post version {w + 1}")
                train_mismatches += state.advance()
                sync.post(w + 1, weights())
    finally:
        rollout.stop()
        engine.shutdown()
    return RolloutReplayResult(state.inventory.run, step, cfg.runtime.mode, state.checkpoint_step, steps,
                               train_mismatches, time.perf_counter() - t0, notes)


@dataclass
class RolledOut:
    """Every sample a step rolled out, as recorded: the trained ones (/samples, rows [0, trained))
    followed by those dynamic sampling dropped (/pool/samples), in one CSR over their tokens."""

    off: np.ndarray          # int64 [N+1]
    sids: np.ndarray         # int64 [N]
    gids: np.ndarray         # int64 [N]
    ids: np.ndarray
    turn: np.ndarray
    rollout_logprob: np.ndarray
    policy_version: np.ndarray
    routing: np.ndarray | None   # [T, L, k] engine routing, None when a part lacks it
    trained: int             # rows [0, trained) are /samples; the rest /pool/samples
    has_pool_samples: bool


def rolled_out(sf: StepFile) -> RolledOut:
    """The step's rolled-out samples from an open step file (see `RolledOut`)."""
    off = sf["/samples/offsets"].astype(np.int64)
    parts = [(off, sf["/samples/sample_id"], sf["/samples/group_id"], sf["/tokens/ids"], sf["/tokens/turn"],
              sf["/tokens/rollout_logprob"], sf["/tokens/policy_version"], sf.get("/routing/rollout"))]
    pool = "/pool/samples/offsets" in sf
    if pool:
        parts.append((sf["/pool/samples/offsets"].astype(np.int64), sf["/pool/samples/sample_id"],
                      sf["/pool/samples/group_id"], sf["/pool/tokens/ids"], sf["/pool/tokens/turn"],
                      sf["/pool/tokens/rollout_logprob"], sf["/pool/tokens/policy_version"],
                      sf.get("/pool/routing/rollout")))
    offs = [parts[0][0]] + [p[0][1:] + int(parts[0][0][-1]) for p in parts[1:]]
    cat = lambda i: np.concatenate([np.asarray(p[i]) for p in parts])  # noqa: E731
    routing = None if any(p[7] is None for p in parts) else cat(7)
    return RolledOut(np.concatenate(offs), cat(1).astype(np.int64), cat(2).astype(np.int64), cat(3), cat(4), cat(5),
                     cat(6), routing, len(off) - 1, pool)


def compare_batch(path: Path, step: int, trajectories: list[Trajectory], *, compare_logprobs: bool = True,
                  dynamic_sampling: bool = False) -> StepComparison:
    """Compare re-generated trajectories with the step file, sample by sample (by sample id): the
    trained samples and those dynamic sampling dropped (/pool/samples). A re-generated sample the
    file does not hold is a divergence too — except, with `dynamic_sampling`, in a step file
    without /pool/samples (written before the dropped samples were recorded)."""
    with StepFile(path) as sf:
        require_full(sf, path)
        ro = rolled_out(sf)
    off, sids, ids, turn, lp, ver, routing = (ro.off, ro.sids, ro.ids, ro.turn, ro.rollout_logprob,
                                              ro.policy_version, ro.routing)
    replayed = {t.sample_id: t for t in trajectories}
    differing: list[int] = []
    first: RolloutDivergence | None = None
    missing = [int(s) for s in sids if int(s) not in replayed]
    if missing:
        first = RolloutDivergence(step, missing[0], None, 0, None, "samples",
                                  f"{len(sids)} samples", f"sample {missing[0]} was not re-generated")
        differing += missing
    known = set(sids.tolist())
    extra = [s for s in sorted(replayed) if s not in known]
    if extra and not (dynamic_sampling and not ro.has_pool_samples):
        first = first or RolloutDivergence(step, extra[0], None, 0, None, "samples", f"{len(sids)} samples",
                                           f"sample {extra[0]} was re-generated but is not in the step file")
        differing += extra
    for r in np.argsort(sids, kind="stable"):
        sid = int(sids[r])
        traj = replayed.get(sid)
        if traj is None:
            continue
        a, b = int(off[r]), int(off[r + 1])
        d = _first_in_sample(step, sid, ids[a:b], turn[a:b], lp[a:b], ver[a:b],
                             None if routing is None else routing[a:b], traj, compare_logprobs)
        if d is not None:
            differing.append(sid)
            first = first or d
    return StepComparison(step, len(sids), int(off[-1]), differing, first)


def _first_in_sample(step: int, sid: int, ids: np.ndarray, turn: np.ndarray, lp: np.ndarray, ver: np.ndarray,
                     routing: np.ndarray | None, traj: Trajectory, compare_logprobs: bool) -> RolloutDivergence | None:
    n = min(len(ids), traj.num_tokens)
    gen = np.isfinite(lp)
    t_ids, t_lp = traj.token_ids, np.asarray(traj.rollout_logprob, np.float32)
    t_route = traj.routed_experts

    def at(t: int, name: str, rec: Any, rep: Any) -> RolloutDivergence:
        k = int(turn[t]) if t < len(turn) else None
        turn_gen = np.flatnonzero(gen & (turn == k)) if k is not None else np.zeros(0, int)
        pos = int(t - turn_gen[0]) if gen[t] and turn_gen.size else None
        return RolloutDivergence(step, sid, k, t, pos, name, rec, rep)

    for t in range(n):
        if t >= 1 and routing is not None and t_route is not None and not np.array_equal(
                routing[t - 1].astype(np.int64), np.asarray(t_route[t - 1], np.int64)):
            return at(t, "routing", routing[t - 1], t_route[t - 1])
        if int(ids[t]) != int(t_ids[t]):
            return at(t, "token_id", int(ids[t]), int(t_ids[t]))
        if compare_logprobs and not _same_f32(lp[t], t_lp[t]):
            return at(t, "rollout_logprob", float(lp[t]), float(t_lp[t]))
        if int(ver[t]) != int(traj.policy_version[t]):
            return at(t, "policy_version", int(ver[t]), int(traj.policy_version[t]))
    if len(ids) != traj.num_tokens:
        return at(n - 1, "length", len(ids), traj.num_tokens)
    return None


def _same_f32(a: Any, b: Any) -> bool:
    a, b = np.float32(a), np.float32(b)
    if np.isnan(a) and np.isnan(b):
        return True
    return a.view(np.uint32) == b.view(np.uint32)


# ------------------------------------------------------------------------------------------ teacher-forced
@dataclass
class TeacherForcedResult:
    run: Path
    step: int
    engine: str                      # the run's engine (sglang | embedded)
    tokens: int
    summary: dict[str, float]        # mean / max |·| of the three differences
    verdict: str                     # whose mismatch it is, in one sentence
    fidelity: dict[str, float]
    rows: list[dict[str, Any]]       # the worst tokens by |trainer − recorded|
    train_mismatches: list[Divergence]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"run": str(self.run), "step": self.step, "kind": "teacher-forced", "engine": self.engine,
                "tokens": self.tokens, "summary": self.summary, "verdict": self.verdict, "fidelity": self.fidelity,
                "worst_tokens": self.rows, "train_mismatches": [m.to_dict() for m in self.train_mismatches],
                "seconds": self.seconds}


def teacher_forced_check(run_dir: str | Path, step: int, *, top: int = 10,
                         progress: Progress | None = None) -> TeacherForcedResult:
    """Re-run step `step`'s recorded token streams through the embedded engine's decode path under the
    policy of the step and set its logprobs beside the recorded engine's (`rollout_logprob`, e.g.
    SGLang's) and the trainer's (`old_logprob`): is the mismatch the engine's or the trainer's?
    Tokens generated by an older version (asynchronous runs) are left out: the trainer's old
    logprob is under another policy than the one that generated them."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    threads_before = torch.get_num_threads()
    state = policy_before(run_dir, step, progress=say)
    try:
        cfg = state.cfg
        with StepFile(state.inventory.files[step]) as sf:
            # the samples dynamic sampling dropped ran in the engine batches too: the clock schedule
            # replays them (rows past the trained ones; they have no trainer logprob)
            ro = rolled_out(sf)
            old_trained = sf["/tokens/old_logprob"]
        off, ids, turn, rec, ver, sids, gids = (ro.off, ro.ids, ro.turn, ro.rollout_logprob, ro.policy_version,
                                                ro.sids, ro.gids)
        old = np.full(len(ids), np.nan, np.float32)
        old[:len(old_trained)] = old_trained
        generated = np.isfinite(rec) & (ver == step)
        contexts = contexts_of(off, ids, turn, generated)
        model = make_engine_model(cfg, state.backend.model_config, dict(state.backend.named_weights()))
        say(f"teacher-forcing {len(contexts)} request(s) through the embedded engine's decode path")
        path = run_engine_path(model, contexts, temperature=cfg.rollout.temperature,
                               max_seq_len=cfg.rollout.max_context_len, max_batch_size=cfg.rollout.max_batch_size,
                               schedule=clock_schedule(cfg, sids, gids), prefix_cache=engine_prefix_cache(cfg),
                               kv_dtype=cfg.rollout.kv_dtype)
        emb = np.full(len(ids), np.nan, np.float32)
        for c, lp in zip(contexts, path.logprob):
            a = int(off[c.sample])
            emb[a + c.start:a + c.end] = lp[c.start:c.end]
        mask = generated & np.isfinite(emb) & np.isfinite(old)
        e, r, o = emb[mask].astype(np.float64), rec[mask].astype(np.float64), old[mask].astype(np.float64)
        summary = {"mean_abs_embedded_vs_recorded": float(np.mean(np.abs(e - r))) if mask.any() else 0.0,
                   "mean_abs_trainer_vs_embedded": float(np.mean(np.abs(o - e))) if mask.any() else 0.0,
                   "mean_abs_trainer_vs_recorded": float(np.mean(np.abs(o - r))) if mask.any() else 0.0,
                   "max_abs_embedded_vs_recorded": float(np.max(np.abs(e - r))) if mask.any() else 0.0,
                   "max_abs_trainer_vs_embedded": float(np.max(np.abs(o - e))) if mask.any() else 0.0,
                   "max_abs_trainer_vs_recorded": float(np.max(np.abs(o - r))) if mask.any() else 0.0}
        where = np.flatnonzero(mask)
        sample_of = np.searchsorted(off, where, side="right") - 1
        worst = np.argsort(-np.abs(o - r), kind="stable")[:top]
        rows = [{"sample_id": int(sids[sample_of[i]]), "token": int(where[i] - off[sample_of[i]]),
                 "turn": int(turn[where[i]]), "recorded": float(r[i]), "embedded": float(e[i]), "trainer": float(o[i])}
                for i in worst]
        return TeacherForcedResult(state.inventory.run, step, cfg.rollout.engine, int(mask.sum()), summary,
                                   _whose(summary, cfg.rollout.engine), path.fidelity(rec, off), rows,
                                   state.mismatches, time.perf_counter() - t0)
    finally:
        state.close()
        torch.set_num_threads(threads_before)


def _whose(s: dict[str, float], engine: str) -> str:
    er, te, tr = (s["mean_abs_embedded_vs_recorded"], s["mean_abs_trainer_vs_embedded"],
                  s["mean_abs_trainer_vs_recorded"])
    if tr == 0:
        return "no mismatch: the trainer reproduces the recorded logprobs exactly"
    if te < 0.5 * tr and er > 0.5 * tr:
        return (f"the {engine} engine's: the embedded decode path agrees with the trainer (mean |Δ| {te:.3g}) "
                f"but not with the recorded {engine} logprobs ({er:.3g}); the recorded engine's kernels differ")
    if er < 0.5 * tr and te > 0.5 * tr:
        return (f"the trainer's side: the embedded decode path reproduces the recorded logprobs (mean |Δ| {er:.3g}) "
                f"and both differ from the trainer ({te:.3g}); the gap is decode vs full forward (explain it "
                "with `axrl-debug explain`)")
    return (f"shared: embedded vs recorded {er:.3g}, trainer vs embedded {te:.3g}, trainer vs recorded {tr:.3g} "
            "(mean |Δ|)")
