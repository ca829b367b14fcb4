"""NeMo-RL (NVIDIA-NeMo/RL) ``train_data_step{N}.jsonl`` → an AxRL run.

Written by default by ``nemo_rl/algorithms/grpo.py`` (checked at NVIDIA-NeMo/RL
7ea279abfbeb698b092856d0dab61e7cf39bc909): one JSON object per sample, ``token_ids`` padded to
the batch's longest sample (``input_lengths`` gives each one's length), ``token_loss_mask``,
``sample_loss_mask`` (0: the whole sample left out of the loss), ``generation_logprobs`` (the
engine's), ``prev_logprobs`` (the trainer's, before the update), ``advantages`` (per token, or one
number), ``rewards``, ``content``; zeros where no logprob exists (NaN off the loss mask here). The
logprobs are at the token's own position: the policy workers prepend a zero for the first token
(no shift). The samples of one prompt are consecutive: ``--group-size G`` puts samples
i·G … i·G + G − 1 in group i; without it, consecutive samples whose prompt tokens (those before the
first loss token) are identical form a group.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .common import ImportedStep, ImportOptions, scalar, vector
from .safe_load import ImportFormatError

ENGINE, BACKEND = None, None        # vLLM or Megatron/DTensor: the dump does not say
ABSENT = ["reference logprobs", "routing", "per-update metrics (/train/updates)", "entropy",
          "weight fingerprints"]
_FILE_RE = re.compile(r"^train_data_step(\d+)\.jsonl$")


def _files(src: Path) -> list[tuple[int, Path]]:
    """(step, file) of every ``train_data_step{N}.jsonl`` in ``src`` (or ``src`` itself)."""
    paths = [src] if src.is_file() else sorted(src.rglob("train_data_step*.jsonl"))
    out = []
    for p in paths:
        m = _FILE_RE.match(p.name)
        if not m:
            raise ImportFormatError(f"{p}: not a NeMo-RL train data file (train_data_step{{N}}.jsonl)")
        out.append((int(m.group(1)), p))
    if not out:
        raise ImportFormatError(f"{src}: no train_data_step*.jsonl in it")
    out.sort()
    for (a, pa), (b, pb) in zip(out, out[1:]):
        if a == b:
            raise ImportFormatError(f"{src}: two dumps of step {a}: {pa} and {pb} (several experiments under "
                                    "SRC?): point SRC at one experiment's log directory, e.g. logs/exp_001")
    return out


def _unbatch(obj: Any) -> Any:
    """A line as NeMo-RL's logger writes it: ``log_batched_dict_as_jsonl`` walks the batch with
    ``make_microbatch_iterator(1)``, so every field is a batch of one (``"token_ids": [[...]]``,
    ``"rewards": [0.5]``) next to ``idx``; unwrapped here. A line whose ``token_ids`` is already one
    flat list is read as it is."""
    ids = obj.get("token_ids") if isinstance(obj, dict) else None
    if not (isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list)):
        return obj
    return {k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in obj.items()}


def _sample(obj: Any, where: str) -> dict[str, Any]:
    """One line's sample, padding trimmed to ``input_lengths``."""
    obj = _unbatch(obj)
    if isinstance(obj, dict) and obj.get("token_ids") is None:
        raise ImportFormatError(f"{where}: missing field 'token_ids' (the line has {sorted(obj)}): NeMo-RL "
                                "versions or logging paths that write no token ids cannot be imported, the "
                                "trace is per token")
    ids = vector(obj, "token_ids", where, dtype=np.int64)
    n = int(scalar(obj, "input_lengths", where))
    if not 0 < n <= ids.size:
        raise ImportFormatError(f"{where}: input_lengths {n} outside [1, len(token_ids)={ids.size}]")
    cols = {k: vector(obj, k, where, ids.size)[:n]
            for k in ("token_loss_mask", "generation_logprobs", "prev_logprobs")}
    mask = cols["token_loss_mask"].astype(np.int64)
    if np.any((mask != 0) & (mask != 1)):
        raise ImportFormatError(f"{where}: field 'token_loss_mask' holds values other than 0 and 1")
    if obj.get("advantages") is None:
        raise ImportFormatError(f"{where}: missing field 'advantages'")
    if np.ndim(obj["advantages"]) == 0:     # one number per sample: its loss tokens carry it
        advantages = np.where(mask == 1, scalar(obj, "advantages", where), 0.0)
    else:
        advantages = vector(obj, "advantages", where, ids.size)[:n]
    hits = np.flatnonzero(mask)
    if obj.get("sample_loss_mask") is not None and scalar(obj, "sample_loss_mask", where) == 0:
        mask = np.zeros_like(mask)     # a sample left out of the loss (e.g. overlong filtering): nothing trained
    return {"ids": ids[:n], "mask": mask, "rollout": cols["generation_logprobs"], "trainer": cols["prev_logprobs"],
            "advantages": advantages,
            "reward": scalar(obj, "filtered_rewards" if "filtered_rewards" in obj else "rewards", where),
            "prompt_len": int(hits[0]) if hits.size else n}


def _groups(samples: list[dict[str, Any]], group_size: int | None, where: Path) -> list[int]:
    """Group ids: fixed-size consecutive blocks, or runs of identical prompts."""
    if group_size is not None:
        if group_size < 1 or len(samples) % group_size:
            raise ImportFormatError(f"{where}: {len(samples)} samples do not split into groups of "
                                    f"--group-size {group_size}")
        return [i // group_size for i in range(len(samples))]
    out, prev, g = [], None, -1
    for s in samples:
        prompt = s["ids"][:s["prompt_len"]].tobytes()
        if prompt != prev:
            g, prev = g + 1, prompt
        out.append(g)
    return out


def _read_file(step: int, path: Path, options: ImportOptions) -> ImportedStep:
    """One step's samples (with dynamic sampling, the trained ones: ``filtered_rewards``)."""
    samples, skipped = [], 0
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ImportFormatError(f"{where}: not JSON ({e})") from None
            if isinstance(obj, dict) and obj.get("filtered_rewards") == []:
                skipped += 1     # dynamic sampling: a line past the trained batch (rewards is the unfiltered one)
                continue
            samples.append(_sample(obj, where))
    if not samples:
        raise ImportFormatError(f"{path}: no samples")
    notes = [f"{path}: {skipped} line(s) past the trained batch (dynamic sampling: only 'rewards' of "
             "rollouts filtered out) skipped"] if skipped else []
    return ImportedStep(
        step=step, token_ids=[s["ids"] for s in samples], loss_mask=[s["mask"] for s in samples],
        rollout_logprobs=[s["rollout"] for s in samples], trainer_logprobs=[s["trainer"] for s in samples],
        advantages=[s["advantages"] for s in samples], rewards=[s["reward"] for s in samples],
        group_ids=_groups(samples, options.group_size, path), prompt_lens=[s["prompt_len"] for s in samples],
        files=[str(path)], notes=notes)


def read_steps(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """The steps of a NeMo-RL log directory (or one train_data_step{N}.jsonl)."""
    for step, path in _files(Path(src)):
        yield _read_file(step, path, options)
