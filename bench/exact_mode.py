"""What `rollout.exact: true` costs: the exact op set (axrl/model/exact.py) against the normal
engine and trainer, side by side in one run, on the quickstart's shapes.

Same model (tiny-moe, same random weights), same requests (`--prompts` prompts of 30-60 tokens,
`--group` samples each with a shared prompt, so the prefix cache is hit, `--new-tokens` sampled at
the quickstart's temperature 0.7, EOS ignored so both engines generate the same number of tokens),
one torch thread, best of `--repeats` interleaved timings after a warm-up, in this process's CPU
time by default (`--clock cpu`: on a machine shared with other jobs, elapsed time mostly measures
them; the engine's scheduler thread waits without spinning, so CPU time is the work's).

* rollout: generated tokens/s of the normal engine (fused decode, prefix cache) and the exact one
  (the same fused decoder running the exact op set, prefix cache);
* train step: old-logprob forward + forward_backward + optimizer step of the torch backend on the
  exact engine's samples, normal vs exact;
* delta: max |trainer logprob − rollout logprob| over the generated tokens, exact engine vs exact
  trainer (and the routing agreement); the normal pair's is printed for scale.

Prints a table and, last, one JSON line: exact_rollout_tok_s_ratio, exact_train_step_ratio,
exact_max_abs_delta (+ the raw numbers).

    python bench/exact_mode.py [--prompts 8] [--group 8] [--new-tokens 40] [--repeats 3] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from axrl.algo import PolicyLossConfig, make_policy_loss
from axrl.inference import EmbeddedEngine, GenerateRequest, GenerateResult, SamplingParams
from axrl.model import build_model, preset_config
from axrl.model.exact import set_exact
from axrl.train import PackedBatch, TorchBackend, TorchBackendConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import best_times  # noqa: E402  (bench/engine_throughput.py: runs interleaved)

TEMPERATURE = 0.7


def requests(prompts: int, group: int, new_tokens: int, vocab: int) -> list[GenerateRequest]:
    """`prompts` random prompts of 30-60 tokens, `group` seeded samples of each (a GRPO group)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for p in range(prompts):
        ids = torch.randint(3, vocab, (int(torch.randint(30, 61, (1,), generator=g)),), generator=g).tolist()
        for s in range(group):
            sp = SamplingParams(max_new_tokens=new_tokens, temperature=TEMPERATURE, ignore_eos=True, seed=p * 1000 + s)
            out.append(GenerateRequest(input_ids=ids, sampling_params=sp, return_logprob=True,
                                       return_routed_experts=True, rid=f"p{p}s{s}"))
    return out


def packed(reqs: list[GenerateRequest], outs: list[GenerateResult]) -> PackedBatch:
    """The samples as the trainer sees them: loss on the generated tokens, their rollout logprobs."""
    ids, mask, lps, routing, offsets = [], [], [], [], [0]
    for r, o in zip(reqs, outs):
        n, m = len(r.input_ids), len(o.output_ids)
        ids += r.input_ids + o.output_ids
        mask += [0.0] * n + [1.0] * m
        lps += [float("nan")] * n + list(o.output_logprobs)
        # routing rows cover every input token; the last sampled token never went through the model
        routing.append(torch.cat([torch.from_numpy(o.routed_experts).long(), torch.zeros(1, *o.routed_experts.shape[1:],
                                                                                         dtype=torch.long)]))
        offsets.append(offsets[-1] + n + m)
    lp = torch.tensor(lps, dtype=torch.float32)
    return PackedBatch(input_ids=torch.tensor(ids), offsets=torch.tensor(offsets), loss_mask=torch.tensor(mask),
                       advantages=torch.randn(len(ids), generator=torch.Generator().manual_seed(1)),
                       old_logprobs=lp.nan_to_num(0.0), rollout_logprobs=lp, routed_experts=torch.cat(routing),
                       temperature=TEMPERATURE)


def delta(backend: TorchBackend, batch: PackedBatch) -> tuple[float, float]:
    """(max |trainer − rollout| logprob over generated tokens, routing agreement on their inputs)."""
    fwd = backend.forward(batch)
    gen = batch.loss_mask > 0
    d = float((fwd.logprobs[gen] - batch.rollout_logprobs[gen]).abs().max())
    # a generated token's own routing row is the next input's; compare every input row but each sample's last
    last = batch.offsets[1:] - 1
    rows = torch.ones(batch.input_ids.shape[0], dtype=torch.bool)
    rows[last] = False
    agree = float((fwd.routed_experts[rows] == batch.routed_experts[rows]).all(-1).all(-1).float().mean())
    return d, agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: this process's CPU time (what the work costs, whatever else the machine runs); "
                         "wall: elapsed time (only meaningful on an otherwise idle machine)")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    cfg = preset_config(args.preset)
    reqs = requests(args.prompts, args.group, args.new_tokens, cfg.vocab_size)
    batch_size = args.prompts * args.group
    engines = {
        "normal": EmbeddedEngine(build_model(cfg, seed=0).eval(), max_batch_size=batch_size, max_seq_len=256, seed=3),
        "exact": EmbeddedEngine(set_exact(build_model(cfg, seed=0).eval(), True), max_batch_size=batch_size,
                                max_seq_len=256, seed=3),
    }
    try:
        outs = {name: e.generate_batch(reqs, timeout=3600) for name, e in engines.items()}
        tokens = {name: sum(len(o.output_ids) for o in out) for name, out in outs.items()}
        roll = best_times([lambda e=e: e.generate_batch(reqs, timeout=3600) for e in engines.values()], args.repeats,
                          clock)
    finally:
        for e in engines.values():
            e.shutdown()
    tok_s = {name: tokens[name] / t for name, t in zip(engines, roll)}

    loss_fn = make_policy_loss(PolicyLossConfig(tis=True))
    common = dict(lr=1e-5, micro_batch_tokens=4096, num_threads=1)
    backends = {"normal": TorchBackend(build_model(cfg, seed=0), TorchBackendConfig(**common)),
                "exact": TorchBackend(build_model(cfg, seed=0), TorchBackendConfig(**common, exact=True))}
    batches = {name: packed(reqs, outs[name]) for name in backends}
    deltas = {name: delta(backends[name], batches[name]) for name in backends}  # before any update

    def train_step(name: str) -> None:
        b = backends[name]
        b.forward(batches[name])
        b.forward_backward(batches[name], loss_fn)
        b.optimizer_step()

    train = best_times([lambda n=n: train_step(n) for n in backends], args.repeats, clock)
    print(f"{'':8} {'rollout tok/s':>14} {'train step s':>13} {'max |Δ|':>10} {'routing agree':>14}")
    for i, name in enumerate(backends):
        print(f"{name:8} {tok_s[name]:14.1f} {train[i]:13.3f} {deltas[name][0]:10.3g} {deltas[name][1]:14.4f}")
    print(json.dumps({
        "exact_rollout_tok_s_ratio": round(tok_s["exact"] / tok_s["normal"], 4),
        "exact_train_step_ratio": round(train[1] / train[0], 4),
        "exact_max_abs_delta": deltas["exact"][0],
        "exact_routing_agreement": deltas["exact"][1],
        "normal_max_abs_delta": deltas["normal"][0],
        "rollout_tok_s": {k: round(v, 1) for k, v in tok_s.items()},
        "train_step_s": {"normal": round(train[0], 4), "exact": round(train[1], 4)},
        "generated_tokens": tokens["exact"], "samples": len(reqs), "threads": 1, "clock": args.clock,
    }))


if __name__ == "__main__":
    main()
