"""Named work arrays of the analysis, reused from step to step."""

from __future__ import annotations

from typing import Any

import numpy as np

class _Scratch:
    """Named work arrays reused from step to step (grown as needed).

    Every temporary of the kernel lives here: a fresh multi-megabyte numpy array per operation
    and step costs more in page faults (glibc hands freed blocks of that size back to the OS) than
    the arithmetic on it: ~40 of ~90 ns per token in a first version of this kernel without it."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def arange(self, n: int) -> np.ndarray:
        """0, 1, …, n − 1 (intp), kept."""
        buf = self._bufs.get("arange")
        if buf is None or buf.size < n:
            buf = self._bufs["arange"] = np.arange(n + n // 4, dtype=np.intp)
        return buf[:n]

    def __call__(self, name: str, n: int, dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = np.empty(n + n // 4, dtype=dtype)
            self._bufs[name] = buf
        return buf[:n]

