"""slime (THUDM/slime) and miles (radixark/miles, slime's descendant) dumps → an AxRL run.

Written with ``--dump-details DIR`` or ``--save-debug-rollout-data`` + ``--save-debug-train-data``
(``torch.save`` pickles; field facts: docs/import.md):

* rollout dump ``{rollout_id, samples: [Sample.to_dict()]}``: per sample ``tokens`` (prompt +
  response), ``response_length``, ``loss_mask`` and ``rollout_log_probs`` (response only; tool/env
  spans hold 0.0), ``reward``, ``index``, ``group_index``, ``rollout_routed_experts``
  ([len(tokens) − 1, layers, k], the engine's experts of every token fed as input);
* train dump (format 2) ``{format_version: 2, rollout_id, rank, samples: [...]}`` (THUDM/slime
  1706a09, ``slime/backends/megatron_utils/train_dump_utils.py``): per sample ``rollout_position``
  (its position in the rollout dump) and ``sample_index`` (= the rollout sample's ``index``) — the
  join key, in that order of preference —, ``log_probs`` (the trainer's), ``ref_log_probs``,
  ``teacher_log_probs``, ``entropy``, ``advantages`` (response only). Evaluation dumps
  (``eval_*`` files) are skipped.

Older slime and miles (radixark/miles 31f1ca9, ``miles/utils/train_dump_utils.py``) write one
train dump per rank, ``{rollout_id, rank, rollout_data, cp_rank, cp_size, qkv_format}``, with
``rollout_data`` one list per field over the rank's samples (``sample_indices`` naming them); with
context parallelism each per-token field holds the rank's zig-zag share of the response
(`context_parallel.py` puts it back together), and tensor-parallel ranks write identical copies.
slime's log probs are at the token's own position (no shift).

``weight_versions`` (THUDM/slime 0d234f3, ``Sample.update_from_meta_info`` in
``slime/utils/types.py``): one entry per engine call that generated the sample — SGLang's
``meta_info["weight_version"]``, a string —, several for a multi-turn or partially rolled-out
sample. Which tokens each call produced is not dumped, so every generated token of a sample gets
its *oldest* numeric version (staleness is then an upper bound); the step's policy version is the
newest version any of its samples saw (slime does not dump the trainer's). Non-numeric versions
(SGLang's default ``"default"``) leave the versions at the step number.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .common import ImportedStep, ImportOptions, need, scalar, vector
from .context_parallel import reassemble
from .safe_load import ImportFormatError, as_numpy, load_dump

ENGINE, BACKEND = "sglang", "megatron"
# the train dump's per-token fields (response only) that the importer reads
_TOKEN_FIELDS = ("log_probs", "ref_log_probs", "teacher_log_probs", "advantages", "entropy", "rollout_log_probs",
                 "loss_masks")
ABSENT = ["trainer routing (/routing/train)", "per-update metrics (/train/updates)", "weight fingerprints"]


def _dump_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    files = sorted(p for p in src.rglob("*.pt") if p.is_file())
    if not files:
        mirror = " (miles' parquet mirrors are not read: point at the directory holding its .pt dumps, which hold " \
                 "the same columns and more)" if any(src.rglob("*.parquet")) else ""
        raise ImportFormatError(f"{src}: no *.pt dump in it{mirror}")
    return files


def _classify(files: list[Path], options: ImportOptions) -> tuple[dict[int, Path], dict[int, list[Path]]]:
    """Rollout dump files by rollout id, and the train dump files (all ranks) by rollout id. Only
    the file names are kept: a step's dumps are loaded again when it is written, so one step's
    dumps are in memory at a time (dumps with routing run to gigabytes)."""
    rollouts: dict[int, Path] = {}
    train: dict[int, list[Path]] = defaultdict(list)
    for f in files:
        if f.name.startswith("eval_"):   # evaluation rollouts (slime's path template gets 'eval_<id>'): not trained
            continue
        d = load_dump(f, trust=options.trust_pickle)
        if not isinstance(d, dict) or ("samples" not in d and "rollout_data" not in d):
            raise ImportFormatError(f"{f}: not a slime/miles dump (expected a dict with 'rollout_id' and "
                                    "'samples' or 'rollout_data')")
        rid = int(scalar(d, "rollout_id", str(f)))
        if "rank" in d or "format_version" in d:
            if d.get("format_version", 2) != 2:
                raise ImportFormatError(f"{f}: train dump format_version {d['format_version']} (this importer reads 2)")
            train[rid].append(f)
        elif rid in rollouts:
            raise ImportFormatError(f"{f}: a second rollout dump of rollout {rid} (first: {rollouts[rid]})")
        else:
            rollouts[rid] = f
        del d
    return rollouts, train


def _train_rows(d: dict, f: Path) -> list[tuple[str, dict]]:
    """(where, sample) of a train dump: format 2's ``samples``, or the per-rank column layout
    (``rollout_data``: one list per field over the rank's samples, ``sample_indices`` naming them;
    older slime, miles)."""
    if "samples" in d:
        return [(f"{f}: samples[{j}]", s) for j, s in enumerate(need(d, "samples", str(f)))]
    cols = need(d, "rollout_data", str(f))
    n = len(need(cols, "response_lengths", f"{f}: rollout_data"))
    if len(need(cols, "sample_indices", f"{f}: rollout_data")) != n:
        raise ImportFormatError(f"{f}: rollout_data: 'sample_indices' has {len(cols['sample_indices'])} entries, "
                                f"'response_lengths' {n}")
    per_sample = {k: v for k, v in cols.items()
                  if hasattr(v, "__len__") and not isinstance(v, (str, bytes)) and len(v) == n}
    return [(f"{f}: rollout_data[{i}]", {**{k: v[i] for k, v in per_sample.items()},
                                         "sample_index": per_sample["sample_indices"][i]}) for i in range(n)]


def _train_by_key(dumps: list[tuple[Path, Any]]) -> tuple[str, dict[int, dict[str, Any]]]:
    """The train dumps' samples by ``rollout_position`` (the sample's position in the rollout dump,
    which slime writes whenever it dumps) when every sample has one, else by ``sample_index``
    (= the rollout sample's ``index``). A sample held by several context-parallel ranks (miles) is
    put back together; copies from tensor-parallel ranks (same ``cp_rank``) count once."""
    rows = [(int(d.get("cp_rank", 0)), int(d.get("cp_size", 1)), d.get("qkv_format", "thd"), where, s)
            for f, d in dumps for where, s in _train_rows(d, f)]
    key = "rollout_position" if rows and all(r[4].get("rollout_position") is not None for r in rows) else "sample_index"
    pieces: dict[int, dict[int, tuple[str, dict]]] = defaultdict(dict)
    cp_of: dict[int, tuple[int, str]] = {}
    for cp_rank, cp_size, qkv, where, s in rows:
        k = int(scalar(s, key, where))
        pieces[k].setdefault(cp_rank, (where, s))
        cp_of[k] = (cp_size, qkv)
    return key, {k: _join_pieces(parts, *cp_of[k]) for k, parts in pieces.items()}


def _join_pieces(parts: dict[int, tuple[str, dict]], cp_size: int, qkv: str) -> dict[str, Any]:
    """One train sample from its context-parallel pieces (cp_rank → (where, sample))."""
    where, first = parts[min(parts)]
    if cp_size == 1:
        return {**first, "_where": where}
    where = " + ".join(w for w, _ in parts.values())
    if qkv != "thd":
        raise ImportFormatError(f"{where}: context-parallel pieces with qkv_format {qkv!r}: only 'thd' dumps "
                                "can be put back together (bshd chunks by the padded length, not recorded)")
    total, response = int(scalar(first, "total_lengths", where)), int(scalar(first, "response_lengths", where))
    merged = {**first, "_where": where}
    for field in _TOKEN_FIELDS:
        if all(s.get(field) is not None for _, s in parts.values()):
            got = {r: as_numpy(s[field], f"{w}.{field}") for r, (w, s) in parts.items()}
            if any(g.shape[0] != response for g in got.values()):
                merged[field] = reassemble(got, total, response, cp_size, f"{where}: field '{field}'")
    return merged


def _response(s: dict, key: str, where: str, n: int, optional: bool = False) -> np.ndarray | None:
    """A response-only per-token field of length ``n`` (None when optional and absent)."""
    if optional and s.get(key) is None:
        return None
    return vector(s, key, where, n)


def _reward(s: dict, where: str, key: str | None) -> float:
    """The sample's reward: a number, or with slime's ``--reward-key`` one entry of a dict; None
    (not scored, e.g. an aborted or removed sample) is NaN."""
    if "reward" in s and s["reward"] is None:
        return math.nan
    raw = need(s, "reward", where)
    if isinstance(raw, dict):
        if key is None or key not in raw:
            what = "pass --reward-key KEY (slime's --reward-key)" if key is None else f"--reward-key {key!r} is not one"
            raise ImportFormatError(f"{where}: field 'reward' is a dict (keys {sorted(map(str, raw))}): {what}")
        return scalar(raw, key, f"{where}: reward")
    return scalar(s, "reward", where)


def _sample(s: dict, where: str, train: dict[str, Any] | None, options: ImportOptions) -> dict[str, Any]:
    """One sample's arrays (response-only logprobs, full-length tokens). slime dumps a rollout
    before it fills in defaults: ``loss_mask`` None means every response token is trained (what
    slime's ``_convert_samples_to_train_data`` then uses), ``rollout_log_probs`` None that the
    rollout returned none (stored NaN: no mismatch for the sample); ``remove_sample`` that none of
    it is trained (slime zeroes its loss mask)."""
    tokens = vector(s, "tokens", where, dtype=np.int64)
    n = int(scalar(s, "response_length", where))
    if not 0 <= n <= tokens.size:
        raise ImportFormatError(f"{where}: response_length {n} outside [0, len(tokens)={tokens.size}]")
    unset = {k for k in ("loss_mask", "rollout_log_probs") if k in s and s[k] is None}
    removed = bool(s.get("remove_sample"))     # slime then trains none of it (its loss mask zeroed)
    out: dict[str, Any] = {
        "tokens": tokens, "prompt_len": tokens.size - n, "reward": _reward(s, where, options.reward_key),
        "mask": (np.zeros(n, np.int64) if removed else np.ones(n, np.int64) if "loss_mask" in unset
                 else vector(s, "loss_mask", where, n, np.int64)),
        "rollout": np.full(n, np.nan) if "rollout_log_probs" in unset else vector(s, "rollout_log_probs", where, n),
        "index": int(scalar(s, "index", where)), "group": int(scalar(s, "group_index", where)),
        "trainer": None, "ref": None, "teacher": None, "entropy": None, "advantages": np.zeros(n),
        "versions": _weight_versions(s.get("weight_versions")),
    }
    routed = s.get("rollout_routed_experts")
    if routed is not None:
        r = as_numpy(routed, f"{where}.rollout_routed_experts")
        if r.ndim != 3 or r.shape[0] != tokens.size - 1:
            raise ImportFormatError(f"{where}: field 'rollout_routed_experts' has shape {r.shape}, "
                                    f"expected ({tokens.size - 1}, layers, k) (len(tokens) - 1)")
        out["routing"] = r.astype(np.int64)
    if train is not None:
        tw = train["_where"]
        out["trainer"] = _response(train, "log_probs", tw, n)
        for name, field in (("ref", "ref_log_probs"), ("teacher", "teacher_log_probs"), ("entropy", "entropy")):
            out[name] = _response(train, field, tw, n, optional=True)
        adv = _response(train, "advantages", tw, n, optional=True)
        out["advantages"] = out["advantages"] if adv is None else adv
    return out


def _weight_versions(raw: Any) -> list[int] | None:
    """The numeric weight versions of a sample's engine calls (None when absent or not numbers)."""
    if not isinstance(raw, (list, tuple)) or not raw:
        return None
    try:
        return [int(str(v).strip()) for v in raw]
    except ValueError:
        return None


def _optional(samples: list[dict[str, Any]], name: str) -> list[np.ndarray] | None:
    """A per-token column every sample has, else None (a column is recorded whole or not at all)."""
    return [x[name] for x in samples] if samples and all(x[name] is not None for x in samples) else None


def _step(rid: int, f: Path, dump: Any, train_dumps: list[tuple[Path, Any]], options: ImportOptions) -> ImportedStep:
    """The step of rollout ``rid``: rollout samples joined with their train-dump samples."""
    key, train = _train_by_key(train_dumps) if train_dumps else ("", {})
    rollout = need(dump, "samples", str(f))
    joined = [(i if key == "rollout_position" else int(s.get("index", -1)) if isinstance(s, dict) else -1)
              for i, s in enumerate(rollout)]
    samples = [_sample(s, f"{f}: samples[{i}]", train.get(k) if train else None, options)
               for i, (s, k) in enumerate(zip(rollout, joined))]
    if train:
        unmatched = sorted(set(train) - set(joined))
        if unmatched:
            raise ImportFormatError(f"train dump(s) of rollout {rid}: {key} {unmatched[:5]} not in {f}")
        missing = [k for k, x in zip(joined, samples) if x["trainer"] is None]
        if missing:
            raise ImportFormatError(f"{f}: rollout samples {missing[:5]} have no train-dump sample ({key})")
    no_lp = sum(1 for s in rollout if isinstance(s, dict) and "rollout_log_probs" in s and s["rollout_log_probs"] is None)
    notes = [f"{f}: {no_lp} of {len(samples)} samples have rollout_log_probs None (the rollout returned no "
             "logprobs): stored NaN, mismatch leaves them out"] if no_lp else []
    routed = [x.get("routing") for x in samples]
    versions = [x["versions"] for x in samples]
    versioned = all(v is not None for v in versions) and bool(versions)
    return ImportedStep(
        step=rid, token_ids=[x["tokens"] for x in samples], loss_mask=[x["mask"] for x in samples],
        rollout_logprobs=[x["rollout"] for x in samples], trainer_logprobs=_optional(samples, "trainer"),
        advantages=[x["advantages"] for x in samples], rewards=[x["reward"] for x in samples],
        group_ids=[x["group"] for x in samples], prompt_lens=[x["prompt_len"] for x in samples],
        ref_logprobs=_optional(samples, "ref"), teacher_logprobs=_optional(samples, "teacher"),
        entropy=_optional(samples, "entropy"), routing=routed if all(r is not None for r in routed) else None,
        sample_ids=[x["index"] for x in samples], files=[str(f)] + [str(p) for p, _ in train_dumps],
        policy_versions=[min(v) for v in versions] if versioned else None,
        policy_version=max(max(v) for v in versions) if versioned else None, notes=notes)


def read_steps(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """The steps of a slime/miles dump directory (or one rollout dump file), by rollout id."""
    rollouts, train = _classify(_dump_files(Path(src)), options)
    if not rollouts:
        raise ImportFormatError(f"{src}: no rollout dump (train dumps alone lack the tokens and rollout logprobs)")
    orphans = sorted(set(train) - set(rollouts))
    if orphans:
        raise ImportFormatError(f"{src}: train dumps of rollout(s) {orphans[:5]} have no rollout dump")
    for rid in sorted(rollouts):
        f = rollouts[rid]
        trained = [(p, load_dump(p, trust=options.trust_pickle)) for p in train.get(rid, [])]
        yield _step(rid, f, load_dump(f, trust=options.trust_pickle), trained, options)
