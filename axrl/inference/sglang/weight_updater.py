"""The SGLang client's weight routes, on top of the shared version bookkeeping
(`axrl/inference/remote/weights.py`). The tensor transport itself (export, buckets,
collectives) is `remote/weight_sync`.

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
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx
import torch

from axrl.inference.remote import weight_sync
from axrl.inference.remote.launcher import ServerLauncher, free_port
from axrl.inference.remote.transport import BlockingTransport, error_message, in_daemon_thread
from axrl.inference.remote.weights import ServerWeights

_GROUP_IDS = itertools.count(1)  # weight-group names must be unique per trainer process


class WeightUpdater(ServerWeights):
    """SGLang's weight routes for the servers behind one `BlockingTransport`.

    Args:
        transport: the blocking calls to the servers.
        launcher: the servers' launcher, if any (its restart counts tell which need a resync).
        version: the version the servers hold now.
        weight_sync, sync_backend, master_address, bucket_bytes, group_timeout_s, export_dir,
            model_dir: as for `SGLangEngine`.
    """

    def __init__(self, transport: BlockingTransport, launcher: ServerLauncher | None, *, version: int,
                 weight_sync: str, sync_backend: str, master_address: str, bucket_bytes: int,
                 group_timeout_s: float, export_dir: Path, model_dir: Path | None) -> None:
        super().__init__(transport, launcher, version=version, weight_sync=weight_sync, export_dir=export_dir,
                         model_dir=model_dir)
        self.sync_backend, self.master_address = sync_backend, master_address
        self.bucket_bytes, self.group_timeout_s = bucket_bytes, group_timeout_s
        self._group: Any = None
        self._group_name: str | None = None
        self._group_stale = False

    def load_dir(self, servers: Sequence[int], path: Path, version: int) -> None:
        """`/update_weights_from_disk` on `servers` (all at once)."""
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        if len(servers) == len(self.transport.urls):
            self.transport.post_all("/update_weights_from_disk", body)
        else:
            for i in servers:
                self.transport.control(i, "POST", "/update_weights_from_disk", body)

    def on_member_lost(self) -> None:
        self._group_stale = self.weight_sync == "distributed"  # the group lost a member

    def send_distributed(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Broadcast `state_dict` in buckets inside `/begin_weight_update` … `/end_weight_update`."""
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
