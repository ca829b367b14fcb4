"""The online spike trigger (`trace.spike_ratio`): a step whose largest update grad norm exceeds
k × the rolling median of the previous steps' (AxisRL's GradSpikeDebugConfig: k = 2) is marked
in its step file (attrs `spike`, `spike_grad_norm_ratio`, `spike_dump`) and gets the deep dump
`axrl-debug replay --dump` would write (`axrl.runtime.recording.dump`), at the time.

How, without slowing normal steps beyond one copy of the trainer state: `before_step` keeps the
state the step starts from (`TrainBackend.state_dict`); when the step spikes, `after_step` loads
it, re-runs the step's updates (`run_updates`, as replay does) with the dump probe, and checks
that the re-execution lands on the weights training produced. Deterministic mode makes that
exact (attr `verdict` = "bitwise-equal"); otherwise the trainer is put back to the trained state.

A backend whose loss runs in other processes (the Ray train group: `loss_in_process` False)
cannot take the probe's loss function, so there the trigger marks the spike without the deep dump
(`spike_dump_verdict` says why: `axrl-debug replay --dump` writes it afterwards) — the mark is what
the `trace.keep_full` ring promotes its steps on.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from axrl.core.settings import Section
from axrl.runtime.recording.dump import DumpProbe, dump_path
from axrl.runtime.results import TrainedStep
from axrl.runtime.step_trainer import TrainStepSettings
from axrl.runtime.updates import run_updates
from axrl.train.determinism import capture_rng_state, restore_rng_state
from axrl.train.protocol import TrainBackend

__all__ = ["NO_DUMP", "SpikeSettings", "SpikeTrigger"]

NO_DUMP = ("not written: the train ranks run the loss in their own processes (runtime.executor: ray); "
           "write it with axrl-debug replay --dump")


def _dumps(backend: TrainBackend) -> bool:
    """Whether the deep dump can re-run the step's loss with its probe in this process."""
    return bool(getattr(backend, "loss_in_process", True))


class SpikeSettings(Section):
    """`trace.spike_*` (the YAML section `trace` extends this type): fire when a step's largest
    update grad norm exceeds `spike_ratio` × the rolling median of the last `spike_window` steps'
    (after `spike_min_history` of them); `spike_ratio` None = off."""

    spike_ratio: float | None = Field(None, gt=1, description="online spike trigger: a step whose largest update "
                                      "grad norm exceeds this × the rolling median gets its deep dump written "
                                      "(RUN/replay/step_N.h5) at the time; null = off")
    spike_window: int = Field(20, ge=1, description="steps in the spike trigger's rolling median")
    spike_min_history: int = Field(3, ge=1, description="steps needed before the trigger can fire")

    def spike_settings(self) -> "SpikeSettings":
        """This object's `SpikeSettings` fields alone (a `TraceSection`'s other keys left out)."""
        return SpikeSettings(**{name: getattr(self, name) for name in SpikeSettings.model_fields})


class SpikeTrigger:
    """Watches each step's largest update grad norm; dumps the steps that spike (module docstring).
    A trigger built with ratio None does nothing."""

    def __init__(self, ratio: float | None, window: int, min_history: int, run_dir: Path,
                 history: list[float] | None = None) -> None:
        self.ratio, self.window, self.min_history, self.run_dir = ratio, window, min_history, Path(run_dir)
        self.history = list(history or [])
        self._before: dict[str, Any] | None = None

    @classmethod
    def for_run(cls, t: SpikeSettings, run_dir: Path) -> "SpikeTrigger":
        """The run's trigger; on resume its history is the grad norms in metrics.jsonl."""
        history: list[float] = []
        if t.spike_ratio is not None:
            path = Path(run_dir) / "metrics.jsonl"
            if path.is_file():
                for line in path.read_text().splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    value = row.get("grad_norm_max", row.get("grad_norm"))
                    if isinstance(value, (int, float)):
                        history.append(float(value))
        return cls(t.spike_ratio, t.spike_window, t.spike_min_history, run_dir, history)

    @property
    def enabled(self) -> bool:
        return self.ratio is not None

    def before_step(self, backend: TrainBackend) -> None:
        """Keep the state the step starts from (only when enabled and the dump can be written)."""
        if self.enabled and _dumps(backend):
            self._before = backend.state_dict()

    def baseline(self) -> float | None:
        """The rolling median of the previous steps' grad norms, or None with too little history."""
        recent = [g for g in self.history[-self.window:] if math.isfinite(g)]
        return statistics.median(recent) if len(recent) >= self.min_history else None

    def after_step(self, backend: TrainBackend, step: TrainStepSettings, outcome: TrainedStep) -> dict[str, Any]:
        """Check the step; on a spike write its dump and mark it. Returns metrics.jsonl additions."""
        if not self.enabled:
            return {}
        before, self._before = self._before, None
        peak = max(u.stats.grad_norm for u in outcome.updates)
        median = self.baseline()
        self.history.append(peak)
        assert self.ratio is not None
        if median is None or not median > 0 or not peak > self.ratio * median:
            return {}
        if not _dumps(backend):
            outcome.marks.update(spike=1, spike_grad_norm_ratio=peak / median)
            return {"spike": 1, "spike_grad_norm_ratio": peak / median, "spike_dump_verdict": NO_DUMP}
        if before is None:
            raise RuntimeError("SpikeTrigger.after_step without before_step: the state before the step is needed")
        t0 = time.perf_counter()
        path, verdict = self._dump(backend, step, outcome, before)
        ratio = peak / median
        outcome.marks.update(spike=1, spike_grad_norm_ratio=ratio, spike_dump=str(path))
        return {"spike": 1, "spike_grad_norm_ratio": ratio, "spike_dump": str(path), "spike_dump_verdict": verdict,
                "time_spike_dump": time.perf_counter() - t0}

    def _dump(self, backend: TrainBackend, step: TrainStepSettings, outcome: TrainedStep,
              before: dict[str, Any]) -> tuple[Path, str]:
        rng = capture_rng_state()
        after = backend.state_dict()
        batch = outcome.processed.batch
        splits = [u.samples for u in outcome.updates]
        r3 = step.r3
        backend.load_state_dict(before)
        probe = DumpProbe(backend, step.loss_fn, batch, splits, r3=r3)
        try:
            results = run_updates(backend, batch, splits, probe.loss_fn, r3=r3,
                                  lr_scale=step.lr_scale_at(outcome.step), hooks=probe)
        finally:
            probe.close()
        same = [r.fingerprint for r in results] == [u.fingerprint for u in outcome.updates]
        if not same:
            backend.load_state_dict(after)  # the run goes on from what training produced
        restore_rng_state(rng)
        verdict = "bitwise-equal" if same else "diverged"
        updates = [{"loss": r.metrics.loss, "grad_norm": r.stats.grad_norm, "lr": r.stats.lr} for r in results]
        path = probe.write(dump_path(self.run_dir, outcome.step), updates=updates, attrs={
            "step": outcome.step, "run": str(self.run_dir), "verdict": verdict, "source": "spike_trigger",
            "first_divergence": "" if same else "the instrumented re-execution did not reach the trained weights"})
        return path, verdict
