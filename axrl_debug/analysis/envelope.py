"""The calibrated envelope ("mismatch budget") of a run: how large a step's training–inference
mismatch may be when nothing is wrong, for this engine, precision and model.

A clean mismatch is not zero; it is the numerics floor of the engine's kernels at its precision.
The envelope is derived per run, from the trace, by the best available source:

* ``rescore`` (AxRL's own replayable runs): a recorded step's token streams are re-run through the
  embedded engine's decode path under the step's own weights, at the run's rollout precision and KV
  dtype (``replay.rollout.teacher_forced_check``), and set beside the trainer's logprobs. That
  difference is the floor *by construction* — whatever an injected or real fault did to the
  recorded rollout, the re-execution runs clean code on the right weights.
* ``sentinel``: the calibrated probe floor the live sync sentinel wrote into the manifest, if any:
  its max |Δ| bounds a step's max; the mean bound stays the dtype's.
* ``dtype`` (imported runs, runs that cannot be replayed): 4 ulps of the rollout precision for the
  mean |Δ| (the spike detector's rounding bound: healthy fp32 runs measure 0.2–1.3 ulps).

The bounds are the measured floor times a margin (``MARGIN``), never below the dtype bound. The
envelope is stored in ``RUN/doctor/envelope.json`` (a cache beside the trace, not the manifest:
`axrl-debug` never rewrites what `axrl train` wrote, and imported runs' directories may be
read-only — then it is recomputed each time).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: ulp (machine epsilon) of the precisions a rollout may run at
EPS = {"fp32": 2.0 ** -23, "float32": 2.0 ** -23, "bf16": 2.0 ** -7, "bfloat16": 2.0 ** -7,
       "fp16": 2.0 ** -10, "float16": 2.0 ** -10, "fp8": 2.0 ** -3}
#: a clean step's mean |Δ| stays below MARGIN × the calibrated floor (steps differ in batch shapes)
MARGIN = 4.0
#: … and its max |Δ| below MAX_MARGIN × the calibrated max (a max over ~1e3 tokens is noisy)
MAX_MARGIN = 8.0
DTYPE_ULPS = 4.0
CACHE = Path("doctor") / "envelope.json"
VERSION = 3   # 2: the sentinel source bounds the max only; 3: calibration says whether the precision was stated


@dataclass
class Envelope:
    """Bounds a clean step's mismatch stays inside, and where they come from."""

    precision: str
    mean_abs: float            # bound on a step's mean |Δ|
    max_abs: float             # bound on a step's max |Δ|
    source: str                # rescore | sentinel | dtype
    floor_mean_abs: float      # the measured (or dtype) floor the bounds were derived from
    floor_max_abs: float
    routing_agreement: float | None = None   # the agreement the trainer reaches with the clean path
    calibration: dict[str, Any] = field(default_factory=dict)
    version: int = VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def judge(self, stats: dict[str, float]) -> dict[str, Any]:
        """A step's mismatch against the envelope: ratios to the bounds and inside/outside."""
        mean, mx = stats.get("mean_abs", math.nan), stats.get("max_abs", math.nan)
        ratio = mean / self.mean_abs if self.mean_abs > 0 and math.isfinite(mean) else math.nan
        max_ratio = mx / self.max_abs if self.max_abs > 0 and math.isfinite(mx) else math.nan
        inside = not (ratio > 1.0 or max_ratio > 1.0)
        return {"envelope_ratio": ratio, "envelope_max_ratio": max_ratio, "inside": inside}


def _stated_precision(config: dict[str, Any] | None) -> Any:
    """What config.yaml states of the engine's precision: `rollout.precision` (AxRL's runs: `auto`
    reads as fp32, the replay-measured floor sizes their envelope), `rollout.dtype` (imported
    runs), the model's dtype; None when nothing is stated."""
    cfg = config or {}
    rollout, model = cfg.get("rollout") or {}, cfg.get("model") or {}
    return rollout.get("precision") or rollout.get("dtype") or model.get("dtype")


def rollout_precision(config: dict[str, Any] | None) -> str:
    """The precision the run's engine computed logprobs at (config.yaml; fp32 when unstated)."""
    p = str(_stated_precision(config) or "float32").lower()
    if "fp8" in p or "w8a8" in p:
        return "fp8"
    for name in ("bf16", "bfloat16", "fp16", "float16"):
        if name in p:
            return name
    return "fp32"


def dtype_envelope(precision: str) -> Envelope:
    """The envelope without a measurement: DTYPE_ULPS ulps of `precision` on the mean |Δ|."""
    eps = EPS.get(precision, EPS["fp32"])
    floor = DTYPE_ULPS * eps
    return Envelope(precision, floor, 256 * eps, "dtype", floor, 256 * eps,
                    calibration={"ulps": DTYPE_ULPS, "eps": eps})


def from_measurement(precision: str, mean_abs: float, max_abs: float, source: str,
                     calibration: dict[str, Any]) -> Envelope:
    """Bounds from a measured clean floor: MARGIN × mean, MAX_MARGIN × max, never below the dtype bound."""
    base = dtype_envelope(precision)
    return Envelope(precision, max(MARGIN * mean_abs, base.mean_abs), max(MAX_MARGIN * max_abs, base.max_abs),
                    source, mean_abs, max_abs, calibration=calibration)


NOT_ASKED = "re-scoring not asked for"


def sentinel_floor(manifest: dict[str, Any]) -> dict[str, float] | None:
    """The live sync sentinel's calibrated probe floor, if the run's manifest has one."""
    entry = manifest.get("sync_sentinel")
    floor = entry.get("floor") if isinstance(entry, dict) else None
    if isinstance(floor, dict) and isinstance(floor.get("logprob_max_abs"), (int, float)):
        # axrl/sync writes the probe's max |Δ| only. It bounds the step's max, not its mean: taken as
        # the mean floor too it made the mean bound 10–100× the dtype's and hid router noise and other
        # faults the engine has from its first weights on (the probe calibrates on that engine)
        return {"max_abs": float(floor["logprob_max_abs"])}
    return None


def rescore_floor(run: Path, step: int) -> dict[str, Any]:
    """The clean floor of `step` measured by re-execution: the embedded engine's decode path, at the
    run's precision, under the step's weights, vs the trainer's logprobs (ReplayInputError or
    FileNotFoundError when the run cannot be re-executed)."""
    from replay.rollout import teacher_forced_check

    res = teacher_forced_check(run, step)
    s = res.summary
    return {"step": step, "tokens": res.tokens, "mean_abs": s["mean_abs_trainer_vs_embedded"],
            "max_abs": s["max_abs_trainer_vs_embedded"], "recorded_vs_clean_mean_abs": s["mean_abs_embedded_vs_recorded"],
            "recorded_vs_clean_max_abs": s["max_abs_embedded_vs_recorded"], "seconds": res.seconds}


def calibrate(run: Path, config: dict[str, Any] | None, manifest: dict[str, Any], steps: list[int], *,
              rescore: bool = True) -> Envelope:
    """The run's envelope from the best source available (module doc)."""
    env = _calibrate(run, config, manifest, steps, rescore=rescore)
    env.calibration["precision_stated"] = _stated_precision(config) is not None   # else fp32 was assumed
    return env


def _calibrate(run: Path, config: dict[str, Any] | None, manifest: dict[str, Any], steps: list[int], *,
               rescore: bool) -> Envelope:
    precision = rollout_precision(config)
    if rescore and steps:
        try:
            m = rescore_floor(run, steps[0])
            if m["tokens"] > 0:
                return from_measurement(precision, m["mean_abs"], m["max_abs"], "rescore", m)
        except Exception as e:  # noqa: BLE001 — any failure falls back to the next source, said in the envelope
            why = f"{type(e).__name__}: {e}"
        else:
            why = "no tokens to re-score"
    else:
        why = NOT_ASKED
    floor = sentinel_floor(manifest)
    if floor is not None:   # the mean bound stays the dtype's (see sentinel_floor)
        base = dtype_envelope(precision)
        return Envelope(precision, base.mean_abs, max(MAX_MARGIN * floor["max_abs"], base.max_abs), "sentinel",
                        base.floor_mean_abs, floor["max_abs"],
                        calibration={"why_not_rescore": why, "mean_bound": "dtype (the probe measures a max only)"})
    env = dtype_envelope(precision)
    env.calibration["why_not_rescore"] = why
    return env


def load_or_calibrate(run: Path, config: dict[str, Any] | None, manifest: dict[str, Any], steps: list[int], *,
                      rescore: bool = True, refresh: bool = False) -> Envelope:
    """The cached envelope of `run` (RUN/doctor/envelope.json) or a fresh calibration, cached when
    the directory is writable."""
    path = run / CACHE
    run_id = f"{manifest.get('start_unix')}:{manifest.get('git_sha')}"   # a re-made run is recalibrated
    if path.is_file() and not refresh:
        try:
            doc = json.loads(path.read_text())
            if (doc.get("version") == VERSION and doc.get("calibration", {}).get("run_id") == run_id
                    and (not rescore or _rescore_was_tried(doc))):
                return Envelope(**doc)
        except (ValueError, TypeError):
            pass  # a damaged cache is recomputed
    env = calibrate(run, config, manifest, steps, rescore=rescore)
    env.calibration["run_id"] = run_id
    try:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(_finite(env.to_dict()), indent=1))
    except OSError:
        pass  # read-only run directory: recomputed next time
    return env


def _rescore_was_tried(doc: dict[str, Any]) -> bool:
    """Whether a cached envelope answers a request that asks for re-scoring: it was re-scored, or
    re-scoring was tried and failed (a cache made with re-scoring off does not answer it)."""
    why = doc.get("calibration", {}).get("why_not_rescore")
    return doc.get("source") == "rescore" or (why is not None and why != NOT_ASKED)


def _finite(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, np.generic):
        return o.item()
    return o
