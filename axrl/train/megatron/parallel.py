"""Where the ranks live: in the driver process (world size 1) or in worker processes that the
backend spawns itself (world size TP × DP > 1, gloo over localhost; NCCL on GPUs).

Both are a `RankGroup`: `call(MegatronRank.method, *args) -> [result of rank 0, rank 1, …]` runs
the same `MegatronRank` method on every rank (collectives inside need all of them), in lockstep;
`call_each` does the same with a first argument per rank (each rank's own share of a batch). A
call is typed (`rank_calls.py`): the method itself, its arguments bound against its signature in
the driver before anything is sent, and resolved on the rank from the registry of its methods.
Workers get batches and return results through pipes; an exception in any worker is re-raised in
the driver with the worker's traceback, and every wait has a timeout so a wedged collective cannot
hang the caller. Under `runtime.executor: ray` the ranks are Ray actors
(`axrl/ray_executor/megatron_ranks.py`), behind the same protocol.
"""

from __future__ import annotations

import os
import pickle
import secrets
import subprocess
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Client, Listener, wait
from typing import Any, Callable, Protocol

from axrl.model import ModelConfig
from axrl.train.megatron.model import ParallelSizes
from axrl.train.megatron.rank_calls import RankCall

#: seconds to wait for a rank's answer (start-up imports megatron-core: several seconds).
CALL_TIMEOUT_S = float(os.environ.get("AXRL_MEGATRON_TIMEOUT", "600"))


class RankGroup(Protocol):
    """The backend's ranks, wherever they live."""

    world_size: int

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Every rank runs the `MegatronRank` method `fn(rank, *args, **kwargs)` (checked here,
        `RankCall.of`); their answers in rank order."""
        ...

    def call_each(self, fn: Callable[..., Any], firsts: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Rank r runs `fn(rank, firsts[r], *args, **kwargs)`: each is sent only its own first argument."""
        ...

    def close(self) -> None:
        ...


_in_process_users = 0  # live InProcessGroups: the last one to close tears the process group down


class InProcessGroup:
    """World size 1: the single rank in this process. The gloo world-1 process group and
    Megatron's parallel state are process-global; they are destroyed when the last in-process
    backend closes, so the process (e.g. a test session) can use torch.distributed afterwards."""

    def __init__(self, model_cfg: ModelConfig, sizes: ParallelSizes, dispatcher: str, weights: dict[str, Any],
                 seed: int, num_threads: int) -> None:
        global _in_process_users
        from axrl.train.megatron.rank import MegatronRank, free_port, init_distributed

        init_distributed(0, 1, free_port(), sizes, seed)
        _in_process_users += 1
        self._open = True
        try:
            self.rank = MegatronRank(model_cfg, sizes, dispatcher, weights)
        except BaseException:
            self.close()
            raise
        self.world_size = 1

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self._run(RankCall.of(fn, *args, **kwargs))

    def call_each(self, fn: Callable[..., Any], firsts: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self._run(RankCall.each(fn, firsts[0], *args, **kwargs), firsts[0])

    def _run(self, call: RankCall, *first: Any) -> list[Any]:
        if not self._open:
            raise RuntimeError("the Megatron backend is closed")
        return [call.run(self.rank, *first)]

    def close(self) -> None:
        global _in_process_users
        if not self._open:
            return
        self._open = False
        rank = getattr(self, "rank", None)
        if rank is not None:
            rank.release()
        _in_process_users -= 1
        if _in_process_users == 0:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()


def _send(conn: Any, obj: Any) -> None:
    # Plain pickle bytes: Connection.send would use torch's shared-memory reductions, whose fd
    # passing needs both processes to share multiprocessing's authkey. Copies are cheap here.
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())


def _serve(conn: Any) -> None:
    """Worker process main loop: receive the init tuple, build the rank, then serve
    ("call", RankCall, firsts) messages until ("close",) or until the driver disappears."""
    rank, world, port, model_cfg, sizes, dispatcher, weights, seed, num_threads = _recv(conn)
    try:
        from axrl.train.megatron.rank import MegatronRank, init_distributed, worker_setup

        worker_setup(seed, num_threads)
        init_distributed(rank, world, port, sizes, seed)
        state = MegatronRank(model_cfg, sizes, dispatcher, weights)
        _send(conn, ("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises
        _send(conn, ("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = _recv(conn)
        except (EOFError, OSError):
            return  # driver gone
        if msg[0] == "close":
            break
        try:
            _send(conn, ("ok", msg[1].run(state, *msg[2])))
        except BaseException:  # noqa: BLE001
            _send(conn, ("error", traceback.format_exc()))
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


class WorkerGroup:
    """`sizes.world_size` worker processes, one rank each.

    Workers are fresh interpreters (`python -m axrl.train.megatron.parallel`), not
    multiprocessing children: a spawned child re-imports the caller's `__main__`, which breaks
    scripts without a main guard. Each connects back over an authenticated localhost socket.
    """

    def __init__(self, model_cfg: ModelConfig, sizes: ParallelSizes, dispatcher: str, weights: dict[str, Any],
                 seed: int, num_threads: int) -> None:
        from axrl.train.megatron.rank import free_port

        self.world_size = sizes.world_size
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = {**os.environ, "AXRL_MEGATRON_ADDR": f"{listener.address[0]}:{listener.address[1]}",
               "AXRL_MEGATRON_KEY": authkey.hex(), "OMP_NUM_THREADS": str(num_threads or 1),
               "PYTHONWARNINGS": "ignore"}
        self.procs = [subprocess.Popen([sys.executable, "-m", "axrl.train.megatron.parallel"], env=env)
                      for _ in range(self.world_size)]
        self.conns: list[Any] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, WorkerGroup._shutdown, self.conns, self.procs)
        try:
            port = free_port()
            listener._listener._socket.settimeout(CALL_TIMEOUT_S)  # accept() must not wait forever
            for r in range(self.world_size):
                try:
                    conn = listener.accept()
                except OSError as e:
                    raise TimeoutError(f"Megatron worker {r} did not connect within {CALL_TIMEOUT_S:.0f} s ({e})") from None
                self.conns.append(conn)
                _send(conn, (r, self.world_size, port, model_cfg, sizes, dispatcher, weights, seed, num_threads or 1))
            self._collect("start-up")
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _collect(self, what: str) -> list[Any]:
        """Every rank's answer, waiting on all at once: a rank that fails stops the group at
        once, even while the others sit in a collective waiting for it."""
        results: dict[int, Any] = {}
        deadline = time.monotonic() + CALL_TIMEOUT_S
        pending = {conn: r for r, conn in enumerate(self.conns)}
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                raise TimeoutError(f"Megatron rank(s) {sorted(pending.values())} gave no answer to {what} within "
                                   f"{CALL_TIMEOUT_S:.0f} s (set AXRL_MEGATRON_TIMEOUT to wait longer); workers stopped")
            for conn in ready:
                r = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    status, value = _recv(conn)
                except (EOFError, OSError):
                    self.close()
                    raise RuntimeError(f"Megatron rank {r} died during {what}; workers stopped") from None
                if status == "error":
                    self.close()
                    raise RuntimeError(f"Megatron rank {r} failed in {what}; workers stopped:\n{value}")
                results[r] = value
        return [results[r] for r in range(len(self.conns))]

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self._run(RankCall.of(fn, *args, **kwargs), [()] * len(self.conns))

    def call_each(self, fn: Callable[..., Any], firsts: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self._run(RankCall.each(fn, firsts[0], *args, **kwargs), [(first,) for first in firsts])

    def _run(self, call: RankCall, firsts: list[tuple[Any, ...]]) -> list[Any]:
        if self._closed:
            raise RuntimeError("the Megatron backend's workers are closed")
        for conn, first in zip(self.conns, firsts):
            _send(conn, ("call", call, first))
        return self._collect(call.name)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()

    @staticmethod
    def _shutdown(conns: list[Any], procs: list[subprocess.Popen]) -> None:
        for conn in conns:
            try:
                _send(conn, ("close",))
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for conn in conns:
            conn.close()


if __name__ == "__main__":
    host, _, port_s = os.environ["AXRL_MEGATRON_ADDR"].rpartition(":")
    _serve(Client((host, int(port_s)), authkey=bytes.fromhex(os.environ["AXRL_MEGATRON_KEY"])))
