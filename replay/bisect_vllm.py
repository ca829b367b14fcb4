"""The vLLM side of bisect: one sample's tokens through a real vLLM server, captured by a worker extension.

The server is launched with `--worker-extension-cls axrl.inference.vllm.worker_extension.WorkerExtension`
and `VLLM_SERVER_DEV_MODE=1` (which serves `POST /collective_rpc`), this repository on its
PYTHONPATH. `vllm_side` arms the extension for a pass of the sample's length, sends the sample's
whole token stream as one prompt (`/v1/completions`, `prompt_logprobs: -1`: the whole vocabulary
at every position), reads the pass the extension saved and maps it onto the probe points with the
SGLang mapping (`replay.bisect_sglang.states_from_dump`; same module names). What vLLM exposes
differs from SGLang (`VLLM_HOW`): `moe` is captured (vLLM's `mlp` module returns the combined
output), the top-k choice and weights are recomputed from the captured router logits (vLLM's
top-k is no module), `expert_out` is recomputed, and no `logits` row is kept. Like SGLang: one
prefill (not the decode path) and the floor estimated as twice the trainer's rounding.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from axrl.inference.vllm.worker_extension import EXTENSION
from replay.bisect_capture import Side, float64_model
from replay.bisect_sglang import FULL_VOCAB_BUDGET, states_from_dump
from replay.plan import ReplayInputError

Progress = Callable[[str], None]
VLLM_HOW: dict[str, str] = {
    "in": "captured: the residual input_layernorm returns (layer 0: embed_tokens)",
    "attn_norm": "captured: input_layernorm",
    "attn": "captured: self_attn",
    "mid": "captured: the residual post_attention_layernorm returns",
    "mlp_norm": "captured: post_attention_layernorm",
    "router": "captured: mlp.gate",
    "topk_ids": "recomputed from the captured router logits (vLLM's top-k is no module)",
    "topk_weights": "recomputed from the captured router logits (softmax, top-k, renormalised)",
    "expert_out": "recomputed: the served policy's experts (as exported) on vLLM's mlp_norm (the fused MoE "
                  "kernel exposes no per-expert output)",
    "moe": "captured: mlp (the fused MoE's combined output)",
    "out": "captured: the residual the next input_layernorm (last layer: model.norm) returns",
    "final": "captured: model.norm",
    "logprobs": "the reply's prompt_logprobs (whole vocabulary), renormalised at the rollout temperature",
}


def server_args() -> list[str]:
    """The flags a bisect vLLM server runs with (the worker extension; no compilation, so that
    module hooks run)."""
    return ["--worker-extension-cls", EXTENSION, "--compilation-config", '{"mode": 0}']


@contextlib.contextmanager
def server_environment() -> Iterator[None]:
    """The launched server inherits this process's environment: turn on `/collective_rpc` and put
    this repository on its PYTHONPATH while it starts."""
    root = str(Path(__file__).resolve().parents[1])
    saved = {k: os.environ.get(k) for k in ("VLLM_SERVER_DEV_MODE", "PYTHONPATH")}
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, saved["PYTHONPATH"]) if p)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _post(url: str, route: str, body: dict[str, Any]) -> Any:
    import httpx

    try:
        r = httpx.post(url.rstrip("/") + route, json=body, timeout=600)
    except httpx.HTTPError as e:
        raise ReplayInputError(f"--engine vllm: {url}{route} failed ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise ReplayInputError(f"--engine vllm: {url}{route} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]


def _full_logprobs(choice: dict[str, Any], n: int, vocab: int) -> torch.Tensor:
    """float64 [n, V]: row r the log-distribution at position r (predicting r + 1); the last NaN."""
    rows = torch.full((n, vocab), float("nan"), dtype=torch.float64)
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != n:
        return rows
    for r, entry in enumerate(entries[1:]):
        if not entry:
            continue
        row = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        for tok, v in entry.items():
            if int(tok) < vocab:
                row[int(tok)] = float(v["logprob"] if isinstance(v, dict) else v)
        rows[r] = row
    return rows


def _rows(x: Any, n: int) -> Any:
    """The first n rows (the runner may pad a batch past the sample's tokens)."""
    if isinstance(x, (list, tuple)):
        return [t[:n] for t in x]
    return x[:n]


def vllm_side(url: str, work: Path, ids: list[int], weights: dict[str, torch.Tensor], mcfg, temperature: float,
              say: Progress) -> Side:
    """The vLLM server at `url` (launched with `server_args()` in `server_environment()`) on the
    sample's tokens in one prefill: every probe point it exposes, rows = positions."""
    n, vocab = len(ids), int(mcfg.vocab_size)
    path = work / "pass.pt"
    armed = _post(url, "/collective_rpc", {"method": "axrl_probe_arm", "args": [str(n), str(path)]})
    say(f"vllm: {armed.get('results')}; one prefill of the sample's {n} tokens")
    full = n * vocab <= FULL_VOCAB_BUDGET
    body = {"model": _served_model(url), "prompt": ids, "max_tokens": 1, "temperature": 1.0,
            "prompt_logprobs": -1 if full else 0}
    reply = _post(url, "/v1/completions", body)
    for _ in range(100):  # the worker writes the pass when the forward ends
        if path.is_file():
            break
        time.sleep(0.1)
    if not path.is_file():
        seen = _post(url, "/collective_rpc", {"method": "axrl_probe_seen"}).get("results")
        _post(url, "/collective_rpc", {"method": "axrl_probe_disarm"})
        raise ReplayInputError(f"--engine vllm: no forward pass of the sample's {n} tokens was seen (passes seen: "
                               f"{seen}; did vLLM split the prefill?)")
    _post(url, "/collective_rpc", {"method": "axrl_probe_disarm"})
    d = {k: _rows(v, n) for k, v in torch.load(path, weights_only=True).items()}
    got = d.get("model.forward_batch_info.input_ids")
    if got is None or got.long().tolist() != list(ids):
        raise ReplayInputError("--engine vllm: the captured pass holds other tokens than the sample's")
    model = float64_model(mcfg, weights).float()
    side = Side("vllm", states_from_dump(d, None, model, n))
    side.positions = torch.arange(n)
    if full:
        lp = _full_logprobs((reply.get("choices") or [{}])[0], n, vocab)
        scale = float(temperature) if temperature > 0 else 1.0
        side.states[(-1, "logprobs")] = torch.log_softmax(lp / scale, dim=-1)
    side.states.pop((-1, "logits"), None)
    return side
