"""Per-step tables of a run: the one-row-per-step view that ``summary``, ``spikes``, ``diff``,
``golden``/``check`` and ``export`` share.

Sources: the scalars the training loop already logged to ``metrics.jsonl`` (reward, loss,
grad_norm, clipfrac, mismatch — see ``axrl/runtime/recording/builders.py``) are taken from there when the
row has a finite value, because that is what the run itself reported; otherwise, and for every
metric the loop does not log (k3 KL, routing agreement, version lag, …), they are computed from
the step file. ``df.attrs["sources"]`` says which metric came from where.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Iterable, Iterator

import numpy as np
import pandas as pd

from axrl.trace import StepFile, TraceReader
from axrl.trace.chunks import iter_chunks

from .chunked import for_each_step

from .mismatch import MismatchAccumulator, MismatchConfig, resolve_compiled

# metrics.jsonl key → step-table column, for the values the loop logs itself
JSONL_METRICS = {"reward": "reward", "loss": "loss", "grad_norm": "grad_norm", "clipfrac": "clipfrac",
                 "mismatch": "mismatch"}

# Columns of the step table, in display order. Numeric ones are what diff/golden compare.
STEP_COLUMNS = ("step", "policy_version", "reward", "loss", "grad_norm", "clipfrac", "mismatch",
                "mismatch_max", "mismatch_p99", "kl_k3", "ratio_max", "frac_above_tis_cap",
                "routing_agreement", "version_lag_mean", "version_lag_max", "samples", "failed",
                "tokens", "generated_tokens", "advantage_abs_mean", "weights_fingerprint_after")

# Columns of traces with /tokens/behaviour_train_logprob (the split of the mismatch, Δ = Δ_engine +
# Δ_staleness: mean |Δ_engine| and mean |Δ_staleness| per step), placed after ``mismatch_p99``.
SPLIT_STEP_COLUMNS = ("mismatch_engine", "mismatch_staleness")

_STEP_SAMPLE_COLUMNS = ["/samples/reward", "/samples/status", "/train/updates/loss", "/train/updates/grad_norm"]
# trace.level summary steps hold no tokens; their per-sample counts (axrl/runtime/recording/tiers.py) stand in
_STEP_OPTIONAL_COLUMNS = ["/train/updates/clipfrac", "/train/weights_fingerprint_after", "/samples/tokens",
                          "/samples/generated_tokens", "/samples/mismatch_max"]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def _nanmean(a: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    a = a[np.isfinite(a)]
    return float(a.mean()) if a.size else math.nan


def step_table(reader: TraceReader, steps: Iterable[int] | None = None,
               cfg: MismatchConfig | None = None) -> pd.DataFrame:
    """One row per readable step (columns: ``STEP_COLUMNS``). Damaged steps are skipped and land
    in ``reader.problems``."""
    if cfg is None:
        cfg = MismatchConfig.from_run_config(reader.config)
    # per-step headlines only: no top-K, no global percentile buffer
    cfg = replace(cfg, top_k=0, keep_abs=False, plot_points=0, per_step_percentiles=True)
    cfg = resolve_compiled(cfg, [reader.step_path(s) for s in (reader.steps if steps is None else steps)])
    acc = MismatchAccumulator(cfg)
    jsonl = {int(r["step"]): r for r in reader.metrics()}
    required, optional = cfg.columns()
    rows: list[dict[str, Any]] = []
    from_jsonl: dict[str, int] = {c: 0 for c in JSONL_METRICS.values()}
    buffers: dict[str, np.ndarray] = {}    # reused chunk buffers: nothing below keeps an array past its chunk

    def fold(sf: StepFile) -> None:
        small = sf.read_columns(_STEP_SAMPLE_COLUMNS, optional=_STEP_OPTIONAL_COLUMNS)
        advantage = _AbsMean()
        chunks = iter_chunks(sf, required + ["/tokens/advantage"], optional=optional,
                             chunk_tokens=cfg.chunk_tokens, buffers=buffers, fast_checksums=bool(cfg.compiled),
                             stream_routing=bool(cfg.compiled))
        head = acc.add_chunks(sf.step, sf.policy_version, advantage.watch(chunks), sf.num_tokens)
        row = _step_row(sf.step, sf.policy_version, head, small, advantage.value())
        logged = jsonl.get(sf.step, {})
        for key, col in JSONL_METRICS.items():
            if _finite(logged.get(key)):
                row[col] = float(logged[key])
                from_jsonl[col] += 1
        rows.append(row)

    for_each_step(reader, reader.steps if steps is None else steps, fold)
    columns = list(STEP_COLUMNS)
    if acc.split is not None:
        at = columns.index("mismatch_p99") + 1
        columns[at:at] = SPLIT_STEP_COLUMNS
    df = pd.DataFrame(rows, columns=columns)
    if len(df):
        df["version_lag_max"] = df["version_lag_max"].astype("Float64").astype(np.float64)
    df.attrs["sources"] = {col: ("metrics.jsonl" if n == len(rows) and n else
                                 "step files" if n == 0 else "mixed") for col, n in from_jsonl.items()}
    return df


class _AbsMean:
    """mean |advantage| over a step's loss tokens (finite values), summed chunk by chunk: one
    chunk gives numpy's mean of them bit for bit; several add their (pairwise) sums."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def watch(self, chunks: Iterator[Any]) -> Iterator[Any]:
        for ch in chunks:
            a = np.asarray(ch["/tokens/advantage"], dtype=np.float64)[np.asarray(ch["/tokens/loss_mask"]) != 0]
            a = np.abs(a[np.isfinite(a)])
            self.total += float(a.sum())
            self.count += int(a.size)
            yield ch

    def value(self) -> float:
        return self.total / self.count if self.count else math.nan


def _step_row(step: int, pv: int, head: dict[str, Any], small: dict[str, Any], advantage_abs_mean: float) -> dict[str, Any]:
    """One step-table row from the step's headline mismatch metrics and its small datasets."""
    status = np.asarray(small["/samples/status"], dtype=object)
    ok = status == "ok"
    reward = np.asarray(small["/samples/reward"], dtype=np.float64)
    clip = small.get("/train/updates/clipfrac")
    row: dict[str, Any] = {
        "step": step,
        "policy_version": pv,
        "reward": _nanmean(reward[ok]),
        "loss": _nanmean(small["/train/updates/loss"]),
        "grad_norm": _nanmean(small["/train/updates/grad_norm"]),
        "clipfrac": _nanmean(clip) if clip is not None else math.nan,
        "mismatch": head["mean_abs"],
        "mismatch_max": head["max_abs"],
        "mismatch_p99": head["p99_abs"],
        "kl_k3": head["k3"],
        "ratio_max": head["ratio_max"],
        "frac_above_tis_cap": head["frac_above_tis_cap"],
        "routing_agreement": head.get("routing_agreement", math.nan),
        "version_lag_mean": head.get("version_lag_mean", math.nan),
        "version_lag_max": head.get("version_lag_max"),
        "samples": int(status.size),
        "failed": int((~ok).sum()),
        "tokens": head["tokens"],
        "generated_tokens": head["generated"],
        # the loss's natural unit: the spike detector's loss floor scales with it
        "advantage_abs_mean": advantage_abs_mean,
        "weights_fingerprint_after": small.get("/train/weights_fingerprint_after"),
    }
    if small.get("/samples/tokens") is not None:   # a summary step: the counts of the tokens it dropped
        row["tokens"] = int(np.sum(small["/samples/tokens"]))
        row["generated_tokens"] = int(np.sum(small["/samples/generated_tokens"]))
        worst = np.asarray(small["/samples/mismatch_max"], np.float64)
        row["mismatch_max"] = float(np.nanmax(worst)) if np.isfinite(worst).any() else math.nan
    if "engine_mean_abs" in head:
        row["mismatch_engine"], row["mismatch_staleness"] = head["engine_mean_abs"], head["staleness_mean_abs"]
    return row


def numeric_metric_columns(df: pd.DataFrame) -> list[str]:
    """The comparable metric columns of a step table (numbers, not the step index itself)."""
    return [c for c in df.columns if c != "step" and pd.api.types.is_numeric_dtype(df[c])]
