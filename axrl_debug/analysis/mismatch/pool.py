"""The worker pool of ``mismatch_report``: forked copies of the process analyse contiguous groups
of step files and send back their accumulators, then only the |Δ| values the exact percentiles
need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .accumulator import MismatchAccumulator, _read_steps
from .config import MismatchConfig
from .percentiles import _values_in_bins


def _analyse_steps(run: str, steps: list[int], cfg: MismatchConfig) -> tuple["MismatchAccumulator", list[tuple[str, str]]]:
    """Analyse ``steps`` of ``run`` (already validated by the parent) with a fresh reader."""
    from axrl.trace import TraceReader

    reader = TraceReader(run, validate=False)
    acc = _read_steps(reader, steps, cfg)
    return acc, [(str(p.path), p.message) for p in reader.problems]


def _worker(channel: "_Forked", run: str, steps: list[int], cfg: MismatchConfig) -> None:
    """Worker process body: send the accumulator of ``steps`` without its |Δ| values (only their
    histogram), then, asked for the histogram bins that the exact percentiles need, the values in
    those bins — a few thousand numbers instead of 4 bytes per analysed token. With plots on
    (``plot_points``) the values travel with the accumulator (the |Δ| histogram plot needs them)."""
    acc, problems = _analyse_steps(run, steps, cfg)
    acc._flush()
    keep = cfg.keep_abs and cfg.plot_points == 0 and bool(acc.abs_parts)
    parts = acc.abs_parts
    if keep:
        acc._abs_elsewhere = sum(p.size for p in parts)
        acc.abs_parts, acc._hist_done = [], 0
    channel.send((acc, problems))
    bins = channel.recv() if keep else None
    if bins is not None:
        channel.send(dict(zip(bins, ([v] for v in _values_in_bins(parts, bins)))))


def auto_workers(paths: list[Any], *, min_bytes_per_worker: int = 48 << 20) -> int:
    """Processes worth using: one per ~48 MB of step files, at most one per usable CPU. Reading
    and analysing 48 MB of step files (~1.4 M tokens) takes ~0.1 s of one core; another process
    costs a fork, its own first-touch memory and a merge (~10–30 ms), so smaller selections stay
    in one process. (On a machine whose other cores are busy a second process buys nothing.)"""
    import os

    total = sum(p.stat().st_size for p in paths)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, len(paths), total // min_bytes_per_worker))


def _partition(steps: list[int], sizes: list[int], parts: int) -> list[list[int]]:
    """Contiguous groups of steps with roughly equal bytes."""
    total = float(sum(sizes)) or 1.0
    groups: list[list[int]] = [[] for _ in range(parts)]
    before = 0
    for step, size in zip(steps, sizes):
        groups[min(parts - 1, int(parts * (before + size / 2) / total))].append(step)
        before += size
    return [g for g in groups if g]


class _Forked:
    """``fn(channel, *args)`` run in a forked copy of this process, with a pickle channel each way
    (``send`` / ``recv``). A bare fork and two pipes: the child inherits the imported modules; no
    pool, queues or management thread to start and tear down. An exception in the child is sent
    back and raised by the parent's next ``recv``."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        import os

        up_r, up_w = os.pipe()                             # child -> parent
        down_r, down_w = os.pipe()                         # parent -> child
        self._pid = os.fork()
        if self._pid == 0:                                 # pragma: no cover - child process
            code = 0
            try:
                os.close(up_r)
                os.close(down_w)
                self._in, self._out = os.fdopen(down_r, "rb"), os.fdopen(up_w, "wb")
                try:
                    fn(self, *args)
                except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
                    self.send(_Failure(e))
                self._out.close()
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        os.close(up_w)
        os.close(down_r)
        self._in, self._out = os.fdopen(up_r, "rb"), os.fdopen(down_w, "wb")

    def send(self, obj: Any) -> None:
        import pickle

        pickle.dump(obj, self._out, protocol=pickle.HIGHEST_PROTOCOL)
        self._out.flush()

    def recv(self) -> Any:
        import pickle

        try:
            obj = pickle.load(self._in)
        except EOFError:
            raise RuntimeError("an analysis worker process died without a result") from None
        if isinstance(obj, _Failure):
            raise obj.error
        return obj

    def close(self) -> None:
        """Reap the child (killing it if it is still running: the caller is done or failing)."""
        import os
        import signal

        if self._pid:
            for fh in (self._in, self._out):
                try:
                    fh.close()
                except OSError:
                    pass
            try:
                if os.waitpid(self._pid, os.WNOHANG) == (0, 0):
                    os.kill(self._pid, signal.SIGKILL)
                    os.waitpid(self._pid, 0)
            except OSError:
                pass
            self._pid = 0


@dataclass
class _Failure:
    error: BaseException
