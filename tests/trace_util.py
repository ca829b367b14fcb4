"""Runs' traces in tests: writing a synthetic run (`axrl_debug.synthetic`) for the debug
commands to read, and reading every dataset of every step file, to compare two runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import h5py

from axrl_debug.synthetic import TinySample, tiny_record, write_run


def make_run(path: Path, steps: Iterable[int], samples: Callable[[int], list[TinySample]],
             update_metrics: Callable[[int], dict[str, list[float]]],
             metrics: Callable[[int], dict[str, Any]] | None = None,
             fingerprint: Callable[[int], str] = lambda step: "fp") -> Path:
    """A synthetic run in `path`: step s (policy version s) holds `samples(s)`, one update with
    `update_metrics(s)`, weights fingerprints from `fingerprint(s)`; metrics.jsonl holds
    {"step": s, **metrics(s)} per step (no metrics.jsonl without `metrics`). Returns `path`."""
    steps = list(steps)
    recs = [tiny_record(s, s, samples(s), update_metrics=update_metrics(s), fingerprint=fingerprint(s)) for s in steps]
    rows = [{"step": s, **metrics(s)} for s in steps] if metrics is not None else None
    write_run(path, recs, metrics=rows)
    return path


def trace_datasets(run_dir: Path) -> dict:
    """{(step file name, dataset path): value} of every dataset in `run_dir`'s trace."""
    out = {}
    for f in sorted((run_dir / "trace").glob("step_*.h5")):
        with h5py.File(f) as h:
            h.visititems(lambda name, obj: out.__setitem__((f.name, name), obj[()])
                         if isinstance(obj, h5py.Dataset) else None)
    return out
