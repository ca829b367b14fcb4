"""Which tensors break TRL's colocated weight push into vLLM's CPU build, one class at a time.

TRL 1.16's colocate mode pushes the trainer's weights into the live engine with, per parameter,
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])``
(``trl/generation/vllm_generation.py``, ``VLLMGeneration.sync_weights``), under the trainer's own
``named_parameters()`` names, then ``llm.reset_prefix_cache()``. This script does exactly that
outside TRL, with the engine built with TRL's ``LLM(...)`` arguments, pushing the *same* weights the
engine loaded (the checkpoint's, read with transformers as TRL's trainer reads them), so a correct
push changes nothing. Each class of tensors is pushed into its own fresh engine (one child process
per class), and for each it reports:

* whether ``load_weights`` raised (TRL catches nothing, so a raise would abort its sync);
* what happened to the engine's parameters the class maps to (shape, dtype, whether they now hold
  the pushed values);
* the mean |Δ| between the engine's teacher-forced logprobs (``prompt_logprobs``) of a fixed chat
  sequence and a transformers float32 forward of the same checkpoint, before and after the push.

Run with AxRL's vLLM environment (TRL is not needed; transformers is vLLM's own):

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 ~/.cache/axrl/vllm-venv/bin/python \\
        bench/trl_vllm_push_classes.py MODEL_DIR [--classes all,embed,...] [--dtype auto]

MODEL_DIR: a trained Qwen3-MoE HF directory (head_dim >= 32), as for bench/trl_vllm_colocate.py.
``--dtype auto`` is what TRL passes (nothing: vLLM's CPU build then runs a float32 checkpoint in
bfloat16). Ends with one JSON line: {class: {raised, delta_before, delta_after, params}}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

# each class: a regex over the trainer's (HF transformers 5) parameter names
CLASSES = {
    "embed": r"^model\.embed_tokens\.",
    "attn_qkv": r"self_attn\.[qkv]_proj\.",
    "attn_o": r"self_attn\.o_proj\.",
    "qk_norm": r"self_attn\.[qk]_norm\.",
    "router": r"mlp\.gate\.weight$",
    "experts": r"mlp\.experts\.",
    "norms": r"(layernorm|^model\.norm)\.",
    "lm_head": r"^lm_head\.",
    "all": r".",
}


def _reference(model_dir: str) -> tuple[list[int], list[float], dict]:
    """Token ids of a fixed chat, transformers' float32 logprobs of tokens 1.., and its weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 6?"},
                                   {"role": "assistant", "content": "3 + 6 = 9"},
                                   {"role": "user", "content": "And 4 + 4?"}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    logps = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return ids, logps.tolist(), {n: p.detach().clone() for n, p in hf.named_parameters()}


def _engine_delta(llm, ids: list[int], ref: list[float]) -> float:
    """Mean |engine − reference| over the teacher-forced logprobs of ``ids[1:]``."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                       use_tqdm=False)[0]
    got = [v[t].logprob for v, t in zip(out.prompt_logprobs[1:], ids[1:])]
    return sum(abs(a - b) for a, b in zip(got, ref)) / len(ref)


def _param_states(model) -> dict[str, tuple]:
    """The engine's parameters: name → (shape, dtype, data pointer)."""
    return {n: (tuple(p.shape), str(p.dtype).removeprefix("torch."), p.data_ptr())
            for n, p in model.named_parameters()}


def _kernels(model) -> dict[str, str]:
    """How layer 0's linears compute on the CPU build: the names the ``cpu_linear`` closure holds."""
    out = {}
    for name, mod in model.named_modules():
        fn = getattr(mod, "cpu_linear", None)
        if fn is not None and (".0." in name or "layers" not in name):
            held = getattr(fn, "__code__", None)
            out[name] = getattr(fn, "__name__", "?") + (f"{held.co_names}" if held else "")
    return out


def _child(model_dir: str, cls: str, dtype: str, repack: bool) -> dict:
    """Build TRL's engine, push one class of weights as TRL does, report what happened."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29563", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    from axrl.inference.vllm.checksum_extension import plain_experts_from, repack_experts

    ids, ref, weights = _reference(model_dir)
    # TRL 1.16's colocate LLM(...) arguments (vllm_generation.py), with GRPOConfig's values of the bench
    llm = LLM(model=model_dir, tensor_parallel_size=1, gpu_memory_utilization=0.3, max_model_len=None,
              max_num_seqs=4, enable_sleep_mode=False, model_impl="auto",
              distributed_executor_backend="external_launcher", seed=0, max_num_batched_tokens=4096,
              logprobs_mode="processed_logprobs", dtype=dtype)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model  # TRL's own path
    kernels = _kernels(model)
    before = _param_states(model)
    delta_before = _engine_delta(llm, ids, ref)
    pushed = {n: t for n, t in weights.items() if re.search(CLASSES[cls], n)}
    raised, loaded = {}, set()
    for name, tensor in pushed.items():  # TRL pushes one parameter per call
        try:
            loaded |= set(model.load_weights([(name, tensor)]) or ())
        except Exception as exc:  # noqa: BLE001 — recorded: TRL would have aborted here
            raised[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    repacked = repack_experts(model, plain_experts_from(weights))["repacked"] if repack else 0
    llm.reset_prefix_cache()
    after = _param_states(model)
    changed = {n: {"before": before[n][:2], "after": after[n][:2], "replaced": before[n][2] != after[n][2]}
               for n in after if n in loaded or before.get(n, after[n])[:2] != after[n][:2]}
    return {"pushed": len(pushed), "repacked": repacked, "raised": raised, "loaded": sorted(loaded), "params": changed,
            "kernels": kernels, "engine_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "delta_before": delta_before, "delta_after": _engine_delta(llm, ids, ref)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated, of {list(CLASSES)}")
    parser.add_argument("--dtype", default="auto", help="vLLM's dtype (TRL passes none: auto)")
    parser.add_argument("--repack", action="store_true",
                        help="after the push, re-run the CPU experts kernel's re-packing (the workaround)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per class's child process")
    args = parser.parse_args()
    if args.child:
        print("AXRL_RESULT " + json.dumps(_child(args.model, args.child, args.dtype, args.repack)), flush=True)
        return
    classes = [c for c in args.classes.split(",") if c]
    if bad := [c for c in classes if c not in CLASSES]:
        raise SystemExit(f"--classes: unknown {bad}; choose from {list(CLASSES)}")
    results = {}
    for cls in classes:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, args.model, "--child", cls, "--dtype", args.dtype]
                              + (["--repack"] if args.repack else []),
                              capture_output=True, text=True, timeout=args.timeout)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("AXRL_RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"class {cls}: child exited {proc.returncode}\n{proc.stderr[-3000:]}")
        res = results[cls] = json.loads(line[-1].removeprefix("AXRL_RESULT "))
        print(f"[{cls}] {time.perf_counter() - t0:.0f} s, engine {res['engine_dtype']}: pushed {res['pushed']}, "
              f"raised {len(res['raised'])}, loaded {len(res['loaded'])}, re-packed {res['repacked']}; mean |engine - transformers| "
              f"{res['delta_before']:.3g} -> {res['delta_after']:.3g}", flush=True)
        for name, msg in list(res["raised"].items())[:3]:
            print(f"    raised on {name}: {msg}", flush=True)
        for name, st in list(res["params"].items())[:6]:
            print(f"    {name}: {st['before']} -> {st['after']}{' (new tensor)' if st['replaced'] else ''}", flush=True)
    print(json.dumps({c: {"raised": len(r["raised"]), "loaded": len(r["loaded"]), "repacked": r["repacked"],
                          "engine_dtype": r["engine_dtype"],
                          "delta_before": r["delta_before"], "delta_after": r["delta_after"],
                          "kernels": r["kernels"]} for c, r in results.items()}))


if __name__ == "__main__":
    main()
