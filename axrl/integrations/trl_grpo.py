"""Record a TRL ``GRPOTrainer`` run as an AxRL trace (`record_grpo`), so `axrl-debug` analyses it.

Written against trl 1.16.0 (``trl/trainer/grpo_trainer.py``) and transformers 5's ``Trainer``. The
hook wraps methods of the trainer *instance* (not the class) and records one AxRL step per
generation batch, written once the optimizer steps that train on the batch are done:

* ``_generate_single_turn`` → the sampler's per-token logprobs (``/tokens/rollout_logprob``). With
  vLLM they are vLLM's (``sampling_per_token_logps``). With transformers' ``generate`` (TRL's
  default) TRL keeps none, so the hook appends one logits processor *after* every other one of that
  ``generate`` call (temperature, top-k, top-p…: it sees the distribution the token was drawn from)
  and keeps log-softmax of it at the sampled token — O(batch × vocab) memory, not the
  batch × length × vocab of ``output_scores``. TRL itself is handed back exactly what it returned.
  Not captured (NaN): ``use_transformers_continuous_batching`` and models whose ``generate`` is not
  the unwrapped model's own (PEFT wrappers);
* ``_generate`` → the unpadded prompt and completion ids;
* ``_calculate_rewards`` → the rewards per function, summed with ``reward_weights`` as TRL does;
* ``_generate_and_score_completions`` → ``completion_mask`` (× ``tool_mask``: tool output is not
  trained) as the loss mask, ``advantages`` [B], ``old_per_token_logps`` and ``ref_per_token_logps``,
  and, with vLLM's importance-sampling correction, ``importance_sampling_ratio`` (its min / mean /
  max over the trained tokens go to the step's metrics, as TRL logs them). The hook adds one inert
  key (``_axrl_row``: each sample's row in the batch) so that it can find the rows again after TRL
  shuffles and splits the batch into micro-batches;
* ``_compute_loss`` → the new per-token logprobs and entropies of every loss forward (TRL's
  ``_get_per_token_logps_and_entropies`` under ``_compute_loss``). TRL computes
  ``old_per_token_logps`` itself only with vLLM importance sampling or when generation and
  optimizer steps are misaligned; otherwise (its defaults) it uses the first loss forward's
  ``per_token_logps.detach()`` as old, and so does the hook: ``/tokens/old_logprob`` is then that
  forward's logprobs. ``/tokens/entropy`` is the first loss forward's entropy; the step's metric
  ``new_old_max_abs_delta`` is the largest |new − old| over the trained tokens of all its loss
  forwards (0 when every sample is trained on once, from the weights that generated it);
* ``training_step`` and ``_get_grad_norm`` (the ``Trainer``'s) → each optimizer step's loss (the sum
  of its micro-steps' scaled losses, as the Trainer logs it) and gradient norm; the step's
  metrics hold their means over the batch's optimizer steps (``loss``, ``grad_norm``) and their
  count (``optimizer_steps``).

TRL's per-token logprobs are over the completion, entry c = log p(completion token c | prompt,
earlier completion tokens): the token's own position, as in AxRL (no shift). Groups: TRL repeats
each prompt ``num_generations`` times consecutively. Single process only (each rank holds a slice).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

import numpy as np
import torch
from transformers import TrainerCallback

from axrl.integrations.trl_vllm_cpu import colocated_model, needs_expert_repack, repack_after_sync
from axrl.trace import Recorder

__all__ = ["GRPORecording", "record_grpo", "step_arrays"]
# the trainer methods the hook wraps (trl 1.16.0's GRPOTrainer, transformers' Trainer)
_WRAPPED = ("_generate", "_generate_single_turn", "_calculate_rewards", "_generate_and_score_completions",
            "_compute_loss", "_get_per_token_logps_and_entropies", "training_step", "_get_grad_norm")
ROW_KEY = "_axrl_row"  # the inert batch key that finds a sample's row after TRL's shuffle and split


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


class SamplerLogprobs:
    """A logits processor appended after all of a ``generate`` call's others: at each step it sees
    the distribution the next token is drawn from, keeps its log-softmax, and on the next step
    (whose ``input_ids`` end with the token drawn) keeps the logprob of that token."""

    def __init__(self) -> None:
        self.taken: list[torch.Tensor] = []          # [B] per finished step
        self.pending: torch.Tensor | None = None     # [B, V] log-softmax of the last step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.taken.append(self.pending.gather(1, input_ids[:, -1:].to(self.pending.device)).squeeze(1))
        self.pending = torch.log_softmax(scores.detach().float(), dim=-1)
        return scores

    def per_sample(self, completion_ids: list[list[int]]) -> list[list[float]] | None:
        """Each completion's per-token logprobs (completions end at their EOS; the last step's
        token is read from ``completion_ids``); None when ``generate`` never called it."""
        if self.pending is None:
            return None
        steps = len(self.taken) + 1
        taken = torch.stack(self.taken, 1).tolist() if self.taken else [[] for _ in completion_ids]
        out = []
        for b, c in enumerate(completion_ids):
            row = taken[b][:len(c)]
            if len(c) == steps:
                row.append(float(self.pending[b, c[-1]]))
            out.append(row)
        return out


def _sample_rows(batch: int, captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
                 width: int) -> tuple[np.ndarray, np.ndarray, float]:
    """From the loss forwards' (rows, logprobs, entropies): each row's first logprobs and
    entropies [B, C] (NaN where never trained on) and the largest |new − first| of later passes."""
    first = np.full((batch, width), np.nan)
    entropy = np.full((batch, width), np.nan)
    seen = np.zeros(batch, bool)
    delta = 0.0
    for rows, logps, ent in captured:
        lp, r = logps.numpy(), rows.numpy()
        w = min(width, lp.shape[1])
        for k, row in enumerate(r):
            if seen[row]:
                d = np.abs(lp[k, :w] - first[row, :w])
                delta = max(delta, float(np.nanmax(d, initial=0.0)))
            else:
                seen[row] = True
                first[row, :w] = lp[k, :w]
                if ent is not None:
                    entropy[row, :w] = ent.numpy()[k, :w]
    return first, entropy, delta


class GRPORecording:
    """The hook `record_grpo` installs; ``recorder`` is the run's `Recorder`, ``steps`` the steps written."""

    def __init__(self, trainer: Any, recorder: Recorder) -> None:
        self.trainer, self.recorder = trainer, recorder
        self.steps: list[int] = []
        self._samples = 0
        self._generated: tuple | None = None
        self._rewards: np.ndarray | None = None
        self._substituted = False      # the sampler logprobs of the call under way are the hook's, not TRL's
        self._loss_rows: torch.Tensor | None = None
        # A batch's step is written once the optimizer steps that train on it are done, with their
        # loss and grad norm: the batch waits here until the next one is generated (or training ends).
        self._pending: dict[str, Any] | None = None
        self._forwards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []  # the pending batch's
        self._micro: list[float] = []                      # micro-step losses of the optimizer step under way
        self._updates: list[tuple[float, float]] = []      # (loss, grad norm) of the pending batch's optimizer steps
        self._wrap_generation(trainer)
        self._wrap_training(trainer)
        trainer.add_callback(_WriteLastStep(self))

    def _wrap_generation(self, trainer: Any) -> None:
        generate, single_turn, rewards, score = (trainer._generate, trainer._generate_single_turn,
                                                 trainer._calculate_rewards, trainer._generate_and_score_completions)

        def _generate(prompts: list) -> tuple:
            self._substituted = False
            out = generate(prompts)
            self._generated = out
            if self._substituted:     # TRL had no sampler logprobs: it gets back the None it made
                out = (*out[:4], None, *out[5:])
            return out

        def _generate_single_turn(*args: Any, **kwargs: Any) -> tuple:
            if getattr(trainer, "use_vllm", False) or getattr(trainer, "use_transformers_continuous_batching", False):
                return single_turn(*args, **kwargs)
            capture = SamplerLogprobs()
            with _appended_processor(trainer, capture):
                completion_ids, logprobs = single_turn(*args, **kwargs)
            if logprobs is None:
                logprobs = capture.per_sample(completion_ids)
                self._substituted = logprobs is not None
            return completion_ids, logprobs

        def _calculate_rewards(*args: Any, **kwargs: Any) -> Any:
            per_func = rewards(*args, **kwargs)
            self._rewards = self._weighted(per_func)
            return per_func

        def _generate_and_score_completions(inputs: Any) -> dict[str, Any]:
            output = score(inputs)
            if trainer.model.training:          # eval batches are not training steps
                self._record(output)
                output[ROW_KEY] = torch.arange(output["completion_ids"].size(0))
            return output

        trainer._generate, trainer._generate_single_turn = _generate, _generate_single_turn
        trainer._calculate_rewards = _calculate_rewards
        trainer._generate_and_score_completions = _generate_and_score_completions

    def _wrap_training(self, trainer: Any) -> None:
        compute_loss, per_token = trainer._compute_loss, trainer._get_per_token_logps_and_entropies
        training_step, grad_norm = trainer.training_step, trainer._get_grad_norm

        def _compute_loss(model: Any, inputs: dict[str, Any]) -> Any:
            self._loss_rows = inputs.get(ROW_KEY)
            try:
                return compute_loss(model, inputs)
            finally:
                self._loss_rows = None

        def _get_per_token_logps_and_entropies(*args: Any, **kwargs: Any) -> Any:
            out = per_token(*args, **kwargs)
            if self._loss_rows is not None and kwargs.get("compute_entropy"):   # the loss's policy forward
                ent = None if out[1] is None else out[1].detach().float().cpu()
                self._forwards.append((self._loss_rows.cpu(), out[0].detach().float().cpu(), ent))
                self._loss_rows = None
            return out

        def _training_step(*args: Any, **kwargs: Any) -> Any:
            loss = training_step(*args, **kwargs)   # already scaled by 1 / gradient_accumulation_steps
            self._micro.append(float(loss))
            return loss

        def _get_grad_norm(*args: Any, **kwargs: Any) -> Any:
            norm = grad_norm(*args, **kwargs)       # the optimizer step's norm, as TRL logs it
            self._updates.append((sum(self._micro), float(norm)))
            self._micro = []
            return norm

        trainer._compute_loss, trainer._get_per_token_logps_and_entropies = _compute_loss, \
            _get_per_token_logps_and_entropies
        trainer.training_step, trainer._get_grad_norm = _training_step, _get_grad_norm

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
        metrics = _is_ratio_metrics(output)
        self._pending = {"policy_version": int(self.trainer.state.global_step), **arrays,
                         "_trl_old": output.get("old_per_token_logps") is not None,
                         "_width": int(output["completion_ids"].size(1)), "_metrics": metrics}
        self._samples += len(arrays["token_ids"])
        self._generated = self._rewards = None

    def _with_forwards(self, pending: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """The pending step's arrays with the loss forwards' logprobs and entropies merged in."""
        trl_old, width, metrics = pending.pop("_trl_old"), pending.pop("_width"), pending.pop("_metrics")
        if not self._forwards:
            return pending, metrics
        lengths = [len(m) for m in pending["loss_mask"]]
        first, entropy, delta = _sample_rows(len(lengths), self._forwards, width)
        pending["entropy"] = [entropy[b, :n] for b, n in enumerate(lengths)]
        if not trl_old:   # TRL's own old logprobs are this forward's (per_token_logps.detach())
            pending["trainer_logprobs"] = [first[b, :n] for b, n in enumerate(lengths)]
        olds = pending["trainer_logprobs"]
        for b, n in enumerate(lengths):
            trained = pending["loss_mask"][b] != 0
            d = np.abs(first[b, :n] - olds[b])[trained]
            delta = max(delta, float(np.nanmax(d, initial=0.0)))
        return pending, {**metrics, "new_old_max_abs_delta": delta}

    def flush(self) -> None:
        """Write the pending batch's step, with the mean loss and grad norm of the optimizer steps
        that trained on it (none yet: no loss or grad norm in its metrics)."""
        if self._pending is None:
            return
        step = len(self.steps)
        pending, metrics = self._with_forwards(self._pending)
        if self._updates:
            losses, norms = zip(*self._updates)
            metrics |= {"loss": float(np.mean(losses)), "grad_norm": float(np.mean(norms)),
                        "optimizer_steps": len(self._updates)}
        self.recorder.write_step(step, nan_off_mask=True, metrics=metrics, **pending)
        self.steps.append(step)
        self._pending, self._updates, self._forwards = None, [], []


def _is_ratio_metrics(output: dict[str, Any]) -> dict[str, float]:
    """Min / mean / max of vLLM's importance-sampling ratio over the trained tokens (TRL's
    ``sampling/importance_sampling_ratio/*``); empty without it."""
    ratio = output.get("importance_sampling_ratio")
    if ratio is None:
        return {}
    mask = output["completion_mask"] if output.get("tool_mask") is None else \
        output["completion_mask"] * output["tool_mask"]
    r = _np(ratio)
    values = r.reshape(-1) if r.shape[1] == 1 else r[_np(mask) != 0]   # sequence modes: [B, 1]
    if values.size == 0:
        return {}
    return {"is_ratio_min": float(values.min()), "is_ratio_mean": float(values.mean()),
            "is_ratio_max": float(values.max())}


@contextlib.contextmanager
def _appended_processor(trainer: Any, processor: SamplerLogprobs) -> Iterator[None]:
    """While TRL's ``generate`` runs: the unwrapped model's logits-processor list gets
    ``processor`` last (after temperature, top-k, top-p…); restored afterwards."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    build = getattr(model, "_get_logits_processor", None)
    if build is None:
        yield
        return
    own = "_get_logits_processor" in vars(model)

    def _get_logits_processor(*args: Any, **kwargs: Any) -> Any:
        processors = build(*args, **kwargs)
        processors.append(processor)
        return processors

    model._get_logits_processor = _get_logits_processor
    try:
        yield
    finally:
        if own:
            model._get_logits_processor = build
        else:
            del model._get_logits_processor


class _WriteLastStep(TrainerCallback):
    """Writes the last batch's step when training ends (its optimizer steps are done by then)."""

    def __init__(self, recording: GRPORecording) -> None:
        self.recording = recording

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.recording.flush()
        return control


def _precisions(trainer: Any) -> dict[str, Any]:
    """config.yaml's dtypes: the trainer's, and the sampler's where the hook can see it (transformers'
    `generate` runs the trainer's model; a colocated vLLM engine its own, bf16 for a float32 model on
    vLLM's CPU build, as TRL passes no dtype). `axrl-debug doctor` sizes its envelope by the sampler's."""
    dtype = getattr(trainer.model, "dtype", None)
    config: dict[str, Any] = {"model": {"dtype": str(dtype).removeprefix("torch.")}} if dtype is not None else {}
    engine_model = colocated_model(trainer) if getattr(trainer, "use_vllm", False) else trainer.model
    engine_dtype = next((p.dtype for p in engine_model.parameters()), None) if engine_model is not None else None
    if engine_dtype is not None:
        config["rollout"] = {"dtype": str(engine_dtype).removeprefix("torch.")}
    return config


def record_grpo(trainer: Any, run_dir: str | os.PathLike, *, model: str | None = None,
                overwrite: bool = False, repack_vllm_cpu_experts: bool = False) -> GRPORecording:
    """Record every generation batch ``trainer`` (a trl ``GRPOTrainer``) trains on into ``run_dir``
    as AxRL steps (step k = the k-th generation batch; policy version = the optimizer steps taken
    before it). Call before ``trainer.train()``.

    ``repack_vllm_cpu_experts``: with TRL's colocated vLLM on vLLM's CPU build, re-run the MoE
    experts kernel's re-packing after each of TRL's weight pushes (`axrl.integrations.trl_vllm_cpu`:
    without it that engine samples from unpacked expert bytes). Off by default, as the hook never
    changes what TRL computes unasked; when the engine needs it and it is off, a warning says so."""
    import trl

    missing = [m for m in _WRAPPED if not callable(getattr(trainer, m, None))]
    if missing:
        raise TypeError(f"record_grpo: {type(trainer).__name__} (trl {trl.__version__}) has no {', '.join(missing)}: "
                        "it records a trl GRPOTrainer as trl 1.16.0 writes it (pip install 'axrl[trl]')")
    if trainer.accelerator.num_processes > 1:
        raise NotImplementedError("record_grpo records single-process runs (each rank holds a slice of the batch)")

    engine = "vllm" if getattr(trainer, "use_vllm", False) else "transformers"
    source = {"framework": "trl", "trl_version": trl.__version__, "trainer": type(trainer).__name__}
    if needs_expert_repack(trainer):
        source["vllm_cpu_expert_repack"] = repack_vllm_cpu_experts
        if repack_vllm_cpu_experts:
            repack_after_sync(trainer)
        else:
            warnings.warn("record_grpo: TRL's colocated vLLM runs on vLLM's CPU build, whose MoE experts kernel "
                          "re-packs the experts at load only: TRL's weight pushes leave them unpacked and the "
                          "engine samples from the wrong weights (docs/import.md). Pass "
                          "record_grpo(..., repack_vllm_cpu_experts=True) to re-pack them after each push.",
                          stacklevel=2)
    recorder = Recorder(run_dir, engine=engine, backend="trl", overwrite=overwrite,
                        model=model or getattr(trainer.model.config, "_name_or_path", None) or None, source=source,
                        config=_precisions(trainer))
    return GRPORecording(trainer, recorder)
