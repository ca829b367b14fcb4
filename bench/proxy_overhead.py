"""What the recording proxy costs: generated tokens/s through it vs the engine directly.

The same requests both ways, on one free-running embedded engine (random-init tiny MoE, every
turn runs to max_tokens: `ignore_eos`): `--requests` chat prompts at once, directly as token ids
via `submit_many`, and through the proxy — one session each, called at once from as many threads
of a separate process (as agents run, not in the engine's process), the proxy parsing the HTTP
request, rendering the template, coalescing the calls that arrive together into one engine
submission if `--coalesce-ms` > 0 (the proxy's default: off), recording and stitching. Two clients:
"HTTP" posts the JSON bodies (built before the timing) with `http.client` — the proxy's own
cost; "SDK" is the official `openai` client, whose request building and response parsing (the
agent's own CPU, on the same cores, serialised on the client process's GIL) come on top. A
third direct path submits each request from its own thread, as independent agents arrive: what
staggered arrivals cost the engine (admission and prefill spread over iterations). Rounds
alternate (direct, per thread, HTTP, SDK, streamed, direct, …) so all see the same machine load;
the medians are compared. "Streamed" is one `stream: true` chat call through the proxy (over
HTTP, alone on the engine): the time to its first content chunk vs to the end of its stream.

    OMP_NUM_THREADS=1 python bench/proxy_overhead.py --rounds 3

Last stdout line: one JSON object; `proxy_vs_direct_tokens_per_s_ratio` (proxy over HTTP / one
submission, the issue's target ≥ 0.95), `proxy_vs_direct_concurrent_ratio` (over HTTP / one per
thread) and `proxy_sdk_vs_direct_ratio` (through the SDK / one submission, target ≥ 0.9): ratios
of the medians; `proxy_vs_direct_paired_ratio` and `proxy_sdk_vs_direct_paired_ratio`: the median
of each round's ratio to the same round's direct run (steadier when the box's load changes);
`ttft_ms` and `completion_ms`: the streamed call's first content chunk and its end (medians).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import openai
import torch

from axrl.agents.proxy import ProxyServer, SessionPolicy, engine_submit
from axrl.inference import EmbeddedEngine
from axrl.inference.protocol import GenerateRequest, SamplingParams
from axrl.model import build_model, preset_config
from axrl.tokenizer import Tokenizer


def stream_call(call: dict, max_tokens: int) -> dict[str, float]:
    """One streamed chat call over HTTP: seconds to its first content chunk and to its end."""
    url = urllib.parse.urlsplit(call["base_url"])
    conn = http.client.HTTPConnection(url.hostname, url.port)
    headers = {"Authorization": f"Bearer {call['api_key']}", "Content-Type": "application/json"}
    conn.request("GET", f"{url.path}/models", headers=headers)  # connection set-up outside the timing
    conn.getresponse().read()
    body = json.dumps({"model": "policy", "messages": call["messages"], "max_tokens": max_tokens, "stream": True})
    t0, first = time.perf_counter(), None
    conn.request("POST", f"{url.path}/chat/completions", body, headers)
    for line in conn.getresponse():  # SSE lines as they arrive
        if first is None and line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
            first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    return {"ttft_s": (first or end) - t0, "completion_s": end - t0}


def client_main() -> None:
    """The agents' process: per job line, every call at once (one client and thread each).

    mode "sdk": the official `openai` client, as agents call; "http": the same JSON bodies, built
    before the timing and posted with `http.client` — what the proxy itself costs, without the
    SDK's request building and response parsing (the agent's own CPU, on the same cores)."""
    for line in sys.stdin:
        job = json.loads(line)
        if job["mode"] == "stream":
            print(json.dumps(stream_call(job["calls"][0], job["max_tokens"])), flush=True)
            continue
        calls, sdk = job["calls"], job["mode"] == "sdk"
        if sdk:
            clients = [openai.OpenAI(base_url=c["base_url"], api_key=c["api_key"], max_retries=0) for c in calls]
            for c in clients:  # connection set-up outside the timing (an agent keeps its client)
                c.models.list()
        else:
            conns, posts = [], []
            for c in calls:
                url = urllib.parse.urlsplit(c["base_url"])
                conn = http.client.HTTPConnection(url.hostname, url.port)
                headers = {"Authorization": f"Bearer {c['api_key']}", "Content-Type": "application/json"}
                conn.request("GET", f"{url.path}/models", headers=headers)
                conn.getresponse().read()
                conns.append(conn)
                posts.append((f"{url.path}/chat/completions", json.dumps(
                    {"model": "policy", "messages": c["messages"], "max_tokens": job["max_tokens"]}), headers))

        def call(i: int) -> int:
            if sdk:
                r = clients[i].chat.completions.create(model="policy", messages=calls[i]["messages"],
                                                       max_tokens=job["max_tokens"])
                return r.usage.completion_tokens
            conns[i].request("POST", *posts[i])
            return json.loads(conns[i].getresponse().read())["usage"]["completion_tokens"]

        with ThreadPoolExecutor(len(calls)) as pool:
            list(pool.map(lambda i: None, range(len(calls))))  # start the threads outside the timing
            t0 = time.perf_counter()
            tokens = sum(pool.map(call, range(len(calls))))
            seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


def main() -> None:
    if "--client" in sys.argv:
        return client_main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--coalesce-ms", type=float, default=0.0,
                    help="the proxy's coalescing window (0: every call submitted on its own)")
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

    def requests() -> list[GenerateRequest]:
        return [GenerateRequest(input_ids=tok.apply_chat_template(c, add_generation_prompt=True),
                                sampling_params=SamplingParams(**{**vars(sampling), "seed": i}),
                                return_logprob=True) for i, c in enumerate(conversations)]

    def direct() -> tuple[float, int]:
        """All requests in one submission: admitted together, one batch from the first step."""
        batch = requests()
        t0 = time.perf_counter()
        results = [f.result() for f in engine.submit_many(batch)]
        return time.perf_counter() - t0, sum(len(r.output_ids) for r in results)

    def direct_concurrent() -> tuple[float, int]:
        """Each request submitted on its own from its own thread, as independent agents arrive."""
        batch = requests()
        with ThreadPoolExecutor(len(batch)) as pool:
            t0 = time.perf_counter()
            results = list(pool.map(lambda r: engine.submit_many([r])[0].result(), batch))
            return time.perf_counter() - t0, sum(len(r.output_ids) for r in results)

    # The agents' side (the SDK clients, one thread per request) runs in a process of its own, as
    # agents do in training: in this process it would take the GIL from the engine's scheduler.
    client = subprocess.Popen([sys.executable, __file__, "--client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)

    with ProxyServer(tok, model_name="policy", coalesce_window_s=args.coalesce_ms / 1e3) as proxy:
        def agents(mode: str, n: int) -> dict:
            """n sessions' calls made by the client process in `mode`; its report."""
            sessions = [proxy.open_session(engine_submit(engine), SessionPolicy(sampling, max_tokens=args.max_tokens,
                                                                                seed=i),
                                           max_context_len=512) for i in range(n)]
            job = {"calls": [{"base_url": proxy.base_url(s), "api_key": s.api_key, "messages": c}
                             for s, c in zip(sessions, conversations)], "max_tokens": args.max_tokens,
                   "mode": mode}
            client.stdin.write(json.dumps(job) + "\n")
            client.stdin.flush()
            done = json.loads(client.stdout.readline())
            for s in sessions:
                proxy.close_session(s)
            return done

        def through_proxy(mode: str) -> tuple[float, int]:
            done = agents(mode, args.requests)
            return done["seconds"], done["tokens"]

        direct()  # warm-up of every path
        through_proxy("http")
        through_proxy("sdk")
        agents("stream", 1)
        d, c, p, k, streamed = [], [], [], [], []
        for _ in range(args.rounds):
            for out, run in ((d, direct), (c, direct_concurrent), (p, lambda: through_proxy("http")),
                             (k, lambda: through_proxy("sdk"))):
                seconds, tokens = run()
                out.append(tokens / seconds)
            streamed.append(agents("stream", 1))
    client.stdin.close()
    client.wait(timeout=30)
    engine.shutdown()
    d_med, c_med, p_med, k_med = (statistics.median(x) for x in (d, c, p, k))
    print(f"direct (one submission)  tokens/s per round: {', '.join(f'{x:.0f}' for x in d)}")
    print(f"direct (one per thread)  tokens/s per round: {', '.join(f'{x:.0f}' for x in c)}")
    print(f"proxy (HTTP client)      tokens/s per round: {', '.join(f'{x:.0f}' for x in p)}")
    print(f"proxy (openai SDK)       tokens/s per round: {', '.join(f'{x:.0f}' for x in k)}")
    ttft, full = (statistics.median(x[key] * 1e3 for x in streamed) for key in ("ttft_s", "completion_s"))
    print("proxy (streamed call)    first chunk / end, ms: "
          + ", ".join(f"{x['ttft_s'] * 1e3:.1f} / {x['completion_s'] * 1e3:.1f}" for x in streamed))
    print(json.dumps({"preset": args.preset, "requests": args.requests, "max_tokens": args.max_tokens,
                      "rounds": args.rounds, "coalesce_ms": args.coalesce_ms, "direct_tokens_per_s": round(d_med, 1),
                      "direct_concurrent_tokens_per_s": round(c_med, 1), "proxy_tokens_per_s": round(p_med, 1),
                      "proxy_vs_direct_tokens_per_s_ratio": round(p_med / d_med, 3),
                      "proxy_vs_direct_concurrent_ratio": round(p_med / c_med, 3),
                      "proxy_sdk_tokens_per_s": round(k_med, 1), "proxy_sdk_vs_direct_ratio": round(k_med / d_med, 3),
                      # each round's path over the same round's direct one, the median: a load
                      # change between rounds (a shared box) moves both sides of a round alike
                      "proxy_vs_direct_paired_ratio": round(statistics.median(x / y for x, y in zip(p, d)), 3),
                      "proxy_sdk_vs_direct_paired_ratio": round(statistics.median(x / y for x, y in zip(k, d)), 3),
                      "ttft_ms": round(ttft, 1), "completion_ms": round(full, 1)}))


if __name__ == "__main__":
    main()
