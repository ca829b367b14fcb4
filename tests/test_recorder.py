"""`axrl.trace.Recorder`: a run written from plain numpy arrays is a run every `axrl-debug`
analysis reads (summary, mismatch, spikes, golden/check, the TUI's data), with the numbers an
independent computation from the arrays gives; bad inputs are named with the shape expected;
replay says why it cannot re-execute such a run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from axrl.trace import Recorder, RecorderError, StepFile, TraceReader
from axrl.trace import schema as S
from axrl_debug.cli import app

N, PROMPT, STEPS = 48, 12, 3


def arrays(step: int, n: int = N, seed: int = 0) -> dict:
    """One step's per-sample inputs: response-only masks/logprobs (tool spans masked out)."""
    rng = np.random.default_rng(seed + step)
    lengths = rng.integers(20, 60, n)
    out: dict = {k: [] for k in ("token_ids", "loss_mask", "rollout_logprobs", "trainer_logprobs")}
    for length in lengths:
        out["token_ids"].append(rng.integers(0, 30000, PROMPT + length))
        mask = np.ones(length, np.uint8)
        mask[length // 2: length // 2 + 3] = 0                       # a tool span
        rollout = np.where(mask == 1, -rng.exponential(0.5, length), 0.0)
        out["loss_mask"].append(mask)
        out["rollout_logprobs"].append(rollout)
        out["trainer_logprobs"].append(np.where(mask == 1, rollout + rng.normal(0, 0.02, length), 0.0))
    out.update(prompt_lens=[PROMPT] * n, rewards=rng.random(n), advantages=list(rng.normal(size=n)),
               group_ids=np.arange(n) // 8)
    return out


def expected_mismatch(steps: list[dict]) -> float:
    """Mean |trainer − rollout| over loss tokens, straight from the inputs (float32 as stored)."""
    deltas = [np.abs(np.float32(t).astype(np.float64) - np.float32(r).astype(np.float64))[np.asarray(m) == 1]
              for a in steps for r, t, m in zip(a["rollout_logprobs"], a["trainer_logprobs"], a["loss_mask"])]
    return float(np.concatenate(deltas).mean())


def invoke(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, list[dict]]:
    run = tmp_path_factory.mktemp("rec") / "run"
    rec = Recorder(run, engine="sglang", backend="megatron", model="Qwen/Qwen3-30B-A3B",
                   source={"note": "test"}, config={"algo": {"tis_cap": 2.0}})
    steps = [arrays(s) for s in range(STEPS)]
    for s, a in enumerate(steps):
        rec.write_step(s, nan_off_mask=True, metrics={"entropy": 0.5}, **a)
    return run, steps


def test_step_files_follow_the_schema(recorded) -> None:
    run, steps = recorded
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["engine"] == "sglang" and manifest["model"] == "Qwen/Qwen3-30B-A3B"
    assert manifest["source"] == {"writer": "axrl.trace.Recorder", "note": "test"}
    assert TraceReader(run).steps == list(range(STEPS)) and not TraceReader(run).problems
    with StepFile(run / "trace" / "step_000001.h5") as sf:
        for spec in S.DATASETS:
            if spec.required:
                assert spec.path in sf, spec.path
                if spec.np_dtype is not None:
                    assert sf[spec.path].dtype == spec.np_dtype, spec.path
        a = steps[1]
        n0 = len(a["token_ids"][0])
        assert sf.num_samples == N and sf["/samples/prompt_len"][0] == PROMPT
        assert sf["/tokens/ids"][:n0].tolist() == a["token_ids"][0].tolist()
        rollout, lm = sf["/tokens/rollout_logprob"], sf["/tokens/loss_mask"]
        assert np.isnan(rollout[:PROMPT]).all() and np.isnan(rollout[lm == 0]).all()   # prompt, tool span
        assert np.isnan(sf["/tokens/old_logprob"][lm == 0]).all()                       # zero fillers → NaN
        assert sf["/train/updates/loss"].size == 0        # no optimizer facts: no update rows, not invented
        assert sf["/tokens/policy_version"][lm == 1].tolist() == [1] * int(lm.sum())


def test_summary_and_mismatch_match_the_arrays(recorded) -> None:
    run, steps = recorded
    summary = one_json(invoke("summary", run, "--json"))
    mismatch = one_json(invoke("mismatch", run, "--json"))
    assert mismatch["metrics"]["mean_abs"] == pytest.approx(expected_mismatch(steps), rel=1e-9)
    generated = sum(int(np.sum(m)) for a in steps for m in a["loss_mask"])
    assert mismatch["tokens"]["analysed"] == mismatch["tokens"]["generated"] == generated
    for row, a in zip(summary["steps"], steps):
        assert row["mismatch"] == pytest.approx(expected_mismatch([a]), rel=1e-9)
        assert row["reward"] == pytest.approx(float(np.mean(a["rewards"])))
        assert row["samples"] == N and row["loss"] is None


def test_spikes_check_and_tui_read_it(recorded, tmp_path) -> None:
    run, steps = recorded
    assert one_json(invoke("spikes", run, "--json"))["spikes"] == []
    golden = tmp_path / "golden.json"
    assert invoke("golden", run, "-o", golden).exit_code == 0
    assert invoke("check", run, "--golden", golden).exit_code == 0
    from axrl_debug.tui.data import RunModel

    model = RunModel(run)
    model.scan(model.steps)
    assert model.rows[2]["mismatch"] == pytest.approx(expected_mismatch([steps[2]]), rel=1e-6)
    step = model.step(0)
    assert step.generated.tolist() == [int(np.sum(m)) for m in steps[0]["loss_mask"]]
    assert step.sample(0).n == len(steps[0]["token_ids"][0])


def test_replay_says_what_it_cannot_do(recorded) -> None:
    run, _ = recorded
    for command in (("replay",), ("replay", "--rollout"), ("replay", "--rollout", "--engine", "embedded"),
                    ("explain",)):
        r = invoke(command[0], run, "--step", 0, *command[1:])
        assert r.exit_code == 2
        text = " ".join(r.output.split())
        assert "axrl.trace.Recorder" in text and "checkpoints" in text and "not trained by `axrl train`" in text


def test_routing_and_teacher_columns(tmp_path) -> None:
    a = arrays(0, n=4)
    lengths = [len(t) for t in a["token_ids"]]
    routing = [np.random.default_rng(i).integers(0, 64, (n - 1, 3, 2)) for i, n in enumerate(lengths)]
    rec = Recorder(tmp_path / "run", engine="sglang", backend="megatron")
    rec.write_step(0, routing=routing, num_experts=64, teacher_logprobs=a["trainer_logprobs"], **a)
    with StepFile(tmp_path / "run" / "trace" / "step_000000.h5") as sf:
        valid = sf["/routing/rollout_valid"]
        ends = np.cumsum(lengths) - 1
        assert valid[ends].tolist() == [0] * 4 and int(valid.sum()) == sum(lengths) - 4
        assert sf["/routing/rollout"][:lengths[0] - 1].tolist() == routing[0].tolist()
        assert "/routing/train" not in sf and "/tokens/teacher_logprob" in sf


@pytest.mark.parametrize("change, needle", [
    (lambda a: a["rollout_logprobs"].__setitem__(3, np.zeros(5)), "rollout_logprobs[3]: shape (5,), expected ("),
    (lambda a: a.__setitem__("group_ids", [0, 1]), "group_ids: shape (2,), expected (48,)"),
    (lambda a: a.__setitem__("prompt_lens", None), "loss_mask[0]: shape"),
    (lambda a: a["token_ids"].__setitem__(0, np.zeros((2, 3), np.int64)), "token_ids[0]: shape (2, 3)"),
    (lambda a: a.__setitem__("trainer_logprobs", a["trainer_logprobs"][:-1]), "trainer_logprobs: expected one array per sample (N=48), got 47"),
    (lambda a: a["token_ids"][2].__setitem__(5, -100), "token_ids[2]: token 5 is -100: ids are >= 0"),
    (lambda a: a.__setitem__("group_ids", np.arange(48) / 5), "group_ids: sample 1: 0.2 is not an integer"),
    (lambda a: a["token_ids"].__setitem__(1, [1, [2, 3]]), "token_ids[1]: not a numeric array"),
    (lambda a: a.__setitem__("trainer_logprobs", [-t for t in a["trainer_logprobs"]]),    # NLL, not log p
     "trainer_logprobs: the median over the loss tokens is"),
])
def test_bad_inputs_name_the_field_and_shape(tmp_path, change, needle) -> None:
    a = arrays(0)
    change(a)
    rec = Recorder(tmp_path / "run", engine=None, backend=None)
    with pytest.raises(RecorderError) as e:
        rec.write_step(0, **a)
    assert needle in str(e.value)
    assert not list((tmp_path / "run" / "trace").iterdir())


def test_bad_routing_and_existing_dir(tmp_path) -> None:
    a = arrays(0, n=2)
    rec = Recorder(tmp_path / "run", engine=None, backend=None)
    with pytest.raises(RecorderError, match=r"routing\[1\]: shape \(3, 2\), expected"):
        rec.write_step(0, routing=[np.zeros((len(a["token_ids"][0]), 2, 2), int), np.zeros((3, 2))],
                       num_experts=8, **a)
    routing = [np.zeros((len(t), 2, 2), np.int32) for t in a["token_ids"]]
    routing[1][7, 1, 0] = 300                                     # an id the given expert count does not have
    with pytest.raises(RecorderError, match=r"routing\[1\]: token 7: expert ids \[0, 0, 300, 0\] outside "
                                            r"\[0, num_experts=256\): give the model's expert count"):
        rec.write_step(0, routing=routing, num_experts=256, **a)
    with pytest.raises(RecorderError, match=r"step 1.5 is not an int >= 0"):
        rec.write_step(1.5, **a)                                   # int() would have made it step 1
    with pytest.raises(FileExistsError, match="not empty"):
        Recorder(tmp_path / "run", engine=None, backend=None)


def test_update_metrics_and_overwrite(tmp_path) -> None:
    a = arrays(0, n=8)
    rec = Recorder(tmp_path / "run", engine=None, backend=None)
    with pytest.raises(RecorderError, match="which samples each of several updates trained on is not known"):
        rec.write_step(0, update_metrics={"loss": [0.5, 0.4], "grad_norm": [1.0, 2.0], "lr": [1e-6, 1e-6]}, **a)
    rec.write_step(0, update_metrics={"loss": [0.5], "grad_norm": [1.5], "lr": [1e-6]}, **a)
    row = one_json(invoke("summary", tmp_path / "run", "--json"))["steps"][0]
    assert row["loss"] == 0.5 and row["grad_norm"] == 1.5
    with StepFile(tmp_path / "run" / "trace" / "step_000000.h5") as sf:
        assert sf["/train/update_samples"].tolist() == list(range(8))
    import torch                                   # the scalars as a training loop holds them; lr not known
    rec.write_step(1, update_metrics={"loss": torch.tensor(0.25), "grad_norm": [np.float32(3.0)]}, **arrays(1, n=8))
    summary = one_json(invoke("summary", tmp_path / "run", "--json"))
    assert summary["steps"][1]["loss"] == 0.25 and summary["steps"][1]["grad_norm"] == 3.0
    assert summary["rollout_precision"] == {"weight_dtype": None, "kv_dtype": None, "precision": None}  # not known
    with StepFile(tmp_path / "run" / "trace" / "step_000001.h5") as sf:
        assert np.isnan(sf["/train/updates/lr"][:]).all()
    again = Recorder(tmp_path / "run", engine=None, backend=None, overwrite=True)
    assert TraceReader(again.path).steps == [] and not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_torch_tensors_none_entries_and_a_step_written_twice(tmp_path) -> None:
    """What a trainer hands over as it is: bf16/fp16 torch tensors (numpy has no bfloat16), logprob
    lists with None for "not known" (vLLM's first prompt token); a step written twice is refused
    naming the step, and the first write stays."""
    import torch
    a = arrays(0, n=8)
    bf16 = [torch.tensor(r).bfloat16() for r in a["rollout_logprobs"]]
    a["rollout_logprobs"] = bf16
    a["trainer_logprobs"] = [torch.tensor(t).half() for t in a["trainer_logprobs"]]
    a["token_ids"] = [torch.tensor(t) for t in a["token_ids"]]
    a["rewards"] = [torch.tensor(r).bfloat16() for r in a["rewards"]]      # a list of 0-d tensors
    full = [None] * PROMPT + [float(x) for x in a["trainer_logprobs"][0].float()]
    a["trainer_logprobs"][0] = full                                  # full length, None over the prompt
    rec = Recorder(tmp_path / "run", engine=None, backend=None)
    rec.write_step(0, **a)
    with StepFile(tmp_path / "run" / "trace" / "step_000000.h5") as sf:
        off, mask = sf["/samples/offsets"][:], sf["/tokens/loss_mask"][:]
        rollout, old = sf["/tokens/rollout_logprob"][:], sf["/tokens/old_logprob"][:]
        stored = rollout[off[1] + PROMPT:off[2]][mask[off[1] + PROMPT:off[2]] == 1]
        want = bf16[1].float().numpy()[a["loss_mask"][1] == 1]
        assert np.array_equal(stored, want)                           # bf16 values, exactly
        assert np.isnan(old[:PROMPT]).all() and np.isfinite(old[PROMPT:off[1]]).all()
    before = (tmp_path / "run" / "trace" / "step_000000.h5").read_bytes()
    with pytest.raises(RecorderError, match=r"step 0 is already in .*step_000000.h5.*written once"):
        rec.write_step(0, **arrays(1, n=8))
    assert (tmp_path / "run" / "trace" / "step_000000.h5").read_bytes() == before
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1
