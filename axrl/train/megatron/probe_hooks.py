"""The probe-point vocabulary (`axrl.model.probe_points`) on megatron-core's `GPTModel`, by forward hooks.

`MegatronBackend.probe_forward` installs these around a rank's no-grad forward (world size 1:
the hooks run in the driver's process). Each Megatron module is mapped onto a point:

  in            pre-hook of `decoder.layers[i]` (its `hidden_states`)
  attn_norm     output of `input_layernorm`
  attn          output of `self_attention` (+ its bias when there is one), before `self_attn_bda`
  mid           input of `pre_mlp_layernorm`
  mlp_norm      output of `pre_mlp_layernorm`
  router        output of the router's `gating` (its logits, fp32)
  topk_ids      the router's `RouterReplay` indices (replayed under R3, else recorded), slot order
  topk_weights  the router's probs at those indices (Megatron's dense [N, E] probs, gathered)
  expert_out    recomputed (MEGATRON_HOW): Megatron applies the routing weight inside each expert's
                activation (`per_token_scale`), so an unweighted expert output never exists
  moe           output of `mlp` (the MoE layer's combine, + bias), before `mlp_bda`
  out           output of the layer
  final         output of `decoder.final_layernorm`
  logits        output of `output_layer`

Megatron's activations are sequence-major ([S, B, …], MoE rows [S·B, …]); the probe is handed the
embedded model's layout ([B, S, …], MoE rows [B·S, …]) so `SampleProbe` reads either backend alike.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

#: How the Megatron trainer's value of each point is obtained (shown in bisect's output).
MEGATRON_HOW: dict[str, str] = {
    "*": "captured (forward hook on the megatron-core GPTModel module, axrl/train/megatron/probe_hooks.py)",
    "router": "captured (the router's gating output)",
    "topk_ids": "captured (the router's RouterReplay indices: replayed under R3, else recorded)",
    "topk_weights": "captured (the router's probs gathered at topk_ids)",
    "expert_out": "recomputed: each chosen expert (Megatron's own module, SequentialMLP.local_experts) on the "
                  "captured router input, unweighted (Megatron multiplies the routing weight inside the expert's "
                  "activation)",
    "logprobs": "derived: log_softmax(logits / T), the sampler's formula",
}


def _first(x: Any) -> torch.Tensor:
    """A module's tensor output: (output, bias) → output + bias; a tensor as is."""
    if isinstance(x, tuple):
        out, bias = x[0], (x[1] if len(x) > 1 else None)
        return out if not isinstance(bias, torch.Tensor) else out + bias
    return x


class _Emitter:
    """Hands Megatron's sequence-major activations to the probe in the embedded layout."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.S = self.B = 0

    def seq(self, point: str, layer: int, x: torch.Tensor) -> None:
        """[S, B, …] → [B, S, …]."""
        self.S, self.B = x.shape[0], x.shape[1]
        self._at(point, layer, x.detach().transpose(0, 1))

    def rows(self, point: str, layer: int, x: torch.Tensor) -> None:
        """Sequence-major rows [S·B, …] → batch-major rows [B·S, …]."""
        y = x.detach().reshape(self.S, self.B, *x.shape[1:]).transpose(0, 1).reshape(self.S * self.B, *x.shape[1:])
        self._at(point, layer, y)

    def _at(self, point: str, layer: int, x: torch.Tensor) -> None:
        # The hooks observe; a probe that patches (explain's substitutions) would be silently ignored.
        if self.probe.at(point, layer, x) is not x:
            raise ValueError(f"probe point {point!r} (layer {layer}): the Megatron backend's probe points only "
                             "observe; patching activations needs train.backend: torch")


def _layer_hooks(layer: torch.nn.Module, li: int, emit: _Emitter) -> list[Any]:
    """The dense points of decoder layer `li`; its router's (if any) through `_router_hooks`."""
    def pre_in(_m: Any, args: tuple, kwargs: dict) -> None:
        emit.seq("in", li, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    def post(point: str) -> Callable[..., None]:
        return lambda _m, _a, out: emit.seq(point, li, _first(out))

    hs = [layer.register_forward_pre_hook(pre_in, with_kwargs=True),
          layer.input_layernorm.register_forward_hook(post("attn_norm")),
          layer.self_attention.register_forward_hook(post("attn")),
          layer.pre_mlp_layernorm.register_forward_pre_hook(lambda _m, args: emit.seq("mid", li, args[0])),
          layer.pre_mlp_layernorm.register_forward_hook(post("mlp_norm")),
          layer.mlp.register_forward_hook(post("moe")),
          layer.register_forward_hook(post("out"))]
    return hs


@contextlib.contextmanager
def _router_hooks(mlp: torch.nn.Module, li: int, emit: _Emitter, top_k: int) -> Iterator[None]:
    """`router`, `topk_ids`, `topk_weights`, `expert_out` of MoE layer `li` (see module doc)."""
    router = mlp.router
    had_own = "gating" in router.__dict__
    gating = router.gating

    def gate(x: torch.Tensor) -> torch.Tensor:
        logits = gating(x)
        emit.rows("router", li, logits.reshape(-1, logits.shape[-1]))
        return logits

    def after(_m: Any, args: tuple, out: tuple) -> None:
        probs = out[0].detach()
        rr = router.router_replay
        ids = rr.target_topk_idx if getattr(rr, "target_topk_idx", None) is not None else rr.recorded_topk_idx
        ids = ids.long().reshape(-1, top_k)
        emit.rows("topk_ids", li, ids)
        emit.rows("topk_weights", li, probs.reshape(ids.shape[0], -1).gather(1, ids))
        h = args[0].detach().reshape(ids.shape[0], -1)
        emit.rows("expert_out", li, _expert_outputs(mlp.experts.local_experts, h, ids))

    router.gating = gate
    handle = router.register_forward_hook(after)
    try:
        yield
    finally:
        handle.remove()
        if had_own:
            router.gating = gating
        else:
            del router.gating


def _expert_outputs(experts: torch.nn.ModuleList, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, k, H]: Megatron expert ids[n, j] (an `MLP`, no routing weight) applied to h[n]."""
    out = torch.zeros((*ids.shape, h.shape[-1]), dtype=h.dtype, device=h.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        y = _first(experts[e](h[tok]))
        out[tok, slot] = y.to(h.dtype)
    return out


@contextlib.contextmanager
def probed(model: torch.nn.Module, probe: Any, top_k: int) -> Iterator[None]:
    """Run the block with `probe.at(point, layer, x)` called at every point of `model`'s forwards
    (a `GPTModel` at expert-parallel size 1: every expert is local)."""
    emit = _Emitter(probe)
    handles: list[Any] = []
    with contextlib.ExitStack() as stack:
        for li, layer in enumerate(model.decoder.layers):
            handles += _layer_hooks(layer, li, emit)
            if getattr(layer.mlp, "router", None) is not None:
                stack.enter_context(_router_hooks(layer.mlp, li, emit, top_k))
        handles.append(model.decoder.final_layernorm.register_forward_hook(
            lambda _m, _a, out: emit.seq("final", -1, _first(out))))
        handles.append(model.output_layer.register_forward_hook(
            lambda _m, _a, out: emit.seq("logits", -1, _first(out))))
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def probe_shares(rank: Any, work: Any, scope: Any, probe: Any) -> list[tuple[Any, ...]]:
    """A world-size-1 rank's no-grad forward of `work` (unmerged micro-batches), `probe` told each
    micro-batch's samples (`probe.begin`) and called at every point: per micro-batch (logprobs,
    entropy, routing or None), as `MegatronRank.forward` answers."""
    rank.model.eval()
    parts, start = [], 0
    with torch.no_grad(), probed(rank.model, probe, rank.cfg.num_experts_per_tok):
        for share in work.shares:
            pm = rank._share(share, scope)
            n = int(pm.input_ids.shape[0])
            probe.begin(list(range(start, start + n)), pm.rows, pm.cols)
            parts.append(tuple(None if t is None else t.cpu() for t in rank._run(share, work, scope)[:3]))
            start += n
    return parts
