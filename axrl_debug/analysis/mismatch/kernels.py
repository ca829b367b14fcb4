"""Compiled per-token loops of the mismatch analysis (numba).

The package keeps the vectorised numpy code where numpy is fast (the SIMD ``exp``/``expm1``
of the moments); the breakdown keys and their joint histograms are one pass over a block's
tokens here (the routing comparison before it: ``routing_kernels``). In numpy they were ~15
whole-array passes (segment starts, six digit columns, a mixed-radix key, two bincounts, packed
routing words): most of the time of ``axrl-debug mismatch`` besides reading the file.

This module imports numba, so it is imported lazily (``compiled._kernels``): the TUI and the
commands that never run the analysis do not pay for it. Compiled code is cached next to this file
(or in numba's user cache when that is read-only), so only the first run on a machine compiles.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def select_analysed(lm, lr, lt, pver, turn, has_keys, idx, d, r, o):  # pragma: no cover - compiled
    """Compact the analysed tokens (loss_mask ≠ 0, both logprobs finite:
    ``axrl.trace.quantities.analysed_mask``, which the tests hold this to) of a block into ``idx``
    (token index), ``d`` (float64 Δ = old − rollout, exact), ``r`` and ``o`` (stored dtypes).

    Returns (analysed, generated, version min, version max, Σ version, turn min, turn max); the
    version/turn figures are over analysed tokens and only when ``has_keys`` (else zeros)."""
    n = 0
    gen = 0
    vlo = np.int64(0)
    vhi = np.int64(0)
    vsum = np.int64(0)
    tlo = np.int64(0)
    thi = np.int64(0)
    for t in range(lm.shape[0]):
        if lm[t] == 0:
            continue
        gen += 1
        a = np.float64(lr[t])
        b = np.float64(lt[t])
        if not (math.isfinite(a) and math.isfinite(b)):
            continue
        idx[n] = t
        d[n] = b - a
        r[n] = lr[t]
        o[n] = lt[t]
        if has_keys:
            v = np.int64(pver[t])
            u = np.int64(turn[t])
            if n == 0:
                vlo = vhi = v
                tlo = thi = u
            else:
                vlo = min(vlo, v)
                vhi = max(vhi, v)
                tlo = min(tlo, u)
                thi = max(thi, u)
            vsum += v
        n += 1
    return n, gen, vlo, vhi, vsum, tlo, thi


@njit(cache=True, nogil=True, fastmath={"reassoc", "nsz"})
def moment_sums(d, em1, x, y, log_clip_high, log_clip_low, log_tis_cap):  # pragma: no cover - compiled
    """The sums behind the headline metrics of n analysed tokens, in one pass plus one for the
    centred moments of the correlation: ``d`` = Δ, ``em1`` = expm1(Δ) = ρ − 1, ``x``/``y`` = the
    rollout/trainer probabilities (the transcendentals come from numpy's SIMD loops).

    Returns (Σ|Δ|, ΣΔ, max|Δ|, ΣΔ², Σ(ρ − 1 − Δ), Σ(ρ − 1), Σ(ρ − 1)², Σ expm1(|Δ|), min(ρ − 1),
    max(ρ − 1), #Δ > log_clip_high, #Δ < log_clip_low, #Δ > log_tis_cap, mean x, mean y,
    Σ(x − x̄)², Σ(y − ȳ)², Σ(x − x̄)(y − ȳ)). expm1(|Δ|) = −(ρ − 1)/ρ for Δ < 0 (no second expm1)."""
    n = d.shape[0]
    s_abs = s_d = max_abs = s_d2 = s_k3 = s_e = s_e2 = s_mult = 0.0
    e_min = np.inf
    e_max = -np.inf
    n_high = n_low = n_tis = 0
    sx = sy = 0.0
    for i in range(n):
        v = d[i]
        e = em1[i]
        a = abs(v)
        s_abs += a
        s_d += v
        max_abs = max(max_abs, a)
        s_d2 += v * v
        s_k3 += e - v
        s_e += e
        s_e2 += e * e
        s_mult += max(e, -e / (1.0 + e))     # expm1(|Δ|), branch-free
        e_min = min(e_min, e)
        e_max = max(e_max, e)
        n_high += v > log_clip_high
        n_low += v < log_clip_low
        n_tis += v > log_tis_cap
        sx += x[i]
        sy += y[i]
    mx = sx / n
    my = sy / n
    sxx = syy = sxy = 0.0
    for i in range(n):
        u = x[i] - mx
        w = y[i] - my
        sxx += u * u
        syy += w * w
        sxy += u * w
    return (s_abs, s_d, max_abs, s_d2, s_k3, s_e, s_e2, s_mult, e_min, e_max, n_high, n_low, n_tis,
            mx, my, sxx, syy, sxy)


@njit(cache=True, nogil=True)
def breakdown_block(lm, lr, lt, off, turn, pver, ent_digit, has_keys, prob_edges, pos_lut,
                    turn_lo, turn_size, version_hi, version_size,
                    row_agree, valid, has_routing, has_valid,
                    mult, counts, sums):  # pragma: no cover - compiled
    """One pass over a block: the breakdown histograms of its analysed tokens.

    Digits, in six fixed slots: 0 position in the response segment (via ``pos_lut``), 1 rollout-prob
    bucket (``prob_edges``: the five inner edges in log space, in ``lr``'s dtype), 2 entropy bucket
    (precomputed ``ent_digit``), 3 turn − ``turn_lo``, 4 ``version_hi`` − version — when
    ``has_keys`` — and 5 the routing class of row t − 1 (``row_agree`` from ``routing_kernels``; 2 =
    unknown at a sample's first token or an invalid row) when ``has_routing``. Each analysed token
    adds 1 and its Δ to cell [Δ < 0] + Σ_slot digit·mult[g, slot] of histogram g
    (``counts[g]``/``sums[g]``, the layout of ``breakdowns._joint_hist``; a slot outside group g has
    multiplier 0), in token order, so the sums are the ones ``np.bincount`` gives."""
    nt = lm.shape[0]
    ngroups = counts.shape[0]
    keyed = ngroups > 0
    nsamples = off.shape[0] - 1
    s = 0
    seg0 = 0
    last_pos = pos_lut.shape[0] - 1
    e0, e1, e2, e3, e4 = prob_edges[0], prob_edges[1], prob_edges[2], prob_edges[3], prob_edges[4]
    for t in range(nt):
        is_start = False
        while s < nsamples and off[s] <= t:
            is_start = is_start or off[s] == t
            s += 1
        if has_keys and (t == 0 or is_start or lm[t - 1] == 0 or turn[t] != turn[t - 1]):
            seg0 = t
        if lm[t] != 0 and keyed:
            a = np.float64(lr[t])
            b = np.float64(lt[t])
            if math.isfinite(a) and math.isfinite(b):
                delta = b - a
                d0 = d1 = d2 = d3 = d4 = d5 = 0
                if has_keys:
                    d0 = pos_lut[min(t - seg0, last_pos)]
                    x = lr[t]   # five inner edges, unrolled (a loop over them costs ~2 ns a token)
                    d1 = (np.int64(x >= e0) + np.int64(x >= e1) + np.int64(x >= e2) + np.int64(x >= e3)
                          + np.int64(x >= e4))
                    d2 = ent_digit[t]
                    d3 = min(max(np.int64(turn[t]) - turn_lo, 0), turn_size - 1)
                    d4 = min(max(version_hi - np.int64(pver[t]), 0), version_size - 1)
                if has_routing:
                    if t == 0 or is_start or (has_valid and valid[t - 1] == 0):
                        d5 = 2                           # unknown
                    elif not row_agree[t - 1]:
                        d5 = 1                           # differs (0: agrees)
                neg = 1 if delta < 0 else 0
                for g in range(ngroups):
                    key = (neg + d0 * mult[g, 0] + d1 * mult[g, 1] + d2 * mult[g, 2] + d3 * mult[g, 3]
                           + d4 * mult[g, 4] + d5 * mult[g, 5])
                    counts[g, key] += 1
                    sums[g, key] += delta
