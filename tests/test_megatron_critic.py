"""PPO's critic on the Megatron backend (`algo.advantage: gae`, `train.backend: megatron`): the
value model's values and updates against the torch critic's on the same weights and batch (world
size 1, and TP=2 / TP=2+EP=2 worker processes), checkpoints that move between the backends, a
real `axrl train` run on Megatron whose critic learns, replays bit for bit and resumes bit for bit,
and the same run under `runtime.executor: ray` (the ranks as Ray actors) writing the local trace
bit for bit. Runs real megatron-core on CPU (gloo)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

from axrl.model import build_model, hf_state_dict, preset_config
from axrl.train.critic import Critic, CriticConfig, critic_batch, initial_value_head
from tests.backend_util import make_batch

import megatron.core as _megatron_core  # noqa: E402,F401  (the test extra installs it: a broken import fails)

from axrl.train.megatron import MegatronBackend, MegatronBackendConfig  # noqa: E402

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5


def critic_config(**kw) -> CriticConfig:
    return CriticConfig(**{"lr": 1e-2, "num_threads": 1, "micro_batch_tokens": 24, "value_clip": 0.2, **kw})


@pytest.fixture
def megatron():
    made: list[MegatronBackend] = []

    def make(model, **cfg) -> MegatronBackend:
        b = MegatronBackend(copy.deepcopy(model), MegatronBackendConfig(**{"lr": 1e-2, "num_threads": 1, **cfg}))
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def random_head(critic: Critic, seed: int) -> dict:
    """The critic's state with a random value head (a zero head gives V = 0 everywhere)."""
    state = critic.state_dict()
    g = torch.Generator().manual_seed(seed)
    for name in ("value_head.weight", "value_head.bias"):
        state["model"][name] = torch.randn(state["model"][name].shape, generator=g) * 0.05
    return state


def targets(batch, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch.num_tokens, generator=g) * 0.3, torch.randn(batch.num_tokens, generator=g) * 0.5


@pytest.mark.parametrize("layout", [{}, pytest.param({"tensor_parallel": 2}, marks=pytest.mark.slow),
                                    pytest.param({"tensor_parallel": 2, "expert_parallel": 2}, marks=pytest.mark.slow),
                                    pytest.param({"expert_parallel": 2}, marks=pytest.mark.slow)],
                         ids=["ws1", "tp2", "tp2-ep2", "ep2-dp2"])
def test_values_and_updates_match_the_torch_critic(megatron, layout):
    """Same weights, same batch: the Megatron value model's V equal the torch critic's within fp32
    tolerance, its clipped value-loss updates (two mini-batches of several micro-batches) move it
    alike, and its checkpoint state is the torch critic's (names, shapes, moments). ep2-dp2: TP 1
    with EP 2 derives DP 2, and a one-sample micro-batch leaves one DP rank running padding only."""
    model = build_model(preset_config("micro-moe"), seed=3)
    batch = make_batch(lengths=[5, 9, 3, 12, 8])  # odd lengths: sequence parallel pads to even
    ref = Critic(copy.deepcopy(model), critic_config())
    state = random_head(ref, seed=0)
    ref.load_state_dict(state)
    backend = megatron(model, **layout)
    mc = backend.attach_critic(critic_config())
    assert mc.from_policy and set(dict(mc.named_weights())) == set(dict(ref.named_weights()))
    mc.load_state_dict(state)
    assert mc.fingerprint() == ref.fingerprint()
    v_ref, v_mc = ref.values(batch), mc.values(batch)
    assert v_ref.abs().max() > 0.1 and float((v_ref - v_mc).abs().max()) < TOL
    assert not v_mc[batch.offsets[:-1]].any()  # V_0 = 0: position 0 is never a trained token
    old, returns = targets(batch)
    cb = critic_batch(batch, v_ref + old, returns)
    clip_fracs = []
    for _ in range(2):
        u_ref, u_mc = ref.train(cb, [[0, 1, 2], [3, 4]]), mc.train(cb, [[0, 1, 2], [3, 4]])
        for a, b in zip(u_ref, u_mc):
            assert abs(a.value_loss - b.value_loss) < TOL and abs(a.grad_norm - b.grad_norm) < 1e-4 * max(1, a.grad_norm)
            assert a.value_clip_frac == b.value_clip_frac and a.lr == b.lr
            clip_fracs.append(a.value_clip_frac)
    assert 0 < max(clip_fracs) < 1  # the clipped branch of the loss was exercised
    w_ref, w_mc = dict(ref.named_weights()), dict(mc.named_weights())
    assert max(float((w_ref[n] - w_mc[n]).abs().max()) for n in w_ref) < 1e-4
    assert float((ref.values(batch) - mc.values(batch)).abs().max()) < 1e-4
    # the Megatron critic's state continues in a torch critic (names, shapes, AdamW moments)
    moved = Critic(copy.deepcopy(model), critic_config())
    moved.load_state_dict(mc.state_dict())
    assert moved.scheduler_step == ref.scheduler_step == 4
    assert max(float((moved.optimizer.state[p]["exp_avg_sq"] - ref.optimizer.state[q]["exp_avg_sq"]).abs().max())
               for p, q in zip(moved.model.parameters(), ref.model.parameters())) < 1e-6
    # the policy is untouched by the critic, and copy_policy keeps the head
    assert backend.fingerprint() == megatron(model).fingerprint()
    head = dict(mc.named_weights())["value_head.weight"].clone()
    mc.copy_policy(hf_state_dict(model))
    body = dict(mc.named_weights())
    assert torch.equal(body["value_head.weight"], head)
    assert torch.equal(body["body.model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_checkpoint_with_critic_round_trips_and_refuses_a_policy_only_checkpoint(megatron, tmp_path):
    model = build_model(preset_config("micro-moe"), seed=4)
    batch = make_batch()
    a = megatron(model)
    ca = a.attach_critic(critic_config())
    cb = critic_batch(batch, *targets(batch))
    ca.train(cb, [[0, 1, 2, 3, 4]])
    a.save(tmp_path / "ck")
    assert (tmp_path / "ck" / "critic" / "optimizer.safetensors").is_file()
    losses_a = [u.value_loss for u in ca.train(cb, [[0, 1], [2, 3, 4]])]
    b = megatron(build_model(preset_config("micro-moe"), seed=5))
    cb2 = b.attach_critic(critic_config())
    b.load(tmp_path / "ck")
    losses_b = [u.value_loss for u in cb2.train(cb, [[0, 1], [2, 3, 4]])]
    assert losses_a == losses_b and ca.fingerprint() == cb2.fingerprint() and cb2.scheduler_step == 3
    shutil.rmtree(tmp_path / "ck" / "critic")
    before = b.fingerprint()
    with pytest.raises(FileNotFoundError, match="no critic state"):
        b.load(tmp_path / "ck")
    assert b.fingerprint() == before


# ---------------------------------------------------------------- end to end

RUN = ["train.backend=megatron", "steps=3", "model.preset=micro-moe", "warmup.steps=100", "data.task=echo",
       "data.task_args={}", "data.prompts_per_step=2", "rollout.group_size=4", "eval.every=0", "checkpoint.every=2",
       "runtime.threads=1", "train.micro_batch_tokens=120", "algo.advantage=gae", "algo.lam=0.9", "algo.gamma=0.9",
       "algo.credit=turn", "critic={lr: 1.0e-3, updates_per_step: 2, warmup_steps: 1, value_clip: 0.2}"]


ENV = {"OMP_NUM_THREADS": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}


def _train(run: Path, extra: list[str], *flags: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "axrl.cli", "train", "examples/quickstart_ppo.yaml", "--run-dir", str(run), *flags]
    for s in RUN + extra:
        args += ["--set", s]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["train.megatron.tensor_parallel=2"]], ids=["ws1", "tp2"])
def test_axrl_train_megatron_critic_learns_replays_and_resumes(tmp_path, layout):
    run = tmp_path / "run"
    out = _train(run, layout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # each step's value loss is on that step's new batch, and the head starts random (N(0, 0.02²)):
    # a later step below the first is the learning a 3-step run can show
    assert min(r["value_loss"] for r in rows[1:]) < rows[0]["value_loss"]
    with h5py.File(run / "trace" / "step_000001.h5") as f:
        assert f.attrs["critic_fingerprint_before"] != f.attrs["critic_fingerprint_after"]
        assert f["tokens/value"][:][f["tokens/loss_mask"][:] > 0].any()
    assert (run / "checkpoints" / "step_000002" / "critic" / "optimizer.safetensors").is_file()
    rp = subprocess.run([sys.executable, "-m", "axrl_debug.cli", "replay", str(run), "--step", "2", "--json"],
                        cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    doc = json.loads(rp.stdout)
    assert rp.returncode == 0 and doc["verdict"] == "bitwise-equal", doc.get("first_divergence")
    assert doc["steps"][-1]["critic"]["fingerprint_after"]["equal"]
    # resume from checkpoint 2 redoes step 2: the same critic and policy bits
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000003", ignore_errors=True)
    out = _train(resumed, layout, "--resume")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    with h5py.File(run / "trace" / "step_000002.h5") as a, h5py.File(resumed / "trace" / "step_000002.h5") as b:
        for key in ("critic_fingerprint_after", "critic_value_loss"):
            assert a.attrs[key] == b.attrs[key]
        assert a["train/weights_fingerprint_after"][()] == b["train/weights_fingerprint_after"][()]
        assert a["tokens/value"][:].tobytes() == b["tokens/value"][:].tobytes()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_megatron_critic_under_ray_writes_the_local_trace_bit_for_bit(tmp_path):
    """TP 2 × EP 2: the policy's and the value model's ranks are Ray actors (instead of the
    backend's worker processes): values, returns, advantages and the critic's fingerprints as
    the local run's, bit for bit, and the critic's checkpoint files."""
    import ray
    from axrl.assembly.build import train
    from tests.test_ray import SMALL, cfg, differing
    from trace_util import trace_datasets

    meg = ["train.backend=megatron", "train.megatron.tensor_parallel=2", "train.megatron.expert_parallel=2",
           "algo.advantage=gae", "algo.lam=0.9", "critic={lr: 1.0e-3, updates_per_step: 2}",
           # the overlong penalty rewards the untrained policy, so the critic has returns to learn
           "algo.overlong_penalty={max_len: 8, cache_len: 6}"]
    local = train(cfg(*meg), tmp_path / "local")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level="warning", log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        out = train(cfg(*meg, "runtime.executor=ray", *SMALL), tmp_path / "ray")
    finally:
        ray.shutdown()
    a, b = trace_datasets(local), trace_datasets(out)
    assert ("step_000001.h5", "tokens/value") in a and not differing(a, b)
    for step in range(3):
        with h5py.File(local / "trace" / f"step_{step:06d}.h5") as x, h5py.File(out / "trace" / f"step_{step:06d}.h5") as y:
            assert x.attrs["critic_fingerprint_after"] == y.attrs["critic_fingerprint_after"]
            assert x.attrs["critic_fingerprint_before"] != x.attrs["critic_fingerprint_after"]
    assert (out / "checkpoints" / "step_000002" / "critic" / "optimizer.safetensors").is_file()


def test_critic_from_a_model_directory_and_one_of_another_architecture(tmp_path):
    """`critic.model` starts the Megatron critic's decoder from a model directory (not from the
    policy); a model of another architecture is refused, naming the field."""
    from axrl.assembly.build import make_tokenizer, make_train_backend
    from axrl.config import ConfigError, load_config
    from axrl.model import save_hf

    cfg = load_config(REPO / "examples" / "quickstart_ppo.yaml", RUN)
    tok = make_tokenizer(cfg)
    policy = make_train_backend(cfg, tok)
    try:
        assert policy.critic.from_policy
        model = policy.hf_model()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)  # not the policy's weights
        save_hf(model, tmp_path / "hf", tok)
        other = build_model(preset_config("tiny-moe", vocab_size=model.config.vocab_size), seed=0)
        save_hf(other, tmp_path / "other", tok)
    finally:
        policy.close()
    backend = make_train_backend(load_config(REPO / "examples" / "quickstart_ppo.yaml",
                                             RUN + [f"critic.model={tmp_path / 'hf'}"]), tok)
    try:
        assert not backend.critic.from_policy
        body = dict(backend.critic.named_weights())
        assert all(torch.equal(body["body." + n], p) for n, p in hf_state_dict(model).items() if n != "lm_head.weight")
        # the torch critic's initial head (small random weight, zero bias), not a zero one
        head = initial_value_head(model.config.hidden_size, 0)
        assert torch.equal(body["value_head.weight"], head["weight"]) and not body["value_head.bias"].any()
    finally:
        backend.close()
    with pytest.raises(ConfigError, match="critic.model .*other: train.backend megatron builds the critic with the "
                                          "policy's architecture"):
        make_train_backend(load_config(REPO / "examples" / "quickstart_ppo.yaml",
                                       RUN + [f"critic.model={tmp_path / 'other'}"]), tok)
