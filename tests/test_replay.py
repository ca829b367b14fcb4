"""Deterministic re-execution (`replay/`, `axrl-debug replay`) against a real recorded run.

One short run is recorded once per module (echo task on the micro MoE, a warm-up long enough
that rewards vary, so every update has a real gradient; several micro-batches per update). It
carries two injected faults: a 30× learning-rate jump at step 1 (replay must honour it from
config.yaml) and noisy rollout logprobs at step 3 (large train/inference ratios for TIS what-ifs).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from axrl.cli import app as axrl_app
from axrl.config import load_config
from axrl_debug.cli import app as debug_app
from replay import load_recorded_step, read_dump
from axrl.algo.processor import update_splits
from replay.whatif import recompute_advantages

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
BASE_LR = 1e-4
RUN_SETTINGS = [
    "steps=4", "model.preset=micro-moe", "warmup.steps=100", "data.task=echo", "data.task_args={}",
    "data.prompts_per_step=2", "rollout.group_size=8", "checkpoint.every=2", "eval.every=0",
    "runtime.threads=1", f"train.lr={BASE_LR}", "train.micro_batch_tokens=120", "algo.loss_agg=token-mean",
    "faults.lr_scale={step: 1, factor: 30}", "faults.rollout_logprob_noise={step: 3, std: 1.0}",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "run"
    args = ["train", str(QUICKSTART), "--run-dir", str(path)]
    for s in RUN_SETTINGS:
        args += ["--set", s]
    result = CliRunner().invoke(axrl_app, args)
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture
def copy(run, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def replay_cli(*args: str):
    return CliRunner().invoke(debug_app, ["replay", *map(str, args)])


def replay_json(*args: str) -> tuple[int, dict]:
    result = replay_cli(*args, "--json")
    assert result.stdout.strip(), result.output
    return result.exit_code, json.loads(result.stdout)


def step_file(run: Path, step: int) -> Path:
    return run / "trace" / f"step_{step:06d}.h5"


# ---------------------------------------------------------------------------- bitwise re-execution
def test_every_step_replays_bitwise(run):
    # The run is worth replaying: real gradients in most updates, several micro-batches per update.
    norms = []
    for step in range(4):
        with h5py.File(step_file(run, step)) as f:
            norms += list(f["train/updates/grad_norm"][:])
            assert f["train/micro_batches/loss"].shape[0] > f["train/updates/loss"].shape[0]
    assert sum(n > 0 for n in norms) >= 6
    for step in range(4):
        code, doc = replay_json(run, "--step", step)
        assert code == 0, doc["first_divergence"]
        assert doc["verdict"] == "bitwise-equal" and doc["first_divergence"] is None
        assert doc["checkpoint_step"] == (0 if step < 2 else 2)
        assert doc["replayed_steps"] == list(range(doc["checkpoint_step"], step + 1))
        target = doc["steps"][-1]
        assert target["fingerprint_after"]["equal"] and target["mismatches"] == []
        for u in target["updates"]:
            assert u["loss"]["equal"] and u["grad_norm"]["equal"] and u["fingerprint_after"]["equal"]
            assert u["loss"]["recorded"] == u["loss"]["replayed"]
            assert all(mb["loss"]["equal"] for mb in u["micro_batches"])
        # The injected learning-rate jump comes from config.yaml and is re-applied.
        lr = 30 * BASE_LR if step == 1 else BASE_LR
        assert all(u["lr"]["replayed"] == pytest.approx(lr) for u in target["updates"])


def test_human_output_says_bitwise_equal(run):
    result = replay_cli(run, "--step", 1)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "bitwise-equal" in text and "re-ran step(s) 0 first" in text and "grad_norm" in text


def test_batches_are_rebuilt_exactly(run):
    """The recorded composition rules hold: update splits and advantages recompute bit for bit."""
    cfg = load_config(run / "config.yaml")
    for step in range(4):
        rec = load_recorded_step(step_file(run, step), cfg)
        assert update_splits(rec.group_ids, cfg.train.updates_per_step) == rec.splits
        assert recompute_advantages(rec, cfg).numpy().tobytes() == rec.batch.advantages.numpy().tobytes()


# ---------------------------------------------------------------------------- divergence
def _alter_advantage(path: Path, update: int, sample_in_update: int) -> int:
    """Change one loss token's advantage; returns the sample row altered."""
    with h5py.File(path, "r+") as f:
        adv = f["tokens/advantage"][:]
        mask = f["tokens/loss_mask"][:]
        us, uo, off = f["train/update_samples"][:], f["train/updates/sample_offsets"][:], f["samples/offsets"][:]
        row = int(us[uo[update] + sample_in_update])
        t = [i for i in range(off[row], off[row + 1]) if mask[i]][1]
        adv[t] = adv[t] + 0.5
        f["tokens/advantage"][:] = adv
    return row


def test_altered_number_is_reported_at_its_step(copy):
    _alter_advantage(step_file(copy, 2), update=1, sample_in_update=0)
    code, doc = replay_json(copy, "--step", 2)
    assert code == 1 and doc["verdict"] == "diverged"
    first = doc["first_divergence"]
    assert (first["step"], first["update"], first["micro_batch"], first["quantity"]) == (2, 1, 0, "micro_batch.loss")
    assert first["abs_diff"] > 0 and first["rel_diff"] > 0 and first["recorded"] != first["replayed"]
    # Update 0 did not touch the altered sample: it still matches bit for bit.
    assert doc["steps"][-1]["updates"][0]["loss"]["equal"]
    # Replaying step 3 re-runs step 2 to rebuild the state: the divergence is reported there too.
    code, doc = replay_json(copy, "--step", 3)
    assert code == 1 and doc["first_divergence"]["step"] == 2
    assert any(m["quantity"] == "weights_fingerprint_before" and m["step"] == 3 for m in doc["steps"][-1]["mismatches"])
    result = replay_cli(copy, "--step", 2)
    assert result.exit_code == 1 and "DIVERGED at step 2, update 1, micro-batch 0" in " ".join(result.stdout.split())


def test_replay_honours_faults_from_config(copy):
    """Without the lr fault in config.yaml, step 1 re-executes with the wrong learning rate."""
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["faults"]["lr_scale"] = None
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    code, doc = replay_json(copy, "--step", 1)
    first = doc["first_divergence"]
    assert code == 1 and (first["step"], first["update"], first["quantity"]) == (1, 0, "lr")
    assert first["recorded"] == pytest.approx(30 * first["replayed"])


def test_damaged_checkpoint_falls_back_to_an_older_one(copy):
    weights = copy / "checkpoints" / "step_000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code, doc = replay_json(copy, "--step", 3)
    assert code == 0 and doc["checkpoint_step"] == 0 and doc["replayed_steps"] == [0, 1, 2, 3]
    assert any("step_000002" in w and "unusable" in w for w in doc["warnings"])


# ---------------------------------------------------------------------------- bad input
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_chunk(path: Path) -> None:
    """Flip bytes inside a compressed, checksummed chunk: the file still opens, reading fails."""
    with h5py.File(path, "r") as f:
        info = f["tokens/advantage"].id.get_chunk_info(0)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        chunk = fh.read(8)
        fh.seek(info.byte_offset + info.size // 2)
        fh.write(bytes(b ^ 0xFF for b in chunk))


@pytest.mark.parametrize("damage,step,needle,nearest", [
    (None, 9, "step 9 is not in the trace", 3),
    (None, -1, "step -1 is not in the trace", 0),
    (lambda run: shutil.rmtree(run / "checkpoints" / "step_000000"), 1, "no checkpoint at or before step 1", 2),
    (lambda run: _truncate(step_file(run, 1)), 1, "step 1's file is damaged", 0),
    (lambda run: _corrupt_chunk(step_file(run, 3)), 3, "step 3's file is damaged", 2),
    (lambda run: step_file(run, 0).unlink(), 1, "step 0 (between checkpoint 0 and step 1) is missing", 2),
])
def test_bad_input_names_the_nearest_usable_step(copy, damage, step, needle, nearest):
    if damage is not None:
        damage(copy)
    result = replay_cli(copy, "--step", step)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert needle in text and f"nearest usable step: {nearest}" in text


def test_damaged_target_is_found_before_any_step_is_rerun(copy):
    _corrupt_chunk(step_file(copy, 3))
    result = replay_cli(copy, "--step", 3)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "step 3's file is damaged" in text and "tokens/advantage" in text
    assert "re-running step" not in text and "re-executing" not in text


def test_damaged_step_before_the_target_is_found_before_any_step_is_rerun(copy):
    _corrupt_chunk(step_file(copy, 2))        # replaying 3 starts from checkpoint 2: step 2 is re-run first
    result = replay_cli(copy, "--step", 3)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "step 2 (between checkpoint 2 and step 3) is damaged" in text
    assert "re-running step" not in text and "nearest usable step: 1" in text


@pytest.mark.parametrize("args,needle", [
    (["--set", "data.prompts_per_step=3"], "cannot be varied in a replay"),
    (["--set", "algo.tis_cap=-1"], "algo.tis_cap"),
    (["--set", "replay.drop_top_k=lots"], "replay.drop_top_k"),
    (["--set", "train.dtype=bfloat16"], "use replay.dtype"),
])
def test_bad_what_if_is_bad_input(run, args, needle):
    result = replay_cli(run, "--step", 0, *args)
    assert result.exit_code == 2 and needle in " ".join(result.output.split())


def test_missing_run_is_bad_input(tmp_path):
    result = replay_cli(tmp_path / "nope", "--step", 0)
    assert result.exit_code == 2 and "not found" in result.output


def test_environment_differences_are_warned(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["threads"] = 4
    manifest["versions"]["torch"] = "1.0.0"
    manifest["host"] = "elsewhere"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, doc = replay_json(copy, "--step", 0)
    text = " ".join(doc["warnings"])
    assert "torch threads differ: recorded 4, now 1" in text and "torch version differs" in text
    assert "host differs" in text and "same torch thread count" in doc["requirements"]
    assert code == 0  # same machine in truth: still bitwise


# ---------------------------------------------------------------------------- dump and what-if
def test_dump_and_tis_what_if_follow_the_formula(copy):
    """Step 3's rollout logprobs carry noise, so TIS weights exp(old − rollout) are far from 1.
    For update 0 (weights = the state before the step, no clipping) the token-mean loss is
    −Σ A_t ρ_t w_t / M with w_t = min(exp(old_t − rollout_t), cap), and w_t = 1 without TIS."""
    code, doc = replay_json(copy, "--step", 3, "--dump", "--set", "algo.tis=false",
                            "--variant", "algo.tis_cap=5", "--variant", "replay.drop_top_k=5",
                            "--variant", "r3=true")
    assert code == 0 and doc["dump"] == str(copy / "replay" / "step_000003.h5")
    base, tis_off, cap5, dropped, r3 = [doc["baseline"]] + [v["updates"] for v in doc["variants"]]
    assert base[0]["tis_capped_frac"] > 0.1  # a step with large ratios

    d = read_dump(doc["dump"])
    with h5py.File(step_file(copy, 3)) as f:
        adv, old, roll = (f[f"tokens/{k}"][:].astype(np.float64) for k in ("advantage", "old_logprob",
                                                                           "rollout_logprob"))
        recorded_loss = f["train/updates/loss"][:]
    upd, ratio = d["/tokens/update"], d["/tokens/ratio"].astype(np.float64)
    in0 = (upd == 0) & (d["/tokens/loss_mask"] > 0)
    assert d["/tokens/clipped"][in0].sum() == 0

    def predicted(tis: bool, cap: float) -> tuple[float, float]:
        w = np.minimum(np.exp(old[in0] - roll[in0]), cap) if tis else np.ones(in0.sum())
        terms = -adv[in0] * ratio[in0] * w / in0.sum()
        return float(terms.sum()), float(np.abs(terms).sum())

    for got, (tis, cap) in ((base[0]["loss"], (True, 2.0)), (tis_off[0]["loss"], (False, 2.0)),
                            (cap5[0]["loss"], (True, 5.0))):
        want, scale = predicted(tis, cap)
        assert abs(got - want) <= 1e-5 * scale, (tis, cap, got, want)
    assert abs(tis_off[0]["loss"] - base[0]["loss"]) > 0.05 * predicted(True, 2.0)[1]
    assert tis_off[0]["tis_weight_mean"] == base[0]["tis_weight_mean"]  # still reported, just not applied
    assert base[0]["loss"] == recorded_loss[0]

    # drop_top_k removes exactly 5 loss tokens; r3 recomputes the old logprobs under forced routing.
    assert sum(u["num_loss_tokens"] for u in base) - sum(u["num_loss_tokens"] for u in dropped) == 5
    notes = {v["label"]: " ".join(v["notes"]) for v in doc["variants"]}
    assert "dropped 5 loss token(s)" in notes["replay.drop_top_k=5"]
    assert "old logprobs recomputed" in notes["r3=true"] and np.isfinite(r3[0]["loss"])

    # The dump itself: token contributions add up to each update's loss, per-tensor gradient norms
    # to its grad norm, router loads to 1; it opens like a step file.
    for u, row in enumerate(doc["baseline"]):
        c = d["/tokens/loss_contribution"][upd == u].astype(np.float64)
        assert abs(c.sum() - row["loss"]) <= 1e-5 * np.abs(c).sum()
        assert np.sqrt((d["/params/grad_norm"][u] ** 2).sum()) == pytest.approx(row["grad_norm"], rel=1e-5)
    assert np.allclose(d["/router/load"].sum(-1), 1.0) and d["/router/entropy"].shape == (2, 2)
    trained = d["/samples/update"] >= 0
    assert (d["/samples/grad_norm"][trained] > 0).all() and np.all(np.abs(d["/samples/grad_cosine"][trained]) <= 1)
    assert list(d["/activations/names"]) == ["embed_tokens", "layers.0", "layers.1", "norm"]
    assert np.isfinite(d["/tokens/activation_norm"][d["/tokens/update"] >= 0]).all()
    assert d["attrs"]["verdict"] == "bitwise-equal" and d["attrs"]["step"] == 3
    from axrl.trace import StepFile

    with StepFile(doc["dump"]) as sf:
        assert sf.step == 3 and "/tokens/ratio" in sf


def test_what_if_table_is_printed(run):
    result = replay_cli(run, "--step", 1, "--set", "faults.lr_scale.factor=1")
    out = " ".join(result.stdout.split())
    assert result.exit_code == 0, result.output
    assert "what-if at step 1" in out and "v1: faults.lr_scale.factor=1" in out
    assert "ratio_max" in out and "clipfrac" in out
