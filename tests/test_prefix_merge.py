"""Prefix-tree merged training (`train.prefix_merge`): the tree's layout, labels and loss mask at
forks, and merged vs unmerged equality of logprobs, entropy, loss, every gradient and R3 routing;
at the quickstart's model size on long shared prefixes, also against the embedded engine."""

from __future__ import annotations

import random

import pytest
import torch

from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams
from axrl.model import build_model, preset_config
from axrl.train import LossContext, PackedBatch, TorchBackend, TorchBackendConfig
from axrl.train.micro_batch import micro_batches, shared_with_previous, split_micro_batches
from axrl.train.prefix_tree import build_prefix_tree
from axrl.train.protocol import R3Scope
from tests.backend_util import make_backend

torch.set_num_threads(1)
TOL = 2e-6


def pack(samples: list[list[int]], loss: list[list[int]] | None = None, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = [len(s) for s in samples]
    T = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    if loss is None:
        loss_mask = (torch.rand(T, generator=g) < 0.7).float()
        loss_mask[offsets[:-1]] = 0.0
    else:
        loss_mask = torch.tensor([x for l in loss for x in l], dtype=torch.float32)
    return PackedBatch(input_ids=torch.tensor([t for s in samples for t in s]), offsets=offsets, loss_mask=loss_mask,
                       advantages=torch.randn(T, generator=g))


def random_tree_samples(seed: int, vocab: int = 50) -> list[list[int]]:
    """Groups sharing prompts, forks at random depths, deep chains (per-turn prefixes), a
    single-sample group, duplicates and mixed lengths."""
    rnd = random.Random(seed)
    tok = lambda n: [rnd.randrange(vocab) for _ in range(n)]  # noqa: E731
    out: list[list[int]] = []
    prompt = tok(rnd.randint(5, 12))
    for _ in range(rnd.randint(2, 4)):                     # a GRPO group: shared prompt, own answers
        out.append(prompt + tok(rnd.randint(1, 8)))
    chain = tok(4)
    for _ in range(3):                                     # per-turn samples: each a prefix of the next
        chain = chain + tok(rnd.randint(2, 6))
        out.append(list(chain))
    base = out[0]
    cut = rnd.randint(1, len(base) - 1)
    out.append(base[:cut] + tok(rnd.randint(1, 5)))        # a fork off an existing sample
    out.append(list(out[1]))                               # an exact duplicate
    out.append(tok(rnd.randint(1, 3)))                     # a single-sample group (maybe 1 token)
    rnd.shuffle(out)
    return out


def test_layout_labels_and_mask_at_a_fork():
    # A = a b c d, B = a b c e, C = a b (a prefix), D = a b c d (duplicate of A)
    samples = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2], [1, 2, 3, 4]]
    loss = [[0, 0, 1, 1], [0, 0, 1, 1], [0, 1], [0, 0, 1, 1]]
    tree = build_prefix_tree(pack(samples, loss))
    # Slots: a, b, then the fork token c duplicated (labels d and e), then d, e.
    assert tree.input_ids.tolist() == [1, 2, 3, 4, 3, 5]
    assert tree.position_ids.tolist() == [0, 1, 2, 3, 2, 3]
    assert tree.labels.tolist() == [2, 3, 4, -1, 5, -1]
    # Every packed token's predicting slot has exactly that token as its label.
    ids = pack(samples, loss).input_ids
    has_pred = tree.pred_slot >= 0
    assert torch.equal(tree.labels[tree.pred_slot[has_pred]], ids[has_pred])
    # C's last token b joins the shared slot; D shares every slot of A.
    assert tree.token_slot.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 0, 1, 0, 1, 2, 3]
    # Each trained slot has exactly one training path: the first sample (batch order) whose loss
    # mask covers its label; b -> c is trained by A (C trains a -> b), the duplicated c's by A and B.
    assert tree.label_owner.tolist() == [2, 0, 0, -1, 1, -1]
    assert tree.loss_mask.tolist() == [True, True, True, False, True, False]
    m = tree.attention_mask()
    expect = torch.tensor([[1, 0, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0, 0],
                           [1, 1, 1, 0, 0, 0],
                           [1, 1, 1, 1, 0, 0],
                           [1, 1, 0, 0, 1, 0],   # the second c sees a, b and itself, not the first c
                           [1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expect)


def test_per_turn_chain_costs_only_the_longest_sample():
    chain = list(range(1, 41))
    samples = [chain[:10], chain[:25], chain]
    tree = build_prefix_tree(pack(samples))
    assert tree.num_slots == 40
    assert tree.position_ids.tolist() == list(range(40))


def merge_backend(merge: bool, preset: str = "micro-moe", **cfg) -> TorchBackend:
    """`make_backend` on `preset` with a 64-token vocabulary (model seed 3), prefix merging `merge`."""
    return make_backend(preset_config(preset, vocab_size=64), 3, prefix_merge=merge, **cfg)


def pg_loss(logprobs, entropy, mb: PackedBatch, ctx: LossContext):
    loss = -(mb.advantages * logprobs * mb.loss_mask).sum() / ctx.num_loss_tokens
    loss = loss - 0.01 * (entropy * mb.loss_mask).sum() / ctx.num_loss_tokens  # entropy gets a gradient too
    return loss, {}


def grads(be: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in be.model.named_parameters()}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("preset", ["micro-moe", "tiny-dense"])
def test_merged_equals_unmerged(seed, preset):
    batch = pack(random_tree_samples(seed), seed=seed)
    flat, merged = merge_backend(False, preset), merge_backend(True, preset)
    a, b = flat.forward(batch), merged.forward(batch)
    assert (a.logprobs - b.logprobs).abs().max() < TOL
    assert (a.entropy - b.entropy).abs().max() < TOL
    assert torch.equal(a.logprobs[batch.offsets[:-1]], torch.zeros(batch.num_samples))
    if a.routed_experts is not None:  # free routing: same experts chosen (no near-ties at this size)
        assert torch.equal(a.routed_experts, b.routed_experts)
    ma, mb = flat.forward_backward(batch, pg_loss), merged.forward_backward(batch, pg_loss)
    la, lb = ma.loss, mb.loss
    assert abs(la - lb) < TOL
    # /train/micro_batches/num_computed: padded positions unmerged, tree slots merged
    assert ma.metrics["num_computed"] == batch.num_samples * int(batch.lengths.max())
    assert mb.metrics["num_computed"] == build_prefix_tree(batch).num_slots < batch.num_tokens
    ga, gb = grads(flat), grads(merged)
    for name in ga:
        assert (ga[name] - gb[name]).abs().max() < 1e-5 * max(1.0, float(ga[name].abs().max())), name


def engine_rollouts(engine: EmbeddedEngine, vocab: int) -> tuple[PackedBatch, torch.Tensor]:
    """A batch of long shared prefixes sampled by `engine`, and the engine's logprob of each token
    (0 where the environment wrote it): two GRPO groups of 4 three-turn episodes on a 320-token
    prompt, and one 32-turn episode on a 300-token prompt as per-turn samples (sample k is the
    stream up to the end of turn k, trained on turn k) — 616 tokens by its last turn."""
    rnd = random.Random(0)
    env = lambda n: [rnd.randrange(vocab) for _ in range(n)]  # noqa: E731
    samples: list[list[int]] = []
    loss: list[list[int]] = []
    rollout: list[list[float]] = []

    def sample(streams: list[list[int]], seed: int, n: int) -> list[tuple[list[int], list[float]]]:
        reqs = [GenerateRequest(list(s), SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True,
                                                        seed=seed + j), return_logprob=True)
                for j, s in enumerate(streams)]
        return [(r.output_ids, r.output_logprobs) for r in engine.generate_batch(reqs)]

    for g in range(2):
        prompt = env(320)
        streams = [list(prompt) for _ in range(4)]
        masks, lps = [[0] * 320 for _ in range(4)], [[0.0] * 320 for _ in range(4)]
        for turn in range(3):
            for j, (ids, lp) in enumerate(sample(streams, 100 * g + 10 * turn, 8)):
                obs = env(6) if turn < 2 else []
                streams[j] += ids + obs
                masks[j] += [1] * len(ids) + [0] * len(obs)
                lps[j] += lp + [0.0] * len(obs)
        samples += streams
        loss += masks
        rollout += lps
    stream, lps = env(300), [0.0] * 300
    for turn in range(32):
        if turn:
            stream, lps = stream + env(4), lps + [0.0] * 4
        ((ids, lp),) = sample([stream], 1000 + turn, 6)
        loss.append([0] * len(stream) + [1] * len(ids))
        stream, lps = stream + ids, lps + lp
        samples.append(list(stream))
        rollout.append(list(lps))
    return pack(samples, loss), torch.tensor([x for lp in rollout for x in lp])


def test_quickstart_size_long_prefixes_match_unmerged_and_the_engine():
    """The quickstart's model (tiny-moe) on prompts of 300+ tokens and a 32-turn episode: merged
    logprobs within 1e-5 of unmerged on every loss token, and no further from the rollout's
    (embedded engine) logprobs than unmerged — what the mismatch corrections (TIS) rely on.

    Initialised at 0.1 instead of the preset's 0.02 so that logits are far from uniform: at 0.02
    every logprob is about -log(1024) and float rounding hardly shows. Compare on the *same*
    weights: two runs, one merged, are not (docs/prefix-merge.md, *Merged and unmerged runs*)."""
    cfg = preset_config("tiny-moe", initializer_range=0.1)
    model = build_model(cfg, seed=0)
    with EmbeddedEngine(model, max_batch_size=8, max_seq_len=1024) as engine:
        batch, engine_lp = engine_rollouts(engine, cfg.vocab_size)
    assert int(batch.lengths.max()) > 600 and build_prefix_tree(batch).num_slots < batch.num_tokens / 10
    out = {m: TorchBackend(model, TorchBackendConfig(num_threads=1, prefix_merge=m)).forward(batch)
           for m in (False, True)}
    on_loss = batch.loss_mask > 0
    gap = lambda a, b: (a - b)[on_loss].abs()  # noqa: E731
    between = gap(out[True].logprobs, out[False].logprobs)
    merged, flat = gap(out[True].logprobs, engine_lp), gap(out[False].logprobs, engine_lp)
    print(f"\nmax |merged - unmerged| {between.max():.1e}; vs engine: unmerged max {flat.max():.1e} "
          f"mean {flat.mean():.1e}, merged max {merged.max():.1e} mean {merged.mean():.1e}")
    assert between.max() < 1e-5
    assert torch.equal(out[True].routed_experts, out[False].routed_experts)
    # Rounding-level noise either way (~1e-6 here), so "no further" with a margin for it.
    assert merged.mean() <= 1.25 * flat.mean()
    assert merged.max() <= 2 * flat.max()


def test_merged_budget_counts_tree_slots():
    # Three samples sharing 8 tokens: 10 + 3 + 3 slots at most (the fork token is duplicated).
    assert split_micro_batches([10, 10, 10], micro_batch_tokens=16, shared=[0, 8, 8]) == [range(0, 3)]
    assert split_micro_batches([10, 10, 10], micro_batch_tokens=15, shared=[0, 8, 8]) == [range(0, 2), range(2, 3)]
    batch = pack([[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8], [7, 8, 9]])
    assert shared_with_previous(batch) == [0, 3, 0, 2]
    for mb in micro_batches(batch, micro_batch_tokens=8, merged=True):
        assert build_prefix_tree(mb).num_slots <= 8
    assert len(micro_batches(batch, micro_batch_tokens=8, merged=True)) < len(micro_batches(batch, 8))


def test_r3_at_shared_slots_replays_the_training_path():
    # Two samples share [1..7]; their recorded routing there differs (as two separately prefilled
    # requests' could). Sample 1 trains token 7, so the shared slot predicting it (token 6) replays
    # sample 1's routing; the other shared slots, trained by nobody, the first sample's.
    be = merge_backend(True)
    cfg = be.model_config
    samples = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 9]]
    loss = [[0] * 8, [0] * 6 + [1, 1]]
    batch = pack(samples, loss)
    g = torch.Generator().manual_seed(5)
    T, L, k, E = batch.num_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts
    routing = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T * L)]).view(T, L, k)
    batch.routed_experts = routing
    tree = build_prefix_tree(batch)
    shared = tree.token_slot[:6]
    assert torch.equal(shared, tree.token_slot[8:14])               # tokens 1..6 share their slots
    assert tree.label_owner[shared].tolist() == [-1] * 5 + [1]      # only 6 -> 7 is trained, by sample 1
    assert tree.routing_source[shared].tolist() == [0, 1, 2, 3, 4, 8 + 5]
    out = be.forward(batch, r3=True)
    # The forward used, at every token, the routing recorded at its slot's source row.
    assert torch.equal(out.routed_experts, routing[tree.routing_source[tree.token_slot]])
    assert torch.equal(out.routed_experts[8 + 5], routing[8 + 5])    # the training path's own row
    assert torch.equal(out.routed_experts[5], routing[8 + 5])        # ... also seen by sample 0
    # Equal to an unmerged R3 forward over the routing the tree replays.
    flat = merge_backend(False)
    replayed = PackedBatch(**{**batch.__dict__, "routed_experts": out.routed_experts})
    ref = flat.forward(replayed, r3=True)
    assert (out.logprobs - ref.logprobs).abs().max() < TOL
    # With equal recorded routing on the shared prefix (one prefill, e.g. the engine's prefix
    # cache), merged R3 equals unmerged R3 for every sample, fully and for loss tokens only.
    routing2 = routing.clone()
    routing2[:7] = routing[8:15]
    batch.routed_experts = routing2
    for r3 in (True, R3Scope(loss_tokens_only=True)):
        a, b = flat.forward(batch, r3=r3), be.forward(batch, r3=r3)
        assert (a.logprobs - b.logprobs).abs().max() < TOL
        assert torch.equal(a.routed_experts, b.routed_experts)
    flat.forward_backward(batch, pg_loss, r3=True)
    be.forward_backward(batch, pg_loss, r3=True)
    ga, gb = grads(flat), grads(be)
    for name in ga:
        assert (ga[name] - gb[name]).abs().max() < 1e-5 * max(1.0, float(ga[name].abs().max())), name


def test_merged_training_is_bitwise_repeatable():
    batch = pack(random_tree_samples(4), seed=4)
    fps = []
    for _ in range(2):
        be = merge_backend(True)
        be.forward_backward(batch, pg_loss)
        stats = be.optimizer_step()
        fps.append((be.fingerprint(), stats.grad_norm))
    assert fps[0] == fps[1]


def test_a_merged_step_replays_bitwise(tmp_path):
    """A run trained with train.prefix_merge (GRPO groups share their prompts) replays bit for bit."""
    import json

    import yaml

    from train_util import debug, train

    run = tmp_path / "run"
    settings = ["steps=2", "model.preset=micro-moe", "warmup.steps=10", "data.task=echo", "data.task_args={}",
                "data.prompts_per_step=2", "rollout.group_size=4", "checkpoint.every=1", "eval.every=0",
                "runtime.threads=1", "train.prefix_merge=true", "train.micro_batch_tokens=400"]
    train(run, settings)
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["prefix_merge"] is True
    out = debug("replay", run, "--step", 1, "--json")
    doc = json.loads(out.stdout)
    assert out.exit_code == 0 and doc["verdict"] == "bitwise-equal", doc.get("first_divergence")
