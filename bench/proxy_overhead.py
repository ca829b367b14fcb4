"""What the recording proxy costs: generated tokens/s through it vs the engine directly.

The same requests both ways, on one free-running embedded engine (random-init tiny MoE, every
turn runs to max_tokens: `ignore_eos`): `--requests` chat prompts at once, directly as token ids
via `submit_many`, and through the proxy — one session each, the official `openai` client from
as many threads, the proxy rendering the template, recording and stitching. Rounds alternate
(direct, proxy, direct, …) so both see the same machine load; the medians are compared.

    OMP_NUM_THREADS=1 python bench/proxy_overhead.py --rounds 3

Last stdout line: one JSON object; `proxy_vs_direct_tokens_per_s_ratio` (proxy / direct, target ≥ 0.9).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import torch

from axrl.agents.proxy import ProxyServer, SessionPolicy, engine_submit
from axrl.inference import EmbeddedEngine
from axrl.inference.protocol import GenerateRequest, SamplingParams
from axrl.model import build_model, preset_config
from axrl.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.default()
    cfg = preset_config(args.preset, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    engine = EmbeddedEngine(build_model(cfg, seed=0).eval(), max_batch_size=args.requests, max_seq_len=512,
                            eos_token_id=tok.eos_token_id)
    conversations = [[{"role": "system", "content": "Use the calculator tool, then reply: The answer is N."},
                      {"role": "user", "content": f"What is {17 + i} + {29 * i}?"}] for i in range(args.requests)]
    sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)

    def direct() -> tuple[float, int]:
        requests = [GenerateRequest(input_ids=tok.apply_chat_template(c, add_generation_prompt=True),
                                    sampling_params=SamplingParams(**{**vars(sampling), "seed": i}),
                                    return_logprob=True) for i, c in enumerate(conversations)]
        t0 = time.perf_counter()
        results = [f.result() for f in engine.submit_many(requests)]
        return time.perf_counter() - t0, sum(len(r.output_ids) for r in results)

    with ProxyServer(tok, model_name="policy") as proxy:
        def through_proxy() -> tuple[float, int]:
            sessions = [proxy.open_session(engine_submit(engine), SessionPolicy(sampling, max_tokens=args.max_tokens,
                                                                                seed=i),
                                           max_context_len=512) for i in range(args.requests)]
            clients = [openai.OpenAI(base_url=proxy.base_url(s), api_key=s.api_key, max_retries=0) for s in sessions]

            def call(i: int) -> int:
                r = clients[i].chat.completions.create(model="policy", messages=conversations[i],
                                                       max_tokens=args.max_tokens)
                return r.usage.completion_tokens

            with ThreadPoolExecutor(args.requests) as pool:
                call(0)  # connection set-up outside the timing (an agent keeps its client)
                sessions[0].turns.clear()
                t0 = time.perf_counter()
                tokens = sum(pool.map(call, range(args.requests)))
                elapsed = time.perf_counter() - t0
            for s in sessions:
                proxy.close_session(s)
            return elapsed, tokens

        direct()  # warm-up of both paths
        through_proxy()
        d, p = [], []
        for _ in range(args.rounds):
            seconds, tokens = direct()
            d.append(tokens / seconds)
            seconds, tokens = through_proxy()
            p.append(tokens / seconds)
    engine.shutdown()
    d_med, p_med = statistics.median(d), statistics.median(p)
    print(f"direct  tokens/s per round: {', '.join(f'{x:.0f}' for x in d)}")
    print(f"proxy   tokens/s per round: {', '.join(f'{x:.0f}' for x in p)}")
    print(json.dumps({"preset": args.preset, "requests": args.requests, "max_tokens": args.max_tokens,
                      "rounds": args.rounds, "direct_tokens_per_s": round(d_med, 1),
                      "proxy_tokens_per_s": round(p_med, 1),
                      "proxy_vs_direct_tokens_per_s_ratio": round(p_med / d_med, 3)}))


if __name__ == "__main__":
    main()
