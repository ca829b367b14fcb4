"""The engine-independent half of weight updates on rollout servers: which version every server
holds, the choice between loading an HF directory and a distributed send, the export of a state
dict (written next to the model's config and tokenizer, only the newest kept), and how a server
the launcher restarted gets the latest weights again (always from a directory: it left any
process group). Subclasses say how one server loads a directory (`load_dir`) and how a state dict
is sent by a process group (`send_distributed`): SGLang's routes (`sglang/weight_updater.py`) and
vLLM's (`vllm/weight_updater.py`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from axrl.inference.remote.launcher import ServerLauncher
from axrl.inference.remote.transport import BlockingTransport
from axrl.inference.remote import weight_sync


class ServerWeights:
    """Weight versions and updates for the servers behind one `BlockingTransport`.

    Args:
        transport: the blocking calls to the servers.
        launcher: the servers' launcher, if any (its restart counts tell which need a resync).
        version: the version the servers hold now.
        weight_sync: "disk" (export + load the directory) or "distributed" (`send_distributed`).
        export_dir: where exported HF directories go.
        model_dir: the HF directory whose config and tokenizer files go next to exported weights.
    """

    def __init__(self, transport: BlockingTransport, launcher: ServerLauncher | None, *, version: int,
                 weight_sync: str, export_dir: Path, model_dir: Path | None) -> None:
        self.transport, self.launcher = transport, launcher
        self.weight_sync, self.export_dir, self.model_dir = weight_sync, export_dir, model_dir
        self.version = version
        self.updated = False                        # any update yet (else servers hold model_path)
        self.last_dir: Path | None = None           # newest exported/loaded HF directory (resync after restart)
        self.last_state: dict[str, torch.Tensor] | None = None  # distributed: kept to resync a restarted server
        # Restart count of each server when it last got the current weights.
        self.synced_restarts = [launcher.restarts(i) if launcher else 0 for i in range(len(transport.urls))]

    # -- what an engine's routes provide ---------------------------------------------------------
    def load_dir(self, servers: Sequence[int], path: Path, version: int) -> None:
        """Servers `servers` load the HF directory `path` and label their weights `version`."""
        raise NotImplementedError

    def send_distributed(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Every server receives `state_dict` through a process group with this process."""
        raise NotImplementedError

    def leave_group(self) -> None:
        """Leave the weight process group, if one was formed (nothing to do by default)."""

    # -- shared ----------------------------------------------------------------------------------
    def update(self, source: Any, version: int | None = None) -> int:
        """Load new weights on every server; returns the new version (`version`, else previous + 1).

        `source`: an HF-named state dict (sent by disk or process group, per `weight_sync`) or the
        path of an HF directory the servers can read (always by disk).
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ValueError(f"version must be an int or None, got {version!r}")
        new = self.version + 1 if version is None else version
        every = range(len(self.transport.urls))
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path / 'config.json'} not found: update_weights needs an HF model directory")
            self.load_dir(every, path.resolve(), new)
            self.last_dir, self.last_state = path, None
        elif isinstance(source, Mapping):
            if self.weight_sync == "disk":
                path = self._export(source, new)
                self.load_dir(every, path.resolve(), new)
                self.last_dir = path
            else:
                self.send_distributed(source, new)
                # A restarted server rejoins through disk with these (the live trainer tensors change later).
                self.last_state = {k: v.detach().to("cpu", copy=True) for k, v in source.items()}
                self.last_dir = None
        else:
            raise ValueError(f"update_weights source must be a state dict or an HF directory, got {type(source).__name__}")
        self.version, self.updated = new, True
        if self.launcher is not None:
            self.synced_restarts = [self.launcher.restarts(i) for i in every]
        return new

    def resync(self, server: int) -> None:
        """Give a restarted server the latest weights (from a directory; it left any process group)."""
        if self.last_dir is None and self.last_state is not None:
            self.last_dir = weight_sync.export_weights(self.last_state, self._require_model_dir(),
                                                       self.export_dir / "resync")
        assert self.last_dir is not None, "resync before any update"
        self.on_member_lost()
        self.load_dir([server], self.last_dir.resolve(), self.version)

    def on_member_lost(self) -> None:
        """A server restarted: a process group it was in must be formed anew (nothing by default)."""

    def _require_model_dir(self) -> Path:
        if self.model_dir is None:
            raise ValueError("model_dir: exporting a state dict needs the model's HF directory (config.json, "
                             "tokenizer); pass model_dir= or a launcher")
        return self.model_dir

    def _export(self, state_dict: Mapping[str, torch.Tensor], version: int) -> Path:
        out = weight_sync.export_weights(state_dict, self._require_model_dir(), self.export_dir / f"v{version}")
        for old in self.export_dir.glob("v*"):  # keep only the newest (a restarted server reloads it)
            if old != out and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        return out
