"""The supervised warm-up: which demonstration tokens are trained on, and that it learns."""

from __future__ import annotations

import torch

from axrl.agents.tasks import get_task
from axrl.model import build_model, preset_config
from axrl.runtime.warmup import conversation_tokens, demonstration_batch, warm_up
from axrl.tokenizer import Tokenizer
from axrl.train import TorchBackend, TorchBackendConfig

torch.set_num_threads(1)


def test_loss_mask_covers_exactly_what_the_policy_generates():
    tok = Tokenizer.default()
    task = get_task("calculator", show_tool_schema=False)
    demo = task.demonstration(task.prompt(0, 0))
    ids, mask = conversation_tokens(tok, demo, tools=None)
    assert ids == tok.apply_chat_template(demo)
    trained = [i for i, m in zip(ids, mask) if m]
    call = tok.encode_message(demo[-3])[len(tok.generation_prompt_ids()):-1]  # drop header and "\n"
    answer = tok.encode_message(demo[-1])[len(tok.generation_prompt_ids()):-1]
    assert trained == call + answer
    assert tok.decode(answer) == demo[-1]["content"] + "<|im_end|>"


def test_warm_up_lowers_the_demonstration_loss():
    tok = Tokenizer.default()
    task = get_task("calculator", show_tool_schema=False)
    backend = TorchBackend(build_model(preset_config("micro-moe"), seed=0),
                           TorchBackendConfig(lr=1e-2, num_threads=1))
    losses = warm_up(backend, tok, task, steps=20, batch_size=4, lr=1e-2, seed=0)
    assert len(losses) == 20 and losses[-1] < 0.6 * losses[0]
    batch = demonstration_batch(tok, task, [task.prompt(5, i) for i in range(3)])
    assert batch.num_samples == 3 and 0 < float(batch.loss_mask.sum()) < batch.num_tokens
