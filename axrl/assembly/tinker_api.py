"""`axrl serve --training`: the serve app (engine, SGLang and OpenAI routes) plus the Tinker API,
driving the run's learner — a service is just another driver of the same train backend and
engine, and every optim_step it triggers is a trace step like any other, replayable.

The service's assembly (axrl/tinker_api/ itself never reads `axrl.config`): each model it creates gets a run
directory with the fully resolved config.yaml (`model.path` = the served directory, `train.lora`
from the request's `lora_config`), built by the same `make_train_backend` that `axrl train` and
replay use.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from axrl.assembly import settings as S
from axrl.assembly.build import make_engine, make_tokenizer, make_train_backend
from axrl.config import Config, config_to_dict
from axrl.inference.scoring import EmbeddedScorer, Scorer
from axrl.inference.serve.main import startup_message
from axrl.inference.scoring.by_engine import server_scorer
from axrl.inference.serve.serve_app import create_app
from axrl.inference.serve.state import ServeConfig, build_server
from axrl.model import hf_state_dict
from axrl.runtime.recording.events import EventLog
from axrl.tinker_api.futures import FutureStore
from axrl.tinker_api.model import ServiceModel
from axrl.tinker_api.routes import add_tinker_routes
from axrl.tinker_api.routing import RoutingMemory
from axrl.tinker_api.sampling import PromptLimits, Sampler
from axrl.tinker_api.state import ServiceState
from axrl.trace import RunDir
from axrl.train.protocol import TrainBackend


def records_routing(cfg: Config, num_experts: int) -> bool:
    """Whether sampled sequences bring their MoE routing into the trace: on an MoE model, from the
    embedded engine or SGLang. vLLM servers return none (AxRL launches them without
    --enable-return-routed-experts, which the CPU build cannot run), so their steps record no routing."""
    return bool(num_experts) and cfg.rollout.engine != "vllm"


class ServedDirectory:
    """The served model directory as what an engine's server fleet reads of a trainer
    (`launch_or_connect`): its architecture, the HF directory the servers load — the directory
    itself — and its weights (for servers given by URL, which load them)."""

    def __init__(self, model_dir: Path, model: torch.nn.Module) -> None:
        self.model_dir, self.model = model_dir, model

    @property
    def model_config(self) -> Any:
        return self.model.config

    def export_hf(self, directory: Path) -> Path:
        return self.model_dir

    def named_weights(self) -> Any:
        return iter(hf_state_dict(self.model).items())


def sampling_engine(cfg: Config, server: Any, model_dir: Path) -> tuple[Any, Scorer]:
    """The engine Tinker sampling runs on and its prompt scorer: the served embedded engine, or
    SGLang / vLLM servers (`rollout.engine: sglang | vllm`, launched on the served directory or
    given by URL) with their teacher-forced scorer. New sampler weights reach the servers by the
    engine's own weight route (vLLM's CPU build: a restart on the exported directory)."""
    if cfg.rollout.engine == "embedded":
        return server.engine, EmbeddedScorer(server.engine.model, server.engine.config.vocab_size)
    source = ServedDirectory(model_dir, server.engine.model)
    engine = make_engine(cfg, server.tokenizer, source)  # type: ignore[arg-type]  (the part of a backend it reads)
    try:
        return engine, server_scorer(cfg.rollout.engine, engine.urls[0], source.model_config.vocab_size)
    except BaseException:
        engine.shutdown()
        raise


def sampling_note(cfg: Config, state: ServiceState, num_experts: int) -> str:
    """The start-up line saying where Tinker sampling runs and whether MoE routing is recorded."""
    engine = state.sampler.engine
    where = ("sampling on the embedded engine" if cfg.rollout.engine == "embedded"
             else f"sampling on {cfg.rollout.engine} servers {', '.join(engine.urls)}")
    if num_experts and not records_routing(cfg, num_experts):
        where += " (MoE routing is not recorded: vLLM servers return none)"
    return where


def model_config(cfg: Config, model_dir: Path, lora_rank: int | None) -> Config:
    """The run config of one created model: the served model, LoRA when asked, temperature 1."""
    data = config_to_dict(cfg)
    data["model"]["path"] = str(model_dir.resolve())
    data["rollout"]["temperature"] = 1.0   # Tinker's training logprobs are at temperature 1
    train = data["train"]
    train["lora"] = None if lora_rank is None else {**(train.get("lora") or {}), "rank": lora_rank}
    return Config.model_validate(data)


def model_factory(cfg: Config, model_dir: Path, run_dir: Path, full_finetune: bool = False,
                  routing: RoutingMemory | None = None) -> Any:
    """Builds the `ServiceModel`s: the first records into `run_dir`, the k-th into run_dir/models/model_k.
    `full_finetune`: train every weight whatever `lora_config` asks (get_info then says is_lora: false)."""
    def make(index: int, model_id: str, lora_rank: int | None) -> ServiceModel:
        # LoRA is the torch backend's: Megatron trains every weight (get_info says is_lora: false)
        lora_rank = None if full_finetune or cfg.train.backend != "torch" else lora_rank
        mcfg = model_config(cfg, model_dir, lora_rank)
        run = RunDir(run_dir if index == 0 else run_dir / "models" / f"model_{index}")
        run.write_config(config_to_dict(mcfg))
        backend, release = service_backend(mcfg)
        run.write_manifest(seed=mcfg.seed, backend=mcfg.train.backend, engine=mcfg.rollout.engine,
                           threads=torch.get_num_threads(), command=sys.argv,
                           extra={"mode": "tinker-service", "model_id": model_id, "lora_rank": lora_rank,
                                  "executor": mcfg.runtime.executor})
        return ServiceModel(model_id, backend, run, str(model_dir), lora_rank, routing, release)
    return make


def service_backend(cfg: Config) -> tuple[TrainBackend, Callable[[], None]]:
    """A model's trainer and what releases it: the run's backend in this process, or under
    `runtime.executor: ray` a train group of `runtime.ray.train_ranks` actors (their gradients
    summed over ranks, as the service's summed losses need) placed without an engine slot (sampling
    runs in the service's own process or on its servers)."""
    if cfg.runtime.executor != "ray":
        backend = make_train_backend(cfg, make_tokenizer(cfg))
        return backend, backend.close
    from axrl.ray_executor.executor import RayExecutor

    executor = RayExecutor(S.run_settings(cfg), cfg.runtime.ray, EventLog(), engine=False)
    try:
        group = executor.start_train_group()
    except BaseException:
        executor.close()
        raise

    def release() -> None:
        group.close()
        executor.close()
    return group, release


def build_service(serve_cfg: ServeConfig, cfg: Config, run_dir: Path, poll_s: float = 30.0,
                  full_finetune: bool = False) -> tuple[Any, Any, ServiceState]:
    """The FastAPI app of `axrl serve --training` and its state."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise FileExistsError(f"--run-dir {run_dir} is not empty: axrl serve --training records a new run "
                              "(each created model from checkpoint 0); choose another --run-dir")
    # rollout.exact: the served engine samples with the trainer's op set, so a sampled sequence's
    # logprobs are bitwise what forward_backward computes for it (docs/train.md "True on-policy")
    server = build_server(dataclasses.replace(serve_cfg, exact=serve_cfg.exact or cfg.rollout.exact))
    model_dir = Path(serve_cfg.model_path)
    base = {k: v.detach().clone() for k, v in hf_state_dict(server.engine.model).items()}
    routing = RoutingMemory() if records_routing(cfg, server.engine.config.num_experts) else None
    try:
        engine, scorer = sampling_engine(cfg, server, model_dir)
    except BaseException:
        server.engine.shutdown()
        raise
    mc = server.engine.config
    # the embedded engine's context is --context-length; servers apply their own and say so
    limits = PromptLimits(mc.vocab_size, serve_cfg.context_length if engine is server.engine else None,
                          getattr(mc, "max_position_embeddings", None))
    state = ServiceState(Sampler(engine, scorer, server.tokenizer, base, routing, limits),
                         model_factory(cfg, model_dir, run_dir, full_finetune, routing),
                         server.model_name, model_dir, server.engine.config.model_type, FutureStore(poll_s=poll_s))
    # at shutdown: the queued training work and step files first, then the sampling servers
    releases = [state.close] + ([scorer.close, engine.shutdown] if engine is not server.engine else [])
    app = create_app(server, on_shutdown=releases)
    add_tinker_routes(app, state)
    return app, server, state


def serve_training(serve_cfg: ServeConfig, cfg: Config, run_dir: Path, full_finetune: bool = False) -> None:
    """Run `axrl serve --training` until stopped."""
    import uvicorn

    started = time.perf_counter()
    app, server, state = build_service(serve_cfg, cfg, run_dir, full_finetune=full_finetune)
    base = f"http://{serve_cfg.host}:{serve_cfg.port}"
    print(startup_message(server, time.perf_counter() - started) + f"\n  Tinker API (tinker==0.38.0) at {base} "
          f"(TINKER_BASE_URL={base} TINKER_API_KEY=tml-…); recording into {run_dir}\n  "
          + sampling_note(cfg, state, server.engine.config.num_experts), file=sys.stderr, flush=True)
    uvicorn.run(app, host=serve_cfg.host, port=serve_cfg.port, log_level=serve_cfg.log_level, access_log=False)
