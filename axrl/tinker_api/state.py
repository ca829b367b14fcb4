"""What the Tinker-compatible service holds: sessions, training models, sampling sessions, saved
weights, the futures, and the two executors (one thread trains — all models, each in its seq_id
order —, a pool samples)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from axrl.tinker_api.errors import UserError
from axrl.tinker_api.futures import FutureStore
from axrl.tinker_api.model import ServiceModel
from axrl.tinker_api.sampling import BASE, Sampler

#: builds a model: (creation index, model id, LoRA rank or None) -> ServiceModel
ModelFactory = Callable[[int, str, "int | None"], ServiceModel]


@dataclass
class Session:
    tags: list[str]
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: str | None = None


class ServiceState:
    """The registry behind the `/api/v1` routes."""

    def __init__(self, sampler: Sampler, make_model: ModelFactory, base_model: str, model_dir: Path,
                 arch: str, store: FutureStore | None = None, sample_threads: int = 16) -> None:
        self.sampler, self.make_model = sampler, make_model
        self.base_model, self.model_dir, self.arch = base_model, model_dir, arch
        self.store = store or FutureStore()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ServiceModel] = {}
        self.sampling_sessions: dict[str, str] = {}      # id -> snapshot path
        self.saved: dict[str, Path] = {}                 # tinker:// path of save_weights -> checkpoint dir
        self.train_pool = ThreadPoolExecutor(1, thread_name_prefix="axrl-service-train")
        self.sample_pool = ThreadPoolExecutor(sample_threads, thread_name_prefix="axrl-service-sample")
        self.lock = threading.Lock()
        self.created = 0

    # -- sessions ---------------------------------------------------------------------------------
    def new_session(self, tags: list[str]) -> str:
        sid = f"axrl-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = Session(tags=tags)
        return sid

    def session(self, sid: str) -> Session:
        if sid not in self.sessions:
            raise UserError(f"unknown session_id {sid!r} (create_session first)")
        return self.sessions[sid]

    # -- models -----------------------------------------------------------------------------------
    def check_base_model(self, name: str | None) -> None:
        """A base model must be the one this server loaded (its directory or its served name)."""
        if name in (None, self.base_model, str(self.model_dir)):
            return
        try:
            if Path(str(name)).resolve() == self.model_dir.resolve():
                return
        except OSError:
            pass
        raise UserError(f"base_model {name!r}: this server trains {str(self.model_dir)!r} (also called "
                        f"{self.base_model!r}); start another `axrl serve --training` for another model")

    def create_model(self, model_id: str, lora_rank: int | None) -> ServiceModel:
        """Build (on the training thread) the model `model_id`."""
        with self.lock:
            if model_id in self.models:
                return self.models[model_id]
            index, self.created = self.created, self.created + 1
        model = self.make_model(index, model_id, lora_rank)
        self.models[model_id] = model
        self.store.open_model(model_id)
        return model

    def model(self, model_id: str | None) -> ServiceModel:
        if model_id not in self.models:
            raise UserError(f"unknown model_id {model_id!r} (create_model first; known: {sorted(self.models)})")
        return self.models[model_id]

    # -- weights ----------------------------------------------------------------------------------
    def checkpoint_of(self, path: str) -> Path:
        if path not in self.saved:
            raise UserError(f"path {path!r}: no weights saved under this name on this server "
                            f"(saved: {sorted(self.saved)[:5]})")
        return self.saved[path]

    def saved_by(self, path: str) -> ServiceModel:
        """The model whose save_weights wrote `path` (`tinker://MODEL/weights/NAME`)."""
        return self.model(path.removeprefix("tinker://").rsplit("/weights/", 1)[0])

    def open_sampling_session(self, model_path: str | None) -> str:
        path = model_path or BASE
        self.sampler.check(path)
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[sid] = path
        return sid

    def sampling_path(self, sid: str | None) -> str:
        if sid not in self.sampling_sessions:
            raise UserError(f"unknown sampling_session_id {sid!r} (create_sampling_session first)")
        return self.sampling_sessions[sid]

    def info(self, model: ServiceModel) -> dict[str, Any]:
        """get_info: the model directory is the model name, so the SDK loads its tokenizer locally."""
        name = str(self.model_dir)
        return {"type": "get_info", "model_id": model.model_id, "model_name": name,
                "model_data": {"arch": self.arch, "model_name": name, "tokenizer_id": name},
                "is_lora": model.lora_rank is not None, "lora_rank": model.lora_rank}

    def close(self) -> None:
        """Finish the queued training work and write every step file still queued."""
        self.train_pool.shutdown(wait=True, cancel_futures=True)
        for model in self.models.values():
            model.close()
        self.sample_pool.shutdown(wait=False, cancel_futures=True)
