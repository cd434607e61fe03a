"""GGUF model files: hyper-parameters and tensors, dequantized to float32 on demand.

The header (metadata and tensor-info table) comes from gguf_file.read_header, parsed once per
process; tensor bytes are views of one read-only memory map of the file, dequantized with
gguf.quants (docs/PROTOCOL.md §7).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import ModelLoadError
from skippy_zmq.model.arch import DEFAULT_ROPE_FREQ_BASE, ArchSpec, arch_spec
from skippy_zmq.model.gguf_file import ArchKey, GGUFHeader, GGUFKey, TensorInfo, read_header

TOKEN_EMBD = "token_embd.weight"
OUTPUT = "output.weight"
ROPE_FREQS = "rope_freqs.weight"  # per-pair divisors of RoPE's angles, (head_dim/2,) F32


def head_tensor_name(header: GGUFHeader) -> str:
    """The head matrix of a file: output.weight, or the tied embedding table where it has none."""
    return OUTPUT if OUTPUT in header.tensors else TOKEN_EMBD

# Rows dequantized per call when a whole tensor is needed; bounds the temporary memory.
_DEQUANT_CHUNK_ROWS = 8192

# GGML types stored as plain numpy values (the others are quantized blocks of bytes).
_PLAIN_DTYPES: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"),
    "I8": np.dtype("<i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
}


def require_gguf() -> Any:
    """The optional gguf module; ModelLoadError explaining how to install it when absent."""
    try:
        import gguf
    except ImportError as exc:
        raise ModelLoadError(
            "the gguf package is required to load models; install skippy-zmq[model]"
        ) from exc
    return gguf


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


def _positive_finite(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    """Attrs validator: a float field must be positive and finite."""
    if not (value > 0 and math.isfinite(value)):
        raise ModelLoadError(f"model hyper-parameter {attr.name} = {value} must be a positive finite number")


ROPE_SCALING_TYPES: Mapping[str, str] = {
    "none": "positions as they are",
    "linear": "positions divided by rope.scaling.factor (rope.scale_linear in older files)",
    "yarn": "YaRN: positions divided by the factor in the slow dimensions, kept in the fast ones, blended "
            "between yarn's two correction dimensions; cos and sin scaled by 1 + 0.1 ln(factor)",
    "longrope": "as linear for these architectures (llama.cpp's long and short factor tensors are Phi-3's, "
                "a family the runtime does not run)",
}
"""The `rope.scaling.type` values this runtime computes, with what each does (llama.cpp's names and
meaning, docs/PROTOCOL.md §7)."""

YARN_BETA_FAST = 32.0
"""YaRN's correction bound of fast rotations, llama.cpp's default (the families here carry no key for it)."""
YARN_BETA_SLOW = 1.0
"""YaRN's correction bound of slow rotations, likewise."""


@attrs.frozen
class RopeScaling:
    """ggml_rope_ext's arguments beyond base and position scale, as llama.cpp derives them from a file."""

    kind: str = attrs.field(default="none", validator=attrs.validators.in_(tuple(ROPE_SCALING_TYPES)))
    ext_factor: float = 0.0  # YaRN's blend towards extrapolation: 1 for yarn, else 0
    attn_factor: float = attrs.field(default=1.0, validator=_positive_finite)
    n_ctx_orig: int = attrs.field(default=0, validator=_non_negative)  # 0: context_length
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW


_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_LIBM.logf.restype, _LIBM.logf.argtypes = ctypes.c_float, [ctypes.c_float]


def _logf(x: np.float32) -> np.float32:
    """The C library's logf, as llama.cpp calls it (numpy's float32 log may differ in the last bit)."""
    return np.float32(_LIBM.logf(float(x)))


def _rope_scaling(header: GGUFHeader, arch: str) -> tuple[float, RopeScaling]:
    """The factor positions are multiplied by before RoPE, and the rest of RoPE's scaling, read and
    computed in float32 as llama.cpp does (llama_model's hparams, then llama_context's cparams).

    An absent type means linear; a factor of 0 or none at all means no scaling.
    """
    type_key = ArchKey.ROPE_SCALING_TYPE.of(arch)
    kind = header.string(type_key, "linear")
    if kind not in ROPE_SCALING_TYPES:
        raise ModelLoadError(f"{header.source}: metadata {type_key} = {kind!r} is not a RoPE scaling this "
                             f"runtime computes; supported: {', '.join(ROPE_SCALING_TYPES)}")
    factor_key = ArchKey.ROPE_SCALING_FACTOR.of(arch)
    if factor_key not in header.metadata:
        factor_key = ArchKey.ROPE_SCALE_LINEAR.of(arch)
    factor = header.number(factor_key, 0.0)
    if not (factor >= 0 and math.isfinite(factor)):
        raise ModelLoadError(f"{header.source}: metadata {factor_key} = {factor} must be a finite number >= 0")
    attn_key = ArchKey.ROPE_SCALING_ATTN_FACTOR.of(arch)
    file_attn = np.float32(header.number(attn_key, 1.0))
    if not (file_attn > 0 and math.isfinite(file_attn)):
        raise ModelLoadError(f"{header.source}: metadata {attn_key} = {file_attn} must be a positive finite number")
    orig_key = ArchKey.ROPE_SCALING_ORIG_CTX.of(arch)
    n_ctx_orig = header.integer(orig_key, 0) or header.integer(ArchKey.CONTEXT_LENGTH.of(arch), 0)
    if n_ctx_orig < 0:
        raise ModelLoadError(f"{header.source}: metadata {orig_key} = {n_ctx_orig} must be >= 0")
    one, tenth = np.float32(1.0), np.float32(0.1)
    freq_scale = one if kind == "none" or factor == 0.0 else one / np.float32(factor)
    ext_factor = 1.0 if kind == "yarn" else 0.0
    attn = one
    if ext_factor != 0.0:
        # llama.cpp sets YaRN's magnitude 1 + 0.1 ln(factor), then cancels it, because ggml's RoPE
        # multiplies it in itself; both steps in float32, so the product may miss 1 by an ulp
        scale = one / freq_scale
        attn = one if scale <= one else tenth * one * _logf(scale) + one
        attn = attn * (one / (one + tenth * _logf(scale)))
    attn = attn * file_attn
    return float(freq_scale), RopeScaling(kind=kind, ext_factor=ext_factor, attn_factor=float(attn),
                                          n_ctx_orig=n_ctx_orig)


def _known_arch(_inst: object, _attr: object, value: str) -> None:
    """Attrs validator: the architecture must be one this runtime implements."""
    arch_spec(value)


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
    # Positions are multiplied by this before RoPE (linear scaling: 1 / rope.scaling.factor).
    rope_freq_scale: float = attrs.field(default=1.0, validator=_positive_finite)
    rope_freq_scale_local: float = attrs.field(default=1.0, validator=_positive_finite)  # sliding layers'
    rope_scaling: RopeScaling = attrs.field(factory=RopeScaling)  # YaRN's arguments and the attention factor
    # Experts (ArchSpec.experts): 0 in a file without; each layer then routes each token to
    # n_expert_used of n_expert feed-forwards n_ff_exp wide.
    n_expert: int = attrs.field(default=0, validator=_non_negative)
    n_expert_used: int = attrs.field(default=0, validator=_non_negative)
    n_ff_exp: int = attrs.field(default=0, validator=_non_negative)
    n_ff_shexp: int = attrs.field(default=0, validator=_non_negative)  # a shared expert's width (ArchSpec)

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
        _check_experts(self.arch, self.n_expert, self.n_expert_used, self.n_ff_exp)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> ModelHParams:
        """Read the hyper-parameters of a GGUF model file (cached per file version)."""
        return _hparams_of_header(read_header(path))

    @classmethod
    def from_header(cls, header: GGUFHeader) -> ModelHParams:
        """Read the hyper-parameters from a parsed GGUF header."""
        source = header.source
        arch = header.string(GGUFKey.ARCHITECTURE)
        spec = arch_spec(arch, source=source)

        def key(name: ArchKey) -> str:
            return name.of(arch)

        n_embd = header.integer(key(ArchKey.EMBEDDING_LENGTH))
        n_head = header.integer(key(ArchKey.HEAD_COUNT))
        head_dim = header.integer(key(ArchKey.KEY_LENGTH), n_embd // n_head if n_head > 0 else 0)
        value_dim = header.integer(key(ArchKey.VALUE_LENGTH), head_dim)
        if value_dim != head_dim:
            raise ModelLoadError(
                f"{source}: attention.value_length {value_dim} != key_length {head_dim}; "
                "only equal key and value head sizes are supported"
            )
        rope_dims = header.integer(key(ArchKey.ROPE_DIMENSION_COUNT), head_dim)
        if rope_dims != head_dim:
            raise ModelLoadError(
                f"{source}: rope.dimension_count {rope_dims} != head_dim {head_dim}; "
                "only RoPE over the full head is supported"
            )
        rope_scale, rope_scaling = _rope_scaling(header, arch)
        embd = header.tensor(TOKEN_EMBD)
        if len(embd.dims) != 2:
            raise ModelLoadError(f"{source}: tensor {TOKEN_EMBD!r} has {len(embd.dims)} dimensions, expected 2")
        rope_base = header.number(key(ArchKey.ROPE_FREQ_BASE), DEFAULT_ROPE_FREQ_BASE)
        sliding_window = 0
        if spec.global_layer_period > 0:
            sliding_window = header.integer(key(ArchKey.SLIDING_WINDOW), 0)
        n_ff = header.integer(key(ArchKey.FEED_FORWARD_LENGTH))
        n_expert, n_used, n_ff_exp = _expert_keys(header, spec, n_ff)
        return cls(
            arch=arch,
            n_layer=header.integer(key(ArchKey.BLOCK_COUNT)),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=header.integer(key(ArchKey.HEAD_COUNT_KV), n_head),
            head_dim=head_dim,
            n_ff=n_ff,
            n_vocab=embd.dims[1],  # (n_embd, n_vocab) in GGUF order
            rms_eps=header.number(key(ArchKey.RMS_EPS)),
            rope_freq_base=rope_base,
            rope_freq_base_local=(rope_base if spec.local_rope_freq_base is None
                                  else header.number(key(ArchKey.ROPE_FREQ_BASE_SWA), spec.local_rope_freq_base)),
            rope_neox=spec.rope_neox,
            sliding_window=sliding_window,
            n_ctx_train=header.integer(key(ArchKey.CONTEXT_LENGTH), 0),
            rope_freq_scale=rope_scale,
            rope_freq_scale_local=rope_scale if spec.local_rope_scaled else 1.0,
            rope_scaling=rope_scaling,
            n_expert=n_expert,
            n_expert_used=n_used,
            n_ff_exp=n_ff_exp,
            # llama.cpp: feed_forward_length where the file has no width of its own for the shared expert
            n_ff_shexp=header.integer(key(ArchKey.EXPERT_SHARED_FEED_FORWARD_LENGTH), 0) or n_ff
            if spec.shared_expert else 0,
        )

    @property
    def has_experts(self) -> bool:
        """Whether every layer's feed-forward is a mixture of experts (docs/ARCHITECTURE.md, "The expert layer")."""
        return self.n_expert > 0

    @property
    def spec(self) -> ArchSpec:
        """The architecture's row: optional weights, per-layer rules, how its block computes (model/arch.py)."""
        return arch_spec(self.arch)

    @property
    def embed_scale(self) -> float | None:
        """Factor applied to input embeddings: sqrt(n_embd) when the row scales them, else none."""
        return float(np.sqrt(np.float32(self.n_embd))) if self.spec.scale_embeddings else None

    def is_sliding_layer(self, il: int) -> bool:
        """Whether layer il attends only to the last sliding_window positions."""
        period = self.spec.global_layer_period
        if period == 0 or self.sliding_window == 0:
            return False
        return il % period != period - 1

    def layer_rope_base(self, il: int) -> float:
        """RoPE frequency base of layer il (sliding layers may use their own)."""
        return self.rope_freq_base_local if self.is_sliding_layer(il) else self.rope_freq_base

    def layer_rope_scale(self, il: int) -> float:
        """RoPE position scale of layer il (Gemma 3 scales only its global layers)."""
        return self.rope_freq_scale_local if self.is_sliding_layer(il) else self.rope_freq_scale

    @property
    def rope_n_ctx_orig(self) -> int:
        """The context YaRN's correction dimensions are computed for: the file's original context, else
        its context_length (llama.cpp's n_ctx_orig_yarn)."""
        return self.rope_scaling.n_ctx_orig or self.n_ctx_train


def _expert_keys(header: GGUFHeader, spec: ArchSpec, n_ff: int) -> tuple[int, int, int]:
    """(n_expert, n_expert_used, n_ff_exp) as the file's keys give them, checked (_check_experts);
    zeros for an architecture without experts, whose keys llama.cpp ignores too."""
    if spec.experts == "none":
        return 0, 0, 0
    n_expert = header.integer(ArchKey.EXPERT_COUNT.of(spec.name), 0)
    n_used = header.integer(ArchKey.EXPERT_USED_COUNT.of(spec.name), 0)
    n_ff_exp = n_ff
    if spec.expert_ff_key and n_used > 0:  # llama.cpp: n_ff / n_expert_used without the key
        n_ff_exp = header.integer(ArchKey.EXPERT_FEED_FORWARD_LENGTH.of(spec.name), 0) or n_ff // n_used
    if n_expert == 0:
        n_ff_exp = 0
    try:
        _check_experts(spec.name, n_expert, n_used, n_ff_exp)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{header.source}: {exc}") from None
    return n_expert, n_used, n_ff_exp


MAX_EXPERTS = 1024
"""llama.cpp's LLAMA_MAX_EXPERTS: a file with more experts per layer is refused, as llama.cpp refuses it."""


def _check_experts(arch: str, n_expert: int, n_used: int, n_ff_exp: int) -> None:
    """ModelLoadError naming the key and its value when a file's expert keys cannot describe an expert
    layer of `arch` (the checks of llama.cpp's loader, as messages rather than aborts)."""
    spec = arch_spec(arch)
    count, used = ArchKey.EXPERT_COUNT.of(arch), ArchKey.EXPERT_USED_COUNT.of(arch)
    if spec.experts == "none":
        if n_expert or n_used or n_ff_exp:
            raise ModelLoadError(f"{arch} has no expert layer, but {count} = {n_expert}, {used} = {n_used}")
        return
    if spec.experts == "required" and n_expert == 0:
        raise ModelLoadError(f"metadata {count} = 0 (or absent); a {arch} file's layers are experts, "
                             "expected a count > 0")
    if n_expert > MAX_EXPERTS:
        raise ModelLoadError(f"metadata {count} = {n_expert}; expected at most {MAX_EXPERTS} (llama.cpp's limit)")
    if n_expert and not 0 < n_used <= n_expert:
        raise ModelLoadError(f"metadata {used} = {n_used} with {count} = {n_expert}; expected 1 to {n_expert} "
                             "experts used per token")
    if not n_expert and n_used:
        raise ModelLoadError(f"metadata {used} = {n_used} without experts ({count} = 0); expected 0")
    if n_expert and n_ff_exp <= 0:
        raise ModelLoadError(f"metadata {ArchKey.EXPERT_FEED_FORWARD_LENGTH.of(arch)} = {n_ff_exp}; expected each "
                             "expert's hidden width > 0")


@functools.lru_cache(maxsize=4)
def _hparams_of_header(header: GGUFHeader) -> ModelHParams:
    """Hyper-parameters of one parsed header (headers are cached, so one object per file version)."""
    return ModelHParams.from_header(header)


def read_hparams(path: str | os.PathLike[str]) -> ModelHParams:
    """Read the hyper-parameters of a GGUF model file."""
    return ModelHParams.from_gguf(path)


@attrs.frozen(eq=False)
class BlockMatrix:
    """A weight matrix as the file stores it: `n` rows (outputs) of `k` values (inputs) in
    blocks of its type, or `experts` such matrices one after the other (an expert tensor);
    `data` is a view of the bytes (usually of the file's memory map)."""

    name: str
    type_name: str
    k: int
    n: int
    data: npt.NDArray[np.uint8] = attrs.field(repr=False)
    file_backed: bool = False  # `data` lies in a read-only mapping of the file (its pages may be dropped)
    experts: int = 0  # > 0: (experts, n, k), ggml's 3-D tensor that ggml_mul_mat_id selects from

    def __attrs_post_init__(self) -> None:
        if self.data.dtype != np.uint8 or self.data.ndim != 1:
            raise ModelLoadError(f"tensor {self.name!r}: block bytes must be a 1-D uint8 view, "
                                 f"got {self.data.dtype} {self.data.shape}")


class GGUFModel:
    """An open GGUF file: hyper-parameters plus tensors by name, dequantized on request."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Read the (cached) header and map the file; tensors stay mapped until asked for."""
        self.path = Path(path)
        self.header = read_header(self.path)
        self.hparams = _hparams_of_header(self.header)
        self._gguf = require_gguf()
        _check_extent(self.header, self._gguf)
        _check_vocab(self.header, self.hparams)
        self._bytes = _map_file(self.header)  # (file_size,) uint8, read-only

    def has_tensor(self, name: str) -> bool:
        """Whether the file holds a tensor of that name."""
        return name in self.header.tensors

    def tensor_type_name(self, name: str) -> str:
        """GGML type name of a tensor (F32, Q8_0, ...)."""
        return str(self._qtype(self.header.tensor(name)).name)

    def rope_freq_factors(self) -> npt.NDArray[np.float32] | None:
        """The file's RoPE frequency factors, (head_dim/2,), where its architecture reads them; else None."""
        hp = self.hparams
        if not (hp.spec.rope_freq_factors and self.has_tensor(ROPE_FREQS)):
            return None
        factors = self.load_f32(ROPE_FREQS, (hp.head_dim // 2,))
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ModelLoadError(f"{self.path}: tensor {ROPE_FREQS!r} must hold positive finite factors")
        return factors

    def load_f32(self, name: str, shape: Sequence[int]) -> npt.NDArray[np.float32]:
        """The whole tensor dequantized to a fresh C-contiguous float32 array of `shape`."""
        data, qtype = self._tensor(name, shape)
        out = np.empty(tuple(shape), dtype=np.float32)
        if len(shape) == 1:
            out[:] = _dequantize(data, qtype, name, self.header.source).reshape(shape)
            return out
        rows = out.reshape(-1, shape[-1])
        data = data.reshape(rows.shape[0], -1)
        for start in range(0, rows.shape[0], _DEQUANT_CHUNK_ROWS):
            stop = min(start + _DEQUANT_CHUNK_ROWS, rows.shape[0])
            rows[start:stop] = _dequantize(data[start:stop], qtype, name, self.header.source)
        return out

    def load_f32_transposed(self, name: str, shape: Sequence[int]) -> npt.NDArray[np.float32]:
        """A 2-D tensor of numpy shape (rows, cols) dequantized into a C-contiguous (cols, rows).

        Matmuls `x @ w_t` with the weight stored (in, out) run faster in OpenBLAS than
        `x @ w.T`; the transpose happens chunk by chunk so no second full copy is made.
        """
        data, qtype = self._tensor(name, shape)
        rows_n, cols_n = int(shape[0]), int(shape[1])
        out = np.empty((cols_n, rows_n), dtype=np.float32)
        data = data.reshape(rows_n, -1)
        for start in range(0, rows_n, _DEQUANT_CHUNK_ROWS):
            stop = min(start + _DEQUANT_CHUNK_ROWS, rows_n)
            values = _dequantize(data[start:stop], qtype, name, self.header.source)
            out[:, start:stop] = values.reshape(-1, cols_n).T
        return out

    def block_matrix(self, name: str, shape: Sequence[int]) -> BlockMatrix:
        """A 2-D tensor of numpy shape (n, k) as its bytes in the mapping, for a kernel that computes
        from the file's blocks (no copy is made)."""
        if len(shape) != 2:
            raise ModelLoadError(f"{self.header.source}: tensor {name!r} must be a matrix, got shape {tuple(shape)}")
        data, qtype = self._tensor(name, shape)
        return BlockMatrix(name=name, type_name=str(qtype.name), k=int(shape[1]), n=int(shape[0]),
                           data=data.reshape(-1).view(np.uint8), file_backed=True)

    def expert_matrix(self, name: str, shape: Sequence[int]) -> BlockMatrix:
        """A 3-D expert tensor of numpy shape (experts, n, k) as its bytes in the mapping (no copy)."""
        if len(shape) != 3:
            raise ModelLoadError(f"{self.header.source}: tensor {name!r} must hold one matrix per expert, "
                                 f"got shape {tuple(shape)}")
        data, qtype = self._tensor(name, shape)
        return BlockMatrix(name=name, type_name=str(qtype.name), k=int(shape[2]), n=int(shape[1]),
                           data=data.reshape(-1).view(np.uint8), file_backed=True, experts=int(shape[0]))

    def row_table(self, name: str, shape: Sequence[int]) -> RowTable:
        """A 2-D tensor left quantized in the memory-mapped file, for dequantizing rows."""
        data, qtype = self._tensor(name, shape)
        # Each row of a 2-D GGUF tensor is a whole number of quantization blocks.
        return RowTable(name=name, data=data.reshape(shape[0], -1), qtype=qtype,
                        n_cols=int(shape[1]), source=self.header.source)

    def rows_f32(self, name: str, shape: Sequence[int], row_ids: npt.NDArray[np.int64]
                 ) -> npt.NDArray[np.float32]:
        """Rows `row_ids` of a 2-D tensor dequantized to float32 (len(row_ids), shape[1])."""
        return self.row_table(name, shape).rows(row_ids)

    def _tensor(self, name: str, shape: Sequence[int]) -> tuple[np.ndarray, Any]:
        """The tensor's bytes in the mapping and its GGMLQuantizationType, checked to have `shape`.

        Plain types (F32, F16, ...) are viewed as values of numpy shape `shape`; quantized
        ones as uint8 rows (..., bytes per row), as gguf.quants.dequantize expects.
        """
        info = self.header.tensor(name)
        if info.shape != tuple(shape):
            raise ModelLoadError(
                f"{self.header.source}: tensor {name!r} has shape {info.shape}, expected {tuple(shape)}"
            )
        qtype = self._qtype(info)
        block_size, type_size = self._gguf.GGML_QUANT_SIZES[qtype]
        if info.dims and info.dims[0] % block_size != 0:
            raise ModelLoadError(
                f"{self.header.source}: tensor {name!r} rows of {info.dims[0]} values are not whole "
                f"{qtype.name} blocks of {block_size}"
            )
        end = info.data_offset + info.n_elements // block_size * type_size
        if end > self._bytes.size:
            raise ModelLoadError(
                f"{self.header.source}: tensor {name!r} ends at byte {end}, past the end of the "
                f"{self._bytes.size}-byte file; is it truncated?"
            )
        raw = self._bytes[info.data_offset:end]
        plain = _PLAIN_DTYPES.get(qtype.name)
        if plain is not None:
            return raw.view(plain).reshape(info.shape), qtype
        row_bytes = info.shape[-1] // block_size * type_size if info.shape else 0
        return raw.reshape((*info.shape[:-1], row_bytes)), qtype

    def _qtype(self, info: TensorInfo) -> Any:
        """The gguf.GGMLQuantizationType of a tensor; ModelLoadError for a type gguf does not know."""
        try:
            return self._gguf.GGMLQuantizationType(info.ggml_type)
        except ValueError:
            raise ModelLoadError(
                f"{self.header.source}: tensor {info.name!r} has ggml type {info.ggml_type}, "
                "which the gguf package does not know"
            ) from None


def _check_extent(header: GGUFHeader, gguf: Any) -> None:
    """ModelLoadError naming the first tensor whose bytes run past the end of the file, so a file
    cut anywhere in its data is refused by every stage, not only by the one whose layers it cut."""
    cut: list[tuple[int, int, str]] = []
    for info in header.tensors.values():
        try:
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
        except (ValueError, KeyError):
            continue  # a type gguf does not know is refused, by name, when a stage reads the tensor
        end = info.data_offset + info.n_elements // block_size * type_size
        if end > header.file_size:
            cut.append((info.data_offset, end, info.name))
    if cut:
        _start, end, name = min(cut)
        raise ModelLoadError(
            f"{header.source}: tensor {name!r} ends at byte {end}, past the end of the "
            f"{header.file_size}-byte file ({len(cut)} tensor(s) run past it); the file is truncated"
        )


def _check_vocab(header: GGUFHeader, hp: ModelHParams) -> None:
    """ModelLoadError when the token list and the embedding's rows disagree (llama.cpp refuses it too):
    a token id past the rows would fail only when a prompt holds it."""
    tokens = header.metadata.get(GGUFKey.TOKENS)
    if isinstance(tokens, tuple) and len(tokens) != hp.n_vocab:
        raise ModelLoadError(
            f"{header.source}: tensor {TOKEN_EMBD!r} has {hp.n_vocab} rows but metadata key "
            f"{GGUFKey.TOKENS.value!r} lists {len(tokens)} tokens; expected one row per token"
        )


def _map_file(header: GGUFHeader) -> npt.NDArray[np.uint8]:
    """The file as a read-only uint8 array over one memory map; the map lives as long as its views."""
    try:
        with open(header.source, "rb") as fh:
            mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{header.source}: cannot map the GGUF file: {exc}") from None
    if len(mapping) != header.file_size:
        size = len(mapping)
        mapping.close()
        raise ModelLoadError(
            f"{header.source}: the file changed while it was opened ({size} bytes now, "
            f"{header.file_size} when its header was read); open it again"
        )
    return np.frombuffer(mapping, dtype=np.uint8)


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

    Holds only the tensor's bytes (a view of the file mapping), not the GGUFModel, so a
    stage can drop the model after loading.
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
