"""How the embedded engine's scheduler uses the prefix cache around a prefill: which requests of
an admission wait for another's prefill, taking a cached prefix into a slot, and caching what a
slot holds. The cache itself (blocks, matching, locking) is `axrl.inference.embedded.prefix_cache`."""

from __future__ import annotations

import numpy as np

from axrl.inference.embedded.inbox import SequenceState
from axrl.inference.embedded.prefix_cache import PrefixCache


def split_shared(pc: PrefixCache, seqs: list[SequenceState],
                 is_moe: bool) -> tuple[list[SequenceState], list[SequenceState]]:
    """(prefill now, prefill after them): a request goes second when an earlier first-round
    request of this admission shares more whole blocks of its prompt than the cache holds."""
    B = pc.block_size
    trie: dict = {}
    first, after = [], []
    for seq in seqs:
        need = is_moe and seq.wants_routing
        cached = pc.match_length(seq.prompt, need_routing=need)
        node, shared = trie, 0
        for i in range(0, len(seq.prompt) - 1 - (len(seq.prompt) - 1) % B, B):
            node = node.get(tuple(seq.prompt[i:i + B]))
            if node is None:
                break
            shared += B
        if shared > cached:
            after.append(seq)
            continue
        first.append(seq)
        node = trie
        for i in range(0, len(seq.prompt) - 1 - (len(seq.prompt) - 1) % B, B):
            node = node.setdefault(tuple(seq.prompt[i:i + B]), {})
    return first, after


def take_cached_prefix(pc: PrefixCache, seq: SequenceState, slot_tokens: list[list[int]], is_moe: bool) -> None:
    """Lock the request's cached prefix and copy its K/V (and routing rows) into its slot.
    `slot_tokens[slot]` (what the slot still holds from its last request) is consumed."""
    m = pc.match(seq.prompt, need_routing=is_moe and seq.wants_routing)
    seq.cache_match, seq.cached_tokens = m, m.num_tokens
    held, slot_tokens[seq.slot] = slot_tokens[seq.slot], []
    c = m.num_tokens
    # The slot may still hold these tokens' K/V from its previous request (the last turn of
    # the same episode, usually): then there is nothing to copy.
    if not (len(held) >= c and held[:c] == seq.prompt[:c]):
        pc.load(m, seq.slot)
    if m.num_tokens and is_moe and seq.wants_routing:
        seq.routing.append(pc.routing_of(m))


def cache_sequence(pc: PrefixCache | None, seq: SequenceState, tokens: list[int], is_moe: bool) -> None:
    """Insert `tokens` (a prefix of what the request's slot holds K/V for) into the prefix
    cache, unless there is none or the weights changed since the request was admitted."""
    m = seq.cache_match
    if pc is None or m is None or m.generation != pc.generation:
        return
    routing = None
    if is_moe and seq.wants_routing and seq.routing:
        routing = np.concatenate(seq.routing)[:len(tokens)]
        if len(routing) < len(tokens):
            routing = None
    pc.insert(tokens, seq.slot, routing, owner=m)


def retire(pc: PrefixCache | None, seq: SequenceState, held: list[int], slot_tokens: list[list[int]],
           is_moe: bool) -> None:
    """A request finished with K/V for `held` in its slot: cache them, note that the slot still
    holds them (its next request may skip the copy, `take_cached_prefix`) and unlock its prefix."""
    cache_sequence(pc, seq, held, is_moe)
    m = seq.cache_match
    if pc is None or m is None:
        return
    if m.generation == pc.generation and seq.slot >= 0:
        slot_tokens[seq.slot] = held  # still valid K/V until the slot's next request writes
    pc.release(m)
    seq.cache_match = None
