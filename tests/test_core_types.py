"""axrl.core, the ground floor: its import isolation, the token-stream helpers the agent loop and
the proxy session share, the one list of finish reasons, and the routing shape every layer agrees
on (ModelConfig.routing_shape), also for MoE models with dense layers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from axrl.agents.proxy import ProxyServer
from axrl.agents.proxy.trajectories import AgentService
from axrl.agents.proxy.session import Session
from axrl.core import (FINISH_REASONS, STATUSES, Trajectory, append_generated, assistant_close_ids, reply_glue,
                       routing_rows, token_versions)
from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams
from axrl.model import build_model, preset_config
from axrl.trace import schema
from test_structure import fresh_import_graph

ROOT = Path(__file__).resolve().parents[1]


def axrl_imports(package: str) -> set[str]:
    """The project modules imported anywhere (also inside functions) by the modules of `package`,
    from test_structure's import graph (built in a fresh interpreter)."""
    graph = fresh_import_graph(ROOT)
    return {dep for mod, deps in graph.items() if mod.startswith(f"axrl.{package}") for dep in deps}


# ---------------------------------------------------------------------------------- layering

def test_core_imports_nothing_of_axrl_but_itself():
    assert {m for m in axrl_imports("core") if not m.startswith("axrl.core")} == set()
    code = "import sys, axrl.core; print(sorted(m for m in sys.modules if m.startswith(('axrl', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["axrl", "axrl.core", "axrl.core.outcomes", "axrl.core.token_stream", "axrl.core.trajectory"]


def test_agents_do_not_import_rollout():
    assert not [m for m in axrl_imports("agents") if m.startswith("axrl.rollout")]
    assert not (ROOT / "axrl" / "rollout" / "trajectory.py").exists()


def test_one_definition_of_finish_reasons_and_statuses():
    assert schema.KNOWN_FINISH_REASONS is FINISH_REASONS and schema.KNOWN_STATUSES is STATUSES
    assert {"stop", "length", "context", "max_turns", "abort", "failed"} == set(FINISH_REASONS)
    assert Trajectory(0, 0, "p").status in STATUSES and Trajectory(0, 0, "p").finish_reason in FINISH_REASONS


# ---------------------------------------------------------------------------------- token stream

def test_close_ids_and_glue(tok):
    close = assistant_close_ids(tok)
    assert close[0] == tok.eos_token_id and tok.decode(close[1:]) == "\n"  # ChatML: <|im_end|> then a newline
    assert reply_glue(close, closed=True) == close[1:] and reply_glue(close, closed=False) == close
    # The proxy session stitches with the very ids the agent loop closes turns with.
    assert Session("s", tok, max_context_len=64, submit=None)._close_ids == close


def test_versions_runs_and_fallback():
    assert token_versions([3, 4, 4], 9, 3) == [3, 4, 4]
    assert token_versions([], 9, 3) == [9, 9, 9]  # engines that report only the final version
    traj = Trajectory(0, 0, "p")
    traj.append([1, 2], generated=False, turn=0)
    append_generated(traj, [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], [2, 2, 3, 2], turn=1)
    traj.check()
    assert traj.policy_version.tolist() == [-1, -1, 2, 2, 3, 2]
    assert traj.loss_mask.tolist() == [0, 0, 1, 1, 1, 1] and traj.turn.tolist() == [0, 0, 1, 1, 1, 1]
    np.testing.assert_allclose(traj.rollout_logprob[2:], [-0.1, -0.2, -0.3, -0.4])


def test_routing_rows_pad_tokens_the_model_never_read():
    chunks = [np.full((3, 2, 2), 1, np.int32), np.full((2, 2, 2), 2, np.int32)]
    rows = routing_rows(chunks, 7)
    assert rows.shape == (7, 2, 2) and rows.dtype == np.int32
    assert rows[:, 0, 0].tolist() == [1, 1, 1, 2, 2, 0, 0]


# ---------------------------------------------------------------------------------- routing shape

DENSE_LAYERS = [dict(num_hidden_layers=3, mlp_only_layers=[1]), dict(num_hidden_layers=4, decoder_sparse_step=2)]


def test_routing_shape_counts_every_decoder_layer():
    assert preset_config("tiny-dense").routing_shape() is None
    assert preset_config("micro-moe").routing_shape() == (2, 2, 4)
    for over in DENSE_LAYERS:
        cfg = preset_config("micro-moe", **over)
        assert sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers))) < cfg.num_hidden_layers
        assert cfg.routing_shape() == (cfg.num_hidden_layers, 2, 4)


@pytest.mark.parametrize("over", DENSE_LAYERS, ids=["mlp_only_layers", "decoder_sparse_step"])
def test_engine_routing_of_a_model_with_dense_layers_is_accepted_by_the_agent_service(tok, over):
    torch.set_num_threads(1)
    cfg = preset_config("micro-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id, **over)
    layers, top_k, experts = cfg.routing_shape()
    model = build_model(cfg, seed=0).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    with torch.no_grad():
        forward = model(torch.tensor([ids]), return_routing=True, compute_logits=False).routed_experts
    assert tuple(forward.shape) == (1, len(ids), layers, top_k)
    engine = EmbeddedEngine(model, max_batch_size=2, max_seq_len=256, eos_token_id=tok.eos_token_id)
    try:
        result = engine.submit_many([GenerateRequest(
            input_ids=ids, return_logprob=True, return_routed_experts=True,
            sampling_params=SamplingParams(max_new_tokens=5, seed=1))])[0].result()
    finally:
        engine.shutdown()
    out = result.output_ids
    n = len(ids) + len(out)
    routing = routing_rows([np.asarray(result.routed_experts, np.int32)], n)
    assert routing.shape == (n, layers, top_k)
    dense = [i for i in range(layers) if not cfg.is_moe_layer(i)]
    assert dense and not routing[:, dense].any()  # dense layers' rows are zeros, MoE layers' are real

    pooled: list[Trajectory] = []
    with ProxyServer(tok) as proxy:
        proxy.registry.service = AgentService(tok, pooled.append, current_version=lambda: 0, max_context_len=256,
                                              routing_shape=cfg.routing_shape())
        body = {"group_id": 1, "token_ids": ids + out, "loss_mask": [0] * len(ids) + [1] * len(out),
                "logprobs": [None] * len(ids) + list(result.output_logprobs), "reward": 1.0,
                "routing": routing.tolist()}
        auth = {"Authorization": f"Bearer {proxy.registry.service.api_key}"}  # the run's agent key
        r = httpx.post(f"{proxy.url}/v1/trajectories", json=body, headers=auth)
        assert r.status_code == 200, r.text
        bad = httpx.post(f"{proxy.url}/v1/trajectories", json={**body, "routing": routing[:, :, :1].tolist()},
                         headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "routing"
    (traj,) = pooled
    np.testing.assert_array_equal(traj.routed_experts, routing)
    assert traj.routed_experts.max() < experts
