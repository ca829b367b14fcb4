"""The headline sums of the analysed tokens (|Δ|, Δ, ρ = exp(Δ), clip / TIS counts, the centred
moments of the probability correlation) and the metrics they give; merging two is adding."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .compiled import _kernels
from .config import MismatchConfig
from .scratch import _Scratch


def _sumsq(a: np.ndarray) -> float:
    """Σ a² without BLAS: np.dot hands 1-D vectors to a multi-threaded BLAS whose thread wake-ups
    cost milliseconds per call on a busy machine; einsum's own loop is a single SIMD pass."""
    return float(np.einsum("i,i->", a, a))


def _moment_sums(d: np.ndarray, em1: np.ndarray, x: np.ndarray, y: np.ndarray, log_clip_high: float,
                 log_clip_low: float, log_tis_cap: float) -> tuple[Any, ...]:
    """``kernels.moment_sums`` in numpy reductions (the numpy path; no numba import): the same
    sums, in numpy's pairwise summation order. Overwrites ``x`` and ``y`` (centred)."""
    ad = np.abs(d)
    mx, my = float(x.mean()), float(y.mean())
    xc, yc = np.subtract(x, mx, out=x), np.subtract(y, my, out=y)
    neg = d < 0
    mult = np.where(neg, -em1 / (1.0 + em1), em1)            # expm1(|Δ|) = −(ρ − 1)/ρ for Δ < 0
    return (float(ad.sum()), float(d.sum()), float(ad.max()), _sumsq(d), float((em1 - d).sum()),
            float(em1.sum()), _sumsq(em1), float(mult.sum()), float(em1.min()), float(em1.max()),
            int(np.count_nonzero(d > log_clip_high)), int(np.count_nonzero(d < log_clip_low)),
            int(np.count_nonzero(d > log_tis_cap)), mx, my, _sumsq(xc), _sumsq(yc),
            float(np.einsum("i,i->", xc, yc)))


@dataclass
class _Moments:
    """Sums over analysed tokens; merging two is adding (Chan's update for the correlation)."""

    n: int = 0
    sum_abs: float = 0.0
    sum_d: float = 0.0
    max_abs: float = 0.0
    sum_k2: float = 0.0
    sum_k3: float = 0.0
    sum_em1: float = 0.0          # Σ (ρ − 1), with ρ − 1 = expm1(Δ) (no cancellation near 0)
    sum_em1_sq: float = 0.0       # Σ (ρ − 1)²
    sum_mult: float = 0.0         # Σ expm1(|Δ|)
    rho_min: float = math.inf
    rho_max: float = -math.inf
    n_clip_high: int = 0
    n_clip_low: int = 0
    n_tis: int = 0
    # Pearson of p_rollout, p_train: count, means and centred (co)moments
    mx: float = 0.0
    my: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0

    def add(self, d: np.ndarray, r: np.ndarray, o: np.ndarray, cfg: MismatchConfig,
            ws: _Scratch | None = None) -> None:
        """``d`` float64 Δ; ``r``, ``o`` the rollout / trainer logprobs (any float dtype: the
        probabilities are computed in float64 from their exact float64 values). The exponentials
        are numpy's (SIMD); the sums one compiled pass (``kernels.moment_sums``), or numpy's
        reductions (``_moment_sums``) on the numpy path."""
        n = d.size
        if n == 0:
            return
        ws = ws or _Scratch()
        em1 = np.expm1(d, out=ws("em1", n, np.float64))
        x, y = ws("x", n, np.float64), ws("y", n, np.float64)
        x[:] = r                       # widen first: exp's own float64 loop beats a casting one
        y[:] = o
        np.exp(x, out=x)
        np.exp(y, out=y)
        # compare in log space: ρ > 1 + ε  ⇔  Δ > log1p(ε)
        log_low = math.log1p(-cfg.clip_low) if cfg.clip_low < 1 else -math.inf
        (s_abs, s_d, max_abs, s_d2, s_k3, s_e, s_e2, s_mult, e_min, e_max, n_high, n_low, n_tis,
         mx, my, sxx, syy, sxy) = (_kernels().moment_sums if cfg.compiled is not False else _moment_sums)(
            d, em1, x, y, math.log1p(cfg.clip_high), log_low, math.log(cfg.tis_cap))
        self.merge(_Moments(
            n=n, sum_abs=s_abs, sum_d=s_d, max_abs=max_abs, sum_k2=0.5 * s_d2, sum_k3=s_k3, sum_em1=s_e,
            sum_em1_sq=s_e2, sum_mult=s_mult, rho_min=e_min + 1.0, rho_max=e_max + 1.0,
            n_clip_high=int(n_high), n_clip_low=int(n_low), n_tis=int(n_tis),
            mx=mx, my=my, sxx=sxx, syy=syy, sxy=sxy))

    def merge(self, m: "_Moments") -> None:
        """Fold in the sums of other tokens (exact for counts and sums; Chan's update for the
        centred moments of the correlation)."""
        if m.n == 0:
            return
        if self.n == 0:
            self.__dict__.update(m.__dict__)
            return
        n0, n1 = self.n, m.n
        tot = n0 + n1
        dx, dy = m.mx - self.mx, m.my - self.my
        f = n0 * n1 / tot
        self.sxx += m.sxx + dx * dx * f
        self.syy += m.syy + dy * dy * f
        self.sxy += m.sxy + dx * dy * f
        self.mx += dx * n1 / tot
        self.my += dy * n1 / tot
        for name in ("sum_abs", "sum_d", "sum_k2", "sum_k3", "sum_em1", "sum_em1_sq", "sum_mult",
                     "n_clip_high", "n_clip_low", "n_tis"):
            setattr(self, name, getattr(self, name) + getattr(m, name))
        self.max_abs = max(self.max_abs, m.max_abs)
        self.rho_min = min(self.rho_min, m.rho_min)
        self.rho_max = max(self.rho_max, m.rho_max)
        self.n = tot

    def metrics(self) -> dict[str, float]:
        n = self.n
        nan = math.nan
        if n == 0:
            return {k: nan for k in METRIC_NAMES if k not in ("p50_abs", "p99_abs")}
        mean_em1 = self.sum_em1 / n
        chi2 = self.sum_em1_sq / n
        denom = math.sqrt(self.sxx * self.syy)
        # ESS = (Σρ)² / (n Σρ²) with Σρ = n + Σ(ρ−1), Σρ² = n + 2Σ(ρ−1) + Σ(ρ−1)²
        s1 = n + self.sum_em1
        s2 = n + 2 * self.sum_em1 + self.sum_em1_sq
        return {
            "mean_abs": self.sum_abs / n,
            "max_abs": self.max_abs,
            "mean": self.sum_d / n,
            "k1": -self.sum_d / n,
            "k2": self.sum_k2 / n,
            "k3": self.sum_k3 / n,
            "chi2": chi2,
            "token_mult_prob_error": 1.0 + self.sum_mult / n,
            "ratio_mean": 1.0 + mean_em1,
            "ratio_std": math.sqrt(max(chi2 - mean_em1 * mean_em1, 0.0)),
            "ratio_min": self.rho_min,
            "ratio_max": self.rho_max,
            "frac_outside_clip": (self.n_clip_high + self.n_clip_low) / n,
            "frac_above_clip_high": self.n_clip_high / n,
            "frac_below_clip_low": self.n_clip_low / n,
            "frac_above_tis_cap": self.n_tis / n,
            "ess": (s1 * s1) / (n * s2) if s2 > 0 else nan,
            "pearson_prob": self.sxy / denom if denom > 0 else nan,
        }


METRIC_NAMES = ("mean_abs", "max_abs", "p50_abs", "p99_abs", "mean", "k1", "k2", "k3", "chi2",
                "token_mult_prob_error", "ratio_mean", "ratio_std", "ratio_min", "ratio_max",
                "frac_outside_clip", "frac_above_clip_high", "frac_below_clip_low", "frac_above_tis_cap",
                "ess", "pearson_prob")

