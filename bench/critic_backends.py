"""PPO with a critic on the Megatron backend beside the torch backend: the same short run of
`examples/quickstart_ppo.yaml` (critic + GAE on the quickstart task, tiny MoE, default sizes) on
each backend, one after the other in this process's machine, from the same seed and config.

    python bench/critic_backends.py [--steps 6] [--tp 2]

Each run is a real `axrl train` (embedded engine, warm-up, critic warm-up steps, trace). Per step
it prints each backend's critic value loss, explained variance and trainer seconds (time_prepare,
which holds the critic's forward, + time_train, which holds the policy's and the critic's
updates). The backends' warm-ups round differently, so their rollouts (and curves) are not the
same samples: this compares behaviour and cost, not bits (the bitwise and fp32-tolerance checks
are tests/test_megatron_critic.py). `--tp 2` adds `megatron_tp2` (2 worker processes, 1 thread each).

Ends with one JSON line: per backend the first and last steps' `value_loss`, and
`megatron_vs_torch_trainer_time_ratio` (sum of time_prepare + time_train over the steps, > 1 =
Megatron slower), and `megatron_tp2_vs_torch_trainer_time_ratio` with `--tp 2`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(name: str, extra: list[str], steps: int, root: Path) -> list[dict]:
    """One `axrl train` of quickstart_ppo.yaml; its metrics.jsonl rows."""
    run_dir = root / name
    args = [sys.executable, "-m", "axrl.cli", "train", "examples/quickstart_ppo.yaml", "--run-dir", str(run_dir),
            "--set", f"steps={steps}", "--set", "eval.every=0", "--set", "runtime.threads=1"]
    for kv in extra:
        args += ["--set", kv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tp", type=int, default=0, help="also run Megatron with this tensor parallel size")
    a = ap.parse_args()
    backends = {"torch": [], "megatron": ["train.backend=megatron"]}
    if a.tp:
        backends[f"megatron_tp{a.tp}"] = ["train.backend=megatron", f"train.megatron.tensor_parallel={a.tp}"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: run(name, extra, a.steps, Path(tmp)) for name, extra in backends.items()}
    trainer = {n: sum(r["time_prepare"] + r["time_train"] for r in rs) for n, rs in rows.items()}
    print(f"quickstart_ppo.yaml, {a.steps} steps, 1 thread/process")
    print("step  " + "".join(f"{n + ' value_loss':>26}{'expl.var':>10}{'trainer s':>11}" for n in rows))
    for s in range(a.steps):
        print(f"{s:>4}  " + "".join(f"{rs[s]['value_loss']:>26.5f}{rs[s]['explained_variance']:>10.3f}"
                                    f"{rs[s]['time_prepare'] + rs[s]['time_train']:>11.2f}" for rs in rows.values()))
    doc: dict = {"steps": a.steps}
    for n, rs in rows.items():
        doc[f"{n}_value_loss_first"] = round(rs[0]["value_loss"], 6)
        doc[f"{n}_value_loss_last"] = round(rs[-1]["value_loss"], 6)
        doc[f"{n}_trainer_s"] = round(trainer[n], 3)
        if n != "torch":
            doc[f"{n}_vs_torch_trainer_time_ratio"] = round(trainer[n] / trainer["torch"], 3)
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
