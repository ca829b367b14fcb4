"""Prefix-tree packing of a micro-batch: shared prefixes computed once (`train.prefix_merge`).

The samples of a micro-batch often share long prefixes (a GRPO group's prompt and tool schema;
the per-turn samples of one episode, each a prefix of the next). Here they become one packed
sequence of *slots*, one forward/backward over it, and the results are unpacked back to the
micro-batch's CSR layout, so losses, the trace and the analysis never see the tree.

Slots. A slot is one token at one position whose logits predict exactly one next token (its
*label*). Two samples share the slot of their token p iff their tokens 0..p+1 are equal — the
trie is keyed by (token, next token) — so at a fork the last shared token is duplicated, one
copy per branch, and every slot keeps a single label. A sample's last token has no label (its
logits are never read) and joins any slot with the same token and prefix; a sample that is a
prefix of another (a per-turn sample inside the next turn's) therefore costs nothing.

Layout. Slots are numbered in DFS pre-order (children in first-seen order, deterministic), so a
slot's subtree is the contiguous range [s, subtree_end[s]) and its ancestors are exactly the
earlier slots whose subtree range contains it. Attention (`attention_mask`): slot i sees slot j
iff j is i or one of its ancestors — each node attends fully to its ancestors' ranges and
causally within itself. Position ids are each slot's depth, the token's position on its own
path, so RoPE sees what an unmerged forward sees.

Unpacking. Token t of sample i reads slot `token_slot[t]` (its routing, as input) and its
logprob/entropy from the slot of token t-1 (`pred_slot`, −1 at a sample's first token): a
gather, so the gradient reaching a shared slot is the sum of what every sample's loss sends it,
exactly the unmerged gradient.

Training path. `label_owner[s]` is the one sample that trains slot s's label: the first, in
batch order, whose loss mask covers the label token (−1 if none). A shared slot is thus trained
on by at most one path in the packed view (`loss_mask`), and under R3 the routing replayed at a
shared slot is its training path's (`routing_source`; with no training path, the first sample's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from axrl.train.protocol import PackedBatch


@dataclass
class PrefixTree:
    """A micro-batch packed as a prefix tree of S slots (see the module doc); T = the micro-batch's tokens."""

    input_ids: torch.Tensor       # int64 [S] token of each slot, DFS order
    position_ids: torch.Tensor    # int64 [S] depth of the slot on its path (RoPE position)
    subtree_end: torch.Tensor     # int64 [S] slots [s, subtree_end[s]) are s and its descendants
    labels: torch.Tensor          # int64 [S] the one next token a slot predicts; −1: none (a last token)
    label_owner: torch.Tensor     # int64 [S] sample that trains the slot's label; −1: none
    token_slot: torch.Tensor      # int64 [T] slot of each packed token
    pred_slot: torch.Tensor       # int64 [T] slot whose logits predict token t; −1 at a sample's first token
    routing_source: torch.Tensor  # int64 [S] packed token whose recorded routing the slot replays (R3)

    @property
    def num_slots(self) -> int:
        return self.input_ids.numel()

    @property
    def loss_mask(self) -> torch.Tensor:
        """bool [S]: slots whose label some path trains (each by exactly one path, `label_owner`)."""
        return self.label_owner >= 0

    def attention_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """bool [S, S], True = may attend: query i sees key j iff j is i or an ancestor of i
        (j <= i < subtree_end[j] in DFS order)."""
        s = torch.arange(self.num_slots, device=device)
        end = self.subtree_end.to(device)
        return (s[None, :] <= s[:, None]) & (s[:, None] < end[None, :])

    def unpack(self, per_slot: torch.Tensor) -> torch.Tensor:
        """[S, ...] → [T, ...]: each token's own slot (routing, hidden states)."""
        return per_slot[self.token_slot.to(per_slot.device)]

    def unpack_predictions(self, per_slot: torch.Tensor) -> torch.Tensor:
        """[S] values about a slot's label → [T] in PackedBatch alignment: token t gets the value
        of the slot predicting it, a sample's first token 0 (differentiable gather)."""
        pred = self.pred_slot.to(per_slot.device)
        out = per_slot[pred.clamp_min(0)]
        return torch.where(pred >= 0, out, torch.zeros_like(out))


def build_prefix_tree(mb: PackedBatch) -> PrefixTree:
    """The prefix tree of a micro-batch's samples (pure function of its token ids and loss mask)."""
    ids = mb.input_ids.tolist()
    offsets = mb.offsets.tolist()
    trie = _Trie(node_of=[0] * len(ids))
    trie.add_labelled_tokens(ids, offsets)
    trie.add_last_tokens(ids, offsets)
    order, slot_of, end = _dfs_order(trie.children)
    token_slot = [slot_of[n] for n in trie.node_of]
    pred_slot, owner, source = _training_paths(token_slot, offsets, (mb.loss_mask > 0).tolist(), len(order))
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return PrefixTree(
        input_ids=as_t([trie.tok[n - 1] for n in order]),
        position_ids=as_t([trie.depth[n - 1] for n in order]),
        subtree_end=as_t([end[n] for n in order]),
        labels=as_t([trie.label[n - 1] for n in order]),
        label_owner=as_t(owner),
        token_slot=as_t(token_slot),
        pred_slot=as_t(pred_slot),
        routing_source=as_t(source),
    )


@dataclass
class _Trie:
    """The slots as trie nodes in creation order (node ids start at 1; 0 is the virtual root);
    `_dfs_order` renumbers them into slots."""

    node_of: list[int]                    # node of each packed token
    tok: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    label: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=lambda: [[]])   # children[0] is the root's
    by_key: list[dict[tuple[int, int], int]] = field(default_factory=lambda: [{}])
    # first child with a given token (a last token may join it)
    by_tok: list[dict[int, int]] = field(default_factory=lambda: [{}])

    def new_node(self, parent: int, t: int, d: int, lab: int) -> int:
        self.tok.append(t), self.depth.append(d), self.label.append(lab)
        self.children.append([]), self.by_key.append({}), self.by_tok.append({})
        n = len(self.tok)
        self.children[parent].append(n)
        self.by_tok[parent].setdefault(t, n)
        return n

    def add_labelled_tokens(self, ids: list[int], offsets: list[int]) -> None:
        """Pass 1: every token with a label, keyed by (token, next token)."""
        for i in range(len(offsets) - 1):
            a, b = offsets[i], offsets[i + 1]
            node = 0
            for p in range(a, b - 1):
                key = (ids[p], ids[p + 1])
                child = self.by_key[node].get(key)
                if child is None:
                    child = self.new_node(node, ids[p], p - a, ids[p + 1])
                    self.by_key[node][key] = child
                self.node_of[p] = child
                node = child

    def add_last_tokens(self, ids: list[int], offsets: list[int]) -> None:
        """Pass 2: last tokens (no label) join any existing slot of the same token and prefix; only
        after pass 1, so whether one joins does not depend on sample order."""
        for i in range(len(offsets) - 1):
            a, b = offsets[i], offsets[i + 1]
            parent = self.node_of[b - 2] if b - a > 1 else 0
            child = self.by_tok[parent].get(ids[b - 1])
            if child is None:
                child = self.new_node(parent, ids[b - 1], b - 1 - a, -1)
            self.node_of[b - 1] = child


def _dfs_order(children: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """DFS pre-order of the trie (iterative; children in creation order): the nodes in slot order,
    each node's slot and the end of its subtree's slot range (indexed by node id)."""
    n_nodes = len(children) - 1
    slot_of = [0] * (n_nodes + 1)
    end = [0] * (n_nodes + 1)
    order: list[int] = []
    stack: list[tuple[int, bool]] = [(c, False) for c in reversed(children[0])]
    while stack:
        node, done = stack.pop()
        if done:
            end[node] = len(order)
            continue
        slot_of[node] = len(order)
        order.append(node)
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(children[node]))
    return order, slot_of, end


def _training_paths(token_slot: list[int], offsets: list[int], loss: list[bool],
                    n_slots: int) -> tuple[list[int], list[int], list[int]]:
    """Per token the slot predicting it (−1 at a sample's first token); per slot the sample that
    trains its label (−1: none) and the packed token whose routing it replays (the owner's, else
    the first sample's at the slot)."""
    pred_slot = [-1] * len(token_slot)
    owner = [-1] * n_slots        # by slot
    owner_row = [-1] * n_slots    # the owner's packed token at the slot
    first_row = [-1] * n_slots    # the first sample's packed token at the slot
    for i in range(len(offsets) - 1):
        a, b = offsets[i], offsets[i + 1]
        for p in range(a, b):
            s = token_slot[p]
            if first_row[s] < 0:
                first_row[s] = p
            if p > a:
                prev = token_slot[p - 1]
                pred_slot[p] = prev
                if loss[p] and owner[prev] < 0:
                    owner[prev], owner_row[prev] = i, p - 1
    source = [o if o >= 0 else f for o, f in zip(owner_row, first_row)]
    return pred_slot, owner, source
