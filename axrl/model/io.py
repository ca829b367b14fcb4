"""Hugging Face model directories: `config.json` + `model.safetensors` (+ tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from axrl.model.config import ModelConfig
from axrl.model.qwen3 import Qwen3ForCausalLM, init_weights

if TYPE_CHECKING:
    from axrl.tokenizer import Tokenizer

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"  # sharded checkpoints (transformers' save_pretrained)
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


def build_model(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """A randomly initialised model; the same seed always gives the same weights."""
    model = Qwen3ForCausalLM(cfg)
    init_weights(model, seed)
    return model.to(dtype)


def hf_state_dict(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """Weights under their HF checkpoint names (tied lm_head omitted, as HF does)."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def save_hf(model: Qwen3ForCausalLM, out_dir: str | Path, tokenizer: "Tokenizer | None" = None) -> Path:
    """Write an HF directory that `transformers` and SGLang load unchanged."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    cfg["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    if tokenizer is not None:
        cfg.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        tokenizer.save(out)
        # What transformers' generate() and SGLang stop on: every eos token of the tokenizer.
        generation = {"eos_token_id": tokenizer.stop_token_ids, "pad_token_id": tokenizer.pad_token_id}
        (out / GENERATION_CONFIG_NAME).write_text(json.dumps(generation, indent=2) + "\n")
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(hf_state_dict(model), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs config.json "
                                "(create one with `axrl model init --preset tiny-moe --out DIR`)")
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: {e}") from e


def load_weights_into(model: Qwen3ForCausalLM, state_dict: dict[str, torch.Tensor], source: str = "state dict") -> None:
    """Copy HF-named weights into `model` in place, checking names and shapes."""
    expected = hf_state_dict(model)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected) - {"lm_head.weight"})
    if missing or unexpected:
        raise ValueError(f"{source}: weight names do not match the model config "
                         f"(missing {missing[:5]}{'…' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''})")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, target in expected.items():
            src = state_dict[name]
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(f"{source}: '{name}' has shape {tuple(src.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
            params[name].copy_(src.to(params[name].dtype))


def read_weights(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """The safetensors weights of an HF directory (one file, or the shards an index names) and a
    description of where they came from."""
    d = Path(model_dir)
    single, index = d / WEIGHTS_NAME, d / WEIGHTS_INDEX_NAME
    if single.is_file():
        return load_file(str(single)), str(single)
    if not index.is_file():
        if any(d.glob("*.bin")) or any(d.glob("*.pt")):
            raise FileNotFoundError(f"{d} holds pickled PyTorch weights (*.bin/*.pt); AxRL reads safetensors only: "
                                    "convert with transformers (from_pretrained(DIR).save_pretrained(DIR))")
        raise FileNotFoundError(f"{single} not found (nor {WEIGHTS_INDEX_NAME} for sharded weights)")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from None
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not (d / shard).is_file():
            raise FileNotFoundError(f"{d / shard} not found ({index} names it)")
        weights.update(load_file(str(d / shard)))
    return weights, f"{index} ({len(shards)} shards)"


def load_hf(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """Load an HF Qwen3 / Qwen3-MoE directory (e.g. one written by `save_hf` or by transformers)."""
    cfg = load_config(model_dir)
    weights, source = read_weights(model_dir)
    model = Qwen3ForCausalLM(cfg).to(dtype)
    load_weights_into(model, weights, source=source)
    return model
