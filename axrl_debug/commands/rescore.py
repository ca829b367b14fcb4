"""`axrl-debug replay RUN --step N --rollout --engine sglang|vllm`: the step's recorded token streams
re-scored on a server (replay/server_rescore.py), that engine's mismatch against the trainer beside
the recorded engine's, on the same tokens, with the breakdowns of `axrl-debug mismatch`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from axrl_debug.analysis.mismatch import MismatchAccumulator, MismatchConfig
from axrl_debug.commands._common import fmt, pct, simple_table
from axrl_debug.commands.base import EXIT_FAILED, EXIT_OK, BadInput, err, out, print_json

if TYPE_CHECKING:
    from replay.server_rescore import RescoreResult

# (label, metric key) of the side-by-side table
ROWS = (("tokens", None), ("mean |Δ|", "mean_abs"), ("max |Δ|", "max_abs"), ("p99 |Δ|", "p99_abs"),
        ("k3 (KL estimate)", "k3"), ("outside the clip band", "frac_outside_clip"), ("ESS", "ess"))


def mismatch_of(run: Path, result: "RescoreResult", rollout: np.ndarray) -> dict[str, Any]:
    """`axrl-debug mismatch`'s report of one step with `rollout` as the rollout logprob."""
    config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    acc = MismatchAccumulator(MismatchConfig.from_run_config(config, routing=False, compiled=False))
    acc.add_columns(result.step, result.policy_version, {**result.columns, "/tokens/rollout_logprob": rollout})
    return acc.result()


def run_rescore(run: Path, step: int, engine: str, url: str | None, python: str | None, cpu_compat: bool | None,
                server_args: list[str], load_weights: bool, json_: bool) -> int:
    """The command body: re-score, analyse, print; exit 1 when the trainer's side diverged on the way."""
    import shlex

    from replay import ReplayInputError
    from replay.server_rescore import PYTHON_ENV, ServerOptions, rescore_on_server

    python = python or os.environ.get(PYTHON_ENV.get(engine, ""), "") or None
    if cpu_compat is None:  # SGLang on a CPU-only machine runs through cpu_compat.py (docs/sglang.md)
        cpu_compat = engine == "sglang" and _cpu_only()
    opts = ServerOptions(url=url, python=python, cpu_compat=cpu_compat,
                         server_args=[a for s in server_args for a in shlex.split(s)], load_weights=load_weights,
                         log_dir=run / "replay" / f"step_{step:06d}_{engine}_logs")
    say = None if json_ else (lambda msg: err.print(f"[dim]{msg}[/]", highlight=False))
    try:
        result = rescore_on_server(run, step, engine, opts, progress=say)
    except ReplayInputError as e:
        raise BadInput(str(e)) from None
    served, recorded = mismatch_of(run, result, result.served), mismatch_of(run, result, result.recorded)
    both = np.isfinite(result.served) & np.isfinite(result.recorded)
    d = np.abs(result.served[both].astype(np.float64) - result.recorded[both].astype(np.float64))
    versus = {"tokens": int(d.size), "mean_abs": float(d.mean()) if d.size else 0.0,
              "max_abs": float(d.max()) if d.size else 0.0}
    if json_:
        print_json({**result.to_dict(), "engine_mismatch": served, "recorded_mismatch": recorded,
                    "engine_vs_recorded": versus})
    else:
        _print(result, served, recorded, versus)
    return EXIT_FAILED if result.train_mismatches else EXIT_OK


def _cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def _print(result: "RescoreResult", served: dict[str, Any], recorded: dict[str, Any], versus: dict[str, Any]) -> None:
    where = "launched on" if result.launched else "at"
    out.print(f"[bold]engines on the same tokens[/] {result.run}  step {result.step}: the recorded "
              f"{result.recorded_engine} rollout re-scored by {result.engine} ({where} {result.url}, serving "
              f"{result.model_dir}), teacher-forced at temperature {result.temperature:g}", highlight=False)
    for note in result.notes:
        out.print(f"  note: {note}", highlight=False)
    if result.train_mismatches:
        out.print(f"[red]training re-execution diverged[/] while rebuilding the policy: "
                  f"{result.train_mismatches[0].describe()}", highlight=False)
    a, b = f"{result.engine} (re-scored)", f"{result.recorded_engine} (recorded)"
    rows = []
    for label, key in ROWS:
        if key is None:
            rows.append([label, str(served["tokens"]["analysed"]), str(recorded["tokens"]["analysed"])])
        else:
            show = pct if key == "frac_outside_clip" else (lambda v: fmt(v, 4))
            rows.append([label, show(served["metrics"][key]), show(recorded["metrics"][key])])
    out.print(simple_table("mismatch against the trainer (Δ = trainer − engine logprob)", ["", a, b], rows))
    for name in ("position", "turn"):
        s_rows = {r["bucket"]: r for r in served.get("breakdowns", {}).get(name, []) if r["count"]}
        r_rows = {r["bucket"]: r for r in recorded.get("breakdowns", {}).get(name, []) if r["count"]}
        table = [[str(k), str(s_rows[k]["count"]), fmt(s_rows[k]["mean_abs"], 3), fmt(r_rows.get(k, {}).get("mean_abs"), 3)]
                 for k in s_rows]
        out.print(simple_table(f"by {name}", [name, "tokens", f"mean |Δ| {result.engine}",
                                              f"mean |Δ| {result.recorded_engine}"], table))
    out.print(f"{result.engine} − recorded {result.recorded_engine}: mean |·| {fmt(versus['mean_abs'], 4)}, max |·| "
              f"{fmt(versus['max_abs'], 4)} over {versus['tokens']} tokens; re-scored in {result.seconds:.1f} s",
              highlight=False)
