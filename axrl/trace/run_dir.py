"""The run directory: layout, manifest.json, config.yaml, metrics.jsonl, step files, resume helpers.

```
run_dir/
  manifest.json   config.yaml   metrics.jsonl
  trace/step_000000.h5 ...
  checkpoints/step_000000/ ...
```
Every whole-file write (manifest, config, truncated metrics) goes through tmp + fsync + os.replace;
metrics lines are appended, flushed and fsynced one at a time.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import yaml

from . import schema as S
from .shards import remove_shards, stray_shard_dirs
from .writer import StepRecord, fsync_dir, write_step


# ============================================================================ helpers
def cpu_facts() -> dict[str, Any]:
    """What decides which CPU kernels torch runs, hence the rounding of every float op.

    The same torch build, thread count and config give the same bits only on CPUs that dispatch
    to the same kernels: the model name alone is not enough (VMs report a generic "Xeon"), so the
    instruction-set flags are recorded as a digest, with torch's own dispatch level.
    """
    model, flags = None, ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    torch = sys.modules.get("torch")
    return {"cpu_model": model or platform.processor() or None,
            "cpu_capability": torch.backends.cpu.get_cpu_capability() if torch is not None else None,
            "cpu_flags": hashlib.sha1(flags.encode()).hexdigest()[:12] if flags else None}


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via ``path.tmp`` + fsync + os.replace + directory fsync."""
    path = Path(path)
    tmp = path.with_name(path.name + S.TMP_SUFFIX)
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item") and getattr(o, "ndim", 0) == 0:
        return o.item()                         # numpy / torch scalars
    if hasattr(o, "tolist"):
        return o.tolist()                       # small arrays
    if isinstance(o, (Path, os.PathLike)):
        return os.fspath(o)
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _finite_or_null(value: Any) -> Any:
    """`value` with every NaN / ±Infinity (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_null(v) for v in value]
    return value


def list_step_files(trace_dir: Path) -> dict[int, Path]:
    """Final step files (``step_XXXXXX.h5``) in ``trace_dir`` by step number; ``*.tmp`` are ignored."""
    out: dict[int, Path] = {}
    if not trace_dir.is_dir():
        return out
    for p in trace_dir.iterdir():
        step = S.parse_step_file_name(p.name)
        if step is not None and p.is_file():
            out[step] = p
    return dict(sorted(out.items()))


def read_metrics_file(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Parse metrics.jsonl: (rows, problems). A line that does not parse as a JSON object (e.g. cut by
    a crash) is skipped and reported as ``'metrics.jsonl:LINE: reason'``."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    if not path.exists():
        return rows, problems
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                problems.append(f"{path}:{lineno}: unparseable line ({e})")
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                problems.append(f"{path}:{lineno}: not an object with an int 'step'")
                continue
            rows.append(row)
    return rows, problems


def _git_info(where: Path) -> tuple[str | None, bool | None]:
    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                                 timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout.strip()

    sha = git("rev-parse", "HEAD")
    if not sha:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return sha, (None if status is None else bool(status))


def _dist_version(name: str) -> str | None:
    mod = sys.modules.get(name)
    if mod is not None and isinstance(getattr(mod, "__version__", None), str):
        return mod.__version__
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ============================================================================ RunDir
class RunDir:
    """A run directory. ``RunDir(path)`` creates ``path/``, ``trace/`` and ``checkpoints/``."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True) -> None:
        self.path = Path(path)
        if create:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise FileNotFoundError(f"run directory not found: {self.path}")

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ---- paths
    @property
    def trace_dir(self) -> Path:
        return self.path / S.TRACE_DIR

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / S.CHECKPOINTS_DIR

    @property
    def manifest_path(self) -> Path:
        return self.path / S.MANIFEST_FILE

    @property
    def config_path(self) -> Path:
        return self.path / S.CONFIG_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / S.METRICS_FILE

    def step_path(self, step: int) -> Path:
        return self.trace_dir / S.step_file_name(step)

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / S.CHECKPOINT_DIR_FORMAT.format(step=int(step))

    # ---- manifest
    def write_manifest(self, *, seed: int | None = None, backend: str | None = None,
                       engine: str | None = None, backend_version: str | None = None,
                       engine_version: str | None = None, threads: int | None = None,
                       command: list[str] | None = None, extra: Mapping[str, Any] | None = None,
                       model: str | None = None, source: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write manifest.json (atomically) and return it. Missing facts are recorded as null.

        ``model`` and ``source`` are written only when given: a run written by ``axrl.trace.Recorder``
        (recorded or imported from another framework) names its model and where its data came from
        (``source``; its presence tells replay the run has no AxRL checkpoints)."""
        from .. import __version__ as axrl_version

        sha, dirty = _git_info(Path(__file__).resolve().parent)
        if threads is None and "torch" in sys.modules:
            threads = sys.modules["torch"].get_num_threads()
        now = time.time()
        try:
            import h5py
            hdf5_version = h5py.version.hdf5_version
        except Exception:  # pragma: no cover
            hdf5_version = None
        manifest: dict[str, Any] = {
            "schema_version": S.SCHEMA_VERSION,
            "axrl_version": axrl_version,
            "git_sha": sha,
            "git_dirty": dirty,
            "versions": {
                "python": platform.python_version(),
                "torch": _dist_version("torch"),
                "numpy": _dist_version("numpy"),
                "h5py": _dist_version("h5py"),
                "hdf5": hdf5_version,
            },
            "backend": backend,
            "backend_version": backend_version,
            "engine": engine,
            "engine_version": engine_version,
            "seed": seed,
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            **cpu_facts(),
            "threads": threads,
            "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
                           if k in os.environ},
            "command": list(sys.argv if command is None else command),
            "cwd": os.getcwd(),
            "pid": os.getpid(),
            "start_time": _dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(),
            "start_unix": now,
            "resumes": [],
        }
        if extra:
            manifest["extra"] = dict(extra)
        if model is not None:
            manifest["model"] = model
        if source is not None:
            manifest["source"] = dict(source)
        atomic_write_text(self.manifest_path, json.dumps(manifest, indent=2, default=_json_default) + "\n")
        return manifest

    def read_manifest(self) -> dict[str, Any]:
        with open(self.manifest_path, encoding="utf-8") as fh:
            return json.load(fh)

    def record_resume(self, from_step: int, *, command: list[str] | None = None) -> dict[str, Any]:
        """Append ``{time, from_step, command, pid}`` to the manifest's ``resumes`` list."""
        manifest = self.read_manifest()
        manifest.setdefault("resumes", []).append({
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "from_step": int(from_step),
            "command": list(sys.argv if command is None else command),
            "pid": os.getpid(),
        })
        atomic_write_text(self.manifest_path, json.dumps(manifest, indent=2, default=_json_default) + "\n")
        return manifest

    # ---- config
    def write_config(self, config: Mapping[str, Any] | Any) -> Path:
        """Write the fully resolved config as YAML (``yaml.safe_dump``, key order kept)."""
        if hasattr(config, "model_dump"):
            config = config.model_dump(mode="json")
        data = json.loads(json.dumps(dict(config), default=_json_default))  # plain types only
        atomic_write_text(self.config_path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
        return self.config_path

    def read_config(self) -> dict[str, Any]:
        with open(self.config_path, encoding="utf-8") as fh:
            return yaml.safe_load(fh) or {}

    # ---- metrics
    def append_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Append one JSON line (must contain an int ``step``); flushed and fsynced before returning.

        Strict JSON: a non-finite float (a metric that could not be measured) is written as null."""
        step = metrics.get("step")
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
            raise ValueError(f"metrics need an int 'step', got {step!r}")
        row = _finite_or_null(json.loads(json.dumps(dict(metrics), default=_json_default)))
        row["step"] = int(step)
        line = json.dumps(row, allow_nan=False)
        if "\n" in line:  # pragma: no cover - json.dumps never emits raw newlines
            raise ValueError("metrics line contains a newline")
        with open(self.metrics_path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        """All parseable rows of metrics.jsonl (a line cut by a crash is skipped)."""
        return read_metrics_file(self.metrics_path)[0]

    # ---- steps
    def write_step(self, record: StepRecord, **kwargs: Any) -> Path:
        return write_step(self.trace_dir, record, **kwargs)

    def completed_steps(self) -> list[int]:
        """Sorted steps that have a final ``trace/step_XXXXXX.h5`` (``*.tmp`` ignored)."""
        return list(list_step_files(self.trace_dir))

    def tmp_files(self) -> list[Path]:
        """Temp files a crash left: in the run root, trace/ and the shard directories of trace/."""
        dirs = [self.path, self.trace_dir]
        if self.trace_dir.is_dir():
            dirs += [d for d in self.trace_dir.iterdir() if S.SHARDS_DIR_RE.match(d.name) and d.is_dir()]
        out = [p for d in dirs if d.is_dir() for p in d.iterdir() if p.name.endswith(S.TMP_SUFFIX) and p.is_file()]
        return sorted(out)

    def clean_tmp(self) -> list[Path]:
        """Remove stray ``*.tmp`` files left by a crash (run root and trace/); return them."""
        removed = self.tmp_files()
        for p in removed:
            p.unlink(missing_ok=True)
        for d in stray_shard_dirs(self.trace_dir):   # shards of a step whose index never landed
            shutil.rmtree(d)
            removed.append(d)
        if removed:
            fsync_dir(self.trace_dir)
            fsync_dir(self.path)
        return removed

    def truncate_after(self, step: int) -> list[Path]:
        """Forget everything after ``step`` (for resume): delete step files > ``step`` and stray tmp
        files, and atomically rewrite metrics.jsonl keeping only rows with step <= ``step`` (unparseable
        lines are dropped). ``step = -1`` empties the run. Checkpoints are left alone. Returns the
        deleted step files."""
        step = int(step)
        self.clean_tmp()
        if self.metrics_path.exists():
            rows, _ = read_metrics_file(self.metrics_path)
            kept = [json.dumps(_finite_or_null(r), allow_nan=False) + "\n" for r in rows if r["step"] <= step]
            atomic_write_text(self.metrics_path, "".join(kept))
        removed = []
        for s, p in list_step_files(self.trace_dir).items():
            if s > step:
                p.unlink()
                remove_shards(self.trace_dir, s)   # after its index: never an index without its shards
                removed.append(p)
        if removed:
            fsync_dir(self.trace_dir)
        return removed

