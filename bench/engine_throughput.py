"""Decode throughput: the embedded engine vs Hugging Face `generate()` — and, when asked, the
server engines (`axrl serve`, SGLang-CPU, vLLM-CPU) — side by side in one run.

Same model (tiny-moe preset, same random weights, exported with `save_hf` and loaded by
transformers and by every server), same prompts (16 and 64 prompts of 16-32 tokens), 64 new
greedy tokens each (EOS ignored everywhere so every request produces exactly 64), one torch
thread per process, a warm-up run each, best of 3 timings (interleaved with each other). A
server engine is timed through its AxRL client (HTTP included), one server, submitted as one
round. Prints a table and, last, one line of JSON with the ratios (`<engine>_vs_embedded_...`).

    python bench/engine_throughput.py [--batches 16 64] [--new-tokens 64] [--repeats 3]
        [--serve] [--sglang-python PY] [--vllm-python PY]

`--sglang-python` / `--vllm-python`: the python of an environment built by
scripts/sglang-cpu-env.sh / scripts/vllm-cpu-env.sh.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch


def best_times(fns: list[Callable[[], object]], repeats: int,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Best time of each function after one warm-up call each (wall time, or another `clock`, e.g.
    time.process_time: this process's CPU time). The runs are interleaved (a, b, a, b, ...) so
    that load from other processes on a shared machine hits both alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


def start_servers(args: argparse.Namespace, model_dir: Path, max_len: int, batch: int, stack: ExitStack) -> dict[str, Any]:
    """The server engines asked for, each one launched server behind its AxRL client (closed by `stack`)."""
    from axrl.inference.remote.launcher import ServerLauncher, free_port
    from axrl.inference.sglang.client import SGLangEngine
    from axrl.inference.sglang.factory import CPU_COMPAT, server_command
    from axrl.inference.sglang.settings import ServedModel, SGLangSettings
    from axrl.inference.vllm.client import VLLMEngine
    from axrl.inference.vllm.factory import SERVER_MODULE, server_args, server_env
    from axrl.inference.vllm.settings import VLLMSettings

    served = ServedModel(max_batch_size=batch, max_context_len=max_len, threads=args.threads)
    env = {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    wanted: dict[str, tuple[list[str], list[str], dict[str, str], str, type]] = {}
    if args.serve:
        command, flags = server_command(SGLangSettings(server="axrl"), served)
        wanted["serve"] = (command, flags, env, "--model-path", SGLangEngine)
    if args.sglang_python:
        _, flags = server_command(SGLangSettings(python=args.sglang_python), served)
        wanted["sglang"] = ([args.sglang_python, str(CPU_COMPAT)], flags, env, "--model-path", SGLangEngine)
    if args.vllm_python:
        wanted["vllm"] = ([args.vllm_python, "-m", SERVER_MODULE], server_args(VLLMSettings(), served, False),
                          server_env(VLLMSettings(), args.threads), "--model", VLLMEngine)
    engines = {}
    for name, (command, flags, variables, model_flag, client) in wanted.items():
        launcher = ServerLauncher(model_dir, command=command, server_args=flags, env=variables, base_port=free_port(),
                                  model_flag=model_flag, startup_timeout_s=900)
        stack.callback(launcher.stop)
        launcher.start()
        engines[name] = client(launcher.urls, launcher=launcher, own_launcher=False, model_dir=model_dir)
        stack.callback(engines[name].shutdown)
    return engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--serve", action="store_true", help="also time `axrl serve` through the SGLang client")
    ap.add_argument("--sglang-python", help="also time a real SGLang-CPU server (python of its environment)")
    ap.add_argument("--vllm-python", help="also time a real vLLM-CPU server (python of its environment)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from axrl.inference import EmbeddedEngine
    from axrl.model import build_model, preset_config, save_hf
    from axrl.tokenizer import Tokenizer

    tok = Tokenizer.default()  # servers load the tokenizer files next to the weights
    cfg = preset_config(args.preset, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    model = build_model(cfg, seed=0)
    n_new, rows, figures = args.new_tokens, [], {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        save_hf(model, tmp, tokenizer=tok)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp).eval()
        # No prefix cache: the timed repeats resubmit the same prompts, and HF generate() has none.
        engines = {"embedded": EmbeddedEngine(model, max_batch_size=max(args.batches), max_seq_len=32 + n_new + 8,
                                              prefix_cache=False)}
        stack.callback(engines["embedded"].shutdown)
        engines.update(start_servers(args, Path(tmp), 32 + n_new + 8, max(args.batches), stack))
        gen = torch.Generator().manual_seed(1234)
        for batch in args.batches:
            lens = torch.randint(16, 33, (batch,), generator=gen).tolist()
            prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
            rows.append((batch, time_batch(hf, engines, prompts, n_new, args.repeats, figures)))

    names = ["hf", *engines]
    print(f"{args.preset}, {n_new} new tokens/request, greedy, torch threads={args.threads}, "
          f"best of {args.repeats} (after a warm-up); tokens/s (× embedded)")
    print(f"{'batch':>5} " + " ".join(f"{n:>16}" for n in names))
    for batch, tps in rows:
        print(f"{batch:>5} " + " ".join(f"{tps[n]:>8.0f} ({tps[n] / tps['embedded']:>4.2f}x)" for n in names))
    figures.update(preset=args.preset, new_tokens=n_new, threads=args.threads, engines=names,
                   torch=torch.__version__, transformers=transformers.__version__)
    print(json.dumps(figures))


def time_batch(hf: Any, engines: dict[str, Any], prompts: list[list[int]], n_new: int, repeats: int,
               figures: dict[str, Any]) -> dict[str, float]:
    """Tokens/s of HF generate() and of every engine on `prompts` (timed interleaved); adds the
    figures (tokens/s, ratios to the embedded engine, greedy agreement with it) to `figures`."""
    from axrl.inference import GenerateRequest, SamplingParams

    batch, width, pad = len(prompts), max(len(p) for p in prompts), 0
    # HF: left-padded batch, as generate() expects for decoder-only models.
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run_hf() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=attn, max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, pad_token_id=pad, eos_token_id=None)
        return out[:, width:].tolist()

    sp = SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True)
    runs: dict[str, Callable[[], list[list[int]]]] = {"hf": run_hf}
    for name, engine in engines.items():
        runs[name] = lambda e=engine: [r.output_ids for r in e.generate_batch(
            [GenerateRequest(input_ids=p, sampling_params=sp) for p in prompts])]
    times = dict(zip(runs, best_times(list(runs.values()), repeats)))
    outputs = {name: run() for name, run in runs.items()}
    tps = {name: batch * n_new / t for name, t in times.items()}
    for name, out in outputs.items():
        assert all(len(o) == n_new for o in out), name
        agree = sum(a == b for x, y in zip(out, outputs["embedded"]) for a, b in zip(x, y)) / (batch * n_new)
        label = "engine" if name == "embedded" else name  # the embedded engine's keys predate the others
        figures[f"{label}_tokens_per_s_b{batch}"] = round(tps[name], 1)
        if name == "hf":
            figures[f"engine_vs_hf_tokens_per_s_ratio_b{batch}"] = round(tps["embedded"] / tps["hf"], 3)
            figures[f"greedy_token_agreement_b{batch}"] = round(agree, 4)
        elif name != "embedded":
            figures[f"{name}_vs_embedded_tokens_per_s_ratio_b{batch}"] = round(tps[name] / tps["embedded"], 3)
            figures[f"{name}_greedy_token_agreement_with_embedded_b{batch}"] = round(agree, 4)
    return tps


if __name__ == "__main__":
    main()
