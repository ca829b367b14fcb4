"""The Megatron-core train backend against the embedded torch backend: weight conversion, logprob
and training parity at world size 1 and with TP=2 / EP=2 / data-parallel worker processes, R3
through Megatron's RouterReplay, checkpoints, errors. Runs real megatron-core on CPU (gloo)."""

from __future__ import annotations

import dataclasses
import math
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axrl.model import build_model, hf_state_dict, preset_config
from axrl.train import TorchBackend, TorchBackendConfig
from axrl.train.megatron.convert import shard, to_hf, to_megatron, unshard
from tests.backend_util import make_batch
from tests.test_train_backend import pg_loss

import megatron.core as _megatron_core  # noqa: E402,F401  (the test extra installs it: a broken import fails)

from axrl.train.megatron import MegatronBackend, MegatronBackendConfig  # noqa: E402

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5


def torch_backend(seed: int = 0, preset: str = "micro-moe", **cfg) -> TorchBackend:
    return TorchBackend(build_model(preset_config(preset), seed=seed),
                        TorchBackendConfig(**{"lr": 1e-2, "num_threads": 1, **cfg}))


@pytest.fixture
def megatron():
    """Factory for Megatron backends that are all closed after the test (worker processes,
    the in-process gloo group)."""
    made: list[MegatronBackend] = []

    def make(seed: int = 0, preset: str = "micro-moe", **cfg) -> MegatronBackend:
        b = MegatronBackend(build_model(preset_config(preset), seed=seed),
                            MegatronBackendConfig(**{"lr": 1e-2, "num_threads": 1, **cfg}))
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def weights_diff(a, b) -> float:
    wa, wb = dict(a.named_weights()), dict(b.named_weights())
    assert set(wa) == set(wb)
    return max(max_diff(wa[k], wb[k]) for k in wa)


# ---------------------------------------------------------------- conversion (no megatron needed)

@pytest.mark.parametrize("preset", ["micro-moe", "tiny-dense"])
def test_hf_megatron_roundtrip_is_bitwise(preset):
    cfg = preset_config(preset)
    hf = hf_state_dict(build_model(cfg, seed=1))
    full = to_megatron(hf, cfg)
    # q/k/v are fused per KV group: group g holds its query heads, then k_g, v_g
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    g1 = qkv[(per + 2) * d:(per + 2) * 2 * d]
    assert torch.equal(g1[:per * d], hf["model.layers.0.self_attn.q_proj.weight"][per * d:2 * per * d])
    assert torch.equal(g1[per * d:(per + 1) * d], hf["model.layers.0.self_attn.k_proj.weight"][d:2 * d])
    back = to_hf(full, cfg)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 2)])
def test_shard_unshard_roundtrip(tp, ep):
    cfg = preset_config("micro-moe", num_attention_heads=8, num_key_value_heads=4)
    full = to_megatron(hf_state_dict(build_model(cfg, seed=2)), cfg)
    parts = []
    for r in range(tp):
        ranks = dict(tp_rank=r, tp_size=tp, ep_rank=r // (tp // ep), ep_size=ep, etp_rank=0, etp_size=1)
        local = shard(full, num_experts=cfg.num_experts, **ranks)
        # each rank holds num_experts / ep experts, renumbered from 0; gate and up sliced separately
        assert f"decoder.layers.0.mlp.experts.local_experts.{cfg.num_experts // ep}.linear_fc1.weight" not in local
        assert local["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] == full[
            "decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] // tp
        parts.append((local, ranks))
    back = unshard(parts, num_experts=cfg.num_experts)
    assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)


# ---------------------------------------------------------------- world size 1 parity

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_embedded_backend(megatron, temperature):
    batch = make_batch(temperature=temperature)
    ref = torch_backend(seed=3, micro_batch_tokens=16).forward(batch)
    mb = megatron(seed=3, micro_batch_tokens=16)
    assert mb.fingerprint() == torch_backend(seed=3).fingerprint()  # same HF weights after the round trip
    out = mb.forward(batch)
    assert max_diff(out.logprobs, ref.logprobs) < TOL
    assert max_diff(out.entropy, ref.entropy) < TOL
    assert torch.equal(out.routed_experts, ref.routed_experts)
    assert out.logprobs[batch.offsets[:-1]].eq(0).all()


def test_dense_model_matches(megatron):
    batch = make_batch()
    ref = torch_backend(seed=1, preset="tiny-dense").forward(batch)
    out = megatron(seed=1, preset="tiny-dense").forward(batch)
    assert out.routed_experts is None and max_diff(out.logprobs, ref.logprobs) < TOL


def test_training_updates_match_embedded_backend(megatron):
    batch = make_batch()
    tb = torch_backend(seed=4, micro_batch_tokens=16, weight_decay=0.01)
    mb = megatron(seed=4, micro_batch_tokens=16, weight_decay=0.01)
    for _ in range(3):
        m1, m2 = tb.forward_backward(batch, pg_loss), mb.forward_backward(batch, pg_loss)
        s1, s2 = tb.optimizer_step(), mb.optimizer_step()
        assert len(m2.micro_batches) == len(m1.micro_batches) > 1
        assert abs(m1.loss - m2.loss) < TOL and abs(m1.metrics["entropy"] - m2.metrics["entropy"]) < TOL
        assert abs(s1.grad_norm - s2.grad_norm) < TOL * max(1.0, s1.grad_norm) and s1.lr == s2.lr
    assert weights_diff(tb, mb) < 1e-4
    assert max_diff(tb.forward(batch).logprobs, mb.forward(batch).logprobs) < 1e-4


def test_r3_restores_rollout_routing_and_router_still_learns(megatron):
    batch = make_batch(lengths=[20, 25, 18, 30])
    mb = megatron(seed=5, lr=0.3, weight_decay=0.0)
    recorded = mb.forward(batch).routed_experts  # "rollout" routing under the initial weights
    for _ in range(4):  # large steps: the trainer's own routing moves away from the recorded one
        mb.forward_backward(batch, pg_loss)
        mb.optimizer_step()
    drifted = mb.forward(batch)
    assert (drifted.routed_experts == recorded).float().mean() < 0.99
    replay_batch = dataclasses.replace(batch, routed_experts=recorded)
    replayed = mb.forward(replay_batch, r3=True)
    assert torch.equal(replayed.routed_experts, recorded)
    # The routing really was replayed: the logprobs are the embedded model's with forced experts.
    ref = TorchBackend(mb.hf_model(), TorchBackendConfig(num_threads=1)).forward(replay_batch, r3=True)
    # (large weights after lr=0.3 steps: logprobs reach -45, so fp32 rounding is relative; two
    # implementations on the CPU's own kernels differ by up to ~1e-4 on some CPUs — still 10x below
    # the drifted routing's gap asserted next)
    assert torch.allclose(replayed.logprobs, ref.logprobs, rtol=1e-5, atol=1e-4)
    assert max_diff(replayed.logprobs, drifted.logprobs) > 1e-3
    # Gradients still reach the router through the replayed experts' probabilities.
    before = dict(mb.named_weights())
    mb.forward_backward(replay_batch, pg_loss, r3=True)
    mb.optimizer_step()
    after = dict(mb.named_weights())
    for i in range(2):
        assert not torch.equal(before[f"model.layers.{i}.mlp.gate.weight"], after[f"model.layers.{i}.mlp.gate.weight"])


def test_r3_rejects_bad_routing(megatron):
    mb = megatron()
    batch = make_batch()
    with pytest.raises(ValueError, match="routed_experts is None"):
        mb.forward(batch, r3=True)
    bad = dataclasses.replace(batch, routed_experts=torch.full((batch.num_tokens, 2, 2), 9))
    with pytest.raises(ValueError, match="outside"):
        mb.forward(bad, r3=True)


def test_bfloat16_trains(megatron):
    batch = make_batch()
    mb = megatron(dtype="bfloat16", lr=3e-2)
    first = mb.forward_backward(batch, pg_loss).loss
    mb.optimizer_step()
    for _ in range(4):
        last = mb.forward_backward(batch, pg_loss).loss
        mb.optimizer_step()
    assert torch.isfinite(torch.tensor(last)) and last < first
    # fp32 master weights, bf16 compute: close to the fp32 forward, not equal
    lp16 = mb.forward(batch).logprobs
    mb.config = mb.config.model_copy(update={"dtype": "float32"})
    assert 0 < max_diff(lp16, mb.forward(batch).logprobs) < 0.1


# ---------------------------------------------------------------- state

def test_save_load_continues_bitwise(megatron, tmp_path):
    batch = make_batch()
    a = megatron(seed=6)
    a.forward_backward(batch, pg_loss)
    a.optimizer_step()
    a.save(tmp_path / "ck")
    losses_a = []
    for _ in range(2):
        losses_a.append(a.forward_backward(batch, pg_loss).loss)
        a.optimizer_step()
    b = megatron(seed=99)  # other initial weights: everything must come from the checkpoint
    b.load(tmp_path / "ck")
    losses_b = []
    for _ in range(2):
        losses_b.append(b.forward_backward(batch, pg_loss).loss)
        b.optimizer_step()
    assert losses_a == losses_b and a.fingerprint() == b.fingerprint() and b.scheduler_step == 3


def test_checkpoints_move_between_backends(megatron, tmp_path):
    """Both backends save HF-named weights and moments: a torch checkpoint continues on Megatron."""
    batch = make_batch()
    tb = torch_backend(seed=7)
    tb.forward_backward(batch, pg_loss)
    tb.optimizer_step()
    tb.save(tmp_path / "ck")
    mb = megatron(seed=0)
    with pytest.warns(UserWarning, match="config differs"):
        mb.load(tmp_path / "ck")
    assert mb.fingerprint() == tb.fingerprint()
    for b in (tb, mb):
        b.forward_backward(batch, pg_loss)
        b.optimizer_step()
    assert weights_diff(tb, mb) < 1e-5


def test_forward_under_kept_weights(megatron):
    from axrl.train.protocol import TrainBackend

    mb = megatron(seed=3)
    assert isinstance(mb, TrainBackend) and mb.inspect(make_batch(), pg_loss) is None
    batch = make_batch()
    before = mb.forward(batch).logprobs
    mb.keep_weights("v0")
    mb.forward_backward(batch, pg_loss)
    mb.optimizer_step()
    fp, after = mb.fingerprint(), mb.forward(batch).logprobs
    assert torch.equal(mb.forward(batch, weights="v0").logprobs, before)
    assert mb.fingerprint() == fp and torch.equal(mb.forward(batch).logprobs, after)
    mb.forget_weights("v0")
    with pytest.raises(KeyError, match="v0"):
        mb.forward(batch, weights="v0")


def test_export_hf_and_warmup_phase(megatron, tmp_path):
    """A warm-up phase (fixed lr, then reset_optimizer) leaves trained weights and a fresh optimizer:
    the next update is bit for bit that of a backend built on the warmed-up weights."""
    from axrl.model import load_hf

    mb = megatron(seed=8)
    mb.forward_backward(make_batch(), pg_loss)
    stats = mb.optimizer_step(lr=0.1)
    assert stats.lr == 0.1 and mb.scheduler_step == 1
    mb.reset_optimizer()
    assert mb.scheduler_step == 0 and mb.state_dict()["optimizer"] == {}
    model = load_hf(mb.export_hf(tmp_path / "hf"))
    assert weights_diff(TorchBackend(model, TorchBackendConfig(num_threads=1)), mb) == 0.0
    fresh = megatron(seed=0)
    fresh.load_state_dict({**mb.state_dict(), "optimizer": {}})
    for b in (fresh, mb):  # the next RL update starts from an empty AdamW on both
        b.forward_backward(make_batch(), pg_loss)
        b.optimizer_step()
    assert weights_diff(fresh, mb) == 0.0


# ---------------------------------------------------------------- errors and packaging

def test_config_validation():
    from axrl.config import ConfigError, load_config
    from axrl.train.megatron import check_parallel_fit

    with pytest.raises(ConfigError, match=r"expert_parallel=4 must divide tensor_parallel × data_parallel = 2 × 1"):
        load_config(None, ["train.megatron.tensor_parallel=2", "train.megatron.expert_parallel=4",
                           "train.megatron.data_parallel=1"])
    with pytest.raises(ValueError, match=r"data_parallel to a multiple of 2"):
        MegatronBackendConfig(tensor_parallel=2, expert_parallel=4, data_parallel=3)
    # data_parallel 0 derives Megatron's smallest layout: world = TP × DP with EP dividing it
    for (tp, ep), dp in {(1, 1): 1, (2, 1): 1, (2, 2): 1, (1, 2): 2, (2, 4): 2, (1, 4): 4}.items():
        c = MegatronBackendConfig(tensor_parallel=tp, expert_parallel=ep)
        assert (c.data_parallel_size, c.world_size) == (dp, tp * dp)
        load_config(None, [f"train.megatron.tensor_parallel={tp}", f"train.megatron.expert_parallel={ep}"])
    assert MegatronBackendConfig(data_parallel=2).world_size == 2  # plain data parallel
    with pytest.raises(ConfigError, match="sequence_parallel"):
        load_config(None, ["train.megatron.tensor_parallel=2", "train.megatron.sequence_parallel=false"])
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_parallel_fit(preset_config("micro-moe"), MegatronBackendConfig(tensor_parallel=4))
    with pytest.raises(ValueError, match="num_experts"):
        check_parallel_fit(preset_config("micro-moe", num_attention_heads=8, num_key_value_heads=8),
                           MegatronBackendConfig(tensor_parallel=8, expert_parallel=8))


def test_data_parallel_shares_are_contiguous_and_balanced():
    from axrl.train.megatron.shares import share_bounds

    for n in range(7):
        for dp in (1, 2, 3, 4):
            shares = [share_bounds(n, dp, r) for r in range(dp)]
            assert [i for s in shares for i in s] == list(range(n))  # concatenated in rank order = sample order
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_untested_megatron_version_is_refused(monkeypatch):
    from axrl.train.megatron import cpu_compat

    monkeypatch.setattr(cpu_compat, "_applied", False)
    monkeypatch.setattr(cpu_compat, "megatron_version", lambda: "0.99.0")
    with pytest.raises(RuntimeError, match=r"tested with 0\.16\.1, but 0\.99\.0 is installed"):
        cpu_compat.apply()


def test_import_is_lazy_and_missing_package_error_is_clear():
    code = (
        "import sys, axrl, axrl.assembly.build, axrl.train.megatron\n"
        "assert not any(m.startswith('megatron') for m in sys.modules), 'megatron imported eagerly'\n"
        "sys.modules['megatron'] = None\n"  # as if megatron-core were not installed
        "from axrl.config import load_config\n"
        "from axrl.assembly.build import make_train_backend\n"
        "from axrl.tokenizer import Tokenizer\n"
        "try:\n"
        "    make_train_backend(load_config(None, ['train.backend=megatron']), Tokenizer.default())\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "train.backend=megatron needs megatron-core: pip install 'axrl[megatron]'" in out.stdout


# ---------------------------------------------------------------- tensor / expert parallel workers

@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,dispatcher", [(2, 1, "allgather"), (2, 2, "alltoall"), (1, 2, "allgather")],
                         ids=["tp2", "tp2-ep2", "ep2-dp2"])
def test_tensor_and_expert_parallel_match_world_size_1(megatron, tp, ep, dispatcher):
    """ep2-dp2: TP 1 with EP 2 derives data parallel 2 — each rank runs half of every micro-batch,
    dense grads are summed over DP, experts get their tokens through the EP dispatch. The last
    micro-batch ([8]) has one sample, so one DP rank runs only padding."""
    batch = make_batch(lengths=[5, 9, 3, 12, 8])  # odd lengths: sequence parallel pads to even
    ref = megatron(seed=9, micro_batch_tokens=24)
    par = megatron(seed=9, micro_batch_tokens=24, tensor_parallel=tp, expert_parallel=ep, moe_dispatcher=dispatcher)
    assert par.config.world_size == 2 and par.fingerprint() == ref.fingerprint()
    a, b = ref.forward(batch), par.forward(batch)
    assert max_diff(a.logprobs, b.logprobs) < TOL and max_diff(a.entropy, b.entropy) < TOL
    assert torch.equal(a.routed_experts, b.routed_experts)
    for _ in range(2):
        m1, m2 = ref.forward_backward(batch, pg_loss), par.forward_backward(batch, pg_loss)
        s1, s2 = ref.optimizer_step(), par.optimizer_step()
        assert len(m1.micro_batches) == len(m2.micro_batches) == 3
        assert abs(m1.loss - m2.loss) < TOL and abs(s1.grad_norm - s2.grad_norm) < TOL * max(1.0, s1.grad_norm)
        assert abs(m1.metrics["num_loss_tokens"] - m2.metrics["num_loss_tokens"]) == 0
        # per-HF-tensor norms add up over TP shards / EP ranks and count replicas once
        assert list(s2.param_grad_norm) == list(s1.param_grad_norm)
        assert all(abs(s2.param_grad_norm[n] - v) < TOL * max(1.0, v) for n, v in s1.param_grad_norm.items())
    # Adam divides by sqrt of tiny second moments, which amplifies last-bit gradient differences
    assert weights_diff(ref, par) < 1e-4
    # R3 across sequence-parallel / data-parallel shards: an arbitrary routing (not what the
    # routers would choose) is followed on every rank, as at world size 1
    g = torch.Generator().manual_seed(0)
    forced = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(batch.num_tokens * 2)]).view(-1, 2, 2)
    replay = dataclasses.replace(batch, routed_experts=forced)
    r_ref, r_par = ref.forward(replay, r3=True), par.forward(replay, r3=True)
    assert torch.equal(r_par.routed_experts, forced)
    assert max_diff(r_ref.logprobs, r_par.logprobs) < TOL and max_diff(r_par.logprobs, b.logprobs) > 1e-3
    from axrl.train.protocol import R3Scope
    scope = R3Scope(loss_tokens_only=True)  # partial replay across the sequence-parallel shards
    p_ref, p_par = ref.forward(replay, r3=scope), par.forward(replay, r3=scope)
    assert torch.equal(p_ref.routed_experts, p_par.routed_experts) and max_diff(p_ref.logprobs, p_par.logprobs) < TOL
    m1, m2 = ref.forward_backward(replay, pg_loss, r3=True), par.forward_backward(replay, pg_loss, r3=True)
    s1, s2 = ref.optimizer_step(), par.optimizer_step()
    assert abs(m1.loss - m2.loss) < TOL and abs(s1.grad_norm - s2.grad_norm) < TOL * max(1.0, s1.grad_norm)
    # optimizer moments gathered from the ranks move to world size 1 and continue identically
    ref.load_state_dict(par.state_dict())
    assert ref.fingerprint() == par.fingerprint()
    ref.forward_backward(batch, pg_loss), par.forward_backward(batch, pg_loss)
    ref.optimizer_step(), par.optimizer_step()
    assert weights_diff(ref, par) < 1e-4
    # a wrong call fails in the driver, before it is sent: the workers keep serving
    from axrl.train.megatron.rank import MegatronRank
    with pytest.raises(TypeError, match="MegatronRank.swap_weights: missing a required argument: 'key'"):
        par._group.call(MegatronRank.swap_weights)
    assert par._group.call(MegatronRank.data_parallel_rank) == par._dp_of
    # a worker-side failure surfaces in the driver and stops the workers
    with pytest.raises(RuntimeError, match="failed in swap_weights; workers stopped"):
        par._group.call(MegatronRank.swap_weights, "never kept")
    with pytest.raises(RuntimeError, match="closed"):
        par.forward(batch)


# ---------------------------------------------------------------- end to end

@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["train.megatron.tensor_parallel=2", "train.megatron.expert_parallel=2"],
                                    ["train.megatron.expert_parallel=2"]], ids=["ws1", "tp2-ep2", "ep2-dp2"])
def test_axrl_train_megatron_then_mismatch_and_replay(tmp_path, layout):
    """The default example on Megatron (world size 1; TP2 + EP2 and EP2 with derived DP2: worker
    processes that the backend launches itself): the trace analyses, and replay in a new process
    is bitwise."""
    run = tmp_path / "run"
    env = {"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    train = [sys.executable, "-m", "axrl.cli", "train", "examples/quickstart.yaml", "--run-dir", str(run),
             "--set", "train.backend=megatron", "--set", "steps=2", "--set", "warmup.steps=20",
             "--set", "eval.every=0", "--set", "data.prompts_per_step=4", "--set", "rollout.group_size=4",
             # an entropy bonus: gradients even when every group's rewards tie (zero advantages)
             "--set", "algo.entropy_coef=0.01"] + [a for kv in layout for a in ("--set", kv)]
    out = subprocess.run(train, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert (run / "trace" / "step_000001.h5").is_file()
    debug = [sys.executable, "-m", "axrl_debug.cli"]
    mm = subprocess.run(debug + ["mismatch", str(run)], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert mm.returncode == 0, mm.stderr[-2000:]
    assert "mean |Δ|" in mm.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step = max(rows, key=lambda r: r["grad_norm"])["step"]  # a step that changed the weights
    assert rows[step]["grad_norm"] > 0
    rp = subprocess.run(debug + ["replay", str(run), "--step", str(step)], cwd=REPO, capture_output=True, text=True,
                        timeout=200, env=env)
    assert rp.returncode == 0, rp.stdout[-2000:] + rp.stderr[-2000:]
    assert "bitwise-equal" in rp.stdout


# ---------------------------------------------------------------- objective columns, per-tensor grad norms, partial R3

def test_per_tensor_grad_norms_and_token_columns_match_embedded_backend(megatron):
    """Megatron's fused / sharded tensors are reported per HF tensor (linear_qkv → q/k/v_proj,
    linear_fc1 → gate/up_proj), as the embedded backend reports them; the loss's per-token
    columns come back in batch order."""
    from axrl.algo import PolicyLossConfig, make_policy_loss

    batch = make_batch()
    tb, mb = torch_backend(seed=6, micro_batch_tokens=16), megatron(seed=6, micro_batch_tokens=16)
    batch = dataclasses.replace(batch, old_logprobs=tb.forward(batch).logprobs - 0.2,
                                rollout_logprobs=torch.where(batch.loss_mask > 0, tb.forward(batch).logprobs + 0.1,
                                                             torch.nan))
    loss = make_policy_loss(PolicyLossConfig(loss="grpo2", correction={"icepop": {"low": 0.95, "high": 1.05}}, tis=False))
    m1, m2 = tb.forward_backward(batch, loss), mb.forward_backward(batch, loss)
    assert torch.equal(m1.tokens["loss_rule"], m2.tokens["loss_rule"])
    assert max_diff(m1.tokens["is_weight"], m2.tokens["is_weight"]) == 0
    s1, s2 = tb.optimizer_step(), mb.optimizer_step()
    assert list(s2.param_grad_norm) == list(s1.param_grad_norm)
    for name, v in s1.param_grad_norm.items():
        assert abs(s2.param_grad_norm[name] - v) < TOL * max(1.0, v), name
    assert math.sqrt(sum(v * v for v in s2.param_grad_norm.values())) == pytest.approx(s2.grad_norm, rel=1e-5)


def test_partial_r3_matches_embedded_backend(megatron):
    from axrl.train.protocol import R3Scope
    from tests.test_train_backend import random_routing

    batch = make_batch(lengths=[20, 25, 18, 30])
    tb, mb = torch_backend(seed=5), megatron(seed=5)
    cfg = tb.model.config
    forced = random_routing(batch.num_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts)
    rb = dataclasses.replace(batch, routed_experts=forced)
    for scope in (R3Scope(layers=(1,)), R3Scope(loss_tokens_only=True)):
        a, b = tb.forward(rb, r3=scope), mb.forward(rb, r3=scope)
        assert torch.equal(a.routed_experts, b.routed_experts), scope
        assert max_diff(a.logprobs, b.logprobs) < TOL, scope
        assert max_diff(a.logprobs, tb.forward(rb, r3=True).logprobs) > 1e-4  # really partial
        m1, m2 = tb.forward_backward(rb, pg_loss, r3=scope), mb.forward_backward(rb, pg_loss, r3=scope)
        s1, s2 = tb.optimizer_step(), mb.optimizer_step()
        assert abs(m1.loss - m2.loss) < TOL and abs(s1.grad_norm - s2.grad_norm) < TOL * max(1.0, s1.grad_norm)


def test_reference_logprobs_in_the_prepare_phase(megatron):
    """algo.kl_coef > 0 on Megatron: the reference kept at RL start gives the prepare phase's
    reference logprobs after the policy moved, as on the embedded backend."""
    from axrl.runtime.reference import keep_reference, with_reference_logprobs

    batch = make_batch()
    tb, mb = torch_backend(seed=2), megatron(seed=2)
    for be in (tb, mb):
        keep_reference(be, True)
        be.forward_backward(batch, pg_loss)
        be.optimizer_step()
    a, b = with_reference_logprobs(tb, batch, True, False), with_reference_logprobs(mb, batch, True, False)
    assert max_diff(a.ref_logprobs, b.ref_logprobs) < TOL
    assert max_diff(b.ref_logprobs, mb.forward(batch).logprobs) > 1e-4        # the policy moved, the reference not
    assert max_diff(b.ref_logprobs, torch_backend(seed=2).forward(batch).logprobs) < TOL


def test_prefix_merge_matches_embedded_backend(megatron):
    """train.prefix_merge on Megatron: the tree through its attention-mask input and RoPE at each
    slot's depth (`rope_positions`) equals the unmerged embedded backend, R3 included."""
    from tests.test_prefix_merge import pack, random_tree_samples

    batch = pack(random_tree_samples(0, vocab=1024), seed=0)
    ref = torch_backend(seed=3)
    mb = megatron(seed=3, prefix_merge=True)
    a, b = ref.forward(batch), mb.forward(batch)
    assert max_diff(a.logprobs, b.logprobs) < TOL and max_diff(a.entropy, b.entropy) < TOL
    assert torch.equal(a.routed_experts, b.routed_experts)
    replay = dataclasses.replace(batch, routed_experts=a.routed_experts)
    assert max_diff(ref.forward(replay, r3=True).logprobs, mb.forward(replay, r3=True).logprobs) < TOL
    for _ in range(2):
        m1, m2 = ref.forward_backward(replay, pg_loss, r3=True), mb.forward_backward(replay, pg_loss, r3=True)
        s1, s2 = ref.optimizer_step(), mb.optimizer_step()
        assert abs(m1.loss - m2.loss) < TOL and abs(s1.grad_norm - s2.grad_norm) < TOL * max(1.0, s1.grad_norm)
    assert weights_diff(ref, mb) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 2)], ids=["tp2_ep2", "dp2_ep2"])
def test_prefix_merge_under_tensor_and_data_parallel(megatron, tp, ep):
    """Merged trees per DP share (padded to the largest share's slots) and sequence-parallel TP."""
    from tests.test_prefix_merge import pack, random_tree_samples

    batch = pack(random_tree_samples(1, vocab=1024), seed=1)
    ref = torch_backend(seed=3)
    mb = megatron(seed=3, prefix_merge=True, tensor_parallel=tp, expert_parallel=ep)
    a, b = ref.forward(batch), mb.forward(batch)
    assert max_diff(a.logprobs, b.logprobs) < TOL and torch.equal(a.routed_experts, b.routed_experts)
    m1, m2 = ref.forward_backward(batch, pg_loss), mb.forward_backward(batch, pg_loss)
    s1, s2 = ref.optimizer_step(), mb.optimizer_step()
    assert abs(m1.loss - m2.loss) < TOL and abs(s1.grad_norm - s2.grad_norm) < TOL * max(1.0, s1.grad_norm)
    assert weights_diff(ref, mb) < 1e-4
