"""On-policy distillation (`distill`, axrl/algo/distill.py, axrl/runtime/teacher.py): the teacher's
scores against a direct forward of the teacher, the advantage against its formula, a teacher with
another tokenizer refused, and a short distillation run end to end (trace column, `axrl-debug
mismatch --against teacher`, bitwise replay)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from axrl.algo.distill import DistillSettings, distill_token_advantages
from axrl.cli import app as axrl_app
from axrl.core.errors import ConfigError
from axrl.model import build_model, preset_config, save_hf
from axrl.runtime.teacher import make_teacher, tokenizer_difference
from axrl.tokenizer import Tokenizer
from axrl.train import TorchBackendConfig
from axrl.train.protocol import PackedBatch
from axrl_debug.cli import app as debug_app

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMALL = ["model.preset=micro-moe", "data.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24",
         "rollout.max_context_len=160", "warmup.steps=3", "warmup.batch_size=4", "checkpoint.every=1",
         "runtime.threads=1", "eval.every=0"]


def _teacher_dir(path: Path, seed: int = 7) -> Path:
    tok = Tokenizer.default()
    cfg = preset_config("micro-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return save_hf(build_model(cfg, seed=seed), path, tok)


def test_distillation_advantage_is_coef_times_teacher_minus_rollout():
    g = torch.Generator().manual_seed(0)
    teacher, rollout = -torch.rand(10, generator=g) * 3, -torch.rand(10, generator=g) * 3
    task = torch.randn(10, generator=g)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.float32)
    rollout[mask == 0] = float("nan")         # prompt tokens have no rollout logprob
    task[mask == 0] = 0.0
    for mode in ("reverse_kl", "reverse_kl+reward"):
        got = distill_token_advantages(task, teacher, rollout, mask, 0.5, mode)
        for t in range(10):
            expected = 0.0 if mask[t] == 0 else 0.5 * (float(teacher[t]) - float(rollout[t]))
            if mode == "reverse_kl+reward":
                expected += float(task[t])
            assert float(got[t]) == pytest.approx(expected, abs=1e-6), (mode, t)
    with pytest.raises(ValueError, match="distill.mode"):
        distill_token_advantages(task, teacher, rollout, mask, 0.5, "forward_kl")  # type: ignore[arg-type]


def test_teacher_scores_are_log_softmax_at_the_rollout_temperature(tmp_path):
    path = _teacher_dir(tmp_path / "teacher")
    teacher = make_teacher(DistillSettings(teacher=str(path)), TorchBackendConfig(micro_batch_tokens=16),
                           Tokenizer.default(), device=torch.device("cpu"), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    lengths = [9, 14, 5]
    ids = torch.randint(0, 200, (sum(lengths),), generator=g)
    offsets = torch.tensor([0, *np.cumsum(lengths)])
    batch = PackedBatch(input_ids=ids, offsets=offsets, loss_mask=torch.ones(len(ids)), temperature=0.7)
    got = teacher.score(batch)

    # Independently: one unpadded forward per sample of the model as saved, log_softmax(logits / T).
    from axrl.model import load_hf
    model = load_hf(path).eval()
    for i, n in enumerate(lengths):
        seq = ids[offsets[i]:offsets[i + 1]]
        with torch.no_grad():
            logits = model(seq[None]).logits[0].double()
        lp = torch.log_softmax(logits / 0.7, dim=-1)
        expected = lp[torch.arange(n - 1), seq[1:]]
        assert torch.allclose(got[offsets[i] + 1:offsets[i + 1]].double(), expected, atol=1e-5), i
        assert float(got[offsets[i]]) == 0.0


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    from hf_checkpoint import train_tokenizer

    default = Tokenizer.default()
    other = Tokenizer(train_tokenizer(), default.config)
    assert tokenizer_difference(default, default) is None
    path = _teacher_dir(tmp_path / "teacher")
    with pytest.raises(ConfigError, match=r"distill.teacher .*tokenizer differs.*vocab_size"):
        make_teacher(DistillSettings(teacher=str(path)), TorchBackendConfig(), other,
                     device=torch.device("cpu"), dtype=torch.float32)
    from axrl.inference.sglang.launcher import free_port

    with pytest.raises(ConfigError, match="distill.url: .*cannot reach the server"):
        make_teacher(DistillSettings(url=f"http://127.0.0.1:{free_port()}"), TorchBackendConfig(), default,
                     device=torch.device("cpu"), dtype=torch.float32)


def _train(run: Path, *overrides: str) -> None:
    args = ["train", str(QUICKSTART), "--run-dir", str(run)]
    for s in [*SMALL, *overrides]:
        args += ["--set", s]
    result = CliRunner().invoke(axrl_app, args)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory) -> Path:
    """A 1-step teacher run, then a 2-step student distilled from its checkpoint."""
    root = tmp_path_factory.mktemp("distill")
    _train(root / "teacher", "steps=1", "model.init_seed=3")
    teacher = root / "teacher" / "checkpoints" / "step_000001"
    _train(root / "student", "steps=2", f"distill.teacher={teacher}", "distill.coef=0.5")
    return root / "student"


def test_distillation_run_records_teacher_logprobs_and_their_advantage(distill_run):
    with h5py.File(distill_run / "trace" / "step_000001.h5") as sf:
        teacher = np.asarray(sf["tokens/teacher_logprob"], np.float64)
        rollout = np.asarray(sf["tokens/rollout_logprob"], np.float64)
        adv = np.asarray(sf["tokens/advantage"], np.float64)
        mask = np.asarray(sf["tokens/loss_mask"]) == 1
    assert mask.any() and np.isfinite(teacher[mask]).all()
    assert np.allclose(adv[mask], 0.5 * (teacher[mask] - rollout[mask]), atol=1e-6)
    assert (adv[~mask] == 0).all()


def test_mismatch_reports_the_teacher_kl(distill_run):
    result = CliRunner().invoke(debug_app, ["mismatch", str(distill_run), "--against", "teacher", "--json"])
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout)
    assert res["against"] == "teacher"
    d, m = [], []
    for step in (0, 1):
        with h5py.File(distill_run / "trace" / f"step_{step:06d}.h5") as f:
            d.append(np.asarray(f["tokens/teacher_logprob"], np.float64) - f["tokens/rollout_logprob"][:])
            m.append(np.asarray(f["tokens/loss_mask"]) == 1)
    d, m = np.concatenate(d), np.concatenate(m)
    assert res["metrics"]["k1"] == pytest.approx(float(np.mean(-d[m])), rel=1e-4, abs=1e-6)
    assert {"position", "turn"} <= set(res["breakdowns"])
    assert res["top"] and all("delta" in t for t in res["top"])
    text = CliRunner().invoke(debug_app, ["mismatch", str(distill_run), "--against", "teacher"])
    assert text.exit_code == 0 and "KL(student ‖ teacher)" in " ".join(text.output.split())


def test_mismatch_against_teacher_needs_a_distillation_run(tmp_path, distill_run):
    teacher_run = distill_run.parent / "teacher"
    result = CliRunner().invoke(debug_app, ["mismatch", str(teacher_run), "--against", "teacher"])
    assert result.exit_code != 0 and "teacher_logprob" in result.output


def test_distillation_step_replays_bitwise(distill_run):
    result = CliRunner().invoke(debug_app, ["replay", str(distill_run), "--step", "1", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "bitwise-equal" and doc["first_divergence"] is None


def test_tui_colours_tokens_by_the_teacher_delta(distill_run):
    from axrl_debug.tui.data import RunModel

    tokens = RunModel(distill_run, against="teacher").step(1).sample(0)
    mask = tokens.data["loss_mask"] == 1
    expected = tokens.data["teacher_logprob"].astype(np.float64) - tokens.data["rollout_logprob"]
    assert mask.any() and np.allclose(tokens.delta[mask], expected[mask], atol=1e-6)
    assert np.isnan(tokens.delta[~mask]).all()
    trainer = RunModel(distill_run).step(1).sample(0)
    assert not np.allclose(trainer.delta[mask], tokens.delta[mask])


def test_tui_token_detail_names_the_teacher_and_refuses_a_run_without_one(distill_run):
    from axrl_debug.tui.data import RunModel
    from axrl_debug.tui.widgets.token_detail import detail_text

    tokens = RunModel(distill_run, against="teacher").step(1).sample(0)
    i = int(np.flatnonzero(tokens.data["loss_mask"] == 1)[0])
    text = detail_text(tokens, i).plain
    teacher, trainer = tokens.data["teacher_logprob"][i], tokens.data["old_logprob"][i]
    assert f"teacher lp {teacher:.5g}" in text and f"trainer lp {trainer:.5g}" in text
    assert f"Δ teacher {tokens.delta[i]:.3g}" in text and "π_T/μ" in text
    # a run without teacher logprobs would show no Δ anywhere, which reads as agreement: refused
    result = CliRunner().invoke(debug_app, ["tui", str(distill_run.parent / "teacher"), "--against", "teacher"])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "/tokens/teacher_logprob" in said and "distill" in said
    result = CliRunner().invoke(debug_app, ["tui", str(distill_run), "--against", "value"])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "/tokens/value" in said and "gae" in said


def test_metrics_log_the_teacher_kl(distill_run):
    rows = [json.loads(line) for line in (distill_run / "metrics.jsonl").read_text().splitlines()]
    with h5py.File(distill_run / "trace" / "step_000001.h5") as f:
        d = np.asarray(f["tokens/teacher_logprob"], np.float64) - f["tokens/rollout_logprob"][:]
        m = np.asarray(f["tokens/loss_mask"]) == 1
    row = next(r for r in rows if r.get("step") == 1 and "teacher_kl" in r)
    assert row["teacher_kl"] == pytest.approx(float(np.mean(-d[m])), rel=1e-9, abs=1e-12)


def test_replay_recomputes_the_distillation_advantage(distill_run):
    from axrl.config import load_config
    from replay import load_recorded_step
    from replay.whatif import recompute_advantages

    cfg = load_config(distill_run / "config.yaml")
    rec = load_recorded_step(distill_run / "trace" / "step_000001.h5", cfg)
    recorded = rec.batch.advantages
    assert torch.equal(recompute_advantages(rec, cfg), recorded)   # the trainer's own pipeline, bitwise
    doubled = load_config(distill_run / "config.yaml", ["distill.coef=1.0"])
    mask = rec.batch.loss_mask > 0
    assert torch.allclose(recompute_advantages(rec, doubled)[mask], 2 * recorded[mask], atol=1e-6)
    result = CliRunner().invoke(debug_app, ["replay", str(distill_run), "--step", "1", "--set", "distill.coef=1.0"])
    assert result.exit_code in (0, 1), result.output
    assert "on-policy distillation (reverse_kl, coef 1)" in " ".join(result.output.split())


class _Vocab:
    """The three things `tokenizer_difference` reads, over a list of token texts."""

    def __init__(self, tokens: list[str], special: list[int]) -> None:
        self.tokens, self.special_token_ids = tokens, special

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def id_to_token(self, i: int) -> str:
        return self.tokens[i]


def test_tokenizer_difference_names_special_tokens_then_the_first_differing_id():
    base = _Vocab(["<eos>", "a", "b", "c"], [0])
    assert tokenizer_difference(base, _Vocab(["<eos>", "a", "b", "c"], [0])) is None
    assert "special tokens differ" in tokenizer_difference(base, _Vocab(["<end>", "a", "b", "c"], [0]))
    assert tokenizer_difference(base, _Vocab(["<eos>", "a", "x", "c"], [0])) == "token id 2 is 'x' (the student's: 'b')"
