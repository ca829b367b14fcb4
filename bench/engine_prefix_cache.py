"""Embedded-engine rollout throughput with and without the prefix cache, side by side.

(1) Multi-turn episodes: `--episodes` episodes of `--turns` turns run together, turn by turn;
    the first prompt is the calculator task's rendered prompt with the tool schema (real
    tokenizer), each turn generates `--new-tokens` tokens (greedy, ignore_eos) and appends
    `--obs-tokens` environment tokens, and the next turn's prompt is the whole stream — the
    white-box agent loop's shape. Two engines on identical weights (`--preset`, random init),
    one with `prefix_cache=True`, one without, take turns (`--repeats` rounds, median). Reports
    generated tokens/s and whether every output token is equal between the two.
(2) The 300-turn test (tests/test_agents.py): the echo task's 300-turn episode through the real
    agent loop on micro-moe; seconds per turn in the first, middle and last 50 turns, cache vs
    no cache (no cache: each turn re-prefills the whole stream, so its time grows with the turn).

    python bench/engine_prefix_cache.py [--preset tiny-moe] [--episodes 16] [--turns 8] [--skip-300]

Last line: JSON with `prefix_cache_rollout_speedup` (case 1) and the per-turn figures of case 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from axrl.agents.tasks import get_task  # noqa: E402
from axrl.inference import EmbeddedEngine, GenerateRequest, GenerateResult, SamplingParams  # noqa: E402
from axrl.model import build_model, hf_state_dict, preset_config  # noqa: E402
from axrl.rollout.agent_loop import run_episode  # noqa: E402
from axrl.tokenizer import Tokenizer  # noqa: E402


def multi_turn(engine: EmbeddedEngine, prompts: list[list[int]], turns: int, new_tokens: int,
               obs_tokens: int) -> tuple[float, int, list[list[int]], int]:
    """(seconds, generated tokens, every output, cached prompt tokens) of one round of episodes."""
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    streams = [list(p) for p in prompts]
    outputs, generated, cached = [], 0, 0
    t0 = time.perf_counter()
    for turn in range(turns):
        results = engine.generate_batch([GenerateRequest(s, sp) for s in streams])
        for i, r in enumerate(results):
            obs = [(7 * turn + 13 * i + j) % 900 + 10 for j in range(obs_tokens)]  # a deterministic "env"
            streams[i] = streams[i] + r.output_ids + obs
            outputs.append(r.output_ids)
            generated += len(r.output_ids)
            cached += r.meta["cached_tokens"]
    return time.perf_counter() - t0, generated, outputs, cached


class TimedEngine:
    """An `InferenceEngine` that records when each `generate` call returns (one per turn)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.stamps = engine, [time.perf_counter()]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        res = await self.engine.generate(request)
        self.stamps.append(time.perf_counter())
        return res

    def submit_many(self, requests: Any) -> Any:
        return self.engine.submit_many(requests)

    def update_weights(self, source: Any, version: int | None = None) -> int:
        return self.engine.update_weights(source, version)

    def abort(self, rid: str) -> bool:
        return self.engine.abort(rid)

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def shutdown(self) -> None:
        self.engine.shutdown()


def three_hundred_turns(tok: Tokenizer, cache: bool) -> list[float]:
    """Seconds of each turn of tests/test_agents.py's 300-turn episode."""
    task = get_task("echo", turns=300)
    prompt = task.prompt(0, 0)
    with EmbeddedEngine(build_model(preset_config("micro-moe"), seed=0), max_batch_size=8, max_seq_len=8192,
                        eos_token_id=tok.eos_token_id, prefix_cache=cache) as eng:
        timed = TimedEngine(eng)
        traj = asyncio.run(run_episode(timed, tok, task.make_env(), prompt, sample_id=0, group_id=0,
                                       sampling=SamplingParams(max_new_tokens=1, seed=1), max_turns=310,
                                       max_context_len=8192, return_routing=True))
    assert traj.num_turns == 300, traj.num_turns
    return [b - a for a, b in zip(timed.stamps, timed.stamps[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--obs-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-300", action="store_true", help="skip case 2 (its no-cache run takes ~45 s)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.default()
    task = get_task("calculator", show_tool_schema=True)
    prompts = []
    for i in range(args.episodes):
        env = task.make_env()
        prompts.append(tok.apply_chat_template(env.reset(task.prompt(0, i)), tools=env.tools, add_generation_prompt=True))
    cfg = preset_config(args.preset, vocab_size=tok.vocab_size)
    max_len = max(map(len, prompts)) + args.turns * (args.new_tokens + args.obs_tokens) + 8
    engines = {c: EmbeddedEngine(build_model(cfg, seed=0), max_batch_size=args.episodes, max_seq_len=max_len,
                                 prefix_cache=c) for c in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list[list[int]]] = {}
    cached_tokens = 0
    for _ in range(args.repeats):
        for c, eng in engines.items():
            # A fresh episode set each round: clear what the previous round cached (same weights).
            eng.update_weights(_weights(eng))
            seconds, generated, outs, cached = multi_turn(eng, prompts, args.turns, args.new_tokens, args.obs_tokens)
            times[c].append(generated / seconds)
            outputs[c] = outs
            if c:
                cached_tokens = cached
    for eng in engines.values():
        eng.shutdown()
    plain, cached_tps = statistics.median(times[False]), statistics.median(times[True])
    same = sum(a == b for a, b in zip(outputs[False], outputs[True])) / len(outputs[False])
    print(f"multi-turn: {args.episodes} episodes x {args.turns} turns, first prompt {len(prompts[0])} tokens "
          f"(calculator + tool schema), {args.new_tokens} new + {args.obs_tokens} env tokens a turn")
    print(f"  rollout tokens/s: no cache {plain:.0f}, prefix cache {cached_tps:.0f} ({cached_tps / plain:.2f}x); "
          f"prompt tokens served from the cache per round {cached_tokens}; identical outputs {same:.0%}")
    result: dict[str, Any] = {"prefix_cache_rollout_speedup": round(cached_tps / plain, 2),
                              "tokens_per_s_no_cache": round(plain), "tokens_per_s_prefix_cache": round(cached_tps),
                              "identical_output_fraction": same}
    if not args.skip_300:
        windows = {"first50": slice(0, 50), "middle50": slice(125, 175), "last50": slice(250, 300)}
        for c in (True, False):
            per_turn = three_hundred_turns(tok, c)
            name = "prefix_cache" if c else "no_cache"
            ms = {w: statistics.mean(per_turn[s]) * 1e3 for w, s in windows.items()}
            print(f"  300-turn episode, {name}: total {sum(per_turn):.1f} s; ms per turn "
                  + ", ".join(f"{w} {v:.1f}" for w, v in ms.items()))
            result[f"turns300_{name}_total_s"] = round(sum(per_turn), 2)
            result.update({f"turns300_{name}_ms_per_turn_{w}": round(v, 2) for w, v in ms.items()})
    print(json.dumps(result))


def _weights(eng: EmbeddedEngine) -> dict[str, torch.Tensor]:
    """The engine's own weights (re-loading them clears the prefix cache: a fresh round)."""
    return {k: v.clone() for k, v in hf_state_dict(eng.model).items()}


if __name__ == "__main__":
    main()
