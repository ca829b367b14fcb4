"""The SGLang client's side of weight updates: which version every server holds, how new weights
get there (an exported HF directory, or a broadcast in a process group with the servers), and
how a restarted server is given the latest weights again. The tensor transport itself (export,
buckets, collectives) is `weight_sync`.

`weight_sync="disk"` exports the state dict as an HF directory and calls
`/update_weights_from_disk`; `"distributed"` builds a process group with every server
(`/init_weights_update_group`; the trainer is rank 0) and broadcasts the tensors inside
`/begin_weight_update` … `/end_weight_update` (skipped on servers that predate them), bucketed by
`bucket_bytes`. Both send `weight_version` = str(version).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import httpx
import torch

from axrl.inference.sglang import weight_sync
from axrl.inference.sglang.launcher import SGLangLauncher, free_port
from axrl.inference.sglang.transport import BlockingTransport, error_message, in_daemon_thread

_GROUP_IDS = itertools.count(1)  # weight-group names must be unique per trainer process


class WeightUpdater:
    """Weight versions and updates for the servers behind one `BlockingTransport`.

    Args:
        transport: the blocking calls to the servers.
        launcher: the servers' launcher, if any (its restart counts tell which need a resync).
        version: the version the servers hold now.
        weight_sync, sync_backend, master_address, bucket_bytes, group_timeout_s, export_dir,
            model_dir: as for `SGLangEngine`.
    """

    def __init__(self, transport: BlockingTransport, launcher: SGLangLauncher | None, *, version: int,
                 weight_sync: str, sync_backend: str, master_address: str, bucket_bytes: int,
                 group_timeout_s: float, export_dir: Path, model_dir: Path | None) -> None:
        self.transport, self.launcher = transport, launcher
        self.weight_sync, self.sync_backend, self.master_address = weight_sync, sync_backend, master_address
        self.bucket_bytes, self.group_timeout_s = bucket_bytes, group_timeout_s
        self.export_dir, self.model_dir = export_dir, model_dir
        n = len(transport.urls)
        self.version = version
        self.updated = False                        # any update yet (else servers hold model_path)
        self.last_dir: Path | None = None           # newest exported/loaded HF directory (resync after restart)
        self.last_state: dict[str, torch.Tensor] | None = None  # distributed: kept to resync a restarted server
        # Restart count of each server when it last got the current weights.
        self.synced_restarts = [launcher.restarts(i) if launcher else 0 for i in range(n)]
        self._group: Any = None
        self._group_name: str | None = None
        self._group_stale = False

    def update(self, source: Any, version: int | None = None) -> int:
        """Load new weights on every server; returns the new version (`version`, else previous + 1).

        `source`: an HF-named state dict (sent by disk or process group, per `weight_sync`) or the
        path of an HF directory the servers can read (always by disk).
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise ValueError(f"version must be an int or None, got {version!r}")
        new = self.version + 1 if version is None else version
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path / 'config.json'} not found: update_weights needs an HF model directory")
            self._update_from_disk(path, new)
            self.last_state = None
        elif isinstance(source, Mapping):
            if self.weight_sync == "disk":
                self._update_from_disk(self._export(source, new), new)
            else:
                self._update_distributed(source, new)
        else:
            raise ValueError(f"update_weights source must be a state dict or an HF directory, got {type(source).__name__}")
        self.version, self.updated = new, True
        if self.launcher is not None:
            self.synced_restarts = [self.launcher.restarts(i) for i in range(len(self.transport.urls))]
        return new

    def resync(self, server: int) -> None:
        """Give a restarted server the latest weights (by disk; it left the process group)."""
        if self.last_dir is None and self.last_state is not None:
            self.last_dir = weight_sync.export_weights(self.last_state, self._require_model_dir(),
                                                       self.export_dir / "resync")
        self._group_stale = self.weight_sync == "distributed"  # the group lost a member
        self.transport.control(server, "POST", "/update_weights_from_disk",
                               {"model_path": str(self.last_dir), "weight_version": str(self.version),
                                "flush_cache": True})

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

    def _update_from_disk(self, path: Path, version: int) -> None:
        self.transport.post_all("/update_weights_from_disk", {"model_path": str(path.resolve()),
                                                              "weight_version": str(version), "flush_cache": True})
        self.last_dir = path

    def _update_distributed(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._ensure_group()
        self.transport.post_all("/begin_weight_update", {}, ok404=True)
        parts = weight_sync.buckets(state_dict, self.bucket_bytes)
        for k, names in enumerate(parts):
            last = k == len(parts) - 1
            body = {**weight_sync.describe(state_dict, names), "group_name": self._group_name, "flush_cache": last,
                    "weight_version": str(version) if last else None}
            tensors = weight_sync.send_list(state_dict, names, self.sync_backend)
            self._with_collective("/update_weights_from_distributed", lambda i: body,
                                  lambda: weight_sync.broadcast_weights(self._group, tensors))
        self.transport.post_all("/end_weight_update", {}, ok404=True)
        # A restarted server rejoins through disk with these (the live trainer tensors change later).
        self.last_state = {k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()}
        self.last_dir = None

    def _with_collective(self, path: str, body_for: Callable[[int], Any], local: Callable[[], Any]) -> Any:
        """POST `path` to every server while running the trainer's side of a collective; fail as
        soon as any side fails (a server that refuses never joins, so waiting would only hang)."""
        n = len(self.transport.urls)
        pool = concurrent.futures.ThreadPoolExecutor(n + 1)
        try:
            posts = [pool.submit(self.transport.control, i, "POST", path, body_for(i)) for i in range(n)]
            mine = in_daemon_thread(local)
            done, _ = concurrent.futures.wait(posts + [mine], return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in posts + [mine]:
                if f in done and f.exception() is not None:
                    self._group_stale = True
                    raise f.exception()
            for f in posts:
                resp = f.result()
                if not resp.json().get("success", True):
                    self._group_stale = True
                    raise RuntimeError(f"{path} failed: {error_message(resp)}")
            return mine.result()
        finally:
            pool.shutdown(wait=False)

    def _ensure_group(self) -> None:
        if self._group is not None and not self._group_stale:
            return
        self.leave_group()  # re-form without a dead member's leftovers
        name = f"axrl_weights_{os.getpid()}_{next(_GROUP_IDS)}"
        port, world = free_port(self.master_address), len(self.transport.urls) + 1

        def body_for(i: int) -> dict[str, Any]:
            return {"master_address": self.master_address, "master_port": port, "rank_offset": i + 1,
                    "world_size": world, "group_name": name, "backend": self.sync_backend}

        self._group = self._with_collective("/init_weights_update_group", body_for, lambda: weight_sync.init_weights_group(
            master_address=self.master_address, master_port=port, rank=0, world_size=world, group_name=name,
            backend=self.sync_backend, timeout_s=self.group_timeout_s))
        self._group_name, self._group_stale = name, False

    def leave_group(self) -> None:
        """Destroy the weight process group on every server (best effort) and here."""
        if self._group is None:
            return
        for url in self.transport.urls:
            try:
                self.transport.client.post(url + "/destroy_weights_update_group",
                                           json={"group_name": self._group_name}, timeout=10.0)
            except httpx.HTTPError:
                pass  # a dead server left the group anyway
        weight_sync.destroy_weights_group(self._group)
        self._group = None
