"""RolloutWorker: a long-lived producer that keeps the engine busy and the pool filled.

It runs in its own thread with its own event loop, from the start of training to the end,
and owns: which prompt starts next (admission, under the schedule's capacity rule), the episodes
in flight (an `EpisodeRunner`), when new weights reach the engine and what happens then to
episodes in flight (`rollout.partial_rollout`), and which complete groups form batch w
(sealing, with stale groups dropped or re-run). The trainer only ever calls `pool.take(w)`.

Identity: the prompt at stream position p is group p; its samples are p · G + j (G =
`rollout.group_size`), each seeded from (run seed, sample id). A group keeps its identity when
it is re-run (stale) or restarted after `--resume`, so ids stay unique and reruns reproducible.

Partial rollout, at a weight update, for episodes still running:
* continue — keep decoding under the new weights; each token records its own version;
* recompute — abort the requests in flight and resume each turn from a re-prefill under the new
  weights (`axrl.rollout.episode_engine`);
* drop — abort them and drop their groups (recorded; the prompts are not retried).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from axrl.agents.env import Env
from axrl.core.trajectory import Trajectory
from axrl.data import PromptLoader
from axrl.inference.protocol import InferenceEngine
from axrl.rollout.pool import Group, GroupFate, TrajectoryPool
from axrl.rollout.runner import Clock, EpisodeRunner, EpisodeSpec, Player, RolloutSettings, sample_seed
from axrl.rollout.schedule import Schedule
from axrl.sync import WeightSync
from axrl.sync.verify import SyncSentinel
from axrl.tokenizer import Tokenizer

PartialRollout = Literal["continue", "recompute", "drop"]
StalePolicy = Literal["drop", "rerun"]


@dataclass
class _GroupLife:
    reruns: int = 0
    fate: tuple[str, int] | None = None   # ("sealed" | "dropped", batch index)


@dataclass
class RolloutCounters:
    """Totals since the worker started (reported per step as deltas)."""

    groups_started: int = 0
    reruns: int = 0
    dropped: int = 0
    interrupted_requests: int = 0
    weight_updates: int = 0
    memory_releases: int = 0


@dataclass
class RolloutPolicy:
    """What the worker does with episodes caught by a weight update or by the staleness bound."""

    partial_rollout: PartialRollout = "continue"
    stale_policy: StalePolicy = "rerun"
    max_reruns: int = 2
    max_live_episodes: int = 64
    release_memory: bool = False   # free the engine's KV cache while it waits for new weights (sync)


class RolloutWorker:
    def __init__(self, engine: InferenceEngine, tokenizer: Tokenizer, make_env: Callable[[], Env],
                 loader: PromptLoader, settings: RolloutSettings, schedule: Schedule, policy: RolloutPolicy,
                 sync: WeightSync, pool: TrajectoryPool, *, clock: Clock, seed: int, threads: int = 1,
                 player: Player | None = None) -> None:
        self.engine, self.tokenizer, self.make_env, self.loader, self.clock = engine, tokenizer, make_env, loader, clock
        self.settings, self.schedule, self.policy, self.sync, self.pool = settings, schedule, policy, sync, pool
        self.seed, self.threads, self.player = seed, threads, player
        self.counters = RolloutCounters()
        self._lock = threading.Lock()          # guards what `snapshot` reads
        self._groups: dict[int, _GroupLife] = {}
        self._open: set[int] = set()           # started (or queued to restart), not sealed or dropped
        self._queue: deque[int] = deque()      # to (re)start before new prompts
        self._dropping: dict[int, int] = {}    # partial-dropped group -> its episodes still finishing
        self._next_position = 0
        self._next_batch = 0
        self._sealed = 0                       # groups sealed into batches, ever (resumes count earlier steps)
        self._events_dropped: list[GroupFate] = []
        self._events_reruns: list[int] = []
        self._engine_version = engine.weight_version
        self._memory_released = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: EpisodeRunner | None = None
        # Verifies the engine after every load, before it serves a token under the new version
        # (`sync.verify`; set by the run's builder, None: not verified).
        self.sentinel: SyncSentinel | None = None

    # -- lifecycle (trainer thread) --------------------------------------------------------------
    def start(self, first_step: int, state: dict[str, Any] | None = None) -> None:
        """Start producing batches `first_step`, `first_step + 1`, …; `state` is a `snapshot`
        from a checkpoint (its pending groups restart first, under their own identities)."""
        self._next_batch = first_step
        self._sealed = first_step * self.schedule.groups_per_step
        self._engine_version = self.engine.weight_version
        if state:
            self._next_position = int(state["next_position"])
            reruns = {int(k): int(v) for k, v in state.get("reruns", {}).items()}
            for gid in sorted(int(g) for g in state["pending"]):
                self._groups[gid] = _GroupLife(reruns=reruns.get(gid, 0))
                self._open.add(gid)
                self._queue.append(gid)
        else:
            self._next_position = first_step * self.schedule.groups_per_step
        self._thread = threading.Thread(target=self._thread_main, name="axrl-rollout", daemon=True)
        self._thread.start()

    def load_weights(self, source: Any, version: int) -> None:
        """Load weights `version` into the engine before `start` (the run's first, or a resumed,
        policy), then verify them (`sentinel`): a resume is checked like any sync."""
        self.engine.update_weights(source, version=version)
        self._verify(source, version, "resume" if version > 0 else "start")

    def _verify(self, weights: Any, version: int, reason: str) -> None:
        """The sentinel's check of the load just made; it blocks this thread, so no request is
        admitted under `version` before it is done (`sync.on_failure: stop` raises from here)."""
        if self.sentinel is not None:
            self.sentinel.verify(weights, version, reason=reason,
                                 resend=lambda: self.engine.update_weights(weights, version=version))

    def stop(self) -> None:
        """Stop producing; episodes in flight are cancelled (the caller shuts the engine down)."""
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def snapshot(self, next_step: int) -> dict[str, Any]:
        """The rollout state a checkpoint taken before `next_step` needs: every group started but
        not trained (or dropped) in a step before `next_step` is pending and restarts on resume."""
        with self._lock:
            pending = sorted(g for g, life in self._groups.items()
                             if life.fate is None or life.fate[1] >= next_step)
            return {"next_position": self._next_position, "pending": pending,
                    "reruns": {str(g): self._groups[g].reruns for g in pending if self._groups[g].reruns}}

    # -- the worker thread -----------------------------------------------------------------------
    def _thread_main(self) -> None:
        torch.set_num_threads(self.threads)  # OpenMP thread counts are per thread
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 — hand it to the trainer waiting in take()
            self.pool.fail(e)

    def _wake(self) -> None:
        loop, runner = self._loop, self._runner
        if loop is not None and runner is not None and not loop.is_closed():
            loop.call_soon_threadsafe(runner.wake.set)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        runner = self._runner = EpisodeRunner(self.engine, self.tokenizer, self.make_env, self.settings,
                                              clock=self.clock,
                                              on_done=self._on_done, player=self.player)
        self.sync.subscribe(self._wake)
        try:
            while not self._stop:
                changed = True
                while changed and not self._stop:  # a fixed point of weights / admission / sealing
                    changed = self._apply_posted() if not self.schedule.sync_at_seal else False
                    changed |= self._admit()
                    await runner.settle()
                    changed |= await self._seal()
                if runner.failure is not None:
                    raise runner.failure
                if self.policy.release_memory and not runner.live and not self._queue and not self._memory_released:
                    # Nothing to run until new weights arrive (sync): the colocated trainer gets the memory.
                    self.engine.release_memory()
                    self._memory_released = True
                    self.counters.memory_releases += 1
                if not self._stop:
                    await runner.advance()
        finally:
            await runner.cancel_all()

    # -- admission --------------------------------------------------------------------------------
    def _admit(self) -> bool:
        runner, G = self._runner, self.settings.group_size
        started = False
        while len(runner.live) + G <= max(self.policy.max_live_episodes, G):
            if self._queue:
                gid = self._queue.popleft()
            elif self._sealed + len(self._open) < self.schedule.capacity(self._engine_version):
                gid = self._next_position
                with self._lock:
                    self._next_position += 1
                    self._groups[gid] = _GroupLife()
                    self._open.add(gid)
            else:
                break
            prompt = self.loader.prompt_at(gid)
            for j in range(G):
                sid = gid * G + j
                runner.launch(EpisodeSpec(sid, gid, prompt, sample_seed(self.seed, sid)))
            self.counters.groups_started += 1
            started = True
        return started

    def _on_done(self, spec: EpisodeSpec, traj: Trajectory) -> None:
        if self.sentinel is not None:  # the run's first samples become the sentinel's probe set
            self.sentinel.observe(traj.token_ids, ok=traj.status == "ok")
        left = self._dropping.get(spec.group_id)
        if left is not None:  # its group was dropped while it ran
            if left == 1:
                del self._dropping[spec.group_id]
            else:
                self._dropping[spec.group_id] = left - 1
            return
        self.pool.add(traj)

    # -- sealing ----------------------------------------------------------------------------------
    async def _seal(self) -> bool:
        sealed_any = False
        while not self._stop:
            w = self._next_batch
            batch, stale = self.pool.seal(w, self.schedule.groups_per_step,
                                          lambda g: self.schedule.fresh(g.min_version, w))
            for group in stale:
                self._stale(group)
            if batch is None:
                return sealed_any
            if self.schedule.sync_at_seal and self._engine_version < w:
                # The engine waits here until the trainer has finished step w - 1.
                await self.sync.wait_for(w, stop=lambda: self._stop)
                if self._stop:
                    return sealed_any
                self._apply_posted()
            batch.dropped, batch.reruns = self._events_dropped, self._events_reruns
            self._events_dropped, self._events_reruns = [], []
            with self._lock:
                for gid in batch.group_ids:
                    if gid in self._groups:  # not a group pushed by the agent service (no prompt position)
                        self._groups[gid].fate = ("sealed", w)
                    self._open.discard(gid)
                self._sealed += self.schedule.groups_per_step
                self._next_batch += 1
            self.pool.publish(batch)
            sealed_any = True
            if self.schedule.drains_before(w + 1):
                # A drain point: nothing is in flight (capacity stopped at batch w); take version
                # w + 1 once step w is trained, so every group of batch w + 1 starts under it.
                await self.sync.wait_for(w + 1, stop=lambda: self._stop)
                if self._stop:
                    return sealed_any
                self._apply_posted()
        return sealed_any

    def _stale(self, group: Group) -> None:
        life = self._groups.get(group.group_id)
        if life is None:  # pushed by the agent service: there is nothing to re-run, it is dropped
            self.counters.dropped += 1
            mv = group.min_version
            self._events_dropped.append(GroupFate(group.group_id, "stale", -1 if mv is None else mv))
            return
        if self.policy.stale_policy == "rerun" and life.reruns < self.policy.max_reruns:
            life.reruns += 1
            self.counters.reruns += 1
            self._events_reruns.append(group.group_id)
            self._queue.append(group.group_id)
            return
        reason = "stale" if self.policy.stale_policy == "drop" else "max_reruns"
        mv = group.min_version
        self._drop(group.group_id, GroupFate(group.group_id, reason, -1 if mv is None else mv))

    def _drop(self, gid: int, fate: GroupFate) -> None:
        self.counters.dropped += 1
        self._events_dropped.append(fate)
        with self._lock:
            self._groups[gid].fate = ("dropped", self._next_batch)
            self._open.discard(gid)

    # -- weights ----------------------------------------------------------------------------------
    def _apply_posted(self) -> bool:
        """Load the newest posted weights into the engine if they are newer than its own."""
        version, weights = self.sync.get()
        if weights is None or version <= self._engine_version:
            return False
        runner = self._runner
        if self.policy.partial_rollout == "recompute":
            self.counters.interrupted_requests += runner.interrupt(resume=True)
        elif self.policy.partial_rollout == "drop":
            live_groups = {sid // self.settings.group_size for sid in runner.live}
            for gid in sorted(live_groups):
                self._dropping[gid] = sum(1 for sid in runner.live if sid // self.settings.group_size == gid)
                self.pool.discard(gid)
                self._drop(gid, GroupFate(gid, "partial_drop", -1))
            self.counters.interrupted_requests += runner.interrupt(set(runner.live), resume=False)
        if self._memory_released:
            self.engine.resume_memory()
            self._memory_released = False
        self.engine.update_weights(weights, version=version)
        self._verify(weights, version, "sync")
        self._engine_version = version
        self.counters.weight_updates += 1
        return True
