"""The SGLang side of bisect: one sample's tokens through a real SGLang server, every op it exposes.

SGLang's own tensor-dump facility (`--debug-tensor-dump-output-folder DIR`,
`sglang/srt/debug_utils/tensor_dump_forward_hook.py`) hooks every leaf module of the served model
and writes one `Pass{n}.pt` per forward pass. `sglang_side` launches a dedicated server on the
step's exported policy with it (radix cache off, so the sample is one fresh prefill), sends the
sample's whole token stream teacher-forced as one prefill-only request (the full-vocabulary
logprobs of every position in the reply), finds the pass whose input ids are the sample's and maps
the dumped module outputs onto the probe points (`SGLANG_HOW`). What the dump cannot expose:

* the decode path (KV cache, one token at a time): the server is sent the stream as one prefill;
  forcing recorded tokens through its decode would need a custom logit processor (not done);
* each routed expert's output: the fused-MoE module is no leaf and its kernel keeps no per-expert
  output, so `expert_out` is recomputed with the exported policy's experts on SGLang's mlp_norm,
  and `moe` is the residual difference out − mid;
* `logits` at every position: SGLang's logits processor keeps the next-token row only (the last
  position); `logprobs` come from the reply's input_top_logprobs (whole vocabulary, renormalised
  at the rollout temperature as `axrl.inference.scoring.sglang` does).

Cost: one server start (tens of seconds on CPU) and one `.pt` file per forward pass, the sample's
about (2 × layers + 4) × positions × hidden floats. The server cannot run float64, so its own
rounding is not measured: the floor of each op is twice the trainer's own rounding there (the
trainer's float32 forward against its float64 run), stated in the output.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from axrl.model import Qwen3ForCausalLM
from replay.bisect_capture import Side, _add_logprobs, _expert_outputs, float64_model
from replay.plan import ReplayInputError

Progress = Callable[[str], None]
#: The dumped tensors behind each probe point (shown in bisect's output).
SGLANG_HOW: dict[str, str] = {
    "in": "captured: the residual input_layernorm returns (layer 0: embed_tokens)",
    "attn_norm": "captured: input_layernorm",
    "attn": "captured: self_attn.o_proj",
    "mid": "captured: the residual post_attention_layernorm returns",
    "mlp_norm": "captured: post_attention_layernorm",
    "router": "captured: mlp.gate",
    "topk_ids": "captured: mlp.topk (TopKOutput.topk_ids)",
    "topk_weights": "captured: mlp.topk (TopKOutput.topk_weights)",
    "expert_out": "recomputed: the served policy's experts (as exported) on SGLang's mlp_norm (the fused MoE kernel "
                  "exposes no per-expert output)",
    "moe": "derived: out − mid (the fused-MoE module is no leaf the dump hooks)",
    "out": "captured: the residual the next input_layernorm (last layer: model.norm) returns",
    "final": "captured: model.norm",
    "logits": "captured: logits_processor, last position only (it keeps the next-token row)",
    "logprobs": "the reply's input_top_logprobs (whole vocabulary), renormalised at the rollout temperature",
}
FLOOR_HOW = ("SGLang cannot serve float64, so its own rounding is not measured: floor = twice the trainer's "
             "float32 rounding (against its float64 run) at each op")
DUMP_FLAGS = ["--disable-radix-cache", "--skip-server-warmup"]
FULL_VOCAB_BUDGET = 4_000_000     # numbers in one reply (as axrl.inference.scoring.sglang)


def dump_server_args(dump_dir: Path) -> list[str]:
    """The flags a bisect server runs with: SGLang's tensor dump into `dump_dir`, one fresh prefill."""
    return ["--debug-tensor-dump-output-folder", str(dump_dir), *DUMP_FLAGS]


def _post(url: str, body: dict[str, Any]) -> Any:
    import httpx

    try:
        r = httpx.post(url.rstrip("/") + "/generate", json=body, timeout=600)
    except httpx.HTTPError as e:
        raise ReplayInputError(f"--engine sglang: {url}/generate failed ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise ReplayInputError(f"--engine sglang: {url}/generate answered {r.status_code}: {r.text[:300]}")
    return r.json()


def _full_logprobs(reply: dict[str, Any], n: int, vocab: int) -> torch.Tensor:
    """float64 [n, V]: row r the log-distribution SGLang computed at position r (predicting r + 1);
    the last row NaN (the reply reports the tokens it was sent)."""
    top = (reply.get("meta_info") or {}).get("input_top_logprobs")
    rows = torch.full((n, vocab), float("nan"), dtype=torch.float64)
    if not isinstance(top, list) or len(top) != n:
        return rows
    for r, entries in enumerate(top[1:]):
        if not entries:
            continue
        row = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        row[torch.tensor([int(e[1]) for e in entries])] = torch.tensor([float(e[0]) for e in entries],
                                                                       dtype=torch.float64)
        rows[r] = row
    return rows


def _find_pass(dump_dir: Path, ids: list[int]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the pass whose input ids are `ids`, the pass after it: it holds that pass's logits)."""
    files = sorted(dump_dir.rglob("Pass*.pt"))
    want = torch.tensor(ids)
    for i, f in enumerate(files):
        d = torch.load(f, weights_only=True)
        got = d.get("model.forward_batch_info.input_ids")
        if got is not None and got.shape == want.shape and bool((got.long() == want).all()):
            nxt = torch.load(files[i + 1], weights_only=True) if i + 1 < len(files) else None
            return d, nxt
    raise ReplayInputError(f"--engine sglang: none of the {len(files)} dumped forward passes in {dump_dir} holds the "
                           f"sample's {len(ids)} tokens as one prefill (was it split into chunks?)")


def _topk(logits: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) from router logits: softmax, top-k, renormalised as the model config says."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (list, tuple)) else x


def states_from_dump(d: dict[str, Any], nxt: dict[str, Any] | None, model: Qwen3ForCausalLM, n: int) -> dict:
    """The probe points from one dumped pass (`SGLANG_HOW`; a vLLM capture of
    axrl/inference/vllm/probe_extension.py uses the same names, with `mlp` the MoE output, no
    top-k: it is recomputed from the router logits as the engine's model computes it)."""
    s: dict[tuple[int, str], torch.Tensor] = {}
    layers = model.model.layers
    for li, layer in enumerate(layers):
        p = f"model.layers.{li}."
        norm_in = d[p + "input_layernorm"]
        s[(li, "attn_norm")] = _first(norm_in).float()
        s[(li, "in")] = (norm_in[1] if isinstance(norm_in, (list, tuple)) else d["model.embed_tokens"]).float()
        s[(li, "attn")] = _first(d[p + "self_attn.o_proj"]).float()
        mlp_norm, mid = d[p + "post_attention_layernorm"]
        s[(li, "mlp_norm")], s[(li, "mid")] = mlp_norm.float(), mid.float()
        nxt_norm = d[f"model.layers.{li + 1}.input_layernorm"] if li + 1 < len(layers) else d["model.norm"]
        s[(li, "out")] = nxt_norm[1].float()
        moe = d.get(p + "mlp")
        s[(li, "moe")] = _first(moe).float() if moe is not None else s[(li, "out")] - s[(li, "mid")]
        if not layer.is_moe:
            continue
        s[(li, "router")] = _first(d[p + "mlp.gate"]).float()
        if p + "mlp.topk" in d:
            weights, ids = d[p + "mlp.topk"][0], d[p + "mlp.topk"][1]
        else:
            weights, ids = _topk(s[(li, "router")], model.config)
        s[(li, "topk_ids")], s[(li, "topk_weights")] = ids.long(), weights.float()
        with torch.no_grad():
            s[(li, "expert_out")] = _expert_outputs(layer.mlp.experts, s[(li, "mlp_norm")], ids.long())
    s[(-1, "final")] = d["model.norm"][0].float()
    logits = torch.full((n, model.config.vocab_size), float("nan"))
    last = None if nxt is None else nxt.get("logits_processor")
    if last is not None and last.shape[-1] >= model.config.vocab_size:
        logits[n - 1] = last.reshape(-1, last.shape[-1])[-1, :model.config.vocab_size].float()
    s[(-1, "logits")] = logits
    return s


def sglang_side(url: str, dump_dir: Path, ids: list[int], weights: dict[str, torch.Tensor], mcfg,
                temperature: float, say: Progress) -> Side:
    """The SGLang server at `url` (launched with `dump_server_args(dump_dir)`) on the sample's tokens
    `ids`, teacher-forced in one prefill: every probe point it exposes, rows = positions."""
    n, vocab = len(ids), int(mcfg.vocab_size)
    body: dict[str, Any] = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}
    full = n * vocab <= FULL_VOCAB_BUDGET
    if full:
        body.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=vocab)
    say(f"sglang: one prefill of the sample's {n} tokens (tensor dump on)")
    reply = _post(url, body)
    _post(url, {"input_ids": ids[:1], "sampling_params": {"max_new_tokens": 1}})  # the next pass holds its logits
    d, nxt = _find_pass(dump_dir, ids)
    model = float64_model(mcfg, weights).float()
    side = Side("sglang", states_from_dump(d, nxt, model, n))
    side.positions = torch.arange(n)
    side.turn_of_row = []
    if full:
        lp = _full_logprobs(reply, n, vocab)
        scale = float(temperature) if temperature > 0 else 1.0
        side.states[(-1, "logprobs")] = torch.log_softmax(lp / scale, dim=-1)
    else:
        _add_logprobs(side, temperature)
    return side


def new_dump_dir(run: Path, step: int, engine: str = "sglang") -> tempfile.TemporaryDirectory:
    """A fresh folder for the server's dump under RUN/replay (removed afterwards)."""
    root = run / "replay"
    root.mkdir(parents=True, exist_ok=True)
    return tempfile.TemporaryDirectory(prefix=f"bisect_step_{step:06d}_{engine}_dump_", dir=root)


def rewrite_weights(model_dir: Path, hook: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Apply `hook` to the exported policy's weights in place (a what-if on the served copy only;
    the names are the model's parameter names, as `engine_weights` of the embedded engine)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(model_dir.glob("*.safetensors")):
        weights = load_file(str(path))
        save_file({k: v.contiguous() for k, v in hook(weights).items()}, str(path), metadata={"format": "pt"})

