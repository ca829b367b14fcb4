"""EpisodeRunner: many agent episodes in flight on one engine, on one event loop.

The runner knows episodes, not steps: it launches them, advances the engine — one settled,
deterministic iteration at a time on a clocked engine (`axrl.rollout.clock`), or by simply
waiting while a free-running engine works — and hands every finished trajectory to a callback.
The rollout worker (admission, staleness, weight updates) and the evaluator build on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Callable, Literal, Protocol

from axrl.agents.env import Env, Prompt
from axrl.core.trajectory import Trajectory
from axrl.inference.protocol import InferenceEngine, SamplingParams
from axrl.rollout.agent_loop import run_episode
from axrl.rollout.clock import EngineClock
from axrl.rollout.episode_engine import EpisodeEngine
from axrl.tokenizer import Tokenizer


def sample_seed(seed: int, sample_id: int) -> int:
    """A sampling seed that depends only on (run seed, sample id): a sample draws the same tokens
    whichever step trains it and however the engine happened to batch it."""
    digest = hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class RolloutSettings:
    group_size: int
    sampling: SamplingParams
    max_turns: int
    max_context_len: int
    return_routing: bool


@dataclass(frozen=True)
class EpisodeSpec:
    """What identifies an episode: its ids, its prompt and the seed its sampling derives from."""

    sample_id: int
    group_id: int
    prompt: Prompt
    seed: int


class Player(Protocol):
    """Plays one episode some other way than the white-box agent loop (a black-box agent,
    `axrl.rollout.blackbox`), generating through the episode's engine handle."""

    async def play(self, engine: InferenceEngine, *, sample_id: int, group_id: int, prompt: Prompt,
                   sampling: SamplingParams, return_routing: bool) -> Trajectory:
        ...


# How a rollout is scheduled (axrl.rollout.clock): engine iterations (a ClockedEngine built
# clocked), request rounds (any engine), or free-running (the engine's own thread and timing).
Clock = Literal["iterations", "rounds", "free"]


class EpisodeRunner:
    """Runs episodes of `make_env()` on `engine`; `on_done(spec, trajectory)` gets each result.

    With `clock` "iterations" (a clocked engine) or "rounds" the runner owns the engine's
    progress (`advance`, see `axrl.rollout.clock`), and everything it produces is a function of
    what was launched when; "free" lets the engine schedule on its own.
    """

    def __init__(self, engine: InferenceEngine, tokenizer: Tokenizer, make_env: Callable[[], Env],
                 settings: RolloutSettings, *, clock: Clock,
                 on_done: Callable[[EpisodeSpec, Trajectory], None], player: Player | None = None) -> None:
        self.engine, self.tokenizer, self.make_env, self.settings = engine, tokenizer, make_env, settings
        self.player = player
        self.clock = None if clock == "free" else EngineClock(engine, rounds=clock == "rounds")
        self.on_done = on_done
        self.live: dict[int, asyncio.Task] = {}          # sample_id -> its episode task
        self.inflight: dict[str, EpisodeEngine] = {}     # rid -> the episode whose request it is
        self.interrupted: set[str] = set()               # rids aborted for a weight update (resumed)
        self.wake = asyncio.Event()                      # set when an episode finishes (free-running)
        self.continuations = 0
        self.failure: BaseException | None = None        # an engine error that ended an episode

    def launch(self, spec: EpisodeSpec) -> None:
        """Start an episode (call from the runner's event loop)."""
        if spec.sample_id in self.live:
            raise ValueError(f"sample {spec.sample_id} is already running")
        submit = ((lambda req, key=spec.sample_id: self.clock.generate(key, req)) if self.clock is not None
                  else self.engine.generate)
        handle = EpisodeEngine(spec.sample_id, submit, self.interrupted, self.inflight)
        if self.clock is not None:
            self.clock.started()
        self.live[spec.sample_id] = asyncio.get_running_loop().create_task(self._episode(spec, handle))

    async def _episode(self, spec: EpisodeSpec, handle: EpisodeEngine) -> None:
        s = self.settings
        sampling = dataclasses.replace(s.sampling, seed=spec.seed)
        try:
            if self.player is not None:
                traj = await self.player.play(handle, sample_id=spec.sample_id, group_id=spec.group_id,
                                              prompt=spec.prompt, sampling=sampling,
                                              return_routing=s.return_routing)
            else:
                traj = await run_episode(
                    handle, self.tokenizer, self.make_env(), spec.prompt, sample_id=spec.sample_id,
                    group_id=spec.group_id, sampling=sampling, max_turns=s.max_turns,
                    max_context_len=s.max_context_len, return_routing=s.return_routing)
        except Exception as e:  # env errors never get here (run_episode records them); engine errors do
            self.failure = self.failure or e
            raise
        finally:
            self.live.pop(spec.sample_id, None)
            self.continuations += handle.continuations
            if self.clock is not None:
                self.clock.finished()
            self.wake.set()
        self.on_done(spec, traj)

    def interrupt(self, sample_ids: set[int] | None = None, *, resume: bool) -> int:
        """Abort the requests in flight (of `sample_ids`, default all); with `resume` each episode
        continues its turn under the engine's new weights, else it ends with finish reason
        "abort". Returns the number of requests aborted."""
        hit = [rid for rid, handle in self.inflight.items() if sample_ids is None or handle.sample_id in sample_ids]
        for rid in hit:
            if resume:
                self.interrupted.add(rid)
            self.engine.abort(rid)
        return len(hit)

    async def advance(self) -> None:
        """Make progress: one engine iteration (clocked, once every episode has settled), or wait
        until an episode finishes or `wake` is set from outside (free-running)."""
        if self.clock is not None:
            await self.clock.settle()
            if not self.clock.idle:
                self.clock.flush()
                await self.clock.tick()
                return
        await self.wake.wait()
        self.wake.clear()

    async def settle(self) -> None:
        """Clocked: wait until every episode is waiting on the engine or done (no-op otherwise)."""
        if self.clock is not None:
            await self.clock.settle()

    @property
    def idle(self) -> bool:
        """No episode running."""
        return not self.live

    async def cancel_all(self) -> None:
        for task in list(self.live.values()):
            task.cancel()
        await asyncio.gather(*self.live.values(), return_exceptions=True)


async def run_all(runner: EpisodeRunner, specs: list[EpisodeSpec]) -> None:
    """Launch every episode and drive them to the end (a fixed batch: eval, tests)."""
    for spec in specs:
        runner.launch(spec)
    while not runner.idle:
        await runner.advance()
        if runner.failure is not None:
            await runner.cancel_all()
            raise runner.failure
