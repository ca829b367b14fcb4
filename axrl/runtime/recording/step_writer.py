"""Step files written off the training step's critical path.

The learner builds a step's `StepRecord` (numpy arrays it owns from then on) and hands it to a
`StepWriter`; a background thread writes it (`RunDir.write_step`: temp file, fsync, rename), so
the next step starts while HDF5 compresses and the disk syncs. The queue is bounded
(`trace.write_queue` steps): when it is full the step waits, and says how long in its metrics
(`time_record_wait`) — a trace never falls further behind than that, and memory never holds
more than that many records.

What a crash can lose: the records still queued (at most `write_queue` steps, never a half file —
the rename rule stands), and nothing else: the loop writes a step's metrics line only once its
file is on disk (`written_through`), and calls `flush` before every checkpoint, so every step
before a checkpoint is on disk when the checkpoint is; `--resume` redoes the steps after it. A failed write is not swallowed: it is raised by the next `submit`,
`flush` or `close`, naming the step.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from axrl.trace.step_record import StepRecord

_STOP = None


class StepWriter:
    """Writes step records with `write` (e.g. `RunDir.write_step`) in a background thread, at
    most `max_pending` of them not on disk yet (queued or being written; `submit` waits for room);
    `max_pending=0` writes in the caller."""

    def __init__(self, write: Callable[[StepRecord], object], max_pending: int = 2) -> None:
        if max_pending < 0:
            raise ValueError(f"trace.write_queue must be >= 0, got {max_pending}")
        self._write, self.max_pending = write, max_pending
        self.last_write_s = 0.0              # how long the latest finished write took (metrics)
        self.written_through = -1            # the latest step whose file is on disk (steps come in order)
        self._error: BaseException | None = None
        self._failed_step: int | None = None
        self._queue: queue.Queue[StepRecord | None] = queue.Queue()
        self._room = threading.Semaphore(max_pending)   # records not yet on disk: queued or being written
        self._thread: threading.Thread | None = None
        if max_pending:
            self._thread = threading.Thread(target=self._run, name="axrl-step-writer", daemon=True)
            self._thread.start()

    def submit(self, record: StepRecord) -> float:
        """Queue `record` for writing (or write it now when not in the background); returns the
        seconds the caller waited for room in the queue (or for the write)."""
        self._raise_failure()
        t0 = time.perf_counter()
        if self._thread is None:
            self._timed_write(record)
        else:
            self._room.acquire()
            self._queue.put(record)
        return time.perf_counter() - t0

    def flush(self) -> None:
        """Return once every submitted record is on disk (raises a failed write)."""
        if self._thread is not None:
            self._queue.join()
        self._raise_failure()

    def close(self) -> None:
        """Write what is queued, then stop the thread (raises a failed write)."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        self._raise_failure()

    # -- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            record = self._queue.get()
            try:
                if record is _STOP:
                    return
                if self._error is None:  # after a failure, later steps are not written out of order
                    self._timed_write(record)
            except BaseException as e:  # noqa: BLE001 — handed to the training thread
                self._error, self._failed_step = e, record.step
            finally:
                if record is not _STOP:
                    self._room.release()
                self._queue.task_done()

    def _timed_write(self, record: StepRecord) -> None:
        t0 = time.perf_counter()
        self._write(record)
        self.last_write_s = time.perf_counter() - t0
        # a step promoted by the spike ring (axrl/runtime/recording/tiers.py) is rewritten after later steps
        self.written_through = max(self.written_through, record.step)

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing the trace file of step {self._failed_step} failed: "
                               f"{type(self._error).__name__}: {self._error}") from self._error
