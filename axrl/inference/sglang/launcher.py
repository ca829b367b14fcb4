"""The SGLang engine's launcher: the shared `ServerLauncher` (axrl/inference/remote/launcher.py),
whose defaults start `python -m sglang.launch_server --model-path ...`. Kept under this name
because runs, tests and benchmarks import it from here."""

from axrl.inference.remote.launcher import CLAIMS_DIR, ServerLauncher, ServerStartError, free_port, port_is_free, \
    stop_orphaned_servers

SGLangLauncher = ServerLauncher

__all__ = ["CLAIMS_DIR", "SGLangLauncher", "ServerStartError", "free_port", "port_is_free", "stop_orphaned_servers"]
