"""`axrl.integrations.trl_grpo.record_grpo`: real TRL GRPOTrainer runs (tiny random Qwen2 on CPU,
no download) are recorded as AxRL traces whose tokens, groups, rewards, advantages, sampler
logprobs (from `generate`) and trainer logprobs are the trainer's — on TRL's defaults (generation
and optimizer steps aligned: TRL computes no old logprobs) and with misaligned steps (TRL
recomputes them); the vLLM path (vllm is not importable beside TRL here) is checked through
`step_arrays` with a batch shaped like TRL's, against an independent mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from axrl.integrations.trl_grpo import record_grpo, step_arrays
from axrl.trace import Recorder, StepFile
from axrl_debug.cli import app

GEN, BATCH = 4, 8


def summary(run: Path) -> dict:
    r = CliRunner().invoke(app, ["summary", str(run), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def tiny_model(path: Path):
    """A 2-layer random Qwen2 and a word-level tokenizer, saved to ``path`` (GRPOTrainer loads by path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {f"w{i}": i for i in range(64)} | {"<pad>": 64, "<eos>": 65, "<unk>": 66}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                         pad_token_id=64, eos_token_id=65))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return tok


def test_records_a_real_grpo_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = tiny_model(tmp_path / "model")
    prompts = [" ".join(f"w{(i * 7 + j) % 64}" for j in range(4 + i % 3)) for i in range(8)]
    seen: list[tuple[str, float]] = []

    def reward(completions, **kw):
        out = [len(c) / 10 for c in completions]
        seen.extend(zip(completions, out))
        return out

    # generation every 2 micro-steps, optimizer every 1: misaligned, so TRL recomputes old logprobs
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=GEN,
                      steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=6, max_steps=4,
                      report_to=[], use_cpu=True, save_strategy="no", bf16=False, logging_steps=1)
    trainer = GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    rec = record_grpo(trainer, tmp_path / "run")
    trainer.train()
    assert rec.steps == [0, 1]                    # 4 optimizer steps, a generation batch every 2
    rows = summary(tmp_path / "run")["steps"]
    for step, row in enumerate(rows):
        with StepFile(tmp_path / "run" / "trace" / f"step_{step:06d}.h5") as sf:
            off, plen = sf["/samples/offsets"], sf["/samples/prompt_len"]
            ids, lm, old = sf["/tokens/ids"], sf["/tokens/loss_mask"], sf["/tokens/old_logprob"]
            assert sf.num_samples == BATCH and sf["/samples/group_id"].tolist() == [2 * step] * 4 + [2 * step + 1] * 4
            rewards = [r for _, r in seen[step * BATCH:(step + 1) * BATCH]]
            assert sf["/samples/reward"].tolist() == pytest.approx(rewards)
            for i in range(BATCH):
                prompt = tok.decode(ids[off[i]:off[i] + plen[i]].tolist())
                assert prompt in prompts                  # the prompt's own ids, unpadded
                assert lm[off[i]:off[i] + plen[i]].sum() == 0
            trained = lm == 1
            assert np.isfinite(old[trained]).all() and np.isnan(old[~trained]).all()
            rollout = sf["/tokens/rollout_logprob"]
            # generate's own logprobs, taken from the distribution it sampled from (T = 1, no top-k/p):
            # the weights that sampled are the ones TRL recomputed old with, so they agree closely
            assert np.isfinite(rollout[trained]).all() and np.isnan(rollout[~trained]).all()
            assert np.abs(rollout[trained] - old[trained]).max() < 1e-4
            assert (old[trained] < 0).all()
        assert row["reward"] == pytest.approx(np.mean(rewards))
        # the loss and grad norm of the two optimizer steps that trained on this batch, as TRL logged them
        logged = [h for h in trainer.state.log_history if "grad_norm" in h][2 * step:2 * step + 2]
        assert len(logged) == 2
        assert row["grad_norm"] == pytest.approx(np.mean([h["grad_norm"] for h in logged]), rel=1e-5)
        assert row["loss"] == pytest.approx(np.mean([h["loss"] for h in logged]), abs=1e-4)  # TRL rounds its log
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["engine"] == "transformers" and manifest["source"]["framework"] == "trl"
    # each batch's second micro-batch trains after the first optimizer step: new logprobs moved from old
    assert all(r["new_old_max_abs_delta"] > 0 for r in metrics_rows(tmp_path / "run"))


def metrics_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def trainer_logprobs(model_dir: Path, ids: list[int], prompt_len: int) -> np.ndarray:
    """log p(token | earlier tokens) of the completion tokens under the model saved at ``model_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logps = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logps[prompt_len - 1:].numpy()


def test_records_logprobs_on_trl_defaults(tmp_path: Path, monkeypatch) -> None:
    """TRL's default set-up (no vLLM; generation and optimizer steps aligned, so TRL computes no old
    logprobs): the sampler's logprobs come from `generate`, the old ones from the loss forward (what
    TRL uses as old), and both equal an independent forward of the initial model on step 0."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = tiny_model(tmp_path / "model")
    prompts = [" ".join(f"w{(i * 5 + j) % 64}" for j in range(3 + i % 4)) for i in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=GEN, num_generations=GEN,
                      max_completion_length=6, max_steps=2, report_to=[], use_cpu=True, save_strategy="no",
                      bf16=False, logging_steps=1)
    trainer = GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=lambda completions, **kw:
                          [len(c) / 10 for c in completions], args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    assert trainer.args.steps_per_generation == trainer.args.gradient_accumulation_steps   # aligned: TRL's default
    rec = record_grpo(trainer, tmp_path / "run")
    trainer.train()
    assert rec.steps == [0, 1]
    for step in (0, 1):
        with StepFile(tmp_path / "run" / "trace" / f"step_{step:06d}.h5") as sf:
            trained = sf["/tokens/loss_mask"] == 1
            rollout, old = sf["/tokens/rollout_logprob"], sf["/tokens/old_logprob"]
            assert trained.sum() > 0
            assert np.isfinite(rollout[trained]).all() and np.isfinite(old[trained]).all()
            assert np.isfinite(sf["/tokens/entropy"][trained]).all()
            assert np.abs(rollout[trained] - old[trained]).max() < 1e-4    # same weights, two code paths
            if step == 0:   # the weights before any update are the ones saved on disk
                off, plen, ids = sf["/samples/offsets"], sf["/samples/prompt_len"], sf["/tokens/ids"]
                for i in range(sf.num_samples):
                    sample = ids[off[i]:off[i + 1]].tolist()
                    mask = trained[off[i]:off[i + 1]][plen[i]:]
                    ref = trainer_logprobs(tmp_path / "model", sample, int(plen[i]))
                    got = rollout[off[i]:off[i + 1]][plen[i]:]
                    assert np.abs(got[mask] - ref[mask]).max() < 1e-4, (i, got, ref)
    rows = summary(tmp_path / "run")["steps"]
    assert all(np.isfinite(r["mismatch"]) for r in rows)
    # every sample is trained on once, from the weights that sampled it: new == old
    assert all(r["new_old_max_abs_delta"] == 0.0 for r in metrics_rows(tmp_path / "run"))
    # `generate` samples with the trainer's own model: its dtype is the sampler's (doctor's envelope)
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config == {"model": {"dtype": "float32"}, "rollout": {"dtype": "float32"}}


def test_step_arrays_with_engine_logprobs(tmp_path: Path) -> None:
    """A batch shaped like TRL's with vLLM: unpadded ids and sampling logprobs (None where vLLM had
    none), padded [B, C] tensors, a tool span, a truncated (masked) completion."""
    rng = np.random.default_rng(0)
    lengths = [7, 5, 9, 3]
    prompts = [list(rng.integers(0, 60, 4)) for _ in lengths]
    completions = [list(rng.integers(0, 60, n)) for n in lengths]
    sampling = [list(-rng.exponential(0.5, n)) for n in lengths]
    sampling[1][2] = None
    old = torch.zeros(4, 9)
    mask = torch.zeros(4, 9, dtype=torch.long)
    for b, n in enumerate(lengths):
        old[b, :n] = torch.tensor([np.nan if x is None else x for x in sampling[b]]) + 0.01 * (b + 1)
        mask[b, :n] = 1
    mask[3] = 0                                   # mask_truncated_completions
    tool = torch.ones(4, 9, dtype=torch.long)
    tool[2, 3:6] = 0                              # tool output inside completion 2
    output = {"completion_mask": mask, "tool_mask": tool, "old_per_token_logps": old,
              "advantages": torch.tensor([0.5, -0.5, 1.0, 0.0])}
    arrays = step_arrays((prompts, completions, None, None, sampling), output, np.array([1.0, 0.0, 1.0, 0.5]),
                         num_generations=2, first_sample=4)
    assert arrays["group_ids"].tolist() == [2, 2, 3, 3]
    Recorder(tmp_path / "run", engine="vllm", backend="trl").write_step(0, nan_off_mask=True, **arrays)
    loss = [(b, j) for b, n in enumerate(lengths) for j in range(n)
            if mask[b, j] and tool[b, j] and sampling[b][j] is not None]
    expected = np.mean([abs(np.float32(old[b, j].item()) - np.float32(sampling[b][j])) for b, j in loss])
    row = summary(tmp_path / "run")["steps"][0]
    assert row["mismatch"] == pytest.approx(expected, rel=1e-6)
    assert row["generated_tokens"] == int((mask * tool).sum())


def test_the_example_script_records_a_run_the_debugger_reads(tmp_path: Path) -> None:
    """`python examples/trl_grpo.py --run-dir DIR`: a model from `axrl model init`, the arithmetic
    task's prompts and verifier, a real GRPOTrainer; `axrl-debug summary`, `spikes`, `golden` +
    `check` and the TUI's step list work on what it recorded."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(root / "examples" / "trl_grpo.py"), "--run-dir", str(run),
                           "--steps", "4"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = summary(run)["steps"]
    assert [r["step"] for r in rows] == [0, 1] and all(r["samples"] == 8 for r in rows)
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)   # the optimizer steps' own
    with StepFile(run / "trace" / "step_000001.h5") as sf:
        assert sf["/samples/group_id"].tolist() == [2] * 4 + [3] * 4
        assert np.isfinite(sf["/tokens/old_logprob"][sf["/tokens/loss_mask"] == 1]).all()
    for args in (["spikes", str(run), "--json"], ["golden", str(run), "-o", str(tmp_path / "g.json")],
                 ["check", str(run), "--golden", str(tmp_path / "g.json")]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, (args, r.output)
    from axrl_debug.tui.data import RunModel
    assert RunModel(run).steps == [0, 1]


def test_a_trainer_without_grpo_methods_is_named(tmp_path: Path) -> None:
    """A trainer that is not trl 1.16's GRPOTrainer (another trl version renamed its private
    methods, another trainer class) is refused naming what it lacks, before anything is written."""
    import types

    from axrl.integrations.trl_grpo import record_grpo

    trainer = types.SimpleNamespace(training_step=lambda *a: 0.0, _get_grad_norm=lambda *a: 0.0,
                                    accelerator=types.SimpleNamespace(num_processes=1))
    with pytest.raises(TypeError, match=r"SimpleNamespace \(trl .*\) has no _generate, _generate_single_turn, "
                                        r"_calculate_rewards, _generate_and_score_completions, _compute_loss, "
                                        r"_get_per_token_logps_and_entropies: it records a trl GRPOTrainer"):
        record_grpo(trainer, tmp_path / "run")
    assert not (tmp_path / "run").exists()
