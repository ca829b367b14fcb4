"""On-policy distillation: a teacher's logprobs of the tokens the student sampled as a dense,
per-token advantage (docs/algorithms.md, "On-policy distillation").

The student π_θ samples y ~ π_θ(· | x) (on-policy: the rollout's own tokens). A teacher π_T
scores the same tokens, teacher-forced, at the rollout temperature T_r — the quantity the engine
reports for the student, log_softmax(logits / T_r)[y_t] — so both sides are the same distribution
family (scoring the teacher at T = 1 against a student sampled at T_r ≠ 1 biases the KL; slime
#2085). The per-token reverse KL's single-sample estimate at the sampled token is

    k1_t = log π_θ(y_t | x, y_<t) − log π_T(y_t | x, y_<t)       (E_{y~π_θ}[k1] = KL(π_θ ‖ π_T))

and minimising it by policy gradient treats −coef·k1_t as the advantage of token t (tinker
cookbook, AxisRL), with log π_θ the rollout's logprob (the engine's, the policy that sampled):

    A_t = coef · (teacher_logprob_t − rollout_logprob_t)                 mode "reverse_kl"
    A_t = A_task,t + coef · (teacher_logprob_t − rollout_logprob_t)     mode "reverse_kl+reward"

on loss tokens (1 in the loss mask), 0 elsewhere. A_t is not normalised over the group: its scale
is the KL's, in nats, times `coef`. The term is a constant of the loss (no gradient flows into
it), so the PPO / TIS machinery of the run applies to it unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import Field, model_validator

from axrl.algo.processor import ProcessedBatch
from axrl.core.settings import Section

DistillMode = Literal["reverse_kl", "reverse_kl+reward"]

__all__ = ["DistillMode", "DistillSettings", "distill_token_advantages", "with_distillation"]


class DistillSettings(Section):
    """On-policy distillation (docs/algorithms.md; the YAML section `distill` is this type): a
    teacher scores the student's sampled tokens and coef·(teacher − rollout logprob) is their
    advantage, alone or added to the task's."""

    teacher: str | None = Field(None, description="teacher model: a Hugging Face directory (as `axrl model export` "
                                "writes) or a run's checkpoints/step_N; same tokenizer as the student")
    url: str | None = Field(None, description="a served teacher: the URL of an SGLang server or `axrl serve` "
                            "(same tokenizer, its directory readable here); scored at the rollout temperature")
    coef: float = Field(1.0, gt=0, description="weight of the reverse-KL advantage coef·(teacher − rollout logprob)")
    mode: DistillMode = Field("reverse_kl", description="'reverse_kl': the distillation advantage alone; "
                              "'reverse_kl+reward': added to the task's advantage")

    @model_validator(mode="after")
    def _one_teacher(self) -> "DistillSettings":
        if (self.teacher is None) == (self.url is None):
            raise ValueError("distill: set exactly one of `teacher` (a model directory or checkpoint) or `url`")
        return self

    def describe(self) -> str:
        """e.g. "on-policy distillation (reverse_kl, coef 1) from /models/teacher"."""
        return f"on-policy distillation ({self.mode}, coef {self.coef:g}) from {self.teacher or self.url}"


def distill_token_advantages(task_advantages: torch.Tensor, teacher_logprobs: torch.Tensor,
                             rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, coef: float,
                             mode: DistillMode) -> torch.Tensor:
    """float32 [T]: the module docstring's A_t from the token tensors of a packed batch.

    Tokens outside the loss mask get 0 (and, under "reverse_kl+reward", the task advantage they
    already carry, which is 0 there too); `where`, not multiply, so the NaN rollout logprob of a
    prompt token cannot leak into the result."""
    if mode not in ("reverse_kl", "reverse_kl+reward"):
        raise ValueError(f"distill.mode {mode!r}: expected 'reverse_kl' or 'reverse_kl+reward'")
    on = loss_mask.reshape(-1) > 0
    kl_term = coef * (teacher_logprobs.double() - rollout_logprobs.double())
    kl_term = torch.where(on, kl_term, torch.zeros_like(kl_term))
    if mode == "reverse_kl+reward":
        kl_term = kl_term + task_advantages.double()
    return kl_term.float()


def with_distillation(processed: ProcessedBatch, teacher_logprobs: torch.Tensor,
                      settings: DistillSettings) -> ProcessedBatch:
    """`processed` with the teacher's logprobs attached (recorded as /tokens/teacher_logprob) and
    its token advantages replaced by the distillation advantage. The per-sample advantages
    (/samples/advantage) stay the task's: they are what the reward pipeline computed."""
    batch = processed.batch
    assert batch.advantages is not None and batch.rollout_logprobs is not None
    adv = distill_token_advantages(batch.advantages, teacher_logprobs, batch.rollout_logprobs, batch.loss_mask,
                                   settings.coef, settings.mode)
    processed.batch = dataclasses.replace(batch, advantages=adv)
    processed.teacher_logprobs = teacher_logprobs
    return processed
