"""`axrl-debug export RUN --format parquet|csv --out DIR`: token-, sample-, update- and step-level
tables for pandas users.

Files written in DIR (created if needed; these names are overwritten, nothing else is touched):

    steps.<ext>    one row per step: the `summary` table (reward, loss, grad_norm, clipfrac,
                   mismatch, kl_k3, routing_agreement, version lag, token counts, fingerprint)
    samples.<ext>  one row per sample: step, sample (row), num_tokens and every /samples column
    updates.<ext>  one row per optimizer update: step, update and every /train/updates metric
    tokens.<ext>   one row per token: step, sample, position (in its sample), every 1-D /tokens
                   column (ids, loss_mask, turn, policy_version, rollout_logprob, old_logprob,
                   advantage, entropy as float32, …) and `delta` = old_logprob − rollout_logprob
                   where the token is analysed (loss_mask = 1, both finite), else NaN. With
                   --routing also routing_rollout_valid and routing_{rollout,train}_l<L>_k<K>.

Join tokens to samples on (step, sample). The token table is written step by step (a Parquet
row group, or CSV rows appended, per step), so exporting a large run does not hold it in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import typer

from axrl.trace import TraceReader
from axrl.trace.reader import StepColumns, step_token_frame
from axrl_debug.analysis.frames import step_table
from axrl_debug.commands.base import JSON_OPTION, BadInput, app, out, print_json, run_command
from axrl_debug.commands._common import STEPS_OPTION_HELP, open_run, report_problems, select_steps

FORMATS = ("parquet", "csv")


class _TableWriter:
    """Appends DataFrames with one fixed column set to a Parquet or CSV file."""

    def __init__(self, path: Path, fmt: str) -> None:
        self.path, self.fmt = path, fmt
        self.columns: list[str] | None = None
        self.rows = 0
        self._pq: Any = None
        self._schema: Any = None
        path.unlink(missing_ok=True)

    def write(self, df: pd.DataFrame) -> None:
        if self.columns is None:
            self.columns = list(df.columns)
        # later steps may lack (or add) optional columns: keep the first step's set, NaN-filled
        df = df.reindex(columns=self.columns)
        if self.fmt == "csv":
            df.to_csv(self.path, mode="a", header=self.rows == 0, index=False)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            if self._pq is None:
                table = pa.Table.from_pandas(df, preserve_index=False)
                self._schema = table.schema
                self._pq = pq.ParquetWriter(self.path, self._schema)
            else:
                table = pa.Table.from_pandas(df, schema=self._schema, preserve_index=False, safe=False)
            self._pq.write_table(table)
        self.rows += len(df)

    def close(self) -> None:
        if self._pq is not None:
            self._pq.close()
        elif self.rows == 0 and self.fmt == "csv":
            pd.DataFrame(columns=self.columns or []).to_csv(self.path, index=False)


def _write_frame(df: pd.DataFrame, path: Path, fmt: str) -> int:
    w = _TableWriter(path, fmt)
    w.write(df)
    w.close()
    return len(df)


def token_table(sc: StepColumns, routing: bool) -> pd.DataFrame:
    """The token rows of one step (``StepColumns`` from ``TraceReader._iter_group``-like reads)."""
    data = dict(sc.data)
    rr, rt, rv = data.pop("/routing/rollout", None), data.pop("/routing/train", None), data.pop("/routing/rollout_valid", None)
    df = step_token_frame(StepColumns(sc.step, sc.path, sc.attrs, data))
    lm = df["loss_mask"].to_numpy() != 0 if "loss_mask" in df else None
    if lm is not None and "old_logprob" in df and "rollout_logprob" in df:
        d = df["old_logprob"].to_numpy(np.float64) - df["rollout_logprob"].to_numpy(np.float64)
        df["delta"] = np.where(lm & np.isfinite(d), d, np.nan)
    if routing:
        if rv is not None:
            df["routing_rollout_valid"] = rv
        for name, arr in (("rollout", rr), ("train", rt)):
            if arr is None:
                continue
            _, nl, k = arr.shape
            for layer in range(nl):
                for j in range(k):
                    df[f"routing_{name}_l{layer}_k{j}"] = arr[:, layer, j]
    return df


def _token_steps(reader: TraceReader, steps: list[int], routing: bool):
    """Yield StepColumns with the offsets, every 1-D /tokens dataset and (optionally) /routing."""
    for step in steps:
        try:
            with reader.open(step) as sf:
                names = [k for k in sf.keys() if k.startswith("/tokens/") and k.count("/") == 2]
        except Exception as e:
            reader.report_problem(reader.step_files().get(step, reader.trace_dir), str(e))
            continue
        optional = ["/routing/rollout", "/routing/train", "/routing/rollout_valid"] if routing else []
        for sc in reader.iter_columns(["/samples/offsets", *names], [step], optional=optional):
            data = {("offsets" if k == "/samples/offsets" else k[len("/tokens/"):] if k.startswith("/tokens/") else k): v
                    for k, v in sc.data.items()}
            yield StepColumns(sc.step, sc.path, sc.attrs, data)


@app.command()
def export(
    run: Path = typer.Argument(..., help="Run directory."),
    fmt: str = typer.Option("parquet", "--format", "-f", help="parquet or csv."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Output directory (steps/samples/updates/tokens.<ext>)."),
    steps: str = typer.Option(None, "--steps", help=STEPS_OPTION_HELP),
    routing: bool = typer.Option(False, "--routing", help="Add the MoE routing columns to tokens.<ext>."),
    json_out: bool = JSON_OPTION,
) -> None:
    """Export token-, sample-, update- and step-level tables as Parquet or CSV
    (DIR/tokens.<ext>, DIR/samples.<ext>, DIR/updates.<ext>, DIR/steps.<ext>)."""

    def body() -> int:
        if fmt not in FORMATS:
            raise BadInput(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if out_dir.exists() and not out_dir.is_dir():
            raise BadInput(f"--out must be a directory, {out_dir} is a file")
        reader = open_run(run)
        chosen = select_steps(reader, None, steps)
        out_dir.mkdir(parents=True, exist_ok=True)
        ext = fmt
        files: dict[str, str] = {}
        rows: dict[str, int] = {}
        tw = _TableWriter(out_dir / f"tokens.{ext}", fmt)
        for sc in _token_steps(reader, chosen, routing):
            tw.write(token_table(sc, routing))
        tw.close()
        files["tokens"], rows["tokens"] = str(tw.path), tw.rows
        for name, df in (("samples", reader.sample_frame(chosen)), ("updates", reader.update_frame(chosen)),
                         ("steps", step_table(reader, chosen))):
            p = out_dir / f"{name}.{ext}"
            rows[name] = _write_frame(df, p, fmt)
            files[name] = str(p)
        problems = report_problems(reader)
        if json_out:
            print_json({"run": str(reader.path), "format": fmt, "files": files, "rows": rows, "problems": problems})
        else:
            for name in ("steps", "samples", "updates", "tokens"):
                out.print(f"{files[name]}  ({rows[name]} rows)", highlight=False)
        return 0

    run_command(body)
