"""What the TUI shows, loaded lazily from a run directory.

Opening a run reads only ``metrics.jsonl`` and the listing of ``trace/`` (no step file is opened),
so the first screen of a 1,000-step run appears at once. A step file is read when the user opens
that step (``RunModel.step``), and of a sample only its token range is read
(``StepFile.read_slice``) when the user opens that sample. Metrics the loop does not log
(max |Δ|, k3, routing agreement, version lag) are filled in by a background scan that reuses
``axrl_debug.analysis.frames.step_table`` a few steps at a time.

Nothing here imports textual, so the data layer is testable and reusable on its own; pandas (for
the analysis frames and spike detection) is imported only off the startup path.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import h5py
import numpy as np

from axrl.trace import StepFile, TraceError, TraceReader
from axrl.trace.run_dir import read_metrics_file

from . import metrics as M

# Per-step scalars taken from metrics.jsonl (what the training loop itself logged).
JSONL_KEYS = ("policy_version", "reward", "loss", "grad_norm", "clipfrac", "mismatch", "entropy",
              "samples", "failed", "generated_tokens")
# Per-step metrics only the step files have (``analysis.frames.step_table`` columns, filled in by
# the background scan) ...
SCAN_ONLY = ("mismatch_max", "kl_k3", "routing_agreement", "version_lag_mean", "advantage_abs_mean")
# ... and every step_table column the TUI uses (the loop's own metrics.jsonl value wins when both exist).
SCAN_KEYS = SCAN_ONLY + ("reward", "loss", "grad_norm", "clipfrac", "mismatch", "samples", "failed",
                         "generated_tokens", "policy_version")


class RunOpenError(Exception):
    """The path is not a readable run (message says why); the CLI maps it to exit code 2."""


def _num(v: Any) -> float:
    """A metrics.jsonl value as float (NaN for missing / non-numeric, e.g. finish_reasons)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


def replay_dump_path(run: Path, step: int) -> Path | None:
    """``RUN/replay/step_XXXXXX.h5`` (``replay.dump.dump_path``; also ``step_N.h5``) if replay
    dumped this step. The same lookup as ``axrl_debug.analysis.spikes.replay_dump_path``, not
    imported from there because that module imports pandas (~0.5 s) and ``replay.dump`` imports
    torch: opening a step must not wait for either."""
    for name in (f"step_{step:06d}.h5", f"step_{step}.h5"):
        p = Path(run) / "replay" / name
        if p.is_file():
            return p
    return None


# ============================================================================ run
class RunModel:
    """A run directory, opened lazily. ``rows[step]`` holds the step's scalars (NaN = unknown)."""

    def __init__(self, path: str | os.PathLike, *, cache_steps: int = 8, against: str = "trainer") -> None:
        self.path = Path(path)
        # What the rollout logprob is compared with in the token view: the trainer's old_logprob, or
        # (an on-policy distillation run) the teacher's teacher_logprob, as `mismatch --against`.
        self.against = against
        try:
            # validate=False: validation opens every step file; the TUI reports a damaged file
            # when the user opens that step instead.
            self.reader = TraceReader(self.path, validate=False)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise RunOpenError(str(e)) from None
        except TraceError as e:
            raise RunOpenError(f"cannot read run {self.path}: {e}") from None
        self.files: dict[int, Path] = self.reader.step_files()
        metrics, self.problems = read_metrics_file(self.reader.path / "metrics.jsonl")
        self.jsonl: dict[int, dict[str, Any]] = {int(r["step"]): r for r in metrics}
        steps = sorted(set(self.files) | set(self.jsonl))
        if not steps:
            raise RunOpenError(f"no steps in {self.path} (no trace/step_*.h5 and no metrics.jsonl lines)")
        self.steps: list[int] = steps
        self.rows: dict[int, dict[str, float]] = {}
        for s in steps:
            logged = self.jsonl.get(s, {})
            row = {k: _num(logged.get(k)) for k in JSONL_KEYS}
            row.update({k: math.nan for k in SCAN_ONLY})
            self.rows[s] = row
        self.scanned: set[int] = set()
        self.unreadable: set[int] = set()       # step files the scan could not read
        self.spikes: dict[int, list[dict[str, Any]]] = {}
        self._cache: OrderedDict[int, StepModel] = OrderedDict()
        self._cache_size = cache_steps
        self._config: dict[str, Any] | None = None
        self._tokenizer: Any = None
        self.is_moe = False  # known once a step with /routing has been read

    # ---- run-level facts
    @property
    def name(self) -> str:
        return self.path.resolve().name or str(self.path)

    @property
    def config(self) -> dict[str, Any]:
        if self._config is None:
            try:
                self._config = self.reader.config or {}
            except Exception:  # a broken config.yaml must not stop the inspection of the trace
                self._config = {}
        return self._config

    @property
    def dtype(self) -> str:
        """The run's ``model.dtype`` (the spike detector's rounding floor depends on it)."""
        model = self.config.get("model") if isinstance(self.config, dict) else None
        return str((model or {}).get("dtype") or "float32")

    @property
    def tokenizer(self) -> Any:
        """The run's tokenizer: the model directory's when the config names one (and it is still
        there), else the default."""
        if self._tokenizer is None:
            from axrl.tokenizer import run_tokenizer

            self._tokenizer = run_tokenizer(self.config)
        return self._tokenizer

    def series(self, key: str, steps: Iterable[int] | None = None) -> np.ndarray:
        """One metric over steps (ascending step order by default), NaN where unknown."""
        return np.array([self.rows[s].get(key, math.nan) for s in (self.steps if steps is None else steps)],
                        dtype=np.float64)

    # ---- background enrichment (run in a helper process by the app; in-process here for tests)
    def merge_scan(self, results: dict[int, dict[str, float]]) -> list[int]:
        """Merge ``scan_steps`` results into ``rows``; the loop's own logged value (metrics.jsonl)
        wins where it exists. Returns the steps updated."""
        for s, values in results.items():
            row = self.rows.get(s)
            if row is None:
                continue
            for key, v in values.items():
                if key in SCAN_ONLY or not math.isfinite(row.get(key, math.nan)):
                    row[key] = v
            if math.isfinite(row.get("routing_agreement", math.nan)):
                self.is_moe = True
        self.scanned.update(results)
        return list(results)

    def scan(self, steps: list[int]) -> list[int]:
        """Compute and merge the step-file metrics of ``steps`` in this process."""
        present = [s for s in steps if s in self.files]
        done = self.merge_scan(scan_steps(str(self.path), present) if present else {})
        self.scanned.update(steps)
        return done

    def spike_series(self) -> dict[str, list[float]]:
        """Every per-step scalar (the spike config picks its metrics in the helper process, so
        the UI process need not import the pandas-based spikes module)."""
        return {k: self.series(k).tolist() for k in (*JSONL_KEYS, *SCAN_ONLY)}

    def detect_spikes(self) -> dict[int, list[dict[str, Any]]]:
        """Spike flags over the per-step scalars, in this process (see ``detect_spikes``)."""
        self.spikes = detect_spikes(self.steps, self.spike_series(), self.dtype)
        return self.spikes

    # ---- steps (lazy, cached)
    def step(self, step: int) -> "StepModel":
        """The step's samples table; reads that step file only (and caches a few)."""
        if step in self._cache:
            self._cache.move_to_end(step)
            return self._cache[step]
        path = self.files.get(step)
        if path is None:
            raise TraceError(f"step {step} has a metrics.jsonl line but no step file in {self.reader.trace_dir}")
        model = StepModel.load(self, step, path)
        self._cache[step] = model
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return model


# ============================================================================ helper-process entry points
# The app runs these in a separate process (multiprocessing, spawn): reading 1,000 step files and
# building pandas frames holds the GIL for seconds, which in a thread made every key press wait.
# Arguments and results are plain lists / dicts (cheap to pickle).
_READERS: dict[str, tuple[TraceReader, Any]] = {}


def scan_steps(path: str, steps: list[int]) -> dict[int, dict[str, float]]:
    """Step-file metrics of ``steps`` via ``axrl_debug.analysis.frames.step_table``, as
    ``{step: {key: value}}`` for ``SCAN_KEYS``. Unreadable steps are simply absent."""
    from axrl_debug.analysis.frames import step_table
    from axrl_debug.analysis.mismatch import MismatchConfig

    if path not in _READERS:
        reader = TraceReader(path, validate=False)
        try:
            config = reader.config or {}
        except Exception:
            config = {}
        _READERS[path] = (reader, MismatchConfig.from_run_config(config))
    reader, cfg = _READERS[path]
    df = step_table(reader, steps, cfg)
    return {int(rec["step"]): {key: _num(rec.get(key)) for key in SCAN_KEYS}
            for rec in df.to_dict(orient="records")}


def detect_spikes(steps: list[int], series: dict[str, list[float]],
                  dtype: str = "float32") -> dict[int, list[dict[str, Any]]]:
    """Spike flags (``axrl_debug.analysis.spikes.detect`` with its default config for a run of
    ``dtype``, as ``summary`` uses it) by step: ``{step: [{metric, value, baseline, z, direction, ...}]}``."""
    import pandas as pd

    from axrl_debug.analysis.spikes import ADVANTAGE_SCALE, SpikeConfig, detect

    cfg = SpikeConfig(dtype=dtype)
    df = pd.DataFrame({"step": steps, **{m: series[m] for m in (*cfg.metrics, ADVANTAGE_SCALE) if m in series}})
    _, spikes = detect(df, cfg)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for sp in spikes:
        by_step.setdefault(int(sp["step"]), []).append(sp)
    return by_step


# ============================================================================ step
# Steps above this many tokens open without their per-sample routing agreement, filled in once the
# samples screen is up (``StepModel.fill_routing``): a 1 M-token 48-layer step holds 400–770 MB of
# stored routing, and comparing it needs the compiled kernels (numba's start alone is ~0.3 s).
LAZY_ROUTING_TOKENS = 1 << 16


# ``fill_routing(rows)`` reads the rows on screen sample by sample, unless they hold more than this
# share of the step's tokens: then the whole step streamed in one compiled pass costs less (a
# 1 M-token step of 64 samples × 16 k tokens shows most of itself on one screen).
STREAM_ROUTING_SHARE = 0.25


def _routing_layers(sf: StepFile) -> int:
    """MoE layers of the step's routing (0 without both routing arrays), from one row."""
    if "/routing/rollout" not in sf or "/routing/train" not in sf or sf.num_tokens == 0:
        return 0
    return int(sf.read_slice("/routing/rollout", 0, 1).shape[1])


def _sample_routing_agree(sf: StepFile, a: int, b: int) -> float:
    """The routing agreement of the sample of tokens ``a:b``, from its rows of the routing alone."""
    cols = {name: sf.read_slice(name, a, b) for name in M.SAMPLE_ROUTING_COLUMNS if name in sf}
    # compiled (numba's kernels: the column is filled after the first screen, where loading them
    # delays nothing) — the same count as the whole-step pass, ~10× faster than numpy's
    return float(M._routing_agree(np.array([0, b - a], np.int64), cols, compiled=True)[0])


_SAMPLE_COLS = ("sample_id", "group_id", "reward", "status", "finish_reason", "num_turns", "prompt_len",
                "error", "prompt_id", "advantage", "session_id", "fork_of", "fork_cause",
                "drift_tokens")


@dataclass
class StepModel:
    """The samples of one step with their per-sample mismatch figures."""

    run: RunModel
    step: int
    path: Path
    policy_version: int
    offsets: np.ndarray
    samples: dict[str, np.ndarray]
    stats: M.SampleStats
    generated: np.ndarray                 # loss-mask tokens per sample
    num_layers: int = 0                   # MoE layers (0 = dense / not recorded)
    replay_path: Path | None = None
    replay_tokens: dict[str, np.ndarray] = field(default_factory=dict)  # /tokens/* of the replay dump
    replay_loss: np.ndarray | None = None  # per-sample Σ loss_contribution from the replay dump
    problems: list[str] = field(default_factory=list)
    routing_pending: bool = False          # stats.routing_agree not computed yet (``fill_routing``)
    routing_filled: set[int] = field(default_factory=set)   # rows ``fill_routing`` has computed

    @property
    def num_samples(self) -> int:
        return int(self.offsets.size) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1]) if self.offsets.size else 0

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    @classmethod
    def load(cls, run: RunModel, step: int, path: Path) -> "StepModel":
        """The step's samples table, its token columns read chunk by chunk (memory bounded by the
        chunk, not the step). On a step of more than ``LAZY_ROUTING_TOKENS`` tokens the per-sample
        routing agreement is left NaN (``routing_pending``) for ``fill_routing`` to compute after
        the first screen is up: reading the routing is most of such a step."""
        with StepFile(path) as sf:
            samples = {name: sf[f"/samples/{name}"] for name in _SAMPLE_COLS if f"/samples/{name}" in sf}
            pv = sf.policy_version
            layers = _routing_layers(sf)
            pending = bool(layers) and sf.num_tokens > LAZY_ROUTING_TOKENS
            stats, generated = M.chunked_sample_stats(sf, routing=bool(layers) and not pending)
            off = np.asarray(sf["/samples/offsets"], dtype=np.int64)
        n = off.size - 1
        if layers:
            run.is_moe = True
        model = cls(run=run, step=step, path=path, policy_version=pv, offsets=off, samples=samples,
                    stats=stats, generated=generated, num_layers=layers, routing_pending=pending)
        model.replay_path = replay_dump_path(run.path, step)
        if model.replay_path is not None:
            dump = read_replay_tokens(model.replay_path, int(off[-1]), model.problems)
            sample_loss = dump.pop("/samples/loss", None)
            model.replay_tokens = dump
            lc = dump.get("loss_contribution")
            if sample_loss is not None and sample_loss.shape == (n,):
                model.replay_loss = np.asarray(sample_loss, dtype=np.float64)
            elif lc is not None:
                with StepFile(path) as sf:
                    lm = np.asarray(sf["/tokens/loss_mask"]) != 0
                sample_of = np.repeat(np.arange(n), np.diff(off))
                per_token = np.nansum(lc.reshape(lc.shape[0], -1), axis=1)
                model.replay_loss = np.bincount(sample_of, weights=np.where(lm, per_token, 0.0), minlength=n)
        return model

    def fill_routing(self, rows: Iterable[int] | None = None) -> int:
        """Compute the per-sample routing agreement left pending by ``load``.

        ``rows``: the sample rows on screen. Only their token ranges of the routing are read and
        decoded (``read_slice``), each row once; the others stay NaN until they are asked for —
        unless those rows hold more than ``STREAM_ROUTING_SHARE`` of the step's tokens, when the
        whole step is streamed instead. The values are the whole step's (``chunked_routing_agree``:
        the same share of valid (row, layer) pairs). ``None``: every row still pending, the
        routing pair streamed as stored. Returns the rows computed."""
        if not self.routing_pending:
            return 0
        n = self.num_samples
        if rows is not None:
            todo = sorted({int(i) for i in rows if 0 <= int(i) < n} - self.routing_filled)
            if sum(self.length(i) for i in todo) > STREAM_ROUTING_SHARE * self.num_tokens:
                rows = None     # most of the step on screen (few long samples): one streamed pass is cheaper
        if rows is None:
            with StepFile(self.path) as sf:
                agree = M.chunked_routing_agree(sf)
            todo = [i for i in range(n) if i not in self.routing_filled]
            self.stats.routing_agree[todo] = agree[todo]
        elif todo:
            with StepFile(self.path) as sf:
                for i in todo:
                    self.stats.routing_agree[i] = _sample_routing_agree(sf, int(self.offsets[i]), int(self.offsets[i + 1]))
        self.routing_filled.update(todo)
        self.routing_pending = len(self.routing_filled) < n
        return len(todo)

    def sample(self, i: int) -> "SampleTokens":
        """The tokens of sample row ``i`` (reads only its token range of the step file)."""
        return SampleTokens.load(self, i)


# Datasets a replay dump copies from the step file: nothing new to show.
_REPLAY_COPIES = frozenset({"ids", "loss_mask"})


def read_replay_tokens(path: Path, num_tokens: int, problems: list[str]) -> dict[str, np.ndarray]:
    """Per-token datasets of a replay dump (``replay/dump.py``: ``/tokens/<name>`` [T] or [T, A]),
    plus ``"/samples/loss"`` when present. Tolerant: a damaged or foreign dump becomes a problem
    line, never an exception, because the trace itself is still worth inspecting."""
    out: dict[str, np.ndarray] = {}
    try:
        with h5py.File(path, "r") as f:
            group = f.get("tokens")
            if isinstance(group, h5py.Group):
                for name, ds in group.items():
                    if (name in _REPLAY_COPIES or not isinstance(ds, h5py.Dataset)
                            or ds.dtype.kind not in "fiub" or ds.ndim == 0):
                        continue
                    a = ds[()]
                    if a.shape[0] == num_tokens:
                        out[name] = a
                    elif a.shape[-1] == num_tokens:  # an update axis first: tokens first, like the rest
                        out[name] = np.moveaxis(a, -1, 0)
            loss = f.get("samples/loss")
            if isinstance(loss, h5py.Dataset) and loss.ndim == 1:
                out["/samples/loss"] = loss[()]
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        problems.append(f"{path}: replay dump unreadable ({e})")
    return out


# ============================================================================ sample
def value_error(loss_mask: np.ndarray, value: np.ndarray, ret: np.ndarray) -> np.ndarray:
    """float64 [n]: V − return on the trained tokens (`--against value`), NaN elsewhere (and
    everywhere in a step without /tokens/value: a critic-free run has nothing to colour)."""
    e = np.asarray(value, np.float64) - np.asarray(ret, np.float64)
    return np.where(np.asarray(loss_mask) > 0, e, np.nan)


_TOKEN_COLS = ("ids", "loss_mask", "turn", "policy_version", "rollout_logprob", "old_logprob",
               "advantage", "entropy", "behaviour_train_logprob", "is_weight", "loss_rule", "teacher_logprob",
               "value", "return")


@dataclass
class SampleTokens:
    """One sample's tokens with everything the token screen shows (arrays of length n)."""

    step: StepModel
    row: int
    start: int                              # first token's index in the step's /tokens arrays
    data: dict[str, np.ndarray]             # _TOKEN_COLS present in the file (short names)
    delta: np.ndarray                       # Δ, NaN where not analysed
    text: list[str]                         # decoded token pieces
    routing_rollout: np.ndarray | None = None   # [n, L, k]
    routing_train: np.ndarray | None = None
    routing_valid: np.ndarray | None = None     # bool [n]
    layer_agree: np.ndarray | None = None       # bool [n, L]
    replay: dict[str, np.ndarray] = field(default_factory=dict)
    # Δ = Δ_engine + Δ_staleness (NaN where it does not split); None without behaviour_train_logprob
    engine_delta: np.ndarray | None = None
    staleness_delta: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.text)

    @classmethod
    def load(cls, step: StepModel, row: int) -> "SampleTokens":
        a, b = int(step.offsets[row]), int(step.offsets[row + 1])
        data: dict[str, np.ndarray] = {}
        rr = rt = rv = None
        with StepFile(step.path) as sf:
            for name in _TOKEN_COLS:
                if f"/tokens/{name}" in sf:
                    data[name] = sf.read_slice(f"/tokens/{name}", a, b)
            if "/routing/rollout" in sf and "/routing/train" in sf:
                rr = sf.read_slice("/routing/rollout", a, b)
                rt = sf.read_slice("/routing/train", a, b)
                rv = (sf.read_slice("/routing/rollout_valid", a, b) != 0) if "/routing/rollout_valid" in sf \
                    else np.ones(b - a, dtype=bool)
        n = b - a
        nan = np.full(n, np.nan, np.float32)
        compared = "teacher_logprob" if step.run.against == "teacher" else "old_logprob"
        delta = M.token_delta(data.get("loss_mask", np.zeros(n, np.uint8)),
                              data.get("rollout_logprob", nan), data.get(compared, nan))
        if step.run.against == "value":  # a PPO critic's value error V − return on trained tokens
            delta = value_error(data.get("loss_mask", np.zeros(n, np.uint8)), data.get("value", nan),
                                data.get("return", nan))
        text = decode_pieces(step.run.tokenizer, data.get("ids", np.zeros(0, np.int32)))
        tokens = cls(step=step, row=row, start=a, data=data, delta=delta, text=text,
                     routing_rollout=rr, routing_train=rt, routing_valid=rv)
        if rr is not None and rt is not None:
            tokens.layer_agree = M.layer_agreement(rr, rt)
        tokens.replay = {k: v[a:b] for k, v in step.replay_tokens.items()}
        if "behaviour_train_logprob" in data:
            tokens.engine_delta, tokens.staleness_delta = M.token_split(
                data.get("loss_mask", np.zeros(n, np.uint8)), data.get("rollout_logprob", nan),
                data.get("old_logprob", nan), data["behaviour_train_logprob"])
        return tokens

    # ---- derived, per token
    def get(self, name: str, i: int, default: float = math.nan) -> Any:
        a = self.data.get(name)
        return default if a is None else a[i].item()

    def disagrees(self) -> np.ndarray:
        """bool [n]: the token's routing row is valid and some layer's expert set differs."""
        if self.layer_agree is None or self.routing_valid is None:
            return np.zeros(self.n, dtype=bool)
        return self.routing_valid & ~self.layer_agree.all(axis=1)

    def segments(self) -> np.ndarray:
        """int [n]: segment id; a new segment starts where the turn or the trained/untrained
        (loss_mask) state changes — prompt, assistant turn, tool/env output, next turn, ..."""
        n = self.n
        if n == 0:
            return np.zeros(0, np.int64)
        lm = self.data.get("loss_mask", np.zeros(n, np.uint8)) != 0
        turn = self.data.get("turn", np.zeros(n, np.int16))
        change = np.zeros(n, dtype=bool)
        change[1:] = (lm[1:] != lm[:-1]) | (turn[1:] != turn[:-1])
        return np.cumsum(change)

    def objective_marks(self) -> tuple[np.ndarray, np.ndarray]:
        """bool [n] pair (masked, clipped): loss tokens the corrections gave weight 0 (MIS, veto,
        IcePop) and tokens the objective hard-clipped (`/tokens/loss_rule` bits 1 | 2 | 4)."""
        n = self.n
        rule = self.data.get("loss_rule")
        weight = self.data.get("is_weight")
        masked = np.zeros(n, dtype=bool) if weight is None else (np.asarray(weight) == 0)
        clipped = np.zeros(n, dtype=bool) if rule is None else (np.asarray(rule).astype(np.int64) & 7) != 0
        return masked, clipped & ~masked

    def segment_kind(self, i: int) -> str:
        """'prompt', 'assistant' (generated, trained) or 'tool/env' (inserted by the environment)."""
        if self.get("loss_mask", i, 0):
            return "assistant"
        return "prompt" if int(self.get("turn", i, 0)) == 0 else "tool/env"


_PRINTABLE = {"\n": "↵", "\t": "⇥", "\r": "␍"}


def display_piece(s: str) -> str:
    """A decoded token as visible text: control characters become symbols (↵ keeps its line break
    in the token screen), the empty string a middle dot, so every token occupies ≥ 1 cell."""
    if not s:
        return "·"
    out = []
    for ch in s:
        if ch in _PRINTABLE:
            out.append(_PRINTABLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(chr(0x2400 + ord(ch)) if ord(ch) < 32 else "␡")
        else:
            out.append(ch)
    return "".join(out)


def decode_pieces(tokenizer: Any, ids: np.ndarray) -> list[str]:
    """Each id decoded on its own (the trace stores ids). Ids outside the vocabulary show as ⟨id⟩.
    Decoding goes through a per-tokenizer cache: a sample repeats few distinct ids."""
    cache: dict[int, str] = getattr(tokenizer, "_axrl_tui_cache", None) or {}
    try:
        setattr(tokenizer, "_axrl_tui_cache", cache)
    except AttributeError:
        pass
    out: list[str] = []
    for i in np.asarray(ids).tolist():
        s = cache.get(i)
        if s is None:
            try:
                s = tokenizer.decode([i]) if 0 <= i < tokenizer.vocab_size else f"⟨{i}⟩"
            except Exception:
                s = f"⟨{i}⟩"
            cache[i] = s
        out.append(s)
    return out
