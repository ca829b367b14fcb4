"""The training loop, in-process: rollout → pool → advantages → train → weight sync → record.

Read top to bottom: `train()` takes the long-lived components (wired by `axrl.assembly` from the
config) and the loop's own `LoopSettings`; `start()` prepares the run directory (warm-up, or
resume), then one `run_step()` per step. The
rollout worker produces into the pool from its own thread for the whole run; each step here
takes batch w from the pool, trains on it and posts the new weights. `runtime.mode` decides
only *when* the worker may generate and sync (axrl/rollout/schedule.py): in a synchronous run
batch w is generated after step w − 1 has synced; in an asynchronous one the engine keeps
generating while the trainer trains, under the staleness bound. Everything goes through small
protocols (InferenceEngine, TrainBackend, LossFn), so the same loop drives the SGLang engine
and the Megatron-core backend.
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from axrl.runtime.checkpoint import clean_partial, latest_checkpoint, load_checkpoint, save_checkpoint
from axrl.runtime.components import Components
from axrl.runtime.learner import StepLearner
from axrl.runtime.recording.metrics_log import MetricsLog
from axrl.runtime.recording.trackers import MlflowSettings, WandbSettings
from axrl.console.progress import PhaseTimer, TrainProgress
from axrl.runtime.reference import keep_reference, restore_reference
from axrl.runtime.warmup import WarmupSettings, warm_up
from axrl.trace import RunDir


@dataclass(frozen=True)
class LoopSettings:
    """What the loop itself needs: how many steps, when to evaluate and checkpoint, the warm-up,
    whether a KL reference is kept, and what goes into the run directory's `config.yaml` and
    `manifest.json` (the resolved config as plain data, so replay can rebuild the run)."""

    steps: int
    seed: int = 0
    eval_every: int = 0
    checkpoint_every: int = 5
    checkpoint_keep: int = 0
    warmup: WarmupSettings = field(default_factory=WarmupSettings)   # the YAML section `warmup`
    needs_reference: bool = False                       # algo.kl_coef > 0
    tensorboard: bool = False
    wandb: WandbSettings | None = None                  # logging.wandb (None: off)
    mlflow: MlflowSettings | None = None                # logging.mlflow (None: off)
    config: dict[str, Any] = field(default_factory=dict)      # RUN/config.yaml
    manifest: dict[str, Any] = field(default_factory=dict)    # backend, engine, mode, rollout_clock


def evaluate(c: Components, version: int) -> float:
    """Mean held-out reward of the trainer's current weights (version `version`)."""
    assert c.evaluator is not None
    return c.evaluator.evaluate(c.backend.sync_source(), version)


def checkpoint_state(c: Components, next_step: int) -> dict[str, Any]:
    """The loop's part of a checkpoint before `next_step`: versions, data identity, and the rollout
    worker's groups in flight (they restart on resume, so none is lost or trained twice)."""
    return {"policy_version": next_step, "data": c.loader.state(), "rollout": c.rollout.snapshot(next_step)}


def start(s: LoopSettings, c: Components, run: RunDir, resume: bool,
          progress: TrainProgress) -> tuple[int, dict | None]:
    """Prepare the run directory and the trainer state; load the engine with the weights the
    first step's rollout uses. Returns (first step, rollout state to resume from)."""
    if resume:
        clean_partial(run.path)
        found = latest_checkpoint(run.path)
        if found is None and run.completed_steps():
            raise FileNotFoundError(f"--resume: {run.path} has recorded steps but no complete checkpoint in "
                                    f"{run.path / 'checkpoints'}; it cannot be continued, start a new run")
        if found is None:  # stopped before its first checkpoint (during the warm-up): nothing to keep
            progress.log(f"--resume: {run.path} has no checkpoint yet (stopped during its warm-up?): "
                         "starting it again from the beginning")
            run.truncate_after(-1)
            return start(s, c, run, False, progress)
        first, path = found
        with warnings.catch_warnings():
            # Config changes on resume were already reported, by key (axrl.runtime.resume).
            warnings.filterwarnings("ignore", message=".*checkpoint config differs")
            restore_reference(c.backend, run.path, s.needs_reference)  # algo.kl_coef > 0: the weights at RL start
            state = load_checkpoint(path, c.backend)
        c.loader.load_state(state["data"])
        c.rollout.load_weights(c.backend.sync_source(), int(state["policy_version"]))
        if run.read_config() != s.config:  # config.yaml describes the run as it continues (replay reads it)
            run.write_config(s.config)
        # Steps recorded after the checkpoint are discarded and redone, so each step is in the trace once.
        removed = run.truncate_after(first - 1)
        run.record_resume(first)
        progress.log(f"resumed from {path.name}: redoing {len(removed)} recorded step(s) after it")
        # Checkpoints of synchronous runs from before the rollout worker kept only the data position.
        return first, state.get("rollout") or {"next_position": c.loader.position, "pending": []}
    run.write_config(s.config)
    m = s.manifest
    run.write_manifest(seed=s.seed, backend=m["backend"], engine=m["engine"], threads=torch.get_num_threads(),
                       extra={"task": c.task.name, "mode": m["mode"], "rollout_clock": m["rollout_clock"],
                              "chat_template": c.tokenizer.template_facts(),
                              **{k: m[k] for k in ("rollout_weight_dtype", "rollout_kv_dtype", "rollout_precision",
                                                   "rollout_exact", "corrections")
                                 if k in m}})
    if "corrections" in m:      # the corrections in effect, defaults resolved (algo.tis, decoupled)
        progress.log("corrections: " + (", ".join(f"{k} {v}" for k, v in m["corrections"].items()) or "none"))
    w = s.warmup
    if w.steps:
        with progress.stage("warm-up", w.steps) as advance:
            losses = warm_up(c.backend, c.tokenizer, c.task, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                             seed=s.seed, on_step=lambda i, loss: advance(f"loss {loss:.3f}"))
        c.backend.reset_optimizer()  # RL starts with a fresh optimizer and schedule
        progress.log(f"warm-up: {w.steps} supervised steps, loss {losses[0]:.3f} → {losses[-1]:.3f}")
    critic = getattr(c.backend, "critic", None)
    if critic is not None and critic.from_policy:  # PPO's critic starts as the policy at RL start
        critic.copy_policy(c.backend.sync_source())
    c.rollout.load_weights(c.backend.sync_source(), 0)
    keep_reference(c.backend, s.needs_reference)  # algo.kl_coef > 0: the reference policy is the state at RL start
    save_checkpoint(run.path, 0, c.backend, checkpoint_state(c, 0))
    return 0, None


def run_step(s: LoopSettings, c: Components, learner: StepLearner, step: int,
             progress: TrainProgress) -> dict[str, Any]:
    """One step: take batch `step` from the pool, train on it, post the new weights, record it."""
    eval_reward = None
    if c.evaluator is not None and step % s.eval_every == 0:
        progress.phase("eval")
        eval_reward = evaluate(c, step)  # of the policy before this step
    timer = PhaseTimer(progress)
    with timer("rollout"):  # waiting for the batch: the rollout worker has been generating all along
        batch = c.pool.take(step)
    metrics = learner.step(batch, step, timer)
    if eval_reward is not None:
        metrics["eval_reward"] = eval_reward
    if c.evaluator is not None and step + 1 == s.steps:
        progress.phase("eval")
        metrics["eval_reward_final"] = evaluate(c, step + 1)  # of the policy after the last step
    return metrics


def log_written(log: MetricsLog, unlogged: deque[dict[str, Any]], learner: StepLearner) -> None:
    """Write the metrics lines of the steps whose trace file is on disk (the background writer's
    `written_through`), in order: metrics.jsonl never holds a step the trace does not."""
    through = learner.written_through()
    while unlogged and unlogged[0]["step"] <= through:
        log.write(unlogged.popleft())


def check_run_dir(run_path: Path, resume: bool) -> None:
    """Refuse a run directory that cannot take this run: a non-empty one for a new run, a
    directory without config.yaml for --resume."""
    if not resume and run_path.exists() and any(run_path.iterdir()):
        raise FileExistsError(f"run directory {run_path} is not empty; pass --resume to continue it "
                              "or choose another --run-dir")
    if resume and not (run_path / "config.yaml").is_file():
        raise FileNotFoundError(f"--resume: {run_path} is not a run directory (no config.yaml)")


def train(s: LoopSettings, c: Components, run_dir: str | Path, resume: bool = False) -> Path:
    """Run (or resume) a training run on built components (closed at the end); returns the run
    directory. `check_run_dir` first: a run that cannot start fails before anything is built."""
    run_path = Path(run_dir)
    try:
        run = RunDir(run_path)
        c.attach(run.path)  # faults and recoveries so far, then as they happen
        log = MetricsLog(run, tensorboard=s.tensorboard, wandb=s.wandb, mlflow=s.mlflow, config=s.config)
    except BaseException:
        c.close()
        raise
    ok = False
    try:
        with TrainProgress(s.steps, below=None if c.executor is None else c.executor.health) as progress:
            first, rollout_state = start(s, c, run, resume, progress)
            learner = c.open_learner(run)
            unlogged: deque[dict[str, Any]] = deque()   # metrics of steps whose file is not on disk yet
            try:
                progress.progress.update(progress.task, completed=first)
                c.rollout.start(first, rollout_state)
                for step in range(first, s.steps):
                    metrics = run_step(s, c, learner, step, progress)
                    unlogged.append(metrics)
                    if (step + 1) % s.checkpoint_every == 0 or step + 1 == s.steps:
                        progress.phase("checkpoint")
                        learner.flush()  # every step before the checkpoint is on disk with it
                        log_written(log, unlogged, learner)
                        save_checkpoint(run.path, step + 1, c.backend, checkpoint_state(c, step + 1),
                                        keep=s.checkpoint_keep)
                    log_written(log, unlogged, learner)
                    progress.step_done(metrics)
            finally:
                learner.close()  # the step files still queued are written, even when a step failed
                log_written(log, unlogged, learner)
        ok = True
    finally:
        log.close(ok=ok)  # the trackers' runs end as finished or failed
        c.close()
    return run_path
