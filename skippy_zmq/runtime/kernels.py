"""Products with a weight matrix, `x @ w_t`, by a kernel chosen per process (docs/ARCHITECTURE.md,
"Kernels").

A stage multiplies by the same matrices every step, a few rows at a time. numpy's OpenBLAS
repacks the whole matrix on each call; ONNX Runtime's CPU MatMul (MLAS) packs a constant
matrix once when its session is built; a decode step of 8-16 rows then runs 1.6-2.5x as fast
on this project's machines (docs/BENCHMARKS.md, "Kernels"). Both compute in float32
from the same float32 weights; only the order of the additions differs.

A kernel is a row of KERNELS: a name and a function that binds one matrix. Shapes: R rows,
K = in_features, N = out_features; a weight is stored transposed, (K, N).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.runtime import ggml, nbits_head, ort_options

F32 = npt.NDArray[np.float32]

KERNEL_ENV = "SKIPPY_ZMQ_KERNEL"
REPACK_ENV = "SKIPPY_ZMQ_REPACK"
"""0 keeps every ggml matrix the file's bytes in place (no copy); 1, the default, repacks what the CPU can."""
HEAD_ENV = "SKIPPY_ZMQ_HEAD"
"""Who multiplies by a quantized kernel's head: `auto` (the default: MatMulNBits where the head's type has
a row in runtime/nbits_head.NBITS_TYPES and ONNX Runtime is installed, else ggml), `ggml` or `nbits`."""
HEAD_ROUTES = ("auto", "ggml", "nbits")
THREADS_ENV = "OPENBLAS_NUM_THREADS"  # the worker's --threads sets it before numpy loads
DEFAULT_KERNEL = "ggml"
"""What a stage runs when nothing names a kernel: llama.cpp's numbers from the file's blocks."""
FALLBACK_KERNEL = "onnxruntime"
"""The default when ggml's library is not installed (the `model` extra): float32, and the reason is logged."""


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
        """Bytes of weights the kernel reads per product (float32, or the file's blocks)."""

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
    after another (`tools/measure_load.py --layers 17 18 [--no-slices]`).
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


@attrs.frozen(eq=False)
class GGMLProjection:
    """`x @ [W_1 | W_2 | ...]` by ggml from the matrices' own blocks in the file (runtime/ggml.py):
    no float32 copy; the activations are quantized as llama.cpp does."""

    graphs: ggml.MatmulGraphs

    @property
    def in_features(self) -> int:
        """K."""
        return self.graphs.k

    @property
    def out_features(self) -> int:
        """N, the sum of the matrices' widths."""
        return self.graphs.n

    @property
    def weight_bytes(self) -> int:
        """The blocks' bytes."""
        return self.graphs.nbytes

    def __call__(self, x: F32) -> F32:
        """(R, K) -> (R, N)."""
        return self.graphs(np.ascontiguousarray(x, dtype=np.float32))


# Matrices above this many bytes are bound in column slices of at most this size (ColumnSplit).
SLICE_BYTES = 96 << 20

Binder = Callable[[F32, int], Projection]
BlockBinder = Callable[[Sequence[ggml.BlockMatrix], int], Projection]


def _bind_numpy(w_t: F32, threads: int) -> Projection:
    """numpy keeps the array; OpenBLAS's threads were fixed before numpy loaded."""
    return NumpyProjection(w_t)


def _bind_onnx(w_t: F32, threads: int) -> Projection:
    """One session, or a ColumnSplit of sessions for a matrix above SLICE_BYTES."""
    k, n = w_t.shape
    if w_t.nbytes <= SLICE_BYTES:
        return OnnxProjection.bind(w_t, threads)
    width = max(1, SLICE_BYTES // (4 * k))
    return ColumnSplit(tuple(OnnxProjection.bind(np.ascontiguousarray(w_t[:, start:start + width]), threads)
                             for start in range(0, n, width)))


def _onnx_available() -> str | None:
    """None if onnxruntime and onnx import, else why not."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        return f"{exc}; install it with `pip install onnxruntime onnx`"
    return None


def _bind_ggml(matrices: Sequence[ggml.BlockMatrix], threads: int) -> Projection:
    """ggml reads the blocks where they are (the file's mapping)."""
    return GGMLProjection(ggml.MatmulGraphs(matrices, threads, where=matrices[0].name if matrices else ""))


@attrs.frozen
class KernelRow:
    """One way to compute products: how it binds a matrix (from float32, or from the file's
    blocks: exactly one of the two), a check that it can run here, and its numerics."""

    unavailable: Callable[[], str | None]
    numerics: str
    bind: Binder | None = None
    bind_blocks: BlockBinder | None = None

    def __attrs_post_init__(self) -> None:
        if (self.bind is None) == (self.bind_blocks is None):
            raise ModelLoadError("a kernel row binds either float32 matrices or blocks, not both or neither")


KERNELS: dict[str, KernelRow] = {
    "onnxruntime": KernelRow(_onnx_available, "float32 products of the dequantized weights",
                             bind=_bind_onnx),
    "numpy": KernelRow(lambda: None, "float32 products of the dequantized weights", bind=_bind_numpy),
    "ggml": KernelRow(ggml.unavailable, "the file's quantized blocks, activations quantized as llama.cpp does",
                      bind_blocks=_bind_ggml),
}


@attrs.frozen
class Kernel:
    """A kernel chosen for this process: its name and how many threads each product may use."""

    name: str = attrs.field()
    threads: int = attrs.field(default=1)
    fallback_reason: str | None = attrs.field(default=None, eq=False)  # why the default could not run
    # ggml: copy the matrices its CPU backend can repack into their interleaved layout, as llama.cpp
    # does by default (many rows per block read: a batch of sessions costs little more than one)
    repack: bool = attrs.field(default=True)
    # the head's product with a quantized kernel (HEAD_ENV): MatMulNBits is faster on many rows
    head: str = attrs.field(default="auto", validator=attrs.validators.in_(HEAD_ROUTES))

    @name.validator
    def _check_name(self, _attribute: object, value: str) -> None:
        if value not in KERNELS:
            raise ModelLoadError(f"kernel {value!r} is unknown; expected one of {sorted(KERNELS)}")
        why = KERNELS[value].unavailable()
        if why is not None:
            raise ModelLoadError(f"kernel {value!r} cannot run here: {why}")

    @threads.validator
    def _check_threads(self, _attribute: object, value: int) -> None:
        if value < 1:
            raise ModelLoadError(f"kernel threads {value} must be >= 1")

    @classmethod
    def from_environment(cls, name: str | None = None) -> Kernel:
        """`name`, else $SKIPPY_ZMQ_KERNEL, else the default (ggml, or onnxruntime where ggml cannot
        run, saying why in `fallback_reason`), with $OPENBLAS_NUM_THREADS threads (default 1)."""
        name = name or os.environ.get(KERNEL_ENV, "").strip()
        fallback = None
        if not name:
            fallback = KERNELS[DEFAULT_KERNEL].unavailable()
            name = DEFAULT_KERNEL if fallback is None else FALLBACK_KERNEL
        raw = os.environ.get(THREADS_ENV, "").strip() or "1"
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ModelLoadError(f"${THREADS_ENV} = {raw!r} is not a thread count; expected an integer >= 1")
        repack = os.environ.get(REPACK_ENV, "1").strip()
        if repack not in ("0", "1"):
            raise ModelLoadError(f"${REPACK_ENV} = {repack!r}; expected 1 (repack, the default) or 0")
        head = os.environ.get(HEAD_ENV, "").strip() or "auto"
        if head not in HEAD_ROUTES:
            raise ModelLoadError(f"${HEAD_ENV} = {head!r}; expected one of {list(HEAD_ROUTES)}")
        return cls(name, threads, fallback_reason=fallback, repack=repack == "1", head=head)

    def head_by_nbits(self, type_name: str, where: str) -> bool:
        """Whether a quantized kernel's head of `type_name` is multiplied by MatMulNBits (HEAD_ENV): `auto`
        where it can run, `nbits` always (refused, naming the type or the missing library, where it cannot)."""
        if not self.quantized or self.head == "ggml":
            return False
        why = nbits_head.unavailable()
        if type_name not in nbits_head.NBITS_TYPES:
            why = f"MatMulNBits takes {sorted(nbits_head.NBITS_TYPES)}, not {type_name}"
        if why is None:
            return True
        if self.head == "nbits":
            raise ModelLoadError(f"{where}: ${HEAD_ENV} = nbits, but the head cannot run there: {why}")
        return False

    @property
    def described(self) -> str:
        """The kernel's name for a load line, with why the default could not run when it fell back."""
        if self.fallback_reason is None:
            if self.quantized:
                return f"the {self.name} kernel ({'repacking' if self.repack else 'not repacking'} weights)"
            return f"the {self.name} kernel"
        return f"the {self.name} kernel ({DEFAULT_KERNEL}, the default, cannot run here: {self.fallback_reason})"

    @property
    def quantized(self) -> bool:
        """True when the kernel computes from the file's blocks (`bind_blocks`), not float32 (`bind`)."""
        return KERNELS[self.name].bind_blocks is not None

    def bind(self, w_t: F32) -> Projection:
        """The matrix w_t (K, N) ready for products; the kernel may keep its own copy."""
        binder = KERNELS[self.name].bind
        if binder is None:
            raise ModelLoadError(f"kernel {self.name!r} computes from a file's blocks; it binds no float32 matrix")
        return binder(w_t, self.threads)

    def bind_blocks(self, matrices: Sequence[ggml.BlockMatrix]) -> Projection:
        """Matrices sharing K, as the file stores them, ready for one product whose outputs lie side by side."""
        binder = KERNELS[self.name].bind_blocks
        if binder is None:
            raise ModelLoadError(f"kernel {self.name!r} computes in float32; it binds no quantized blocks")
        return binder(matrices, self.threads)
