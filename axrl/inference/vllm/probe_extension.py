"""A vLLM worker extension that captures one forward pass at bisect's probe points.

Loaded into the vLLM server's worker (`--worker-extension-cls
axrl.inference.vllm.probe_extension.ProbeExtension`; the server's PYTHONPATH must reach this
repository) and driven through `collective_rpc` (`POST /collective_rpc`, served when
`VLLM_SERVER_DEV_MODE=1`):

    axrl_probe_arm(n_tokens, path)   forward hooks on the model's modules; the next forward pass of
                                     at least n_tokens tokens is kept, written to `path` (torch.save),
                                     and the hooks removed
    axrl_probe_disarm()              remove the hooks without capturing

What is kept, named as SGLang's tensor dump names them (replay/bisect_sglang.py maps both onto the
probe points): `model.embed_tokens`, per layer `input_layernorm` (normed, residual),
`self_attn.o_proj` (the attention's output), `post_attention_layernorm` (normed, residual),
`mlp.gate` (router logits, where vLLM's fused MoE calls it as a module), `mlp` (the combined MoE
output) and `model.norm`, plus `model.forward_batch_info.input_ids`. vLLM's fused MoE keeps no
per-expert outputs and its top-k is no module: those are recomputed on the AxRL side.

This module must import nothing from vLLM or AxRL at import time (it is loaded by vLLM's worker).
"""

from __future__ import annotations

from typing import Any

import torch


def _tensors(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, (tuple, list)):
        kept = [t.detach().to("cpu", copy=True) for t in x if isinstance(t, torch.Tensor)]
        return kept[0] if len(kept) == 1 else kept
    return None


class ProbeExtension:
    """Mixed into vLLM's worker class (`self.model_runner` is the worker's)."""

    def _axrl_model(self) -> torch.nn.Module:
        runner = getattr(self, "model_runner")
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return getattr(model, "model", model)

    def axrl_probe_arm(self, n_tokens: str, path: str) -> str:
        """Hook the next forward pass of `n_tokens` tokens; it is saved to `path`."""
        self.axrl_probe_disarm()
        inner = self._axrl_model()
        want, state = int(n_tokens), {"pass": {}, "on": False}
        handles = []
        self._axrl_seen = []

        # The pass starts at embed_tokens (its input: the ids) and ends at the final norm; the inner
        # model's own hooks do not run (vLLM's compile decorator calls its forward directly).
        def start(module, args):
            ids = args[0] if args else None
            size = int(ids.shape[0]) if isinstance(ids, torch.Tensor) else -1
            self._axrl_seen.append(size)
            # a prefill of the sample's length; the runner may pad the batch past it (AxRL cuts the rows)
            state["on"] = size >= want and not state.get("done")
            if state["on"]:
                state["pass"] = {"model.forward_batch_info.input_ids": ids.detach().cpu().clone()}

        def end(module, args, output):
            if state["on"]:
                state["pass"]["model.norm"] = _tensors(output)
                torch.save(state["pass"], path)
                state["on"], state["done"] = False, True   # kept once; AxRL disarms through the RPC

        def keep(name: str):
            def hook(module, args, output):
                if state["on"]:
                    value = _tensors(output)
                    if value is not None:
                        state["pass"][name] = value
            return hook

        handles.append(inner.embed_tokens.register_forward_pre_hook(start))
        for name, module in inner.named_modules():
            key = _key(name)
            if key is not None and key != "model.norm":
                handles.append(module.register_forward_hook(keep(key)))
        handles.append(inner.norm.register_forward_hook(end))
        self._axrl_handles = handles
        return f"armed for {want} tokens, {len(handles) - 2} module hooks"

    def axrl_probe_seen(self) -> list:
        """The token counts of the forward passes seen since arming (-1: no input ids)."""
        return list(getattr(self, "_axrl_seen", []))

    def axrl_probe_disarm(self) -> str:
        """Remove every hook this extension installed."""
        for h in getattr(self, "_axrl_handles", []):
            h.remove()
        self._axrl_handles = []
        return "disarmed"


def _key(name: str) -> str | None:
    """The dump name of an inner-model module kept, or None (`name` relative to the inner model)."""
    if name in ("embed_tokens", "norm"):
        return f"model.{name}"
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != "layers":
        return None
    rest = ".".join(parts[2:])
    mapping = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
               "self_attn": "self_attn.o_proj", "mlp.gate": "mlp.gate", "mlp": "mlp"}
    return f"model.layers.{parts[1]}.{mapping[rest]}" if rest in mapping else None
