"""Token sampling with SGLang semantics and per-request random streams.

* temperature 0 → greedy (argmax); its logprob is plain `log_softmax(logits)`.
* Otherwise probs = softmax(logits / T), filtered by top-k and top-p (SGLang's rule: top-p is
  decided on the unfiltered sorted probabilities, top-k on the rank), and one token is drawn
  with the exponential race `argmax(probs / q)`, q ~ Exp(1) — equivalent to sampling from the
  renormalised filtered distribution.
* Logprobs are `log_softmax(logits.float() / T)` at the chosen token, *before* filtering.
* Each request owns a `torch.Generator` and draws exactly one vector of V exponentials per
  sampled token, so the same seed and the same logits give the same tokens whatever else is in
  the batch (batch-invariant sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def derive_seed(engine_seed: int, counter: int) -> int:
    """A well-mixed 63-bit seed from (engine seed, request counter): splitmix64."""
    z = (engine_seed * 0x9E3779B97F4A7C15 + (counter + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class RowParams:
    """What the sampler needs to know about one row of the logits."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None  # required when temperature > 0
    want_logprob: bool


def sample(logits: torch.Tensor, rows: list[RowParams]) -> tuple[torch.Tensor, list[int], list[float] | None]:
    """Choose one token per row of logits [N, V]; return (tokens as an int64 tensor, the same as a
    list, logprobs or None if no row wants them).

    Greedy rows are handled in one vectorised argmax; sampled rows share the softmax, sort and
    filter ops and only draw their noise per row (their generators are private).
    """
    logits = logits.float()
    n, vocab = logits.shape
    dev = logits.device
    temps = [r.temperature for r in rows]
    sampled_idx = [i for i, t in enumerate(temps) if t > 0]

    if not sampled_idx:  # fast path: all greedy (the benchmark, and most evaluation)
        tokens_t = logits.argmax(dim=-1)
    else:
        tokens_t = logits.argmax(dim=-1) if len(sampled_idx) < n else torch.empty(n, dtype=torch.long, device=dev)
        idx = torch.tensor(sampled_idx, device=dev)
        sub = [rows[i] for i in sampled_idx]
        t = torch.tensor([r.temperature for r in sub], dtype=torch.float32, device=dev)[:, None]
        probs = torch.softmax(logits[idx] / t, dim=-1)
        probs = _filter_top_k_top_p(probs, [r.top_k for r in sub], [r.top_p for r in sub])
        # Drawn on the CPU by each request's own generator, then moved: the same draws on any device.
        noise = torch.stack([torch.empty(vocab).exponential_(generator=r.generator) for r in sub]).to(dev)
        noise.clamp_(min=torch.finfo(torch.float32).tiny)  # a 0 draw would give 0/0 on filtered tokens
        tokens_t[idx] = (probs / noise).argmax(dim=-1)

    tokens = tokens_t.tolist()
    if not any(r.want_logprob for r in rows):
        return tokens_t, tokens, None
    # Greedy rows use T = 1 (plain log_softmax), as SGLang does.
    scale = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32, device=dev)[:, None]
    logprobs = torch.log_softmax(logits / scale, dim=-1).gather(1, tokens_t[:, None])[:, 0]
    return tokens_t, tokens, logprobs.tolist()


def _filter_top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k / top-p set (the top-1 token always stays)."""
    vocab = probs.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_p):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None]
    drop = rank >= torch.tensor(ks, device=probs.device)[:, None]
    # Nucleus: drop a token if the mass strictly before it already reaches top_p.
    # top_p >= 1 means off (cumsum can exceed 1.0 by rounding, which must not drop the tail).
    ps = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], dtype=probs.dtype, device=probs.device)
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > ps[:, None]
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)
