"""Activation parts and frames: what one stage hands to the next (docs/PROTOCOL.md §3). No sockets."""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import FrameError, LimitError

FRAME_VERSION = 2
PART_OPTIONAL = 1 << 0
KNOWN_PART_FLAGS = PART_OPTIONAL
MAX_PARTS = 16
MAX_RANK = 4
MAX_ACTIVATION_BYTES = 512 * 1024 * 1024
"""Limit on both the wire bytes and the decoded bytes of one activation frame (docs/PROTOCOL.md §2.5)."""
MAX_DIM = 2**32 - 1


class GGMLType(enum.IntEnum):
    """ggml tensor types an activation part may have; ids are ggml's."""

    F32 = 0
    F16 = 1
    I32 = 26
    BF16 = 30

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return 4 if self in (GGMLType.F32, GGMLType.I32) else 2

    @property
    def dtype(self) -> np.dtype[Any]:
        """Little-endian numpy dtype of decoded values (BF16 is kept as its raw uint16 bits)."""
        return np.dtype(_DTYPES[self])

    @classmethod
    def parse(cls, value: int) -> GGMLType:
        """Return the member for a ggml type id, or raise FrameError naming the id."""
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(f"{m.name}={m.value}" for m in cls)
            raise FrameError(
                f"unsupported activation part ggml type {value}; expected one of {known}"
            ) from None


_DTYPES = {GGMLType.F32: "<f4", GGMLType.F16: "<f2", GGMLType.I32: "<i4", GGMLType.BF16: "<u2"}


def _check_part(part: PartDesc, _attr: Any, _value: Any) -> None:
    if not 1 <= len(part.dims) <= MAX_RANK:
        raise LimitError(
            f"activation part {part.identity}: rank {len(part.dims)} is outside 1..{MAX_RANK}"
        )
    if not 0 <= part.token_axis < len(part.dims):
        raise FrameError(
            f"activation part {part.identity}: token_axis {part.token_axis} is outside "
            f"0..{len(part.dims) - 1} for rank {len(part.dims)}"
        )
    for axis, dim in enumerate(part.dims):
        if dim < 1:
            raise FrameError(
                f"activation part {part.identity}: dims[{axis}] = {dim} must be positive"
            )
        if dim > MAX_DIM:
            raise LimitError(
                f"activation part {part.identity}: dims[{axis}] = {dim} exceeds the limit of {MAX_DIM}"
            )
    if part.flags & ~KNOWN_PART_FLAGS:
        raise FrameError(
            f"activation part {part.identity}: unknown flag bits {part.flags & ~KNOWN_PART_FLAGS:#x}; "
            f"only OPTIONAL ({PART_OPTIONAL:#x}) is defined"
        )
    if not 0 <= part.identity < 2**32:
        raise FrameError(f"activation part identity {part.identity} is outside 0..2**32-1")


def _int_tuple(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(value)


def _part_tuple(value: Sequence[PartDesc]) -> tuple[PartDesc, ...]:
    return tuple(value)


def _array_tuple(value: Sequence[npt.NDArray[Any]]) -> tuple[npt.NDArray[Any], ...]:
    return tuple(value)


def _to_ggml_type(value: int) -> GGMLType:
    return value if isinstance(value, GGMLType) else GGMLType.parse(value)


@attrs.frozen
class PartDesc:
    """Descriptor of one activation part; `dims[0]` is innermost, as in ggml."""

    identity: int
    ggml_type: GGMLType = attrs.field(converter=_to_ggml_type)
    dims: tuple[int, ...] = attrs.field(converter=_int_tuple)
    token_axis: int = 0
    flags: int = attrs.field(default=0, validator=_check_part)

    @property
    def rank(self) -> int:
        """Number of dims (1..4)."""
        return len(self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (C-order) shape: dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        """Number of values in the part."""
        count = 1
        for dim in self.dims:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        """Decoded size in bytes."""
        return self.n_elements * self.ggml_type.itemsize

    @property
    def optional(self) -> bool:
        """True when a consumer may ignore this part."""
        return bool(self.flags & PART_OPTIONAL)

    @property
    def token_count(self) -> int:
        """Number of tokens the part covers (`dims[token_axis]`)."""
        return self.dims[self.token_axis]


def _check_frame(frame: FrameDesc, _attr: Any, _value: Any) -> None:
    if frame.version != FRAME_VERSION:
        raise FrameError(
            f"activation frame version {frame.version} is not supported; expected {FRAME_VERSION}"
        )
    if not 1 <= len(frame.parts) <= MAX_PARTS:
        raise LimitError(f"activation frame part count {len(frame.parts)} is outside 1..{MAX_PARTS}")
    if frame.token_count < 1:
        raise FrameError(f"activation frame token_count {frame.token_count} must be at least 1")
    if frame.sequence_count < 1:
        raise FrameError(
            f"activation frame sequence_count {frame.sequence_count} must be at least 1"
        )
    if not 0 <= frame.layer_start < frame.layer_end:
        raise FrameError(
            f"activation frame layer range {frame.layer_start}..{frame.layer_end} is empty or negative"
        )
    if frame.producer_stage_index < 0:
        raise FrameError(
            f"activation frame producer_stage_index {frame.producer_stage_index} must not be negative"
        )
    seen: set[int] = set()
    for part in frame.parts:
        if part.identity in seen:
            raise FrameError(f"activation frame has two parts with identity {part.identity}")
        seen.add(part.identity)
        if part.token_count != frame.token_count:
            raise FrameError(
                f"activation part {part.identity}: dims[{part.token_axis}] = {part.token_count} "
                f"must equal the frame token_count {frame.token_count}"
            )
    primary = frame.parts[0]
    if primary.ggml_type is not GGMLType.F32 or primary.optional:
        raise FrameError(
            f"activation part 0 (identity {primary.identity}) must be the primary hidden state: "
            f"F32 and not OPTIONAL, got {primary.ggml_type.name} flags {primary.flags:#x}"
        )
    total = sum(part.nbytes for part in frame.parts)
    if total > MAX_ACTIVATION_BYTES:
        raise LimitError(
            f"activation frame decoded size {total} bytes exceeds the limit of "
            f"{MAX_ACTIVATION_BYTES} bytes"
        )


@attrs.frozen
class FrameDesc:
    """Descriptor of an activation frame: producer, its layer range, token count and parts."""

    producer_stage_index: int
    layer_start: int
    layer_end: int
    token_count: int
    parts: tuple[PartDesc, ...] = attrs.field(converter=_part_tuple)
    sequence_count: int = 1
    version: int = attrs.field(default=FRAME_VERSION, validator=_check_frame)

    @property
    def payload_bytes(self) -> int:
        """Decoded size of all parts, in bytes."""
        return sum(part.nbytes for part in self.parts)


def _array_key(arrays: tuple[npt.NDArray[Any], ...]) -> tuple[tuple[str, tuple[int, ...], bytes], ...]:
    return tuple((a.dtype.str, a.shape, a.tobytes()) for a in arrays)


@attrs.frozen
class ActivationFrame:
    """A decoded frame: descriptor plus one numpy array per part (shape `PartDesc.shape`)."""

    desc: FrameDesc
    arrays: tuple[npt.NDArray[Any], ...] = attrs.field(converter=_array_tuple, eq=_array_key)

    def __attrs_post_init__(self) -> None:
        if len(self.arrays) != len(self.desc.parts):
            raise FrameError(
                f"activation frame has {len(self.arrays)} arrays for {len(self.desc.parts)} parts"
            )
        for part, array in zip(self.desc.parts, self.arrays, strict=True):
            if array.dtype != part.ggml_type.dtype or array.shape != part.shape:
                raise FrameError(
                    f"activation part {part.identity}: array {array.dtype} {array.shape} does not "
                    f"match descriptor {part.ggml_type.name} shape {part.shape}"
                )

    @classmethod
    def from_hidden(
        cls,
        hidden: npt.NDArray[np.float32],
        *,
        producer_stage_index: int,
        layer_start: int,
        layer_end: int,
        sidebands: Sequence[tuple[PartDesc, npt.NDArray[Any]]] = (),
    ) -> ActivationFrame:
        """Wrap a `(token_count, n_embd)` hidden state (plus optional sideband parts) as a frame."""
        if hidden.ndim != 2 or hidden.dtype != np.float32:
            raise FrameError(
                f"primary hidden state must be float32 (token_count, n_embd), "
                f"got {hidden.dtype} {hidden.shape}"
            )
        token_count, n_embd = hidden.shape
        desc = _hidden_desc(
            n_embd, token_count, producer_stage_index, layer_start, layer_end,
            tuple(part for part, _ in sidebands),
        )
        return cls(desc, (np.ascontiguousarray(hidden), *(a for _, a in sidebands)))

    @property
    def hidden(self) -> npt.NDArray[np.float32]:
        """The primary hidden state, `(token_count, n_embd)` for a rank-2 primary part."""
        return self.arrays[0]


@functools.lru_cache(maxsize=256)
def _hidden_desc(
    n_embd: int,
    token_count: int,
    producer_stage_index: int,
    layer_start: int,
    layer_end: int,
    sidebands: tuple[PartDesc, ...],
) -> FrameDesc:
    # Cached: a stage emits the same descriptor for every decode step.
    primary = PartDesc(identity=0, ggml_type=GGMLType.F32, dims=(n_embd, token_count), token_axis=1)
    return FrameDesc(
        producer_stage_index=producer_stage_index,
        layer_start=layer_start,
        layer_end=layer_end,
        token_count=token_count,
        parts=(primary, *sidebands),
    )
