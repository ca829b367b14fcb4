"""`axrl-debug bisect` with the trainer on the Megatron-core backend (world size 1, CPU/gloo): the
trainer side's probe points come from forward hooks on megatron-core's GPTModel
(axrl/train/megatron/probe_hooks.py). A clean run bisects to no divergence with every op's size
and floor reported; one expert perturbed in the engine's copy only is named with its layer,
`expert_out` and that expert; the hooks leave the forward's bits alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

from replay.bisect import bisect_step  # noqa: E402
from replay.bisect_capture import SampleProbe  # noqa: E402
from replay.policy import policy_before  # noqa: E402
from train_util import debug, train  # noqa: E402

# One recorded step of the two-layer micro-moe model trained by Megatron with R3 (the trainer replays
# the rollout routing: bisect replays it as recorded), the checkpoint before it.
RUN = ["train.backend=megatron", "r3=true", "steps=1", "model.preset=micro-moe", "warmup.steps=30", "data.task=echo",
       "data.task_args={}", "data.prompts_per_step=1", "rollout.group_size=2", "eval.every=0", "runtime.threads=1",
       "checkpoint.every=1", "rollout.max_new_tokens=8", "train.micro_batch_tokens=200"]
EXPERT = (1, 2)  # (layer, expert) perturbed in the engine only


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bisect_megatron") / "run"
    train(path, RUN)
    return path


def test_megatron_trainer_side_bisects_clean_and_names_a_perturbed_expert(run):
    clean = debug("bisect", run, "--step", 0, "--json")
    assert clean.exit_code == 0, clean.output
    doc = json.loads(clean.output)
    assert doc["first_divergence"] is None, doc["first_divergence"]
    assert doc["r3"] is True
    assert doc["how"]["trainer"]["expert_out"].startswith("recomputed")  # said, as the engines say theirs
    ops = {(p["layer"], p["op"]) for p in doc["points"]}
    assert {(0, "attn"), (1, "expert_out"), (1, "topk_ids"), (-1, "logits"), (-1, "logprobs")} <= ops
    floats = [p for p in doc["points"] if p["op"] not in ("topk_ids", "in")]
    assert max(p["size"] for p in floats) > 0 and all(0 < p["floor"] < 1e-4 for p in floats)
    assert all(p["size"] <= p["floor"] for p in floats)

    layer, expert = EXPERT

    def perturb(weights):
        w = dict(weights)
        key = f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"
        w[key] = w[key] * 1.05
        return w

    first = bisect_step(run, 0, engine_weights=perturb).first_divergence()
    assert (first["layer"], first["op"], first.get("experts")) == (layer, "expert_out", [expert]), first
    assert first["size"] > 1e3 * first["floor"]

    # the hooks only observe: logprobs and routing as `forward`'s, bit for bit
    state = policy_before(run, 0)
    try:
        batch = state.recorded(0).batch
        plain = state.backend.forward(batch, r3=True)
        probe = SampleProbe(0, int(batch.lengths[0]))
        probed = state.backend.probe_forward(batch, probe, r3=True)
    finally:
        state.close()
    assert torch.equal(plain.logprobs, probed.logprobs) and torch.equal(plain.routed_experts, probed.routed_experts)
    assert {(1, "expert_out"), (0, "topk_ids"), (-1, "logits")} <= set(probe.states)
