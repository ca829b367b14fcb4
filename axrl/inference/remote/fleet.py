"""Bring up the servers of an HTTP rollout engine for a run — the part SGLang's and vLLM's
factories share: export the trainer's initial weights as the HF directory every server loads,
then either connect to the given URLs (and give those servers the run's weights) or launch
`num_servers` processes and wait for their health, and hand the engine what it must clean up."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from axrl.inference.remote.launcher import ServerLauncher
from axrl.inference.remote.settings import ServerFleetSettings
from axrl.train.protocol import TrainBackend


def client_options(s: ServerFleetSettings, backend: TrainBackend, export: Path, initial: Path) -> dict[str, Any]:
    """The client keywords every server engine takes, from its section and the run's model."""
    cfg = backend.model_config
    return dict(max_concurrency=s.max_concurrency, timeout_s=s.timeout_s, retries=s.retries, backoff_s=s.backoff_s,
                weight_sync=s.weight_sync, export_dir=export / "sync", model_dir=initial,
                routing_shape=cfg.routing_shape()[:2] if cfg.is_moe else None, vocab_size=cfg.vocab_size)


def launch_or_connect(s: ServerFleetSettings, backend: TrainBackend, prefix: str,
                      make_engine: Callable[..., Any], launch: Callable[[Path], tuple[Sequence[str], Sequence[str]]],
                      env: dict[str, str], model_flag: str = "--model-path") -> Any:
    """The engine of a run, its servers holding the trainer's current weights.

    `make_engine(urls, launcher=..., **client_options)` builds the client; `launch(initial)` gives
    (argv prefix of one server, flags of every server) for the exported initial model."""
    export = Path(s.export_dir) if s.export_dir else Path(tempfile.mkdtemp(prefix=prefix))
    temporary = [] if s.export_dir else [export]
    # Servers load an HF directory, so the run's initial model is exported first.
    initial = backend.export_hf(export / "initial")
    options = client_options(s, backend, export, initial)
    if s.urls:
        engine = make_engine(s.urls, **options)
        engine.cleanup += temporary
        # Servers started elsewhere hold their own weights: give them the run's.
        engine.update_weights(dict(backend.named_weights()), version=0)
        return engine
    command, args = launch(initial)
    launcher = ServerLauncher(initial, num_servers=s.num_servers, base_port=s.base_port,
                              server_args=[*args, *s.server_args], command=command, env=env,
                              startup_timeout_s=s.startup_timeout_s, log_dir=s.log_dir, watchdog_s=s.watchdog_s,
                              model_flag=model_flag)
    urls = launcher.start()
    try:
        engine = make_engine(urls, launcher=launcher, **options)
        engine.cleanup += temporary
        return engine
    except BaseException:
        launcher.stop()
        raise
