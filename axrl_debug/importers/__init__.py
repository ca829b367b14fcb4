"""Importers: another framework's dumps → an AxRL run directory (`axrl-debug import FORMAT SRC RUN`).

One module per format reads its dumps into `ImportedStep`s (`common.py`); `common.write_steps`
writes them through `axrl.trace.Recorder`. Pickled dumps are read by the restricted unpickler of
`safe_load.py` only. See docs/import.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from . import axisrl, nemo_rl, slime
from .common import ImportOptions, write_steps
from .safe_load import ImportFormatError, UnsafePickleError

__all__ = ["FORMATS", "ImportFormatError", "ImportOptions", "UnsafePickleError", "import_run"]


@dataclass(frozen=True)
class Format:
    """A dump format: the module that reads it and what its dumps are."""

    module: ModuleType
    doc: str


FORMATS: dict[str, Format] = {
    "slime": Format(slime, "slime --dump-details / --save-debug-{rollout,train}-data (*.pt)"),
    # miles writes slime's dumps (train dumps per rank, context-parallel pieces): the same reader
    "miles": Format(slime, "miles rollout + per-rank train dumps (*.pt)"),
    "nemo-rl": Format(nemo_rl, "NeMo-RL train_data_step{N}.jsonl"),
    "axisrl": Format(axisrl, "AxisRL spike_snapshots/iter_N/batch_rank{r}.pt"),
}


def import_run(fmt: str, src: str | Path, run: str | Path, *, options: ImportOptions | None = None,
               model: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Import ``src`` (format ``fmt``) into the run directory ``run``; return the import's report."""
    if fmt not in FORMATS:
        raise ImportFormatError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or directory")
    m = FORMATS[fmt].module
    options = options or ImportOptions()
    options.config()   # a dtype it cannot state is refused before any dump is read
    return write_steps(m.read_steps(src, options), run, fmt=fmt, src=src, engine=m.ENGINE, backend=m.BACKEND,
                       model=model, options=options, absent=list(m.ABSENT), overwrite=overwrite)
