"""Record a TRL ``GRPOTrainer`` run as an AxRL trace (`record_grpo`), so `axrl-debug` analyses it.

Written against trl 1.16.0 (``trl/trainer/grpo_trainer.py``) and transformers 5's ``Trainer``. The
hook wraps five methods of the trainer *instance* (not the class) and records one AxRL step per
generation batch, written once the optimizer steps that train on the batch are done:

* ``_generate`` → the unpadded prompt and completion ids and, with vLLM, the engine's per-token
  logprobs (``sampling_per_token_logps``; None without vLLM: the rollout logprobs are then absent);
* ``_calculate_rewards`` → the rewards per function, summed with ``reward_weights`` as TRL does;
* ``_generate_and_score_completions`` → ``completion_mask`` (× ``tool_mask``: tool output is not
  trained) as the loss mask, ``advantages`` [B], ``old_per_token_logps`` (the trainer's recompute;
  TRL computes it only with vLLM importance sampling or when generation and optimizer steps are
  misaligned — otherwise absent) and ``ref_per_token_logps``;
* ``training_step`` and ``_get_grad_norm`` (the ``Trainer``'s) → each optimizer step's loss (the sum
  of its micro-steps' scaled losses, as the Trainer logs it) and gradient norm; the step's
  metrics hold their means over the batch's optimizer steps (``loss``, ``grad_norm``) and their
  count (``optimizer_steps``).

TRL's per-token logprobs are over the completion, entry c = log p(completion token c | prompt,
earlier completion tokens): the token's own position, as in AxRL (no shift). Groups: TRL repeats
each prompt ``num_generations`` times consecutively. Single process only (each rank holds a slice).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from transformers import TrainerCallback

from axrl.trace import Recorder

__all__ = ["GRPORecording", "record_grpo", "step_arrays"]
# the trainer methods the hook wraps (trl 1.16.0's GRPOTrainer, transformers' Trainer)
_WRAPPED = ("_generate", "_calculate_rewards", "_generate_and_score_completions", "training_step", "_get_grad_norm")


def _np(t: Any) -> np.ndarray:
    """A tensor (any dtype, any device) or list as a float64/int numpy array."""
    if hasattr(t, "detach"):
        t = t.detach().float().cpu() if t.is_floating_point() else t.detach().cpu()
        return t.numpy()
    return np.asarray(t)


def step_arrays(generated: tuple, output: dict[str, Any], rewards: np.ndarray,
                num_generations: int, first_sample: int) -> dict[str, Any]:
    """`Recorder.write_step` arguments from one generation batch.

    ``generated``: what ``_generate`` returned (prompt ids, completion ids, tool mask, completions,
    sampling logprobs, …: lists of per-sample lists); ``output``: what
    ``_generate_and_score_completions`` returned (padded [B, C] tensors); ``rewards`` [B];
    ``first_sample``: samples recorded before this batch (group ids continue across batches)."""
    prompt_ids, completion_ids, tool_mask, _, sampling = generated[:5]
    completion_mask = _np(output["completion_mask"])
    tool = None if output.get("tool_mask") is None else _np(output["tool_mask"])
    old = None if output.get("old_per_token_logps") is None else _np(output["old_per_token_logps"])
    ref = None if output.get("ref_per_token_logps") is None else _np(output["ref_per_token_logps"])
    advantages = _np(output["advantages"]).reshape(len(prompt_ids), -1)
    out: dict[str, list] = {k: [] for k in ("token_ids", "loss_mask", "rollout_logprobs", "trainer_logprobs",
                                             "ref_logprobs", "advantages")}
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        n = len(c)
        mask = completion_mask[b, :n] * (1 if tool is None else tool[b, :n])
        out["token_ids"].append(np.asarray(list(p) + list(c), np.int64))
        out["loss_mask"].append((mask != 0).astype(np.uint8))
        out["rollout_logprobs"].append(np.full(n, np.nan) if sampling is None else
                                       np.array([np.nan if x is None else x for x in sampling[b]], np.float64))
        out["trainer_logprobs"].append(np.full(n, np.nan) if old is None else old[b, :n])
        out["ref_logprobs"].append(None if ref is None else ref[b, :n])
        a = advantages[b]
        out["advantages"].append(np.where(mask != 0, a[0], 0.0) if a.size == 1 else a[:n])
    b_count = len(prompt_ids)
    return {**out, "ref_logprobs": None if ref is None else out["ref_logprobs"],
            "prompt_lens": [len(p) for p in prompt_ids], "rewards": np.asarray(rewards, np.float64),
            "group_ids": (first_sample + np.arange(b_count)) // num_generations}


class GRPORecording:
    """The hook `record_grpo` installs; ``recorder`` is the run's `Recorder`, ``steps`` the steps written."""

    def __init__(self, trainer: Any, recorder: Recorder) -> None:
        self.trainer, self.recorder = trainer, recorder
        self.steps: list[int] = []
        self._samples = 0
        self._generated: tuple | None = None
        self._rewards: np.ndarray | None = None
        # A batch's step is written once the optimizer steps that train on it are done, with their
        # loss and grad norm: the batch waits here until the next one is generated (or training ends).
        self._pending: dict[str, Any] | None = None
        self._micro: list[float] = []                      # micro-step losses of the optimizer step under way
        self._updates: list[tuple[float, float]] = []      # (loss, grad norm) of the pending batch's optimizer steps
        generate, rewards, score = (trainer._generate, trainer._calculate_rewards,
                                    trainer._generate_and_score_completions)
        training_step, grad_norm = trainer.training_step, trainer._get_grad_norm

        def _generate(prompts: list) -> tuple:
            self._generated = generate(prompts)
            return self._generated

        def _calculate_rewards(*args: Any, **kwargs: Any) -> Any:
            per_func = rewards(*args, **kwargs)
            self._rewards = self._weighted(per_func)
            return per_func

        def _generate_and_score_completions(inputs: Any) -> dict[str, Any]:
            output = score(inputs)
            if trainer.model.training:          # eval batches are not training steps
                self._record(output)
            return output

        def _training_step(*args: Any, **kwargs: Any) -> Any:
            loss = training_step(*args, **kwargs)   # already scaled by 1 / gradient_accumulation_steps
            self._micro.append(float(loss))
            return loss

        def _get_grad_norm(*args: Any, **kwargs: Any) -> Any:
            norm = grad_norm(*args, **kwargs)       # the optimizer step's norm, as TRL logs it
            self._updates.append((sum(self._micro), float(norm)))
            self._micro = []
            return norm

        trainer._generate, trainer._calculate_rewards = _generate, _calculate_rewards
        trainer._generate_and_score_completions = _generate_and_score_completions
        trainer.training_step, trainer._get_grad_norm = _training_step, _get_grad_norm
        trainer.add_callback(_WriteLastStep(self))

    def _weighted(self, per_func: Any) -> np.ndarray:
        """[B] rewards: the functions' rewards × ``reward_weights``, NaN where every function gave None."""
        r = _np(per_func).astype(np.float64)
        w = _np(self.trainer.reward_weights).astype(np.float64)
        total = np.nansum(r * w[None, :], axis=1)
        total[np.isnan(r).all(axis=1)] = np.nan
        return total

    def _record(self, output: dict[str, Any]) -> None:
        if self._generated is None or self._rewards is None:
            raise RuntimeError("record_grpo: a batch was scored without passing _generate/_calculate_rewards")
        self.flush()
        arrays = step_arrays(self._generated, output, self._rewards, self.trainer.num_generations, self._samples)
        self._pending = {"policy_version": int(self.trainer.state.global_step), **arrays}
        self._samples += len(arrays["token_ids"])
        self._generated = self._rewards = None

    def flush(self) -> None:
        """Write the pending batch's step, with the mean loss and grad norm of the optimizer steps
        that trained on it (none yet: no loss or grad norm in its metrics)."""
        if self._pending is None:
            return
        step = len(self.steps)
        metrics = {}
        if self._updates:
            losses, norms = zip(*self._updates)
            metrics = {"loss": float(np.mean(losses)), "grad_norm": float(np.mean(norms)),
                       "optimizer_steps": len(self._updates)}
        self.recorder.write_step(step, nan_off_mask=True, metrics=metrics, **self._pending)
        self.steps.append(step)
        self._pending, self._updates = None, []


class _WriteLastStep(TrainerCallback):
    """Writes the last batch's step when training ends (its optimizer steps are done by then)."""

    def __init__(self, recording: GRPORecording) -> None:
        self.recording = recording

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.recording.flush()
        return control


def record_grpo(trainer: Any, run_dir: str | os.PathLike, *, model: str | None = None,
                overwrite: bool = False) -> GRPORecording:
    """Record every generation batch ``trainer`` (a trl ``GRPOTrainer``) trains on into ``run_dir``
    as AxRL steps (step k = the k-th generation batch; policy version = the optimizer steps taken
    before it). Call before ``trainer.train()``."""
    import trl

    missing = [m for m in _WRAPPED if not callable(getattr(trainer, m, None))]
    if missing:
        raise TypeError(f"record_grpo: {type(trainer).__name__} (trl {trl.__version__}) has no {', '.join(missing)}: "
                        "it records a trl GRPOTrainer as trl 1.16.0 writes it (pip install 'axrl[trl]')")
    if trainer.accelerator.num_processes > 1:
        raise NotImplementedError("record_grpo records single-process runs (each rank holds a slice of the batch)")

    engine = "vllm" if getattr(trainer, "use_vllm", False) else "transformers"
    recorder = Recorder(run_dir, engine=engine, backend="trl", overwrite=overwrite,
                        model=model or getattr(trainer.model.config, "_name_or_path", None) or None,
                        source={"framework": "trl", "trl_version": trl.__version__, "trainer": type(trainer).__name__})
    return GRPORecording(trainer, recorder)
