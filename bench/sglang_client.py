"""Cost of serving over HTTP: the SGLang client driving `axrl serve` vs the in-process engine.

Same model (tiny-moe, same random weights: the server loads the directory the in-process engine
is built from), same prompts (B prompts of 16-32 tokens, 64 greedy new tokens each, EOS ignored),
one torch thread per engine. Each lock-step-style round is one `submit_many` (one batched
`/generate` per server). Best of N interleaved timings after a warm-up. Also times one weight
sync of the whole model by disk and by gloo process group (2 servers), and checks that the
served tokens equal the in-process ones.

    python bench/sglang_client.py [--batches 16 64] [--new-tokens 64] [--repeats 3]

Ends with one line of JSON: tokens/s in-process and over HTTP (1 and 2 servers), their ratios,
and the sync times.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

# Same interleaved best-of-N timing as the engine benchmark (this directory is on sys.path when
# the script runs).
from engine_throughput import best_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams
    from axrl.inference.sglang import SGLangEngine, SGLangLauncher
    from axrl.inference.sglang.launcher import free_port
    from axrl.model import build_model, hf_state_dict, load_hf, preset_config, save_hf
    from axrl.tokenizer import Tokenizer

    tok = Tokenizer.default()
    cfg = preset_config("tiny-moe", vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id)
    tmp = Path(tempfile.mkdtemp(prefix="axrl-bench-sglang-"))
    model_dir = save_hf(build_model(cfg, seed=0), tmp / "model", tokenizer=tok)
    slots = max(args.batches)
    launcher = SGLangLauncher(model_dir, num_servers=2, base_port=free_port(),
                              command=[sys.executable, "-m", "axrl.cli", "serve"], env={"OMP_NUM_THREADS": "1"},
                              server_args=["--max-running-requests", str(slots), "--context-length", "256"])
    launcher.start()
    one = SGLangEngine(launcher.urls[:1], export_dir=tmp / "sync1", model_dir=model_dir)
    two = SGLangEngine(launcher.urls, export_dir=tmp / "sync2", model_dir=model_dir)
    local = EmbeddedEngine(load_hf(model_dir), max_batch_size=slots, max_seq_len=256)
    g = torch.Generator().manual_seed(0)
    results: dict[str, float] = {}
    try:
        for b in args.batches:
            prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
                       for n in torch.randint(16, 33, (b,), generator=g)]
            sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
            # Sticky keys spread the batch over the two servers like the agent loop's episode keys.
            reqs = [GenerateRequest(input_ids=p, sampling_params=sp, return_logprob=True, sticky_key=f"e{i}")
                    for i, p in enumerate(prompts)]

            def run(engine):
                return lambda: engine.generate_batch(copy.deepcopy(reqs))

            t_local, t_one, t_two = best_times([run(local), run(one), run(two)], args.repeats)
            tokens = b * args.new_tokens
            same = [a.output_ids for a in run(local)()] == [a.output_ids for a in run(one)()]
            results.update({f"inprocess_tokens_per_s_b{b}": round(tokens / t_local, 1),
                            f"http_1server_tokens_per_s_b{b}": round(tokens / t_one, 1),
                            f"http_2servers_tokens_per_s_b{b}": round(tokens / t_two, 1),
                            f"http_1server_vs_inprocess_ratio_b{b}": round(t_local / t_one, 3),
                            f"http_2servers_vs_inprocess_ratio_b{b}": round(t_local / t_two, 3),
                            f"greedy_tokens_identical_b{b}": float(same)})
            print(f"batch {b:3d}: in-process {tokens / t_local:8.0f} tok/s | HTTP 1 server {tokens / t_one:8.0f} "
                  f"| HTTP 2 servers {tokens / t_two:8.0f} | tokens identical: {same}")
        weights = hf_state_dict(load_hf(model_dir))
        t0 = time.perf_counter()
        two.update_weights(weights)
        results["disk_sync_s_2servers"] = round(time.perf_counter() - t0, 3)
        dist = SGLangEngine(launcher.urls, weight_sync="distributed", model_dir=model_dir)
        try:
            t0 = time.perf_counter()
            dist.update_weights(weights)
            results["distributed_first_sync_s_2servers"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            dist.update_weights(weights)
            results["distributed_sync_s_2servers"] = round(time.perf_counter() - t0, 3)
        finally:
            dist.shutdown()
        print(f"weight sync of {sum(t.numel() for t in weights.values()) / 1e6:.2f}M params to 2 servers: disk "
              f"{results['disk_sync_s_2servers']} s, process group {results['distributed_sync_s_2servers']} s "
              f"(first, with group formation: {results['distributed_first_sync_s_2servers']} s)")
    finally:
        for e in (one, two):
            e.shutdown()
        local.shutdown()
        launcher.stop()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
