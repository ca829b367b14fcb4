"""A training model of the service: the run's train backend, the step being accumulated, and the
run directory it records into (one trace step per optim_step, checkpoints at save_weights).

Every method runs on the service's one training thread, in the model's seq_id order.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from axrl.runtime.results import UpdateResult
from axrl.runtime.recording.step_writer import StepWriter
from axrl.runtime.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from axrl.tinker_api.batch import pack, per_datum
from axrl.tinker_api.errors import UserError
from axrl.tinker_api.losses import ServiceLoss, check_loss
from axrl.tinker_api.recording import CallRouting, RecordedCall, metrics_row, step_record
from axrl.tinker_api.routing import RoutingMemory
from axrl.tinker_api.training import CallSpec, apply_optim, check_adam, merged_metrics, run_call
from axrl.tinker_api.wire import ForwardBackwardCall, encode_forward_backward_output
from axrl.trace import RunDir
from axrl.train.protocol import LossContext, PackedBatch, TrainBackend


class ServiceModel:
    """One `create_model`: `model_id` = `{session}:train:{seq}`, trained by `backend`, recorded in `run`."""

    def __init__(self, model_id: str, backend: TrainBackend, run: RunDir, base_model: str,
                 lora_rank: int | None, routing: RoutingMemory | None = None,
                 release: Callable[[], None] | None = None) -> None:
        self.model_id, self.backend, self.run = model_id, backend, run
        self.release = release  # frees the trainer (its processes or actors) when the service stops
        # the sampler's memory of sampled sequences' routing (None: a dense model)
        self.routing = routing if backend.model_config.num_experts else None
        self.base_model, self.lora_rank = base_model, lora_rank
        self.step = 0
        self.calls: list[RecordedCall] = []
        self.started = 0.0
        self.fingerprint = backend.fingerprint()
        # Step files are written in the background, off the step's critical path (as `axrl train` does).
        self.writer = StepWriter(run.write_step, max_pending=2)
        save_checkpoint(run.path, 0, backend, self._state("create_model"))

    def _state(self, why: str) -> dict[str, Any]:
        return {"policy_version": self.step, "source": "tinker", "model_id": self.model_id, "why": why}

    @property
    def num_samples(self) -> int:
        return self.calls[-1].spec.end if self.calls else 0

    def forward_backward(self, call: ForwardBackwardCall) -> bytes:
        """One forward_backward (gradients accumulate until optim_step) or forward (`forward_only`);
        the ForwardBackwardOutput protobuf: per-datum logprobs and elementwise_loss, `loss:sum`."""
        config = check_loss(call.loss_fn, call.loss_fn_config)
        mc = self.backend.model_config
        batch = pack(call.data, call.loss_fn, mc.vocab_size, getattr(mc, "max_position_embeddings", None))
        if call.forward_only:
            res = self.backend.forward(batch)
            loss, cols = ServiceLoss(call.loss_fn, config)(res.logprobs, res.entropy, batch, LossContext.of(batch))
            logprobs, elementwise, total = res.logprobs, cols["tokens/elementwise_loss"], float(loss)
        else:
            if not self.calls:
                self.started = time.perf_counter()
            routing = self._routing(batch)
            metrics = run_call(self.backend, batch, call.loss_fn, config)
            batch.old_logprobs = metrics.tokens["logprobs"]
            start = self.num_samples
            self.calls.append(RecordedCall(CallSpec(call.loss_fn, config, start, start + batch.num_samples),
                                           batch, metrics, routing))
            logprobs, elementwise, total = metrics.tokens["logprobs"], metrics.tokens["elementwise_loss"], metrics.loss
        outputs = {"logprobs": per_datum(batch, logprobs), "elementwise_loss": per_datum(batch, elementwise)}
        return encode_forward_backward_output(outputs, {"loss:sum": total}, batch.num_samples)

    def _routing(self, batch: PackedBatch) -> CallRouting | None:
        """The call's routing when its datums include sequences the service sampled: the engine's
        rows for those, and the trainer's from a no-grad forward at the weights about to be trained
        (one extra forward, only for calls that carry sampled sequences)."""
        if self.routing is None:
            return None
        off = batch.offsets.tolist()
        found = self.routing.batch_rows([batch.input_ids[a:b].tolist() for a, b in zip(off[:-1], off[1:])])
        if found is None:
            return None
        train = self.backend.forward(batch).routed_experts
        if train is None:
            return None
        rollout, valid = found
        return CallRouting(rollout, valid, train.cpu().numpy().astype(np.int16), self.backend.model_config.num_experts)

    def optim_step(self, params: dict[str, Any]) -> dict[str, Any]:
        """The AdamW update over the gradients accumulated since the last one; closes trace step `step`."""
        adam = check_adam(params)
        if not self.calls:
            raise UserError("optim_step: no forward_backward since the last optim_step (nothing to update)")
        train_s = time.perf_counter() - self.started
        t0 = time.perf_counter()
        stats = apply_optim(self.backend, adam)
        update = UpdateResult(list(range(self.num_samples)), merged_metrics([c.metrics for c in self.calls]),
                              stats, self.backend.fingerprint())
        optim_s = time.perf_counter() - t0
        record = step_record(self.step, self.calls, update, self.fingerprint, adam,
                             {"train": train_s + optim_s, "optim": optim_s})
        self.writer.submit(record)
        self.run.append_metrics(metrics_row(record, update, {"time_train": train_s + optim_s}))
        self.fingerprint, self.calls = update.fingerprint, []
        self.step += 1
        return {"metrics": {"grad_norm:mean": stats.grad_norm, "learning_rate:mean": stats.lr,
                            "loss:sum": update.metrics.loss}}

    def save_state(self) -> Path:
        """A checkpoint of the state before the next step (weights, AdamW moments, RNG)."""
        if self.calls:
            raise UserError("save_weights: a forward_backward is pending (its gradients are not in a checkpoint); "
                            "call optim_step first")
        self.writer.flush()
        return save_checkpoint(self.run.path, self.step, self.backend, self._state("save_weights"))

    def load_state(self, path: Path, optimizer: bool) -> None:
        """Weights (and AdamW moments when `optimizer`) from a checkpoint; recorded as a checkpoint of
        this run, so the steps after it replay from it."""
        if self.calls:
            raise UserError("load_weights: a forward_backward is pending; call optim_step first")
        load_checkpoint(path, self.backend)
        if not optimizer:
            self.backend.reset_optimizer()
        self.fingerprint = self.backend.fingerprint()
        save_checkpoint(self.run.path, self.step, self.backend, self._state("load_weights"))

    def export(self, name: str) -> Path:
        """The current model as a Hugging Face directory RUN/sampler_weights/NAME (with LoRA: merged),
        which `axrl serve --model-path` and transformers load."""
        if "/" in name or name in ("", ".", ".."):
            raise UserError(f"path {name!r}: a sampler weights name must be a plain file name")
        return self.backend.export_hf(self.run.path / "sampler_weights" / name)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights (HF names) for a sampler snapshot."""
        return dict(self.backend.named_weights())

    def checkpoints(self) -> list[tuple[int, Path]]:
        return list_checkpoints(self.run.path)

    def close(self) -> None:
        """Write the step files still queued, then release the trainer."""
        self.writer.close()
        if self.release is not None:
            self.release()
