"""Compiled routing comparison of the mismatch analysis (numba): rollout vs trainer expert sets per
(token, layer), on [T, L, k] ids (``routing_rows``) or on packed routing as stored
(``packed_routing_rows``: only the rows its ``train_differs`` marks name).

Both count the same figures as ``routing.routing_agreement`` (the numpy reference the tests hold
them to): per layer, the valid rows whose sets differ and Σ (k − |A ∩ B|) over valid rows, and per
row whether every layer agrees. A row whose ids are equal in order (all of them under R3, ~90 %
without) agrees with |A ∩ B| = k and costs one word compare (raw) or nothing at all (packed:
unmarked). For the others |A ∩ B| = Σ_i [a_i ∈ B] is counted on the k ids as lanes of one word
(``_lane_hits``: k = 8 ids of ≤ 8 bits, packed or raw uint8; k = 4 uint16 ids), else through a
bitset of the ids.

Imports numba: loaded lazily (``routing_pass``), cached next to this file like ``kernels``.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def _lane_hits(aw, bw, lanes, width, ones, highs, mask):  # pragma: no cover - compiled
    """Σ_i [a_i ∈ B] for two words of ``lanes`` ids of ``width`` bits each (lane i: bits
    [i·width, (i+1)·width)); ``ones`` has the lowest bit of every lane set, ``highs`` the highest,
    ``mask`` is 2^width − 1. Lane by lane: B ^ (a_i broadcast) has a zero lane iff a_i ∈ B, and
    (v − ones) & ~v & highs is non-zero iff v has a zero lane (a borrow only starts at the lowest
    zero lane, and a lane's high bit survives ~v only where that lane was zero or borrowed into)."""
    hits = 0
    for i in range(lanes):
        a = (aw >> np.uint64(i * width)) & mask
        v = bw ^ (a * ones)
        hits += ((v - ones) & ~v & highs) != np.uint64(0)
    return hits


@njit(cache=True, nogil=True, inline="always")
def _lanes(lanes, width):  # pragma: no cover - compiled
    """(ones, highs, mask) of ``_lane_hits`` for ``lanes`` lanes of ``width`` bits."""
    ones = np.uint64(0)
    for i in range(lanes):
        ones |= np.uint64(1) << np.uint64(i * width)
    return ones, ones << np.uint64(width - 1), np.uint64((1 << width) - 1)


@njit(cache=True, nogil=True, inline="always")
def _set_hits(a, b, members):  # pragma: no cover - compiled
    """Σ_i [a_i ∈ B] of two rows of k ids through ``members``, a bitset over the ids (zero on
    entry and on return): the ids of ``b`` set bits, those of ``a`` test them — 2k steps instead
    of k² compares (k² compares when ``members`` is empty: ids that are not small unsigned ints)."""
    k = a.shape[0]
    hits = 0
    if members.size == 0:
        for i in range(k):
            found = False
            for j in range(k):
                found |= a[i] == b[j]
            hits += found
        return hits
    one, six, low = np.uint64(1), np.uint64(6), np.uint64(63)
    for j in range(k):
        x = np.uint64(b[j])
        members[x >> six] |= one << (x & low)
    for i in range(k):
        x = np.uint64(a[i])
        hits += np.int64((members[x >> six] >> (x & low)) & one)
    for j in range(k):
        members[np.uint64(b[j]) >> six] = 0
    return hits


@njit(cache=True, nogil=True)
def routing_rows(rr, rt, rw, tw, has_words, valid, has_valid, row_agree, disagree, lost,
                 members, row_layers):  # pragma: no cover - compiled
    """Compare each row's expert sets per layer, order-insensitively: adds to ``disagree[l]`` the
    valid rows whose sets differ and to ``lost[l]`` Σ (k − |A ∩ B|) over valid rows (agreeing rows
    = valid rows − disagree, Σ |A ∩ B| = valid rows · k − lost); ``row_agree[t]``: every layer of
    row t agrees; ``row_layers[t]`` (when not empty): how many do.

    Token by token, each token's [L, k] ids read once in storage order. ``rw``, ``tw``: [T, L]
    word views of the rows (``has_words``: k ids of 1 or 2 bytes filling 8 bytes), compared
    whole, and lane by lane (``_lane_hits``) where they differ; else id by id (``_set_hits``)."""
    nt, nl, k = rr.shape
    width = 64 // k if has_words else 8
    ones, highs, mask = _lanes(k if has_words else 1, width)
    for t in range(nt):
        counted = not has_valid or valid[t] != 0
        agreeing = nl
        for layer in range(nl):
            if has_words:
                if rw[t, layer] == tw[t, layer]:
                    continue
                hits = _lane_hits(rw[t, layer], tw[t, layer], k, width, ones, highs, mask)
            else:
                in_order = True
                for i in range(k):
                    in_order &= rr[t, layer, i] == rt[t, layer, i]
                if in_order:
                    continue
                hits = _set_hits(rr[t, layer], rt[t, layer], members)
            if hits != k:
                agreeing -= 1
                if counted:
                    disagree[layer] += 1
                    lost[layer] += k - hits
        row_agree[t] = agreeing == nl
        if row_layers.size:
            row_layers[t] = agreeing


@njit(cache=True, nogil=True, inline="always")
def _word_at(flat, at, nbytes, keep):  # pragma: no cover - compiled
    """The ``nbytes`` (≤ 8) bytes of ``flat`` from ``at`` as one little-endian word (``keep``: their
    mask). Eight fixed loads at unsigned indices where the array has room (which LLVM folds into
    one load), else byte by byte."""
    u = np.uint64(at)
    if at + 8 <= flat.shape[0]:
        word = (np.uint64(flat[u]) | np.uint64(flat[u + np.uint64(1)]) << np.uint64(8)
                | np.uint64(flat[u + np.uint64(2)]) << np.uint64(16) | np.uint64(flat[u + np.uint64(3)]) << np.uint64(24)
                | np.uint64(flat[u + np.uint64(4)]) << np.uint64(32) | np.uint64(flat[u + np.uint64(5)]) << np.uint64(40)
                | np.uint64(flat[u + np.uint64(6)]) << np.uint64(48) | np.uint64(flat[u + np.uint64(7)]) << np.uint64(56))
        return word & keep
    word = np.uint64(0)
    for byte in range(nbytes):
        word |= np.uint64(flat[at + byte]) << np.uint64(8 * byte)
    return word


@njit(cache=True, nogil=True, inline="always")
def _lowest_bit(m):  # pragma: no cover - compiled
    """Index of the lowest set bit of a non-zero uint64 (de Bruijn multiply)."""
    return _DEBRUIJN[((m & (~m + np.uint64(1))) * np.uint64(0x03F79D71B4CB0A89)) >> np.uint64(58)]


_DEBRUIJN = np.zeros(64, np.int64)
for _i in range(64):
    _DEBRUIJN[(((1 << _i) * 0x03F79D71B4CB0A89) & (2 ** 64 - 1)) >> 58] = _i


@njit(cache=True, nogil=True)
def packed_routing_rows(packed, bits, differs, rows, k, valid, has_valid, row_agree, disagree, lost,
                        ids, members, row_layers):  # pragma: no cover - compiled
    """``routing_rows`` on packed routing (``axrl.trace.routing_codec``, ids of at most 8 bits),
    reading only what the ``train_differs`` marks name: an unmarked (token, layer) holds the
    rollout's very ids (agrees, |A ∩ B| = k: nothing to count); a marked one is compared with the
    trainer's next stored row (``rows``). Top-8 rows are one group of eight ``bits``-bit ids, i.e.
    one word each, compared lane by lane as stored (``_lane_hits``); other k are unpacked
    (``_unpack_ids``) into ``ids`` (int64 [2k] scratch) and compared through ``members``.

    A marked row of an invalid token (``valid[t] == 0``) is skipped, not compared: the layer
    counts leave it out and a token's routing class ignores an invalid row before it, so its
    ``row_agree`` is set False unread — and ``packed`` may then hold no bytes ([T, 0]) when no
    valid row is marked. ``row_layers[t]`` (when not empty): how many layers of row t agree, as
    ``routing_rows`` counts them — for a valid row; an invalid row's is L less its marked layers,
    equally unread.

    ``packed`` uint8 [T, B]; ``differs`` uint8 [T, ⌈L/8⌉] (at most 64 layers a word, in turn).
    Returns the stored rows used, or −1 when a mark names a layer past L or a row past ``rows``
    (a damaged file)."""
    nt, width = packed.shape
    nl = disagree.shape[0]
    nbytes = differs.shape[1]
    bk = rows.shape[1]
    flat = packed.reshape(nt * width)
    stored = rows.reshape(rows.shape[0] * bk)
    mask = (1 << bits) - 1
    keep = np.uint64((1 << (8 * bits)) - 1) if bits < 8 else ~np.uint64(0)
    ones, highs, wmask = _lanes(8, bits)
    r = 0
    for t in range(nt):
        counted = not has_valid or valid[t] != 0
        every = True
        agreeing = nl
        for first in range(0, nbytes, 8):
            m = _word_at(differs[t], first, min(8, nbytes - first), ~np.uint64(0))
            while m != np.uint64(0):
                layer = first * 8 + _lowest_bit(m)
                m &= m - np.uint64(1)
                if layer >= nl or r >= rows.shape[0]:
                    return -1
                if not counted:         # a row never fed to the model: no figure reads its comparison
                    every = False
                    agreeing -= 1
                    r += 1
                    continue
                if k == 8:
                    hits = _lane_hits(_word_at(flat, t * width + layer * bits, bits, keep),
                                      _word_at(stored, r * bk, bits, keep), 8, bits, ones, highs, wmask)
                else:
                    _unpack_ids(packed[t], layer * k, k, bits, mask, ids, 0)
                    _unpack_ids(rows[r], 0, k, bits, mask, ids, k)
                    hits = _set_hits(ids[:k], ids[k:], members)
                r += 1
                if hits != k:
                    every = False
                    agreeing -= 1
                    disagree[layer] += 1
                    lost[layer] += k - hits
        row_agree[t] = every
        if row_layers.size:
            row_layers[t] = agreeing
    return r


@njit(cache=True, nogil=True)
def hits_routing_rows(differs, hits, k, valid, has_valid, row_agree, disagree, lost,
                      row_layers):  # pragma: no cover - compiled
    """``packed_routing_rows`` from the stored ``train_hits`` (|A ∩ B| of each marked row, written
    with the trace): the same counts, no routing row read or decoded. Returns the stored counts
    used, or −1 when a mark names a layer past L or a row past ``hits`` (a damaged file)."""
    nt = differs.shape[0]
    nl = disagree.shape[0]
    nbytes = differs.shape[1]
    r = 0
    for t in range(nt):
        counted = not has_valid or valid[t] != 0
        every = True
        agreeing = nl
        for first in range(0, nbytes, 8):
            m = _word_at(differs[t], first, min(8, nbytes - first), ~np.uint64(0))
            while m != np.uint64(0):
                layer = first * 8 + _lowest_bit(m)
                m &= m - np.uint64(1)
                if layer >= nl or r >= hits.shape[0]:
                    return -1
                h = np.int64(hits[r])
                r += 1
                if not counted:
                    every = False
                    agreeing -= 1
                elif h != k:
                    every = False
                    agreeing -= 1
                    disagree[layer] += 1
                    lost[layer] += k - h
        row_agree[t] = every
        if row_layers.size:
            row_layers[t] = agreeing
    return r


@njit(cache=True, nogil=True, inline="always")
def _unpack_ids(row, first, count, bits, mask, out, at):  # pragma: no cover - compiled
    """Ids ``first … first + count − 1`` of a packed row (groups of eight ids in ``bits`` bytes,
    little-endian: ``routing_codec.pack_ids``) into ``out[at:]``, each from the one or two bytes
    that hold it."""
    for j in range(first, first + count):
        o = (j & 7) * bits
        p = (j >> 3) * bits + (o >> 3)
        s = o & 7
        v = np.int64(row[p]) >> s
        if s + bits > 8:
            v |= np.int64(row[p + 1]) << (8 - s)
        out[at + j - first] = v & mask
