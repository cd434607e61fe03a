"""GGUF model files: hyper-parameters and tensors, dequantized to float32 on demand."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ModelLoadError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("gemma3", "llama")

# Gemma 3: every sixth layer (il % 6 == 5) attends globally, the others use the sliding window.
GEMMA3_GLOBAL_LAYER_PERIOD = 6
# Gemma 3 local (sliding-window) layers use this RoPE base whatever rope.freq_base says.
GEMMA3_LOCAL_ROPE_FREQ_BASE = 10000.0

# Rows dequantized per call when a whole tensor is needed; bounds the temporary memory.
_DEQUANT_CHUNK_ROWS = 8192


def require_gguf() -> Any:
    """The optional gguf module; ModelLoadError explaining how to install it when absent."""
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError(
            "the gguf package is required to load models; install skippy-zmq[model]"
        ) from exc
    return gguf


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Open a GGUF file for reading (memory-mapped); ModelLoadError if it cannot be read."""
    gguf = require_gguf()
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{p}: model file does not exist")
    try:
        return _plain_view_reader_type(gguf)(p, "r")
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ModelLoadError(f"{p}: not a readable GGUF file: {exc}") from exc


@functools.cache
def _plain_view_reader_type(gguf: Any) -> type[GGUFReader]:
    """GGUFReader reading through a plain ndarray view of its np.memmap: about 3x faster.

    The stock reader slices np.memmap once per metadata item (a million times for a
    262k-token vocab) and each memmap slice runs Python-level __array_finalize__; a
    plain view of the same mapping reads the same bytes without that cost.
    """

    class PlainViewReader(gguf.GGUFReader):  # type: ignore[misc, name-defined]
        def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
                 override_order: str | None = None) -> npt.NDArray[Any]:
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            dt = np.dtype(dtype)
            count = int(count)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return PlainViewReader


def _field(reader: GGUFReader, key: str, default: Any = None, *, source: str) -> Any:
    """One metadata value by key; ModelLoadError if absent and no default is given."""
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"{source}: metadata key {key!r} is missing")
        return default
    return field.contents()


def _positive(name: str) -> Any:
    """Attrs validator: an int field must be > 0."""

    def check(_inst: object, _attr: object, value: int) -> None:
        if value <= 0:
            raise ModelLoadError(f"model hyper-parameter {name} = {value} must be > 0")

    return check


def _non_negative(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    """Attrs validator: an int field must be >= 0."""
    if value < 0:
        raise ModelLoadError(f"model hyper-parameter {attr.name} = {value} must be >= 0")


def _known_arch(_inst: object, _attr: object, value: str) -> None:
    """Attrs validator: the architecture must be one this runtime implements."""
    if value not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {value!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


@attrs.frozen
class ModelHParams:
    """Dimensions and constants of a decoder-only transformer, as the GGUF metadata says."""

    arch: str = attrs.field(validator=_known_arch)
    n_layer: int = attrs.field(validator=_positive("n_layer"))
    n_embd: int = attrs.field(validator=_positive("n_embd"))
    n_head: int = attrs.field(validator=_positive("n_head"))
    n_head_kv: int = attrs.field(validator=_positive("n_head_kv"))
    head_dim: int = attrs.field(validator=_positive("head_dim"))
    n_ff: int = attrs.field(validator=_positive("n_ff"))
    n_vocab: int = attrs.field(validator=_positive("n_vocab"))
    rms_eps: float
    rope_freq_base: float
    rope_freq_base_local: float
    rope_neox: bool
    sliding_window: int = attrs.field(validator=_non_negative)
    n_ctx_train: int = attrs.field(validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        """Check relations between fields (GQA grouping, even head_dim for RoPE)."""
        if self.n_head % self.n_head_kv != 0:
            raise ModelLoadError(
                f"n_head {self.n_head} must be a multiple of n_head_kv {self.n_head_kv}"
            )
        if self.head_dim % 2 != 0:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even for RoPE")
        if not (self.rms_eps > 0 and math.isfinite(self.rms_eps)):
            raise ModelLoadError(f"rms_eps {self.rms_eps} must be a positive finite number")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> ModelHParams:
        """Read the hyper-parameters of a GGUF model file (cached per file version)."""
        p = Path(path)
        try:
            st = p.stat()
        except OSError as exc:
            raise ModelLoadError(f"{p}: model file does not exist") from exc
        # Parsing a 262k-token vocab takes seconds; workers ask before loading the stage.
        return _hparams_of_file(str(p.resolve()), st.st_mtime_ns, st.st_size)

    @classmethod
    def from_reader(cls, reader: GGUFReader, *, source: str) -> ModelHParams:
        """Read the hyper-parameters from an open GGUF reader."""
        arch = str(_field(reader, "general.architecture", source=source))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def key(name: str, default: Any = None) -> Any:
            return _field(reader, f"{arch}.{name}", default, source=source)

        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        value_dim = int(key("attention.value_length", head_dim))
        if value_dim != head_dim:
            raise ModelLoadError(
                f"{source}: attention.value_length {value_dim} != key_length {head_dim}; "
                "only equal key and value head sizes are supported"
            )
        rope_dims = int(key("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            raise ModelLoadError(
                f"{source}: rope.dimension_count {rope_dims} != head_dim {head_dim}; "
                "only RoPE over the full head is supported"
            )
        scaling = str(key("rope.scaling.type", "none"))
        if scaling not in ("none", "") and float(key("rope.scaling.factor", 1.0)) != 1.0:
            raise ModelLoadError(f"{source}: RoPE scaling {scaling!r} is not supported")
        embd = reader.get_tensor(_tensor_index(reader, "token_embd.weight", source))
        n_vocab = int(embd.shape[1])
        rope_base = float(key("rope.freq_base", 10000.0))
        if arch == "gemma3":
            sliding_window = int(key("attention.sliding_window", 0))
            rope_local = GEMMA3_LOCAL_ROPE_FREQ_BASE
            rope_neox = True
        else:
            sliding_window = 0
            rope_local = rope_base
            rope_neox = False
        return cls(
            arch=arch,
            n_layer=int(key("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(key("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_ff=int(key("feed_forward_length")),
            n_vocab=n_vocab,
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_freq_base=rope_base,
            rope_freq_base_local=rope_local,
            rope_neox=rope_neox,
            sliding_window=sliding_window,
            n_ctx_train=int(key("context_length", 0)),
        )

    def is_sliding_layer(self, il: int) -> bool:
        """Whether layer il attends only to the last sliding_window positions."""
        if self.arch != "gemma3" or self.sliding_window == 0:
            return False
        return il % GEMMA3_GLOBAL_LAYER_PERIOD != GEMMA3_GLOBAL_LAYER_PERIOD - 1

    def layer_rope_base(self, il: int) -> float:
        """RoPE frequency base of layer il (local layers differ on Gemma 3)."""
        return self.rope_freq_base_local if self.is_sliding_layer(il) else self.rope_freq_base


@functools.lru_cache(maxsize=8)
def _hparams_of_file(path: str, _mtime_ns: int, _size: int) -> ModelHParams:
    """Hyper-parameters of one version of a file (the key includes mtime and size)."""
    return ModelHParams.from_reader(open_gguf(path), source=path)


def read_hparams(path: str | os.PathLike[str]) -> ModelHParams:
    """Read the hyper-parameters of a GGUF model file."""
    return ModelHParams.from_gguf(path)


def _tensor_index(reader: GGUFReader, name: str, source: str) -> int:
    """Index of a tensor in the reader; ModelLoadError naming it when absent."""
    for i, tensor in enumerate(reader.tensors):
        if tensor.name == name:
            return i
    raise ModelLoadError(f"{source}: tensor {name!r} is missing")


class GGUFModel:
    """An open GGUF file: hyper-parameters plus tensors by name, dequantized on request."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open the file and read its metadata; tensors stay memory-mapped until asked for."""
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.hparams = ModelHParams.from_reader(self.reader, source=str(self.path))
        self._tensors: dict[str, ReaderTensor] = {t.name: t for t in self.reader.tensors}

    def has_tensor(self, name: str) -> bool:
        """Whether the file holds a tensor of that name."""
        return name in self._tensors

    def _tensor(self, name: str, shape: Sequence[int]) -> ReaderTensor:
        """The raw tensor, checked to have the numpy (row-major) shape expected."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        got = tuple(int(d) for d in reversed(tensor.shape))
        if got != tuple(shape):
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has shape {got}, expected {tuple(shape)}"
            )
        return tensor

    def tensor_type_name(self, name: str) -> str:
        """GGML type name of a tensor (F32, Q8_0, ...)."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        return str(tensor.tensor_type.name)

    def load_f32(self, name: str, shape: Sequence[int]) -> npt.NDArray[np.float32]:
        """The whole tensor dequantized to a fresh C-contiguous float32 array of `shape`."""
        tensor = self._tensor(name, shape)
        out = np.empty(tuple(shape), dtype=np.float32)
        if len(shape) == 1:
            out[:] = self._dequantize(tensor, tensor.data).reshape(shape)
            return out
        rows = out.reshape(-1, shape[-1])
        data = tensor.data.reshape(rows.shape[0], -1)
        for start in range(0, rows.shape[0], _DEQUANT_CHUNK_ROWS):
            stop = min(start + _DEQUANT_CHUNK_ROWS, rows.shape[0])
            rows[start:stop] = self._dequantize(tensor, data[start:stop])
        return out

    def load_f32_transposed(self, name: str, shape: Sequence[int]) -> npt.NDArray[np.float32]:
        """A 2-D tensor of numpy shape (rows, cols) dequantized into a C-contiguous (cols, rows).

        Matmuls `x @ w_t` with the weight stored (in, out) run faster in OpenBLAS than
        `x @ w.T`; the transpose happens chunk by chunk so no second full copy is made.
        """
        tensor = self._tensor(name, shape)
        rows_n, cols_n = int(shape[0]), int(shape[1])
        out = np.empty((cols_n, rows_n), dtype=np.float32)
        data = tensor.data.reshape(rows_n, -1)
        for start in range(0, rows_n, _DEQUANT_CHUNK_ROWS):
            stop = min(start + _DEQUANT_CHUNK_ROWS, rows_n)
            out[:, start:stop] = self._dequantize(tensor, data[start:stop]).reshape(-1, cols_n).T
        return out

    def row_table(self, name: str, shape: Sequence[int]) -> RowTable:
        """A 2-D tensor left quantized in the memory-mapped file, for dequantizing rows."""
        tensor = self._tensor(name, shape)
        # Each row of a 2-D GGUF tensor is a whole number of quantization blocks.
        return RowTable(name=name, data=tensor.data.reshape(shape[0], -1),
                        qtype=tensor.tensor_type, n_cols=int(shape[1]), source=str(self.path))

    def rows_f32(self, name: str, shape: Sequence[int], row_ids: npt.NDArray[np.int64]
                 ) -> npt.NDArray[np.float32]:
        """Rows `row_ids` of a 2-D tensor dequantized to float32 (len(row_ids), shape[1])."""
        return self.row_table(name, shape).rows(row_ids)

    def _dequantize(self, tensor: ReaderTensor, data: np.ndarray) -> npt.NDArray[np.float32]:
        """Dequantize raw tensor bytes (or float values) with gguf.quants."""
        return _dequantize(data, tensor.tensor_type, tensor.name, str(self.path))


def _dequantize(data: np.ndarray, qtype: Any, name: str, source: str) -> npt.NDArray[np.float32]:
    """gguf.quants.dequantize as float32, with a ModelLoadError for unsupported types."""
    gguf = require_gguf()
    try:
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{source}: tensor {name!r} has type {qtype.name}, which gguf.quants cannot dequantize"
        ) from exc


@attrs.frozen(eq=False)
class RowTable:
    """A quantized 2-D tensor kept in the memory-mapped file; rows dequantized on demand.

    Holds only the tensor's bytes (a view of the file mapping), not the GGUF reader and
    its parsed metadata, so a stage can drop those after loading.
    """

    name: str
    data: np.ndarray  # (n_rows, bytes_per_row) uint8, or (n_rows, n_cols) float
    qtype: Any
    n_cols: int
    source: str

    def rows(self, row_ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """Rows `row_ids` dequantized to float32; (len(row_ids), n_cols)."""
        picked = self.data[row_ids]
        values = _dequantize(picked, self.qtype, self.name, self.source)
        return np.ascontiguousarray(values.reshape(len(row_ids), self.n_cols), dtype=np.float32)
