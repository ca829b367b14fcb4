"""The embedded Qwen3 / Qwen3-MoE policy model."""

from axrl.model.config import PRESETS, ModelConfig, preset_config
from axrl.model.io import build_model, hf_state_dict, load_config, load_hf, load_weights_into, save_hf
from axrl.model.qwen3 import ActivationProbe, ModelOutput, Qwen3ForCausalLM

__all__ = [
    "PRESETS", "ActivationProbe", "ModelConfig", "ModelOutput", "Qwen3ForCausalLM", "build_model", "hf_state_dict",
    "load_config", "load_hf", "load_weights_into", "preset_config", "save_hf",
]
