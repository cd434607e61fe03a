"""Stage messages and replies as ZeroMQ multipart frames (docs/PROTOCOL.md §2). No sockets.

`encode_message` turns a `StageMessage` into a list of buffers for `send_multipart(copy=False)`;
`decode_message` validates a received list of frames and returns views into them. The byte
layout is documented in docs/PROTOCOL.md and pinned by golden-byte tests.
"""

from __future__ import annotations

import enum
import functools
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq import defaults
from skippy_zmq.errors import CodecError, FrameError, LimitError, SkippyError, WireError, check_rows
from skippy_zmq.wire.codecs import ActivationCodec, decode_array, encode_array, encoded_nbytes
from skippy_zmq.wire.frames import (
    FRAME_VERSION,
    MAX_ACTIVATION_BYTES,
    MAX_PARTS,
    MAX_RANK,
    ActivationFrame,
    FrameDesc,
    GGMLType,
    PartDesc,
)
from skippy_zmq.wire.options import GenerationOptions, decode_options, encode_options
from skippy_zmq.wire.trace import MAX_TRACE_RECORDS, TRACE_BYTES, TraceRecord

if TYPE_CHECKING:
    from skippy_zmq.wire.codecs import Buffer

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("skippy_zmq.wire assumes a little-endian host (zero-copy int32/f32 views)")

MESSAGE_MAGIC = b"SKZM"
WIRE_VERSION = 1
STATE_VERSION = 1
MAX_SIDEBAND_VALUES = 1_048_576
MAX_DRAFT_TOKENS = defaults.MAX_DRAFT_TOKENS

FLAG_FINAL_CHUNK = 1 << 0
FLAG_OPTIONS = 1 << 3
FLAG_PASS_CONTINUES = 1 << 4
"""Set by a sender on every message of a pass it sends back to back but the last: the receiver
may wait a moment for the rest before it runs a pass (docs/PROTOCOL.md §2.2, §5 Batching)."""
KNOWN_STATE_FLAGS = FLAG_FINAL_CHUNK | FLAG_OPTIONS | FLAG_PASS_CONTINUES
PHASE_NONE = 0
PHASE_PREFILL = 1
PHASE_DECODE = 2

DRIVER_ID_BITS = 15
INCARNATION_BITS = 16
MAX_DRIVER_ID = (1 << DRIVER_ID_BITS) - 1
MAX_DRIVER_INCARNATION = (1 << INCARNATION_BITS) - 1


class MessageKind(enum.IntEnum):
    """Stage message kinds; the ids are part of the wire format."""

    PREFILL_EMBD = 1
    DECODE_EMBD = 2
    STOP = 3
    PREFILL_FINAL_EMBD = 4
    CONFIGURE_GENERATION = 14
    TRIM_SESSION = 19
    FORK_SESSION = 20
    VERIFY_EMBD = 21

    @classmethod
    def parse(cls, value: int) -> MessageKind:
        """Return the kind for a wire id, or raise WireError ("unknown stage message kind 10")."""
        try:
            return cls(value)
        except ValueError:
            raise WireError(f"unknown stage message kind {value}") from None

    @property
    def carries_tokens(self) -> bool:
        """True for kinds that run layers on `token_count` tokens (prefill and decode)."""
        return KINDS[self].carries_tokens

    @property
    def expects_reply(self) -> bool:
        """True when the final stage answers this kind (everything but a non-final prefill chunk)."""
        return KINDS[self].expects_reply

    @property
    def phase(self) -> int:
        """The state-header phase this kind must carry."""
        return KINDS[self].phase

    @property
    def decodes(self) -> bool:
        """True for the decode kinds: a decode step and a speculative verification (docs/PROTOCOL.md §2.1)."""
        return KINDS[self].phase == PHASE_DECODE


@attrs.frozen
class KindRow:
    """What the format says of one message kind: the phase its state header carries, whether it
    runs layers on tokens, and whether the final stage answers it."""

    phase: int
    carries_tokens: bool = False
    expects_reply: bool = True


KINDS: dict[MessageKind, KindRow] = {
    MessageKind.PREFILL_EMBD: KindRow(PHASE_PREFILL, carries_tokens=True, expects_reply=False),
    MessageKind.PREFILL_FINAL_EMBD: KindRow(PHASE_PREFILL, carries_tokens=True),
    MessageKind.DECODE_EMBD: KindRow(PHASE_DECODE, carries_tokens=True),
    MessageKind.VERIFY_EMBD: KindRow(PHASE_DECODE, carries_tokens=True),
    MessageKind.STOP: KindRow(PHASE_NONE),
    MessageKind.CONFIGURE_GENERATION: KindRow(PHASE_NONE),
    MessageKind.TRIM_SESSION: KindRow(PHASE_NONE),
    MessageKind.FORK_SESSION: KindRow(PHASE_NONE),
}
"""One row per message kind (docs/PROTOCOL.md §2.2): a kind added to `MessageKind` without its row
fails at import, naming it."""
check_rows(KINDS, MessageKind, "skippy_zmq.wire.messages.KINDS")


# --- fixed structs (offsets in docs/PROTOCOL.md) -------------------------------------------

_STATE = struct.Struct("<10i")
_HEADER = struct.Struct("<4sHHiiQQHHI40sI")
_FRAME_HEADER = struct.Struct("<HHiiiiiQ")
_PART = struct.Struct("<IIBBH4I")

CRC = struct.Struct("<I")
"""The little-endian CRC-32 that closes a message or reply header."""
_CRC_OFFSET = _HEADER.size - CRC.size
HEADER_BYTES = _HEADER.size
FRAME_HEADER_BYTES = _FRAME_HEADER.size
PART_BYTES = _PART.size


def check_int(name: str, value: int, low: int, high: int) -> None:
    """WireError unless low <= value <= high."""
    if not low <= value <= high:
        raise WireError(f"{name} {value} is outside {low}..{high}")


def in_int32(name: str) -> Callable[[Any, Any, int], None]:
    """An attrs validator of a signed 32-bit field."""
    return lambda _i, _a, v: check_int(name, v, -(2**31), 2**31 - 1)


def in_uint64(name: str) -> Callable[[Any, Any, int], None]:
    """An attrs validator of an unsigned 64-bit field."""
    return lambda _i, _a, v: check_int(name, v, 0, 2**64 - 1)


def driver_word(driver_id: int, incarnation: int) -> int:
    """The state's `driver_incarnation` word (docs/PROTOCOL.md §2.2): the driver id in bits 16..30,
    the incarnation of that driver in bits 0..15; both at least 1, so 0 means "no driver word"."""
    check_int("driver id", driver_id, 1, MAX_DRIVER_ID)
    check_int("driver incarnation", incarnation, 1, MAX_DRIVER_INCARNATION)
    return driver_id << INCARNATION_BITS | incarnation


def driver_id_of(word: int) -> int:
    """The driver id a non-zero `driver_incarnation` word names (0 for the word 0)."""
    return word >> INCARNATION_BITS


def driver_id_for(return_connect: str) -> int:
    """A driver's id: what a driver restarted on the same topology keeps, derived from the
    endpoint the stages send their replies to (docs/PROTOCOL.md §6, Driver restarts)."""
    return zlib.crc32(return_connect.encode()) % MAX_DRIVER_ID + 1


@attrs.frozen
class StateHeader:
    """The int32 state block every stage message carries (docs/PROTOCOL.md §2.2)."""

    version: int
    seq_id: int
    phase: int
    flags: int
    driver_incarnation: int
    prompt_token_count: int
    decode_step: int
    current_token: int
    source_stage_index: int
    activation_codec: int

    def __attrs_post_init__(self) -> None:
        # One range check for the whole block: this runs for every message on the hot path.
        values = (
            self.version, self.seq_id, self.phase, self.flags, self.driver_incarnation,
            self.prompt_token_count, self.decode_step, self.current_token,
            self.source_stage_index, self.activation_codec,
        )
        if min(values) < -(2**31) or max(values) > 2**31 - 1:
            field, value = next(
                (a.name, v) for a, v in zip(attrs.fields(StateHeader), values, strict=True) if not -(2**31) <= v < 2**31
            )
            raise WireError(f"state {field} {value} is outside the int32 range")

    @classmethod
    def for_kind(
        cls,
        kind: MessageKind,
        *,
        seq_id: int = 0,
        prompt_token_count: int = 0,
        decode_step: int = -1,
        current_token: int = -1,
        options: bool = False,
        driver_incarnation: int = 0,
    ) -> StateHeader:
        """A driver-side state header that agrees with `kind` (phase and FINAL_CHUNK)."""
        flags = FLAG_FINAL_CHUNK if kind is MessageKind.PREFILL_FINAL_EMBD else 0
        if options:
            flags |= FLAG_OPTIONS
        return cls(
            version=STATE_VERSION,
            seq_id=seq_id,
            phase=kind.phase,
            flags=flags,
            driver_incarnation=driver_incarnation,
            prompt_token_count=prompt_token_count,
            decode_step=decode_step,
            current_token=current_token,
            source_stage_index=-1,
            activation_codec=0,
        )

    def to_bytes(self) -> bytes:
        """The 40-byte little-endian encoding."""
        return _STATE.pack(*attrs.astuple(self))

    @classmethod
    def from_bytes(cls, data: Buffer) -> StateHeader:
        """Parse the 40-byte encoding."""
        return cls(*_STATE.unpack(data))


EMPTY_I32: npt.NDArray[np.int32] = np.zeros(0, dtype=np.int32)
EMPTY_I32.flags.writeable = False


def tuple_of_traces(value: Sequence[TraceRecord]) -> tuple[TraceRecord, ...]:
    """An attrs converter: trace records as a tuple."""
    return tuple(value)


def _tuple_of_buffers(value: Sequence[Buffer]) -> tuple[Buffer, ...]:
    return tuple(value)


def as_int32_array(value: Any) -> npt.NDArray[np.int32]:
    """An attrs converter: a 1-D contiguous int32 sideband, or WireError."""
    array = np.ascontiguousarray(value, dtype=np.int32)
    if array.ndim != 1:
        raise WireError(f"a sideband must be a 1-D int32 array, got shape {array.shape}")
    return array


@attrs.frozen(eq=False)
class EncodedActivation:
    """An activation frame as it travels: descriptor, codec and one encoded payload per part."""

    desc: FrameDesc
    codec: ActivationCodec
    payloads: tuple[Buffer, ...] = attrs.field(converter=_tuple_of_buffers)

    def __attrs_post_init__(self) -> None:
        if len(self.payloads) != len(self.desc.parts):
            raise FrameError(
                f"activation has {len(self.payloads)} payloads for {len(self.desc.parts)} parts"
            )
        wire_total = 0
        for part, payload in zip(self.desc.parts, self.payloads, strict=True):
            expected = part_wire_nbytes(self.codec, part)
            got = memoryview(payload).nbytes
            if got != expected:
                raise FrameError(
                    f"activation part {part.identity} payload has {got} bytes; expected {expected} "
                    f"for {part.ggml_type.name} dims {list(part.dims)} under {self.codec.wire_name}"
                )
            wire_total += got
        if wire_total > MAX_ACTIVATION_BYTES:
            raise LimitError(
                f"activation wire size {wire_total} bytes exceeds the limit of "
                f"{MAX_ACTIVATION_BYTES} bytes"
            )

    @property
    def wire_nbytes(self) -> int:
        """Total bytes of the encoded payloads."""
        return sum(memoryview(p).nbytes for p in self.payloads)

    def decode(self) -> ActivationFrame:
        """Decode every part; F32 parts through the codec, others as byte-exact views."""
        arrays = []
        for part, payload in zip(self.desc.parts, self.payloads, strict=True):
            if part.ggml_type is GGMLType.F32:
                arrays.append(decode_array(self.codec, payload, part.shape))
            else:
                arrays.append(np.frombuffer(payload, dtype=part.ggml_type.dtype).reshape(part.shape))
        return ActivationFrame(self.desc, tuple(arrays))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EncodedActivation):
            return NotImplemented
        return (
            self.desc == other.desc
            and self.codec == other.codec
            and [bytes(memoryview(p)) for p in self.payloads]
            == [bytes(memoryview(p)) for p in other.payloads]
        )

    __hash__ = None  # type: ignore[assignment]


def part_wire_nbytes(codec: ActivationCodec, part: PartDesc) -> int:
    """Encoded size of one part: F32 parts follow the codec, other types travel as they are."""
    if part.ggml_type is GGMLType.F32:
        return encoded_nbytes(codec, part.shape)
    return part.nbytes


def encode_activation(codec: ActivationCodec, frame: ActivationFrame) -> EncodedActivation:
    """Encode every F32 part of `frame` with `codec`; other parts pass through as views."""
    payloads: list[Buffer] = []
    for part, array in zip(frame.desc.parts, frame.arrays, strict=True):
        if part.ggml_type is GGMLType.F32:
            payloads.append(encode_array(codec, np.ascontiguousarray(array)))
        else:
            payloads.append(np.ascontiguousarray(array))
    return EncodedActivation(frame.desc, codec, tuple(payloads))


@attrs.frozen(eq=False)
class StageMessage:
    """One message on a stage link (docs/PROTOCOL.md §2.2)."""

    kind: MessageKind
    pos_start: int = attrs.field(validator=in_int32("pos_start"))
    token_count: int = attrs.field(validator=in_int32("token_count"))
    state: StateHeader = attrs.field()
    request_id: int = attrs.field(validator=in_uint64("request_id"))
    session_id: int = attrs.field(validator=in_uint64("session_id"))
    options: GenerationOptions | None = None
    tokens: npt.NDArray[np.int32] = attrs.field(factory=lambda: EMPTY_I32, converter=as_int32_array)
    positions: npt.NDArray[np.int32] = attrs.field(
        factory=lambda: EMPTY_I32, converter=as_int32_array
    )
    activation: EncodedActivation | None = None
    trace: tuple[TraceRecord, ...] = attrs.field(default=(), converter=tuple_of_traces)

    def __attrs_post_init__(self) -> None:
        _check_message(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StageMessage):
            return NotImplemented
        return (
            self.kind == other.kind
            and self.pos_start == other.pos_start
            and self.token_count == other.token_count
            and self.state == other.state
            and self.request_id == other.request_id
            and self.session_id == other.session_id
            and self.options == other.options
            and np.array_equal(self.tokens, other.tokens)
            and np.array_equal(self.positions, other.positions)
            and self.activation == other.activation
            and self.trace == other.trace
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def label(self) -> str:
        """`request 7 session 3 (DECODE_EMBD)`, for log lines and error texts."""
        return f"request {self.request_id} session {self.session_id} ({self.kind.name})"

    @property
    def pass_continues(self) -> bool:
        """Whether its sender sends more messages of the same pass right behind it (PASS_CONTINUES)."""
        return bool(self.state.flags & FLAG_PASS_CONTINUES)

    def with_pass_continues(self, more: bool) -> StageMessage:
        """The same message with PASS_CONTINUES set (`more`) or clear: a flag of one hop, which
        every sender sets for its own sends."""
        flags = self.state.flags | FLAG_PASS_CONTINUES if more else self.state.flags & ~FLAG_PASS_CONTINUES
        if flags == self.state.flags:
            return self
        return attrs.evolve(self, state=attrs.evolve(self.state, flags=flags))


def _check_message(message: StageMessage) -> None:
    _check_state(message)
    _check_counts(message)
    _check_activation_codec(message)


def _check_state(message: StageMessage) -> None:
    kind, state = message.kind, message.state
    if state.version != STATE_VERSION:
        raise WireError(f"state version {state.version} is not supported; expected {STATE_VERSION}")
    if state.phase != kind.phase:
        raise WireError(f"state phase {state.phase} does not match {kind.name}; expected {kind.phase}")
    if state.flags & ~KNOWN_STATE_FLAGS:
        raise WireError(f"unknown state flag bits {state.flags & ~KNOWN_STATE_FLAGS:#x}")
    final = bool(state.flags & FLAG_FINAL_CHUNK)
    if final != (kind is MessageKind.PREFILL_FINAL_EMBD):
        raise WireError(
            f"state FINAL_CHUNK is {'set' if final else 'clear'} on {kind.name}; it must be set "
            f"exactly on PREFILL_FINAL_EMBD"
        )
    if bool(state.flags & FLAG_OPTIONS) != (message.options is not None):
        raise WireError("state OPTIONS flag must be set exactly when generation options are present")
    if message.pos_start < 0:
        raise WireError(f"pos_start {message.pos_start} must not be negative")
    if state.source_stage_index < -1:
        raise WireError(f"source_stage_index {state.source_stage_index} must be -1 or a stage index")
    word = state.driver_incarnation
    if word and (word < 0 or not word >> INCARNATION_BITS or not word & MAX_DRIVER_INCARNATION):
        raise WireError(
            f"state driver_incarnation {word:#x} is not a driver word; expected 0 or a driver id "
            f"1..{MAX_DRIVER_ID} in bits 16..30 and an incarnation 1..{MAX_DRIVER_INCARNATION} in bits 0..15"
        )


def _check_counts(message: StageMessage) -> None:
    kind = message.kind
    for name, array in (("token", message.tokens), ("position", message.positions)):
        if array.size > MAX_SIDEBAND_VALUES:
            raise LimitError(
                f"{name} sideband has {array.size} values; the limit is {MAX_SIDEBAND_VALUES}"
            )
    if kind.carries_tokens:
        if message.token_count < 1:
            raise WireError(f"{kind.name} token_count {message.token_count} must be at least 1")
        if kind is MessageKind.DECODE_EMBD and message.token_count != 1:
            raise WireError(f"DECODE_EMBD token_count {message.token_count} must be 1")
        if kind is MessageKind.VERIFY_EMBD and not 2 <= message.token_count <= MAX_DRAFT_TOKENS + 1:
            raise WireError(f"VERIFY_EMBD token_count {message.token_count} must be 2..{MAX_DRAFT_TOKENS + 1}: the "
                            f"session's last token and 1..{MAX_DRAFT_TOKENS} draft tokens")
        if message.tokens.size != message.token_count:
            raise WireError(
                f"token sideband has {message.tokens.size} values for token_count "
                f"{message.token_count}"
            )
    elif kind in (MessageKind.TRIM_SESSION, MessageKind.FORK_SESSION):
        if message.token_count < 0:
            raise WireError(f"{kind.name} token_count {message.token_count} must not be negative")
        if kind is MessageKind.FORK_SESSION:
            _check_fork(message)
    elif message.token_count != 0 or message.tokens.size:
        raise WireError(f"{kind.name} must carry no tokens, got token_count {message.token_count}")
    if message.positions.size not in (0, message.token_count) or (
        message.positions.size and not kind.carries_tokens
    ):
        raise WireError(
            f"position sideband has {message.positions.size} values; expected 0 or token_count "
            f"{message.token_count}"
        )
    if len(message.trace) > MAX_TRACE_RECORDS:
        raise LimitError(
            f"trace has {len(message.trace)} records; the limit is {MAX_TRACE_RECORDS}"
        )


def _check_fork(message: StageMessage) -> None:
    """A ForkSession names the session it copies from, which is not the one it opens (§2.6)."""
    source = message.options.fork_from if message.options is not None else None
    if source is None:
        raise WireError("FORK_SESSION must carry generation options with a fork-from record naming the source session")
    if source == message.session_id:
        raise WireError(f"FORK_SESSION copies session {source} into itself; the source must be another session")


def _check_activation_codec(message: StageMessage) -> None:
    kind, state, activation = message.kind, message.state, message.activation
    if activation is None:
        if state.activation_codec != 0:
            raise WireError(
                f"activation_codec {state.activation_codec} is set on a message without activation"
            )
        return
    if not kind.carries_tokens:
        raise WireError(f"{kind.name} must not carry an activation frame")
    if state.activation_codec != int(activation.codec):
        raise WireError(
            f"state activation_codec {state.activation_codec} does not match the frame's codec "
            f"{int(activation.codec)}"
        )


def check_activation_matches(message: StageMessage) -> None:
    """Receiver-side checks (docs/PROTOCOL.md §3) of a frame against its message (token count, producer)."""
    activation = message.activation
    if activation is None:
        return
    if activation.desc.token_count != message.token_count:
        raise FrameError(
            f"activation frame token count does not match stage message: frame "
            f"{activation.desc.token_count}, message {message.token_count}"
        )
    if activation.desc.producer_stage_index != message.state.source_stage_index:
        raise FrameError(
            f"activation frame producer does not match stage message: frame producer "
            f"{activation.desc.producer_stage_index}, source_stage_index "
            f"{message.state.source_stage_index}"
        )


# --- encoding -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _descriptor_to_bytes(desc: FrameDesc) -> bytes:
    # Cached: a pipeline sends the same few descriptors (one per token count) over and over.
    out = bytearray(
        _FRAME_HEADER.pack(
            desc.version,
            len(desc.parts),
            desc.producer_stage_index,
            desc.layer_start,
            desc.layer_end,
            desc.token_count,
            desc.sequence_count,
            desc.payload_bytes,
        )
    )
    for part in desc.parts:
        dims = (*part.dims, *([0] * (MAX_RANK - part.rank)))
        out += _PART.pack(
            part.identity, int(part.ggml_type), part.rank, part.token_axis, part.flags, *dims
        )
    return bytes(out)


def _descriptor_from_bytes(data: memoryview, part_count: int) -> FrameDesc:
    expected = FRAME_HEADER_BYTES + part_count * PART_BYTES
    if data.nbytes != expected:
        raise WireError(
            f"activation descriptor has {data.nbytes} bytes; expected {expected} for "
            f"{part_count} parts"
        )
    return _parse_descriptor(bytes(data), part_count)


@functools.lru_cache(maxsize=256)
def _parse_descriptor(data: bytes, part_count: int) -> FrameDesc:
    # Cached by content: descriptors repeat, and FrameDesc is immutable. Errors are not cached.
    version, count, producer, start, end, tokens, seqs, payload_bytes = _FRAME_HEADER.unpack_from(data)
    if version != FRAME_VERSION:
        raise FrameError(f"activation frame version {version} is not supported; expected {FRAME_VERSION}")
    if count != part_count:
        raise WireError(
            f"activation descriptor part_count {count} does not match header part count {part_count}"
        )
    parts = []
    for index in range(count):
        identity, ggml_type, rank, token_axis, flags, *dims = _PART.unpack_from(
            data, FRAME_HEADER_BYTES + index * PART_BYTES
        )
        if not 1 <= rank <= MAX_RANK:
            raise LimitError(f"activation part {identity}: rank {rank} is outside 1..{MAX_RANK}")
        if any(dims[rank:]):
            raise FrameError(f"activation part {identity}: dims beyond rank {rank} must be zero")
        parts.append(
            PartDesc(
                identity=identity,
                ggml_type=GGMLType.parse(ggml_type),
                dims=tuple(dims[:rank]),
                token_axis=token_axis,
                flags=flags,
            )
        )
    desc = FrameDesc(
        producer_stage_index=producer,
        layer_start=start,
        layer_end=end,
        token_count=tokens,
        parts=tuple(parts),
        sequence_count=seqs,
        version=version,
    )
    if desc.payload_bytes != payload_bytes:
        raise FrameError(
            f"activation descriptor payload_bytes {payload_bytes} does not match its parts "
            f"({desc.payload_bytes} bytes)"
        )
    return desc


def crc_of(*parts: Buffer) -> int:
    """CRC-32 over the buffers in order."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def encode_message(message: StageMessage) -> list[Buffer]:
    """Frames for `send_multipart(..., copy=False)`: header, options, tokens, positions[, activation]."""
    activation = message.activation
    part_count = len(activation.desc.parts) if activation is not None else 0
    trace = b"".join(record.to_bytes() for record in message.trace)
    options = encode_options(message.options) if message.options is not None else b""
    descriptor = _descriptor_to_bytes(activation.desc) if activation is not None else b""
    fixed = _HEADER.pack(
        MESSAGE_MAGIC,
        WIRE_VERSION,
        int(message.kind),
        message.pos_start,
        message.token_count,
        message.request_id,
        message.session_id,
        part_count,
        len(message.trace),
        message.positions.size,
        message.state.to_bytes(),
        0,
    )[:_CRC_OFFSET]
    crc = crc_of(fixed, trace, options, message.tokens, message.positions, descriptor)
    frames: list[Buffer] = [
        fixed + CRC.pack(crc) + trace,
        options,
        message.tokens,
        message.positions,
    ]
    if activation is not None:
        frames.append(descriptor)
        frames.extend(activation.payloads)
    return frames


def decode_message(frames: Sequence[Buffer]) -> StageMessage:
    """Validate and parse a multipart stage message; payloads stay views into `frames`."""
    try:
        return _decode_message(frames)
    except SkippyError:
        raise
    except (struct.error, ValueError, TypeError, OverflowError) as exc:
        # Defence in depth: nothing malformed escapes as anything but a WireError.
        raise WireError(f"malformed stage message: {exc}") from None


@attrs.frozen(eq=False)
class _Envelope:
    """The fixed header fields of a received message, checked against its frames."""

    kind: MessageKind
    pos_start: int
    token_count: int
    request_id: int
    session_id: int
    part_count: int
    trace_count: int
    position_count: int
    state_bytes: bytes
    tokens: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int32]


def _decode_message(frames: Sequence[Buffer]) -> StageMessage:
    views = [memoryview(f).cast("B") for f in frames]
    envelope = _open_envelope(views)
    head, part_count = views[0], envelope.part_count
    state = StateHeader.from_bytes(envelope.state_bytes)
    trace = tuple(
        TraceRecord.from_bytes(head[HEADER_BYTES + i * TRACE_BYTES : HEADER_BYTES + (i + 1) * TRACE_BYTES])
        for i in range(envelope.trace_count)
    )
    options = decode_options(views[1]) if views[1].nbytes else None
    positions = envelope.positions
    if positions.size != envelope.position_count:
        raise WireError(
            f"position sideband has {positions.size} values; the header says {envelope.position_count}"
        )
    activation = None
    if part_count:
        try:
            codec = ActivationCodec.parse(state.activation_codec)
        except CodecError as exc:
            raise WireError(f"state activation_codec: {exc}") from None
        desc = _descriptor_from_bytes(views[4], part_count)
        activation = EncodedActivation(desc, codec, tuple(views[5:]))
    message = StageMessage(
        kind=envelope.kind,
        pos_start=envelope.pos_start,
        token_count=envelope.token_count,
        state=state,
        request_id=envelope.request_id,
        session_id=envelope.session_id,
        options=options,
        tokens=envelope.tokens,
        positions=positions,
        activation=activation,
        trace=trace,
    )
    check_activation_matches(message)
    return message


def _open_envelope(views: list[memoryview]) -> _Envelope:
    """Header, frame count, limits and checksum: everything checked before any payload is read."""
    frames = views
    if len(frames) < 4:
        raise WireError(f"stage message has {len(frames)} frames; expected at least 4")
    head = views[0]
    if head.nbytes < HEADER_BYTES:
        raise WireError(f"stage message header has {head.nbytes} bytes; expected at least {HEADER_BYTES}")
    (magic, version, kind_id, pos_start, token_count, request_id, session_id, part_count,
     trace_count, position_count, state_bytes, crc) = _HEADER.unpack_from(head)
    if magic != MESSAGE_MAGIC:
        raise WireError(f"stage message magic {magic!r} is wrong; expected {MESSAGE_MAGIC!r}")
    if version != WIRE_VERSION:
        raise WireError(f"stage message wire version {version} is not supported; expected {WIRE_VERSION}")
    kind = MessageKind.parse(kind_id)
    if part_count > MAX_PARTS:
        raise LimitError(f"activation part count {part_count} exceeds the limit of {MAX_PARTS}")
    if trace_count > MAX_TRACE_RECORDS:
        raise LimitError(f"trace record count {trace_count} exceeds the limit of {MAX_TRACE_RECORDS}")
    expected_head = HEADER_BYTES + trace_count * TRACE_BYTES
    if head.nbytes != expected_head:
        raise WireError(
            f"stage message header has {head.nbytes} bytes; expected {expected_head} for "
            f"{trace_count} trace records"
        )
    expected_frames = 4 if part_count == 0 else 5 + part_count
    if len(frames) != expected_frames:
        raise WireError(
            f"stage message has {len(frames)} frames; expected {expected_frames} for "
            f"{part_count} activation parts"
        )
    tokens = _sideband(views[2], "token")
    positions = _sideband(views[3], "position")
    descriptor = views[4] if part_count else b""
    actual = crc_of(head[:_CRC_OFFSET], head[HEADER_BYTES:], *views[1:4], descriptor)
    if crc != actual:
        raise WireError(
            f"stage message header checksum {crc:#010x} does not match its contents "
            f"({actual:#010x}); the header, options, sideband or descriptor frame is corrupt"
        )
    return _Envelope(kind, pos_start, token_count, request_id, session_id, part_count, trace_count,
                     position_count, state_bytes, tokens, positions)


def _sideband(view: memoryview, name: str) -> npt.NDArray[np.int32]:
    if view.nbytes % 4:
        raise WireError(f"{name} sideband has {view.nbytes} bytes; expected a multiple of 4")
    count = view.nbytes // 4
    if count > MAX_SIDEBAND_VALUES:
        raise LimitError(f"{name} sideband has {count} values; the limit is {MAX_SIDEBAND_VALUES}")
    return np.frombuffer(view, dtype="<i4")


_PEEK = struct.Struct("<4s2xH8xQQ")
"""magic, kind, request_id and session_id: the first 32 bytes of a header (§2.2)."""


def peek_ids(frames: Sequence[Buffer]) -> tuple[int, int, MessageKind | None]:
    """Best-effort (request_id, session_id, kind) of a message that failed to decode, so its
    Error reply can still be matched: a header cut short after the ids still names them."""
    if not frames:
        return 0, 0, None
    try:
        head = memoryview(frames[0]).cast("B")
    except (TypeError, ValueError):
        return 0, 0, None
    if head.nbytes < _PEEK.size:
        return 0, 0, None
    magic, kind_id, request_id, session_id = _PEEK.unpack_from(head)
    if magic != MESSAGE_MAGIC:
        return 0, 0, None
    kind = MessageKind(kind_id) if kind_id in _KIND_IDS else None
    return request_id, session_id, kind


_KIND_IDS = frozenset(int(kind) for kind in MessageKind)


# --- replies --------------------------------------------------------------------------------


