"""Decode throughput: the embedded engine vs Hugging Face `generate()`, side by side.

Same model (tiny-moe preset, same random weights, exported with `save_hf` and loaded by
transformers), same prompts (16 and 64 prompts of 16-32 tokens), 64 new greedy tokens each
(EOS ignored on both sides so every request produces exactly 64), one torch thread, a warm-up
run each, best of 3 timings
(interleaved with each other). Prints a table and, last, one line of JSON with the ratios.

    python bench/engine_throughput.py [--batches 16 64] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Callable

import torch


def best_times(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Best wall time of each function after one warm-up call each. The runs are interleaved
    (a, b, a, b, ...) so that load from other processes on a shared machine hits both alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from axrl.inference import EmbeddedEngine, GenerateRequest, SamplingParams
    from axrl.model import build_model, preset_config, save_hf

    cfg = preset_config(args.preset)
    model = build_model(cfg, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp).eval()

    gen = torch.Generator().manual_seed(1234)
    n_new = args.new_tokens
    rows, figures = [], {}
    # No prefix cache: the timed repeats resubmit the same prompts, and HF generate() has none.
    engine = EmbeddedEngine(model, max_batch_size=max(args.batches), max_seq_len=32 + n_new + 8, prefix_cache=False)
    try:
        for batch in args.batches:
            lens = torch.randint(16, 33, (batch,), generator=gen).tolist()
            prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]

            # HF: left-padded batch, as generate() expects for decoder-only models.
            width = max(lens)
            pad = 0
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

            def run_hf() -> torch.Tensor:
                with torch.inference_mode():
                    return hf.generate(ids, attention_mask=attn, max_new_tokens=n_new, min_new_tokens=n_new,
                                       do_sample=False, pad_token_id=pad, eos_token_id=None)

            sp = SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)

            def run_engine() -> list:
                return engine.generate_batch([GenerateRequest(input_ids=p, sampling_params=sp) for p in prompts])

            t_hf, t_engine = best_times([run_hf, run_engine], args.repeats)
            hf_out = run_hf()[:, width:].tolist()
            engine_out = [r.output_ids for r in run_engine()]
            assert all(len(o) == n_new for o in engine_out) and all(len(o) == n_new for o in hf_out)
            agree = sum(a == b for x, y in zip(hf_out, engine_out) for a, b in zip(x, y)) / (batch * n_new)

            tok = batch * n_new
            rows.append((batch, tok / t_hf, tok / t_engine, t_hf / t_engine, agree))
            figures[f"engine_tokens_per_s_b{batch}"] = round(tok / t_engine, 1)
            figures[f"hf_tokens_per_s_b{batch}"] = round(tok / t_hf, 1)
            figures[f"engine_vs_hf_tokens_per_s_ratio_b{batch}"] = round(t_hf / t_engine, 3)
            figures[f"greedy_token_agreement_b{batch}"] = round(agree, 4)
    finally:
        engine.shutdown()

    print(f"{args.preset}, {n_new} new tokens/request, greedy, torch threads={args.threads}, "
          f"best of {args.repeats} (after a warm-up)")
    print(f"{'batch':>5} {'HF tok/s':>10} {'engine tok/s':>13} {'ratio':>7} {'same tokens':>12}")
    for batch, hf_tps, eng_tps, ratio, agree in rows:
        print(f"{batch:>5} {hf_tps:>10.0f} {eng_tps:>13.0f} {ratio:>7.2f} {agree:>12.1%}")
    figures.update(preset=args.preset, new_tokens=n_new, threads=args.threads,
                   torch=torch.__version__, transformers=transformers.__version__)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
