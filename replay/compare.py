"""Bit-for-bit comparison of a re-executed step against its recording.

Quantities are compared in the order training produced them — micro-batch by micro-batch
(loss first), then the update's loss, grad norm, lr and other metrics, then the weights
fingerprint after the update, finally the step's fingerprint — so the first mismatch is the
first place the computation went a different way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from axrl.runtime.results import UpdateResult
from replay.recorded import RecordedStep


@dataclass
class Divergence:
    """One quantity that differs. `update` / `micro_batch` are None for step-level quantities;
    `micro_batch` counts within its update. Diffs are None for non-numeric quantities."""

    step: int
    update: int | None
    micro_batch: int | None
    quantity: str
    recorded: Any
    replayed: Any
    abs_diff: float | None = None
    rel_diff: float | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        where = f"step {self.step}"
        if self.update is not None:
            where += f", update {self.update}"
        if self.micro_batch is not None:
            where += f", micro-batch {self.micro_batch}"
        text = f"{where}: {self.quantity} recorded {_fmt(self.recorded)} vs replayed {_fmt(self.replayed)}"
        if self.abs_diff is not None:
            text += f" (abs diff {self.abs_diff:.3g}, rel diff {self.rel_diff:.3g})"
        return text + (f" — {self.detail}" if self.detail else "")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)


def same_bits(recorded: Any, replayed: Any) -> bool:
    """Bitwise equality of what the recorder would have stored: integer columns (counts) compare
    as integers, float columns as float64 bit patterns (two NaNs count as equal)."""
    if isinstance(recorded, (np.integer, int)) and not isinstance(recorded, bool):
        return float(replayed) == float(int(replayed)) and int(replayed) == int(recorded)
    a, b = np.float64(recorded), np.float64(replayed)
    if math.isnan(a) and math.isnan(b):
        return True
    return a.tobytes() == b.tobytes()


def numeric_diff(recorded: Any, replayed: Any) -> tuple[float, float]:
    a, b = float(recorded), float(replayed)
    d = abs(a - b)
    scale = max(abs(a), abs(b))
    return d, (d / scale if scale > 0 else (0.0 if d == 0 else math.inf))


def _num(step: int, update: int | None, mb: int | None, quantity: str, recorded: Any, replayed: Any) -> Divergence:
    rec = int(recorded) if isinstance(recorded, np.integer) else float(recorded)
    d, r = numeric_diff(recorded, replayed)
    return Divergence(step, update, mb, quantity, rec, float(replayed), d, r)


def compare_updates(rec: RecordedStep, results: list[UpdateResult]) -> list[Divergence]:
    """Every recorded per-micro-batch / per-update quantity against the re-execution, in order."""
    out: list[Divergence] = []
    s = rec.step
    if len(results) != len(rec.updates):
        out.append(Divergence(s, None, None, "num_updates", len(rec.updates), len(results)))
        return out
    for u, (r, res) in enumerate(zip(rec.updates, results)):
        rows = res.metrics.micro_batches
        if r.micro_batches and len(rows) != len(r.micro_batches):
            out.append(Divergence(s, u, None, "num_micro_batches", len(r.micro_batches), len(rows)))
        for j, (mrec, mrep) in enumerate(zip(r.micro_batches, rows)):
            for key in ["loss", "num_tokens"] + sorted(k for k in mrec if k not in ("loss", "num_tokens")):
                if key not in mrec:
                    continue
                if key not in mrep:
                    out.append(Divergence(s, u, j, f"micro_batch.{key}", _plain(mrec[key]), None,
                                          detail="not produced by the re-execution"))
                elif not same_bits(mrec[key], mrep[key]):
                    out.append(_num(s, u, j, f"micro_batch.{key}", mrec[key], mrep[key]))
        replayed = {"loss": res.metrics.loss, "grad_norm": res.stats.grad_norm, "lr": res.stats.lr,
                    **{k: v for k, v in res.metrics.metrics.items() if k != "loss"}}
        for key in ["loss", "grad_norm", "lr"] + sorted(k for k in r.values if k not in ("loss", "grad_norm", "lr")):
            if key not in r.values:
                continue
            if key not in replayed:
                out.append(Divergence(s, u, None, key, _plain(r.values[key]), None,
                                      detail="not produced by the re-execution"))
            elif not same_bits(r.values[key], replayed[key]):
                out.append(_num(s, u, None, key, r.values[key], replayed[key]))
        if r.fingerprint_after is not None and r.fingerprint_after != res.fingerprint:
            out.append(Divergence(s, u, None, "weights_fingerprint_after", r.fingerprint_after, res.fingerprint))
    return out


def compare_tensor(step: int, quantity: str, recorded: np.ndarray,
                   replayed: torch.Tensor | np.ndarray) -> Divergence | None:
    """Bitwise comparison of a per-token array [T, ...] at the recorded dtype (the replayed values
    are cast to it, as the recorder did); the divergence names the first differing token."""
    rep = replayed.detach().cpu().numpy() if isinstance(replayed, torch.Tensor) else np.asarray(replayed)
    rep = rep.astype(recorded.dtype, copy=False)
    if rep.shape != recorded.shape:
        return Divergence(step, None, None, quantity, f"shape {recorded.shape}", f"shape {rep.shape}")
    a2, b2 = recorded.reshape(len(recorded), -1), rep.reshape(len(rep), -1)
    if recorded.dtype.kind == "f":
        bits = np.dtype(f"u{recorded.dtype.itemsize}")
        differ = (a2.view(bits) != b2.view(bits)) & ~(np.isnan(a2) & np.isnan(b2))
    else:
        differ = a2 != b2
    rows = differ.any(axis=1)
    if not rows.any():
        return None
    t = int(np.argmax(rows))
    detail = f"{int(rows.sum())} of {len(rows)} tokens differ, first at token {t}"
    if recorded.dtype.kind == "f":
        d = np.abs(a2.astype(np.float64) - b2.astype(np.float64))
        detail += f"; max abs diff {np.nanmax(d):.3g}"
        da, dr = numeric_diff(recorded[t], rep[t])
        return Divergence(step, None, None, quantity, float(recorded[t]), float(rep[t]), da, dr, detail)
    return Divergence(step, None, None, quantity, recorded[t].tolist(), rep[t].tolist(), detail=detail)


def _plain(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v
