"""The head's product by ONNX Runtime's `MatMulNBits` from the file's own blocks (docs/ARCHITECTURE.md,
"Kernels", "The head").

The head is the largest matrix a stage multiplies (Gemma 3 270M: 640 x 262,144 Q8_0, 178 MB of its
247 MB) and the one every row of a batch meets. On two threads of this project's machines
`MatMulNBits` at accuracy level 4 (activations quantized to int8 per block, integer dot products in
tiles of rows and columns) takes 0.53-0.68x ggml's time for that Q8_0 matrix at 4 to 32 rows, 0.83-0.86x
at one (`probe_head.py`, in tools/ until commit f9d1290; docs/BENCHMARKS.md, "The head"). The package's Q8_0
product is faster at 1 to 16 rows on two threads, with llama.cpp's bits, so a Q8_0 head is its by default
(runtime/kernels.HEAD_ENV); this one multiplies Q4_0 heads, and Q8_0 ones where asked.
The weights are the file's exactly: a Q8_0 block's int8 codes become unsigned by flipping their top bit (MatMulNBits'
default zero point for 8 bits is 128), a Q4_0 block's nibbles are reordered to its packing (zero point
8), and the blocks' float16 scales are widened to float32.

ONNX Runtime packs the codes into its own layout when the session is built; the arrays handed to it
are then freed, and so are the file's pages under the head, so the process holds one packed copy
instead of the file's bytes (Gemma 3 270M's head alone: +286 MiB with the library and a 16-row
product's logits, against ggml's +194 MiB; `probe_head.py --memory`, in tools/ until commit f9d1290). A
type with no row in `NBITS_TYPES` keeps ggml's product.
"""

from __future__ import annotations

import importlib.util
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq import ort_options
from skippy_zmq.compute import ggml
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_model import BlockMatrix

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

BLOCK = 32
"""Values per block of every type below (Q8_0, Q4_0): MatMulNBits' block_size."""
LIBRARY_BYTES = 56 << 20
"""ONNX Runtime and onnx imported, a session and its arena: what `probe_head.py --memory nbits` (in
tools/ until commit f9d1290) measured beyond the codes, three float32 arrays per block and the logits
(Gemma 3 270M: about 50 MiB), rounded up."""
OUTPUT_BUFFERS = 8
"""Output arrays kept per row count (each R x N floats), as ggml's graphs are kept per layout."""


def _scales(blocks: U8) -> F32:
    """(N, K/32) float32 of each block's leading float16 scale."""
    return blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q8_0(raw: U8, k: int, n: int) -> tuple[U8, F32]:
    """Q8_0 blocks (2-byte scale, 32 int8 codes) -> codes (N, K/32, 32) uint8 = q + 128, scales."""
    blocks = raw.reshape(n, k // BLOCK, 2 + BLOCK)
    codes = np.empty((n, k // BLOCK, BLOCK), np.uint8)
    np.bitwise_xor(blocks[..., 2:], np.uint8(0x80), out=codes)  # one pass over the strided codes
    return codes, _scales(blocks)


def _q4_0(raw: U8, k: int, n: int) -> tuple[U8, F32]:
    """Q4_0 blocks (2-byte scale, 16 bytes: value j in byte j's low nibble, value j + 16 in its high one)
    -> codes (N, K/32, 16) with value 2i in byte i's low nibble and 2i + 1 in its high one, scales."""
    blocks = raw.reshape(n, k // BLOCK, 2 + BLOCK // 2)
    packed = blocks[..., 2:]
    values = np.concatenate([packed & np.uint8(15), packed >> np.uint8(4)], axis=-1)  # (N, K/32, 32)
    return np.ascontiguousarray(values[..., 0::2] | (values[..., 1::2] << np.uint8(4))), _scales(blocks)


@attrs.frozen
class NbitsType:
    """How one ggml type's blocks become MatMulNBits' codes and scales, exactly."""

    bits: int
    block_bytes: int
    decode: Callable[[U8, int, int], tuple[U8, F32]]


NBITS_TYPES: dict[str, NbitsType] = {
    "Q8_0": NbitsType(bits=8, block_bytes=2 + BLOCK, decode=_q8_0),
    "Q4_0": NbitsType(bits=4, block_bytes=2 + BLOCK // 2, decode=_q4_0),
}


def resident_bytes(type_name: str, n: int, k: int) -> int:
    """What a head of `n` x `k` values of `type_name` holds once bound: ONNX Runtime's packed codes, its
    scales and per-block sums (float32 each), and the library (Gemma 3 270M's head: 276 MiB; measured
    270 MiB, the 286 of `probe_head.py --memory nbits` (above) less its 16 MiB of logits, which the
    planner counts with the head's graphs)."""
    return n * k * NBITS_TYPES[type_name].bits // 8 + 3 * 4 * n * (k // BLOCK) + LIBRARY_BYTES


def unavailable() -> str | None:
    """None if ONNX Runtime and onnx are installed (the `model` extra), else why not. Found, not imported:
    the planner asks in the gateway's process, which never multiplies (importing both costs 0.3 s)."""
    missing = [name for name in ("onnxruntime", "onnx") if importlib.util.find_spec(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed; install the `model` extra (pip install 'skippy-zmq[model]')"
    return None


def _external(name: str, data_type: int, shape: tuple[int, ...]) -> Any:
    """An initializer whose bytes the session options hand over (no copy in the model's bytes)."""
    from onnx import TensorProto

    tensor = TensorProto()
    tensor.name, tensor.data_type = name, data_type
    tensor.dims.extend(shape)
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", f"{name}.bin"
    return tensor


class NbitsHead:
    """(R, K) float32 -> (R, N): `x @ W.T` by one MatMulNBits node over a matrix's own blocks."""

    def __init__(self, matrix: BlockMatrix, threads: int, where: str) -> None:
        """Decode `matrix`'s codes and scales, build the session, free what ONNX Runtime copied."""
        kind = NBITS_TYPES.get(matrix.type_name)
        if kind is None:
            raise ModelLoadError(f"{where}: tensor {matrix.name!r} is {matrix.type_name}; MatMulNBits takes "
                                 f"{sorted(NBITS_TYPES)}")
        if matrix.k % BLOCK or matrix.data.nbytes != matrix.n * (matrix.k // BLOCK) * kind.block_bytes:
            raise ModelLoadError(f"{where}: tensor {matrix.name!r} holds {matrix.data.nbytes} bytes for "
                                 f"{matrix.n} x {matrix.k} {matrix.type_name}; expected "
                                 f"{matrix.n * (matrix.k // BLOCK) * kind.block_bytes} with k a "
                                 f"multiple of {BLOCK}")
        why = unavailable()
        if why is not None:
            raise ModelLoadError(f"{where}: the MatMulNBits head cannot run here: {why}")
        try:
            import onnxruntime as ort
            from onnx import TensorProto, helper
        except ImportError as exc:  # installed but broken
            raise ModelLoadError(f"{where}: the MatMulNBits head cannot run here: {exc}") from exc

        self.in_features, self.out_features, self.type_name = matrix.k, matrix.n, matrix.type_name
        codes, scales = kind.decode(matrix.data, matrix.k, matrix.n)
        node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=matrix.k,
                                N=matrix.n, bits=kind.bits, block_size=BLOCK, accuracy_level=4)
        graph = helper.make_graph(
            [node], "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", matrix.k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["R", matrix.n])],
            initializer=[_external("B", TensorProto.UINT8, codes.shape),
                         _external("S", TensorProto.FLOAT, scales.shape)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort_options.sleeping_threads(ort, threads)  # ggml's threads run between heads
        values = [ort.OrtValue.ortvalue_from_numpy(codes), ort.OrtValue.ortvalue_from_numpy(scales)]
        self._codes: list[Any] | None = [codes, scales, *values]  # kept while the session may read them
        options.add_external_initializers(["B", "S"], values)
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own types; one load error names the tensor
            raise ModelLoadError(f"{where}: ONNX Runtime refused the MatMulNBits head over {matrix.name!r}: "
                                 f"{exc}") from exc
        self._lock = threading.Lock()
        self._outputs: OrderedDict[int, F32] = OrderedDict()
        self._pad_single = False
        self.packed_own_copy = self._release_if_packed(codes, scales)
        self._pad_single = self._single_row_differs()
        if self.packed_own_copy and matrix.file_backed:
            ggml.drop_pages(matrix.data)

    def _release_if_packed(self, codes: U8, scales: F32) -> bool:
        """Free the codes and scales if the session packed its own copy (MatMulNBits does where its
        int8 kernels run; the API does not say): the same product with every code bit flipped proves
        it reads none of ours (with the scales negated too, and a product that is not all zeros). Otherwise
        flip them back (exactly) and keep them for the session."""
        probe = np.linspace(-1.0, 1.0, 2 * self.in_features, dtype=np.float32).reshape(2, self.in_features)
        before = self._run(probe).copy()
        np.bitwise_not(codes, out=codes)
        np.negative(scales, out=scales)
        packed = bool(np.any(before)) and np.array_equal(self._run(probe), before)
        np.bitwise_not(codes, out=codes)
        np.negative(scales, out=scales)
        if packed:
            self._codes = None
        return packed

    def _single_row_differs(self) -> bool:
        """Whether a one-row product gives other bits than the same row in a batch: MatMulNBits takes
        another kernel for one row on some CPUs (4 bits on an AVX2-only AMD EPYC). Then a single row
        runs as two, so a row's logits never depend on the batch it came in (split equals whole)."""
        probe = np.random.default_rng(0).standard_normal((3, self.in_features)).astype(np.float32)
        batched = self._run(probe).copy()
        return any(not np.array_equal(self._run(probe[i:i + 1])[0], batched[i]) for i in range(3))

    @property
    def weight_bytes(self) -> int:
        """Bytes of codes and scales a product reads (ONNX Runtime's packed copy holds about as many)."""
        return self.out_features * self.in_features * NBITS_TYPES[self.type_name].bits // 8 \
            + self.out_features * (self.in_features // BLOCK) * 4

    def __call__(self, x: F32, *, reuse: bool = False) -> F32:
        """(R, K) C-contiguous float32 -> (R, N); with `reuse`, an array the next call of as many rows
        overwrites (no fresh R x N floats per call)."""
        with self._lock:
            out = self._run(x)
            return out if reuse else out.copy()

    def _run(self, x: F32) -> F32:
        if self._pad_single and x.shape[0] == 1:
            return self._run(np.repeat(x, 2, axis=0))[:1]
        rows = int(x.shape[0])
        out = self._outputs.get(rows)
        if out is None:
            out = self._outputs[rows] = np.empty((rows, self.out_features), np.float32)
            while len(self._outputs) > OUTPUT_BUFFERS:
                self._outputs.popitem(last=False)
        else:
            self._outputs.move_to_end(rows)
        binding = self.session.io_binding()
        binding.bind_cpu_input("x", np.ascontiguousarray(x, np.float32))
        binding.bind_output("y", "cpu", 0, np.float32, out.shape, out.ctypes.data)
        self.session.run_with_iobinding(binding)
        return out
