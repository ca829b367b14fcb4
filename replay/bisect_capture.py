"""Capture every probe point (`axrl.model.probe_points`) of one recorded sample on both sides.

Four captures of the same tokens, each a `Side`: per (layer, point) a tensor whose leading
dimension is the sample's token positions (NaN rows where that side computed nothing):

* **engine** — the embedded engine's teacher-forced computation of the step as it ran
  (`replay.engine_path.run_engine_path`: the clock's batches, the prefix cache as recorded, the
  fused prefill and the KV-cache decode one token at a time), keeping the sample's requests;
* **trainer** — the trainer's forward of the micro-batch that held the sample, as trained
  (`TrainBackend.probe_forward`, routing replayed when the run used R3);
* **engine64 / trainer64** — the same two computations of this sample alone in float64: weights as
  each side stores them (a bf16 rollout copy stays bf16-rounded), K/V as the cache stores them,
  the trainer's routing replay as recorded. They are the reference that `replay.bisect_compare`
  derives each point's numerics floor from.

The engine's fused decoder exposes `in`, `mid`, `router`, `out`, `final` and the logits; the
other points are obtained from those (`ENGINE_HOW`): the norms, the routing choice and weights and
each routed expert's output recomputed with the engine's own weights from the captured input of
that op, the attention and MoE outputs as differences of captured residual states (the fused
decoder adds them into the residual inside one GEMM / scatter, so they never exist on their own).
The trainer's forward exposes every point directly. `logprobs` is derived on both sides with the
sampler's formula, log_softmax(logits / T).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

import replay.engine_path as engine_path
from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.inference.quant import ACT_ATTR
from axrl.model import ModelConfig, Qwen3ForCausalLM
from axrl.model.probe_points import MOE_POINTS
from axrl.train.micro_batch import pad_micro_batch, split_micro_batches
from axrl.train.protocol import PackedBatch, TrainBackend
from axrl.train.r3 import use_r3

Key = tuple[int, str]           # (layer, point); layer −1 for the model-level points
States = dict[Key, torch.Tensor]
CacheFactory = Callable[..., StaticKVCache]

#: How the embedded engine's value of each point is obtained (shown in bisect's output).
ENGINE_HOW: dict[str, str] = {
    "in": "captured", "mid": "captured", "router": "captured", "out": "captured", "final": "captured",
    "logits": "captured",
    "attn_norm": "recomputed from `in` with the engine's input_layernorm",
    "attn": "derived: mid − in (the fused decoder adds o_proj's output into the residual in one GEMM)",
    "mlp_norm": "recomputed from `mid` with the engine's post_attention_layernorm",
    "topk_ids": "recomputed from the captured router logits (softmax, top-k, as the engine)",
    "topk_weights": "recomputed from the captured router logits (softmax, top-k, renormalised, as the engine)",
    "expert_out": "recomputed: each chosen expert of the engine's weights on the engine's mlp_norm",
    "moe": "derived: out − mid (the fused decoder scatters the experts' sum into the residual)",
    "logprobs": "derived: log_softmax(logits / T), the sampler's formula",
}
TRAINER_HOW = "captured (axrl.model.ActivationProbe in the trainer's forward)"


def trainer_how(backend: TrainBackend) -> dict[str, str]:
    """How the trainer side's points are obtained: per point ("*" for the rest)."""
    how = getattr(backend, "probe_how", None)  # a backend whose points are not all captured as such
    return dict(how) if how else {"*": TRAINER_HOW}


@dataclass
class Side:
    """One computation of the sample: per (layer, point) a tensor [rows, ...] (float points NaN
    where not computed, `topk_ids` −1); the trainer's rows are the sample's positions, the
    engine's its requests' positions one request after another (`positions`)."""

    name: str
    states: States = field(default_factory=dict)
    positions: torch.Tensor | None = None    # row → token position (None: row i is position i)
    requests: list[int] = field(default_factory=list)     # the engine requests, in row order
    turn_of_row: list[int] = field(default_factory=list)  # row → the turn of the request it belongs to

    def rows_of(self, positions: torch.Tensor) -> dict[Key, torch.Tensor]:
        """The states at the given positions (a trainer side aligned to an engine side's rows)."""
        n = min(x.shape[0] for x in self.states.values())
        pos = positions.clamp(max=n - 1)
        out = {}
        for key, x in self.states.items():
            rows = x[pos]
            if x.dtype.is_floating_point:
                rows[positions >= x.shape[0]] = float("nan")
            out[key] = rows
        return out


# ------------------------------------------------------------------------------------- trainer
class SampleProbe:
    """A `ForwardProbe` copying every point of one batch sample (`target`: its row in the batch)."""

    def __init__(self, target: int, length: int) -> None:
        self.target, self.length = target, length
        self.states: States = {}
        self._row: int | None = None
        self._rows = 1

    def begin(self, samples: list[int], rows: torch.Tensor, cols: torch.Tensor) -> None:
        self._row = samples.index(self.target) if self.target in samples else None
        self._rows = len(samples)

    def at(self, point: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self._row is None:
            return x
        view = x.reshape(self._rows, -1, *x.shape[1:]) if point in MOE_POINTS else x
        self.states[(layer, point)] = view[self._row][:self.length].detach().cpu().clone()
        return x


def trainer_side(backend: TrainBackend, batch: PackedBatch, row: int, micro_batch_tokens: int, r3) -> Side:
    """The trainer's forward of the micro-batch holding batch row `row` (as trained), capturing it."""
    ranges = split_micro_batches(batch.lengths, micro_batch_tokens)
    rng = next(rg for rg in ranges if row in rg)
    sub = batch.select(list(rng))
    n = int(batch.lengths[row])
    probe = SampleProbe(row - rng.start, n)
    if backend.probe_forward(sub, probe, r3=r3) is None:
        raise ValueError("the run's train backend cannot hook its model (bisect needs train.backend: torch, or "
                         "megatron at world size 1: tensor_parallel × data_parallel = 1)")
    side = Side("trainer", probe.states)
    _add_logprobs(side, batch.temperature)
    return side


def trainer64_side(backend: TrainBackend, batch: PackedBatch, row: int, r3) -> Side:
    """The trainer's math on this sample alone in float64, routing replayed as the run replayed it."""
    mcfg = backend.model_config
    model = float64_model(mcfg, dict(backend.named_weights()))
    one = batch.select([row])
    scope = use_r3(mcfg, one, r3)
    pm = pad_micro_batch(one, with_routing=scope is not None, scope=scope)
    probe = SampleProbe(0, int(one.lengths[0]))
    probe.begin([0], pm.rows, pm.cols)
    with torch.no_grad():
        model(pm.input_ids, attention_mask=pm.attention_mask, forced_experts=pm.forced_experts, probe=probe)
    side = Side("trainer64", probe.states)
    _add_logprobs(side, batch.temperature)
    return side


def float64_model(mcfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Qwen3ForCausalLM:
    """A float64 copy of the policy holding `weights` (their values as stored, widened)."""
    model = Qwen3ForCausalLM(mcfg)
    missing, unexpected = model.load_state_dict({k: v.detach().double() for k, v in weights.items()}, strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise ValueError(f"the weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.double().eval()


# -------------------------------------------------------------------------------------- engine
def unquantised(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """`model` with fp8 activation rounding off (its weights stay as stored): the engine's math
    without activation-dependent rounding, for the references."""
    setattr(model, ACT_ATTR, False)
    return model


@contextlib.contextmanager
def engine_cache(factory: CacheFactory | None) -> Iterator[None]:
    """Run the engine path with KV caches built by `factory` (a what-if, e.g. a lower-precision
    cache); without one, the engine's own `StaticKVCache`."""
    if factory is None:
        yield
        return
    saved = engine_path.StaticKVCache
    engine_path.StaticKVCache = factory  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        engine_path.StaticKVCache = saved  # type: ignore[misc]


def engine_side(name: str, model: Qwen3ForCausalLM, ep: engine_path.EnginePath, indices: list[int],
                temperature: float) -> Side:
    """The rows of the sample's requests `indices` of the engine path `ep`, request after request
    (a position each request computed is its own row: a decode step and a later turn's prefill of
    the same token are compared separately), plus the points the fused decoder does not expose,
    obtained as `ENGINE_HOW` says."""
    side = Side(name)
    parts: dict[Key, list[torch.Tensor]] = {}
    for c in indices:
        end = ep.contexts[c].end
        for (point, layer), buf in ep.states[c].items():
            parts.setdefault((layer, point), []).append(buf)  # every request reaches every point
        side.requests.append(c)
        side.turn_of_row += [ep.contexts[c].turn] * end
    side.positions = torch.cat([torch.arange(ep.contexts[c].end) for c in indices])
    side.states = {key: torch.cat(bufs) for key, bufs in parts.items()}
    _derive_engine_points(side, model)
    _add_logprobs(side, temperature)
    return side


def _derive_engine_points(side: Side, model: Qwen3ForCausalLM) -> None:
    """The points `ENGINE_HOW` marks recomputed / derived, from the captured ones."""
    s = side.states
    cfg = model.config
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            x_in, mid, out = s[(li, "in")], s[(li, "mid")], s[(li, "out")]
            s[(li, "attn_norm")] = layer.input_layernorm(x_in)
            s[(li, "attn")] = mid - x_in
            h = s[(li, "mlp_norm")] = layer.post_attention_layernorm(mid)
            s[(li, "moe")] = out - mid
            if not layer.is_moe:
                continue
            logits = s[(li, "router")]
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
            if cfg.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            rows = torch.isfinite(logits).all(-1)
            ids[~rows] = -1
            s[(li, "topk_ids")] = ids
            s[(li, "topk_weights")] = weights.to(h.dtype)
            s[(li, "expert_out")] = _expert_outputs(layer.mlp.experts, h, ids)


def _expert_outputs(experts: torch.nn.ModuleList, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[N, k, H]: expert ids[n, j] applied to h[n] (NaN rows where ids is −1)."""
    out = torch.full((*ids.shape, h.shape[-1]), float("nan"), dtype=h.dtype)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = torch.where(ids == e)
        out[tok, slot] = experts[e](h[tok]).to(h.dtype)
    return out


def _add_logprobs(side: Side, temperature: float) -> None:
    """`logprobs`: the sampler's log_softmax(logits / T) in the logits' own precision (fp32 or fp64)."""
    logits = side.states.get((-1, "logits"))
    if logits is None:
        return
    scale = float(temperature) if temperature > 0 else 1.0
    wide = logits.double() if logits.dtype == torch.float64 else logits.float()
    side.states[(-1, "logprobs")] = torch.log_softmax(wide / scale, dim=-1)


def sample_contexts(contexts: list[engine_path.Context], row: int) -> list[int]:
    """Indices of the requests of step row `row`, in turn order."""
    return [i for i, c in enumerate(contexts) if c.sample == row]

