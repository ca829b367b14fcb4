"""The training loop, in-process: rollout → pool → advantages → train → weight sync → record.

Read top to bottom: `build()` wires the components from the config, `train()` runs the steps.
Everything a step does goes through a small protocol (InferenceEngine, TrainBackend, LossFn),
so the same loop drives the SGLang engine and the Megatron-core backend.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from axrl.agents.tasks import Task, get_task
from axrl.algo.processor import AlgorithmProcessor, prompts_to_roll_out
from axrl.config import Config, config_to_dict
from axrl.data import PromptLoader
from axrl.inference.protocol import InferenceEngine, SamplingParams
from axrl.rollout.worker import RolloutSettings, RolloutWorker
from axrl.runtime.components import make_engine, make_tokenizer, make_train_backend
from axrl.runtime.checkpoint import clean_partial, latest_checkpoint, load_checkpoint, save_checkpoint
from axrl.runtime.faults import lr_scale, perturb_batch
from axrl.runtime.progress import PhaseTimer, TrainProgress
from axrl.runtime.records import TrainedStep, step_metrics, step_record
from axrl.runtime.reference import keep_reference, restore_reference, with_reference_logprobs
from axrl.runtime.spike_trigger import SpikeTrigger
from axrl.runtime.updates import policy_loss, routing_replay, run_updates
from axrl.runtime.warmup import warm_up
from axrl.tokenizer import Tokenizer
from axrl.trace import RunDir
from axrl.train.protocol import TrainBackend


@dataclass
class Components:
    tokenizer: Tokenizer
    task: Task
    loader: PromptLoader
    engine: InferenceEngine
    backend: TrainBackend
    worker: RolloutWorker
    evaluator: RolloutWorker
    processor: AlgorithmProcessor
    num_experts: int


def build(cfg: Config) -> Components:
    tokenizer = make_tokenizer(cfg)
    task = get_task(cfg.data.task, **cfg.data.task_args)
    loader = (PromptLoader.from_file(cfg.data.path, seed=cfg.seed) if cfg.data.path
              else PromptLoader.from_task(task, seed=cfg.seed))
    backend = make_train_backend(cfg, tokenizer)
    engine = make_engine(cfg, backend, tokenizer)
    model_config = backend.model_config
    r = cfg.rollout
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, stop_token_ids=[tokenizer.eos_token_id])
    settings = RolloutSettings(group_size=r.group_size, sampling=sampling, max_turns=r.max_turns,
                               max_context_len=r.max_context_len, return_routing=model_config.is_moe,
                               lockstep=cfg.runtime.deterministic)
    worker = RolloutWorker(engine, tokenizer, task, settings, seed=cfg.seed)
    evaluator = RolloutWorker(engine, tokenizer, task, dataclasses.replace(
        settings, group_size=cfg.eval.samples_per_prompt, return_routing=False), seed=cfg.seed + 2)
    processor = AlgorithmProcessor.from_config(cfg)
    return Components(tokenizer, task, loader, engine, backend, worker, evaluator, processor,
                      model_config.num_experts)


def sync_weights(c: Components, version: int) -> None:
    c.engine.update_weights({name: t.detach() for name, t in c.backend.named_weights()}, version=version)


def evaluate(c: Components, cfg: Config) -> float:
    """Mean reward on the held-out prompts (task stream seed + 2), with fixed sampling seeds."""
    prompts = [c.task.prompt(cfg.seed + 2, i) for i in range(cfg.eval.prompts)]
    trajectories = c.evaluator.rollout(prompts, step=0)
    return sum(t.reward for t in trajectories) / len(trajectories)


def rng_digest() -> str:
    return hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8).hexdigest()


def run_step(c: Components, cfg: Config, step: int, version: int, timer: PhaseTimer) -> TrainedStep:
    """One RL step: rollout, old logprobs, `updates_per_step` optimizer updates, weight sync."""
    with timer("rollout"):
        trajectories = c.worker.rollout(c.loader.next_batch(prompts_to_roll_out(cfg)), step)
    with timer("prepare"):
        processed = c.processor(trajectories)
        processed.batch = perturb_batch(cfg, step, processed.batch)  # faults.rollout_logprob_noise; no-op by default
        old = c.backend.forward(processed.batch, r3=routing_replay(cfg))
        processed.batch = dataclasses.replace(processed.batch, old_logprobs=old.logprobs)
        processed.batch = with_reference_logprobs(c.backend, processed.batch, cfg)  # algo.kl_coef > 0
    fingerprint_before = c.backend.fingerprint()
    with timer("train"):
        # Shared with replay/, which re-runs these updates from the trace (axrl/runtime/updates.py).
        updates = run_updates(c.backend, processed.batch, processed.update_splits(cfg.train.updates_per_step),
                              policy_loss(cfg), r3=routing_replay(cfg), lr_scale=lr_scale(cfg, step))
    with timer("sync"):
        sync_weights(c, version + 1)
    return TrainedStep(step=step, policy_version=version, processed=processed, old=old, updates=updates,
                       fingerprint_before=fingerprint_before, fingerprint_after=updates[-1].fingerprint,
                       wall_times=timer.times, num_experts=c.num_experts)


def start(cfg: Config, c: Components, run: RunDir, resume: bool, progress: TrainProgress) -> tuple[int, int]:
    """Prepare the run directory and the state to start from; returns (first step, policy version)."""
    if resume:
        clean_partial(run.path)
        found = latest_checkpoint(run.path)
        if found is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {run.path / 'checkpoints'}")
        first, path = found
        restore_reference(c.backend, run.path, cfg)  # algo.kl_coef > 0: the weights of step_000000
        state = load_checkpoint(path, c.backend)
        c.loader.load_state(state["data"])
        version = int(state["policy_version"])
        sync_weights(c, version)
        _update_recorded_config(run, cfg)
        # Steps recorded after the checkpoint are discarded and redone, so each step is in the trace once.
        removed = run.truncate_after(first - 1)
        run.record_resume(first)
        progress.log(f"resumed from {path.name}: redoing {len(removed)} recorded step(s) after it")
        return first, version
    run.write_config(config_to_dict(cfg))
    run.write_manifest(seed=cfg.seed, backend=cfg.train.backend, engine=cfg.rollout.engine,
                       threads=torch.get_num_threads(), extra={"task": c.task.name})
    if cfg.warmup.steps:
        progress.phase("warm-up")
        losses = warm_up(c.backend, c.tokenizer, c.task, steps=cfg.warmup.steps, batch_size=cfg.warmup.batch_size,
                         lr=cfg.warmup.lr, seed=cfg.seed)
        c.backend.reset_optimizer()  # RL starts with a fresh optimizer and schedule
        progress.log(f"warm-up: {cfg.warmup.steps} supervised steps, loss {losses[0]:.3f} → {losses[-1]:.3f}")
        sync_weights(c, 0)
    keep_reference(c.backend, cfg)  # algo.kl_coef > 0: the reference policy is the state at RL start
    save_checkpoint(run.path, 0, c.backend, {"policy_version": 0, "data": c.loader.state()})
    return 0, 0


def _update_recorded_config(run: RunDir, cfg: Config) -> None:
    """On resume, config.yaml must describe the run as it continues (replay reads it)."""
    recorded = run.read_config()
    if recorded == config_to_dict(cfg):
        return
    if cfg.train.lr_schedule != "constant" and recorded.get("steps") != cfg.steps:
        raise ValueError(f"--resume: changing steps ({recorded.get('steps')} → {cfg.steps}) would change the "
                         f"'{cfg.train.lr_schedule}' learning-rate schedule of steps already trained")
    run.write_config(config_to_dict(cfg))


def train(cfg: Config, run_dir: str | Path, resume: bool = False) -> Path:
    """Run (or resume) a training run; returns the run directory."""
    run_path = Path(run_dir)
    if not resume and run_path.exists() and any(run_path.iterdir()):
        raise FileExistsError(f"run directory {run_path} is not empty; pass --resume to continue it "
                              "or choose another --run-dir")
    if resume and not (run_path / "config.yaml").is_file():
        raise FileNotFoundError(f"--resume: {run_path} is not a run directory (no config.yaml)")
    run = RunDir(run_path)
    c = build(cfg)
    try:
        with TrainProgress(cfg.steps) as progress:
            first, version = start(cfg, c, run, resume, progress)
            trigger = SpikeTrigger.from_config(cfg, run.path)  # trace.spike_ratio (off by default)
            progress.progress.update(progress.task, completed=first)
            for step in range(first, cfg.steps):
                eval_reward = None
                if cfg.eval.every and step % cfg.eval.every == 0:
                    progress.phase("eval")
                    eval_reward = evaluate(c, cfg)
                trigger.before_step(c.backend)
                outcome = run_step(c, cfg, step, version, PhaseTimer(progress))
                version += 1
                metrics = step_metrics(outcome)
                metrics.update(trigger.after_step(c.backend, cfg, outcome))
                if eval_reward is not None:
                    metrics["eval_reward"] = eval_reward  # of the policy before this step
                if cfg.eval.every and step + 1 == cfg.steps:
                    progress.phase("eval")
                    metrics["eval_reward_final"] = evaluate(c, cfg)  # of the policy after the last step
                if cfg.trace.enabled:
                    progress.phase("record")
                    t0 = time.perf_counter()
                    run.write_step(step_record(outcome, rng_digest(), routing=cfg.trace.routing))
                    metrics["time_record"] = time.perf_counter() - t0
                run.append_metrics(metrics)
                if (step + 1) % cfg.checkpoint.every == 0 or step + 1 == cfg.steps:
                    progress.phase("checkpoint")
                    save_checkpoint(run.path, step + 1, c.backend,
                                    {"policy_version": version, "data": c.loader.state()}, keep=cfg.checkpoint.keep)
                progress.step_done(metrics)
    finally:
        c.engine.shutdown()
        c.backend.close()
    return run_path

