"""Build the SGLang rollout engine of a run from its `SGLangSettings` (launch servers or connect)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from axrl.inference.sglang.client import SGLangEngine
from axrl.inference.remote.fleet import launch_or_connect
from axrl.inference.sglang.settings import ServedModel, SGLangSettings
from axrl.tokenizer import Tokenizer
from axrl.train.protocol import TrainBackend

CPU_COMPAT = Path(__file__).with_name("cpu_compat.py")


def server_command(s: SGLangSettings, r: ServedModel) -> tuple[list[str], list[str]]:
    """(argv prefix that starts one server, flags for every server)."""
    if s.server == "axrl":
        args = ["--max-running-requests", str(r.max_batch_size), "--context-length", str(r.max_context_len),
                "--random-seed", str(r.seed), "--threads", str(r.threads), "--dtype", r.dtype]
        if not r.prefix_cache:  # the run's own setting: its rollouts then equal an in-process engine's
            args.append("--disable-radix-cache")
        return [sys.executable, "-m", "axrl.cli", "serve"], args
    python = s.python or sys.executable
    _check_sglang(python)
    command = [python, str(CPU_COMPAT)] if s.cpu_compat else [python, "-m", "sglang.launch_server"]
    # --dtype explicitly: with "auto" SGLang serves a float32 checkpoint in float16 (measured: 2e-3
    # logprob mismatch instead of 5e-7).
    return command, ["--random-seed", str(r.seed), "--context-length", str(r.max_context_len),
                     "--max-running-requests", str(r.max_batch_size), "--dtype", r.dtype]


def _check_sglang(python: str) -> None:
    """Fail early, with what to do, when the chosen interpreter has no sglang."""
    hint = ("install it (GPU: pip install 'axrl[sglang]'; CPU: scripts/sglang-cpu-env.sh DIR and "
            "rollout.sglang.python=DIR/bin/python with rollout.sglang.cpu_compat=true), or set "
            "rollout.sglang.server=axrl to serve with `axrl serve`")
    if python == sys.executable:
        if importlib.util.find_spec("sglang") is None:
            raise ValueError(f"rollout.sglang.server=sglang but the sglang package is not installed here; {hint}")
        return
    if not Path(python).is_file():
        raise ValueError(f"rollout.sglang.python={python!r} does not exist; {hint}")
    probe = subprocess.run([python, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('sglang') is None)"],
                           capture_output=True, timeout=60)
    if probe.returncode != 0:
        raise ValueError(f"rollout.sglang.python={python} has no sglang package; {hint}")


def build_sglang_engine(s: SGLangSettings, served: ServedModel, backend: TrainBackend,
                        tokenizer: Tokenizer) -> SGLangEngine:
    """Launch (or connect to) the servers and return a client holding the trainer's current weights."""

    def launch(initial: Path) -> tuple[list[str], list[str]]:
        command, args = server_command(s, served)
        if backend.model_config.is_moe:
            args.append("--enable-return-routed-experts")
        return command, args

    def make(urls: list[str], **options: object) -> SGLangEngine:
        return SGLangEngine(urls, sync_backend=s.sync_backend, **options)

    return launch_or_connect(s, backend, "axrl-sglang-", make, launch,
                             env={"OMP_NUM_THREADS": str(served.threads), "TOKENIZERS_PARALLELISM": "false"})
