"""Supervised warm-up: teach the random-init policy the task's format from its demonstrations,
so RL starts from a model that succeeds some of the time."""

from __future__ import annotations

from typing import Callable

import torch
from pydantic import Field

from axrl.agents.env import Message
from axrl.agents.tasks import Task
from axrl.algo.sft import nll_loss
from axrl.core.settings import Section
from axrl.tokenizer import Tokenizer
from axrl.train.protocol import PackedBatch, TrainBackend


class WarmupSettings(Section):
    """Supervised warm-up on the task's demonstrations before RL (skipped on --resume; `steps` 0 =
    none). The YAML section `warmup` is this type; `warm_up` takes its fields."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)


def conversation_tokens(tokenizer: Tokenizer, conversation: list[Message],
                        tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """Token ids of a conversation as the agent loop would stream it, and a loss mask over what
    the policy generates: each assistant reply's text through its end-of-turn token (not the
    reply's opening nor the glue after, which the agent loop supplies); see
    :meth:`~axrl.tokenizer.Tokenizer.episode_ids`."""
    return tokenizer.episode_ids(conversation, tools)


def demonstration_batch(tokenizer: Tokenizer, task: Task, prompts: list) -> PackedBatch:
    """Pack the task's ideal conversations for `prompts` into one SFT batch."""
    tools = task.make_env().tools or None
    seqs = [conversation_tokens(tokenizer, task.demonstration(p), tools) for p in prompts]
    lengths = torch.tensor([len(ids) for ids, _ in seqs])
    return PackedBatch(
        input_ids=torch.tensor([t for ids, _ in seqs for t in ids], dtype=torch.int64),
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        loss_mask=torch.tensor([m for _, mask in seqs for m in mask], dtype=torch.float32),
    )


def warm_up(backend: TrainBackend, tokenizer: Tokenizer, task: Task, *, steps: int, batch_size: int, lr: float,
            seed: int, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """`steps` supervised updates at the fixed rate `lr` on fresh demonstrations; returns the loss
    of each update. The caller resets the optimizer before RL (`TrainBackend.reset_optimizer`).

    Prompts come from a seed stream disjoint from RL's (seed + 1), so the warm-up does not
    rehearse the exact problems the RL run is later scored on.
    """
    losses = []
    for step in range(steps):
        prompts = [task.prompt(seed + 1, step * batch_size + i) for i in range(batch_size)]
        metrics = backend.forward_backward(demonstration_batch(tokenizer, task, prompts), nll_loss)
        backend.optimizer_step(lr=lr)
        losses.append(metrics.loss)
        if on_step:
            on_step(step, metrics.loss)
    return losses
