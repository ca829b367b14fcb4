"""Which server of the SGLang client takes a request, and how one submission is cut into batches.

Requests with the same `sticky_key` (one per episode, set by the agent loop) go to the same
server, chosen by a stable hash of the key, so a trajectory's multi-turn prefix stays in that
server's cache and a run routes the same way every time; requests without a key go round robin.
When a request moves off a failing server (no launcher to restart it), its key follows it.
"""

from __future__ import annotations

import hashlib
import itertools

from axrl.inference.protocol import GenerateRequest


class Router:
    """Server choice for `num_servers` servers. Not thread-safe: the caller holds its lock."""

    def __init__(self, num_servers: int) -> None:
        self.num_servers = num_servers
        self._sticky_override: dict[str, int] = {}
        self._round_robin = itertools.count()

    def route(self, req: GenerateRequest) -> int:
        """The server for `req`: its sticky key's (hash or override), else the next in turn."""
        n = self.num_servers
        if req.sticky_key is None:
            return next(self._round_robin) % n
        if req.sticky_key in self._sticky_override:
            return self._sticky_override[req.sticky_key]
        digest = hashlib.blake2b(req.sticky_key.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % n

    def move(self, reqs: list[GenerateRequest], server: int) -> int:
        """The server after `server`, where `reqs` go next; their sticky keys follow them."""
        if self.num_servers == 1:
            return server
        moved = (server + 1) % self.num_servers
        for r in reqs:
            if r.sticky_key is not None:
                self._sticky_override[r.sticky_key] = moved
        return moved


def split_batches(ks: list[int], reqs: list[GenerateRequest], lists_ok: bool) -> list[list[int]]:
    """Indices `ks` (into `reqs`) of one server, cut into batches SGLang accepts: routing flags
    shared, and start lengths too unless the server takes a list of them (`lists_ok`: axrl serve)."""
    batches: dict[tuple, list[int]] = {}
    for k in ks:
        r = reqs[k]
        key = (r.return_routed_experts, None if lists_ok else r.routed_experts_start_len)
        batches.setdefault(key, []).append(k)
    return list(batches.values())
