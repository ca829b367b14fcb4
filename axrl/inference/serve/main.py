"""`axrl serve`'s process: load the model, start the engine and the HTTP app, print where it
listens, and run until stopped (or until the launching trainer is gone)."""

from __future__ import annotations

import sys
import time

from axrl.inference.serve.serve_app import create_app
from axrl.inference.serve.state import AxrlServer, ServeConfig, build_server
from axrl.model import hf_state_dict


def _exit_with_parent(parent: int) -> None:
    """A launched server must not outlive its trainer, even one killed with SIGKILL."""
    import os
    import signal
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown

    threading.Thread(target=watch, name="axrl-serve-parent-watch", daemon=True).start()


def serve(cfg: ServeConfig) -> None:
    """Run the server until SIGINT/SIGTERM (or until the launching process, AXRL_PARENT_PID, dies)."""
    import os

    import uvicorn

    if os.environ.get("AXRL_PARENT_PID", "").isdigit() and int(os.environ["AXRL_PARENT_PID"]) == os.getppid():
        _exit_with_parent(os.getppid())
    started = time.perf_counter()
    server = build_server(cfg)
    app = create_app(server)
    print(startup_message(server, time.perf_counter() - started), file=sys.stderr, flush=True)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=False)


def startup_message(server: AxrlServer, load_seconds: float) -> str:
    """What `axrl serve` prints before it starts listening: the model, the address, the endpoints."""
    cfg, model = server.cfg, server.engine.config
    experts = f", {model.num_experts} experts top-{model.num_experts_per_tok}" if model.is_moe else ""
    params = sum(t.numel() for t in hf_state_dict(server.engine.model).values()) / 1e6
    tokenizer = ("its tokenizer and chat template" if server.tokenizer is not None
                 else "no tokenizer (send token ids: input_ids / prompt as ids)")
    base = f"http://{cfg.host}:{cfg.port}"
    return (f"axrl serve: model {server.model_name!r} from {cfg.model_path} ({model.model_type}, "
            f"{model.num_hidden_layers} layers{experts}, {params:.2f}M parameters, {cfg.dtype}; {tokenizer}; "
            f"loaded in {load_seconds:.1f} s)\n"
            f"  listening on {base}: OpenAI {base}/v1/chat/completions, {base}/v1/completions (model "
            f"{server.model_name!r}), SGLang {base}/generate; Ctrl-C stops")
