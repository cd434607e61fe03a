"""Activation codecs: raw, f16, bf16 and row-scaled s8; lossless selection; policies.

The wire format of each codec is in docs/PROTOCOL.md §4. A codec is one `CodecSpec` row of
`CODECS` (its wire id, wire name, payload size, kernels and lossless role) plus the kernels
the row names; every dispatch below reads the row. Pure numpy, no sockets. Wire bytes are
little-endian and so is every host we run on (x86-64, aarch64), so native
``float32``/``uint16`` arrays expose the wire bytes directly.

The f16 and bf16 kernels are integer/float bit manipulation in ``out=`` ufuncs over blocks
of ``_BLOCK`` elements with per-thread scratch buffers: each of the ~12 passes over a block
then runs in cache instead of DRAM, and the hot path allocates nothing but its output.
On 16 MiB frames numpy's own ``astype(float16)`` reaches 9-11% of copy speed here, these
kernels 15-21% (bf16: 22-34%); see `skippy-zmq bench codecs` and docs/BENCHMARKS.md.
"""

from __future__ import annotations

import enum
import math
import operator
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, NoReturn, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import CodecError

__all__ = [
    "CODECS",
    "LOSSLESS_CANDIDATES",
    "ActivationCodec",
    "Buffer",
    "CodecPolicy",
    "CodecSpec",
    "decode_array",
    "decode_values",
    "encode_array",
    "encode_values",
    "encoded_nbytes",
    "select_lossless",
]

# zmq.Frame has the buffer protocol at run time, but pyzmq's stubs do not declare
# ``__buffer__``, hence the ``Any``: `_byte_view` checks the protocol when it matters.
Buffer: TypeAlias = bytes | bytearray | memoryview | npt.NDArray[Any] | Any
"""Anything exposing the buffer protocol (bytes, memoryview, numpy arrays, zmq.Frame)."""


@enum.unique
class ActivationCodec(enum.IntEnum):
    """Activation codec; the value is the wire id (docs/PROTOCOL.md §4), `spec` its table row."""

    RAW_F32_V1 = 1
    F16_RNE_V1 = 2
    BF16_RNE_V1 = 3
    S8_ROW_F32_RNE_V1 = 4

    @property
    def spec(self) -> CodecSpec:
        """This codec's row of `CODECS`."""
        return _BY_CODEC[self]

    @property
    def wire_name(self) -> str:
        """Name used in configuration, logs and errors, e.g. ``bf16-rne-v1``."""
        return _BY_CODEC[self].wire_name

    @classmethod
    def parse(cls, value: str | int | ActivationCodec) -> ActivationCodec:
        """Return the codec named by a wire name or wire id; raise CodecError otherwise."""
        if isinstance(value, ActivationCodec):
            return value
        if isinstance(value, str):
            codec = _BY_WIRE_NAME.get(value)
            if codec is None:
                raise CodecError(
                    f"unknown activation codec {value!r}; expected one of "
                    f"{', '.join(_BY_WIRE_NAME)}"
                )
            return codec
        if not isinstance(value, (bool, np.bool_)):
            try:
                wire_id = operator.index(value)  # int, or a numpy integer from a header
            except TypeError:
                pass
            else:
                try:
                    return cls(wire_id)
                except ValueError:
                    raise CodecError(
                        f"unknown activation codec id {wire_id}; expected one of "
                        + ", ".join(f"{c.value} ({c.wire_name})" for c in cls)
                    ) from None
        raise CodecError(
            f"activation codec must be a wire name or wire id, got {type(value).__name__} {value!r}"
        )


# (values) -> wire array: ``values`` is C-contiguous float32 of rank >= 1 (maybe empty); the
# result is C-contiguous; CodecError if a value cannot be encoded.
_Encoder: TypeAlias = Callable[[npt.NDArray[np.float32]], npt.NDArray[Any]]
# (payload bytes, shape) -> float32 array of ``shape``; the payload has the row's size.
_Decoder: TypeAlias = Callable[[npt.NDArray[np.uint8], tuple[int, ...]], npt.NDArray[np.float32]]
# (frame parts) -> their encodings if every value is exact, else _INEXACT or _NON_FINITE.
_ExactEncoder: TypeAlias = Callable[
    [Sequence[npt.NDArray[np.float32]]], "list[npt.NDArray[Any]] | int"
]


@attrs.frozen
class CodecSpec:
    """One activation codec: wire identity, payload size, kernels and lossless role."""

    codec: ActivationCodec
    """The enum member; its value is the wire id."""
    wire_name: str
    """Name in configuration, logs and errors."""
    label: str
    """Value type named in encode errors (``F16 activation value is out of range: ...``)."""
    value_bytes: int
    """Payload bytes per value."""
    encode: _Encoder
    """Checked float32 values -> C-contiguous wire array; CodecError if a value does not fit."""
    decode: _Decoder
    """Payload bytes of the right size, shape -> float32 values; CodecError if invalid."""
    row_header_bytes: int = 0
    """Payload bytes heading each row (a row is the last axis), e.g. the s8 scale."""
    lossless_order: int | None = None
    """Place in `LOSSLESS_CANDIDATES` (docs/PROTOCOL.md §4.1), None if not a candidate.

    0 is the fallback, exact for every value; the others are tried from 1 up, so the lower
    place wins when several are exact.
    """
    exact: _ExactEncoder | None = None
    """The exactness check and encoding of a lossless candidate other than the fallback."""

    def nbytes(self, dims: tuple[int, ...]) -> int:
        """Payload size for a valid numpy shape (0 for an empty array)."""
        size = math.prod(dims)
        if size == 0:
            return 0
        return size * self.value_bytes + size // dims[-1] * self.row_header_bytes


# --------------------------------------------------------------------------- validation


def _checked_shape(spec: CodecSpec, shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise CodecError(
            f"{spec.wire_name}: shape must be a sequence of integers, got {shape!r}"
        ) from None
    if not dims or any(d < 0 for d in dims):
        raise CodecError(
            f"{spec.wire_name}: invalid shape {dims}; expected rank >= 1 and non-negative dims"
        )
    return dims


def _checked_values(user: str, values: object) -> npt.NDArray[np.float32]:
    """``values`` if it is a C-contiguous float32 array of rank >= 1; ``user`` names the caller."""
    if not isinstance(values, np.ndarray):
        raise CodecError(f"{user} expects a float32 numpy array, got {type(values).__name__}")
    if values.dtype != np.float32:
        raise CodecError(
            f"{user} expects float32 values, got dtype {values.dtype.str} of shape {values.shape}"
        )
    if values.ndim == 0:
        raise CodecError(f"{user} expects an array of rank >= 1, got a rank-0 scalar")
    if not values.flags.c_contiguous:
        raise CodecError(
            f"{user} expects a C-contiguous array, got a strided "
            f"layout (strides {values.strides}) of shape {values.shape}"
        )
    return values


def _byte_view(spec: CodecSpec, payload: Buffer) -> npt.NDArray[np.uint8]:
    try:
        view = memoryview(payload)
    except TypeError:
        raise CodecError(
            f"{spec.wire_name} payload must support the buffer protocol, "
            f"got {type(payload).__name__}"
        ) from None
    if not view.c_contiguous:
        raise CodecError(f"{spec.wire_name} payload must be a contiguous buffer")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return np.frombuffer(view, dtype=np.uint8)


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, row_len) of a non-empty shape; a row is the last axis (ggml dims[0])."""
    row_len = shape[-1]
    return math.prod(shape) // row_len, row_len


# --------------------------------------------------------------------------- scratch

# Elements per block (256 KiB of f32). Each ufunc call costs ~1-2 us, so 16 Ki blocks lost
# to 64 Ki and 128 Ki ones on 16 MiB frames although they fit L2 (tools/bench_codecs.py --block at commit f9d1290).
_BLOCK = 65536
# Up to this many values numpy's own float16 casts (also IEEE RNE) beat the kernels' fixed
# cost of ~12 ufunc calls: 640 values encode in 3 us instead of 17 us, decode in 2 instead
# of 10 (per-token frames are this small); from ~8 Ki values on the kernels win.
_NUMPY_CAST_MAX: Final = 4096


_F16_MIN_NORMAL: Final = np.float32(2.0**-14)


class _Scratch(threading.local):
    """Per-thread scratch blocks, so the kernels allocate nothing but their output."""

    def __init__(self) -> None:
        self.resize(_BLOCK)

    def resize(self, block: int) -> None:
        """Reallocate the scratch blocks for ``block`` elements."""
        self.block = block
        block = max(block, _NUMPY_CAST_MAX)  # the small-array f16 path uses them too
        self.u32_a = np.empty(block, np.uint32)
        self.u32_b = np.empty(block, np.uint32)
        self.u32_c = np.empty(block, np.uint32)
        self.u16 = np.empty(block, np.uint16)
        # An array operand: np.maximum with a scalar float operand is ~4x slower.
        self.f16_min_normal = np.full(block, _F16_MIN_NORMAL, np.float32)


_scratch = _Scratch()


def _set_block(block: int) -> None:
    """Change the kernel block size (benchmark tuning only)."""
    global _BLOCK  # noqa: PLW0603 - a benchmark-only knob; the kernels read the global
    _BLOCK = block
    _scratch.resize(block)


def _blocks(size: int) -> range:
    if _scratch.block != _BLOCK:
        _scratch.resize(_BLOCK)
    return range(0, size, _BLOCK)


# --------------------------------------------------------------------------- bf16

# |x| >= 0x7F7F8000 (3.3961775e38) rounds to the bf16 exponent 0xFF: out of range.
_BF16_LIMIT: Final = np.uint32(0x7F7F8000).view(np.float32)
_OK, _OUT_OF_RANGE, _INEXACT = 0, 1, 2


def _encode_bf16_into(src: npt.NDArray[np.float32], dst: npt.NDArray[np.uint16]) -> int:
    bits = src.view(np.uint32)
    scratch = _scratch
    for start in _blocks(src.size):
        x = src[start : start + _BLOCK]
        n = x.size
        # NaN fails both comparisons, so this also rejects NaN and Inf.
        if not (np.maximum.reduce(x) < _BF16_LIMIT and np.minimum.reduce(x) > -_BF16_LIMIT):
            return _OUT_OF_RANGE
        b = bits[start : start + n]
        t = scratch.u32_a[:n]
        # docs/PROTOCOL.md §4: (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16; no wrap for finite bits.
        np.right_shift(b, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, b, out=t)
        np.add(t, 0x7FFF, out=t)
        np.right_shift(t, 16, out=t)
        np.copyto(dst[start : start + n], t, casting="unsafe")
    return _OK


def _bf16_status(src: npt.NDArray[np.float32]) -> int:
    """_OK if every value is a finite bf16 value, else _OUT_OF_RANGE or _INEXACT."""
    bits = src.view(np.uint32)
    scratch = _scratch
    for start in _blocks(src.size):
        x = src[start : start + _BLOCK]
        n = x.size
        if not (np.maximum.reduce(x) < np.inf and np.minimum.reduce(x) > -np.inf):
            return _OUT_OF_RANGE
        low = scratch.u32_a[:n]
        np.bitwise_and(bits[start : start + n], 0xFFFF, out=low)
        if np.maximum.reduce(low) != 0:
            return _INEXACT
    return _OK


def _truncate_bf16_into(src: npt.NDArray[np.float32], dst: npt.NDArray[np.uint16]) -> None:
    """bf16 encoding of values already known to be bf16-exact: the high halves."""
    bits = src.view(np.uint32)
    scratch = _scratch
    for start in _blocks(src.size):
        b = bits[start : start + _BLOCK]
        t = scratch.u32_a[: b.size]
        np.right_shift(b, 16, out=t)
        np.copyto(dst[start : start + b.size], t, casting="unsafe")


def _decode_bf16_into(src: npt.NDArray[np.uint16], dst: npt.NDArray[np.float32]) -> int:
    """Decode; return the first block start holding a non-finite pattern, or -1."""
    out = dst.view(np.uint32)
    scratch = _scratch
    for start in _blocks(src.size):
        h = src[start : start + _BLOCK]
        n = h.size
        magnitude = scratch.u16[:n]
        np.bitwise_and(h, 0x7FFF, out=magnitude)
        if np.maximum.reduce(magnitude) >= 0x7F80:
            return start
        o = out[start : start + n]
        np.copyto(o, h)
        np.left_shift(o, 16, out=o)
    return -1


# --------------------------------------------------------------------------- f16

_SUBNORMAL_PROBE: Final = np.float32(2.0**-130)


def _require_ieee_subnormals() -> None:
    """Raise CodecError if this thread's FPU flushes subnormals (FTZ/DAZ).

    The f16 kernels round and rebias with float32 arithmetic through f32 subnormals; a
    library built with -ffast-math can switch that off for the whole process, and the
    f16 codec would then be silently wrong.
    """
    if _SUBNORMAL_PROBE * np.float32(2.0) == 0:
        raise CodecError(
            "f16-rne-v1 needs IEEE subnormal arithmetic, but the FPU flushes subnormals "
            "to zero (FTZ/DAZ set by a library built with -ffast-math)"
        )


# |x| >= 65520 (0x477FF000) rounds to f16 infinity: out of range.
_F16_LIMIT_BITS: Final = 0x477FF000
_F16_LIMIT: Final = np.uint32(_F16_LIMIT_BITS).view(np.float32)
_TWO_POW_13: Final = np.float32(2.0**13)
_TWO_POW_M112: Final = np.float32(2.0**-112)
_TWO_POW_112: Final = np.float32(2.0**112)


def _encode_f16_into(
    src: npt.NDArray[np.float32], dst: npt.NDArray[np.uint16], *, exact_only: bool
) -> int:
    """IEEE binary16 RNE of ``src`` into ``dst``; _OK, _OUT_OF_RANGE or (exact_only) _INEXACT.

    Rounding is done by the FPU: for |x| in [2^e, 2^(e+1)), e >= -14, the sum
    2^(e+13) + |x| lies in [2^(e+13), 2^(e+14)) where the f32 spacing is 2^(e-10), the
    f16 spacing of |x|; below 2^-14 the grid 2^(-14+13) gives the fixed subnormal spacing
    2^-24. Subtracting 2^(e+13) again is exact. Scaling by 2^-112 moves the f32 exponent
    bias (127) to the f16 one (15), f16 subnormals becoming f32 subnormals exactly, so
    ``bits >> 13`` is the f16 magnitude. The sign is put back at bit 15.
    """
    _require_ieee_subnormals()
    if src.size <= _NUMPY_CAST_MAX:
        return _encode_f16_small(src, dst, exact_only=exact_only)
    bits = src.view(np.uint32)
    scratch = _scratch
    for start in _blocks(src.size):
        b = bits[start : start + _BLOCK]
        n = b.size
        magnitude = scratch.u32_a[:n]
        np.bitwise_and(b, 0x7FFFFFFF, out=magnitude)
        # NaN and Inf have larger magnitude bits than any finite value.
        if np.maximum.reduce(magnitude) >= _F16_LIMIT_BITS:
            return _OUT_OF_RANGE
        grid = scratch.u32_b[:n]
        grid_f = grid.view(np.float32)
        np.bitwise_and(magnitude, 0x7F800000, out=grid)  # 2^e (0.0 for zero and subnormals)
        np.maximum(grid_f, scratch.f16_min_normal[:n], out=grid_f)
        np.multiply(grid_f, _TWO_POW_13, out=grid_f)
        # Without the exactness check |x| is not needed again: round in place.
        rounded = scratch.u32_c[:n] if exact_only else magnitude
        rounded_f = rounded.view(np.float32)
        np.add(magnitude.view(np.float32), grid_f, out=rounded_f)
        np.subtract(rounded_f, grid_f, out=rounded_f)
        if exact_only:
            np.bitwise_xor(rounded, magnitude, out=grid)
            if np.maximum.reduce(grid) != 0:
                return _INEXACT
        np.multiply(rounded_f, _TWO_POW_M112, out=rounded_f)
        np.right_shift(rounded, 13, out=rounded)
        np.right_shift(b, 16, out=grid)
        np.bitwise_and(grid, 0x8000, out=grid)
        np.bitwise_or(rounded, grid, out=rounded)
        np.copyto(dst[start : start + n], rounded, casting="unsafe")
    return _OK


def _encode_f16_small(
    src: npt.NDArray[np.float32], dst: npt.NDArray[np.uint16], *, exact_only: bool
) -> int:
    """_encode_f16_into for at most _NUMPY_CAST_MAX values, using numpy's RNE cast."""
    n = src.size
    if n == 0:
        return _OK
    bits = src.view(np.uint32)
    scratch = _scratch
    magnitude = scratch.u32_a[:n]
    np.bitwise_and(bits, 0x7FFFFFFF, out=magnitude)
    if np.maximum.reduce(magnitude) >= _F16_LIMIT_BITS:
        return _OUT_OF_RANGE
    with np.errstate(under="ignore"):  # numpy flags inexact subnormal results
        np.copyto(dst.view(np.float16), src, casting="unsafe")
    if exact_only:
        back = scratch.u32_b[:n]
        np.copyto(back.view(np.float32), dst.view(np.float16))
        np.bitwise_xor(back, bits, out=back)
        if np.maximum.reduce(back) != 0:
            return _INEXACT
    return _OK


def _decode_f16_into(src: npt.NDArray[np.uint16], dst: npt.NDArray[np.float32]) -> int:
    """Decode; return the first block start holding a non-finite pattern, or -1."""
    _require_ieee_subnormals()
    if src.size <= _NUMPY_CAST_MAX:
        magnitude = _scratch.u16[: src.size]
        np.bitwise_and(src, 0x7FFF, out=magnitude)
        if src.size and np.maximum.reduce(magnitude) >= 0x7C00:
            return 0
        np.copyto(dst, src.view(np.float16))  # widening is exact
        return -1
    out = dst.view(np.uint32)
    out_f = dst
    scratch = _scratch
    signed = src.view(np.int16)
    for start in _blocks(src.size):
        h = src[start : start + _BLOCK]
        n = h.size
        magnitude = scratch.u16[:n]
        np.bitwise_and(h, 0x7FFF, out=magnitude)
        if np.maximum.reduce(magnitude) >= 0x7C00:
            return start
        o = out[start : start + n]
        # int16 -> uint32 sign-extends, so after << 13 bit 31 holds the f16 sign and bits
        # 27..13 the f16 exponent and mantissa; bits 30..28 are extension debris.
        np.copyto(o, signed[start : start + n], casting="unsafe")
        np.left_shift(o, 13, out=o)
        np.bitwise_and(o, 0x8FFFFFFF, out=o)
        # Rebias the exponent from 15 to 127; exact, f32 subnormals becoming f16 ones.
        o_f = out_f[start : start + n]
        np.multiply(o_f, _TWO_POW_112, out=o_f)
    return -1


# --------------------------------------------------------------------------- s8

_S8_MIN_SCALE: Final = np.float32(2.0**-149)  # smallest positive f32 subnormal


def _encode_s8_into(src: npt.NDArray[np.float32], dst: npt.NDArray[np.uint8]) -> None:
    """Row-scaled int8 of ``src`` (rows, row_len) into ``dst`` (rows, 4 + row_len).

    ``x / scale`` is computed in float64: the float64 quotient of two float32 values is
    within 2^-46 of the true one and never lands on a false .5 tie (a true non-tie is at
    least 2^-26 away from one), so ``np.rint`` gives round-half-even of the exact quotient,
    independent of blocking.
    """
    rows, row_len = src.shape
    rows_per_block = max(1, _BLOCK // row_len)
    for start in range(0, rows, rows_per_block):
        x = src[start : start + rows_per_block]  # (r, row_len)
        max_abs = np.max(np.abs(x), axis=1)  # (r,); NaN propagates
        if not np.isfinite(max_abs).all():
            _raise_non_finite(ActivationCodec.S8_ROW_F32_RNE_V1, src)
        scale = (max_abs.astype(np.float64) / 127.0).astype(np.float32)  # (r,)
        np.maximum(scale, _S8_MIN_SCALE, out=scale)
        scale[max_abs == 0] = 1.0
        quotient = x.astype(np.float64)
        quotient /= scale[:, None].astype(np.float64)
        np.rint(quotient, out=quotient)
        np.clip(quotient, -127.0, 127.0, out=quotient)
        block = dst[start : start + x.shape[0]]
        block[:, :4] = scale.view(np.uint8).reshape(-1, 4)
        np.copyto(block[:, 4:].view(np.int8), quotient, casting="unsafe")


def _decode_s8(payload: npt.NDArray[np.uint8], shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    codec = ActivationCodec.S8_ROW_F32_RNE_V1
    out = np.empty(shape, np.float32)
    if out.size == 0:
        return out
    rows, row_len = _rows(shape)
    table = payload.reshape(rows, 4 + row_len)
    scale = np.ascontiguousarray(table[:, :4]).view(np.float32).reshape(rows)  # (rows,)
    bad = np.flatnonzero(~(np.isfinite(scale) & (scale > 0)))
    if bad.size:
        row = int(bad[0])
        raise CodecError(
            f"{codec.wire_name} payload has invalid scale {scale[row]!s} in row {row}; "
            "expected a finite positive float32"
        )
    quantised = table[:, 4:].view(np.int8)  # (rows, row_len), strided
    if int(quantised.min()) == -128:
        row, col = (int(i[0]) for i in np.nonzero(quantised == -128))
        raise CodecError(
            f"{codec.wire_name} payload has the reserved int8 value -128 in row {row} "
            f"column {col}; expected values in [-127, 127]"
        )
    np.multiply(quantised, scale[:, None], out=out.reshape(rows, row_len))
    return out


# --------------------------------------------------------------------------- errors


def _raise_non_finite(codec: ActivationCodec, values: npt.NDArray[np.float32]) -> NoReturn:
    spec = _BY_CODEC[codec]
    flat = values.reshape(-1)
    index = int(np.flatnonzero(~np.isfinite(flat))[0])
    raise CodecError(
        f"{spec.label} activation value is non-finite: {flat[index]!s} at flat "
        f"index {index}; {spec.wire_name} encodes finite values only"
    )


def _raise_out_of_range(
    codec: ActivationCodec, values: npt.NDArray[np.float32], limit: np.float32
) -> NoReturn:
    """Report the first value with ``|x| >= limit`` (NaN included) of ``values``."""
    spec = _BY_CODEC[codec]
    flat = values.reshape(-1)
    index = int(np.flatnonzero(~(np.abs(flat) < limit))[0])
    value = flat[index]
    if not np.isfinite(value):
        # Non-finite input can never be represented: also "out of range" (docs/PROTOCOL.md §4).
        raise CodecError(
            f"{spec.label} activation value is out of range: non-finite {value!s} "
            f"at flat index {index}; {spec.wire_name} encodes finite values only"
        )
    raise CodecError(
        f"{spec.label} activation value is out of range: {value!s} at flat index "
        f"{index}; {spec.wire_name} encodes |x| < {limit!s}"
    )


def _raise_non_finite_pattern(
    codec: ActivationCodec, halves: npt.NDArray[np.uint16], start: int, exponent: int
) -> NoReturn:
    """Report the first half word from ``start`` on whose ``exponent`` bits are all set."""
    tail = halves[start:]
    index = start + int(np.flatnonzero((tail & exponent) == exponent)[0])
    raise CodecError(
        f"{_BY_CODEC[codec].wire_name} payload holds a non-finite value "
        f"(bits 0x{int(halves[index]):04x}) at flat index {index}; expected finite values only"
    )


# --------------------------------------------------------------------------- codec entry points

# Verdicts of a lossless candidate's exactness check (besides its encodings).
_NON_FINITE: Final = 3  # a NaN or Inf: only the fallback is exact, stop looking


def _encode_raw(values: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    return values  # zero copy: the f32 array is its wire bytes


def _decode_raw(data: npt.NDArray[np.uint8], dims: tuple[int, ...]) -> npt.NDArray[np.float32]:
    view = data.view(np.float32).reshape(dims)
    view.flags.writeable = False  # aliases the message buffer
    return view


def _encode_f16(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    halves = np.empty(values.shape, np.uint16)
    if _encode_f16_into(values.reshape(-1), halves.reshape(-1), exact_only=False) != _OK:
        _raise_out_of_range(ActivationCodec.F16_RNE_V1, values, _F16_LIMIT)
    return halves


def _decode_f16(data: npt.NDArray[np.uint8], dims: tuple[int, ...]) -> npt.NDArray[np.float32]:
    halves = data.view(np.uint16)
    out = np.empty(dims, np.float32)
    bad = _decode_f16_into(halves, out.reshape(-1))
    if bad >= 0:
        _raise_non_finite_pattern(ActivationCodec.F16_RNE_V1, halves, bad, 0x7C00)
    return out


def _f16_exact(parts: Sequence[npt.NDArray[np.float32]]) -> list[npt.NDArray[Any]] | int:
    """f16 encodings of ``parts`` if all are f16-exact; one encoding pass with a check."""
    encodings: list[npt.NDArray[Any]] = []
    for values in parts:
        halves = np.empty(values.shape, np.uint16)
        if _encode_f16_into(values.reshape(-1), halves.reshape(-1), exact_only=True) != _OK:
            return _INEXACT
        encodings.append(halves)
    return encodings


def _encode_bf16(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    halves = np.empty(values.shape, np.uint16)
    if _encode_bf16_into(values.reshape(-1), halves.reshape(-1)) != _OK:
        _raise_out_of_range(ActivationCodec.BF16_RNE_V1, values, _BF16_LIMIT)
    return halves


def _decode_bf16(data: npt.NDArray[np.uint8], dims: tuple[int, ...]) -> npt.NDArray[np.float32]:
    halves = data.view(np.uint16)
    out = np.empty(dims, np.float32)
    bad = _decode_bf16_into(halves, out.reshape(-1))
    if bad >= 0:
        _raise_non_finite_pattern(ActivationCodec.BF16_RNE_V1, halves, bad, 0x7F80)
    return out


def _bf16_exact(parts: Sequence[npt.NDArray[np.float32]]) -> list[npt.NDArray[Any]] | int:
    """bf16 encodings of ``parts`` if all are bf16-exact: bit tests first, then one encoding."""
    for values in parts:
        status = _bf16_status(values.reshape(-1))
        if status == _OUT_OF_RANGE:
            return _NON_FINITE
        if status == _INEXACT:
            return _INEXACT  # the next candidate still sees any NaN/Inf of later parts
    encodings: list[npt.NDArray[Any]] = []
    for values in parts:
        halves = np.empty(values.shape, np.uint16)
        _truncate_bf16_into(values.reshape(-1), halves.reshape(-1))
        encodings.append(halves)
    return encodings


def _encode_s8(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    encoded = np.empty(_BY_CODEC[ActivationCodec.S8_ROW_F32_RNE_V1].nbytes(values.shape), np.uint8)
    if values.size:
        rows, row_len = _rows(values.shape)
        _encode_s8_into(values.reshape(rows, row_len), encoded.reshape(rows, 4 + row_len))
    return encoded


# --------------------------------------------------------------------------- the table

CODECS: Final[tuple[CodecSpec, ...]] = (
    CodecSpec(
        codec=ActivationCodec.RAW_F32_V1,
        wire_name="raw-f32-v1",
        label="F32",
        value_bytes=4,
        encode=_encode_raw,
        decode=_decode_raw,
        lossless_order=0,
    ),
    CodecSpec(
        codec=ActivationCodec.F16_RNE_V1,
        wire_name="f16-rne-v1",
        label="F16",
        value_bytes=2,
        encode=_encode_f16,
        decode=_decode_f16,
        lossless_order=2,
        exact=_f16_exact,
    ),
    CodecSpec(
        codec=ActivationCodec.BF16_RNE_V1,
        wire_name="bf16-rne-v1",
        label="BF16",
        value_bytes=2,
        encode=_encode_bf16,
        decode=_decode_bf16,
        lossless_order=1,  # bf16 wins a tie with f16
        exact=_bf16_exact,
    ),
    CodecSpec(
        codec=ActivationCodec.S8_ROW_F32_RNE_V1,
        wire_name="s8-row-f32-rne-v1",
        label="S8",
        value_bytes=1,
        row_header_bytes=4,  # the row's f32 scale
        encode=_encode_s8,
        decode=_decode_s8,
    ),
)
"""Every activation codec, one row each, in wire-id order."""


def _index(rows: Iterable[CodecSpec]) -> dict[ActivationCodec, CodecSpec]:
    """The rows by codec; CodecError unless each codec has one row and the roles are coherent."""
    rows = tuple(rows)
    if [row.codec for row in rows] != list(ActivationCodec):
        raise CodecError(
            "codec table must have one row per ActivationCodec member, in wire-id order; got "
            + ", ".join(row.codec.name for row in rows)
        )
    names = [row.wire_name for row in rows]
    if len(set(names)) != len(names):
        raise CodecError(f"codec table has a repeated wire name: {names}")
    ranked = _lossless_rows(rows)
    if not ranked or [row.lossless_order for row in ranked] != list(range(len(ranked))):
        raise CodecError(
            "codec table lossless_order must number the candidates 0, 1, ...; got "
            + ", ".join(f"{row.wire_name}={row.lossless_order}" for row in ranked)
        )
    # The fallback takes every value; each other candidate needs its exactness check.
    if any((row.exact is None) != (row.lossless_order == 0) for row in ranked):
        raise CodecError("codec table: only the lossless fallback (order 0) has no exact check")
    return {row.codec: row for row in rows}


def _lossless_rows(rows: Iterable[CodecSpec]) -> tuple[CodecSpec, ...]:
    """The lossless candidates among ``rows``, in preference order."""
    candidates = (row for row in rows if row.lossless_order is not None)
    return tuple(sorted(candidates, key=lambda row: row.lossless_order or 0))


_BY_CODEC: Final[dict[ActivationCodec, CodecSpec]] = _index(CODECS)
_BY_WIRE_NAME: Final[dict[str, ActivationCodec]] = {row.wire_name: row.codec for row in CODECS}
_LOSSLESS_ROWS: Final = _lossless_rows(CODECS)

LOSSLESS_CANDIDATES: Final[tuple[ActivationCodec, ...]] = tuple(r.codec for r in _LOSSLESS_ROWS)
"""The codecs of auto-lossless-v1 in preference order; the first is the fallback."""

_LOSSLESS_FALLBACK: Final = LOSSLESS_CANDIDATES[0]
# (codec, exactness check) of the candidates other than the fallback, in the order tried.
_LOSSLESS_TRIED: Final[tuple[tuple[ActivationCodec, _ExactEncoder], ...]] = tuple(
    (r.codec, r.exact) for r in _LOSSLESS_ROWS if r.exact is not None
)


# --------------------------------------------------------------------------- policies


class CodecPolicy(enum.Enum):
    """How a stage picks each frame's codec and which codecs it admits (docs/PROTOCOL.md §4.1)."""

    FIXED = "fixed"
    AUTO_LOSSLESS_V1 = "auto-lossless-v1"

    @classmethod
    def parse(cls, value: str | CodecPolicy) -> CodecPolicy:
        """Return the policy named by ``value``; raise CodecError otherwise."""
        if isinstance(value, CodecPolicy):
            return value
        if isinstance(value, str):
            for policy in cls:
                if policy.value == value:
                    return policy
        raise CodecError(
            f"unknown activation codec policy {value!r}; expected one of "
            + ", ".join(policy.value for policy in cls)
        )

    def check_compatible(self, configured: ActivationCodec) -> None:
        """Raise CodecError if this policy cannot run with the configured codec."""
        configured = ActivationCodec.parse(configured)
        # auto-lossless-v1 sends the fallback whenever no compact codec is exact.
        if self is CodecPolicy.AUTO_LOSSLESS_V1 and configured is not _LOSSLESS_FALLBACK:
            raise CodecError(
                f"activation codec policy {self.value} is incompatible with configured "
                f"codec {configured.wire_name}"
            )

    def admits(self, configured: ActivationCodec, codec: ActivationCodec) -> bool:
        """Whether a receiver configured with ``configured`` accepts frames in ``codec``."""
        return ActivationCodec.parse(codec) in self.admitted(configured)

    def admitted(self, configured: ActivationCodec) -> tuple[ActivationCodec, ...]:
        """The codecs a receiver configured with ``configured`` accepts under this policy."""
        if self is CodecPolicy.AUTO_LOSSLESS_V1:
            return LOSSLESS_CANDIDATES
        return (ActivationCodec.parse(configured),)


# --------------------------------------------------------------------------- public


def encoded_nbytes(codec: ActivationCodec | str | int, shape: Sequence[int]) -> int:
    """Wire size of an F32 array of numpy ``shape`` under ``codec`` (0 for an empty array)."""
    spec = _BY_CODEC[ActivationCodec.parse(codec)]
    return spec.nbytes(_checked_shape(spec, shape))


def encode_array(
    codec: ActivationCodec | str | int, values: npt.NDArray[np.float32]
) -> npt.NDArray[Any]:
    """Encode a C-contiguous float32 array; return a C-contiguous array of the wire bytes.

    raw returns ``values`` itself (zero copy); f16/bf16 return uint16 of the same shape,
    s8 a flat uint8 array. ``values`` is never modified.
    """
    spec = _BY_CODEC[ActivationCodec.parse(codec)]
    return spec.encode(_checked_values(f"{spec.wire_name} encoder", values))


def decode_array(
    codec: ActivationCodec | str | int, payload: Buffer, shape: Sequence[int]
) -> npt.NDArray[np.float32]:
    """Decode wire bytes into a float32 array of ``shape`` (raw: a read-only view)."""
    spec = _BY_CODEC[ActivationCodec.parse(codec)]
    dims = _checked_shape(spec, shape)
    data = _byte_view(spec, payload)
    expected = spec.nbytes(dims)
    if data.size != expected:
        raise CodecError(
            f"{spec.wire_name} payload has {data.size} bytes; expected {expected} for shape {dims}"
        )
    return spec.decode(data, dims)


def encode_values(codec: ActivationCodec | str | int, values: npt.NDArray[np.float32]) -> bytes:
    """Encode a float32 array (last axis = row) to wire bytes; the convenience API."""
    codec = ActivationCodec.parse(codec)
    if isinstance(values, np.ndarray) and values.dtype == np.float32 and values.ndim >= 1:
        values = np.ascontiguousarray(values)
    return encode_array(codec, values).tobytes()


def decode_values(
    codec: ActivationCodec | str | int, payload: Buffer, shape: Sequence[int]
) -> npt.NDArray[np.float32]:
    """Decode wire bytes to a new, writable float32 array of ``shape``."""
    decoded = decode_array(codec, payload, shape)
    if not decoded.flags.writeable:  # a view of the payload (raw)
        return decoded.copy()
    return decoded


def select_lossless(
    arrays: Sequence[npt.NDArray[np.float32]],
) -> tuple[ActivationCodec, list[npt.NDArray[Any]]]:
    """auto-lossless-v1 for one frame: the smallest codec exact for every F32 part.

    Returns the codec and the encodings to send (as from ``encode_array``). The candidates
    are tried in `LOSSLESS_CANDIDATES` order, each encoding the frame at most once; any
    NaN/Inf, or no elements at all, gives the fallback, raw (docs/PROTOCOL.md §4.1).
    """
    parts = [_checked_values("auto-lossless-v1 selection", values) for values in arrays]
    if sum(values.size for values in parts) == 0:
        return _LOSSLESS_FALLBACK, list(parts)
    for codec, exact in _LOSSLESS_TRIED:
        encodings = exact(parts)
        if isinstance(encodings, list):
            return codec, encodings
        if encodings == _NON_FINITE:
            break
    return _LOSSLESS_FALLBACK, list(parts)
