"""A run directory's steps, read safely.

``TraceReader`` lists the steps of a run (each a ``StepFile``, ``axrl.trace.step_file``) and reports
(rather than crashes on) step files that are truncated or corrupt. Nothing here unpickles: HDF5
through h5py, JSON through ``json``, YAML through ``yaml.safe_load``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np
import yaml

from . import schema as S
from .columns import StepColumns
from .run_dir import list_step_files, read_metrics_file
from .schema import CorruptStepError, NotARunDirError, TraceError
from .shards import check_shards
from .step_file import _READ_ERRORS, StepFile, _check_version, read_step

if TYPE_CHECKING:  # pandas is optional for the trace package; only the frame helpers need it
    import pandas as pd

@dataclass(frozen=True)
class TraceProblem:
    path: Path
    message: str

    def __str__(self) -> str:
        return self.message if str(self.path) in self.message else f"{self.path}: {self.message}"


class TraceReader:
    """The steps of a run directory.

    Raises ``FileNotFoundError`` for a missing directory, ``NotARunDirError`` for a directory with
    neither ``manifest.json`` nor ``trace/``, ``SchemaVersionError`` if the manifest declares an
    unknown schema version. Step files that cannot be read (truncated, corrupt, wrong version, step
    attr disagreeing with the file name) are skipped and listed in ``problems``; ``*.tmp`` files are
    never steps.
    """

    def __init__(self, run_dir: str | os.PathLike, *, validate: bool = True) -> None:
        self.path = Path(run_dir)
        if not self.path.exists():
            raise FileNotFoundError(f"run directory not found: {self.path}")
        if not self.path.is_dir():
            raise NotADirectoryError(f"not a directory: {self.path}")
        self.trace_dir = self.path / S.TRACE_DIR
        manifest_path = self.path / S.MANIFEST_FILE
        if not manifest_path.is_file() and not self.trace_dir.is_dir():
            raise NotARunDirError(f"not an AxRL run directory (no {S.MANIFEST_FILE} and no "
                                  f"{S.TRACE_DIR}/): {self.path}")
        self.manifest: dict[str, Any] = {}
        if manifest_path.is_file():
            try:
                self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise TraceError(f"{manifest_path}: invalid JSON ({e})") from None
            if not isinstance(self.manifest, dict):
                raise TraceError(f"{manifest_path}: expected a JSON object")
            if "schema_version" in self.manifest:
                _check_version(self.manifest["schema_version"], str(manifest_path))
        self._validate = validate
        self._valid: dict[int, Path] | None = None
        self._problems: list[TraceProblem] = []

    def __repr__(self) -> str:
        return f"TraceReader({str(self.path)!r})"

    # ---- run-level files
    @property
    def config(self) -> dict[str, Any] | None:
        p = self.path / S.CONFIG_FILE
        if not p.is_file():
            return None
        with open(p, encoding="utf-8") as fh:
            return yaml.safe_load(fh) or {}

    def metrics(self) -> list[dict[str, Any]]:
        """Rows of metrics.jsonl; unparseable lines are skipped and added to ``problems``."""
        rows, problems = read_metrics_file(self.path / S.METRICS_FILE)
        for msg in problems:
            prob = TraceProblem(self.path / S.METRICS_FILE, msg)
            if prob not in self._problems:
                self._problems.append(prob)
        return rows

    # ---- steps
    def step_files(self) -> dict[int, Path]:
        """Every final step file by step (unvalidated)."""
        return list_step_files(self.trace_dir)

    def tmp_files(self) -> list[Path]:
        if not self.trace_dir.is_dir():
            return []
        return sorted(p for p in self.trace_dir.iterdir() if p.name.endswith(S.TMP_SUFFIX))

    def check_step_file(self, path: Path, step: int | None = None) -> str | None:
        """None if the file opens and has a consistent structure, else a message naming the path."""
        try:
            with StepFile(path) as sf:
                if step is not None and sf.step != step:
                    return f"{path}: step attr {sf.step} does not match the file name (step {step})"
                off = sf["/samples/offsets"]
                if off.ndim != 1 or off.size < 1 or int(off[-1]) != sf.num_tokens:
                    return f"{path}: /samples/offsets does not cover /tokens/ids ({sf.num_tokens} tokens)"
                # walks all object headers (a sharded step's: and its shards')
                check_shards(sf._f, sf.shards, sf.step) if sf.shards else sf.keys()
        except TraceError as e:
            return str(e)
        except FileNotFoundError:
            return f"{path}: disappeared while reading"
        except _READ_ERRORS as e:
            return f"{path}: unreadable ({e})"
        return None

    def _scan(self) -> dict[int, Path]:
        if self._valid is None:
            valid: dict[int, Path] = {}
            for step, path in self.step_files().items():
                msg = self.check_step_file(path, step) if self._validate else None
                if msg is None:
                    valid[step] = path
                else:
                    self._problems.append(TraceProblem(path, msg))
            self._valid = valid
        return self._valid

    def refresh(self) -> None:
        """Forget the cached listing (e.g. while a run is still writing)."""
        self._valid = None
        self._problems = []

    @property
    def steps(self) -> list[int]:
        """Sorted steps with a readable step file."""
        return list(self._scan())

    @property
    def problems(self) -> list[TraceProblem]:
        """Step files (and metrics lines) that were skipped, with the reason."""
        self._scan()
        return list(self._problems)

    def __len__(self) -> int:
        return len(self._scan())

    def step_path(self, step: int) -> Path:
        valid = self._scan()
        if step not in valid:
            bad = [p for p in self._problems if p.path.name == S.step_file_name(step)]
            if bad:
                raise CorruptStepError(str(bad[0]))
            raise KeyError(f"no step {step} in {self.trace_dir} (have {len(valid)} steps)")
        return valid[step]

    def open(self, step: int) -> StepFile:
        return StepFile(self.step_path(step))

    def read(self, step: int) -> dict[str, Any]:
        return read_step(self.step_path(step))

    def __iter__(self) -> Iterator[StepFile]:
        """Open each valid step in order (the caller closes them, or uses ``with``)."""
        for step in self.steps:
            try:
                yield self.open(step)
            except TraceError as e:  # became unreadable since the scan
                self._problems.append(TraceProblem(self._scan()[step], str(e)))

    # ---- column-selective reads across steps (analysis)
    def report_problem(self, path: str | os.PathLike, message: str) -> None:
        """Record a problem found after the scan (e.g. a chunk failing its checksum on read), once."""
        prob = TraceProblem(Path(path), message)
        if prob not in self._problems:
            self._problems.append(prob)

    def iter_columns(self, names: Iterable[str], steps: Iterable[int] | None = None, *,
                     optional: Iterable[str] = (), reuse_buffers: bool = False,
                     fast_checksums: bool = False) -> Iterator[StepColumns]:
        """For each step (default: all valid steps, in order), read only ``names`` (+ ``optional``
        where present). A step whose data turns out unreadable (checksum failure, missing required
        dataset) is skipped and added to ``problems`` rather than ending the iteration.

        ``reuse_buffers=True`` reads every step into the same (growing) buffers, so the arrays of a
        step are only valid until the iteration moves on — for consumers that fold each step into
        an aggregate (no fresh allocation and page faults per dataset and step). With it,
        ``fast_checksums=True`` verifies the raw columns' checksums in compiled code instead of
        HDF5's filter (see ``read_columns``)."""
        names, optional = list(names), list(optional)
        buffers: dict[str, np.ndarray] | None = {} if reuse_buffers else None
        return self._iter_steps(steps, lambda sf, path: sf.read_columns(
            names, optional=optional, buffers=buffers, fast_checksums=fast_checksums))

    def _iter_steps(self, steps: Iterable[int] | None,
                    read: Callable[[StepFile, Path], dict[str, Any]]) -> Iterator[StepColumns]:
        """Open each step (default: all, in order), yield what ``read`` takes; an unreadable one goes to ``problems``."""
        valid = self._scan()
        for step in (self.steps if steps is None else steps):
            path = valid.get(step)
            if path is None:
                raise KeyError(f"no step {step} in {self.trace_dir}")
            try:
                with StepFile(path) as sf:
                    data = read(sf, path)
                    attrs = dict(sf.attrs)
            except (TraceError, KeyError) as e:
                msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
                self.report_problem(path, str(msg))
                continue
            yield StepColumns(step, path, attrs, data)

    def columns(self, names: Iterable[str], steps: Iterable[int] | None = None) -> dict[str, np.ndarray]:
        """Datasets of equal length per step (e.g. several ``/tokens/*``), concatenated across steps,
        plus ``"step"`` (int64, the step of each row). Unreadable steps are skipped (see problems)."""
        names = list(names)
        parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
        step_col: list[np.ndarray] = []
        for sc in self.iter_columns(names, steps):
            n = len(sc[names[0]]) if names else 0
            for name in names:
                parts[name].append(np.asarray(sc[name]))
            step_col.append(np.full(n, sc.step, np.int64))
        out = {n: (np.concatenate(v) if v else np.zeros(0)) for n, v in parts.items()}
        out["step"] = np.concatenate(step_col) if step_col else np.zeros(0, np.int64)
        return out

    def token_frame(self, steps: Iterable[int] | None = None, columns: Iterable[str] | None = None) -> "pd.DataFrame":
        """One row per token: ``step``, ``sample`` (row in /samples), ``position`` (index inside its sample)
        and each 1-D ``/tokens/<name>`` dataset as column ``<name>`` (default: all of them). Needs pandas."""
        import pandas as pd

        frames = [step_token_frame(sc) for sc in self._iter_group(S.G_TOKENS, steps, columns)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def sample_frame(self, steps: Iterable[int] | None = None) -> "pd.DataFrame":
        """One row per sample: ``step``, ``sample`` (row), ``num_tokens`` and every 1-D
        ``/samples/<name>`` dataset except ``offsets``. Needs pandas."""
        import pandas as pd

        frames = []
        for sc in self._iter_group(S.G_SAMPLES, steps, None):
            off = sc.data.pop("offsets")
            n = len(off) - 1
            cols = {"step": np.full(n, sc.step, np.int64), "sample": np.arange(n, dtype=np.int64),
                    "num_tokens": np.diff(off)}
            cols.update({k: v for k, v in sc.data.items() if np.ndim(v) == 1 and len(v) == n})
            frames.append(pd.DataFrame(cols))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def update_frame(self, steps: Iterable[int] | None = None) -> "pd.DataFrame":
        """One row per optimizer update: ``step``, ``update`` and every ``/train/updates/<metric>``
        (except the CSR ``sample_offsets``). Needs pandas."""
        import pandas as pd

        frames = []
        for sc in self._iter_group(S.G_UPDATES, steps, None):
            sc.data.pop("sample_offsets", None)
            u = max((len(v) for v in sc.data.values() if np.ndim(v) == 1), default=0)
            cols = {"step": np.full(u, sc.step, np.int64), "update": np.arange(u, dtype=np.int64)}
            cols.update({k: v for k, v in sc.data.items() if np.ndim(v) == 1 and len(v) == u})
            frames.append(pd.DataFrame(cols))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def _iter_group(self, group: str, steps: Iterable[int] | None,
                    columns: Iterable[str] | None) -> Iterator[StepColumns]:
        """Like ``iter_columns`` for the datasets directly under ``group`` (short names as keys);
        ``/tokens`` always brings ``/samples/offsets`` along (key ``"offsets"``)."""
        prefix = group + "/"

        def read(sf: StepFile, path: Path) -> dict[str, Any]:
            present = [k for k in sf.keys() if k.startswith(prefix) and "/" not in k[len(prefix):]]
            if columns is not None:
                wanted = {prefix + c for c in columns}
                missing = wanted - set(present)
                if missing:
                    raise KeyError(f"{path}: no dataset(s) {sorted(missing)}")
                present = [k for k in present if k in wanted]
            data = {k[len(prefix):]: sf[k] for k in present}
            if group == S.G_TOKENS:
                data["offsets"] = sf["/samples/offsets"]
            return data

        return self._iter_steps(steps, read)


def step_token_frame(sc: StepColumns) -> "pd.DataFrame":
    """The token rows of one step from ``StepColumns`` whose data maps short ``/tokens`` names to
    arrays plus ``"offsets"`` (``/samples/offsets``); see ``TraceReader.token_frame``."""
    import pandas as pd

    off = np.asarray(sc.data.pop("offsets"), dtype=np.int64)
    t = int(off[-1])
    lengths = np.diff(off)
    sample = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    cols: dict[str, Any] = {"step": np.full(t, sc.step, np.int64), "sample": sample,
                            "position": np.arange(t, dtype=np.int64) - off[:-1][sample]}
    for k, v in sc.data.items():
        if np.ndim(v) == 1 and len(v) == t:
            # float16 (entropy) widened: pandas and Parquet writers handle half floats poorly
            cols[k] = v.astype(np.float32) if v.dtype == np.float16 else v
    return pd.DataFrame(cols)
