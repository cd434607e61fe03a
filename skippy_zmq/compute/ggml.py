"""ggml's CPU kernels through ctypes: `x @ W` computed from a GGUF matrix's own quantized blocks
(docs/ARCHITECTURE.md, "Kernels").

The library is the one llama.cpp is built on, as llama-cpp-python ships it (`llama_cpp/lib/`,
the `model` extra), or any build whose directory `$SKIPPY_ZMQ_GGML_LIB` names. Only a few
functions of its C API are declared here, and ggml objects stay opaque pointers but for the head
of `struct ggml_tensor` (type, buffer, shape, strides, as ggml 0.25's ggml.h lays them out), which
`mul_mat` reads to route a product, and the one struct passed by value (`ggml_init_params`: size,
buffer, no_alloc), which has kept its layout across ggml releases. The package's Q6_K op reads
tensors too; it is checked against ggml's own product before a graph holds it (`mul_mat`), which
also checks those layouts against the build loaded.

A weight tensor's data pointer is set into the memory-mapped GGUF file (a CPU buffer made over
those bytes), or into a copy that replaces those pages (repacked, or on huge pages: `Weights`), so
the stage holds one copy of its blocks and no float32 one. Products run as small graphs built once
per row count (`MatmulGraphs`), so a call costs a copy in, one `ggml_backend_graph_compute` and a
copy out. ggml quantizes the activations to the weight type's dot-product type (q8_0 or q8_K) as
llama.cpp does: the products are llama.cpp's.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from skippy_zmq.compute import huge_pages, products, q4k, q6k, q80
from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.gguf_model import BlockMatrix

F32 = npt.NDArray[np.float32]
LIB_ENV = "SKIPPY_ZMQ_GGML_LIB"
"""A directory holding libggml-base.so, libggml-cpu*.so and libggml.so (default: llama-cpp-python's)."""
EXTRA_HINT = "install the model extra (`pip install -e '.[model]'`, which builds llama-cpp-python)"

GGML_TYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
    "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22,
    "IQ4_XS": 23, "IQ1_M": 29, "BF16": 30, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39,
}
"""The weight types a matrix may have, by GGUF name, with ggml's type ids (part of its file format): every
type ggml's CPU backend multiplies, as llama.cpp loads them (tests/compute/test_ggml.py checks each product
against gguf's dequantization)."""
GGML_I32 = 26
"""ggml's type id of int32 tensors (positions, row indices)."""
GGML_I64 = 27
"""ggml's type id of int64 tensors (the row indices of ggml_set_rows)."""
TENSOR_ALIGNMENT = 32
"""ggml refuses a buffer whose address is not a multiple of this (GGUF files align their data to it)."""
GRAPHS_PER_MATRIX = 16
"""Graphs (one per row count) a projection keeps; the least recently used one goes first."""

_VP = ctypes.c_void_p
_N_TASKS_MAX = -1  # GGML_N_TASKS_MAX: a custom op runs on every thread of the graph's backend
_log = logging.getLogger(__name__)


class TensorHead(ctypes.Structure):
    """The first fields of `struct ggml_tensor` (ggml.h): what `mul_mat` reads to route a product."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("type", ctypes.c_int), ("buffer", _VP), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4)]

    @classmethod
    def of(cls, tensor: int) -> TensorHead:
        """The head of the tensor at `tensor` (a view: it reads the tensor's memory)."""
        return cls.from_address(tensor)


class InitParams(ctypes.Structure):
    """struct ggml_init_params {size_t mem_size; void *mem_buffer; bool no_alloc;}"""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("mem_size", ctypes.c_size_t), ("mem_buffer", _VP), ("no_alloc", ctypes.c_bool)]


# name, library ("base" or "cpu"), result type, argument types
_FUNCTIONS: tuple[tuple[str, str, Any, tuple[Any, ...]], ...] = (
    ("ggml_init", "base", _VP, (InitParams,)),
    ("ggml_free", "base", None, (_VP,)),
    ("ggml_tensor_overhead", "base", ctypes.c_size_t, ()),
    ("ggml_graph_overhead_custom", "base", ctypes.c_size_t, (ctypes.c_size_t, ctypes.c_bool)),
    ("ggml_new_tensor_2d", "base", _VP, (_VP, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)),
    ("ggml_new_graph_custom", "base", _VP, (_VP, ctypes.c_size_t, ctypes.c_bool)),
    ("ggml_build_forward_expand", "base", None, (_VP, _VP)),
    ("ggml_set_input", "base", None, (_VP,)),
    ("ggml_set_output", "base", None, (_VP,)),
    ("ggml_get_data", "base", _VP, (_VP,)),
    ("ggml_row_size", "base", ctypes.c_size_t, (ctypes.c_int, ctypes.c_int64)),
    ("ggml_blck_size", "base", ctypes.c_int64, (ctypes.c_int,)),
    ("ggml_mul_mat", "base", _VP, (_VP, _VP, _VP)),
    # ctx, type, ne0..ne3, args, n_args, fun, n_tasks, userdata
    ("ggml_custom_4d", "base", _VP, (_VP, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, _VP, ctypes.c_int, _VP, ctypes.c_int, _VP)),
    ("ggml_is_contiguous", "base", ctypes.c_bool, (_VP,)),
    ("ggml_new_tensor_1d", "base", _VP, (_VP, ctypes.c_int, ctypes.c_int64)),
    ("ggml_new_tensor_3d", "base", _VP, (_VP, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)),
    ("ggml_reshape_3d", "base", _VP, (_VP, _VP, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)),
    ("ggml_nbytes", "base", ctypes.c_size_t, (_VP,)),
    ("ggml_reshape_2d", "base", _VP, (_VP, _VP, ctypes.c_int64, ctypes.c_int64)),
    ("ggml_view_2d", "base", _VP, (_VP, _VP, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t, ctypes.c_size_t)),
    ("ggml_view_3d", "base", _VP, (_VP, _VP, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_size_t,
                                   ctypes.c_size_t, ctypes.c_size_t)),
    ("ggml_permute", "base", _VP, (_VP, _VP, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)),
    ("ggml_cont_2d", "base", _VP, (_VP, _VP, ctypes.c_int64, ctypes.c_int64)),
    ("ggml_cpy", "base", _VP, (_VP, _VP, _VP)),
    ("ggml_concat", "base", _VP, (_VP, _VP, _VP, ctypes.c_int)),
    ("ggml_cont", "base", _VP, (_VP, _VP)),
    ("ggml_new_tensor_4d", "base", _VP, (_VP, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int64)),
    ("ggml_reshape_4d", "base", _VP, (_VP, _VP, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)),
    ("ggml_view_4d", "base", _VP, (_VP, _VP, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)),
    ("ggml_set_rows", "base", _VP, (_VP, _VP, _VP, _VP)),
    ("ggml_get_rows", "base", _VP, (_VP, _VP, _VP)),
    ("ggml_soft_max_ext", "base", _VP, (_VP, _VP, _VP, ctypes.c_float, ctypes.c_float)),
    ("ggml_rms_norm", "base", _VP, (_VP, _VP, ctypes.c_float)),
    ("ggml_mul", "base", _VP, (_VP, _VP, _VP)),
    ("ggml_add", "base", _VP, (_VP, _VP, _VP)),
    ("ggml_scale", "base", _VP, (_VP, _VP, ctypes.c_float)),
    ("ggml_geglu_split", "base", _VP, (_VP, _VP, _VP)),
    ("ggml_swiglu_split", "base", _VP, (_VP, _VP, _VP)),
    # the expert layer (llama.cpp's build_moe_ffn)
    ("ggml_mul_mat_id", "base", _VP, (_VP, _VP, _VP, _VP)),
    ("ggml_soft_max", "base", _VP, (_VP, _VP)),
    ("ggml_argsort_top_k", "base", _VP, (_VP, _VP, ctypes.c_int)),
    ("ggml_sum_rows", "base", _VP, (_VP, _VP)),
    ("ggml_clamp", "base", _VP, (_VP, _VP, ctypes.c_float, ctypes.c_float)),
    ("ggml_div", "base", _VP, (_VP, _VP, _VP)),
    ("ggml_silu", "base", _VP, (_VP, _VP)),
    # ctx, a, positions, frequency factors, n_dims, mode, n_ctx_orig, freq_base, freq_scale,
    # ext_factor, attn_factor, beta_fast, beta_slow
    ("ggml_rope_ext", "base", _VP, (_VP, _VP, _VP, _VP, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float,
                                    ctypes.c_float, ctypes.c_float)),
    ("ggml_backend_cpu_buffer_from_ptr", "base", _VP, (_VP, ctypes.c_size_t)),
    ("ggml_backend_cpu_buffer_type", "base", _VP, ()),
    ("ggml_backend_buffer_free", "base", None, (_VP,)),
    ("ggml_backend_tensor_alloc", "base", ctypes.c_int, (_VP, _VP, _VP)),
    ("ggml_backend_graph_compute", "base", ctypes.c_int, (_VP, _VP)),
    ("ggml_gallocr_new", "base", _VP, (_VP,)),
    ("ggml_gallocr_free", "base", None, (_VP,)),
    ("ggml_gallocr_alloc_graph", "base", ctypes.c_bool, (_VP, _VP)),
    ("ggml_gallocr_reserve", "base", ctypes.c_bool, (_VP, _VP)),
    ("ggml_gallocr_get_buffer_size", "base", ctypes.c_size_t, (_VP, ctypes.c_int)),
    ("ggml_quantize_chunk", "base", ctypes.c_size_t,
     (ctypes.c_int, _VP, _VP, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _VP)),
    ("ggml_quantize_requires_imatrix", "base", ctypes.c_bool, (ctypes.c_int,)),
    ("ggml_backend_buft_alloc_buffer", "base", _VP, (_VP, ctypes.c_size_t)),
    ("ggml_backend_buffer_get_base", "base", _VP, (_VP,)),
    ("ggml_backend_buffer_get_type", "base", _VP, (_VP,)),
    ("ggml_backend_tensor_set", "base", None, (_VP, _VP, ctypes.c_size_t, ctypes.c_size_t)),
    ("ggml_log_set", "base", None, (_VP, _VP)),
    ("ggml_cpu_has_avx2", "cpu", ctypes.c_int, ()),
    ("ggml_backend_cpu_init", "cpu", _VP, ()),
    ("ggml_backend_cpu_set_n_threads", "cpu", None, (_VP, ctypes.c_int)),
)


GGML_LOG_WARN, GGML_LOG_ERROR, GGML_LOG_CONT = 3, 4, 5
"""ggml's log levels kept (NONE 0, DEBUG 1 and INFO 2 are dropped); CONT continues the message before."""
_LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class GgmlLog:
    """ggml's log, into this module's logger: warnings and errors as they come, its debug and info
    lines dropped (by default ggml writes every line to stderr, a line per repacked tensor: over a
    hundred a stage of an expert file)."""

    def __init__(self) -> None:
        self.kept = False  # whether the message a CONT line continues was kept
        self.callback = _LogCallback(self._log)  # referenced as long as ggml may call it

    def _log(self, level: int, text: bytes | None, _user_data: int | None) -> None:
        if level != GGML_LOG_CONT:
            self.kept = level >= GGML_LOG_WARN
        if self.kept and text:
            _log.log(logging.ERROR if level == GGML_LOG_ERROR else logging.WARNING, "ggml: %s",
                     text.decode("utf-8", "replace").rstrip())


def library_dir() -> Path | None:
    """Where the ggml libraries are: $SKIPPY_ZMQ_GGML_LIB, else llama-cpp-python's lib/ (not imported)."""
    named = os.environ.get(LIB_ENV, "").strip()
    if named:
        return Path(named)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


class Library:
    """The loaded ggml libraries and the declared functions (one per process: `Library.get()`)."""

    _instance: ClassVar[Library | None] = None
    _lock: ClassVar[threading.RLock] = threading.RLock()

    def __init__(self, directory: Path) -> None:
        """Load the libraries in `directory` (base first: the CPU backend links against it)."""
        names = {"base": "libggml-base.so", "cpu": "libggml-cpu*.so"}
        self.directory = directory
        self._libs: dict[str, ctypes.CDLL] = {}
        for role, pattern in names.items():
            found = sorted(glob.glob(str(directory / pattern)))
            if not found:
                raise ModelLoadError(f"the ggml kernel needs {pattern} in {directory}, which has none; {EXTRA_HINT}"
                                     f" or set ${LIB_ENV}")
            try:
                self._libs[role] = ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise ModelLoadError(f"cannot load {found[0]}: {exc}") from None
        for name, role, result, args in _FUNCTIONS:
            try:
                function = getattr(self._libs[role], name)
            except AttributeError:
                raise ModelLoadError(f"{directory}: ggml function {name} is missing; this ggml build is too old "
                                     "or not ggml") from None
            function.restype, function.argtypes = result, list(args)
            setattr(self, name, function)
        self.log = GgmlLog()
        self.own_log()
        self.repack_buffer_type = self._repack_buffer_type()

    def own_log(self) -> None:
        """Route ggml's log through `GgmlLog` again: llama.cpp's own library sets ggml's logger too (the
        tokenizer loads a vocabulary through it), so `Weights`, whose repacking logs a line per tensor,
        takes it back first."""
        self.ggml_log_set(ctypes.cast(self.log.callback, _VP), None)

    def _repack_buffer_type(self) -> int | None:
        """The CPU backend's repacking buffer type (a C++ symbol, `ggml_backend_cpu_repack_buffer_type()`),
        or None when this build has none or this CPU has no kernel for it (REPACKED_TYPES)."""
        try:
            function = self._libs["cpu"]._Z35ggml_backend_cpu_repack_buffer_typev
        except AttributeError:
            return None
        function.restype, function.argtypes = _VP, []
        if not self.ggml_cpu_has_avx2():
            return None
        return int(function())

    def repacks(self, type_name: str, rows: int) -> bool:
        """Whether a matrix of this type and row count is repacked into the CPU backend's interleaved
        layout when placed in `repack_buffer_type` (the rule of ggml-cpu's repack.cpp on x86)."""
        return self.repack_buffer_type is not None and type_name in REPACKED_TYPES and rows % REPACK_ROWS == 0

    @classmethod
    def get(cls) -> Library:
        """The process's library; ModelLoadError naming the extra when it is not installed."""
        with cls._lock:
            if cls._instance is None:
                directory = library_dir()
                if directory is None or not directory.is_dir():
                    raise ModelLoadError(f"the ggml kernel needs llama-cpp-python's ggml libraries; {EXTRA_HINT} "
                                         f"or set ${LIB_ENV} to a directory holding libggml-base.so")
                cls._instance = cls(directory)
            return cls._instance

    def __getattr__(self, name: str) -> Any:
        """A declared C function (set in __init__); mypy sees them as Any."""
        raise AttributeError(name)


def unavailable() -> str | None:
    """None when the ggml kernel can run here, else why not."""
    try:
        Library.get()
    except ModelLoadError as exc:
        return str(exc)
    return None


def check_type(type_name: str, name: str, where: str) -> int:
    """ggml's id of a weight type, or ModelLoadError naming the tensor, its type and the supported list."""
    if type_name not in GGML_TYPES:
        raise ModelLoadError(f"{where}: tensor {name!r} has type {type_name}, which the ggml kernel does not "
                             f"support; supported: {', '.join(GGML_TYPES)}")
    return GGML_TYPES[type_name]


def aligned(data: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """`data` itself when ggml may use its address, else a copy at an aligned address (a file whose
    alignment is below TENSOR_ALIGNMENT, or bytes made in memory): ggml would abort on it."""
    if data.ctypes.data % TENSOR_ALIGNMENT == 0:
        return data
    store = np.empty(data.nbytes + TENSOR_ALIGNMENT, dtype=np.uint8)
    start = -store.ctypes.data % TENSOR_ALIGNMENT
    copy = store[start:start + data.nbytes]
    copy[:] = data
    return copy


class Backend:
    """One CPU backend with its thread count; products on it run one at a time (a lock)."""

    def __init__(self, lib: Library, threads: int) -> None:
        self.lib = lib
        self.threads = threads
        self.handle = lib.ggml_backend_cpu_init()
        if not self.handle:
            raise ModelLoadError("ggml_backend_cpu_init failed")
        lib.ggml_backend_cpu_set_n_threads(self.handle, threads)
        self.lock = threading.Lock()

    _shared: ClassVar[dict[int, Backend]] = {}

    @classmethod
    def shared(cls, threads: int) -> Backend:
        """The process's backend for `threads` threads (made once; never freed: it lives as long as the stage)."""
        with Library._lock:
            if threads not in cls._shared:
                cls._shared[threads] = cls(Library.get(), threads)
            return cls._shared[threads]

    def compute(self, graph: int) -> None:
        """Run a graph; ModelLoadError if ggml reports a failure."""
        status = self.lib.ggml_backend_graph_compute(self.handle, graph)
        if status != 0:
            raise ModelLoadError(f"ggml_backend_graph_compute failed with status {status}")


REPACKED_TYPES = frozenset({"Q4_0", "Q4_K"})
"""Types ggml's CPU backend repacks on x86 with AVX2 (8 rows interleaved, products by GEMM kernels
that read each block once for many rows): what llama.cpp does by default (its --repack)."""
REPACK_ROWS = 8
"""Rows interleaved per repacked block; a matrix whose rows are not a multiple stays as it is."""


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.restype, _LIBC.madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def drop_pages(data: npt.NDArray[np.uint8]) -> None:
    """Let the kernel take back the mapped file pages under `data` (copied into a repacked buffer, or
    into ONNX Runtime's packed head): the mapping stays valid and reads them again if ever touched."""
    page = mmap.PAGESIZE
    start = -(-data.ctypes.data // page) * page
    end = (data.ctypes.data + data.nbytes) // page * page
    if end > start:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


class Weights:
    """ggml tensors over the bytes of `BlockMatrix`es: one no-alloc context, one CPU buffer per matrix.

    With `repack`, a matrix the CPU backend can repack (`Library.repacks`) is copied once into its
    interleaved layout. With `huge` (compute/huge_pages.py), such a buffer asks for huge pages, and
    a file-backed matrix that holds a whole one is copied into a buffer that does too. The file's
    pages under a copied matrix are dropped from this process; the others stay where they lie."""

    def __init__(self, lib: Library, matrices: Sequence[BlockMatrix], where: str, repack: bool = False,
                 huge: bool | None = None) -> None:
        """Bind `matrices`; `huge` None takes the environment's choice (`huge_pages.wanted`)."""
        huge = huge_pages.wanted() if huge is None else huge
        lib.own_log()
        self.lib = lib
        self._keep: list[object] = list(matrices)  # the bytes must outlive the tensors over them
        self.ctx = lib.ggml_init(InitParams(lib.ggml_tensor_overhead() * (len(matrices) + 1), None, True))
        self.buffers: list[int] = []
        self.tensors: list[int] = []
        self.repacked_bytes = 0
        self.copied_bytes = 0  # file-backed matrices copied as they are, for huge pages
        self.huge_bytes = 0  # bytes of the copies advised to live on huge pages
        for matrix in matrices:
            type_id = check_type(matrix.type_name, matrix.name, where)
            if matrix.k % lib.ggml_blck_size(type_id):
                raise ModelLoadError(f"{where}: tensor {matrix.name!r} rows of {matrix.k} values are not whole "
                                     f"{matrix.type_name} blocks of {lib.ggml_blck_size(type_id)}")
            expected = lib.ggml_row_size(type_id, matrix.k) * matrix.n * max(1, matrix.experts)
            if matrix.data.nbytes != expected:
                shape = f"{matrix.experts} x " * (matrix.experts > 0) + f"{matrix.n} x {matrix.k}"
                raise ModelLoadError(f"{where}: tensor {matrix.name!r} ({matrix.type_name}, {shape}) "
                                     f"has {matrix.data.nbytes} bytes of data; its shape needs {expected}")
            if matrix.experts:  # (k, n, experts) in ggml's order: what ggml_mul_mat_id selects from
                tensor = lib.ggml_new_tensor_3d(self.ctx, type_id, matrix.k, matrix.n, matrix.experts)
            else:
                tensor = lib.ggml_new_tensor_2d(self.ctx, type_id, matrix.k, matrix.n)
            if repack and lib.repacks(matrix.type_name, matrix.n) and lib.repack_buffer_type is not None:
                self._copy(tensor, matrix, lib.repack_buffer_type, huge, where)
                self.repacked_bytes += matrix.data.nbytes
                continue
            if huge and matrix.file_backed and matrix.data.nbytes >= huge_pages.WHOLE_PAGE_BYTES:
                self._copy(tensor, matrix, lib.ggml_backend_cpu_buffer_type(), huge, where)
                self.copied_bytes += matrix.data.nbytes
                continue
            data = aligned(matrix.data)
            self._keep.append(data)
            address = data.ctypes.data
            buffer = lib.ggml_backend_cpu_buffer_from_ptr(address, data.nbytes)
            if lib.ggml_backend_tensor_alloc(buffer, tensor, address) != 0:
                raise ModelLoadError(f"{where}: ggml could not place tensor {matrix.name!r} at its bytes")
            self.buffers.append(buffer)
            self.tensors.append(tensor)

    def _copy(self, tensor: int, matrix: BlockMatrix, buffer_type: int, huge: bool, where: str) -> None:
        """Place `tensor` in a buffer of its own of `buffer_type` (on huge pages with `huge`) and copy
        the matrix in; a repacking buffer type interleaves it as it copies."""
        lib = self.lib
        nbytes = matrix.data.nbytes
        buffer = lib.ggml_backend_buft_alloc_buffer(buffer_type, nbytes)
        if not buffer:
            raise ModelLoadError(f"{where}: ggml could not allocate {nbytes} bytes to copy tensor {matrix.name!r}")
        self.buffers.append(buffer)
        base = lib.ggml_backend_buffer_get_base(buffer)
        if huge:  # before the copy first writes the pages
            self.huge_bytes += huge_pages.advise(base, nbytes)
        if lib.ggml_backend_tensor_alloc(buffer, tensor, base) != 0:
            raise ModelLoadError(f"{where}: ggml could not place tensor {matrix.name!r} in its own buffer")
        source = np.ascontiguousarray(matrix.data)
        lib.ggml_backend_tensor_set(tensor, source.ctypes.data, 0, nbytes)
        if matrix.file_backed:
            drop_pages(matrix.data)
        self.tensors.append(tensor)

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        for buffer in getattr(self, "buffers", ()):
            lib.ggml_backend_buffer_free(buffer)
        if getattr(self, "ctx", None):
            lib.ggml_free(self.ctx)


class Graph:
    """A graph of one input `x` (rows, k) and the outputs `build(ctx, x)` returns, (rows, width_i)
    each, allocated by its own graph allocator: numpy views of ggml's buffers."""

    def __init__(self, lib: Library, k: int, rows: int, build: Callable[[int, int], Sequence[int]],
                 widths: Sequence[int]) -> None:
        self.lib = lib
        nodes = 2 * len(widths) + 16
        size = lib.ggml_tensor_overhead() * nodes + lib.ggml_graph_overhead_custom(nodes, False)
        self.ctx = lib.ggml_init(InitParams(size, None, True))
        self.allocator = None
        graph = lib.ggml_new_graph_custom(self.ctx, nodes, False)
        x = lib.ggml_new_tensor_2d(self.ctx, GGML_TYPES["F32"], k, rows)  # ne0 = k: row-major (rows, k)
        lib.ggml_set_input(x)
        outputs = list(build(self.ctx, x))
        for y in outputs:
            lib.ggml_set_output(y)
            lib.ggml_build_forward_expand(graph, y)
        self.allocator = lib.ggml_gallocr_new(lib.ggml_backend_cpu_buffer_type())
        if not lib.ggml_gallocr_alloc_graph(self.allocator, graph):
            raise ModelLoadError(f"ggml could not allocate a graph of {rows} rows")
        self.graph = graph
        self.x = _view(lib, x, rows, k)
        self.outputs = [_view(lib, y, rows, n) for y, n in zip(outputs, widths, strict=True)]

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        if lib is None:
            return
        if getattr(self, "allocator", None):
            lib.ggml_gallocr_free(self.allocator)
        if getattr(self, "ctx", None):
            lib.ggml_free(self.ctx)


class HostArrays:
    """numpy arrays that ggml tensors are placed on (a CPU buffer over each): a graph reads its
    inputs from them and writes its outputs into them, with no copy in or out."""

    def __init__(self, lib: Library) -> None:
        self.lib = lib
        self._keep: list[npt.NDArray[Any]] = []
        self._buffers: dict[tuple[int, int], int] = {}  # (array address, bytes) -> buffer

    def empty(self, shape: tuple[int, ...], dtype: type[np.generic] = np.float32) -> npt.NDArray[Any]:
        """A zeroed C-contiguous array at an address ggml accepts, kept as long as this object."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        array = aligned(np.zeros(max(nbytes, 1), dtype=np.uint8))[:nbytes].view(dtype).reshape(shape)
        self._keep.append(array)
        return array

    @property
    def nbytes(self) -> int:
        """Bytes of every array made here."""
        return sum(int(array.nbytes) for array in self._keep)

    def place(self, tensor: int, array: npt.NDArray[Any]) -> None:
        """Put `tensor`, whose bytes must be the array's, on the array's memory (one of `empty`'s)."""
        address, nbytes = array.ctypes.data, array.nbytes
        if self.lib.ggml_nbytes(tensor) != nbytes or not array.flags.c_contiguous:
            kind = "an" if array.flags.c_contiguous else "a strided"
            raise ModelLoadError(f"a ggml tensor of {self.lib.ggml_nbytes(tensor)} bytes cannot be placed on {kind} "
                                 f"array of {nbytes} bytes; expected a C-contiguous array of the tensor's bytes")
        # By address and size: one memory may hold tensors of two sizes (a pool slot's first layer of
        # keys, and the whole pool, when its first session prefills beside pooled decode rows).
        buffer = self._buffers.get((address, nbytes))
        if buffer is None:
            buffer = self._buffers[(address, nbytes)] = self.lib.ggml_backend_cpu_buffer_from_ptr(address, nbytes)
        if self.lib.ggml_backend_tensor_alloc(buffer, tensor, address) != 0:
            raise ModelLoadError(f"ggml could not place a tensor on an array of {nbytes} bytes")

    def __del__(self) -> None:
        lib = getattr(self, "lib", None)
        for buffer in getattr(self, "_buffers", {}).values():
            if lib is not None:
                lib.ggml_backend_buffer_free(buffer)


def _view(lib: Library, tensor: int, rows: int, cols: int) -> F32:
    """A float32 (rows, cols) numpy view of an allocated F32 tensor's data."""
    address = lib.ggml_get_data(tensor)
    buffer = (ctypes.c_float * (rows * cols)).from_address(address)
    return np.frombuffer(buffer, dtype=np.float32).reshape(rows, cols)


class MatmulGraphs:
    """`x @ [W_1 | W_2 | ...]` for matrices that share K, from their blocks: one graph per row
    count, the outputs side by side in one (R, sum N_i) array."""

    def __init__(self, matrices: Sequence[BlockMatrix], threads: int, where: str = "", repack: bool = False, *,
                 invariant: bool = False) -> None:
        if not matrices or len({m.k for m in matrices}) != 1:
            raise ModelLoadError(f"{where}: a fused product needs matrices of one input width, got "
                                 f"{[(m.name, m.k) for m in matrices]}")
        self.lib = Library.get()
        self.backend = Backend.shared(threads)
        self.weights = Weights(self.lib, matrices, where, repack=repack)
        self.k = matrices[0].k
        self.widths = tuple(m.n for m in matrices)
        self.n = sum(self.widths)
        self.nbytes = sum(m.data.nbytes for m in matrices)
        self.invariant = invariant  # a row's products in one order whatever the row count (mul_mat)
        self._graphs: OrderedDict[int, Graph] = OrderedDict()

    def __call__(self, x: F32) -> F32:
        """(R, K) float32 -> (R, N)."""
        rows = int(x.shape[0])
        out = np.empty((rows, self.n), dtype=np.float32)
        if rows == 0:
            return out
        with self.backend.lock:
            graph = self._graph(rows)
            np.copyto(graph.x, x, casting="same_kind")
            self.backend.compute(graph.graph)
            start = 0
            for y, width in zip(graph.outputs, self.widths, strict=True):
                out[:, start:start + width] = y
                start += width
        return out

    def compute_only(self, x: F32) -> Callable[[], None]:
        """A call that computes the products of rows `x` alone, with no copies in or out (`bench products`)."""
        rows = int(x.shape[0])
        with self.backend.lock:
            graph = self._graph(rows)
            np.copyto(graph.x, x, casting="same_kind")

        def compute() -> None:
            with self.backend.lock:
                self.backend.compute(graph.graph)

        return compute

    def _products(self, ctx: int, x: int) -> list[int]:
        """y_i = x @ W_i.T, (rows, n_i), for every matrix."""
        return [mul_mat(self.lib, ctx, tensor, x, invariant=self.invariant) for tensor in self.weights.tensors]

    def _graph(self, rows: int) -> Graph:
        graph = self._graphs.get(rows)
        if graph is None:
            graph = self._graphs[rows] = Graph(self.lib, self.k, rows, self._products, self.widths)
            while len(self._graphs) > GRAPHS_PER_MATRIX:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(rows)
        return graph


Q6K_CHECK_ROWS = (1, 5)
"""Activation row counts at which the package's Q6_K product must give ggml's bits, once per process
before any graph holds it (ggml's row-by-row dot product, which it runs below 8 rows)."""
Q4K_CHECK_ROWS = (2, 5, 37)
"""Row counts at which the package's Q4_K product must give ggml's bits, once per process before any graph
holds it: ggml's one-row kernel per row (2), its 4-row kernel and a row after (5), its 16-row kernel, then
its 4-row one and a row after, over several of the op's tiles (37: two of the AVX-512 variant's 32 rows, five
of the AVX2 one's 8)."""
Q80_CHECK_ROWS = (1, 6)
"""Row counts at which the package's Q8_0 product must give ggml's bits, once per process before any graph
holds it: one row, and a tile of four with a partial one after it."""

_native_lock = threading.Lock()
_native: dict[str, products.Native | str] = {}  # "TYPE route" -> the checked product, or why ggml's own runs


def q6k_product() -> products.Native | str:
    """The package's Q6_K product this process puts in graphs (checked once against ggml's), or why
    ggml's own runs; ModelLoadError when $SKIPPY_ZMQ_Q6K names a variant that cannot run or disagrees."""
    return _product(q6k.PRODUCT, _check_q6k)


def q4k_product() -> products.Native | str:
    """The package's Q4_K product over repacked blocks this process puts in graphs (checked once against
    ggml's), or why ggml's own runs; ModelLoadError as for q6k_product, with $SKIPPY_ZMQ_Q4K."""
    return _product(q4k.PRODUCT, _check_q4k)


def _product(compiled: products.Compiled, check: Callable[[products.Native], str | None]) -> products.Native | str:
    asked, env, type_name = compiled.route(), compiled.env, compiled.type_name
    if asked == "ggml":
        return f"${env} = ggml"
    with _native_lock:
        key = f"{type_name} {asked}"
        if key not in _native:
            found = compiled.load(asked)
            if isinstance(found, products.Native):
                why = check(found)
                if why is not None:
                    found = why
            if isinstance(found, str):
                if asked != "auto":
                    raise ModelLoadError(f"${env} = {asked}, but that product cannot run here: {found}")
                _log.warning("%s matrices multiply by ggml's product: %s", type_name, found)
            _native[key] = found
        return _native[key]


def q80_product() -> products.Native | str:
    """The package's Q8_0 product this process puts in graphs (checked once against ggml's), or why ggml's
    own runs; ModelLoadError as for q6k_product, with $SKIPPY_ZMQ_Q80."""
    return _product(q80.PRODUCT, _check_q80)


def q6k_described() -> str:
    """Who multiplies Q6_K matrices in this process, for a stage's load line."""
    product = q6k_product()
    if isinstance(product, products.Native):
        long_k = product.variants[product.variant].long_k
        rule = "" if long_k is None else f", matrices of {long_k} inputs or more by single rows only, others from 2"
        return (f"the package's product ({product.variant}, {product.min_rows} to {product.max_rows} rows{rule}; "
                "ggml's outside them)")
    return f"ggml's ({product})"


def q80_described() -> str:
    """Who multiplies Q8_0 matrices in this process, for a stage's load line."""
    product = q80_product()
    if isinstance(product, products.Native):
        return f"the package's Q8_0 product ({product.variant})"
    return f"ggml's ({product})"


def q4k_described() -> str:
    """Who multiplies repacked Q4_K matrices at 2 or more rows in this process, for a stage's load line."""
    product = q4k_product()
    if isinstance(product, products.Native):
        return f"the package's product ({product.variant})"
    return f"ggml's ({product})"


def mul_mat(lib: Library, ctx: int, weight: int, x: int, *, invariant: bool = False) -> int:
    """`weight` (n, k) times rows `x` (rows, k) in the graph of `ctx`, (rows, n): ggml_mul_mat, or one of the
    package's ops where `native_product` names one (docs/ARCHITECTURE.md, "The Q6_K product", "The Q4_K
    product", "The Q8_0 product"); `invariant`: a row's products in one order whatever the row count
    (INVARIANT_TYPES)."""
    product = native_product(lib, weight, x, invariant=invariant)
    if product is None:
        return int(lib.ggml_mul_mat(ctx, weight, x))
    return _custom_op(lib, ctx, product, weight, x, row_by_row=invariant)


INVARIANT_TYPES = frozenset({"Q4_K", "Q6_K", "Q5_0", "Q8_0"})
"""Matrix types whose products the batch-invariant mode holds in one order per row at every row count
(docs/ARCHITECTURE.md, "Batch-invariant mode"): Q6_K by the package's product (ggml's row-by-row dot), a
repacked Q4_K by the package's product with every row as ggml's one-row GEMV, Q5_0 by ggml's own and Q8_0 by
ggml's or the package's, the same bits (one sum per row and weight row at any row count:
tests/compute/test_invariant.py and test_q80.py check it). Not
F32 or F16 matrices: from 2 rows ggml multiplies them by llamafile's GEMM, in another order."""


def native_product(lib: Library, weight: int, x: int, *, invariant: bool = False) -> products.Native | None:
    """The package's product `mul_mat` puts in a graph for these two tensors, or None for ggml's: the Q6_K
    one for a Q6_K weight and up to its rows, the Q4_K one for a repacked Q4_K weight and 2 up to its rows
    (`invariant`: at any row count from those), the Q8_0 one for a Q8_0 weight ggml did not repack (a single
    row only of a short matrix); the rows contiguous float32 either way."""
    w, a = TensorHead.of(weight), TensorHead.of(x)
    if not (a.type == GGML_TYPES["F32"] and w.ne[0] == a.ne[0] and a.ne[2] == a.ne[3] == 1
            and w.ne[2] == w.ne[3] == 1 and lib.ggml_is_contiguous(x)):
        return None
    rows = int(a.ne[1])
    if w.type == GGML_TYPES["Q6_K"]:
        product, fewest = q6k_product(), 1
    elif w.type == GGML_TYPES["Q4_K"] and rows >= q4k.MIN_ROWS and _repacked(lib, w):
        product, fewest = q4k_product(), q4k.MIN_ROWS
    elif w.type == GGML_TYPES["Q8_0"] and not _repacked(lib, w):  # a long single row: ggml's (Variant.takes)
        product, fewest = q80_product(), 1
    else:
        return None
    most = 1 << 62 if invariant else product.max_rows if isinstance(product, products.Native) else 0
    if (isinstance(product, products.Native) and max(fewest, product.min_rows) <= rows <= most
            and product.takes(rows, int(w.ne[0]))):
        return product
    return None


def repacked(lib: Library, tensor: int) -> bool:
    """Whether a matrix lies in the CPU backend's repacking buffer type (ggml's interleaved layout)."""
    return _repacked(lib, TensorHead.of(tensor))


def _repacked(lib: Library, tensor: TensorHead) -> bool:
    """Whether the tensor lies in the CPU backend's repacking buffer type (ggml's interleaved layout)."""
    return (lib.repack_buffer_type is not None and bool(tensor.buffer)
            and lib.ggml_backend_buffer_get_type(tensor.buffer) == lib.repack_buffer_type)


def _custom_op(lib: Library, ctx: int, product: products.Native, weight: int, x: int, *,
               row_by_row: bool = False) -> int:
    """The package's op in the graph; `row_by_row` asks the Q4_K one for ggml's one-row sums on every row."""
    head = TensorHead.of(weight)
    n, rows = int(head.ne[1]), int(TensorHead.of(x).ne[1])  # the output: rows x n
    args = (_VP * 2)(weight, x)  # ggml copies them into the new tensor's sources
    flags = q4k.ROW_BY_ROW if row_by_row and head.type == GGML_TYPES["Q4_K"] else 0
    return int(lib.ggml_custom_4d(ctx, GGML_TYPES["F32"], n, rows, 1, 1, ctypes.cast(args, _VP), 2,
                                  product.function, _N_TASKS_MAX, product.userdata | flags))


def _check_q6k(product: products.Native) -> str | None:
    """None when `product` gives ggml's products of a random Q6_K matrix bit for bit (Q6K_CHECK_ROWS), else
    what differs: this also checks the tensor layout the op reads against this ggml build."""
    n, k = 24, 512
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (n * k // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.full((1,), 2.0 ** -7, dtype=np.float16).view(np.uint8)  # d, finite
    matrix = BlockMatrix(name="<the Q6_K check>", type_name="Q6_K", k=k, n=n, data=blocks.reshape(-1))
    return _check(product, Weights(Library.get(), [matrix], "the Q6_K check"), Q6K_CHECK_ROWS, rng)


def _check_q4k(product: products.Native) -> str | None:
    """As _check_q6k, for the Q4_K product over a random matrix ggml quantized and repacked (Q4K_CHECK_ROWS)."""
    lib = Library.get()
    n, k = 64, 512
    if not lib.repacks("Q4_K", n):
        return "ggml repacks no Q4_K matrix on this CPU or build"
    rng = np.random.default_rng(0)
    matrix = BlockMatrix(name="<the Q4_K check>", type_name="Q4_K", k=k, n=n,
                         data=quantize("Q4_K", rng.standard_normal((n, k)).astype(np.float32)))
    return _check(product, Weights(lib, [matrix], "the Q4_K check", repack=True), Q4K_CHECK_ROWS, rng)


def _check_q80(product: products.Native) -> str | None:
    """As _check_q6k, for the Q8_0 product over a random matrix ggml quantized (Q80_CHECK_ROWS); 26 rows, so
    both threads' ranges end in a partial group."""
    n, k = 26, 256
    rng = np.random.default_rng(0)
    matrix = BlockMatrix(name="<the Q8_0 check>", type_name="Q8_0", k=k, n=n,
                         data=quantize("Q8_0", rng.standard_normal((n, k)).astype(np.float32)))
    return _check(product, Weights(Library.get(), [matrix], "the Q8_0 check"), Q80_CHECK_ROWS, rng)


def _check(product: products.Native, weights: Weights, row_counts: Sequence[int],
           rng: np.random.Generator) -> str | None:
    lib = Library.get()
    tensor = weights.tensors[0]
    k, n = (int(size) for size in TensorHead.of(tensor).ne[:2])
    # A backend of its own: the check runs while a graph is built, under the shared backends' locks.
    # Two threads, each taking its share of the weight rows.
    backend = Backend(lib, 2)
    for rows in row_counts:
        def both(ctx: int, x: int) -> list[int]:
            return [int(lib.ggml_mul_mat(ctx, tensor, x)), _custom_op(lib, ctx, product, tensor, x)]

        graph = Graph(lib, k, rows, both, [n, n])
        graph.x[:] = rng.standard_normal((rows, k)).astype(np.float32)
        graph.outputs[1][:] = np.nan  # an op that wrote nothing must not pass on what memory held before
        with backend.lock:
            backend.compute(graph.graph)
        theirs, ours = graph.outputs
        if not np.array_equal(theirs, ours):
            differ = int(np.count_nonzero(theirs != ours))
            gaps = np.abs(theirs - ours)[np.isfinite(ours)]
            by = f"by up to {float(gaps.max()):.3g}" if gaps.size else "writing no finite number"
            return (f"the {product.variant} product differs from ggml's in {differ} of {theirs.size} outputs at "
                    f"{rows} rows ({by}); expected its bits")
    return None


def quantize(type_name: str, values: F32) -> npt.NDArray[np.uint8]:
    """`values` (n, k) quantized to `type_name` blocks by ggml itself (tests and tools make files with it)."""
    lib = Library.get()
    type_id = check_type(type_name, "<array>", "quantize")
    if lib.ggml_quantize_requires_imatrix(type_id):  # ggml would abort the process
        raise ModelLoadError(f"quantize: {type_name} needs an importance matrix, which this function does not take")
    n, k = values.shape
    source = np.ascontiguousarray(values, dtype=np.float32)
    out = aligned(np.empty(lib.ggml_row_size(type_id, k) * n, dtype=np.uint8))
    written = lib.ggml_quantize_chunk(type_id, source.ctypes.data, out.ctypes.data, 0, n, k, None)
    if written != out.nbytes:
        raise ModelLoadError(f"ggml_quantize_chunk wrote {written} bytes of {type_name}; expected {out.nbytes}")
    return out
