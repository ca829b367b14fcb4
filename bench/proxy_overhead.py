"""What the recording proxy costs: generated tokens/s through it vs the engine directly.

One free-running embedded engine (random-init tiny MoE, every call runs to its `max_tokens`:
`ignore_eos`, so every path generates exactly the same number of tokens — checked, the bench
exits non-zero otherwise), `--requests` agents (16) in a process of their own
(`bench/proxy_agents.py`, never the engine's), their clients built and connected before the
timing (an agent keeps its client). Rounds alternate between every path, so all see the same
machine load. Three workloads:

**Steady-state multi-turn: the headline, the issue's keys.** What AxRL's rollouts are: each agent
a session of `--turns` chat calls (4, `rollout.max_turns`' default), each reply appended to the
conversation and then a fixed short message (`FOLLOW_UP`, the tool's answer), then the next
call; and turns of varying length (EOS, tool outputs), so while one agent parses its reply and
builds its next call the engine decodes the others. Each turn's `max_tokens` is drawn (seeded,
`--seed`; the same draws for every path) uniformly from [max_tokens/3, 5·max_tokens/3]: [16, 80]
at the default 48 (`rollout.max_new_tokens`, what the quickstart trains on) — the quickstart's
mean turn, spread wide enough that sessions finish their turns on different engine steps, no
turn under a third of it. Directly, the same token streams (each session's stream so far, the
reply's turn close, the follow-up message: what the proxy stitches) go to the engine, each
session's next turn submitted the moment its previous one finishes, two ways: from the finished
call's done-callback on the engine's own thread (`direct_callback`: no wake-up between turns,
all first turns in one submission) and from one thread per session (`direct_threads`); `direct`
is the faster of the two (median tokens/s) — the engine's best case, only what the agents and
the proxy add can separate the paths. Through the proxy every agent is a thread running its
turns back to back: "HTTP" posts the JSON with `http.client` (~0.25 ms of client CPU a call: the
proxy's own cost), "SDK" calls the official `openai` client (one per agent; its ~2 ms of request
building and reply parsing per call, on the agents' process's GIL and the same cores as the
engine, come on top). Every proxy session must record one chain of its turns with the direct
path's prompt lengths and reply lengths. Two more direct runs say what the proxy path's CPU
alone costs the engine: `direct_callback` while a burner spends, per call, the CPU the HTTP
agents and the proxy spent in the same round's HTTP run, at one call's share of the direct round
— in a thread of the engine's process (`direct_burn_thread`: on its GIL, as the proxy is) or in a
process of its own (`direct_burn_process`).

**Lockstep multi-turn (`lockstep_` keys): a worst case.** The same with every turn `max_tokens`
long: every session's turn ends on the same engine step, so all the agents' client CPU and the
proxy's intake between two turns fall where the engine has nothing to decode.

**Single turn (`single_turn_` keys).** All calls fired at the same instant, one each: directly in
one `submit_many` and from one thread each, and through the proxy over HTTP, the SDK from
threads, and the SDK from one forked process per agent (as AxRL forks a `python agent.py`
episode). Also one `stream: true` call per round (over HTTP, alone on the engine): the time to
its first content chunk and to its end. `--coalesce-ms` > 0 sets the proxy's coalescing window.

    OMP_NUM_THREADS=1 python bench/proxy_overhead.py --rounds 9

Last stdout line: one JSON object. `proxy_vs_direct_tokens_per_s_ratio` (HTTP agents over
`direct`, target ≥ 0.95) and `proxy_sdk_vs_direct_ratio` (SDK agents, target ≥ 0.9): steady
state, ratios of the median tokens/s over rounds; `*_paired_ratio`: the median of each round's
ratio to the same round's `direct` run (steadier when the box's load changes); `direct_path`
(which direct way was faster), `direct_ms` (its round), `direct_callback_tokens_per_s`,
`direct_threads_tokens_per_s`; where the time goes, medians over rounds, per path
(`direct_callback`, `direct_threads`, `http_turns`, `sdk_turns`): `_between_turns_ms` (how long a
session was away from the engine between two of its turns: from the engine finishing one call
to it receiving the next — through the proxy, the proxy's reply, the agent's parsing and next
request, the proxy's intake), `_mean_in_flight` (sessions the engine held on average: their time
in it over the round's), `_engine_steps` (scheduler iterations in the round), `_engine_step_ms`
(the time per step while the engine held any session), and through the proxy `_round_ms`,
`_client_cpu_per_call_ms` (the agents' thread CPU time per call) and `_proxy_cpu_per_call_ms`
(the proxy's event-loop thread's CPU time per call, in the engine's process);
`direct_burn_thread_tokens_per_s`, `direct_burn_process_tokens_per_s` and their
`_vs_direct_ratio` (the burner runs; the same breakdown keys). The same keys with a `lockstep_`
prefix for the lockstep workload (no burner runs), and the single-turn ones with `single_turn_` (`_last_at_engine_ms`,
`_engine_done_ms`, `_replies_parsed_ms`: ms from the calls' start; `direct_concurrent`: the
one-thread-per-call direct path); `ttft_ms`, `completion_ms`: the streamed call (medians);
`proxy_cpu_ms_per_call`: the proxy's CPU per call of the steady multi-turn HTTP rounds
(`http_turns_proxy_cpu_per_call_ms`), with `load_average_1m` and `cpu_count` beside it — the
figure depends on how busy the cores are, so say under which load it was measured.
perf_counter is CLOCK_MONOTONIC, one clock for both processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from axrl.agents.proxy import ProxyServer, SessionPolicy, engine_submit
from axrl.agents.proxy.stitch import appended_text, render
from axrl.core.token_stream import assistant_close_ids, reply_glue
from axrl.inference import EmbeddedEngine
from axrl.inference.protocol import GenerateRequest, SamplingParams
from axrl.model import build_model, preset_config
from axrl.tokenizer import Tokenizer
from proxy_agents import burn


FOLLOW_UP = {"role": "user", "content": "calculator: 46. Go on."}  # every session's next message, every turn
WORKLOADS = {"steady": "", "lockstep": "lockstep_"}  # the multi-turn workloads and their keys' prefixes
DIRECT_PATHS = {"direct_callback": "direct (done-callback resubmits)", "direct_threads": "direct (thread per session)"}
TURN_PATHS = {"http-turns": "proxy (HTTP client)", "sdk-turns": "proxy (SDK, threads)"}
BURN_PATHS = {"direct_burn_thread": "direct + HTTP's CPU, a thread", "direct_burn_process": "direct + HTTP's CPU, a process"}
# The single-turn proxy paths, as `client_main` runs them, and how the report names them.
PROXY_PATHS = {"http": "proxy (HTTP client)", "sdk": "proxy (SDK, threads)", "sdk-processes": "proxy (SDK, processes)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--requests", type=int, default=16, help="agents (sessions) at once")
    ap.add_argument("--max-tokens", type=int, default=48,
                    help="tokens per call (single turn, lockstep); the steady turns' mean (drawn from [1/3, 5/3] of it)")
    ap.add_argument("--turns", type=int, default=4,
                    help="model calls per agent session in the multi-turn workloads (rollout.max_turns' default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="the steady workload's turn-length draws")
    ap.add_argument("--coalesce-ms", type=float, default=0.0,
                    help="the proxy's coalescing window (0: every call submitted on its own)")
    args = ap.parse_args()
    if args.turns < 1 or args.requests < 1 or args.max_tokens < 3:
        ap.error("--turns and --requests must be >= 1, --max-tokens >= 3")
    torch.set_num_threads(1)
    bench = Bench(args)
    runs = bench.run()
    same_tokens(args, bench.lengths, runs)
    report(args, bench.lengths, runs)


def turn_lengths(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """Per workload, session and turn, the call's `max_tokens` (exact: `ignore_eos`). Steady: drawn
    uniformly from [max_tokens // 3, 5 * max_tokens // 3] ([16, 80] at 48), seeded; lockstep: all
    `max_tokens`."""
    rng = random.Random(args.seed)
    lo, hi = args.max_tokens // 3, 5 * args.max_tokens // 3
    return {"steady": [[rng.randint(lo, hi) for _ in range(args.turns)] for _ in range(args.requests)],
            "lockstep": [[args.max_tokens] * args.turns for _ in range(args.requests)]}


def same_tokens(args: argparse.Namespace, lengths: dict[str, list[list[int]]], runs: dict[str, list[dict]]) -> None:
    """Every round of every path generated what it should: the rates compare the same tokens."""
    for name, rounds in runs.items():
        if name == "stream":
            continue
        workload = name.split(":")[0]
        expected = sum(map(sum, lengths[workload])) if workload in WORKLOADS else args.requests * args.max_tokens
        got = [r["tokens"] for r in rounds]
        if any(n != expected for n in got):
            raise RuntimeError(f"{name}: generated {got} tokens per round, not {expected}: the paths differ")


def timed_many(submit_many: Callable, logs: list[list[list[float]]], requests: list[GenerateRequest]) -> list:
    """`submit_many(requests)`, noting in logs[k], per request k, [when it reached the engine, when
    the engine finished it] (the engine's thread stamps the end, before any later done-callback)."""
    t = time.perf_counter()
    futures = submit_many(requests)
    for f, log in zip(futures, logs):
        entry = [t, t]
        log.append(entry)
        f.add_done_callback(lambda _f, e=entry: e.__setitem__(1, time.perf_counter()))
    return futures


class timed_submit(engine_submit):  # noqa: N801 — as engine_submit
    """`engine_submit` that notes each call in `log` (`timed_many`)."""

    def __init__(self, engine: EmbeddedEngine, log: list[list[float]]) -> None:
        super().__init__(engine)
        submit_many = self.many
        self.many = lambda requests: timed_many(submit_many, [log] * len(requests), requests)


class Bench:
    """The engine, the conversations, and every path's round (see the module doc)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tok = tok = Tokenizer.default()
        cfg = preset_config(args.preset, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
        self.conversations = [[{"role": "system", "content": "Use the calculator tool, then reply: The answer is N."},
                               {"role": "user", "content": f"What is {17 + i} + {29 * i}?"}]
                              for i in range(args.requests)]
        self.lengths = turn_lengths(args)
        self.max_len = max(args.max_tokens, *(n for w in self.lengths.values() for s in w for n in s))
        self.sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
        self.prompts = [tok.apply_chat_template(c, add_generation_prompt=True) for c in self.conversations]
        self.glue = reply_glue(assistant_close_ids(tok), closed=False)  # a reply cut at max_tokens
        conv = self.conversations[0] + [{"role": "assistant", "content": "."}, FOLLOW_UP]
        full = render(tok, conv, None, generation=True)
        self.follow_ids = tok.encode(appended_text(tok, conv, len(conv) - 1, None, full))
        # The engine's context: the single-turn bench's 512 (the quickstart's rollout.max_context_len),
        # more only when the sessions' streams need it.
        longest = max(len(p) + sum(n + len(self.glue) + len(self.follow_ids) for n in s)
                      for w in self.lengths.values() for p, s in zip(self.prompts, w))
        self.max_seq_len = max(512, -(-longest // 64) * 64)
        self.engine = EmbeddedEngine(build_model(cfg, seed=0).eval(), max_batch_size=args.requests,
                                     max_seq_len=self.max_seq_len, eos_token_id=tok.eos_token_id)
        self.at_engine: dict[int, list[list[float]]] = {}  # per session: [submitted, finished] of each call

    def request(self, i: int, prompt: list[int], turn: int = 0, max_tokens: int | None = None) -> GenerateRequest:
        """Session i's engine request: its prompt ids, the bench's sampling, a seed per session and turn."""
        return GenerateRequest(input_ids=prompt, sampling_params=dataclasses.replace(
            self.sampling, seed=i + 1000 * turn, max_new_tokens=max_tokens or self.args.max_tokens),
            return_logprob=True)

    def direct(self) -> dict:
        """All requests in one submission: admitted together, one batch from the first step."""
        batch = [self.request(i, p) for i, p in enumerate(self.prompts)]
        t0 = time.perf_counter()
        results = [f.result() for f in self.engine.submit_many(batch)]
        return {"seconds": time.perf_counter() - t0, "tokens": sum(len(r.output_ids) for r in results)}

    def direct_concurrent(self) -> dict:
        """Each request submitted on its own from its own thread, as independent agents arrive."""
        batch = [self.request(i, p) for i, p in enumerate(self.prompts)]
        with ThreadPoolExecutor(len(batch)) as pool:
            t0 = time.perf_counter()
            results = list(pool.map(lambda r: self.engine.submit_many([r])[0].result(), batch))
            return {"seconds": time.perf_counter() - t0, "tokens": sum(len(r.output_ids) for r in results)}

    def direct_chained(self, workload: str, threads: bool) -> dict:
        """The multi-turn sessions' token streams without the proxy and agents: each session's
        next turn (its stream so far, the reply's close, the follow-up message: what the proxy
        stitches) submitted the moment its previous one finishes — from the finished call's
        done-callback on the engine's own thread (no wake-up between turns; all first turns in one
        submission), or from one thread per session in this process (`threads`)."""
        lengths, n = self.lengths[workload], self.args.requests
        logs: list[list[list[float]]] = [[] for _ in range(n)]
        prompt_lens: list[list[int]] = [[] for _ in range(n)]
        tokens, errors, finished = [0] * n, [], threading.Semaphore(0)

        def submit(sessions: list[int], turn: int, prompts: list[list[int]]) -> list:
            for i, p in zip(sessions, prompts):
                prompt_lens[i].append(len(p))
            return timed_many(self.engine.submit_many, [logs[i] for i in sessions],
                              [self.request(i, p, turn, lengths[i][turn]) for i, p in zip(sessions, prompts)])

        def step(i: int, turn: int, prompt: list[int], result: Any) -> list[int] | None:
            """Count a finished turn; the session's next prompt, None after its last turn."""
            tokens[i] += len(result.output_ids)
            return prompt + list(result.output_ids) + self.glue + self.follow_ids if turn + 1 < len(lengths[i]) else None

        def chain(i: int, turn: int, prompt: list[int], future: Any) -> None:  # on the engine's thread
            try:
                nxt = step(i, turn, prompt, future.result())
                if nxt is not None:
                    submit([i], turn + 1, [nxt])[0].add_done_callback(lambda f: chain(i, turn + 1, nxt, f))
                    return
            except BaseException as e:  # noqa: BLE001 — a callback's error would be swallowed
                errors.append(e)
            finished.release()

        def session(i: int) -> None:
            prompt, turn = self.prompts[i], 0
            while prompt is not None:
                prompt, turn = step(i, turn, prompt, submit([i], turn, [prompt])[0].result()), turn + 1

        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda i: None, range(n)))  # start the threads outside the timing
            t0 = time.perf_counter()
            if threads:
                list(pool.map(session, range(n)))
            else:
                for i, f in enumerate(submit(list(range(n)), 0, self.prompts)):
                    f.add_done_callback(lambda f, i=i: chain(i, 0, self.prompts[i], f))
                for _ in range(n):
                    if not finished.acquire(timeout=300) or errors:
                        raise RuntimeError(f"the direct chained sessions failed: {errors or 'timed out'}")
            seconds = time.perf_counter() - t0
        return {"seconds": seconds, "tokens": sum(tokens), "prompt_lens": prompt_lens, "per_session": logs,
                "at_engine": [x for log in logs for x in log]}

    def agents(self, proxy: ProxyServer, mode: str, n: int, workload: str | None = None) -> dict:
        """n sessions' calls made by the client process in `mode` (multi-turn: `workload`'s turns); its report."""
        self.at_engine = {i: [] for i in range(n)}
        sessions = [proxy.open_session(timed_submit(self.engine, self.at_engine[i]),
                                       SessionPolicy(self.sampling, max_tokens=self.max_len, seed=i),
                                       max_context_len=self.max_seq_len) for i in range(n)]
        job = {"calls": [{"base_url": proxy.base_url(s), "api_key": s.api_key, "messages": c}
                         for s, c in zip(sessions, self.conversations)], "max_tokens": self.args.max_tokens,
               "mode": mode, "lengths": workload and self.lengths[workload], "follow_up": FOLLOW_UP}
        cpu = proxy.cpu_seconds()
        self.client.stdin.write(json.dumps(job) + "\n")
        self.client.stdin.flush()
        done = json.loads(self.client.stdout.readline())
        done["proxy_cpu_s"] = proxy.cpu_seconds() - cpu
        if workload:
            self.check_sessions(sessions, workload)
        for s in sessions:
            proxy.close_session(s)
        return {**done, "at_engine": [list(x) for log in self.at_engine.values() for x in log],
                "per_session": [[list(x) for x in log] for log in self.at_engine.values()]}

    def check_sessions(self, sessions: list, workload: str) -> None:
        """Every multi-turn session recorded one chain of its turns, each prompt as long as the
        direct path's (the same token streams both ways) and each reply its turn's length."""
        expected, lengths = self.direct_lengths[workload], self.lengths[workload]
        for i, s in enumerate(sessions):
            got = [(t.parent, len(t.prompt_ids), len(t.output_ids)) for t in (s.turns[k] for k in sorted(s.turns))]
            want = [(k or None, expected[i][k], n) for k, n in enumerate(lengths[i])]
            if got != want:
                raise RuntimeError(f"session {i} recorded (parent, prompt length, reply length) {got}, "
                                   f"the direct path ran {want}: the paths' token streams differ")

    def run_path(self, proxy: ProxyServer, name: str) -> dict:
        """One round of the path `name` ("direct", "http", ..., or "<workload>:<path>")."""
        steps = self.engine.health()["iterations"]
        run = self.last[name] = self.run_once(proxy, name)
        run["engine_steps"] = self.engine.health()["iterations"] - steps
        return run

    def run_once(self, proxy: ProxyServer, name: str) -> dict:
        """`run_path` without the engine's step count."""
        workload, _, path = name.rpartition(":")
        if path in BURN_PATHS:
            return self.direct_burning(workload, path)
        if path in DIRECT_PATHS:
            run = self.direct_chained(workload, threads=path == "direct_threads")
            if self.direct_lengths.setdefault(workload, run["prompt_lens"]) != run["prompt_lens"]:
                raise RuntimeError(f"{name}: the direct paths' prompt lengths differ from round to round")
            return run
        if path in ("direct", "direct_concurrent"):
            return getattr(self, path)()
        return self.agents(proxy, path, 1 if path == "stream" else self.args.requests, workload or None)

    def direct_burning(self, workload: str, path: str) -> dict:
        """`direct_callback` while a burner spends the HTTP agents' and the proxy's CPU of this
        round's HTTP run (per call, at one call per direct round / calls), in a thread of this
        process (`direct_burn_thread`: on the engine's GIL, as the proxy is) or in a process of its
        own (`direct_burn_process`): how much the same CPU costs the engine without any agent."""
        http, direct = self.last[f"{workload}:http-turns"], self.last[f"{workload}:direct_callback"]
        burst, period = (http["cpu_s"] + http["proxy_cpu_s"]) / http["calls"], direct["seconds"] / http["calls"]
        if path == "direct_burn_thread":
            stop = threading.Event()
            burner = threading.Thread(target=burn, args=(burst, period, stop.wait))
            burner.start()
            try:
                return self.direct_chained(workload, threads=False)
            finally:
                stop.set()
                burner.join()
        with subprocess.Popen([sys.executable, str(Path(__file__).with_name("proxy_agents.py")), "--burn", str(burst),
                               str(period)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as burner:
            if burner.stdout.readline() != "burning\n":
                raise RuntimeError("the burner process did not start")
            try:
                return self.direct_chained(workload, threads=False)
            finally:
                burner.stdin.close()

    def run(self) -> dict[str, list[dict]]:
        """Warm every path up, then `rounds` rounds of every path, alternating."""
        # The agents' side runs in a process of their own, as agents do in training: in this
        # process it would take the GIL from the engine's scheduler.
        self.client = subprocess.Popen([sys.executable, str(Path(__file__).with_name("proxy_agents.py"))], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        self.direct_lengths: dict[str, list[list[int]]] = {}
        self.last: dict[str, dict] = {}  # per path, its latest run
        names = ["direct", "direct_concurrent", *PROXY_PATHS, "stream",
                 *(f"{w}:{p}" for w in WORKLOADS for p in (*DIRECT_PATHS, *TURN_PATHS)),
                 *(f"steady:{p}" for p in BURN_PATHS)]
        with ProxyServer(self.tok, model_name="policy", coalesce_window_s=self.args.coalesce_ms / 1e3) as proxy:
            for name in names:  # the warm-up round (the direct paths first: the checks' prompt lengths)
                self.run_path(proxy, name)
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for _ in range(self.args.rounds):
                for name in names:
                    runs[name].append(self.run_path(proxy, name))
        self.client.stdin.close()
        self.client.wait(timeout=30)
        self.engine.shutdown()
        return runs


def where_the_time_goes(run: dict) -> dict[str, float]:
    """One single-turn proxy round's timeline, ms from the moment the agents start their calls:
    the last call to reach the engine, the last the engine finished, the last reply the agents had
    parsed, and the agents' CPU per call (request building, sending, reading, parsing)."""
    t0, ms = run["t0"], 1e3
    return {"last_at_engine": (max(a for a, _ in run["at_engine"]) - t0) * ms,
            "engine_done": (max(b for _, b in run["at_engine"]) - t0) * ms,
            "replies_parsed": (max(run["ends"]) - t0) * ms,
            "client_cpu_per_call": run["cpu_s"] / len(run["ends"]) * ms,
            "proxy_cpu_per_call": run["proxy_cpu_s"] / len(run["ends"]) * ms}


def between_turns(run: dict) -> dict[str, float]:
    """One multi-turn round's timeline: the whole round (ms), how long a session was away from
    the engine between two of its turns (the engine finishing one call to it receiving the next;
    through the proxy: its reply, the agent's parsing and next request, the proxy's intake; median
    over all sessions' turns), how many sessions the engine held on average (their time in it over
    the round's), its steps (scheduler iterations) and the time per step while it held any session
    (ms), and, through the proxy, the agents' and the proxy's CPU per call."""
    gaps = [log[t + 1][0] - log[t][1] for log in run["per_session"] for t in range(len(log) - 1)]
    in_engine = sum(b - a for a, b in run["at_engine"])
    busy, end = 0.0, 0.0  # how long the engine held at least one session
    for a, b in sorted(run["at_engine"]):
        busy, end = (busy + b - max(a, end), b) if b > end else (busy, end)
    out = {"round": run["seconds"] * 1e3, "between_turns": statistics.median(gaps) * 1e3 if gaps else 0.0,
           "mean_in_flight": in_engine / run["seconds"], "engine_steps": run["engine_steps"],
           "engine_step": busy * 1e3 / max(run["engine_steps"], 1)}
    if "cpu_s" in run:
        out.update(client_cpu_per_call=run["cpu_s"] / run["calls"] * 1e3,
                   proxy_cpu_per_call=run["proxy_cpu_s"] / run["calls"] * 1e3)
    return out


def medians(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over rounds."""
    return {key: statistics.median(p[key] for p in parts) for key in parts[0]}


class Rates:
    """Generated tokens/s per path and round, and the ratios of two paths."""

    def __init__(self, runs: dict[str, list[dict]]) -> None:
        self.rate = {name: [r["tokens"] / r["seconds"] for r in rs] for name, rs in runs.items() if name != "stream"}
        self.med = {name: statistics.median(x) for name, x in self.rate.items()}

    def ratios(self, name: str, direct: str) -> tuple[float, float]:
        """The ratio of the medians, and the paired ratio: each round's path over the same round's
        direct one, the median (a load change between rounds moves both sides of a round alike)."""
        return (round(self.med[name] / self.med[direct], 3),
                round(statistics.median(x / y for x, y in zip(self.rate[name], self.rate[direct])), 3))

    def per_round(self, name: str, label: str) -> None:
        print(f"  {label:<34} tokens/s per round: {', '.join(f'{x:.0f}' for x in self.rate[name])}")


def multi_turn_report(args: argparse.Namespace, workload: str, lengths: list[list[int]], runs: dict[str, list[dict]],
                      rates: Rates) -> dict:
    """One multi-turn workload's lines and JSON keys (unprefixed)."""
    flat = [n for s in lengths for n in s]
    title = "steady state" if workload == "steady" else "lockstep"
    print(f"multi-turn, {title}: {args.requests} sessions x {args.turns} turns, max_tokens "
          + (f"drawn from [{min(flat)}, {max(flat)}] (seed {args.seed})" if workload == "steady" else f"{flat[0]}")
          + f", {sum(flat)} tokens a round")
    paths = {**DIRECT_PATHS, **TURN_PATHS, **(BURN_PATHS if workload == "steady" else {})}
    for path, label in paths.items():
        rates.per_round(f"{workload}:{path}", label)
    direct = max(DIRECT_PATHS, key=lambda p: rates.med[f"{workload}:{p}"])
    parts = {path: medians([between_turns(r) for r in runs[f"{workload}:{path}"]]) for path in paths}
    print(f"  where the time goes (medians, ms); `direct` is {DIRECT_PATHS[direct]}")
    for path, label in paths.items():
        x = parts[path]
        print(f"    {label:<32} round {x['round']:6.1f}, a session away from the engine between turns "
              f"{x['between_turns']:5.2f}, sessions in the engine on average {x['mean_in_flight']:4.1f} of "
              f"{args.requests}, {x['engine_steps']:.0f} engine steps of {x['engine_step']:.2f}"
              + (f"; CPU per call: agents' {x['client_cpu_per_call']:.2f}, the proxy's "
                                    f"{x['proxy_cpu_per_call']:.2f}" if "client_cpu_per_call" in x else ""))
    (http, http_p), (sdk, sdk_p) = (rates.ratios(f"{workload}:{p}", f"{workload}:{direct}") for p in TURN_PATHS)
    return {"direct_path": direct, "direct_tokens_per_s": round(rates.med[f"{workload}:{direct}"], 1),
            **{f"{p}_tokens_per_s": round(rates.med[f"{workload}:{p}"], 1) for p in DIRECT_PATHS},
            "proxy_tokens_per_s": round(rates.med[f"{workload}:http-turns"], 1),
            "proxy_sdk_tokens_per_s": round(rates.med[f"{workload}:sdk-turns"], 1),
            "proxy_vs_direct_tokens_per_s_ratio": http, "proxy_sdk_vs_direct_ratio": sdk,
            "proxy_vs_direct_paired_ratio": http_p, "proxy_sdk_vs_direct_paired_ratio": sdk_p,
            "direct_ms": round(parts[direct]["round"], 1),
            **{f"{p}_{key}": v for p in (BURN_PATHS if workload == "steady" else ()) for key, v in
               zip(("tokens_per_s", "vs_direct_ratio"), (round(rates.med[f"{workload}:{p}"], 1),
                                                         rates.ratios(f"{workload}:{p}", f"{workload}:{direct}")[0]))},
            **{f"{path.replace('-', '_')}_{key}" + ("" if key in ("mean_in_flight", "engine_steps") else "_ms"): round(v, 2)
               for path, x in parts.items() for key, v in x.items() if key != "round" or path in TURN_PATHS}}


def single_turn_report(args: argparse.Namespace, runs: dict[str, list[dict]], rates: Rates) -> dict:
    """The single-turn burst's lines and JSON keys (unprefixed)."""
    print(f"single turn: {args.requests} calls at the same instant x {args.max_tokens} tokens")
    for name, label in (("direct", "direct (one submission)"), ("direct_concurrent", "direct (one per thread)"),
                        *PROXY_PATHS.items()):
        rates.per_round(name, label)
    streamed = runs["stream"]
    print("  proxy (streamed call)              first chunk / end, ms: "
          + ", ".join(f"{x['ttft_s'] * 1e3:.1f} / {x['completion_s'] * 1e3:.1f}" for x in streamed))
    direct_ms = statistics.median(r["seconds"] for r in runs["direct"]) * 1e3
    print(f"  where the time goes (medians, ms from the calls' start): direct, all done at {direct_ms:.1f}")
    steps = {mode: medians([where_the_time_goes(r) for r in runs[mode]]) for mode in PROXY_PATHS}
    for mode, label in PROXY_PATHS.items():
        x = steps[mode]
        print(f"    {label:<24} last call at the engine {x['last_at_engine']:5.1f}, engine done "
              f"{x['engine_done']:5.1f}, replies parsed {x['replies_parsed']:5.1f}; CPU per call: agents' "
              f"{x['client_cpu_per_call']:.2f}, the proxy's {x['proxy_cpu_per_call']:.2f}")
    single = {"direct_tokens_per_s": round(rates.med["direct"], 1),
              "direct_concurrent_tokens_per_s": round(rates.med["direct_concurrent"], 1),
              "proxy_tokens_per_s": round(rates.med["http"], 1), "proxy_sdk_tokens_per_s": round(rates.med["sdk"], 1),
              "direct_ms": round(direct_ms, 1)}
    for key, name, direct in (("proxy_vs_direct_tokens_per_s", "http", "direct"),
                              ("proxy_vs_direct_concurrent", "http", "direct_concurrent"),
                              ("proxy_sdk_vs_direct", "sdk", "direct"),
                              ("proxy_sdk_processes_vs_direct", "sdk-processes", "direct")):
        single[f"{key}_ratio"], single[f"{key.replace('_tokens_per_s', '')}_paired_ratio"] = rates.ratios(name, direct)
    single.update({f"{mode.replace('-', '_')}_{key}_ms": round(v, 2)
                   for mode, x in steps.items() for key, v in x.items()})
    return single


def report(args: argparse.Namespace, lengths: dict[str, list[list[int]]], runs: dict[str, list[dict]]) -> None:
    """The per-round lines, the breakdowns of where a round's time goes, and the JSON line."""
    rates = Rates(runs)
    multi = {w: multi_turn_report(args, w, lengths[w], runs, rates) for w in WORKLOADS}
    single = single_turn_report(args, runs, rates)
    streamed = runs["stream"]
    steady = [n for s in lengths["steady"] for n in s]
    print(json.dumps({
        "preset": args.preset, "requests": args.requests, "max_tokens": args.max_tokens, "turns": args.turns,
        "rounds": args.rounds, "seed": args.seed, "coalesce_ms": args.coalesce_ms,
        "turn_tokens_min": min(steady), "turn_tokens_max": max(steady), "tokens_per_round": sum(steady),
        **{f"{prefix}{key}": v for w, prefix in WORKLOADS.items() for key, v in multi[w].items()},
        **{f"single_turn_{key}": v for key, v in single.items()},
        "ttft_ms": round(statistics.median(x["ttft_s"] for x in streamed) * 1e3, 1),
        "completion_ms": round(statistics.median(x["completion_s"] for x in streamed) * 1e3, 1),
        # the proxy's CPU time per call (ProxyServer.cpu_seconds() over the calls of the steady
        # multi-turn HTTP rounds, median round) and the machine's load while it was measured
        "proxy_cpu_ms_per_call": multi["steady"]["http_turns_proxy_cpu_per_call_ms"],
        "load_average_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
