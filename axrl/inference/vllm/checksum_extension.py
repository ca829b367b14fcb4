"""The vLLM worker side of the sync sentinel's checksums: per-tensor checksums of the weights the
worker computes with, named by their HF keys.

Called through `collective_rpc` (`POST /collective_rpc`, dev mode) as
`axrl_weight_checksums(weights_path)`, where `weights_path` is the HF directory the server was
last given (the trainer's export of the version under test). vLLM keeps the weights in its
kernels' layouts, not the HF tensors, so each parameter is read as follows:

* fused linears (`qkv_proj`, `gate_up_proj`; the model's `packed_modules_mapping`): split back
  into their HF parts along dim 0, with the part sizes of the directory's tensors;
* stacked experts (`experts.w13_weight` [E, 2I, H] = gate then up, `experts.w2_weight` [E, H, I]):
  one slice per expert; where the build re-packs them for its kernel (the CPU build's
  `prepack_moe_weight`, with padding of I), the directory's experts are put through the layer's
  own re-packing and the packed bytes are compared per expert, inside the worker;
* a parameter the build emptied because its kernel computes from an opaque handle (the CPU
  build's oneDNN / packed GEMM linears: `weight` becomes an empty tensor) cannot be read: its HF
  names are returned as unreadable, and the sentinel's probe covers them;
* everything else (embeddings, norms, lm_head) is read as it is.

Returns `{"held": {hf_name: checksum}, "expected": {name: checksum}, "unreadable": [hf_name],
"packed": {name: [the HF names it stands for]}, "dtype": "torch.float32"}`, each checksum `[digest, sample_sum, numel]` as `axrl.sync.checksums` computes
it. `expected` holds only what the worker had to derive itself (re-packed experts); every other
held tensor is compared by the caller with the trainer's own tensor. Re-packed experts are named
`model.layers.L.mlp.experts.E.gate_up_proj.weight` and `…experts.E.down_proj.weight`.

Like `probe_extension`, nothing from vLLM or AxRL is imported at import time.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import torch

_EXPERT_PARAMS = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _checksum(t: torch.Tensor) -> list:
    from axrl.sync.checksums import tensor_checksum

    c = tensor_checksum(t)
    return [c.digest, c.sample_sum, c.numel]


class ChecksumExtension:
    """Mixed into vLLM's worker class (`self.model_runner` is the worker's)."""

    def axrl_repack_experts(self, weights_path: str) -> str:
        """Re-pack every experts module's stacked tensors in place, as a fresh load does; call it
        after `reload_weights(weights_path)` (the server paused). On the CPU build the in-place
        reload copies the new experts into the packed parameters in vLLM's plain layout and skips
        the re-packing (`_setup_kernel` runs the kernel's `process_weights_after_loading` on the
        first load only), so the kernel reads unpacked bytes: the stale reload of docs/vllm.md.
        A module is re-packed only when it holds exactly `weights_path`'s experts in the plain
        layout (a vLLM that re-packs on reload itself is left alone, never packed twice);
        returns a JSON count of modules `repacked`, `already_packed` and `neither` (for the sync
        sentinel's checksums to name)."""
        hf = _hf_tensors(Path(weights_path))
        return json.dumps(repack_experts(_worker_model(self), plain_experts_from(hf)))

    def axrl_weight_checksums(self, weights_path: str) -> str:
        """Per-tensor checksums of the worker's weights (module docstring), as a JSON string."""
        model = _worker_model(self)
        hf = _hf_tensors(Path(weights_path))
        fused = dict(getattr(model, "packed_modules_mapping", {}) or {})
        out: dict[str, Any] = {"held": {}, "expected": {}, "unreadable": [], "packed": {},
                               "dtype": str(next(model.parameters()).dtype)}
        with torch.no_grad():
            experts = _expert_modules(model)
            for name, layer in experts.items():
                _experts(out, layer, _hf_prefix(name), hf)
            for name, param in model.named_parameters():
                if name.rpartition(".")[0] not in experts:
                    _plain(out, name, param, hf, fused)
        return json.dumps(out)


def _worker_model(worker: Any) -> torch.nn.Module:
    """The model a vLLM worker runs (`model_runner.get_model()`, or its `model` attribute)."""
    runner = getattr(worker, "model_runner")
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


def repack_experts(model: torch.nn.Module,
                   plain_of: Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor | None]]
                   ) -> dict[str, int]:
    """Re-pack, in place, each experts module of ``model`` whose kernel re-packs its stacked
    tensors at load (the CPU build), where the module holds its new experts in vLLM's plain
    layout: what a weight push that writes the parameters (an in-place reload, `load_weights`)
    leaves behind, since the kernel re-packs on the first load only.

    ``plain_of(module name, held)`` gives the experts the module should hold, in the plain layout
    (`w13_weight` [E, 2I, H] gate;up, `w2_weight` [E, H, I]; None where unknown), ``held`` being
    its parameters. A module is re-packed only when it holds exactly those bytes; one that holds
    them re-packed already (a vLLM that re-packs itself) is left alone — packing packed bytes would
    corrupt them — and one that holds neither is counted, never written. Returns the counts of
    modules `repacked`, `already_packed` and `neither`."""
    counts = {"repacked": 0, "already_packed": 0, "neither": 0}
    with torch.no_grad():
        for name, layer in _expert_modules(model).items():
            kernel = _repacking_kernel(layer)
            if kernel is None:
                continue
            held = _held(layer)
            plain = plain_of(name, held)
            if any(plain.get(k) is None or plain[k].shape != p.shape for k, p in held.items()):
                counts["neither"] += 1
                continue
            plain = {k: plain[k].to(p.dtype) for k, p in held.items()}
            packed = _repack(kernel, layer, plain)
            if all(torch.equal(held[k], packed[k]) for k in held):
                counts["already_packed"] += 1
            elif all(torch.equal(held[k], plain[k]) for k in held):
                for k in held:
                    held[k].data.copy_(packed[k])
                counts["repacked"] += 1
            else:
                counts["neither"] += 1
    return counts


def _held(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An experts module's own stacked parameters (`w13_weight`, `w2_weight`)."""
    return {leaf: layer._parameters[leaf] for leaf in _EXPERT_PARAMS}    # noqa: SLF001


def plain_experts_from(tensors: dict[str, torch.Tensor]
                       ) -> Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor | None]]:
    """`repack_experts`' ``plain_of`` for HF-named ``tensors`` (a checkpoint's, or a transformers
    model's parameters): an experts module's experts stacked in vLLM's plain layout, from the
    per-expert `…experts.E.{gate,up,down}_proj.weight` or from transformers 5's fused
    `…experts.gate_up_proj` [E, 2I, H] / `…experts.down_proj` [E, H, I] (already that layout)."""

    def plain_of(module_name: str, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        prefix = _hf_prefix(module_name)
        fused = {leaf: tensors.get(f"{prefix}.{hf_leaf}") for leaf, hf_leaf in _EXPERT_PARAMS.items()}
        if all(t is not None for t in fused.values()):
            return fused
        n = held["w13_weight"].shape[0]
        return {leaf: _stacked(prefix, leaf, n, tensors, p.dtype) for leaf, p in held.items()}

    return plain_of


def repacks_experts(model: torch.nn.Module) -> bool:
    """Whether any experts module of ``model`` has a kernel that re-packs its tensors at load (the
    CPU build), so that a weight push which writes the parameters needs `repack_experts` after it."""
    return any(_repacking_kernel(layer) is not None for layer in _expert_modules(model).values())


def _expert_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules that hold stacked experts themselves (w13_weight and w2_weight), by name."""
    return {name: m for name, m in model.named_modules()
            if all(k in m._parameters for k in _EXPERT_PARAMS)}       # noqa: SLF001 - own params only


def _hf_prefix(module_name: str) -> str:
    """The HF key prefix of an experts module: vLLM nests the stacked tensors one module deeper
    (`mlp.experts.routed_experts.w13_weight`) than the HF experts (`mlp.experts.E.…`)."""
    return module_name.removesuffix(".routed_experts")


def _plain(out: dict, name: str, param: torch.Tensor, hf: dict[str, torch.Tensor],
           fused: dict[str, list[str]]) -> None:
    """A non-expert parameter: as it is, or split into the HF parts of a fused linear."""
    module_name, _, leaf = name.rpartition(".")
    prefix, _, short = module_name.rpartition(".")
    parts = [f"{prefix}.{p}.{leaf}" for p in fused.get(short, [])] or [name]
    if param.numel() == 0:                     # emptied: the kernel computes from a handle
        out["unreadable"].extend(parts)
        return
    if len(parts) == 1:
        out["held"][name] = _checksum(param)
        return
    sizes = [hf[p].shape[0] if p in hf else -1 for p in parts]
    if min(sizes) < 0 or sum(sizes) != param.shape[0]:
        out["unreadable"].extend(parts)        # a layout this reading does not know
        return
    for part, piece in zip(parts, torch.split(param, sizes, dim=0)):
        out["held"][part] = _checksum(piece)


def _sources(prefix: str, leaf: str, e: int) -> list[str]:
    """The HF tensors of expert `e` that vLLM's `leaf` stacks (w13: gate then up; w2: down)."""
    base = f"{prefix}.{e}"
    return [f"{base}.gate_proj.weight", f"{base}.up_proj.weight"] if leaf == "w13_weight" \
        else [f"{base}.down_proj.weight"]


def _experts(out: dict, layer: torch.nn.Module, prefix: str, hf: dict[str, torch.Tensor]) -> None:
    """One experts module: per-expert slices of its stacked tensors, named by HF key; where its
    kernel re-packs them, compared with the directory's experts re-packed the same way."""
    held = _held(layer)
    n = held["w13_weight"].shape[0]
    plain = {leaf: _stacked(prefix, leaf, n, hf, p.dtype) for leaf, p in held.items()}
    every = [s for leaf in _EXPERT_PARAMS for e in range(n) for s in _sources(prefix, leaf, e)]
    kernel = _repacking_kernel(layer)
    if any(v is None for v in plain.values()):
        out["unreadable"].extend(every)
        return
    if kernel is None:
        if any(plain[leaf].shape != p.shape for leaf, p in held.items()):   # a layout this reading does not know
            out["unreadable"].extend(every)
            return
        for leaf, p in held.items():               # the HF layout itself: name each HF tensor
            for e in range(n):
                sources = _sources(prefix, leaf, e)
                for s, piece in zip(sources, torch.chunk(p[e], len(sources), dim=0)):
                    out["held"][s] = _checksum(piece)
        return
    expected = _repack(kernel, layer, plain)
    for leaf, p in held.items():
        for e in range(n):
            key = f"{prefix}.{e}.{_EXPERT_PARAMS[leaf]}.weight"
            out["held"][key], out["expected"][key] = _checksum(p[e]), _checksum(expected[leaf][e])
            out["packed"][key] = _sources(prefix, leaf, e)


def _stacked(prefix: str, leaf: str, n: int, hf: dict[str, torch.Tensor],
             dtype: torch.dtype) -> torch.Tensor | None:
    """The directory's experts in vLLM's unpacked layout ([E, 2I, H] gate;up, or [E, H, I]); None
    when the directory lacks any of them."""
    rows = []
    for e in range(n):
        sources = _sources(prefix, leaf, e)
        if any(s not in hf for s in sources):
            return None
        rows.append(torch.cat([hf[s] for s in sources], dim=0))
    return torch.stack(rows).to(dtype)


def _repacking_kernel(layer: torch.nn.Module) -> Any:
    """The layer's CPU experts kernel (`quant_method.moe_kernel.fused_experts`, whose
    `process_weights_after_loading` pads and re-packs at load), or None where the kernel keeps
    vLLM's plain stacked layout."""
    kernel = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if kernel is None or "CPU" not in type(kernel).__name__ or not hasattr(kernel, "process_weights_after_loading"):
        return None
    return kernel


def _repack(kernel: Any, layer: torch.nn.Module, plain: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`plain` put through the kernel's own load-time re-packing, on a stand-in of the layer (a
    shallow copy with its own parameter table), so the live layer and kernel keep their state."""
    stand_in = copy.copy(layer)
    stand_in._parameters = {k: (torch.nn.Parameter(plain[k], requires_grad=False) if k in plain   # noqa: SLF001
                                else torch.nn.Parameter(v.detach().clone(), requires_grad=False))
                            for k, v in layer._parameters.items() if v is not None}                # noqa: SLF001
    saved = dict(kernel.__dict__)
    try:
        kernel.process_weights_after_loading(stand_in)
    finally:
        kernel.__dict__.clear()
        kernel.__dict__.update(saved)
    return {k: stand_in._parameters[k].detach() for k in plain}                                    # noqa: SLF001
