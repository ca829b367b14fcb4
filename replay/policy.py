"""The trainer at the start of a recorded step: what rollout replay and mismatch attribution start from.

Built exactly as training replay builds it (replay/train_step.py): the backend from `RUN/config.yaml`
by `make_train_backend`, the newest loadable checkpoint at or before the step, then the recorded
updates of the steps in between re-run by the loop's own `run_updates`, each checked against its
recording (a divergence while rebuilding is reported, not hidden).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from axrl.config import Config, ConfigError, load_config
from axrl.assembly.build import make_tokenizer, make_train_backend, policy_loss
from axrl.assembly.settings import routing_replay, step_settings
from axrl.runtime.updates import run_updates
from axrl.tokenizer import Tokenizer
from axrl.trace import TraceError
from axrl.train.protocol import TrainBackend
from replay.compare import Divergence, compare_updates
from replay.train_step import load_start
from replay.plan import ReplayInputError, RunInventory
from replay.recorded import RecordedStep, load_recorded_step

Progress = Callable[[str], None]


@dataclass
class PolicyState:
    """A trainer positioned at the start of `step` (weights of version `step`)."""

    inventory: RunInventory
    cfg: Config
    tokenizer: Tokenizer
    backend: TrainBackend
    step: int
    checkpoint_step: int
    mismatches: list[Divergence] = field(default_factory=list)   # while rebuilding (should be none)
    notes: list[str] = field(default_factory=list)

    def recorded(self, step: int) -> RecordedStep:
        """Step file `step` as the trainer saw it."""
        path = self.inventory.files[step]
        try:
            return load_recorded_step(path, self.cfg)
        except (TraceError, ValueError, OSError, KeyError) as e:
            raise ReplayInputError.for_step(f"step file {path} is damaged or incomplete: {e}", self.inventory,
                                            step) from None

    def advance(self) -> list[Divergence]:
        """Re-run the recorded updates of `step` (checked against the trace) and move to the next."""
        rec = self.recorded(self.step)
        cfg, backend = self.cfg, self.backend
        results = run_updates(backend, rec.batch, rec.splits, policy_loss(cfg), r3=routing_replay(cfg),
                              lr_scale=step_settings(cfg).lr_scale_at(self.step))
        found = compare_updates(rec, results)
        if results and results[-1].fingerprint != rec.fingerprint_after:
            found.append(Divergence(self.step, None, None, "weights_fingerprint_after", rec.fingerprint_after,
                                    results[-1].fingerprint))
        self.mismatches += found
        self.step += 1
        return found

    def close(self) -> None:
        self.backend.close()


def load_run_config(run_dir: str | Path) -> tuple[RunInventory, Config]:
    inv = RunInventory(run_dir)
    path = inv.run / "config.yaml"
    try:
        return inv, load_config(path)
    except ConfigError as e:
        raise ReplayInputError(f"{path}: {e}") from None


def policy_before(run_dir: str | Path, step: int, *, start_at: int | None = None,
                  progress: Progress | None = None) -> PolicyState:
    """The trainer at the start of `step` (or of `start_at` ≤ step, when the caller advances it
    itself: an asynchronous rollout replay needs every version from the start)."""
    say = progress or (lambda msg: None)
    inv, cfg = load_run_config(run_dir)
    plan = inv.plan(step)
    tokenizer = make_tokenizer(cfg)
    try:
        backend = make_train_backend(cfg, tokenizer)
    except (NotImplementedError, ValueError, OSError) as e:
        raise ReplayInputError(f"cannot build the trainer from {inv.run / 'config.yaml'}: {e}") from None
    target = step if start_at is None else start_at
    try:
        if start_at is not None and plan.checkpoint_step > start_at:
            fallbacks = [(k, p) for k, p in plan.older_checkpoints if k <= start_at]
            if not fallbacks:
                raise ReplayInputError(f"no checkpoint at or before step {start_at} in {inv.run}")
            plan.checkpoint_step, plan.checkpoint_path = fallbacks[0]
            plan.older_checkpoints = fallbacks[1:]
        k0, _, notes = load_start(inv, plan, backend, target, say)
        state = PolicyState(inv, cfg, tokenizer, backend, k0, k0, notes=notes)
        while state.step < target:
            say(f"re-running step {state.step} to rebuild the policy of step {target}")
            state.advance()
    except BaseException:
        backend.close()
        raise
    return state
