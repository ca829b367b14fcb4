"""On-policy distillation vs GRPO alone: steps for a fresh student to reach its teacher's eval reward.

Runs of `examples/quickstart.yaml` (calculator tool use, tiny MoE), one after another in child
processes with one torch thread:

1. the teacher: the quickstart trained with GRPO for `--teacher-steps` steps (warm-up, then RL);
   its checkpoint `step_<teacher-steps>` is the teacher, its final eval reward `teacher_eval`;
2. a student per `--modes` entry: the same config and seed, so warmed up the same way (its
   step 0 is bitwise the teacher run's step 0, which this script checks via the trace's weight
   fingerprint), then trained `--student-steps` steps with `distill.teacher` = that checkpoint;
3. GRPO alone: under `runtime.deterministic` a GRPO-alone student repeats the teacher's run step
   for step, so the teacher run's own eval curve is that curve (no third training run).

Evaluation: `--eval-prompts` held-out questions × 1 sample (independent episodes), the same
questions and sampling seeds at every evaluation and in every run, before every
`--eval-every`-th step and after the last. Rewards lie in [0, 1], so an eval mean m over n
episodes has standard error ≤ sqrt(m(1 − m)/n) (Var X ≤ E X − m² for X in [0, 1]; calculator
rewards are 0, 0.1 or 1, so the bound is nearly tight); `se` is that bound.

Reported: each curve (step → eval reward), `teacher_eval`, `steps_to_teacher_*` (the first
evaluated step whose eval reward is ≥ `teacher_eval`; null if none within the run; the GRPO-alone
curve gets there at `--teacher-steps` by construction, or earlier), the same for `teacher_eval`
minus its standard error (`steps_to_teacher_within_1se`, the noise-aware reading) and for 90 % of
the teacher's gain over the shared start (`steps_to_90pct_gain`), the student–teacher KL k1
(`teacher_kl_first_last`, nats/token, as the run logged it), median step times and the wall
times of the runs this invocation trained.

    python bench/distill_curve.py [--out DIR] [--teacher-steps 40] [--student-steps 40]
        [--eval-prompts 512] [--eval-every 5] [--modes reverse_kl,reverse_kl+reward:5] [--coef 1.0]
        [--reuse]

`--reuse` keeps a run already complete in `--out` when its config.yaml holds the settings this
invocation would give it (e.g. the teacher when only the student settings change), and extends one
that differs only by fewer steps with `axrl train --resume` (bitwise the longer run: e.g.
`--teacher-steps 80` after a 40-step invocation trains 40 more teacher steps, not 80).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "examples" / "quickstart.yaml"


def train(run_dir: Path, sets: list[str], reuse: bool) -> float:
    """Train the quickstart with `sets` into `run_dir` (child process, one thread); the wall time
    in seconds, or 0.0 when `reuse` finds the run complete with the same settings."""
    if reuse and _complete(run_dir, sets):
        print(f"reusing {run_dir}", flush=True)
        return 0.0
    cmd = [sys.executable, "-m", "axrl.cli", "train", str(CONFIG), "--run-dir", str(run_dir)]
    others, steps = [s for s in sets if not s.startswith("steps=")], [s for s in sets if s.startswith("steps=")]
    if reuse and steps and _complete(run_dir, others) and _steps(run_dir) < int(steps[0].split("=")[1]):
        cmd.append("--resume")  # the same run, shorter: extend it (resume continues bit for bit)
    cmd += [a for s in sets for a in ("--set", s)]
    print("running:", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                            "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - t0


def _complete(run_dir: Path, sets: list[str]) -> bool:
    """The run has its final eval and its config.yaml holds every `key=value` of `sets`."""
    import yaml

    if not (run_dir / "config.yaml").is_file() or "eval_reward_final" not in _last_row(run_dir):
        return False
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    for s in sets:
        key, value = s.split("=", 1)
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != yaml.safe_load(value) and str(node) != value:
            return False
    return True


def _steps(run_dir: Path) -> int:
    import yaml

    return int(yaml.safe_load((run_dir / "config.yaml").read_text())["steps"])


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _last_row(run_dir: Path) -> dict[str, Any]:
    rows = _rows(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    return rows[-1] if rows else {}


def curve(run_dir: Path) -> list[tuple[int, float]]:
    """(steps trained, eval reward) of a run: `eval_reward` of step k is before step k (after k
    steps), `eval_reward_final` after the last step (a run extended with --resume evaluates the
    step it resumed at again: one point per step, the later)."""
    out: dict[int, float] = {}
    for r in _rows(run_dir):
        if r.get("eval_reward") is not None:
            out[int(r["step"])] = float(r["eval_reward"])
        if r.get("eval_reward_final") is not None:
            out[int(r["step"]) + 1] = float(r["eval_reward_final"])
    return sorted(out.items())


def se_bound(mean: float, n: int) -> float:
    """Standard-error bound of a mean of n independent rewards in [0, 1]."""
    return math.sqrt(max(mean * (1.0 - mean), 0.0) / n)


def first_reaching(points: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step whose eval reward is ≥ target (None: never)."""
    return next((step for step, r in points if r >= target - 1e-12), None)


def step0_fingerprint(run_dir: Path) -> tuple[bytes, bytes]:
    """Step 0's weights before training (the state right after the warm-up) and its sampled tokens."""
    import h5py

    with h5py.File(run_dir / "trace" / "step_000000.h5") as f:
        fingerprint = f["train/weights_fingerprint_before"][()]
        return bytes(fingerprint) if isinstance(fingerprint, bytes) else str(fingerprint).encode(), \
            f["tokens/ids"][:].tobytes()


def teacher_kl(run_dir: Path) -> list[float]:
    """The student–teacher KL k1 (nats/token) logged at the run's first and last step."""
    kl = [float(r["teacher_kl"]) for r in _rows(run_dir) if r.get("teacher_kl") is not None]
    return [kl[0], kl[-1]] if kl else []


def grpo_kl_to(run_dir: Path, ckpt: Path, steps: list[int]) -> dict[int, float]:
    """KL k1 (nats/token) of the GRPO run's own rollouts of step k to the checkpoint `ckpt` (its
    later self, the teacher): mean(rollout − teacher logprob) over loss tokens, the teacher scored
    as a distillation run scores it (`LocalTeacher`, at the rollout temperature). How far along its
    path GRPO already is at step k, in the unit a student's logged `teacher_kl` uses."""
    import h5py
    import numpy as np
    import torch
    import yaml

    from axrl.runtime.teacher import LocalTeacher, load_teacher
    from axrl.train import TorchBackendConfig
    from axrl.train.protocol import PackedBatch

    torch.set_num_threads(1)
    temperature = float(yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]["temperature"])
    model, _ = load_teacher(str(ckpt), torch.float32)
    teacher = LocalTeacher(model, TorchBackendConfig(micro_batch_tokens=4096))
    out = {}
    for k in steps:
        with h5py.File(run_dir / "trace" / f"step_{k:06d}.h5") as f:
            batch = PackedBatch(input_ids=torch.from_numpy(f["tokens/ids"][:].astype(np.int64)),
                                offsets=torch.from_numpy(f["samples/offsets"][:].astype(np.int64)),
                                loss_mask=torch.from_numpy((f["tokens/loss_mask"][:] > 0).astype(np.float32)),
                                temperature=temperature)
            rollout = torch.from_numpy(f["tokens/rollout_logprob"][:].astype(np.float64))
        t = teacher.score(batch).double()
        m = (batch.loss_mask > 0) & torch.isfinite(rollout)
        out[k] = round(float((rollout[m] - t[m]).mean()), 5)
    return out


def median_step_time(run_dir: Path) -> float:
    """The run's median step time in seconds (the teacher's scoring forward is in a student's)."""
    return round(statistics.median(float(r["step_time"]) for r in _rows(run_dir) if "step_time" in r), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/distill_curve"))
    ap.add_argument("--teacher-steps", type=int, default=40)
    ap.add_argument("--student-steps", type=int, default=40)
    ap.add_argument("--eval-prompts", type=int, default=512)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--modes", default="reverse_kl,reverse_kl+reward",
                    help="comma-separated distill.mode values, each optionally with its own coef: reverse_kl+reward:5")
    ap.add_argument("--coef", type=float, default=1.0, help="distill.coef of a --modes entry without one")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--teacher-at", type=int, default=None,
                    help="the teacher is the GRPO run's checkpoint at this step (default: --teacher-steps); its "
                         "eval reward there is the target")
    ap.add_argument("--grpo-kl", action="store_true",
                    help="also score the GRPO run's own rollouts with the teacher (grpo_kl_to): its KL to the "
                         "teacher at each evaluated step, beside the students' logged teacher_kl")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    common = [f"eval.every={args.eval_every}", f"eval.prompts={args.eval_prompts}", "eval.samples_per_prompt=1"]
    teacher_dir = args.out / "teacher"
    wall = {"teacher": train(teacher_dir, common + [f"steps={args.teacher_steps}"], args.reuse)}
    at = args.teacher_steps if args.teacher_at is None else args.teacher_at
    ckpt = teacher_dir / "checkpoints" / f"step_{at:06d}"
    students = {}
    for entry in args.modes.split(","):
        mode, _, coef = entry.partition(":")
        name = f"{mode}:{float(coef):g}" if coef else mode
        run = args.out / (f"student_{name.replace('+', '_').replace(':', '_c')}"
                          + ("" if args.teacher_at is None else f"_t{at}"))
        wall[name] = train(run, common + [f"steps={args.student_steps}", f"distill.teacher={ckpt}",
                                          f"distill.mode={mode}", f"distill.coef={float(coef or args.coef)}"],
                           args.reuse)
        if step0_fingerprint(run) != step0_fingerprint(teacher_dir):
            raise SystemExit(f"{run}: step 0 does not start from the teacher run's post-warm-up weights; "
                             "the GRPO-alone curve would not be this student's")
        students[name] = run
    report(args, teacher_dir, students, wall)


def report(args: argparse.Namespace, teacher_dir: Path, students: dict[str, Path], wall: dict[str, float]) -> None:
    """Print the table and, last, the JSON line."""
    n = args.eval_prompts
    at = args.teacher_steps if args.teacher_at is None else args.teacher_at
    grpo = [(s, r) for s, r in curve(teacher_dir) if s <= at]
    teacher_eval = grpo[-1][1]
    start = grpo[0][1]
    curves = {"grpo": grpo, **{m: curve(r) for m, r in students.items()}}
    gain90 = start + 0.9 * (teacher_eval - start)
    steps = sorted({s for c in curves.values() for s, _ in c})
    print(f"\neval reward on {n} held-out episodes (SE ≤ sqrt(m(1-m)/{n}), ≈ {se_bound(0.6, n):.3f} at 0.6)")
    print("| steps | " + " | ".join(curves) + " |")
    for s in steps:
        cells = [next((f"{r:.3f}" for k, r in c if k == s), "–") for c in curves.values()]
        print(f"| {s} | " + " | ".join(cells) + " |")
    to_teacher = {m: first_reaching(c, teacher_eval) for m, c in curves.items()}
    to_90 = {m: first_reaching(c, gain90) for m, c in curves.items()}
    within_se = {m: first_reaching(c, teacher_eval - se_bound(teacher_eval, n)) for m, c in curves.items()}
    primary = next(iter(students))
    print(json.dumps({
        "teacher_steps": args.teacher_steps, "student_steps": args.student_steps, "eval_episodes": n,
        "teacher_eval": teacher_eval, "teacher_eval_se": se_bound(teacher_eval, n),
        "start_eval": start, "start_eval_se": se_bound(start, n), "coef": args.coef,
        "steps_to_teacher_grpo": to_teacher["grpo"], "steps_to_teacher_distill": to_teacher[primary],
        "steps_to_teacher": to_teacher, "steps_to_teacher_within_1se": within_se, "steps_to_90pct_gain": to_90,
        "curves": {m: [[s, r] for s, r in c] for m, c in curves.items()},
        "teacher_kl_first_last": {m: teacher_kl(r) for m, r in students.items()},
        "median_step_time_s": {m: median_step_time(d) for m, d in {"grpo": teacher_dir, **students}.items()},
        "teacher_at": at, "steps_to_90pct_gain_grpo": to_90["grpo"],
        "steps_to_90pct_gain_distill": to_90[primary],
        "grpo_teacher_kl": (grpo_kl_to(teacher_dir, teacher_dir / "checkpoints" / f"step_{at:06d}",
                                       [s for s, _ in grpo if s < at]) if args.grpo_kl else None),
        "wall_s": {k: round(v, 1) for k, v in wall.items()},
    }))


if __name__ == "__main__":
    main()
