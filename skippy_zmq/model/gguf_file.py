"""GGUF file headers: the metadata key/values and the tensor-info table, parsed once per file version.

Layout read here (little-endian, GGUF versions 2 and 3): the magic b"GGUF", a u32 version,
a u64 tensor count and a u64 key/value count; the key/value pairs (a length-prefixed key, a
u32 value type, the value); one info record per tensor (name, u32 n_dims, n_dims u64
dimensions innermost first, u32 ggml type, u64 offset into the data section); padding up to
`general.alignment` (32 when absent); then the tensor data. Tensor bytes are not read here:
`GGUFModel` memory-maps them using the offsets of this table.

The gguf package is not needed for this module, so hyper-parameters and the vocab can be
read by processes that never load a tensor.
"""

from __future__ import annotations

import enum
import functools
import math
import mmap
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_T = TypeVar("_T")


class _Required(enum.Enum):
    """Marks an accessor call without a default: a missing key is an error."""

    REQUIRED = enum.auto()


_REQUIRED = _Required.REQUIRED


class GGUFValueType(enum.IntEnum):
    """Type tag of a metadata value, as stored before the value."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class GGUFKey(enum.StrEnum):
    """Metadata keys that do not depend on the architecture."""

    ARCHITECTURE = "general.architecture"
    ALIGNMENT = "general.alignment"
    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENS = "tokenizer.ggml.tokens"
    SCORES = "tokenizer.ggml.scores"
    TOKEN_TYPE = "tokenizer.ggml.token_type"
    BOS_ID = "tokenizer.ggml.bos_token_id"
    EOS_ID = "tokenizer.ggml.eos_token_id"
    UNK_ID = "tokenizer.ggml.unknown_token_id"
    PAD_ID = "tokenizer.ggml.padding_token_id"
    EOT_ID = "tokenizer.ggml.eot_token_id"
    ADD_BOS = "tokenizer.ggml.add_bos_token"
    ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
    RERANK_TEMPLATE = "tokenizer.chat_template.rerank"  # a reranker's prompt, {query} and {document} in it


class ArchKey(enum.StrEnum):
    """Metadata keys stored under the architecture's prefix: `ArchKey.BLOCK_COUNT.of("llama")`."""

    BLOCK_COUNT = "block_count"
    CONTEXT_LENGTH = "context_length"
    EMBEDDING_LENGTH = "embedding_length"
    FEED_FORWARD_LENGTH = "feed_forward_length"
    HEAD_COUNT = "attention.head_count"
    HEAD_COUNT_KV = "attention.head_count_kv"
    KEY_LENGTH = "attention.key_length"
    VALUE_LENGTH = "attention.value_length"
    RMS_EPS = "attention.layer_norm_rms_epsilon"
    SLIDING_WINDOW = "attention.sliding_window"
    ROPE_DIMENSION_COUNT = "rope.dimension_count"
    ROPE_FREQ_BASE = "rope.freq_base"
    ROPE_FREQ_BASE_SWA = "rope.freq_base_swa"
    ROPE_SCALING_TYPE = "rope.scaling.type"
    ROPE_SCALING_FACTOR = "rope.scaling.factor"
    ROPE_SCALE_LINEAR = "rope.scale_linear"  # the older name of the linear factor
    ROPE_SCALING_ATTN_FACTOR = "rope.scaling.attn_factor"
    ROPE_SCALING_ORIG_CTX = "rope.scaling.original_context_length"
    EXPERT_COUNT = "expert_count"
    EXPERT_USED_COUNT = "expert_used_count"
    EXPERT_FEED_FORWARD_LENGTH = "expert_feed_forward_length"
    EXPERT_SHARED_FEED_FORWARD_LENGTH = "expert_shared_feed_forward_length"
    POOLING_TYPE = "pooling_type"  # llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank
    CLASSIFIER_LABELS = "classifier.output_labels"

    def of(self, arch: str) -> str:
        """The full key for one architecture, e.g. "gemma3.block_count"."""
        return f"{arch}.{self.value}"


# A decoded metadata value: numeric arrays as read-only numpy arrays, string arrays as the raw
# bytes of each string (a vocab entry need not be valid UTF-8), arrays of arrays as lists.
MetadataValue = int | float | bool | str | tuple[bytes, ...] | npt.NDArray[Any] | list[Any]

_SCALAR_FORMATS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_ARRAY_DTYPES: dict[GGUFValueType, np.dtype[Any]] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")  # item type, item count
_FILE_HEAD = struct.Struct("<4sIQQ")  # magic, version, tensor count, key/value count


@attrs.frozen
class TensorInfo:
    """One row of the tensor-info table: where a tensor's bytes are and how to read them."""

    name: str
    dims: tuple[int, ...]  # GGUF order: the contiguous (innermost) dimension first
    ggml_type: int  # a gguf.GGMLQuantizationType value
    data_offset: int  # from the start of the file (the data section start plus the stored offset)

    @property
    def shape(self) -> tuple[int, ...]:
        """Dimensions in numpy (row-major) order, outermost first."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        """Number of values the tensor holds."""
        return math.prod(self.dims)


@attrs.frozen(eq=False)
class GGUFHeader:
    """Everything before a GGUF file's tensor data: metadata, tensor infos, data layout."""

    source: str
    version: int
    metadata: Mapping[str, MetadataValue]
    tensors: Mapping[str, TensorInfo]  # in file order
    alignment: int
    data_start: int  # first byte of the data section
    file_size: int
    # Each key's stored type, and for an array its items' type: what a copy must write back.
    value_types: Mapping[str, tuple[GGUFValueType, GGUFValueType | None]] = attrs.field(factory=dict)

    @classmethod
    def parse(cls, buf: mmap.mmap | bytes, source: str) -> GGUFHeader:
        """Parse the header at the start of `buf`; ModelLoadError if it is not a readable GGUF."""
        try:
            return _HeaderParser(buf, source).header()
        except (struct.error, IndexError, ValueError, OverflowError) as exc:
            raise ModelLoadError(
                f"{source}: not a readable GGUF file: header is truncated or malformed ({exc})"
            ) from None

    @overload
    def integer(self, key: str) -> int: ...
    @overload
    def integer(self, key: str, default: _T) -> int | _T: ...
    def integer(self, key: str, default: object = _REQUIRED) -> object:
        """An integer value (any integer type); `default` when absent, else ModelLoadError."""
        if key not in self.metadata:
            return self._absent(key, default)
        value = self.metadata[key]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise self._wrong_type(key, value, "an integer")

    @overload
    def number(self, key: str) -> float: ...
    @overload
    def number(self, key: str, default: _T) -> float | _T: ...
    def number(self, key: str, default: object = _REQUIRED) -> object:
        """A float or integer value as a float; `default` when absent, else ModelLoadError."""
        if key not in self.metadata:
            return self._absent(key, default)
        value = self.metadata[key]
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise self._wrong_type(key, value, "a number")

    @overload
    def flag(self, key: str) -> bool: ...
    @overload
    def flag(self, key: str, default: _T) -> bool | _T: ...
    def flag(self, key: str, default: object = _REQUIRED) -> object:
        """A bool (or integer) value as a bool; `default` when absent, else ModelLoadError."""
        if key not in self.metadata:
            return self._absent(key, default)
        value = self.metadata[key]
        if isinstance(value, int):  # bool is an int
            return bool(value)
        raise self._wrong_type(key, value, "a bool")

    @overload
    def string(self, key: str) -> str: ...
    @overload
    def string(self, key: str, default: _T) -> str | _T: ...
    def string(self, key: str, default: object = _REQUIRED) -> object:
        """A string value; `default` when absent, else ModelLoadError."""
        if key not in self.metadata:
            return self._absent(key, default)
        value = self.metadata[key]
        if isinstance(value, str):
            return value
        raise self._wrong_type(key, value, "a string")

    def strings(self, key: str) -> Sequence[bytes]:
        """An array of strings, each as its raw bytes; ModelLoadError when absent."""
        value = self.metadata.get(key)
        if isinstance(value, tuple):
            return value
        raise self._wrong_type(key, value, "an array of strings")

    def array(self, key: str) -> npt.NDArray[Any]:
        """A numeric array (read-only); ModelLoadError when absent."""
        value = self.metadata.get(key)
        if isinstance(value, np.ndarray):
            return value
        raise self._wrong_type(key, value, "a numeric array")

    def tensor(self, name: str) -> TensorInfo:
        """The info of one tensor; ModelLoadError naming it when absent."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.source}: tensor {name!r} is missing")
        return info

    def _absent(self, key: str, default: object) -> object:
        """`default` for a key the file lacks; ModelLoadError when the key is required."""
        if default is _REQUIRED:
            raise ModelLoadError(f"{self.source}: metadata key {key!r} is missing")
        return default

    def _wrong_type(self, key: str, value: object, expected: str) -> ModelLoadError:
        if value is None:
            return ModelLoadError(f"{self.source}: metadata key {key!r} is missing")
        shown = f"an array of {len(value)}" if isinstance(value, tuple | list | np.ndarray) else repr(value)
        return ModelLoadError(f"{self.source}: metadata key {key!r} is {shown}; expected {expected}")


class _HeaderParser:
    """Reads a header front to back; struct.error or ValueError on truncated or bad bytes."""

    def __init__(self, buf: mmap.mmap | bytes, source: str) -> None:
        self.buf = buf
        self.source = source
        self.pos = 0

    def header(self) -> GGUFHeader:
        magic, version, n_tensors, n_kv = _FILE_HEAD.unpack_from(self.buf, 0)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(
                f"{self.source}: not a readable GGUF file: magic {magic!r} instead of {GGUF_MAGIC!r} "
                "means this is not a GGUF file"
            )
        if version not in SUPPORTED_GGUF_VERSIONS:
            order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ModelLoadError(
                f"{self.source}: GGUF version {version}{order} is not supported; expected 2 or 3, little-endian"
            )
        self.pos = _FILE_HEAD.size
        metadata: dict[str, MetadataValue] = {}
        value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for _ in range(n_kv):
            key = self.string().decode("utf-8", "replace")
            vtype = GGUFValueType(self.u32())
            item_type = GGUFValueType(_U32.unpack_from(self.buf, self.pos)[0]) if vtype == GGUFValueType.ARRAY else None
            metadata[key] = self.value(vtype)
            value_types[key] = (vtype, item_type)
        alignment = metadata.get(GGUFKey.ALIGNMENT, DEFAULT_ALIGNMENT)
        if not (isinstance(alignment, int) and alignment > 0 and alignment & (alignment - 1) == 0):
            raise ModelLoadError(f"{self.source}: general.alignment {alignment!r} must be a power of two")
        infos = [self.tensor_info() for _ in range(n_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            if name in tensors:
                raise ModelLoadError(f"{self.source}: tensor {name!r} is listed twice")
            tensors[name] = TensorInfo(name=name, dims=dims, ggml_type=ggml_type, data_offset=data_start + offset)
        return GGUFHeader(source=self.source, version=version, metadata=metadata, tensors=tensors,
                          alignment=alignment, data_start=data_start, file_size=len(self.buf),
                          value_types=value_types)

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def string(self) -> bytes:
        length = self.u64()
        end = self.pos + length
        if end > len(self.buf):
            raise ValueError(f"string of {length} bytes at offset {self.pos - 8} runs past the end of the file")
        raw = self.buf[self.pos:end]
        self.pos = end
        return raw

    def value(self, vtype: GGUFValueType) -> MetadataValue:
        if vtype == GGUFValueType.STRING:
            return self.string().decode("utf-8", "replace")
        if vtype == GGUFValueType.ARRAY:
            item_type, count = _ARRAY_HEAD.unpack_from(self.buf, self.pos)
            self.pos += _ARRAY_HEAD.size
            return self.array(GGUFValueType(item_type), count)
        fmt = _SCALAR_FORMATS[vtype]
        scalar: int | float | bool = fmt.unpack_from(self.buf, self.pos)[0]
        self.pos += fmt.size
        return scalar

    def array(self, item_type: GGUFValueType, count: int) -> MetadataValue:
        if item_type == GGUFValueType.STRING:
            return self.string_array(count)
        if item_type == GGUFValueType.ARRAY:
            return [self.value(item_type) for _ in range(count)]
        dtype = _ARRAY_DTYPES[item_type]
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        values.flags.writeable = False  # shared by every reader of the cached header
        self.pos += dtype.itemsize * count
        return values

    def string_array(self, count: int) -> tuple[bytes, ...]:
        """`count` length-prefixed strings; the loop a 262k-token vocab spends its time in."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        items: list[bytes] = []
        append = items.append
        for _ in range(count):
            (length,) = unpack(buf, pos)
            start = pos + 8
            pos = start + length
            if pos > size:
                raise ValueError(f"string of {length} bytes at offset {start - 8} runs past the end of the file")
            append(buf[start:pos])
        self.pos = pos
        return tuple(items)

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string().decode("utf-8")
        n_dims = self.u32()
        dims = tuple(self.u64() for _ in range(n_dims))
        ggml_type = self.u32()
        return name, dims, ggml_type, self.u64()


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of a GGUF file, parsed once per process for each version of the file.

    The cache key is (resolved path, mtime_ns, size), so a rewritten file is parsed again.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ModelLoadError(f"{p}: cannot read: model file does not exist") from None
    except OSError as exc:
        raise ModelLoadError(f"{p}: cannot read the GGUF file: {exc}") from None
    return _header_of_version(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _header_of_version(path: str, _mtime_ns: int, _size: int) -> GGUFHeader:
    """Parse one version of a file (the key includes its mtime and size)."""
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return GGUFHeader.parse(mm, path)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read the GGUF file: {exc}") from None
    except ValueError as exc:  # mmap refuses an empty file
        raise ModelLoadError(f"{path}: not a readable GGUF file: header is truncated or malformed ({exc})") from None
