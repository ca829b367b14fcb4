"""`axrl-debug bisect` (replay/bisect.py) on the embedded engine: an unmodified run is within every
op's floor and bisects the same twice; one expert perturbed in the engine's copy only is named with
its layer, `expert_out`, the expert and exactly the tokens routed to it; keys and values read back
from the KV cache in bf16 are named as `attn` at the decode positions only. Also: the probe
points of the model's forward leave its bits alone, and they follow the shared vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from axrl.inference.embedded.kv_cache import StaticKVCache
from axrl.model import Qwen3ForCausalLM
from axrl.model.config import preset_config
from axrl.model.probe_points import POINTS, forward_order
from axrl.model.qwen3 import init_weights
from bisect_util import EXPERT, perturbed_expert, routed_positions, small_run
from replay.bisect import bisect_step
from train_util import debug, train


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bisect") / "run"
    train(path, small_run())
    return path


def _without_timings(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "timings"}


def test_probe_points_keep_the_forward_bitwise_and_follow_the_vocabulary():
    cfg = preset_config("micro-moe")
    model = Qwen3ForCausalLM(cfg)
    init_weights(model, 0)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    seen: list[tuple[int, str]] = []

    class Probe:
        def at(self, point, layer, x):
            seen.append((layer, point))
            return x

    with torch.no_grad():
        plain = model(ids, return_routing=True)
        probed = model(ids, return_routing=True, probe=Probe())
    assert torch.equal(plain.logits, probed.logits) and torch.equal(plain.routed_experts, probed.routed_experts)
    moe = {i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)}
    # the model calls every point but the derived `logprobs`, in the vocabulary's order
    assert seen == [p for p in forward_order(cfg.num_hidden_layers, moe) if p[1] != "logprobs"]
    assert POINTS[:3] == ("in", "attn_norm", "attn") and POINTS[-3:] == ("final", "logits", "logprobs")


def test_unmodified_run_is_within_every_floor_and_stable(run):
    first = debug("bisect", run, "--step", 0, "--json")
    assert first.exit_code == 0, first.output
    again = debug("bisect", run, "--step", 0, "--json")
    a, b = json.loads(first.output), json.loads(again.output)
    assert _without_timings(a) == _without_timings(b)  # sizes, floors, tokens: the same bits twice
    assert a["first_divergence"] is None, a["first_divergence"]
    assert a["fidelity"]["engine_path_vs_rollout_logprob"]["bitwise_equal"] > 0
    sizes = [p["size"] for p in a["points"] if p["op"] not in ("in", "topk_ids")]
    assert max(sizes) > 0  # the two paths do differ (kernel rounding), just not beyond the floor
    assert all(0 < p["floor"] < 1e-4 for p in a["points"] if p["op"] != "topk_ids")
    assert a["vocab"] and all(v["argmax_agree"] and v["kl_engine_trainer"] < 1e-9 for v in a["vocab"])


def test_expert_perturbed_in_the_engine_only_is_named_with_its_tokens(run):
    layer, expert = EXPERT
    result = bisect_step(run, 0, engine_weights=perturbed_expert(layer, expert))
    first = result.first_divergence()
    assert (first["layer"], first["op"], first.get("experts")) == (layer, "expert_out", [expert]), first
    assert first["size"] > 1e3 * first["floor"]
    # exactly the positions whose recorded routing sent them to that expert (the last token is never fed)
    routed, _ = routed_positions(run, result.sample_id, layer, expert)
    assert first["tokens"] == routed
    assert result.routing is not None and result.routing["ids_differ"] == []


def test_bf16_kv_cache_reads_are_named_as_attention_at_decode_positions(run):
    class Bf16Reads(StaticKVCache):
        """The decode step reads keys and values rounded to bf16 (prefill attends over its own)."""

        def view(self, layer, n, kv_len):
            k, v = super().view(layer, n, kv_len)
            return k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)

    result = bisect_step(run, 0, engine_kv=Bf16Reads)
    first = result.first_divergence()
    assert (first["layer"], first["op"]) == (0, "attn"), first
    # decode feeds each turn's generated tokens but its last; the first one comes from the prefill
    generated = set(result.generated)
    decoded = {p for p in generated if p + 1 in generated}
    assert first["tokens"] and set(first["tokens"]) <= decoded, (first["tokens"], sorted(decoded))


def test_bad_input_is_refused_with_what_to_do(run):
    vllm = debug("bisect", run, "--step", 0, "--engine", "vllm", "--engine-python", "/nonexistent/python")
    assert vllm.exit_code == 2 and "no such interpreter" in vllm.output, vllm.output
    embedded = debug("bisect", run, "--step", 0, "--engine-python", "/nonexistent/python")
    assert embedded.exit_code == 2 and "only with --engine sglang|vllm" in embedded.output, embedded.output
    sglang = debug("bisect", run, "--step", 0, "--engine", "sglang", "--engine-python", "/nonexistent/python")
    assert sglang.exit_code == 2 and "no such interpreter" in sglang.output, sglang.output
    unknown = debug("bisect", run, "--step", 0, "--sample", 9999)
    assert unknown.exit_code == 2 and "--sample 9999" in unknown.output, unknown.output


def test_tui_token_view_bisects_its_sample(run):
    """`b` in a sample's token view bisects that sample and shows the verdict and the walk."""
    import asyncio

    from axrl_debug.tui.app import DebugApp
    from axrl_debug.tui.screens import BisectScreen, TokensScreen

    app = DebugApp(run)

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(600):
                if app.background_done:
                    break
                await pilot.pause(0.05)
            await pilot.press("enter", "enter")
            assert isinstance(app.screen, TokensScreen)
            await pilot.press("b")
            for _ in range(1200):                   # ≤ 60 s: the policy is rebuilt, both sides run
                if isinstance(app.screen, BisectScreen):
                    break
                await pilot.pause(0.05)
            assert isinstance(app.screen, BisectScreen)
            doc = app.screen.doc
            assert doc["engine"] == "embedded" and doc["points"] and doc["first_divergence"] is None
            await pilot.press("escape")
            assert isinstance(app.screen, TokensScreen)

    asyncio.run(main())
