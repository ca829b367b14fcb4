"""Reading a run's trace in tests: every dataset of every step file, to compare two runs."""

from __future__ import annotations

from pathlib import Path

import h5py


def trace_datasets(run_dir: Path) -> dict:
    """{(step file name, dataset path): value} of every dataset in `run_dir`'s trace."""
    out = {}
    for f in sorted((run_dir / "trace").glob("step_*.h5")):
        with h5py.File(f) as h:
            h.visititems(lambda name, obj: out.__setitem__((f.name, name), obj[()])
                         if isinstance(obj, h5py.Dataset) else None)
    return out
