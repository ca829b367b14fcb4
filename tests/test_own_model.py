"""Bring your own model: Hugging Face directories written by `transformers` itself (random init
from a Qwen3 / Qwen3-MoE config, saved with a tokenizer the `tokenizers` library built that differs
from AxRL's: other vocabulary size, other special-token ids, a Qwen-style chat template) are
trained with *their* tokenizer and template, traced, replayed bit for bit and exported to a
directory that transformers and `axrl serve` load (tests/hf_checkpoint.py builds them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from axrl.model import load_hf
from axrl.tokenizer import Tokenizer, load_tokenizer
from axrl.trace import StepFile
from hf_checkpoint import MODEL_VOCAB, write_checkpoint
from train_util import axrl, debug, set_args, train

import transformers  # noqa: E402  (the test extra installs it: a broken import fails)
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
# Echo on the checkpoint: a warm-up that leaves rewards varying, so the updates have real gradients.
RUN = ["steps=3", "warmup.steps=60", "warmup.lr=5e-3", "data.task=echo", "data.task_args={turns: 2}",
       "data.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.temperature=1.0",
       "eval.every=0", "checkpoint.every=2", "runtime.threads=1"]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate <x> & 'y'.",
                                           "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 37 + 58?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call00001",
                                             "function": {"name": "calculator", "arguments": {"e": "37 + 58"}}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": "95"},
    {"role": "tool", "tool_call_id": "call00001", "content": "96"},
    {"role": "assistant", "content": "<think>\nsum\n</think>\n\nThe answer is 95."},
    {"role": "user", "content": "And 1 + 1?"},
]


@pytest.fixture(scope="module", params=["moe", "dense"])
def checkpoint(request, tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp(f"hf_{request.param}") / "model", moe=request.param == "moe")


@pytest.fixture(scope="module")
def trained(checkpoint, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run") / "run"
    train(run, [f"model.path={checkpoint}", *RUN])
    return run


def test_checkpoint_tokenizer_is_the_directorys_own(checkpoint):
    ours, hf = load_tokenizer(checkpoint), transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    default = Tokenizer.default()
    assert ours.vocab_size == len(hf) != default.vocab_size
    im_end, eot = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    assert (ours.eos_token_id, ours.pad_token_id) == (im_end, eot) != (default.eos_token_id, default.pad_token_id)
    assert ours.stop_token_ids == sorted([im_end, eot])             # generation_config.json's eos list
    assert ours.tool_call_tags == ("<tool_call>", "</tool_call>")     # read off the template
    for tools in (None, TOOLS):
        for gen in (False, True):
            text = ours.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=gen, tokenize=False)
            assert text == hf.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=gen) == \
                hf.encode(text, add_special_tokens=False)
    # the template renders no empty conversation (messages[0]); the generation prompt is still known
    assert ours.decode(ours.generation_prompt_ids()) == "<|im_start|>assistant\n"
    # consecutive tool results are merged, and the agent loop's stream follows (it renders what
    # comes after each reply from the whole conversation) ...
    assert ours.incremental_mismatch(CONVERSATION[:6], TOOLS) is None
    # ... but reasoning stripped from an earlier turn once a new question comes is drift: said, not hidden
    assert "think" in ours.incremental_mismatch(CONVERSATION + [{"role": "assistant", "content": "2"}], TOOLS)
    assert ours.parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')[0]["name"] == "f"


def test_unsupported_architecture_fails_at_load_naming_it(checkpoint, tmp_path):
    other = tmp_path / "llama"
    shutil.copytree(checkpoint, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    result = train(tmp_path / "run", [f"model.path={other}", "warmup.steps=0"], check=False)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert "'architectures' is ['LlamaForCausalLM']" in text and "Qwen3MoeForCausalLM" in text
    assert axrl("model", "info", other).exit_code == 2


def test_tokenizer_larger_than_the_embedding_is_refused(checkpoint, tmp_path):
    small = tmp_path / "small"
    shutil.copytree(checkpoint, small)
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 400}))
    with pytest.raises(ValueError, match="has 429 token ids but .* vocab_size 400"):
        load_tokenizer(small)


def test_trace_holds_the_checkpoints_token_ids(trained, checkpoint):
    tok = load_tokenizer(checkpoint)
    with StepFile(trained / "trace" / "step_000000.h5") as sf:
        ids, off = sf["/tokens/ids"].astype(np.int64), sf["/samples/offsets"]
        mask, prompt_len = sf["/tokens/loss_mask"], sf["/samples/prompt_len"]
    # a random-init model may sample the embedding's padding rows (tokenizer size .. vocab_size)
    assert ids.max() < MODEL_VOCAB and tok.vocab_size < MODEL_VOCAB
    first = ids[off[0]:off[1]].tolist()
    text = tok.decode(first)
    # the prompt is the checkpoint's template rendering, its special tokens at their ids (420+)
    assert text.startswith("<|im_start|>user\nRepeat each word I say.")
    assert first[:int(prompt_len[0])] == tok.apply_chat_template(
        [{"role": "user", "content": text.split("\n")[1].split("<|im_end|>")[0]}], add_generation_prompt=True)
    # every assistant turn the model ended itself ends with the checkpoint's end-of-turn id
    gen_ends = [i for i in range(1, len(first)) if mask[off[0] + i - 1] and not mask[off[0] + i]]
    assert gen_ends and all(first[i - 1] == tok.eos_token_id for i in gen_ends)
    metrics = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    assert any(m["grad_norm"] > 0 for m in metrics)          # real updates for replay to check


def test_replay_is_bitwise_on_a_checkpoint_run(trained):
    result = debug("replay", trained, "--step", 2, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "bitwise-equal" and doc["replayed_steps"] == [2]


def test_export_loads_in_transformers_and_axrl_serve(trained, checkpoint, tmp_path):
    out = tmp_path / "export"
    result = axrl("model", "export", trained, "--out", out)
    assert result.exit_code == 0, result.output
    assert "after 3 RL steps" in " ".join(result.output.split())
    ckpt = json.loads((trained / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    from axrl.train.fingerprint import weights_fingerprint
    from axrl.model import hf_state_dict
    ours = load_hf(out)
    assert weights_fingerprint(hf_state_dict(ours).items()) == ckpt["weights_fingerprint"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[5, 17, 300, 421, 42, 9]])
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    original = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    assert hf_tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False) == \
        original.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == load_tokenizer(checkpoint).stop_token_ids
    # an older checkpoint on request, and a clear refusal for one that does not exist
    assert axrl("model", "export", trained, "--step", 0, "--out", tmp_path / "e0").exit_code == 0
    missing = axrl("model", "export", trained, "--step", 1, "--out", tmp_path / "e1")
    assert missing.exit_code == 2 and "checkpoints: 0, 2, 3" in " ".join(missing.output.split())

    from fastapi.testclient import TestClient

    from axrl.inference.serve import ServeConfig, build_server, create_app
    server = build_server(ServeConfig(model_path=str(out), context_length=256))
    with TestClient(create_app(server)) as http:
        reply = http.post("/v1/chat/completions", json={"model": "export", "messages": CONVERSATION[:2],
                                                         "max_tokens": 4, "return_token_ids": True})
        assert reply.status_code == 200, reply.text
        prompt_ids = reply.json()["choices"][0]["prompt_token_ids"]
    assert prompt_ids == load_tokenizer(checkpoint).apply_chat_template(CONVERSATION[:2], add_generation_prompt=True)


def test_serve_on_a_checkpoint_directory_says_export(trained):
    ckpt = trained / "checkpoints" / "step_000002"
    result = axrl("serve", "--model-path", ckpt)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"axrl model export {trained} --step 2 --out DIR" in text


def test_docs_models_commands_run(tmp_path, monkeypatch):
    """docs/models.md's four commands, as written (from a scratch directory; the train command gets
    a shorter warm-up appended), each checked."""
    import os
    import re
    import subprocess
    import sys

    from axrl.inference.sglang.launcher import free_port

    doc = (ROOT / "docs" / "models.md").read_text()
    block = doc[doc.index("## The whole path in four commands"):]
    commands = block[block.index("```bash\n") + 8:].split("\n```", 1)[0].splitlines()
    assert [c.split()[:2] for c in commands] == [["python", "tests/hf_checkpoint.py"], ["axrl", "train"],
                                                 ["axrl", "model"], ["axrl", "serve"]]
    monkeypatch.chdir(tmp_path)
    local = lambda c: re.sub(r"(?<![\w/])(examples|tests)/", lambda m: f"{ROOT}/{m.group(1)}/", c)  # noqa: E731
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    made = subprocess.run([sys.executable, *local(commands[0]).split()[1:]], capture_output=True, text=True, env=env)
    assert made.returncode == 0 and (tmp_path / "my-qwen3" / "config.json").is_file(), made.stderr
    run = axrl(*local(commands[1]).split()[1:],
               *set_args(["warmup.steps=4", "eval.every=0", "data.prompts_per_step=2", "runtime.threads=1"]))
    assert run.exit_code == 0 and (tmp_path / "runs" / "mine" / "trace" / "step_000002.h5").is_file(), run.output
    export = axrl(*commands[2].split()[1:])
    assert export.exit_code == 0 and (tmp_path / "exported" / "model.safetensors").is_file(), export.output
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "axrl.cli", *commands[3].split()[1:], "--port", str(port)],
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        started = serve.stderr.readline() + serve.stderr.readline()
    finally:
        serve.terminate()
        serve.wait(30)
    assert "model 'exported' from exported (qwen3_moe" in started and f"listening on http://127.0.0.1:{port}" in started


def test_analysis_decodes_with_the_checkpoints_tokenizer(trained, checkpoint):
    result = debug("mismatch", trained, "--top", 3, "--json")
    assert result.exit_code == 0, result.output
    tok, shipped = load_tokenizer(checkpoint), Tokenizer.default()
    top = json.loads(result.stdout)["top"]
    assert all(t["text"] == tok.decode([t["token_id"]]) for t in top)
    assert any(t["text"] != shipped.decode([t["token_id"]]) for t in top)  # the shipped one reads other text
    from axrl_debug.tui.data import RunModel
    assert RunModel(trained).tokenizer.vocab_size == tok.vocab_size
