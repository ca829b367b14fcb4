"""`Recorder`: write an AxRL run directory from plain per-sample arrays.

For traces that did not come out of `axrl train` — another framework's run, a notebook, an
importer (`axrl-debug import`). The step files are the ones `axrl train` writes (same schema, same
writer: `axrl.trace.writer.write_step`), so every analysis reads them; what the caller does not
know (trainer routing, per-update metrics, entropy, weight fingerprints) is left absent, NaN or
empty, never invented. See docs/import.md.

Alignment (docs/trace-format.md): a token's logprob is stored at the token's own position
(``log p(token_t | tokens_<t)`` at row t). A per-token array is given per sample either over the
sample's whole token list or over its response only (``len(tokens) - prompt_len`` entries, the
prompt then filled with NaN, zero or the prompt's value of the column).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .quantities import mean_abs_delta
from .step_record import StepRecord
from .run_dir import RunDir
from .schema import UPDATE_REQUIRED, TraceValidationError

__all__ = ["Recorder", "RecorderError"]

RECORDER = "axrl.trace.Recorder"   # manifest["source"]["writer"] of every run this module writes


class RecorderError(TraceValidationError):
    """An input of `Recorder.write_step` has the wrong shape or values; the message names it."""


def _fail(name: str, msg: str) -> RecorderError:
    return RecorderError(f"Recorder.write_step: {name}: {msg}")


def _array(name: str, value: Any, dtype: Any = None) -> np.ndarray:
    """``value`` (a list, array or torch tensor) as numpy. Tensors go through ``.numpy()`` (float
    ones as float32: numpy has no bfloat16); a float column reads None entries as NaN (not known)."""
    if hasattr(value, "detach") and hasattr(value, "is_floating_point"):     # a torch tensor
        t = value.detach().cpu()
        value = (t.float() if t.is_floating_point() else t).numpy()
    elif isinstance(value, (list, tuple)) and any(hasattr(v, "detach") for v in value):   # e.g. [tensor(0.5), ...]
        value = [_array(name, v) for v in value]
    try:
        a = np.asarray(value)
        if a.dtype == object and dtype is not None and np.dtype(dtype).kind == "f":
            a = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise _fail(name, f"not a numeric array ({e})") from None
    return a


def _per_sample(name: str, values: Any, n: int, dtype: Any) -> np.ndarray:
    """One value per sample as a 1-D array of ``dtype`` (N entries); integer columns refuse
    non-integral values (they would be truncated silently)."""
    if values is None:
        raise _fail(name, f"is required (one value per sample, N={n})")
    a = _array(name, values)
    if a.shape != (n,):
        raise _fail(name, f"shape {a.shape}, expected ({n},) (one value per sample, N = len(token_ids))")
    if a.size and a.dtype.kind not in "biuf":
        raise _fail(name, f"dtype {a.dtype} is not numeric")
    if np.dtype(dtype).kind in "iu" and a.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(a) | (a != np.round(a)))
        if bad.size:
            raise _fail(name, f"sample {bad[0]}: {a[bad[0]]} is not an integer")
    return a.astype(dtype)


def _one_sample(name: str, value: Any, i: int, length: int, prompt_len: int, fill: float,
                dtype: Any) -> np.ndarray:
    """Sample i's column over all its ``length`` tokens from a full or response-only array (or a
    scalar, broadcast over the response); the prompt of a response-only array gets ``fill``."""
    a = _array(f"{name}[{i}]", value, dtype)
    response = length - prompt_len
    if a.ndim == 0:
        a = np.full(response, a.item() if a.dtype.kind in "biuf" else np.nan)
    if a.ndim != 1 or a.shape[0] not in (length, response):
        raise _fail(f"{name}[{i}]", f"shape {a.shape}, expected ({length},) (all the sample's tokens) "
                                    f"or ({response},) (its response: len(token_ids[{i}]) - prompt_len)")
    if a.size and a.dtype.kind not in "biuf":
        raise _fail(f"{name}[{i}]", f"dtype {a.dtype} is not numeric")
    if a.shape[0] == length:
        return a.astype(dtype)
    out = np.full(length, fill, dtype=dtype)
    out[prompt_len:] = a
    return out


def _ragged(name: str, values: Any, lengths: np.ndarray, prompt_lens: np.ndarray, fill: float,
            dtype: Any) -> np.ndarray:
    """A per-token column: one array per sample, concatenated in sample order (T entries)."""
    n = lengths.size
    sized = hasattr(values, "__len__") and not isinstance(values, (str, bytes))
    if not sized or len(values) != n:
        got = f"{len(values)} entries" if sized else type(values).__name__
        raise _fail(name, f"expected one array per sample (N={n}), got {got}")
    parts = [_one_sample(name, v, i, int(lengths[i]), int(prompt_lens[i]), fill, dtype) for i, v in enumerate(values)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _routing(routing: Sequence[Any], lengths: np.ndarray, num_experts: int | None) -> tuple[np.ndarray, np.ndarray]:
    """/routing/rollout [T, L, k] and /routing/rollout_valid [T] from per-sample expert ids.

    A sample's routing is [len, L, k] or [len - 1, L, k]: engines such as SGLang never feed the
    last token back as input, so its row is missing (stored as zeros, valid = 0)."""
    if num_experts is None:
        raise _fail("num_experts", "is required with routing")
    if len(routing) != lengths.size:
        raise _fail("routing", f"expected one array per sample (N={lengths.size}), got {len(routing)}")
    rows, valid, lk = [], [], None
    for i, (r, n) in enumerate(zip(routing, lengths)):
        a = _array(f"routing[{i}]", r)
        if a.ndim != 3 or a.shape[0] not in (n, n - 1) or (lk is not None and a.shape[1:] != lk):
            want = f"(L, k) = {lk}" if lk is not None else "L, k >= 1"
            raise _fail(f"routing[{i}]", f"shape {a.shape}, expected ({n}, L, k) or ({n - 1}, L, k) with {want}")
        if a.size and a.dtype.kind not in "iu":
            raise _fail(f"routing[{i}]", f"dtype {a.dtype} is not an integer type")
        lk = a.shape[1:]
        out_of_range = np.flatnonzero(((a < 0) | (a >= num_experts)).reshape(a.shape[0], -1).any(axis=1)) if a.size else []
        if len(out_of_range):
            t = int(out_of_range[0])
            raise _fail(f"routing[{i}]", f"token {t}: expert ids {a[t].reshape(-1).tolist()[:8]} outside [0, "
                                         f"num_experts={num_experts}): give the model's expert count (num_experts, "
                                         "--num-experts); padding such as -1 is not an expert id")
        missing = int(n) - a.shape[0]
        rows.append(np.concatenate([a.astype(np.int64), np.zeros((missing, *lk), np.int64)]))
        valid.append(np.r_[np.ones(a.shape[0], np.uint8), np.zeros(missing, np.uint8)])
    return np.concatenate(rows), np.concatenate(valid)


def _check_log_probabilities(cols: dict[str, np.ndarray], mask: np.ndarray) -> None:
    """Refuse a logprob column whose loss tokens are mostly positive — probabilities or negative
    log-likelihoods passed for log p: every analysis (mismatch, KL estimates, ratios) would be
    silently wrong. The median, not the maximum: noise and rounding put a few log p near 0 above it."""
    for key, name in (("rollout_logprob", "rollout_logprobs"), ("old_logprob", "trainer_logprobs"),
                      ("ref_logprob", "ref_logprobs"), ("teacher_logprob", "teacher_logprobs")):
        values = cols[key][mask == 1] if key in cols else np.zeros(0)
        values = values[np.isfinite(values)]
        if values.size and np.median(values) > 0:
            raise _fail(name, f"the median over the loss tokens is {np.median(values):.4g} > 0 "
                              f"({int((values > 0).sum())} of {values.size} positive): pass log p(token) (≤ 0), "
                              "not a probability or a negative log-likelihood")


def _strings(name: str, values: Sequence[str] | None, n: int, default: Sequence[str]) -> list[str]:
    """One string per sample (``default`` when not given)."""
    if values is None:
        return list(default)
    if isinstance(values, (str, bytes)) or len(values) != n:
        raise _fail(name, f"expected one string per sample (N={n})")
    return [str(v) for v in values]


def _prompt_lens(prompt_lens: Any, loss_mask: Sequence[Any], lengths: np.ndarray) -> np.ndarray:
    """Each sample's prompt length: given, or the tokens before its first loss token (then the
    loss masks must cover every token)."""
    n = lengths.size
    if prompt_lens is not None:
        p = _per_sample("prompt_lens", prompt_lens, n, np.int64)
        bad = np.nonzero((p < 0) | (p > lengths))[0]
        if bad.size:
            i = int(bad[0])
            raise _fail("prompt_lens", f"sample {i}: {p[i]} not in [0, {lengths[i]}] (len(token_ids[{i}]))")
        return p
    if loss_mask is None or len(loss_mask) != n:
        raise _fail("loss_mask", f"expected one array per sample (N={n})")
    out = np.empty(n, np.int64)
    for i, (m, length) in enumerate(zip(loss_mask, lengths)):
        m = _array(f"loss_mask[{i}]", m)
        if m.shape != (length,):
            raise _fail(f"loss_mask[{i}]", f"shape {m.shape}, expected ({length},) (len(token_ids[{i}])); "
                                           "response-only masks need prompt_lens")
        hits = np.flatnonzero(m)
        out[i] = hits[0] if hits.size else length
    return out


class Recorder:
    """Write a run directory step by step from plain per-sample arrays.

    ``Recorder(run_dir, engine=..., backend=..., model=..., source={...})`` creates ``run_dir``
    with its manifest.json (``source``: free-form facts on where the data came from; the manifest
    keeps them under ``source`` with ``writer = 'axrl.trace.Recorder'``) and, when ``config`` is
    given, config.yaml (e.g. ``{'algo': {'tis_cap': 2.0}, 'model': {'dtype': 'bfloat16'}}``: the
    analyses read the clip band, TIS cap and dtype from it). ``write_step`` writes one step file
    and its metrics.jsonl line. A non-empty ``run_dir`` is refused unless ``overwrite`` (which
    removes its steps and metrics first).
    """

    def __init__(self, run_dir: str | os.PathLike, *, engine: str | None, backend: str | None,
                 model: str | None = None, source: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, seed: int | None = None,
                 overwrite: bool = False) -> None:
        path = Path(run_dir)
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"{path} exists and is not a directory: a run is a directory")
        if path.exists() and any(path.iterdir()) and not overwrite:
            raise FileExistsError(f"{path} exists and is not empty (pass overwrite=True to replace its trace)")
        self.run = RunDir(path)
        if overwrite:
            self.run.truncate_after(-1)
            self.run.config_path.unlink(missing_ok=True)
        self.manifest = self.run.write_manifest(
            seed=seed, backend=backend, engine=engine, threads=None, command=None, model=model,
            source={"writer": RECORDER, **dict(source or {})})
        if config is not None:
            self.run.write_config(config)
        self._next_sample_id = 0

    @property
    def path(self) -> Path:
        return self.run.path

    def write_step(self, step: int, *, token_ids: Sequence[Any], loss_mask: Sequence[Any],
                   rollout_logprobs: Sequence[Any], trainer_logprobs: Sequence[Any] | None,
                   rewards: Any, advantages: Sequence[Any], group_ids: Any,
                   prompt_lens: Any = None, ref_logprobs: Sequence[Any] | None = None,
                   teacher_logprobs: Sequence[Any] | None = None, entropy: Sequence[Any] | None = None,
                   routing: Sequence[Any] | None = None,
                   num_experts: int | None = None, policy_version: int | None = None,
                   sample_ids: Any = None, prompt_ids: Sequence[str] | None = None,
                   finish_reasons: Sequence[str] | None = None, metrics: Mapping[str, float] | None = None,
                   update_metrics: Mapping[str, Sequence[float]] | None = None,
                   nan_off_mask: bool = False, extra_samples: Mapping[str, Any] | None = None,
                   token_policy_versions: Sequence[Any] | None = None) -> Path:
        """Write step ``step``; return its file. Per sample i (N = ``len(token_ids)``):

        * ``token_ids[i]`` — every token of the sample (prompt, generated, tool/env), 1-D ints;
        * ``loss_mask[i]``, ``rollout_logprobs[i]`` (engine), ``trainer_logprobs[i]`` (trainer's
          recompute before the update; None: not known, NaN), ``advantages[i]`` (or a scalar),
          ``ref_logprobs[i]`` / ``teacher_logprobs[i]`` / ``entropy[i]`` (the trainer's; optional) —
          full length or response-only;
        * ``rewards[i]``, ``group_ids[i]``, ``prompt_lens[i]`` (default: tokens before the first
          loss token), ``sample_ids``/``prompt_ids``/``finish_reasons`` (optional);
        * ``routing[i]`` — engine's expert ids per token as input, [len, L, k] or [len - 1, L, k]
          (with ``num_experts``).

        ``policy_version``: the weights the step trains (default: ``step``);
        ``token_policy_versions[i]``: the weights that generated sample i's tokens (a number, or
        per token; default: ``policy_version``) — what staleness (``version_lag``) is measured from.

        ``metrics``: step scalars for metrics.jsonl; ``update_metrics``: per-update columns (with
        ``loss``, ``grad_norm``, ``lr``), all samples in each update, only with one update —
        without it the step has no update rows (the optimizer's work is not known).
        ``nan_off_mask``: store every logprob off the loss mask as NaN (frameworks that write 0.0
        where no logprob exists). Rollout logprobs off the mask are always NaN (not generated).
        Raises ``RecorderError`` naming the field and the shape it expected.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise RecorderError(f"Recorder.write_step: step {step!r} is not an int >= 0")
        n = len(token_ids)
        ids = [_array(f"token_ids[{i}]", t) for i, t in enumerate(token_ids)]
        for i, a in enumerate(ids):
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise _fail(f"token_ids[{i}]", f"shape {a.shape} dtype {a.dtype}, expected 1-D integers")
            if a.size and a.min() < 0:
                j = int(np.argmax(a < 0))
                raise _fail(f"token_ids[{i}]", f"token {j} is {a[j]}: ids are >= 0 (drop padding and "
                                               "ignore-index entries such as -100 before recording)")
        if self.run.step_path(int(step)).exists():
            raise RecorderError(f"Recorder.write_step: step {step} is already in {self.run.path} "
                                f"({self.run.step_path(int(step)).name}): each step is written once (a new "
                                "Recorder(..., overwrite=True) replaces the whole trace)")
        lengths = np.array([a.size for a in ids], np.int64)
        plens = _prompt_lens(prompt_lens, loss_mask, lengths)
        mask = _ragged("loss_mask", loss_mask, lengths, plens, 0, np.int64)
        if mask.size and (mask.min() < 0 or mask.max() > 1):
            raise _fail("loss_mask", "values must be 0 or 1")
        cols = self._token_columns(lengths, plens, mask, rollout_logprobs, trainer_logprobs, advantages,
                                   ref_logprobs, teacher_logprobs, nan_off_mask)
        cols["entropy"] = (np.full(int(lengths.sum()), np.nan, np.float16) if entropy is None else
                           _ragged("entropy", entropy, lengths, plens, np.nan, np.float16))
        record = self._record(step, n, ids, lengths, plens, mask, cols, rewards, group_ids, policy_version,
                              sample_ids, prompt_ids, finish_reasons, update_metrics, extra_samples)
        if token_policy_versions is not None:
            versions = _ragged("token_policy_versions", token_policy_versions, lengths, plens, -1, np.int64)
            record.token_policy_version = np.where(mask == 1, versions, -1)
        if routing is not None:
            record.num_experts = num_experts
            record.routing_rollout, record.routing_rollout_valid = _routing(routing, lengths, num_experts)
        path = self.run.write_step(record)
        self.run.append_metrics(self._metrics_row(record, metrics))
        return path

    @staticmethod
    def _token_columns(lengths: np.ndarray, plens: np.ndarray, mask: np.ndarray, rollout: Any, trainer: Any,
                       advantages: Any, ref: Any, teacher: Any, nan_off_mask: bool) -> dict[str, np.ndarray]:
        """The per-token logprob and advantage columns [T] (prompt of response-only arrays: NaN / 0)."""
        off = mask == 0
        cols = {"rollout_logprob": _ragged("rollout_logprobs", rollout, lengths, plens, np.nan, np.float32),
                "advantage": _ragged("advantages", advantages, lengths, plens, 0.0, np.float32)}
        cols["rollout_logprob"][off] = np.nan   # schema: NaN where not generated by the policy
        cols["old_logprob"] = (np.full(int(lengths.sum()), np.nan, np.float32) if trainer is None else
                               _ragged("trainer_logprobs", trainer, lengths, plens, np.nan, np.float32))
        for key, name, value in (("ref_logprob", "ref_logprobs", ref), ("teacher_logprob", "teacher_logprobs", teacher)):
            if value is not None:
                cols[key] = _ragged(name, value, lengths, plens, np.nan, np.float32)
        if nan_off_mask:
            for key in ("old_logprob", "ref_logprob", "teacher_logprob"):
                if key in cols:
                    cols[key][off] = np.nan
        _check_log_probabilities(cols, mask)
        return cols

    def _record(self, step: int, n: int, ids: list[np.ndarray], lengths: np.ndarray, plens: np.ndarray,
                mask: np.ndarray, cols: dict[str, np.ndarray], rewards: Any, group_ids: Any,
                policy_version: int | None, sample_ids: Any, prompt_ids: Sequence[str] | None,
                finish_reasons: Sequence[str] | None, update_metrics: Mapping[str, Sequence[float]] | None,
                extra_samples: Mapping[str, Any] | None) -> StepRecord:
        """The StepRecord of a step (validated again, field by field, by the writer)."""
        t = int(lengths.sum())
        version = int(step if policy_version is None else policy_version)
        groups = _per_sample("group_ids", group_ids, n, np.int64)
        if sample_ids is None:
            sample_ids = np.arange(self._next_sample_id, self._next_sample_id + n)
        sids = _per_sample("sample_ids", sample_ids, n, np.int64)
        self._next_sample_id = int(sids.max()) + 1 if n else self._next_sample_id
        position = np.arange(t) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        prompt = position < np.repeat(plens, lengths)
        updates = {k: _array(f"update_metrics[{k!r}]", v, np.float64).reshape(-1)
                   for k, v in (update_metrics or {}).items()}
        for k, v in updates.items():
            if v.dtype.kind not in "biuf":
                raise _fail(f"update_metrics[{k!r}]", f"dtype {v.dtype} is not numeric")
        if updates and any(v.size != 1 for v in updates.values()):
            raise _fail("update_metrics", "one value per column (one update over all samples): which samples "
                                          "each of several updates trained on is not known")
        if updates:    # the optimizer facts the caller does not know (often lr) are NaN, not invented
            updates = {**{k: [math.nan] for k in UPDATE_REQUIRED},
                       **{k: [float(v[0])] for k, v in updates.items()}}
        teacher = cols.pop("teacher_logprob", None)
        return StepRecord(
            step=int(step), policy_version=version, sample_offsets=np.r_[0, np.cumsum(lengths)],
            sample_id=sids, group_id=groups,
            prompt_id=_strings("prompt_ids", prompt_ids, n, [f"group/{g}" for g in groups]),
            prompt_len=plens, num_turns=np.ones(n, np.int32),
            reward=_per_sample("rewards", rewards, n, np.float64),
            finish_reason=_strings("finish_reasons", finish_reasons, n, ["stop"] * n), status=["ok"] * n,
            token_ids=np.concatenate(ids) if ids else np.zeros(0, np.int32), loss_mask=mask,
            turn=np.where(prompt, 0, 1), token_policy_version=np.where(mask == 1, version, -1),
            update_sample_offsets=[0, n] if updates else [0], update_samples=np.arange(n) if updates else [],
            update_metrics=updates, weights_fingerprint_before="", weights_fingerprint_after="",
            extra_tokens={} if teacher is None else {"teacher_logprob": teacher},
            extra_samples=dict(extra_samples or {}), **cols)

    @staticmethod
    def _metrics_row(r: StepRecord, metrics: Mapping[str, float] | None) -> dict[str, Any]:
        """The step's metrics.jsonl line: what the arrays say (by the definitions `axrl train` logs
        with) and the caller's scalars, which win."""
        reward = np.asarray(r.reward, np.float64)
        mask = np.asarray(r.loss_mask)
        row: dict[str, Any] = {
            "step": int(r.step), "policy_version": int(r.policy_version),
            "reward": float(np.nanmean(reward)) if np.isfinite(reward).any() else math.nan,
            "mismatch": mean_abs_delta(mask, r.rollout_logprob, r.old_logprob),
            "samples": r.num_samples, "failed": 0, "tokens": r.num_tokens,
            "generated_tokens": int(mask.sum()),
        }
        row.update({k: v for k, v in (metrics or {}).items()})
        return row
