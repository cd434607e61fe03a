"""The logprobs normalizer's kernel: sum(exp(row)) of one row of float32 logits (docs/PROTOCOL.md
§5, Logprobs; docs/BENCHMARKS.md, "Logprobs").

Both rows of `EXP_SUMS` sum in the same order: the row's first 16·W values seen as (16, W), each
of the W columns' 16 terms added in order, then numpy's pairwise sum of the W column sums, then
the last `n mod 16` terms. What differs is the exp: numpy's, or ONNX Runtime's vectorized `Exp`
with the column sums as a (1, 16) @ (R, 16, W) product of ones in the same one-node-pair graph, so
the exp values are never written back for numpy to read again (0.19-0.23 against numpy's exp and
pairwise sum at 0.29-0.35 ms a row of 262,144 from memory, one thread, `probe_softmax.py`;
both exps within 1.3 ulp a term). The final stage runs it on its kernel's threads, once for each
stretch of adjacent rows of a pass that asked for logprobs (`ExpSum.rows`): one run instead of one
a row saves ONNX Runtime's call and its threads' waking: a 16-session pass's picks with logprobs
take 3.2-3.5 against 5.0-5.6 ms (`bench_logprobs_pass.py` against its `--per-row`;
docs/BENCHMARKS.md, "Logprobs"; the tools named here were in tools/ until commit f9d1290).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq import ort_options
from skippy_zmq.errors import StageError

F32 = npt.NDArray[np.float32]
GROUPS = 16
"""Terms each column sum adds in order before the pairwise sum of the columns."""


@attrs.frozen(eq=False)
class RowSum:
    """One row's exp-sum and its (n // 16,) column sums (see `ExpSum.columns`)."""

    total: float
    columns: F32


class ExpSum(Protocol):
    """sum(exp(row)) of one contiguous (n,) float32 row, overflow to inf and NaN passed through."""

    name: str

    def __call__(self, row: F32) -> float:
        """The row's exp-sum, as a Python float."""

    @property
    def columns(self) -> F32:
        """The last row's (n // 16,) column sums: column j adds exp(row[i * (n // 16) + j]) for
        i in 0..15; valid until the next call."""

    def rows(self, block: F32) -> list[RowSum]:
        """Each row's exp-sum and column sums of a C-contiguous (R, n) float32 block, n a multiple of
        16: the same values as a call per row, in one run where the kernel can; each result owns its
        column sums."""


def takes_block(block: F32) -> bool:
    """Whether `ExpSum.rows` takes `block`: C-contiguous float32 (R, n) with n a multiple of 16, so
    that its rows are 16-term column groups end to end."""
    return (isinstance(block, np.ndarray) and block.ndim == 2 and block.dtype == np.float32
            and block.flags.c_contiguous and block.shape[1] % GROUPS == 0)


def _check_block(block: F32) -> int:
    """The block's column count W = n / 16; StageError for a block `rows` cannot take."""
    if not takes_block(block):
        raise StageError(f"exp-sum: a block of rows must be C-contiguous float32 (R, n) with n a multiple of "
                         f"{GROUPS}, got {getattr(block, 'dtype', type(block).__name__)} "
                         f"{getattr(block, 'shape', '')}")
    return int(block.shape[1]) // GROUPS


def _pairwise_total(sums: F32, row: F32, head: int) -> float:
    """The column sums' pairwise sum plus the `n mod 16` trailing terms' exps."""
    total = float(sums.sum())
    if head < row.size:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # inf and NaN pass through
            total += float(np.exp(row[head:]).sum())
    return total


class NumpyExpSum:
    """numpy's exp into a kept working row, then the column sums by one add per group row."""

    name = "numpy"

    def __init__(self, threads: int = 1) -> None:
        del threads  # numpy's exp runs on the caller's thread
        self._work = np.empty(0, np.float32)
        self._sums = np.empty(0, np.float32)

    @property
    def columns(self) -> F32:
        """The last row's column sums."""
        return self._sums

    def __call__(self, row: F32) -> float:
        """The row's exp-sum."""
        width = row.size // GROUPS
        if self._work.size != row.size:
            self._work, self._sums = np.empty(row.size, np.float32), np.empty(width, np.float32)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            exps = np.exp(row, out=self._work)
            np.add.reduce(exps[:GROUPS * width].reshape(GROUPS, width), axis=0, out=self._sums)
            return _pairwise_total(self._sums, row, GROUPS * width)

    def rows(self, block: F32) -> list[RowSum]:
        """Each row's sums, a call per row."""
        _check_block(block)
        return [RowSum(self(row), self._sums.copy()) for row in block]


class OnnxExpSum:
    """ONNX Runtime's `Exp` and a (1, 16) @ (R, 16, W) product of ones on `threads` threads (the
    stage kernel's: they sleep, not spin, between runs); the rows are bound in place and the column
    sums written into arrays of ours. A single row runs as a block of one, so its bits are a block's."""

    name = "onnxruntime"

    def __init__(self, threads: int = 1) -> None:
        import onnxruntime as ort
        from onnx import TensorProto, helper

        graph = helper.make_graph(
            [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("MatMul", ["ones", "e"], ["s"])], "exp_sum",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", GROUPS, "W"])],
            [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["R", 1, "W"])],
            initializer=[helper.make_tensor("ones", TensorProto.FLOAT, [1, GROUPS], [1.0] * GROUPS)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        options = ort_options.sleeping_threads(ort, threads)
        options.log_severity_level = 3
        self._session: Any = ort.InferenceSession(model.SerializeToString(), options,
                                                  providers=["CPUExecutionProvider"])
        self._binding: Any = self._session.io_binding()
        self._sums: F32 = np.empty((1, 1, 0), np.float32)  # (1, 1, W) the last single row's

    @property
    def columns(self) -> F32:
        """The last row's column sums."""
        sums: F32 = self._sums[0, 0]
        return sums

    def _run(self, start: int, rows: int, width: int, out: F32) -> None:
        """Exp and column sums of `rows` x 16 x `width` floats at address `start` into `out`."""
        self._binding.bind_input("x", "cpu", 0, np.float32, [rows, GROUPS, width], start)
        self._binding.bind_output("s", "cpu", 0, np.float32, [rows, 1, width], out.ctypes.data)
        self._session.run_with_iobinding(self._binding)

    def __call__(self, row: F32) -> float:
        """The row's exp-sum."""
        width = row.size // GROUPS
        if width == 0:
            self._sums = np.empty((1, 1, 0), np.float32)
            return _pairwise_total(self._sums[0, 0], row, 0)
        if not (row.dtype == np.float32 and row.flags.c_contiguous):
            raise StageError(f"exp-sum: the row must be contiguous float32, got {row.dtype} "
                             f"(contiguous: {row.flags.c_contiguous})")
        if self._sums.shape[2] != width:
            self._sums = np.empty((1, 1, width), np.float32)
        self._run(row.ctypes.data, 1, width, self._sums)
        return _pairwise_total(self._sums[0, 0], row, GROUPS * width)

    def rows(self, block: F32) -> list[RowSum]:
        """Each row's sums, one run for the whole block."""
        width = _check_block(block)
        count = int(block.shape[0])
        if count == 0 or width == 0:
            return [RowSum(0.0, np.empty(0, np.float32)) for _ in range(count)]
        sums = np.empty((count, 1, width), np.float32)  # the results' own (malloc reuses freed blocks)
        self._run(block.ctypes.data, count, width, sums)
        return [RowSum(_pairwise_total(row_sums[0], row, GROUPS * width), row_sums[0])
                for row, row_sums in zip(block, sums, strict=True)]


EXP_SUMS: dict[str, Callable[[int], ExpSum]] = {
    "onnxruntime": OnnxExpSum,
    "numpy": NumpyExpSum,
}
"""The normalizer's kernels, preferred first; a row whose library is missing is skipped."""
_NEEDS = {"onnxruntime": ("onnxruntime", "onnx"), "numpy": ()}
assert set(_NEEDS) == set(EXP_SUMS), "every exp-sum kernel names the modules it needs"


def available() -> list[str]:
    """The kernels whose libraries are importable here, preferred first."""
    return [name for name in EXP_SUMS if all(importlib.util.find_spec(module) for module in _NEEDS[name])]


def best(threads: int = 1) -> ExpSum:
    """A new instance of the preferred kernel available, on `threads` threads: one whose library
    imports but will not build its session is passed over, as numpy never is."""
    for name in available():
        try:
            return EXP_SUMS[name](threads)
        except Exception:  # noqa: BLE001 - ONNX Runtime raises its own types; numpy's row remains
            continue
    return NumpyExpSum(threads)
