"""How fast `axrl-debug tui` opens a large run and moves around in it.

Generates (or reuses, with --run-dir) a synthetic run of 1,000 steps with 1,000,000 generated
tokens in total (8 samples × 125 generated tokens per step, prompts and a tool/env segment on
top, MoE routing 4 layers × top-2), then measures headless, at 80×24:

* first screen, in-process: ``DebugApp(run)`` constructed → app mounted and the steps table
  holding every step (the number the issue's "< 1 s" target is about);
* first screen, cold: a fresh Python process that imports the ``axrl-debug`` CLI (as the console
  script does, including the other commands' imports) and reaches the same point;
* step files opened before the first screen (must be 0: the steps table comes from metrics.jsonl);
* moving to another step (``]`` in the samples view: reads that one step file), opening a step
  from the steps table, opening a sample, moving to the next sample, jumping to the worst token.

Moves are measured while the background scan of step files runs (what a user gets) and, for
comparison, with ``--no-scan``. Prints a table, then one JSON line with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from axrl.trace import RunDir, StepRecord  # noqa: E402

SAMPLES, PROMPT, GEN1, ENV, GEN2 = 8, 40, 80, 20, 45   # per step: 8 × (80 + 45) = 1,000 generated
LAYERS, TOPK, EXPERTS = 4, 2, 8


def make_run(path: Path, steps: int, seed: int = 0) -> int:
    """Write the synthetic run; returns the total number of generated tokens. One array set is
    built once and re-used for every step with small per-step changes (cheap to write)."""
    rng = np.random.default_rng(seed)
    run = RunDir(path)
    run.write_manifest(seed=seed, backend="torch", engine="embedded", command=["bench/tui_open.py"])
    run.write_config({"steps": steps, "seed": seed, "algo": {"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0}})
    per = PROMPT + GEN1 + ENV + GEN2
    t = SAMPLES * per
    off = np.arange(SAMPLES + 1, dtype=np.int64) * per
    one_lm = np.r_[np.zeros(PROMPT), np.ones(GEN1), np.zeros(ENV), np.ones(GEN2)].astype(np.uint8)
    one_turn = np.r_[np.zeros(PROMPT), np.ones(GEN1 + ENV), np.full(GEN2, 2)].astype(np.int16)
    loss_mask, turn = np.tile(one_lm, SAMPLES), np.tile(one_turn, SAMPLES)
    ids = rng.integers(3, 1000, t).astype(np.int32)                # inside the default tokenizer's 1,024 ids
    gen = loss_mask == 1
    rollout = np.where(gen, -rng.exponential(1.5, t), np.nan).astype(np.float32)
    base_noise = rng.normal(0, 1e-3, t).astype(np.float32)
    entropy = rng.random(t).astype(np.float16) * 3
    routing = rng.integers(0, EXPERTS, (t, LAYERS, TOPK)).astype(np.uint8)
    routing[:, :, 1] = (routing[:, :, 0] + 1) % EXPERTS          # distinct top-2 experts
    valid = np.ones(t, np.uint8)
    valid[off[1:] - 1] = 0
    gen_total = 0
    metrics = []
    for step in range(steps):
        spike = step > 20 and step % 97 == 0                      # a few steps with a mismatch spike
        noise = np.roll(base_noise, step) * (40.0 if spike else 1.0)
        old = np.where(gen, rollout + noise, rng.normal(-3, 1, t)).astype(np.float32)
        train = routing.copy()
        flip = (np.arange(t) % 211) == (step % 211)                # a few routing disagreements per step
        train[flip, 0, 1] = (train[flip, 0, 0] + 2) % EXPERTS
        reward = ((np.arange(SAMPLES) + step) % 3 == 0).astype(np.float64)
        adv = np.repeat(reward - reward.mean(), per).astype(np.float32)
        pv = np.where(gen, step, -1).astype(np.int32)
        rec = StepRecord(
            step=step, policy_version=step, sample_offsets=off,
            sample_id=np.arange(SAMPLES, dtype=np.int64) + SAMPLES * step,
            group_id=np.repeat(np.arange(2), SAMPLES // 2).astype(np.int64) + 2 * step,
            prompt_id=[f"bench/{step}/{i // 4}" for i in range(SAMPLES)],
            prompt_len=np.full(SAMPLES, PROMPT, np.int32), num_turns=np.full(SAMPLES, 2, np.int32),
            reward=reward, finish_reason=["stop"] * SAMPLES, status=["ok"] * SAMPLES,
            token_ids=ids, loss_mask=loss_mask, turn=turn, token_policy_version=pv,
            rollout_logprob=rollout, old_logprob=old, advantage=adv, entropy=entropy,
            num_experts=EXPERTS, routing_rollout=routing, routing_rollout_valid=valid, routing_train=train,
            update_sample_offsets=np.array([0, SAMPLES // 2, SAMPLES], np.int64),
            update_samples=np.arange(SAMPLES, dtype=np.int64),
            update_metrics={"loss": np.full(2, 0.1 + 0.01 * np.sin(step)), "grad_norm": np.full(2, 1.0),
                            "lr": np.full(2, 1e-6)},
            weights_fingerprint_before=f"{step:064x}", weights_fingerprint_after=f"{step + 1:064x}",
            wall_times={"rollout": 1.0, "train": 1.0},
        )
        run.write_step(rec)
        d = np.abs(old[gen] - rollout[gen])
        metrics.append({"step": step, "policy_version": step, "reward": float(reward.mean()),
                        "loss": 0.1 + 0.01 * float(np.sin(step)) + (2.0 if step % 251 == 200 else 0.0),
                        "grad_norm": 1.0, "lr": 1e-6, "clipfrac": 0.0, "mismatch": float(d.mean()),
                        "samples": SAMPLES, "failed": 0, "tokens": t, "generated_tokens": int(gen.sum())})
        gen_total += int(gen.sum())
    # one write instead of 1,000 fsynced appends: the bench measures reading, not the recorder
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return gen_total


class _Counter:
    """Counts StepFile opens (the laziness check) by wrapping the class the TUI and the reader use."""

    def __init__(self) -> None:
        import axrl.trace.reader as reader_mod
        import axrl_debug.tui.data as data_mod

        self.n = 0
        orig = reader_mod.StepFile
        counter = self

        class Counting(orig):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **kw) -> None:
                counter.n += 1
                super().__init__(*a, **kw)

        reader_mod.StepFile = Counting
        data_mod.StepFile = Counting


async def _timed(pilot, *keys: str) -> float:
    t0 = time.perf_counter()
    await pilot.press(*keys)
    await pilot.pause()
    return time.perf_counter() - t0


async def measure(run: Path, *, scan: bool, moves: int, counter: _Counter) -> dict[str, float]:
    from axrl_debug.tui.app import DebugApp
    from axrl_debug.tui.screens import SamplesScreen, TokensScreen

    out: dict[str, float] = {}
    opened_before = counter.n
    t0 = time.perf_counter()
    app = DebugApp(run, scan=scan)
    async with app.run_test(size=(80, 24)) as pilot:
        table = app.steps_screen.table
        while len(table.order) < len(app.run_model.steps):     # run_test returns once mounted
            await pilot.pause(0.001)
        out["first_screen_s"] = time.perf_counter() - t0
        # a key nothing is bound to: the harness's own round trip (press + wait for idle), so the
        # numbers below can be read as "this much more than doing nothing"
        out["noop_key_s"] = statistics.median([await _timed(pilot, "z") for _ in range(5)])
        out["step_files_opened_at_first_screen"] = counter.n - opened_before if not scan else float("nan")
        out["open_step_s"] = await _timed(pilot, "enter")
        assert isinstance(app.screen, SamplesScreen)
        step_moves = [await _timed(pilot, "right_square_bracket") for _ in range(moves)]
        out["next_step_s_median"] = statistics.median(step_moves)
        out["next_step_s_max"] = max(step_moves)
        out["open_sample_s"] = await _timed(pilot, "enter")
        assert isinstance(app.screen, TokensScreen)
        sample_moves = [await _timed(pilot, "right_square_bracket") for _ in range(SAMPLES - 1)]
        out["next_sample_s_median"] = statistics.median(sample_moves)
        out["next_sample_s_max"] = max(sample_moves)
        out["jump_worst_s"] = statistics.median([await _timed(pilot, "w") for _ in range(5)])
        out["scan_steps_done_during_moves"] = float(len(app.run_model.scanned))
        app.exit()
    return out


def cold_start(run: Path, *, cli: bool = True) -> float:
    """Seconds from a fresh process start to the first screen; ``cli``: import the whole
    ``axrl-debug`` CLI first, as the console script does (every command module and what it imports)."""
    code = (
        "import os, sys, time, asyncio\n"
        "t0 = float(os.environ['AXRL_BENCH_T0'])\n"
        + ("import axrl_debug.cli\n" if cli else "") +
        "from axrl_debug.tui.app import DebugApp\n"
        "async def main():\n"
        "    app = DebugApp(sys.argv[1])\n"
        "    async with app.run_test(size=(80, 24)) as pilot:\n"
        "        while len(app.steps_screen.table.order) < len(app.run_model.steps):\n"
        "            await pilot.pause(0.001)\n"
        "        print(time.time() - t0)\n"
        "        app.exit()\n"
        "asyncio.run(main())\n"
    )
    env = dict(os.environ, AXRL_BENCH_T0=repr(time.time()))
    res = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return float(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--run-dir", type=Path, default=None,
                    help="Reuse (or create) the synthetic run here instead of a temporary directory.")
    ap.add_argument("--moves", type=int, default=10, help="Step moves to time.")
    ap.add_argument("--cold-runs", type=int, default=3)
    args = ap.parse_args()

    tmp = None
    run = args.run_dir
    if run is None:
        tmp = tempfile.mkdtemp(prefix="axrl-tui-bench-")
        run = Path(tmp) / "run"
    try:
        if not (run / "metrics.jsonl").exists():
            t = time.perf_counter()
            gen = make_run(run, args.steps)
            print(f"generated {args.steps} steps, {gen:,} generated tokens in {time.perf_counter() - t:.1f} s "
                  f"({run})", file=sys.stderr)
        from axrl.trace import TraceReader

        metrics = TraceReader(run, validate=False).metrics()
        steps = len(metrics)
        gen = int(sum(m.get("generated_tokens", 0) for m in metrics))
        counter = _Counter()
        lazy = asyncio.run(measure(run, scan=False, moves=args.moves, counter=counter))
        live = asyncio.run(measure(run, scan=True, moves=args.moves, counter=counter))
        cold = [cold_start(run) for _ in range(args.cold_runs)]
        cold_tui = [cold_start(run, cli=False) for _ in range(args.cold_runs)]
        rows = [("first screen, in-process (scan on)", live["first_screen_s"]),
                ("first screen, in-process (--no-scan)", lazy["first_screen_s"]),
                ("first screen, cold process incl. CLI imports (median)", statistics.median(cold)),
                ("first screen, cold process, TUI imports only (median)", statistics.median(cold_tui)),
                ("step files opened before the first screen", lazy["step_files_opened_at_first_screen"]),
                ("open a step (enter)", live["open_step_s"]),
                ("next step ] median / max", (live["next_step_s_median"], live["next_step_s_max"])),
                ("next step ] median, --no-scan", lazy["next_step_s_median"]),
                ("open a sample (enter)", live["open_sample_s"]),
                ("next sample ] median / max", (live["next_sample_s_median"], live["next_sample_s_max"])),
                ("jump to worst token (w) median", live["jump_worst_s"]),
                ("(harness round trip of an unbound key, median)", live["noop_key_s"])]
        print(f"run: {steps} steps, {gen:,} generated tokens; terminal 80×24 (headless)")
        for name, v in rows:
            val = " / ".join(f"{x:.3f} s" for x in v) if isinstance(v, tuple) else (
                f"{int(v)}" if "opened" in name else f"{v:.3f} s")
            print(f"  {name:<55} {val}")
        print(json.dumps({
            "steps": steps, "generated_tokens": gen,
            "first_screen_s": round(live["first_screen_s"], 4),
            "first_screen_no_scan_s": round(lazy["first_screen_s"], 4),
            "cold_start_first_screen_s": round(statistics.median(cold), 4),
            "cold_start_tui_only_first_screen_s": round(statistics.median(cold_tui), 4),
            "step_files_opened_at_first_screen": int(lazy["step_files_opened_at_first_screen"]),
            "open_step_s": round(live["open_step_s"], 4),
            "next_step_s": round(live["next_step_s_median"], 4),
            "next_step_no_scan_s": round(lazy["next_step_s_median"], 4),
            "open_sample_s": round(live["open_sample_s"], 4),
            "next_sample_s": round(live["next_sample_s_median"], 4),
            "jump_worst_s": round(live["jump_worst_s"], 4),
            "noop_key_s": round(live["noop_key_s"], 4),
            "first_screen_under_1s": live["first_screen_s"] < 1.0,
        }))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
