"""Embeddings at the final stage: the output-normed hidden states of a prompt, pooled and
L2-normalized, or scored by a reranker's head (docs/PROTOCOL.md §5, Embeddings; §7, Session forks
and embeddings, for what llama.cpp pools and how close ours comes).

A prompt may arrive in several prefill chunks, so `PooledRows` keeps a running float64 sum (mean
pooling) or the latest row (last and rank pooling) until the final chunk asks for the vector.
`RankHead` turns a rank pooling's last row into scores as llama.cpp's rank pooling does: the
file's classifier tensors when it has them, the row itself when it has none.
"""

from __future__ import annotations

import enum
import os
from typing import TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import StageError, WireError

F32: TypeAlias = npt.NDArray[np.float32]


class Pooling(enum.IntEnum):
    """How a prompt's rows become one vector; the ids are wire format (docs/PROTOCOL.md §2.6)."""

    MEAN = 1  # the mean of every position's row (llama-server's --pooling mean)
    LAST = 2  # the last position's row (--pooling last)
    RANK = 3  # the last position's row, unnormalized, through the reranker's head (serve --reranking)
    NONE = 4  # every position's row, unnormalized, one after the other (--pooling none: per-token embeddings)

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
        self._rows: list[npt.NDArray[np.float32]] = []  # pooling none: every chunk's rows, copied

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
        elif self.pooling is Pooling.NONE:
            self._rows.append(np.array(rows, dtype=np.float32))
        self._last = rows[-1].copy()

    def vector(self) -> npt.NDArray[np.float32]:
        """The pooled, L2-normalized embedding (n_embd,) float32 (rank pooling: the last row as it
        is, for `RankHead.scores`; pooling none: every row as it is, flat, (T * n_embd,)); StageError before
        any row."""
        if self._last is None:
            raise StageError("pooling: no rows were pooled; the prompt has no positions")
        if self.pooling is Pooling.RANK:
            return self._last.astype(np.float32)
        if self.pooling is Pooling.NONE:
            return np.concatenate(self._rows, axis=0).reshape(-1)
        pooled = self._sum / self.count if self.pooling is Pooling.MEAN else self._last.astype(np.float64)
        norm = float(np.sqrt(np.dot(pooled, pooled)))
        return (pooled / norm if norm > 0 else pooled).astype(np.float32)


_DENSE, _DENSE_BIAS, _OUT, _OUT_BIAS = "cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias"


@attrs.frozen(eq=False)
class RankHead:
    """A reranker's head as llama.cpp's rank pooling applies it to a prompt's last output-normed row
    (n_embd,): `cls.weight` (+ `cls.bias`) then tanh where the file has them, `cls.output.weight`
    (+ `cls.output.bias`) where it has it, a softmax where the architecture's row asks
    (`ArchSpec.rank_softmax`: Qwen3-Reranker's P("yes"), P("no")); a file with none of these scores by
    its row itself. A prompt's relevance is the first score (docs/PROTOCOL.md §9.3, Reranking)."""

    dense: F32 | None = None  # (n_embd, n_embd) cls.weight, numpy (out, in)
    dense_bias: F32 | None = None  # (n_embd,)
    out: F32 | None = None  # (n_cls_out, n_embd) cls.output.weight, numpy (out, in)
    out_bias: F32 | None = None  # (n_cls_out,)
    softmax: bool = False
    n_scores: int = 1  # the file's classifier labels (1 without): how many leading scores a rank answers with

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RankHead:
        """The head of a GGUF file (final stage); ModelLoadError naming a tensor of the wrong shape."""
        from skippy_zmq.model.gguf_file import ArchKey
        from skippy_zmq.model.gguf_model import GGUFModel

        model = GGUFModel(path)
        n_embd = model.hparams.n_embd
        # the classifier's width is the file's: cls.output.weight is (n_cls_out, n_embd) in numpy order
        n_out = model.header.tensor(_OUT).shape[0] if model.has_tensor(_OUT) else 0

        def load(name: str, shape: tuple[int, ...]) -> F32 | None:
            return model.load_f32(name, shape) if model.has_tensor(name) else None

        labels = ArchKey.CLASSIFIER_LABELS.of(model.hparams.arch)
        n_labels = len(model.header.strings(labels)) if labels in model.header.metadata else 0
        return cls(load(_DENSE, (n_embd, n_embd)), load(_DENSE_BIAS, (n_embd,)), load(_OUT, (n_out, n_embd)),
                   load(_OUT_BIAS, (n_out,)), model.hparams.spec.rank_softmax, max(n_labels, 1))

    def scores(self, row: F32) -> F32:
        """The first `n_scores` scores of one last row (n_embd,), as llama.cpp answers a rank pooling
        (without a classifier, the row's own first values)."""
        x = np.asarray(row, dtype=np.float32)
        if self.dense is not None:
            x = self.dense @ x
            if self.dense_bias is not None:
                x = x + self.dense_bias
            x = np.tanh(x)
        if self.out is not None:
            x = self.out @ x
            if self.out_bias is not None:
                x = x + self.out_bias
        if self.softmax:
            shifted = np.exp(x.astype(np.float64) - float(np.max(x)))
            x = shifted / shifted.sum()
        return np.ascontiguousarray(x[: self.n_scores], dtype=np.float32)
