"""`axrl-debug import FORMAT SRC RUN`: dumps in slime, miles, NeMo-RL and AxisRL formats, built
here from each writer's field list at the sizes of real runs, are imported and analysed; the
analyses' numbers equal an independent computation from the fixture arrays. Malformed dumps are
refused naming the file and the field; hostile pickles are refused naming the class, and their
code does not run."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import types
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tensordict import TensorDict
from typer.testing import CliRunner

from axrl.trace import StepFile
from axrl_debug.cli import app

STEPS, N, GROUP = 2, 128, 8


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def said(result, needle: str) -> bool:
    """The command failed as bad input (exit 2) with ``needle`` in its output (rich wraps lines anywhere)."""
    return result.exit_code == 2 and "".join(needle.split()) in "".join(result.output.split())


def mean_abs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Mean |trainer − rollout| over loss tokens, from (rollout, trainer) arrays of loss tokens only
    (float32 as the trace stores them)."""
    d = [np.abs(t.astype(np.float32).astype(np.float64) - r.astype(np.float32).astype(np.float64)) for r, t in pairs]
    return float(np.concatenate(d).mean())


def sample_arrays(rng: np.random.Generator) -> dict:
    """One sample: prompt + response tokens, a response loss mask with a tool span, the engine's
    logprobs (0.0 off the mask, as the writers leave them) and the trainer's."""
    p, r = int(rng.integers(20, 80)), int(rng.integers(40, 300))
    mask = np.ones(r, np.int64)
    mask[r // 3: r // 3 + 5] = 0
    rollout = np.where(mask == 1, -rng.exponential(0.6, r), 0.0).astype(np.float32)
    trainer = np.where(mask == 1, rollout + rng.normal(0, 0.03, r), 0.0).astype(np.float32)
    return {"prompt": rng.integers(0, 150000, p), "response": rng.integers(0, 150000, r), "mask": mask,
            "rollout": rollout, "trainer": trainer, "reward": float(rng.random()),
            "advantage": rng.normal(0, 1, r).astype(np.float32)}


def analyse(run: Path) -> tuple[dict, dict]:
    return one_json(invoke("summary", run, "--json")), one_json(invoke("mismatch", run, "--json"))


# ----------------------------------------------------------------------------- slime / miles
def zigzag(a: np.ndarray, total: int, response: int, cp: int, rank: int) -> np.ndarray:
    """CP rank ``rank``'s share of a response field, as miles' ``slice_log_prob_with_cp`` cuts it
    (radixark/miles 31f1ca9, ``miles/backends/training_utils/cp_utils.py``, qkv_format 'thd')."""
    prompt, chunk = total - response, -(-total // (2 * cp))
    parts = [a[max(k * chunk, prompt - 1) - (prompt - 1):min((k + 1) * chunk, total - 1) - (prompt - 1)]
             for k in (rank, 2 * cp - rank - 1) if max(k * chunk, prompt - 1) < min((k + 1) * chunk, total - 1)]
    return np.concatenate(parts) if parts else a[:0]


def rollout_dump(root: Path, rid: int, samples: list[dict], rng: np.random.Generator, extra: dict | None) -> None:
    """slime/miles rollout dump ``{rollout_id, samples: [Sample.to_dict()]}``."""
    rollout = []
    for i, s in enumerate(samples):
        tokens = np.concatenate([s["prompt"], s["response"]])
        rollout.append({"tokens": tokens.tolist(), "response_length": len(s["response"]),
                        "loss_mask": s["mask"].tolist(), "rollout_log_probs": s["rollout"].tolist(),
                        "reward": s["reward"], "index": rid * N + i, "group_index": rid * N // GROUP + i // GROUP,
                        "weight_versions": [str(rid)], "prompt": "q", "response": "a", "status": "completed",
                        "rollout_routed_experts": rng.integers(0, 32, (tokens.size - 1, 4, 2), dtype=np.int32),
                        **(extra or {})})
    torch.save({"rollout_id": rid, "samples": rollout}, root / f"rollout_{rid}.pt")


def slime_train_dump(root: Path, rid: int, samples: list[dict]) -> None:
    """slime's format 2 (THUDM/slime 1706a09, ``train_dump_utils.py``): one file per rollout from
    the DP-source rank, samples sorted by ``rollout_position``, CP fields already gathered."""
    train = [{"sample_index": rid * N + i, "rollout_position": i, "data_parallel_rank": i % 2,
              "log_probs": torch.from_numpy(s["trainer"]), "ref_log_probs": torch.from_numpy(s["trainer"] - 0.1),
              "entropy": torch.full((len(s["mask"]),), 0.25), "advantages": torch.from_numpy(s["advantage"]),
              "loss_masks": torch.from_numpy(s["mask"]), "response_lengths": len(s["mask"]), "rewards": s["reward"]}
             for i, s in enumerate(samples)]
    torch.save({"format_version": 2, "rollout_id": rid, "rank": 0, "samples": train,
                "dp_shards": [{"rank": 0}], "raw_reward": []}, root / f"train_{rid}_0.pt")


def miles_train_dumps(root: Path, rid: int, samples: list[dict], cp: int = 2, tp: int = 2, dp: int = 2) -> None:
    """miles' per-rank dumps (radixark/miles 31f1ca9, ``train_dump_utils.py``): ``rollout_data``
    columns over the DP shard's samples; the trainer's per-token fields cut into each CP rank's
    zig-zag share; every TP rank writes the same file."""
    for d in range(dp):
        rows = list(range(d, N, dp))
        for c in range(cp):
            def cut(a, i):
                total, response = len(samples[i]["prompt"]) + len(a), len(a)
                return torch.from_numpy(zigzag(np.asarray(a), total, response, cp, c))
            cols = {"sample_indices": [rid * N + i for i in rows],
                    "tokens": [torch.from_numpy(np.concatenate([samples[i]["prompt"], samples[i]["response"]])) for i in rows],
                    "response_lengths": [len(samples[i]["mask"]) for i in rows],
                    "total_lengths": [len(samples[i]["prompt"]) + len(samples[i]["mask"]) for i in rows],
                    "loss_masks": [torch.from_numpy(samples[i]["mask"]) for i in rows],
                    "log_probs": [cut(samples[i]["trainer"], i) for i in rows],
                    "ref_log_probs": [cut(samples[i]["trainer"] - 0.1, i) for i in rows],
                    "entropy": [cut(np.full(len(samples[i]["mask"]), 0.25, np.float32), i) for i in rows],
                    "advantages": [cut(samples[i]["advantage"], i) for i in rows],
                    "rewards": [samples[i]["reward"] for i in rows], "raw_reward": [0.0] * N}
            for t in range(tp):
                rank = (d * cp + c) * tp + t
                torch.save({"rollout_id": rid, "rank": rank, "rollout_data": cols, "cp_rank": c, "cp_size": cp,
                            "qkv_format": "thd"}, root / f"{rid}_{rank}.pt")


def slime_dumps(root: Path, *, miles: bool = False, extra: dict | None = None) -> list[list[dict]]:
    """Rollout dumps + train dumps in slime's or miles' layout; the fixture samples per step."""
    rng = np.random.default_rng(1)
    steps = []
    for rid in range(STEPS):
        samples = [sample_arrays(rng) for _ in range(N)]
        rollout_dump(root, rid, samples, rng, extra)
        (miles_train_dumps if miles else slime_train_dump)(root, rid, samples)
        steps.append(samples)
    return steps


def loss_pairs(samples: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(rollout, trainer) logprobs of each sample's loss tokens (none for a sample out of the loss)."""
    return [(s["rollout"][s["mask"] == 1], s["trainer"][s["mask"] == 1]) for s in samples if s.get("sample_mask", 1)]


@pytest.mark.parametrize("fmt", ["slime", "miles"])
def test_slime_and_miles(tmp_path: Path, fmt: str) -> None:
    src = tmp_path / "dumps"
    src.mkdir()
    steps = slime_dumps(src, miles=fmt == "miles")
    torch.save({"rollout_id": 1, "samples": [{"tokens": [1]}]}, src / "eval_1.pt")   # an eval rollout: skipped
    report = one_json(invoke("import", fmt, src, tmp_path / "run", "--num-experts", 32, "--json"))
    assert report["steps"] == [0, 1] and report["samples"] == STEPS * N
    summary, mismatch = analyse(tmp_path / "run")
    assert mismatch["metrics"]["mean_abs"] == pytest.approx(mean_abs([p for s in steps for p in loss_pairs(s)]), rel=1e-9)
    for row, samples in zip(summary["steps"], steps):
        assert row["mismatch"] == pytest.approx(mean_abs(loss_pairs(samples)), rel=1e-9)
        assert row["reward"] == pytest.approx(np.mean([s["reward"] for s in samples]))
        assert row["loss"] is None and row["routing_agreement"] is None      # absent, not invented
    with StepFile(tmp_path / "run" / "trace" / "step_000001.h5") as sf:
        s0 = steps[1][0]
        p, n = len(s0["prompt"]), len(s0["prompt"]) + len(s0["response"])
        rollout, old = sf["/tokens/rollout_logprob"][:n], sf["/tokens/old_logprob"][:n]
        assert np.isnan(rollout[:p]).all() and np.isnan(old[p:][s0["mask"] == 0]).all()   # prompt, tool span
        assert np.array_equal(old[p:][s0["mask"] == 1], s0["trainer"][s0["mask"] == 1])
        assert sf["/samples/group_id"][:GROUP].tolist() == [N // GROUP] * GROUP
        assert sf["/routing/rollout"].shape[1:] == (4, 2) and sf["/routing/rollout_valid"][n - 1] == 0
        assert "/routing/train" not in sf and "/tokens/ref_logprob" in sf
        assert np.all(sf["/tokens/entropy"][p:n] == np.float16(0.25))     # the train dump's, response only
        assert np.array_equal(sf["/tokens/advantage"][p:n], s0["advantage"])  # CP pieces back in place (miles)
    assert invoke("replay", tmp_path / "run", "--step", 0).exit_code == 2


def test_miles_parquet_mirror_alone_is_named(tmp_path: Path) -> None:
    (tmp_path / "rollout_data").mkdir()
    (tmp_path / "rollout_data" / "0.parquet").write_bytes(b"PAR1")
    r = invoke("import", "miles", tmp_path, tmp_path / "run")
    assert said(r, "miles' parquet mirrors are not read")


def test_slime_weight_versions_give_staleness(tmp_path: Path) -> None:
    """slime's per-sample ``weight_versions`` (one per engine call) become per-token policy versions:
    a sample's generated tokens get its oldest version, the step the newest, so mismatch reports
    the lag the way it does for an async AxRL run."""
    src = tmp_path / "dumps"
    src.mkdir()
    slime_dumps(src)
    dump = torch.load(src / "rollout_1.pt", weights_only=False)
    lags = [i % 3 for i in range(N)]                     # 0: fresh; 1: one version old; 2: two calls, 3 → 5
    for s, lag in zip(dump["samples"], lags):
        s["weight_versions"] = {0: ["5"], 1: ["4"], 2: ["3", "5"]}[lag]
    torch.save(dump, src / "rollout_1.pt")
    one_json(invoke("import", "slime", src, tmp_path / "run", "--num-experts", 32, "--json"))
    with StepFile(tmp_path / "run" / "trace" / "step_000001.h5") as sf:
        assert sf.attrs["policy_version"] == 5              # the newest version the step's samples saw
        offsets, mask = sf["/samples/offsets"][:], sf["/tokens/loss_mask"][:]
        tv = sf["/tokens/policy_version"][:]
        for i, lag in enumerate(lags):
            a, b = int(offsets[i]), int(offsets[i + 1])
            assert set(tv[a:b][mask[a:b] == 1].tolist()) == {5 - lag}
            assert set(tv[a:b][mask[a:b] == 0].tolist()) == {-1}
    m = one_json(invoke("mismatch", tmp_path / "run", "--step", 1, "--json"))
    counts = {int(r["bucket"]): r["count"] for r in m["breakdowns"]["version_lag"]}
    lag_of_token = np.repeat(lags, np.diff(offsets))[mask == 1]
    assert counts == {lag: int((lag_of_token == lag).sum()) for lag in (0, 1, 2)}
    assert m["per_step"][0]["version_lag_max"] == 2


def test_slime_malformed_dumps_are_named(tmp_path: Path) -> None:
    src = tmp_path / "dumps"
    src.mkdir()
    slime_dumps(src)
    d = torch.load(src / "rollout_1.pt", weights_only=False)
    del d["samples"][3]["rollout_log_probs"]
    torch.save(d, src / "rollout_1.pt")
    r = invoke("import", "slime", src, tmp_path / "run")
    assert said(r, "rollout_1.pt: samples[3]: missing field 'rollout_log_probs'")
    d["samples"][3]["rollout_log_probs"] = [0.0] * 3
    torch.save(d, src / "rollout_1.pt")
    r = invoke("import", "slime", src, tmp_path / "run2")
    assert said(r, "field 'rollout_log_probs' has shape (3,), expected (")
    r = invoke("import", "slime", src, tmp_path / "run3", "--num-experts", 16)    # the fixture's ids go to 31
    assert said(r, f"step 0 ({src / 'rollout_0.pt'}, {src / 'train_0_0.pt'}): Recorder.write_step: routing[0]: token")
    assert not (tmp_path / "run2").exists()      # step 0 was fine, step 1 not: no half-imported run left
    (tmp_path / "a_file").write_text("x")
    assert said(invoke("import", "slime", src, tmp_path / "a_file"), "a_file exists and is not a directory")
    assert said(invoke("import", "slime", src, tmp_path / "a_file" / "run"), "Not a directory: RUN must be a directory")
    assert (tmp_path / "a_file").read_text() == "x"


# ----------------------------------------------------------------------------- hostile pickles
class Payload:
    """A pickle whose loading would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickles_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    for name, save in (("rollout_0.pt", torch.save), ("rollout_1.pt", lambda o, p: pickle.dump(o, open(p, "wb")))):
        src = tmp_path / name.split(".")[0]
        src.mkdir()
        save({"rollout_id": 0, "samples": [{"tokens": [1, 2], "x": Payload(marker)}]}, src / name)
        r = invoke("import", "slime", src, tmp_path / f"run_{name}")
        assert said(r, f"{src / name}: refusing to load posix.system"), r.output
        assert not marker.exists()


def test_untrusted_class_needs_trust_pickle(tmp_path: Path) -> None:
    src = tmp_path / "dumps"
    src.mkdir()
    slime_dumps(src, extra={"metadata": {"weight": Fraction(1, 3)}})
    r = invoke("import", "slime", src, tmp_path / "run")
    assert said(r, "refusing to load fractions.Fraction")
    assert invoke("import", "slime", src, tmp_path / "run", "--trust-pickle").exit_code == 0


# ----------------------------------------------------------------------------- NeMo-RL
def nemo_dumps(root: Path) -> list[list[dict]]:
    """train_data_step{N}.jsonl: token_ids padded to the batch's longest, zeros where no logprob,
    the samples of a prompt consecutive."""
    rng = np.random.default_rng(2)
    steps = []
    for step in range(1, STEPS + 1):
        samples = [sample_arrays(rng) for _ in range(N)]
        for i, s in enumerate(samples):
            s["prompt"] = samples[i - i % GROUP]["prompt"]                # one prompt per group
            s["sample_mask"] = int(i != 3)                                # sample 3 left out of the loss
        width = max(len(s["prompt"]) + len(s["response"]) for s in samples)
        with open(root / f"train_data_step{step}.jsonl", "w") as fh:
            for s in samples:
                p, n = len(s["prompt"]), len(s["prompt"]) + len(s["response"])
                pad = lambda a: np.concatenate([np.zeros(p), a, np.zeros(width - n)]).tolist()  # noqa: E731
                fh.write(json.dumps({
                    "token_ids": np.concatenate([s["prompt"], s["response"], np.zeros(width - n, int)]).tolist(),
                    "input_lengths": n, "token_loss_mask": pad(s["mask"]),
                    "generation_logprobs": pad(s["rollout"].astype(np.float64)),
                    "prev_logprobs": pad(s["trainer"].astype(np.float64)),
                    "advantages": pad(s["advantage"].astype(np.float64)), "rewards": s["reward"],
                    "sample_loss_mask": s["sample_mask"], "content": "q … a"}) + "\n")
        steps.append(samples)
    return steps


@pytest.mark.parametrize("group_option", [(), ("--group-size", GROUP)])
def test_nemo_rl(tmp_path: Path, group_option: tuple) -> None:
    steps = nemo_dumps(tmp_path)
    report = one_json(invoke("import", "nemo-rl", tmp_path, tmp_path / "run", *group_option, "--json"))
    assert report["steps"] == [1, 2]
    summary, mismatch = analyse(tmp_path / "run")
    assert mismatch["metrics"]["mean_abs"] == pytest.approx(mean_abs([p for s in steps for p in loss_pairs(s)]), rel=1e-9)
    assert [r["mismatch"] for r in summary["steps"]] == pytest.approx([mean_abs(loss_pairs(s)) for s in steps], rel=1e-9)
    with StepFile(tmp_path / "run" / "trace" / "step_000002.h5") as sf:
        assert sf["/samples/group_id"].tolist() == [i // GROUP for i in range(N)]
        assert sf["/samples/prompt_len"][0] == len(steps[1][0]["prompt"])
        off = sf["/samples/offsets"]                  # sample_loss_mask 0: nothing of sample 3 trained
        assert sf["/tokens/loss_mask"][off[3]:off[4]].sum() == 0 and sf["/samples/prompt_len"][3] == len(steps[1][3]["prompt"])
        assert sf.num_tokens == sum(len(s["prompt"]) + len(s["response"]) for s in steps[1])   # padding trimmed


def test_nemo_rl_malformed(tmp_path: Path) -> None:
    nemo_dumps(tmp_path)
    path = tmp_path / "train_data_step2.jsonl"
    lines = path.read_text().splitlines()
    bad = json.loads(lines[5])
    del bad["prev_logprobs"]
    path.write_text("\n".join(lines[:5] + [json.dumps(bad)] + lines[6:]) + "\n")
    r = invoke("import", "nemo-rl", tmp_path, tmp_path / "run")
    assert said(r, "train_data_step2.jsonl:6: missing field 'prev_logprobs'")
    r = invoke("import", "nemo-rl", tmp_path / "train_data_step1.jsonl", tmp_path / "run1", "--group-size", 7)
    assert said(r, "do not split into groups of --group-size 7")


def test_nemo_rl_logger_layout_dynamic_sampling_and_two_experiments(tmp_path: Path) -> None:
    """NeMo-RL's ``Logger.log_batched_dict_as_jsonl`` (nemo_rl/utils/logger.py) walks the batch with
    ``make_microbatch_iterator(1)``: every field of a line is a batch of one (``[[...]]``, ``[0.5]``)
    plus ``idx``. With dynamic sampling ``rewards`` is the unfiltered list (longer, so trailing lines
    hold only it) and ``filtered_rewards`` the trained samples' rewards."""
    flat = tmp_path / "flat"
    flat.mkdir()
    steps = nemo_dumps(flat)
    src = tmp_path / "logs" / "exp_001"
    src.mkdir(parents=True)
    for step in (1, 2):
        lines = [json.loads(x) for x in (flat / f"train_data_step{step}.jsonl").read_text().splitlines()]
        out = []
        for i, obj in enumerate(lines):
            obj["filtered_rewards"], obj["rewards"] = obj["rewards"], -1.0      # the unfiltered one: not this sample's
            out.append({**{k: [v] for k, v in obj.items()}, "idx": i})
        out += [{"rewards": [0.0], "filtered_rewards": [], "input_lengths": [], "token_ids": [], "idx": len(out)}]
        (src / f"train_data_step{step}.jsonl").write_text("".join(json.dumps(o) + "\n" for o in out))
    report = one_json(invoke("import", "nemo-rl", src, tmp_path / "run", "--json"))
    assert report["steps"] == [1, 2] and report["samples"] == STEPS * N
    assert any("1 line(s) past the trained batch" in n for n in report["notes"])
    summary, mismatch = analyse(tmp_path / "run")
    assert mismatch["metrics"]["mean_abs"] == pytest.approx(mean_abs([p for s in steps for p in loss_pairs(s)]), rel=1e-9)
    assert [r["reward"] for r in summary["steps"]] == pytest.approx([np.mean([s["reward"] for s in st]) for st in steps])
    (tmp_path / "logs" / "exp_002").mkdir()
    (tmp_path / "logs" / "exp_002" / "train_data_step1.jsonl").write_text("{}\n")
    r = invoke("import", "nemo-rl", tmp_path / "logs", tmp_path / "run2")
    assert said(r, "two dumps of step 1") and said(r, "point SRC at one experiment's log directory")
    (src / "train_data_step1.jsonl").write_text(json.dumps({"content": ["q"], "rewards": [1.0], "idx": 0}) + "\n")
    r = invoke("import", "nemo-rl", src, tmp_path / "run3")
    assert said(r, "train_data_step1.jsonl:1: missing field 'token_ids'")


# ----------------------------------------------------------------------------- AxisRL
@pytest.fixture
def fake_packages(monkeypatch):
    """AxisRL's classes (its package is also named `axrl`): a snapshot object and the tensor-store
    handle of its R3 routing, importable only while the fixtures are saved; the batches are real
    `tensordict.TensorDict`s (tensordict 0.15 pickles them with `_make_td`)."""
    meta_mod, store_mod = types.ModuleType("axrl.axisrl_snapshot"), types.ModuleType("axrl.utils.tensor_store")

    class SnapshotMeta:
        def __init__(self, iteration: int) -> None:
            self.iteration = iteration

    @dataclasses.dataclass(frozen=True)
    class TensorHandle:            # AxisRL's: a reference into its Ray tensor store, and a row slice
        ref: str
        row_start: int = 0
        row_count: int = -1

    SnapshotMeta.__module__, SnapshotMeta.__qualname__ = "axrl.axisrl_snapshot", "SnapshotMeta"
    TensorHandle.__module__, TensorHandle.__qualname__ = "axrl.utils.tensor_store", "TensorHandle"
    meta_mod.SnapshotMeta, store_mod.TensorHandle = SnapshotMeta, TensorHandle
    for name, mod in (("axrl.axisrl_snapshot", meta_mod), ("axrl.utils", types.ModuleType("axrl.utils")),
                      ("axrl.utils.tensor_store", store_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    return TensorDict, SnapshotMeta, TensorHandle


def forget_snapshot_classes(monkeypatch) -> None:
    """After saving: AxisRL's classes gone, and any import of tensordict fails — the importer must
    rebuild both from the pickles without importing them."""
    for name in ("axrl.axisrl_snapshot", "axrl.utils", "axrl.utils.tensor_store"):
        monkeypatch.delitem(sys.modules, name)
    for name in [m for m in sys.modules if m == "tensordict" or m.startswith("tensordict.")]:
        monkeypatch.setitem(sys.modules, name, None)       # `import tensordict…` now raises ImportError


def axisrl_snapshots(root: Path, TensorDict, SnapshotMeta, TensorHandle, ranks: int = 2) -> list[list[dict]]:
    """spike_snapshots/iter_N/batch_rank{r}.pt: label-aligned [B, S] columns, right-padded, with R3
    routing as AxisRL saves it: per row one path of two tensor-store handles (the prompt's rows and
    the response's), their payloads in routing_payload_rank{r}.pt in first-seen order."""
    rng = np.random.default_rng(3)
    steps = []
    for it in (40, 41):
        samples = [sample_arrays(rng) for _ in range(N)]
        d = root / "spike_snapshots" / f"iter_{it}"
        d.mkdir(parents=True)
        for rank in range(ranks):
            rows = samples[rank::ranks]
            B, S = len(rows), max(len(s["prompt"]) + len(s["response"]) for s in rows)
            cols = {k: np.zeros((B, S), np.float32) for k in ("loss_mask", "rollout_logprobs", "old_logprobs", "advantage")}
            ids, labels, am = np.zeros((B, S), np.int64), np.full((B, S), -100, np.int64), np.zeros((B, S), np.int64)
            handles, payloads = [], []
            for b, s in enumerate(rows):
                p, n = len(s["prompt"]), len(s["prompt"]) + len(s["response"])
                ids[b, :n], am[b, :n] = np.concatenate([s["prompt"], s["response"]]), 1
                labels[b, p - 1:n - 1] = s["response"]                       # entry j predicts token j + 1
                for k, v in (("loss_mask", s["mask"]), ("rollout_logprobs", s["rollout"]),
                             ("old_logprobs", s["trainer"]), ("advantage", s["advantage"])):
                    cols[k][b, p - 1:n - 1] = v
                s["routing"] = rng.integers(0, 32, (n - 1, 4, 2)).astype(np.int16)
                ref = f"obj-{it}-{rank}-{b}"
                handles.append([[TensorHandle(ref, 0, p), TensorHandle(ref, p, n - 1 - p)]])
                payloads += [s["routing"][:p], s["routing"][p:]]
            td = TensorDict({"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                             "attention_mask": torch.from_numpy(am), "reward": torch.tensor([s["reward"] for s in rows]),
                             "group_ids": torch.tensor([(rank + ranks * b) // GROUP for b in range(B)]),
                             **{k: torch.from_numpy(v) for k, v in cols.items()}}, batch_size=[B])
            td.set_non_tensor("meta", SnapshotMeta(it))
            td.set_non_tensor("routing_handles_per_path", handles)
            torch.save(td, d / f"batch_rank{rank}.pt")
            torch.save(payloads, d / f"routing_payload_rank{rank}.pt")
        steps.append(samples)
    return steps


def test_axisrl(tmp_path: Path, fake_packages, monkeypatch) -> None:
    steps = axisrl_snapshots(tmp_path, *fake_packages)
    forget_snapshot_classes(monkeypatch)
    report = one_json(invoke("import", "axisrl", tmp_path / "spike_snapshots", tmp_path / "run", "--num-experts", 32,
                             "--json"))
    assert report["steps"] == [40, 41] and report["samples"] == STEPS * N and report["notes"] == []
    summary, mismatch = analyse(tmp_path / "run")
    assert mismatch["metrics"]["mean_abs"] == pytest.approx(mean_abs([p for s in steps for p in loss_pairs(s)]), rel=1e-9)
    assert [r["mismatch"] for r in summary["steps"]] == pytest.approx([mean_abs(loss_pairs(s)) for s in steps], rel=1e-9)
    with StepFile(tmp_path / "run" / "trace" / "step_000040.h5") as sf:
        s0 = steps[0][0]                      # rank 0's first row: the run's first sample
        p, n = len(s0["prompt"]), len(s0["prompt"]) + len(s0["response"])
        assert sf["/samples/prompt_len"][0] == p and int(sf["/samples/offsets"][1]) == n
        gen = sf["/tokens/rollout_logprob"][p:n]   # shifted onto the generated tokens' own positions
        assert np.array_equal(gen[s0["mask"] == 1], s0["rollout"][s0["mask"] == 1])
        assert sf["/tokens/loss_mask"][p:n].tolist() == s0["mask"].tolist()
        s1 = steps[0][2]                      # rank 0's second row: the run's second sample
        assert np.array_equal(sf["/routing/rollout"][:n - 1], s0["routing"])      # per token as input
        assert sf["/routing/rollout_valid"][n - 1] == 0                             # the last token: never fed
        m = len(s1["prompt"]) + len(s1["response"])
        assert np.array_equal(sf["/routing/rollout"][n:n + m - 1], s1["routing"])


def two_row_snapshot(d: Path, handles: list, payloads: int) -> Path:
    """An iter_N directory: one rank, two 6-token rows, routing handles and ``payloads`` arrays."""
    d.mkdir()
    ids = torch.arange(12).reshape(2, 6)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    cols = {k: torch.zeros(2, 6) for k in ("loss_mask", "rollout_logprobs", "old_logprobs", "advantage")}
    td = TensorDict({"input_ids": ids, "labels": labels, "reward": torch.zeros(2), **cols}, batch_size=[2])
    td.set_non_tensor("routing_handles_per_path", handles)
    torch.save(td, d / "batch_rank0.pt")
    torch.save([np.zeros((5, 2, 2), np.int16)] * payloads, d / "routing_payload_rank0.pt")
    return d


def test_axisrl_merged_rows_leave_routing_out(tmp_path: Path, fake_packages, monkeypatch) -> None:
    """A row merged from several paths (AxisRL's prefix trie) needs AxisRL's merge map, which the
    importer does not read: the step imports without routing and the report says why."""
    _, _, Handle = fake_packages
    d = two_row_snapshot(tmp_path / "iter_7", [[[Handle("a")], [Handle("b")]], [[Handle("c")]]], payloads=3)
    forget_snapshot_classes(monkeypatch)
    report = one_json(invoke("import", "axisrl", d, tmp_path / "run", "--json"))
    assert report["samples"] == 2 and "merged from several paths" in report["notes"][0]
    with StepFile(tmp_path / "run" / "trace" / "step_000007.h5") as sf:
        assert "/routing/rollout" not in sf


def test_axisrl_routing_payload_count_is_checked(tmp_path: Path, fake_packages, monkeypatch) -> None:
    _, _, Handle = fake_packages
    d = two_row_snapshot(tmp_path / "iter_8", [[[Handle("a")]], [[Handle("b")]]], payloads=1)
    forget_snapshot_classes(monkeypatch)
    r = invoke("import", "axisrl", d, tmp_path / "run")
    assert said(r, "routing_payload_rank0.pt: expected a list of 2 routing arrays")


def test_axisrl_misaligned_labels(tmp_path: Path, fake_packages, monkeypatch) -> None:
    TensorDict, Meta, _ = fake_packages
    d = tmp_path / "iter_3"
    d.mkdir()
    ids = torch.arange(12).reshape(2, 6)
    cols = {k: torch.zeros(2, 6) for k in ("loss_mask", "rollout_logprobs", "old_logprobs", "advantage")}
    torch.save(TensorDict({"input_ids": ids, "labels": ids.clone(), "reward": torch.zeros(2), **cols}, batch_size=[2]),
               d / "batch_rank0.pt")
    r = invoke("import", "axisrl", d, tmp_path / "run")
    assert said(r, "row 0: labels[0] = 0 is not input_ids[1] = 1")


def test_axisrl_uuid_groups_and_left_padding(tmp_path: Path, fake_packages, monkeypatch) -> None:
    """``uid`` as verl-style trainers keep it (a non-tensor list of prompt uuids, shared across
    ranks) groups the rows; a left-padded row is refused rather than trimmed at the wrong end."""
    TensorDict = fake_packages[0]
    ids = torch.arange(24).reshape(4, 6)
    labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1)
    cols = {k: torch.zeros(4, 6) for k in ("loss_mask", "rollout_logprobs", "old_logprobs", "advantage")}
    for rank, uids in enumerate((["u-b", "u-a", "u-b", "u-c"], ["u-a", "u-c", "u-d", "u-d"])):
        d = tmp_path / "spike_snapshots" / "iter_5"
        d.mkdir(parents=True, exist_ok=True)
        td = TensorDict({"input_ids": ids, "labels": labels, "reward": torch.zeros(4), **cols}, batch_size=[4])
        td.set_non_tensor("uid", uids)
        torch.save(td, d / f"batch_rank{rank}.pt")
    forget_snapshot_classes(monkeypatch)
    one_json(invoke("import", "axisrl", tmp_path / "spike_snapshots", tmp_path / "run", "--json"))
    with StepFile(tmp_path / "run" / "trace" / "step_000005.h5") as sf:
        assert sf["/samples/group_id"][:].tolist() == [0, 1, 0, 2, 1, 2, 3, 3]
    monkeypatch.undo()                                     # tensordict importable again, to save the next fixture
    am = torch.ones(4, 6, dtype=torch.long)
    am[2, :2] = 0                                          # row 2 padded on the left
    d = tmp_path / "iter_6"
    d.mkdir()
    torch.save(TensorDict({"input_ids": ids, "labels": labels, "reward": torch.zeros(4), "attention_mask": am,
                           **cols}, batch_size=[4]), d / "batch_rank0.pt")
    r = invoke("import", "axisrl", d, tmp_path / "run2")
    assert said(r, "batch_rank0.pt: row 2: attention_mask is not ones then zeros (right padding)")
    other = tmp_path / "other_run" / "spike_snapshots" / "iter_5"        # a second run's snapshot of iteration 5
    other.mkdir(parents=True)
    (other / "batch_rank0.pt").write_bytes((tmp_path / "spike_snapshots" / "iter_5" / "batch_rank0.pt").read_bytes())
    (tmp_path / "iter_6" / "batch_rank0.pt").unlink()
    r = invoke("import", "axisrl", tmp_path, tmp_path / "run3")
    assert said(r, "two dumps of step 5:") and said(r, "point SRC at one run's dumps")
    assert not (tmp_path / "run3").exists()


def test_miles_missing_context_parallel_rank(tmp_path: Path) -> None:
    slime_dumps(tmp_path, miles=True)
    for rank in (2, 3):                       # DP shard 0's cp_rank 1 (both of its TP copies)
        (tmp_path / f"1_{rank}.pt").unlink()
    r = invoke("import", "miles", tmp_path, tmp_path / "run")
    assert said(r, "context-parallel ranks [1] of 2 missing")


def test_slime_rollout_dump_defaults_and_dict_rewards(tmp_path: Path) -> None:
    """slime dumps a rollout before filling in defaults (THUDM/slime ``slime/ray/rollout.py``:
    ``_save_debug_rollout_data`` runs before ``_convert_samples_to_train_data`` sets ``loss_mask``
    to all ones): a single-turn run's samples hold ``loss_mask`` None, a rollout without logprobs
    ``rollout_log_probs`` None, and with ``--reward-key`` the reward is a dict."""
    src = tmp_path / "dumps"
    src.mkdir()
    steps = slime_dumps(src)
    d = torch.load(src / "rollout_1.pt", weights_only=False)
    for s in d["samples"]:
        s["loss_mask"] = None
        s["reward"] = {"acc": s["reward"], "format": 1.0}
    d["samples"][0]["rollout_log_probs"] = None
    d["samples"][5]["remove_sample"] = True                  # slime zeroes its loss mask: not trained
    d["samples"][5]["reward"] = None                         # and does not score it
    torch.save(d, src / "rollout_1.pt")
    r = invoke("import", "slime", src, tmp_path / "run")
    assert said(r, "rollout_1.pt: samples[0]: field 'reward' is a dict (keys ['acc', 'format']): pass --reward-key")
    report = one_json(invoke("import", "slime", src, tmp_path / "run", "--reward-key", "acc", "--json"))
    assert any("1 of 128 samples have rollout_log_probs None" in n for n in report["notes"])
    summary = one_json(invoke("summary", tmp_path / "run", "--json"))
    assert summary["steps"][1]["reward"] == pytest.approx(np.mean([s["reward"] for i, s in enumerate(steps[1]) if i != 5]))
    with StepFile(tmp_path / "run" / "trace" / "step_000001.h5") as sf:
        offsets, mask = sf["/samples/offsets"][:], sf["/tokens/loss_mask"][:]
        rollout = sf["/tokens/rollout_logprob"][:]
        assert np.isnan(sf["/samples/reward"][5])
        for i, s in enumerate(steps[1][:4]):
            a, p, b = int(offsets[i]), int(offsets[i]) + len(s["prompt"]), int(offsets[i + 1])
            assert mask[a:p].sum() == 0 and mask[p:b].all()      # None: every response token trained
        assert np.isnan(rollout[offsets[0]:offsets[1]]).all()    # no rollout logprobs: NaN, not 0
        assert mask[offsets[5]:offsets[6]].sum() == 0
        assert np.array_equal(rollout[p:b], steps[1][3]["rollout"].astype(np.float32))


def test_the_rollout_dtype_stated_at_import_sizes_doctors_envelope(tmp_path: Path) -> None:
    """slime dumps carry no precision: unstated, doctor assumes fp32 and says so; `--rollout-dtype bf16`
    goes to config.yaml and the envelope is bf16's. A dtype it cannot state is refused, naming the flag."""
    src = tmp_path / "dumps"
    src.mkdir()
    slime_dumps(src)
    one_json(invoke("import", "slime", src, tmp_path / "plain", "--num-experts", 32, "--json"))
    assert not (tmp_path / "plain" / "config.yaml").exists()
    plain = invoke("doctor", tmp_path / "plain", "--no-reexec")
    assert "states no rollout precision" in "".join(plain.output.split("\n")), plain.output
    one_json(invoke("import", "slime", src, tmp_path / "bf16", "--num-experts", 32, "--rollout-dtype", "bf16",
                    "--model-dtype", "torch.float32", "--json"))
    config = yaml.safe_load((tmp_path / "bf16" / "config.yaml").read_text())
    assert config == {"rollout": {"dtype": "bfloat16"}, "model": {"dtype": "float32"}}
    stated = one_json(invoke("doctor", tmp_path / "bf16", "--no-reexec", "--json"))
    assert stated["envelope"]["precision"] == "bfloat16" and stated["envelope"]["calibration"]["precision_stated"]
    bad = invoke("import", "slime", src, tmp_path / "bad", "--rollout-dtype", "int4")
    assert said(bad, "--rollout-dtype: 'int4'") and not (tmp_path / "bad").exists()
