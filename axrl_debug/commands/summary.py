"""`axrl-debug summary RUN`: one row per step (reward, loss, grad norm, clip fraction, mismatch,
routing agreement, policy-version lag, spike flags)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer

from axrl.runtime.recording.events import read_events
from axrl_debug.analysis.frames import step_table
from axrl_debug.analysis.objective import objective_by_step
from axrl_debug.analysis.pool import pool_by_step
from axrl_debug.analysis.sessions import sessions_by_step
from axrl_debug.analysis.spikes import SpikeConfig, detect
from axrl_debug.analysis.turns import turns_by_step
from axrl_debug.analysis.value_error import value_errors
from axrl_debug.commands.base import JSON_OPTION, app, out, print_json, run_command
from axrl_debug.commands._common import (STEPS_OPTION_HELP, fmt, open_run, pct, report_problems,
                                         select_steps, show, simple_table)


def records(df: Any) -> list[dict[str, Any]]:
    """DataFrame rows as plain dicts (NaN stays NaN; print_json turns it into null)."""
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in df.to_dict(orient="records")]


def worst_steps(df: Any) -> dict[str, Any]:
    """Steps with the largest mismatch / k3 / max |Δ| and the lowest routing agreement."""
    out: dict[str, Any] = {}
    for col, largest in (("mismatch", True), ("kl_k3", True), ("mismatch_max", True),
                         ("routing_agreement", False)):
        s = df[col].dropna() if col in df else None
        if s is None or s.empty:
            out[col] = None
            continue
        i = s.idxmax() if largest else s.idxmin()
        out[col] = {"step": int(df.loc[i, "step"]), "value": float(df.loc[i, col])}
    return out


def show_sessions(rows: list[dict[str, Any]]) -> None:
    """Black-box agent sessions per step: forks (with their causes) and drift."""
    def ids(values: list[int]) -> str:
        return ", ".join(map(str, values[:4])) + (" …" if len(values) > 4 else "")

    show(simple_table("black-box agent sessions (forks: extra root-to-leaf paths; drift: samples that differ "
                      "from the template's rendering of their conversation)",
                      ["step", "sessions", "failed", "fork paths", "drift samples", "drift tok", "fork / drift ids"],
                      [[str(r["step"]), str(r["sessions"]), str(r["failed_sessions"]), str(r["forks"]),
                        str(r["drift_samples"]), str(r["drift_tokens"]),
                        " / ".join(x for x in (ids(r["fork_ids"]), ids(r["drift_ids"])) if x)] for r in rows]))
    forks, drift = sum(r["forks"] for r in rows), sum(r["drift_samples"] for r in rows)
    causes: dict[str, int] = {}
    for r in rows:
        for cause, n in r.get("fork_causes", {}).items():
            causes[cause or "unknown"] = causes.get(cause or "unknown", 0) + n
    why = f" ({', '.join(f'{n} {c}' for c, n in sorted(causes.items()))})" if causes else ""
    out.print(f"sessions: {sum(r['sessions'] for r in rows)} over {len(rows)} steps, {forks} fork path(s){why}, "
              f"{drift} sample(s) with drift", highlight=False)


def show_turns(rows: list[dict[str, Any]]) -> None:
    """Per step and turn index: samples that reached it, mean turn reward, mean advantage of its tokens."""
    show(simple_table("per-turn rewards (/tokens/turn_reward) and advantages (algo.credit: turn makes them differ)",
                      ["step", "turn", "samples", "reward", "advantage"],
                      [[str(r["step"]), str(t["turn"]), str(t["samples"]),
                        fmt(t["reward_mean"], 3) if t["reward_mean"] is not None else "–",
                        fmt(t["advantage_mean"], 3) if t["advantage_mean"] is not None else "–"]
                       for r in rows for t in r["turns"]]))


def show_value_error(doc: dict[str, Any]) -> None:
    """The critic's value error e = V − return on trained tokens: per step, then by turn and by
    position (trained-token index) pooled over the steps."""
    def cells(r: dict[str, Any]) -> list[str]:
        return [str(r["tokens"]), *(fmt(r[k], 3) if r[k] is not None else "–" for k in ("mean", "mean_abs", "rmse"))]

    head = ["tokens", "mean e", "mean |e|", "rmse"]
    show(simple_table("critic value error e = V − return (/tokens/value, /tokens/return; trained tokens)",
                      ["step", *head], [[str(r["step"]), *cells(r)] for r in doc["steps"]]))
    show(simple_table("value error by turn (all shown steps)", ["turn", *head],
                      [[str(r["turn"]), *cells(r)] for r in doc["all"]["by_turn"]]))
    show(simple_table("value error by position: the token's index among its sample's trained tokens",
                      ["positions", *head], [[r["positions"], *cells(r)] for r in doc["all"]["by_position"]]))


def show_pool(rows: list[dict[str, Any]]) -> None:
    """Per step: groups the pool dropped (by reason) or re-ran, and the dropped samples recorded."""
    show(simple_table("rollout pool (dropped groups are recorded under /pool, never trained)",
                      ["step", "dropped groups", "reasons", "re-run groups", "dropped samples", "tokens",
                       "reward"],
                      [[str(r["step"]), str(r["dropped_groups"]),
                        ", ".join(f"{k} {v}" for k, v in r["dropped_by_reason"].items()),
                        str(r["rerun_groups"]), str(r["dropped_samples"]), str(r["dropped_tokens"]),
                        fmt(r["dropped_reward_mean"], 3) if r["dropped_reward_mean"] is not None else "–"]
                       for r in rows]))


def rollout_precision(manifest: dict) -> dict[str, str | None]:
    """The rollout engine's weight, KV and recipe precision the run recorded (runs from before
    `rollout.weight_dtype` rolled out in the model's precision: fp32 / auto; `precision` fp8_w8a8 =
    fp8 activations too, and its weights are fp8 whatever weight_dtype said). A run written by
    another trainer (manifest ``source``) did not say: None, not AxRL's defaults."""
    if manifest.get("source"):
        return {"weight_dtype": None, "kv_dtype": None, "precision": None}
    extra = manifest.get("extra") or {}
    precision = extra.get("rollout_precision", "auto")
    weights = "fp8" if precision == "fp8_w8a8" else extra.get("rollout_weight_dtype", "fp32")
    return {"weight_dtype": weights, "kv_dtype": extra.get("rollout_kv_dtype", "auto"), "precision": precision}


def show_steps(path: Path, flagged: Any) -> None:
    """The per-step table (the frame of `step_table` with its spike flags)."""
    split = "mismatch_engine" in flagged
    rows = []
    masked = "masked_frac" in flagged and bool((flagged["masked_frac"].fillna(0) > 0).any())
    for r in flagged.itertuples(index=False):
        lag = r.version_lag_mean
        rows.append([str(r.step), fmt(r.reward, 3), fmt(r.loss, 3), fmt(r.grad_norm, 3), pct(r.clipfrac),
                     *([pct(r.masked_frac)] if masked else []),
                     fmt(r.mismatch, 3), *([fmt(r.mismatch_engine, 3), fmt(r.mismatch_staleness, 3)] if split else []),
                     fmt(r.kl_k3, 3), pct(r.routing_agreement), "–" if math.isnan(lag) else f"{lag:.2g}",
                     f"[bold red]{r.spikes}[/]" if r.spikes else ""])
    show(simple_table(
        f"{path} — {len(flagged)} steps (more columns: --json)",
        ["step", "reward", "loss", "gnorm", "clip", *(["masked"] if masked else []), "mean|Δ|",
         *(["|Δ_eng|", "|Δ_stale|"] if split else []), "k3", "routing", "lag", "spikes"], rows))


@app.command()
def summary(
    run: Path = typer.Argument(..., help="Run directory (holds manifest.json, metrics.jsonl, trace/)."),
    steps: str = typer.Option(None, "--steps", help=STEPS_OPTION_HELP),
    window: int = typer.Option(10, "--window", min=1, help="Spike flags: trailing baseline window (steps)."),
    threshold: float = typer.Option(5.0, "--threshold", min=0.0, help="Spike flags: robust z threshold."),
    json_out: bool = JSON_OPTION,
) -> None:
    """One row per step: reward, loss, grad norm, clip fraction, share of loss tokens the corrections
    masked (when any did), mismatch (mean and max |Δ|, k3 KL; with /tokens/behaviour_train_logprob
    also its engine and staleness parts), MoE routing agreement, policy-version lag and spike flags;
    a run with a black-box agent also gets its sessions' forks and re-tokenisation drift per step,
    a run that dropped or re-ran groups (staleness, dynamic sampling) what its pool left out;
    a run with per-turn rewards (/tokens/turn_reward) their mean and the mean advantage per turn;
    a run with a critic (algo.advantage: gae) its value error V − return per step, by turn and by position;
    --json adds the share of loss tokens per objective/correction rule.

    Scalars the training loop logged (reward, loss, grad_norm, clipfrac, mismatch) come from
    metrics.jsonl; the rest is computed from the step files."""

    def body() -> int:
        reader = open_run(run)
        chosen = select_steps(reader, None, steps)
        df = step_table(reader, chosen)
        objective = objective_by_step(reader, list(df["step"]))
        for key in dict.fromkeys(k for row in objective.values() for k in row):
            df[key] = [objective.get(int(s), {}).get(key, math.nan) for s in df["step"]]
        flagged, spikes = detect(df, SpikeConfig.for_run(reader.config, window=window, threshold=threshold))
        problems = report_problems(reader)
        worst = worst_steps(flagged)
        # Faults and recoveries (RUN/events.jsonl: actor deaths, restarts, train-group resumes).
        faults = [e for e in read_events(reader.path) if e["event"] not in ("actors_started",)]
        sessions = sessions_by_step(reader, list(df["step"]))
        drift: list[dict[str, Any]] = []
        if not any(r["sessions"] for r in sessions):     # a white-box run: no agent sessions, maybe drift
            drift = [{k: r[k] for k in ("step", "drift_samples", "drift_tokens", "drift_ids")}
                     for r in sessions if r["drift_samples"]]
            sessions = []
        pool = pool_by_step(reader, list(df["step"]))
        turns = turns_by_step(reader, list(df["step"]))
        values = value_errors(reader, list(df["step"]))
        precision = rollout_precision(reader.manifest)
        if json_out:
            cols = [c for c in flagged.columns if not c.endswith("_z")]
            print_json({"run": str(reader.path), "rollout_precision": precision, "steps": records(flagged[cols]),
                        "sources": df.attrs.get("sources", {}), "spikes": spikes, "worst": worst,
                        "sessions": sessions, **({"drift": drift} if drift else {}), "pool": pool, **({"turns": turns} if turns else {}),
                        **({"value_error": values} if values else {}),
                        "problems": problems, **({"events": faults} if faults else {})})
            return 0
        show_steps(reader.path, flagged)
        if precision["weight_dtype"] not in ("fp32", None) or precision["kv_dtype"] not in ("auto", None):
            acts = ", activations fp8 (W8A8)" if precision["precision"] == "fp8_w8a8" else ""
            out.print(f"rollout precision: weights {precision['weight_dtype']}{acts}, KV cache {precision['kv_dtype']} "
                      "(rollout.weight_dtype / rollout.precision / rollout.kv_dtype)", highlight=False)
        if sessions:
            show_sessions(sessions)
        if drift:
            out.print(f"re-tokenisation drift: {sum(r['drift_samples'] for r in drift)} sample(s) on {len(drift)} "
                      f"step(s) differ from the template's rendering of their conversation "
                      f"({sum(r['drift_tokens'] for r in drift)} tokens)", highlight=False)
        if pool:
            show_pool(pool)
        if turns:
            show_turns(turns)
        if values:
            show_value_error(values)
        if worst.get("mismatch"):
            w = worst["mismatch"]
            out.print(f"worst mismatch: step {w['step']} (mean |Δ| {fmt(w['value'], 3)}) — "
                      f"explain it with `axrl-debug mismatch {run} --step {w['step']}`", highlight=False)
        for e in faults:
            out.print(f"{e['time'][:19]} {e['event']}: {e.get('component', '')} "
                      f"{', '.join(f'{k}={v}' for k, v in e.items() if k in ('old_pid', 'new_pid', 'requeued_requests', 'restart', 'pids'))}",
                      highlight=False)
        if spikes:
            out.print(f"{len(spikes)} spike(s) on {len({s['step'] for s in spikes})} step(s) — "
                      f"attribute them with `axrl-debug spikes {run}`", highlight=False)
        return 0

    run_command(body)
