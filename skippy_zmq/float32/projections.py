"""Float32 products with a weight matrix, `x @ w_t`, for the float32 engine (docs/ARCHITECTURE.md, "Kernels").

A stage multiplies by the same matrices every step, a few rows at a time. numpy's OpenBLAS repacks the
whole matrix on each call; ONNX Runtime's CPU MatMul (MLAS) packs a constant matrix once when its session
is built, so a decode step of 8-16 rows runs 1.6-2.5x as fast (measured at commit f9d1290 with its
bench_step.py). Both compute in float32 from the same float32 weights; only the order of the additions
differs.

Shapes: R rows, K = in_features, N = out_features; a weight is stored transposed, (K, N).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq import ort_options

F32 = npt.NDArray[np.float32]


class Projection(Protocol):
    """One weight matrix bound to a kernel: (R, K) float32 rows in, (R, N) out."""

    @property
    def in_features(self) -> int:
        """K."""

    @property
    def out_features(self) -> int:
        """N."""

    @property
    def weight_bytes(self) -> int:
        """Bytes of float32 weights the kernel reads per product."""

    def __call__(self, x: F32) -> F32:
        """x @ w_t for C-contiguous float32 x of shape (R, K)."""


@attrs.frozen(eq=False)
class NumpyProjection:
    """`x @ w_t` with numpy (OpenBLAS); keeps the (K, N) array, which may be memory-mapped."""

    w_t: F32

    @property
    def in_features(self) -> int:
        """K."""
        return int(self.w_t.shape[0])

    @property
    def out_features(self) -> int:
        """N."""
        return int(self.w_t.shape[1])

    @property
    def weight_bytes(self) -> int:
        """4 K N."""
        return int(self.w_t.nbytes)

    def __call__(self, x: F32) -> F32:
        """(R, K) -> (R, N)."""
        out: F32 = x @ self.w_t
        return out


@attrs.frozen(eq=False)
class OnnxProjection:
    """`x @ w_t` by an ONNX Runtime session whose MatMul packed w_t once when it was built.

    The session keeps its own packed copy: the array it was built from may be dropped (a test
    pins that the session never reads it again).
    """

    graph: Any  # an onnxruntime.InferenceSession: named apart from the pipeline's sessions
    in_features: int
    out_features: int

    @property
    def weight_bytes(self) -> int:
        """4 K N."""
        return 4 * self.in_features * self.out_features

    @classmethod
    def bind(cls, w_t: F32, threads: int) -> OnnxProjection:
        """Build a one-node session holding w_t (K, N) with `threads` threads that do not spin."""
        import onnxruntime as ort  # imported here: numpy-only users and the CLI never load it
        from onnx import TensorProto, helper

        # ONNX Runtime's own log lines would interleave with the process's JSON log on
        # stderr; only its errors get through (they also raise here).
        ort.set_default_logger_severity(3)
        k, n = (int(d) for d in w_t.shape)
        weight = TensorProto()
        weight.name = "w"
        weight.data_type = TensorProto.FLOAT
        weight.dims.extend([k, n])
        # The bytes come from the array below, handed over in memory; ONNX marks such a
        # tensor as external data, and the location is only a label.
        weight.data_location = TensorProto.EXTERNAL
        entry = weight.external_data.add()
        entry.key, entry.value = "location", "skippy-zmq-weight"
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], "projection",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["R", n])],
            initializer=[weight])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        options = ort_options.sleeping_threads(ort, threads)
        options.log_severity_level = 3
        options.add_external_initializers(["w"], [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(w_t))])
        graph = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return cls(graph=graph, in_features=k, out_features=n)

    def __call__(self, x: F32) -> F32:
        """(R, K) -> (R, N)."""
        out: F32 = self.graph.run(None, {"x": np.ascontiguousarray(x, dtype=np.float32)})[0]
        return out


@attrs.frozen(eq=False)
class ColumnSplit:
    """One matrix bound as several column slices, (K, N_i) each: the outputs side by side.

    ONNX Runtime holds a copy of a matrix while it packs it, so binding the 671 MB output
    head whole peaked at 2,047 MiB of resident memory against 1,535 MiB in slices bound one
    after another (`measure_load.py --layers 17 18 [--no-slices]`, in tools/ until commit f9d1290).
    """

    parts: tuple[Projection, ...]

    @property
    def in_features(self) -> int:
        """K."""
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        """N, the sum of the slices' widths."""
        return sum(p.out_features for p in self.parts)

    @property
    def weight_bytes(self) -> int:
        """The slices' bytes."""
        return sum(p.weight_bytes for p in self.parts)

    def __call__(self, x: F32) -> F32:
        """(R, K) -> (R, N)."""
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        start = 0
        for part in self.parts:
            out[:, start:start + part.out_features] = part(x)
            start += part.out_features
        return out


# Matrices above this many bytes are bound in column slices of at most this size (ColumnSplit).
SLICE_BYTES = 96 << 20

Binder = Callable[[F32, int], Projection]


def bind_numpy(w_t: F32, threads: int) -> Projection:
    """numpy keeps the array; OpenBLAS's threads were fixed before numpy loaded."""
    return NumpyProjection(w_t)


def bind_onnx(w_t: F32, threads: int) -> Projection:
    """One session, or a ColumnSplit of sessions for a matrix above SLICE_BYTES."""
    k, n = w_t.shape
    if w_t.nbytes <= SLICE_BYTES:
        return OnnxProjection.bind(w_t, threads)
    width = max(1, SLICE_BYTES // (4 * k))
    return ColumnSplit(tuple(OnnxProjection.bind(np.ascontiguousarray(w_t[:, start:start + width]), threads)
                             for start in range(0, n, width)))


def onnx_unavailable() -> str | None:
    """None if onnxruntime and onnx import, else why not."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        return f"{exc}; install it with `pip install onnxruntime onnx`"
    return None
