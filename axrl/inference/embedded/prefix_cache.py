"""A radix (prefix) cache over KV blocks for the embedded engine, as SGLang's radix cache.

What it stores. Blocks of `block_size` consecutive tokens of a sequence whose keys/values (and,
on an MoE model, routing) the engine has computed, in a pool of `num_blocks` blocks per layer.
A radix tree maps token prefixes, one whole block per edge, to pool blocks: the path from the
root spelling a prompt's first k·B tokens holds their K/V. A new request takes the longest cached
prefix of its prompt (at most len − 1 tokens: the last prompt token is always computed, its
hidden state samples the first output token), has it copied into its KV-cache slot and prefills
only the rest. A finished request inserts its prompt + output (what its slot holds) so the next
turn of an episode — whose prompt extends this one — reuses all of it; the engine also inserts a
prompt right after its prefill, so the other samples of a GRPO group admitted with it reuse its
prefill in the same iteration.

The engine keeps its static, slot-based KV cache (`kv_cache.py`): cached blocks are *copied*
into a slot at admission (a memcpy, tiny next to the prefill it saves), which keeps the decode
kernels unchanged. A paged KV cache with block tables would avoid that copy.

Lifetimes. Every node counts the running requests whose matched prefix passes through it
(`lock` at admission, `unlock` at finish): a locked node is never evicted, so a running request's
prefix is still there when it extends it at finish. Eviction takes the least recently used
unlocked leaf (a leaf's parent may become one next). A weight update `clear`s the tree: keys and
values computed by other weights must not be reused; requests admitted before it hold a stale
`generation` and neither insert nor unlock into the new tree.

Routing. A block inserted without routing (a request that did not ask for it) is matched only by
requests that do not ask for routing either; routing is stored per token as int32 rows
[B, layers, top_k] (the SGLang layout of the engine's results).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from axrl.inference.embedded.kv_cache import LayerKV, StaticKVCache
from axrl.model import ModelConfig

DEFAULT_BLOCK_SIZE = 16  # tokens per cached block (the engine's `prefix_cache_block` default)


def pool_tokens(prefix_cache_tokens: int, max_batch_size: int, max_seq_len: int) -> int:
    """The pool size in tokens an engine gets for `prefix_cache_tokens` (0: as many as its KV
    cache's slots hold). The teacher-forced engine path (replay/engine_path.py) sizes its mirror
    of a run's cache with it, so evictions happen where they happened in the run."""
    return prefix_cache_tokens or max_batch_size * max_seq_len


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]                 # the block's tokens (empty for the root)
    parent: "_Node | None"
    block: int = -1                      # pool block holding its K/V (−1: the root)
    has_routing: bool = False
    ref: int = 0                         # running requests whose prefix passes through here
    last_used: int = 0
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)


@dataclass
class CacheMatch:
    """A request's cached prefix: the nodes of its path (locked until `PrefixCache.release`)."""

    nodes: list[_Node]
    generation: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.nodes) * self.block_size


class PrefixCache:
    """Radix tree of KV blocks with LRU eviction and reference counts (see the module doc)."""

    def __init__(self, cache: StaticKVCache, *, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 routing_shape: tuple[int, int] | None = None) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"prefix cache: block_size and num_blocks must be >= 1, got {block_size}, {num_blocks}")
        self.kv, self.block_size, self.num_blocks = cache, block_size, num_blocks
        k0 = cache.k[0]
        self.blocks = LayerKV(len(cache.k), (num_blocks, cache.num_kv_heads, block_size, cache.head_dim), k0.dtype,
                              k0.device)
        self.routing = (None if routing_shape is None
                        else np.zeros((num_blocks, block_size, *routing_shape), dtype=np.int32))
        self.generation = 0
        self.clock = 0
        self.hits = self.queries = 0     # cached / asked-for prompt tokens (for health())
        self.evictions = 0
        self.clear()

    @classmethod
    def for_pool(cls, cache: StaticKVCache, config: ModelConfig, pool: tuple[int, int]) -> "PrefixCache":
        """The engine's cache for `pool` = (tokens, block size): whole blocks, at least one, with
        routing rows on an MoE model (the teacher-forced engine path builds its mirror the same way)."""
        tokens, block = pool
        return cls(cache, num_blocks=max(1, tokens // block), block_size=block,
                   routing_shape=config.routing_shape()[:2] if config.is_moe else None)

    # -- the tree ---------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget everything (a weight update): later matches start from an empty tree."""
        self.root = _Node(key=(), parent=None)
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.nodes: set[_Node] = set()
        # Eviction candidates (unlocked leaves) by last use, checked lazily when popped: an entry
        # is stale once its node was touched, locked, given a child or evicted since the push.
        self.lru: list[tuple[int, int, _Node]] = []
        self._order = itertools.count()
        self.generation += 1

    @property
    def num_cached_tokens(self) -> int:
        return len(self.nodes) * self.block_size

    def _blocks(self, tokens: list[int], n: int, first: int = 0) -> list[tuple[int, ...]]:
        """The whole blocks of tokens[:n] from block `first` on, as tree keys."""
        B = self.block_size
        return [tuple(tokens[i:i + B]) for i in range(first * B, n - n % B, B)]

    def match(self, tokens: list[int], *, need_routing: bool) -> CacheMatch:
        """Lock and return the longest cached prefix of `tokens` that leaves at least one token
        to compute (whole blocks; with `need_routing`, only blocks that stored routing)."""
        self.clock += 1
        path = self._walk(tokens, need_routing)
        for n in path:
            n.ref += 1
            n.last_used = self.clock
        self.queries += len(tokens)
        self.hits += len(path) * self.block_size
        return CacheMatch(path, self.generation, self.block_size)

    def match_length(self, tokens: list[int], *, need_routing: bool) -> int:
        """How many tokens `match` would give now (nothing is locked or counted)."""
        return len(self._walk(tokens, need_routing)) * self.block_size

    def _walk(self, tokens: list[int], need_routing: bool) -> list[_Node]:
        node, path = self.root, []
        for key in self._blocks(tokens, len(tokens) - 1):
            child = node.children.get(key)
            if child is None or (need_routing and not child.has_routing):
                break
            path.append(child)
            node = child
        return path

    def release(self, m: CacheMatch) -> None:
        """Unlock a match (its request finished); a match from before a `clear` is just dropped."""
        if m.generation == self.generation:
            for n in m.nodes:
                self._unlock(n)
        m.nodes = []

    def insert(self, tokens: list[int], slot: int, routing: np.ndarray | None, owner: CacheMatch | None = None) -> None:
        """Cache the whole blocks of `tokens`, whose K/V are columns [0, len(tokens)) of `slot` in
        the engine's KV cache (routing: their rows [len, layers, top_k], or None). Blocks already
        cached are only touched; a full pool evicts LRU unlocked leaves, and when nothing can be
        evicted the rest is not cached.

        `owner`: the match of the request inserting (its nodes spell a prefix of `tokens`); the
        walk starts below it and the new nodes join it, locked until the request is released."""
        self.clock += 1
        node, added, first = self.root, [], 0
        if owner is not None and owner.generation == self.generation and owner.nodes:
            node, first = owner.nodes[-1], len(owner.nodes)
        try:
            for i, key in enumerate(self._blocks(tokens, len(tokens), first), start=first):
                child = node.children.get(key)
                if child is None:
                    block = self._allocate()
                    if block < 0:
                        break
                    child = _Node(key=key, parent=node, block=block)
                    node.children[key] = child
                    self.nodes.add(child)
                    self._store(block, slot, i * self.block_size)
                if routing is not None and not child.has_routing and self.routing is not None:
                    self.routing[child.block] = routing[i * self.block_size:(i + 1) * self.block_size]
                    child.has_routing = True
                child.last_used = self.clock
                child.ref += 1  # held while inserting: the allocation below must not evict our own path
                added.append(child)
                node = child
        finally:
            if owner is not None and owner.generation == self.generation:
                owner.nodes.extend(added)  # stay locked with the request's own prefix
            else:
                for n in added:
                    self._unlock(n)

    def _unlock(self, n: _Node) -> None:
        n.ref -= 1
        if n.ref == 0:
            self._candidate(n)

    def _candidate(self, n: _Node) -> None:
        """Queue `n` for eviction if it is an unlocked leaf (at its current last use)."""
        if n.ref == 0 and not n.children and n.parent is not None:
            heapq.heappush(self.lru, (n.last_used, next(self._order), n))
            if len(self.lru) > 4 * len(self.nodes) + 1024:  # drop the stale entries
                self.lru = [e for e in self.lru if self._evictable(e)]
                heapq.heapify(self.lru)

    def _evictable(self, entry: tuple[int, int, _Node]) -> bool:
        used, _, n = entry
        return n in self.nodes and n.ref == 0 and not n.children and n.last_used == used

    def _allocate(self) -> int:
        """A free pool block, or the least recently used unlocked leaf's (−1: none)."""
        if self.free:
            return self.free.pop()
        while self.lru:
            entry = heapq.heappop(self.lru)
            if not self._evictable(entry):
                continue
            victim = entry[2]
            parent = victim.parent
            del parent.children[victim.key]
            self.nodes.discard(victim)
            self.evictions += 1
            self._candidate(parent)  # may have become a leaf
            return victim.block
        return -1

    # -- data movement ----------------------------------------------------------------------------
    def _store(self, block: int, slot: int, start: int) -> None:
        B = self.block_size
        for layer in range(len(self.blocks.k)):
            self.blocks.k[layer][block] = self.kv.k[layer][slot, :, start:start + B]
            self.blocks.v[layer][block] = self.kv.v[layer][slot, :, start:start + B]

    def load(self, m: CacheMatch, slot: int) -> None:
        """Copy a match's K/V into columns [0, m.num_tokens) of `slot`."""
        if not m.nodes:
            return
        blocks = torch.tensor([n.block for n in m.nodes], device=self.blocks.k[0].device)
        n = m.num_tokens
        for layer in range(len(self.blocks.k)):
            # [blocks, heads, B, D] -> [heads, blocks * B, D]
            self.kv.k[layer][slot, :, :n] = (self.blocks.k[layer][blocks].transpose(0, 1)
                                             .reshape(self.kv.num_kv_heads, n, -1))
            self.kv.v[layer][slot, :, :n] = (self.blocks.v[layer][blocks].transpose(0, 1)
                                             .reshape(self.kv.num_kv_heads, n, -1))

    def routing_of(self, m: CacheMatch) -> np.ndarray:
        """The match's stored routing rows [m.num_tokens, layers, top_k]."""
        assert self.routing is not None
        return self.routing[[n.block for n in m.nodes]].reshape(m.num_tokens, *self.routing.shape[2:]).copy()

    def stats(self) -> dict[str, float]:
        return {"cached_tokens": self.num_cached_tokens, "capacity_tokens": self.num_blocks * self.block_size,
                "hit_rate": self.hits / self.queries if self.queries else 0.0, "evictions": self.evictions}
