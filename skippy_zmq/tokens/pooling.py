"""Embeddings at the final stage: the output-normed hidden states of a prompt, pooled and
L2-normalized (docs/PROTOCOL.md §5, Embeddings; §7, Session forks and embeddings,
for what llama.cpp pools and how close ours comes).

A prompt may arrive in several prefill chunks, so `PooledRows` keeps a running float64 sum (mean
pooling) or the latest row (last pooling) until the final chunk asks for the vector.
"""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import StageError, WireError


class Pooling(enum.IntEnum):
    """How a prompt's rows become one vector; the ids are wire format (docs/PROTOCOL.md §2.6)."""

    MEAN = 1  # the mean of every position's row (llama-server's --pooling mean)
    LAST = 2  # the last position's row (--pooling last)

    @classmethod
    def parse(cls, value: int) -> Pooling:
        """The pooling a wire id names; WireError naming an unknown id."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(f"{p.value} ({p.name.lower()})" for p in cls)
            raise WireError(f"unknown pooling id {value}; expected one of {names}") from None

    @classmethod
    def named(cls, name: str) -> Pooling:
        """The pooling a CLI or request names ("mean", "last"); ValueError otherwise."""
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown pooling {name!r}; expected one of "
                             f"{', '.join(p.name.lower() for p in cls)}") from None


class PooledRows:
    """The pooled rows of one session's prompt so far."""

    def __init__(self, pooling: Pooling, n_embd: int) -> None:
        """Pool rows of n_embd values with `pooling`; nothing pooled yet."""
        self.pooling = pooling
        self.count = 0
        self._sum = np.zeros(n_embd, dtype=np.float64)  # (n_embd,) mean pooling's running sum
        self._last: npt.NDArray[np.float32] | None = None

    def add(self, rows: npt.NDArray[np.float32]) -> None:
        """Take a chunk's output-normed rows (T, n_embd), in position order."""
        n_embd = self._sum.shape[0]
        if (not isinstance(rows, np.ndarray) or not np.issubdtype(rows.dtype, np.floating) or rows.ndim != 2
                or rows.shape[1] != n_embd or rows.shape[0] == 0):
            got = f"{rows.dtype} {rows.shape}" if isinstance(rows, np.ndarray) else type(rows).__name__
            raise StageError(f"pooling: expected float rows (T, {n_embd}) with T >= 1, got {got}")
        self.count += rows.shape[0]
        if self.pooling is Pooling.MEAN:
            self._sum += rows.sum(axis=0, dtype=np.float64)
        self._last = rows[-1].copy()

    def vector(self) -> npt.NDArray[np.float32]:
        """The pooled, L2-normalized embedding (n_embd,) float32; StageError before any row."""
        if self._last is None:
            raise StageError("pooling: no rows were pooled; the prompt has no positions")
        pooled = self._sum / self.count if self.pooling is Pooling.MEAN else self._last.astype(np.float64)
        norm = float(np.sqrt(np.dot(pooled, pooled)))
        return (pooled / norm if norm > 0 else pooled).astype(np.float32)
