"""Train side: the backend protocol, the embedded PyTorch backend and its building blocks."""

from axrl.train.determinism import RngState, capture_rng_state, restore_rng_state, set_determinism
from axrl.train.fingerprint import weights_fingerprint
from axrl.train.micro_batch import (PaddedMicroBatch, micro_batches, next_token_logprobs, pad_micro_batch,
                                    split_micro_batches, unpad)
from axrl.train.optim import clip_grads_, grad_norm, lr_at
from axrl.train.protocol import (ForwardResult, LossContext, LossFn, PackedBatch, StepStats, TrainBackend,
                                 TrainMetrics)
from axrl.train.settings import BackendConfig
from axrl.train.torch.backend import TorchBackend, TorchBackendConfig

__all__ = [
    "BackendConfig", "ForwardResult", "LossContext", "LossFn", "PackedBatch", "PaddedMicroBatch", "RngState",
    "StepStats", "TorchBackend", "TorchBackendConfig", "TrainBackend", "TrainMetrics", "capture_rng_state",
    "clip_grads_", "grad_norm", "lr_at", "micro_batches", "next_token_logprobs", "pad_micro_batch", "restore_rng_state",
    "set_determinism", "split_micro_batches", "unpad", "weights_fingerprint",
]
