"""Per-tensor weight checksums of a running SGLang server, in SGLang's own layout, and the same
checksums computed from the trainer's HF tensors — so the sync sentinel can say which tensor a
server holds stale, not only that its probe logprobs moved.

    held = held_checksums("http://127.0.0.1:30000")          # {sglang name: hex hash}
    want = expected_checksums(hf_state_dict(model), torch.float32)
    mismatches, compared = compare(want, held)

The server side is SGLang's own checker (sglang/srt/utils/weight_checker.py, SGLang ≥ 0.5.23):
`POST /weights_checker {"action": "checksum"}` hashes every parameter and persistent buffer of the
model (`WeightChecker._compute_checksum`) and answers one `ranks[]` entry per scheduler rank, each
`{"checksums": {name: hash}, "per_gpu_checksum", "parallelism_info"}`. Each hash is
`_hash_tensor`: `tensor_hash` (sglang/srt/managers/mm_utils.py) of the raw bytes, as 16 hex digits.
For a tensor in host memory (SGLang's CPU build) that is the first 8 bytes of the SHA-256 of the
tensor's contiguous bytes (`sglang_hash`); for a tensor on a CUDA device SGLang runs its Triton
kernel `gpu_tensor_hash` (sglang/kernels/ops/memory/gpu_tensor_hash.py: a per-32-bit-word mix,
summed per tile of 8192 words, the tiles' 64-bit values summed, then splitmix64), which
`sglang_cuda_hash` recomputes with plain torch integer ops on any device (checked bit for bit
against SGLang's kernel under TRITON_INTERPRET=1, tests/test_sglang_weight_checksums.py).
`expected_checksums(..., server_device=)` picks the one the server uses.

The names are SGLang's parameter names, not HF keys: q/k/v fused into `qkv_proj`, a dense MLP's
gate/up into `gate_up_proj`, and a MoE layer's experts stacked into two tensors, `w13_weight`
[E, 2I, H] and `w2_weight` [E, H, I]. `LAYOUT` (one table) says how each SGLang tensor is built
from HF tensors, and where in SGLang each rule comes from. Because SGLang hashes a whole stacked
expert tensor, a mismatch in `w13_weight` / `w2_weight` names the layer and all its experts as
sources; naming the single expert that differs is left to the probe re-score / `axrl-debug bisect`.

Layouts valid for tensor parallel size 1 (one rank holds whole tensors), no expert parallelism, no
quantization, and SGLang's default MoE runner (the flashinfer TRT-LLM and Triton-kernels runners
reorder or transpose expert weights). A weight SGLang re-packs after loading (the CPU AMX backend
packs bf16/fp16 linear and expert weights when `sgl_kernel` is built with it) is hashed as packed
and would differ; the stock PyPI wheel under cpu_compat.py packs nothing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

VOCAB_PAD = 64             # sglang/srt/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class LayoutRule:
    """How one kind of SGLang tensor is built from HF tensors.

    `hf` fullmatches the HF keys the rule consumes; its named groups: `layer`, `expert` (the
    tensor is a stack over experts 0..E-1 along a new dim 0) and `part` (which piece of the fused
    tensor this key is). `sglang` is the SGLang name, formatted with the match's `layer`/`name`
    (None: keys SGLang's loader drops).
    `parts`: the concatenation order along dim 0 within one expert (empty: the tensor is the one
    key, whole). `pad_rows`: rows appended as zeros up to a multiple of this. `where`: the SGLang
    code that lays the tensor out this way."""

    hf: re.Pattern[str]
    sglang: str | None          # None: SGLang's loader skips these keys (no tensor to compare)
    parts: tuple[str, ...] = ()
    pad_rows: int = 1
    where: str = ""


_L = r"model\.layers\.(?P<layer>\d+)\."
# Order matters: the first rule that fullmatches an HF key takes it; the last one takes any key.
LAYOUT: tuple[LayoutRule, ...] = (
    LayoutRule(re.compile(r".*rotary_emb\.inv_freq|mtp\..*"), None,
               where="models/qwen3_moe.py load_weights: `rotary_emb.inv_freq` and `mtp.*` (a draft's) are "
                     "skipped; SGLang recomputes its rotary cache"),
    LayoutRule(re.compile(_L + r"self_attn\.(?P<part>q_proj|k_proj|v_proj)\.weight"),
               "model.layers.{layer}.self_attn.qkv_proj.weight", ("q_proj", "k_proj", "v_proj"),
               where="models/qwen3_moe.py load_weights stacked_params_mapping (q, k, v) → "
                     "layers/linear.py QKVParallelLinear.weight_loader: q rows, then k, then v"),
    LayoutRule(re.compile(_L + r"mlp\.experts\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj)\.weight"),
               "model.layers.{layer}.mlp.experts.w13_weight", ("gate_proj", "up_proj"),
               where="FusedMoE.make_expert_params_mapping (gate → w1, up → w3) → "
                     "layers/moe/fused_moe_triton/layer.py FusedMoE._load_w13: w13_weight[e] = [w1; w3] "
                     "(gate rows first), [E, 2I, H]"),
    LayoutRule(re.compile(_L + r"mlp\.experts\.(?P<expert>\d+)\.(?P<part>down_proj)\.weight"),
               "model.layers.{layer}.mlp.experts.w2_weight", ("down_proj",),
               where="FusedMoE.make_expert_params_mapping (down → w2) → FusedMoE._load_w2: "
                     "w2_weight[e] = down_proj, [E, H, I]"),
    LayoutRule(re.compile(_L + r"mlp\.(?P<part>gate_proj|up_proj)\.weight"),
               "model.layers.{layer}.mlp.gate_up_proj.weight", ("gate_proj", "up_proj"),
               where="models/qwen3.py load_weights stacked_params_mapping (gate → 0, up → 1) → "
                     "layers/linear.py MergedColumnParallelLinear.weight_loader: gate rows, then up"),
    LayoutRule(re.compile(r"(?P<name>model\.embed_tokens\.weight|lm_head\.weight)"), "{name}",
               pad_rows=VOCAB_PAD,
               where="layers/vocab_parallel_embedding.py VocabParallelEmbedding.weight_loader: the "
                     "vocabulary padded to a multiple of 64 rows, the padding filled with 0"),
    LayoutRule(re.compile(r"(?P<name>.+)"), "{name}",
               where="everything else (norms, o_proj, the MoE router `mlp.gate`): copied whole "
                     "(default_weight_loader, RowParallelLinear / ReplicatedLinear at tp=1)"),
)


@dataclass(frozen=True)
class ExpectedTensor:
    """The trainer-side checksum of one SGLang tensor: its `digest` (as SGLang hashes it), the HF
    keys it is built from, its layer, and the experts stacked in it (None: not an expert stack)."""

    digest: str
    sources: tuple[str, ...]
    layer: int | None
    experts: tuple[int, ...] | None


@dataclass(frozen=True)
class Mismatch:
    """One SGLang tensor whose hash differs from the trainer's (`held` None: the server did not
    report it). For a stacked expert tensor `experts` lists every expert of the layer: SGLang
    hashes the stack as one tensor, so which expert differs is not known here."""

    name: str
    sources: tuple[str, ...]
    layer: int | None
    experts: tuple[int, ...] | None
    expected: str
    held: str | None

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.name, "sources": list(self.sources), "layer": self.layer,
                "experts": None if self.experts is None else list(self.experts),
                "expected": self.expected, "held": self.held}


def sglang_hash(t: torch.Tensor) -> str:
    """SGLang's `_hash_tensor` of a host tensor: the first 8 bytes of the SHA-256 of its
    contiguous raw bytes, as 16 hex digits (mm_utils.tensor_hash, CPU path)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(memoryview(flat.view(torch.uint8).numpy())).hexdigest()[:16]


# gpu_tensor_hash's constants (sglang/kernels/ops/memory/gpu_tensor_hash.py)
_M32, _M64 = 0xFFFFFFFF, (1 << 64) - 1
_FMIX = (0x85EBCA6B, 0xC2B2AE35)
_POS = (0x27D4EB2D, 0x165667B1)
_SEED = 0x243F6A88
_TILE = 8192                 # 32-bit words per tile (tile_words)
_CHUNK = _TILE * 512         # words mixed at once here (a multiple of the tile): bounds the int64 copies


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for 0 <= x < 2**32 in int64, without overflowing int64 (c split in halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX[0])
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX[1])
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _splitmix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sglang_cuda_hash(t: torch.Tensor) -> str:
    """SGLang's `_hash_tensor` of a CUDA tensor (`gpu_tensor_hash`, default seed and tile), as 16
    hex digits, recomputed with torch integer ops on `t`'s own device: the bytes zero-padded to
    32-bit words; word i mixed twice, fmix32(w ^ ((i*A + s) ^ rotl(i, r))); the mixes summed mod
    2**32 per tile of 8192 words, each sum xor-ed with the byte count and fmix32-ed, the two
    joined into 64 bits; the tiles summed mod 2**64; splitmix64 of the total."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() == 0:
        return f"{0:016x}"
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 4)])
    words = raw.view(torch.int32)
    n = words.numel()
    seeds = (_SEED & _M32, ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32)
    total = 0
    for start in range(0, n, _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64) & _M32
        idx = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
        halves = []
        for pos, seed, rot in zip(_POS, seeds, (15, 13)):
            k = _fmix32(w ^ (((_mul32(idx, pos) + seed) & _M32) ^ _rotl32(idx, rot)))
            k = torch.cat([k, k.new_zeros(-k.numel() % _TILE)]).reshape(-1, _TILE)
            halves.append(_fmix32((k.sum(1) & _M32) ^ ((n * 4) & _M32)))
        total += (int(halves[0].sum()) << 32) + int(halves[1].sum())
    return f"{_splitmix64(total & _M64):016x}"


HASHERS = {"cpu": sglang_hash, "cuda": sglang_cuda_hash}     # the server's device → how SGLang hashes


def _rule_for(key: str) -> tuple[LayoutRule, re.Match[str]]:
    for rule in LAYOUT:
        m = rule.hf.fullmatch(key)
        if m is not None:
            return rule, m
    raise AssertionError("the last LAYOUT rule matches every key")


@dataclass
class _Group:
    rule: LayoutRule
    layer: int | None
    pieces: dict[tuple[int | None, str], tuple[str, torch.Tensor]]   # (expert, part) → (HF key, tensor)


def _group(weights: Mapping[str, torch.Tensor]) -> dict[str, _Group]:
    """The HF tensors collected under the SGLang tensor each one goes into."""
    groups: dict[str, _Group] = {}
    for key, tensor in weights.items():
        rule, m = _rule_for(key)
        if rule.sglang is None:
            continue
        found = m.groupdict()
        name = rule.sglang.format(**{k: v for k, v in found.items() if v is not None})
        at = _LAYER.search(name)
        layer = None if at is None else int(at.group(1))
        g = groups.setdefault(name, _Group(rule, layer, {}))
        expert = None if found.get("expert") is None else int(found["expert"])
        g.pieces[(expert, found.get("part") or "")] = (key, tensor)
    return groups


def _assemble(name: str, g: _Group, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """The SGLang tensor `name` built from its group's HF tensors (cast to `dtype` first, as
    SGLang's `param.data.copy_(loaded_weight)` casts), and the experts stacked in it."""
    parts = g.rule.parts or ("",)
    experts = sorted({e for e, _ in g.pieces if e is not None})
    if experts and experts != list(range(len(experts))):
        missing = sorted(set(range(experts[-1] + 1)) - set(experts))
        raise ValueError(f"{name}: the weights have experts {experts} of layer {g.layer} but not {missing}; "
                         f"SGLang stacks experts 0..E-1, pass the complete state dict")
    rows = []
    for e in experts or [None]:
        chunk = []
        for part in parts:
            if (e, part) not in g.pieces:
                have = next(iter(g.pieces.values()))[0]
                raise ValueError(f"{name}: the weights have {have} but no {part!r} piece"
                                 f"{'' if e is None else f' of expert {e}'}; SGLang fuses {', '.join(parts)} "
                                 f"into one tensor, pass the complete state dict")
            chunk.append(g.pieces[(e, part)][1].detach().to(dtype))
        rows.append(chunk[0] if len(chunk) == 1 else torch.cat(chunk, 0))
    t = torch.stack(rows) if experts else rows[0]
    pad = -t.shape[0] % g.rule.pad_rows
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))], 0)
    return t, (tuple(experts) if experts else None)


def expected_checksums(weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                       server_device: str = "cpu") -> dict[str, ExpectedTensor]:
    """{SGLang name: ExpectedTensor} for the trainer's HF state dict (Qwen3 / Qwen3-MoE keys, as
    `axrl.model.hf_state_dict` gives them): each SGLang tensor laid out by `LAYOUT` from the HF
    tensors cast to the server's `dtype`, hashed as SGLang hashes it on `server_device` ("cpu":
    `sglang_hash`, "cuda": `sglang_cuda_hash`; the tensors may live anywhere). A stacked
    expert tensor lists every expert's keys as its sources. Raises ValueError naming the missing
    HF key when a fused or stacked tensor is incomplete."""
    if server_device not in HASHERS:
        raise ValueError(f"server_device={server_device!r}: SGLang hashes weights on {sorted(HASHERS)} only")
    hasher = HASHERS[server_device]
    out: dict[str, ExpectedTensor] = {}
    for name, g in _group(weights).items():
        t, experts = _assemble(name, g, dtype)
        sources = tuple(key for key, _ in g.pieces.values())
        out[name] = ExpectedTensor(hasher(t), sources, g.layer, experts)
    return out


def compare(expected: Mapping[str, ExpectedTensor],
            held: Mapping[str, str]) -> tuple[list[Mismatch], list[str]]:
    """(mismatches, the SGLang names compared), in `expected`'s order. A name the server holds
    that `expected` lacks (rotary caches and other buffers, anything `LAYOUT` does not model) is
    not compared and never a mismatch (`not_compared` lists them). An expected tensor the server
    does not report is a mismatch when the server reported tensors at all — except an `lm_head`
    equal to the embedding, which a server with tied embeddings holds once, as the embedding.
    A mismatching expert stack names its layer and every expert: finding the one expert is left
    to the probe re-score / bisect."""
    if not held:
        return [], []
    mismatches, compared = [], []
    embed = expected.get("model.embed_tokens.weight")
    for name, want in expected.items():
        got = held.get(name)
        if got is None and name == "lm_head.weight" and embed is not None and embed.digest == want.digest:
            continue
        compared.append(name)
        if got != want.digest:
            mismatches.append(Mismatch(name, want.sources, want.layer, want.experts, want.digest, got))
    return mismatches, compared


def not_compared(expected: Mapping[str, ExpectedTensor], held: Mapping[str, str]) -> list[str]:
    """The names the server reported that `expected` has no entry for (sorted)."""
    return sorted(set(held) - set(expected))


def held_checksums(url: str, timeout_s: float = 60.0) -> dict[str, str]:
    """{SGLang parameter/buffer name: 16-hex-digit hash} of the model a server holds, from
    `POST {url}/weights_checker {"action": "checksum"}` (the target model; drafts excluded).
    Raises RuntimeError naming the URL and what SGLang said when the route is missing, the server
    answers success=false or is unreachable, or its ranks hold tensor-parallel shards (not
    modelled). The ranks of a data- or pipeline-parallel server are merged; a name two ranks hash
    differently gets both hashes joined by "|", which matches no expected digest."""
    import httpx

    endpoint = url.rstrip("/") + "/weights_checker"
    try:
        r = httpx.post(endpoint, json={"action": "checksum", "selector": "target"}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise RuntimeError(f"{endpoint}: no answer ({type(e).__name__}: {e})") from None
    if r.status_code == 404:
        raise RuntimeError(f"{endpoint}: the server has no /weights_checker route (SGLang < 0.5.23, or not "
                           f"SGLang); per-tensor checksums are unavailable, use the probe re-score")
    try:
        body = r.json()
    except ValueError:
        raise RuntimeError(f"{endpoint}: HTTP {r.status_code}, not JSON: {r.text[:300]!r}") from None
    if r.status_code != 200 or not body.get("success", False):
        raise RuntimeError(f"{endpoint}: HTTP {r.status_code}, SGLang said: {body.get('message', r.text[:300])!r}")
    return _merge_ranks(endpoint, body.get("ranks") or [])


def _merge_ranks(endpoint: str, ranks: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """One {name: hash} from the ranks' answers (see `held_checksums`)."""
    if not ranks:
        raise RuntimeError(f"{endpoint}: success, but no rank reported checksums")
    merged: dict[str, set[str]] = {}
    for rank in ranks:
        infos = rank.get("parallelism_info") or []     # a list, one per role (target, drafts), in 0.5.23
        for info in [infos] if isinstance(infos, Mapping) else infos:
            if int(info.get("tp_size", 1)) > 1:
                raise RuntimeError(f"{endpoint}: tensor-parallel server (tp_size={info['tp_size']}): each rank "
                                   f"hashes its shard, which the expected layout does not model")
        for name, digest in (rank.get("checksums") or {}).items():
            merged.setdefault(name, set()).add(str(digest))
    return {name: "|".join(sorted(d)) for name, d in merged.items()}
