"""What every importer shares: the step it hands over (`ImportedStep`), field access that names the
file and the field when something is missing, the shift of label-aligned columns, and the writing
of the run through `axrl.trace.Recorder`."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from axrl.trace import Recorder, TraceValidationError

from .safe_load import ImportFormatError, as_numpy


@dataclass
class ImportedStep:
    """One step of another framework's run, per sample (arrays full-length or response-only, as
    `Recorder.write_step` takes them; logprobs at the token's own position)."""

    step: int
    token_ids: list[np.ndarray]
    loss_mask: list[np.ndarray]
    rollout_logprobs: list[np.ndarray]
    trainer_logprobs: list[np.ndarray] | None
    advantages: list[Any]
    rewards: list[float]
    group_ids: list[int]
    prompt_lens: list[int] | None = None
    ref_logprobs: list[np.ndarray] | None = None
    teacher_logprobs: list[np.ndarray] | None = None
    entropy: list[np.ndarray] | None = None
    routing: list[np.ndarray] | None = None
    sample_ids: list[int] | None = None
    policy_versions: list[int] | None = None           # per sample: the weights that generated it
    policy_version: int | None = None                  # the step's (default: the step number)
    files: list[str] = field(default_factory=list)     # the dumps it was read from
    notes: list[str] = field(default_factory=list)     # what was left out of this step, and why

    @property
    def num_samples(self) -> int:
        return len(self.token_ids)


@dataclass
class ImportOptions:
    """What the user tells an importer that the dumps do not say."""

    trust_pickle: bool = False
    group_size: int | None = None         # NeMo-RL: samples per prompt (else inferred from prompts)
    num_experts: int | None = None        # MoE routing: experts per layer (else max id + 1)
    reward_key: str | None = None         # slime/miles: the entry of a dict reward (slime's --reward-key)
    rollout_dtype: str | None = None      # the precision the engine computed logprobs in (config rollout.dtype)
    model_dtype: str | None = None        # the trainer's (config model.dtype)

    def config(self) -> dict[str, Any] | None:
        """config.yaml of the imported run: the dtypes the user stated (`axrl-debug doctor` sizes its
        envelope by the rollout's), or None when none was."""
        out = {section: {"dtype": _dtype_name(flag, value)}
               for section, flag, value in (("rollout", "--rollout-dtype", self.rollout_dtype),
                                            ("model", "--model-dtype", self.model_dtype)) if value}
        return out or None


#: the dtypes an imported run's precision may be stated in, with the name config.yaml keeps
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16", "fp8": "fp8"}


def _dtype_name(flag: str, value: str) -> str:
    name = DTYPES.get(value.lower().removeprefix("torch."))
    if name is None:
        raise ImportFormatError(f"{flag}: {value!r} is not a dtype this can state (one of {', '.join(sorted(DTYPES))})")
    return name


def need(obj: Mapping[str, Any], key: str, where: str) -> Any:
    """``obj[key]``, or ImportFormatError naming ``where`` and the missing field."""
    if not isinstance(obj, Mapping):
        raise ImportFormatError(f"{where}: expected a dict with '{key}', got {type(obj).__name__}")
    if key not in obj or obj[key] is None:
        raise ImportFormatError(f"{where}: missing field '{key}'")
    return obj[key]


def vector(obj: Mapping[str, Any], key: str, where: str, length: int | None = None,
           dtype: Any = np.float64) -> np.ndarray:
    """A 1-D field of ``obj`` as numpy, checked against the expected ``length``."""
    a = as_numpy(need(obj, key, where), f"{where}.{key}")
    if a.ndim != 1 or (length is not None and a.shape[0] != length):
        want = f"({length},)" if length is not None else "1-D"
        raise ImportFormatError(f"{where}: field '{key}' has shape {a.shape}, expected {want}")
    if a.size and a.dtype.kind not in "biuf":
        raise ImportFormatError(f"{where}: field '{key}' is not numeric (dtype {a.dtype})")
    return a.astype(dtype)


def scalar(obj: Mapping[str, Any], key: str, where: str) -> float:
    """A numeric scalar field (a one-element tensor/array counts)."""
    a = as_numpy(need(obj, key, where), f"{where}.{key}")
    if a.size != 1 or a.dtype.kind not in "biuf":
        raise ImportFormatError(f"{where}: field '{key}' should be one number, got shape {a.shape} dtype {a.dtype}")
    return float(a.reshape(-1)[0])


def shift_label_aligned(a: np.ndarray, fill: float) -> np.ndarray:
    """A label-aligned column (entry j concerns token j + 1) at the tokens' own positions: AxRL
    stores log p(token_t | tokens_<t) at row t, so everything moves one place right and row 0
    (the first token, which nothing predicts) gets ``fill``."""
    out = np.full(a.shape, fill, dtype=np.result_type(a.dtype, np.asarray(fill).dtype))
    out[1:] = a[:-1]
    return out


def num_experts_of(routing: list[np.ndarray] | None, given: int | None) -> int | None:
    """The routing's expert count: the user's, else the largest id seen + 1 (a lower bound)."""
    if routing is None:
        return None
    if given is not None:
        return int(given)
    return max((int(r.max()) for r in routing if r.size), default=0) + 1


def write_steps(steps: Iterable[ImportedStep], run: str | Path, *, fmt: str, src: str | Path,
                engine: str | None, backend: str | None, model: str | None, options: ImportOptions,
                absent: list[str], overwrite: bool = False) -> dict[str, Any]:
    """Write the run through the Recorder; return what was imported (for the command's report)."""
    steps = iter(steps)
    first = next(steps, None)     # read (and check) the first step before creating the run
    if first is None:
        raise ImportFormatError(f"{src}: no {fmt} dump found")
    fresh = not Path(run).exists()
    try:
        return _record(itertools.chain([first], steps), run, fmt=fmt, src=src, engine=engine, backend=backend,
                       model=model, options=options, absent=absent, overwrite=overwrite)
    except BaseException:
        if fresh:   # a dump found bad halfway: leave no half-imported run behind
            shutil.rmtree(run, ignore_errors=True)
        raise


def _record(steps: Iterable[ImportedStep], run: str | Path, *, fmt: str, src: str | Path, engine: str | None,
            backend: str | None, model: str | None, options: ImportOptions, absent: list[str],
            overwrite: bool) -> dict[str, Any]:
    """Write every step through the Recorder and count what was written."""
    source = {"format": fmt, "path": str(Path(src).resolve()), "absent": absent}
    rec = Recorder(run, engine=engine, backend=backend, model=model, source=source, overwrite=overwrite,
                   config=options.config())
    report: dict[str, Any] = {"run": str(rec.path), "format": fmt, "steps": [], "samples": 0, "tokens": 0,
                              "absent": absent, "notes": []}
    seen: dict[int, list[str]] = {}
    for s in steps:
        if s.step in seen:
            raise ImportFormatError(f"two dumps of step {s.step}: {', '.join(seen[s.step])} and {', '.join(s.files)} "
                                    "(several runs under SRC?): point SRC at one run's dumps")
        seen[s.step] = s.files
        try:
            _write_step(rec, s, options)
        except TraceValidationError as e:    # name the dumps the bad value came from
            raise ImportFormatError(f"step {s.step} ({', '.join(s.files)}): {e}") from None
        report["steps"].append(s.step)
        report["notes"] += s.notes
        report["samples"] += s.num_samples
        report["tokens"] += int(sum(len(t) for t in s.token_ids))
    return report


def _write_step(rec: Recorder, s: ImportedStep, options: ImportOptions) -> None:
    """One imported step through the Recorder."""
    experts = num_experts_of(s.routing, options.num_experts)
    rec.write_step(s.step, token_ids=s.token_ids, loss_mask=s.loss_mask, rollout_logprobs=s.rollout_logprobs,
                   trainer_logprobs=s.trainer_logprobs, rewards=s.rewards, advantages=s.advantages,
                   group_ids=s.group_ids, prompt_lens=s.prompt_lens, ref_logprobs=s.ref_logprobs,
                   teacher_logprobs=s.teacher_logprobs, entropy=s.entropy,
                   routing=s.routing, num_experts=experts, sample_ids=s.sample_ids, nan_off_mask=True,
                   policy_version=s.policy_version, token_policy_versions=s.policy_versions)
