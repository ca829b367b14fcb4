"""The embedded PyTorch backend (`backend.py`: `TorchBackend`), its LoRA adapters (`lora.py`) and
the deep per-layer dumps replay takes from it (`inspection.py`). What it shares with the Megatron
backend (`axrl/train/megatron/`) lives one level up in `axrl/train/`."""

from axrl.train.torch.backend import TorchBackend, TorchBackendConfig

__all__ = ["TorchBackend", "TorchBackendConfig"]
