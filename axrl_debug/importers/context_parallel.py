"""Put a sample's per-token response fields back together from context-parallel (CP) pieces.

Megatron's CP splits a sequence of T tokens into 2·cp chunks of ⌈T / 2cp⌉ and gives rank r chunks
r and 2cp − 1 − r (the load-balancing "zig-zag"); a response field (entry j about response token j,
i.e. logits row prompt_len − 1 + j) is sliced to the rows inside the rank's two chunks. This is
the inverse for ``qkv_format = 'thd'`` (the packed layout; ``bshd`` chunks by the padded batch
length, which the dumps do not record). Offsets as in miles'
``miles/backends/training_utils/cp_utils.py`` (``get_logits_and_tokens_offset_with_cp``,
radixark/miles 31f1ca961a94cb860cec3b2dea34ec332bfa8f76).
"""

from __future__ import annotations

import numpy as np

from .safe_load import ImportFormatError


def response_ranges(total: int, response: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of the response (entry 0 = first response token) rank ``cp_rank``
    holds, in the order its piece stores them."""
    prompt = total - response
    chunk = -(-total // (2 * cp_size))
    out = []
    for c in (cp_rank, 2 * cp_size - cp_rank - 1):
        lo, hi = max(c * chunk, prompt - 1), min((c + 1) * chunk, total - 1)
        if lo < hi:
            out.append((lo - (prompt - 1), hi - (prompt - 1)))
    return out


def reassemble(pieces: dict[int, np.ndarray], total: int, response: int, cp_size: int,
               where: str) -> np.ndarray:
    """The whole response field from every CP rank's piece (``pieces``: cp_rank → array)."""
    missing = sorted(set(range(cp_size)) - set(pieces))
    if missing:
        raise ImportFormatError(f"{where}: context-parallel ranks {missing} of {cp_size} missing")
    first = next(iter(pieces.values()))
    out = np.zeros((response, *first.shape[1:]), dtype=first.dtype)
    for rank, piece in pieces.items():
        ranges = response_ranges(total, response, cp_size, rank)
        if piece.shape[0] != sum(b - a for a, b in ranges):
            raise ImportFormatError(f"{where}: cp_rank {rank} holds {piece.shape[0]} entries, its zig-zag share "
                                    f"of a {response}-token response of a {total}-token sample is "
                                    f"{sum(b - a for a, b in ranges)}")
        at = 0
        for a, b in ranges:
            out[a:b] = piece[at:at + b - a]
            at += b - a
    return out
