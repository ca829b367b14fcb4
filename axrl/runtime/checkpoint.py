"""Run checkpoints: `run_dir/checkpoints/step_K/` holds the full state *before* step K.

`step_000000` is written after the supervised warm-up, before the first RL step, so every step
of a run can be rebuilt from a checkpoint at or before it. A checkpoint directory is written
under a `.tmp` name and renamed when complete: a name without `.tmp` is always whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from axrl.trace.kill_points import kill_point
from axrl.train.protocol import TrainBackend

STATE_FILE = "state.json"
_NAME = re.compile(r"^step_(\d{6,})$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def checkpoint_of(path: str | Path) -> tuple[Path, int] | None:
    """(run directory, step) when ``path`` is a run's checkpoint directory (``RUN/checkpoints/step_N``)."""
    p = Path(path)
    m = _NAME.match(p.name)
    if m and p.parent.name == "checkpoints" and (p / STATE_FILE).is_file():
        return p.parent.parent, int(m.group(1))
    return None


def save_checkpoint(run_dir: Path, next_step: int, backend: TrainBackend, state: dict[str, Any],
                    keep: int = 0) -> Path:
    """Save backend state + loop state (data position, policy version…) as the state before `next_step`."""
    final = checkpoint_dir(run_dir, next_step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    backend.save(tmp)
    with open(tmp / STATE_FILE, "w") as f:
        json.dump({"next_step": next_step, **state}, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    kill_point(f"written:{final.name}")         # tests of crash recovery (AXRL_KILL_AT)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    kill_point(f"renamed:{final.name}")
    if keep:
        for old in list_checkpoints(run_dir)[:-keep]:
            if old[0] != 0:  # the post-warm-up state is the root of every replay: keep it
                shutil.rmtree(old[1])
    return final


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first; half-written `.tmp` directories are ignored."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path, at_or_before: int | None = None) -> tuple[int, Path] | None:
    """The newest complete checkpoint (optionally: whose state is from before step `at_or_before`+1)."""
    found = [c for c in list_checkpoints(run_dir) if at_or_before is None or c[0] <= at_or_before]
    return found[-1] if found else None


def load_checkpoint(path: Path, backend: TrainBackend) -> dict[str, Any]:
    """Restore the backend from a checkpoint and return the loop state saved with it."""
    state_path = path / STATE_FILE
    try:
        state = json.loads(state_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {path}: cannot read {STATE_FILE}: {e}") from e
    backend.load(path)
    return state


def clean_partial(run_dir: Path) -> None:
    """Remove checkpoint directories left half-written by a crash."""
    root = run_dir / "checkpoints"
    if root.is_dir():
        for p in root.glob("*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
