"""Stage replies to the driver as ZeroMQ multipart frames: Ack, PredictedToken(s) and Error, with
their trace records (docs/PROTOCOL.md §2.4). No sockets.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.errors import LimitError, SkippyError, WireError
from skippy_zmq.wire.messages import (
    CRC,
    EMPTY_I32,
    WIRE_VERSION,
    MessageKind,
    as_int32_array,
    crc_of,
    in_int32,
    in_uint64,
    tuple_of_traces,
)
from skippy_zmq.wire.trace import MAX_TRACE_RECORDS, TRACE_BYTES, TraceRecord

if TYPE_CHECKING:
    from skippy_zmq.wire.codecs import Buffer


REPLY_MAGIC = b"SKZR"
MAX_ERROR_TEXT_BYTES = 64 * 1024
MAX_PREDICTED_TOKENS = 4096


class ReplyKind(enum.IntEnum):
    """Replies to the driver; ids are part of the wire format."""

    ACK = 1
    PREDICTED_TOKEN = 2
    PREDICTED_TOKENS = 3
    ERROR = 4

    @classmethod
    def parse(cls, value: int) -> ReplyKind:
        """Return the reply kind for a wire id, or raise WireError naming it."""
        try:
            return cls(value)
        except ValueError:
            raise WireError(f"unknown stage reply kind {value}") from None


class ErrorCause(enum.IntEnum):
    """Why a stage refused a message, in an Error reply's token field (docs/PROTOCOL.md §2.4):
    the refusals a driver acts on rather than failing the session. The ids are wire format."""

    UNSPECIFIED = -1
    LANE_LIMIT = 1  # every lane held: the session may start over once one is free
    DRIVER_REPLACED = 2  # the message came from a driver incarnation the stage saw replaced

    @classmethod
    def of(cls, value: int) -> ErrorCause:
        """The cause a wire value names; an id this version does not know is UNSPECIFIED."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


_REPLY_HEADER = struct.Struct("<4sHHQQiiiHHI")
_REPLY_CRC_OFFSET = _REPLY_HEADER.size - CRC.size
REPLY_HEADER_BYTES = _REPLY_HEADER.size


def clip_error_text(text: str) -> str:
    """`text` cut to the reply's error-text limit (MAX_ERROR_TEXT_BYTES of UTF-8, §2.5)."""
    if len(text) * 4 <= MAX_ERROR_TEXT_BYTES:
        return text
    return text.encode()[:MAX_ERROR_TEXT_BYTES].decode("utf-8", "ignore")


@attrs.frozen(eq=False)
class Reply:
    """A reply to the driver: Ack, PredictedToken(s) or Error, with the per-stage trace."""

    kind: ReplyKind
    request_id: int = attrs.field(validator=in_uint64("request_id"))
    session_id: int = attrs.field(validator=in_uint64("session_id"))
    stage_index: int = attrs.field(validator=in_int32("reply stage_index"))
    answered: MessageKind | None = None
    decode_step: int = attrs.field(default=-1, validator=in_int32("decode_step"))
    predicted_token: int = attrs.field(default=-1, validator=in_int32("predicted_token"))
    tokens: npt.NDArray[np.int32] = attrs.field(factory=lambda: EMPTY_I32, converter=as_int32_array)
    error: str = ""
    trace: tuple[TraceRecord, ...] = attrs.field(default=(), converter=tuple_of_traces)

    def __attrs_post_init__(self) -> None:
        if (self.kind is ReplyKind.ERROR) != bool(self.error):
            raise WireError("error text must be present exactly on ERROR replies")
        size = len(self.error.encode())
        if size > MAX_ERROR_TEXT_BYTES:
            raise LimitError(f"error text has {size} bytes; the limit is {MAX_ERROR_TEXT_BYTES}")
        if self.tokens.size > MAX_PREDICTED_TOKENS:
            raise LimitError(
                f"reply has {self.tokens.size} predicted tokens; the limit is {MAX_PREDICTED_TOKENS}"
            )
        if len(self.trace) > MAX_TRACE_RECORDS:
            raise LimitError(f"trace has {len(self.trace)} records; the limit is {MAX_TRACE_RECORDS}")

    @classmethod
    def heartbeat(cls, stage_index: int, sent_at_us: int, incarnation: int = 0) -> Reply:
        """The liveness beacon a worker sends its driver: an Ack for request 0 whose session_id
        field carries the worker process's incarnation id (docs/PROTOCOL.md §2.4)."""
        record = TraceRecord(stage_index=stage_index, received_at_us=sent_at_us, sent_at_us=sent_at_us)
        return cls(kind=ReplyKind.ACK, request_id=0, session_id=incarnation, stage_index=stage_index, trace=(record,))

    @property
    def is_heartbeat(self) -> bool:
        """True for a worker's liveness beacon (see `heartbeat`): an Ack for request 0 that
        answers no message kind (a stage refuses request id 0, so no real Ack looks like it)."""
        return self.kind is ReplyKind.ACK and self.request_id == 0 and self.answered is None

    @property
    def error_cause(self) -> ErrorCause:
        """An Error reply's cause (the header's token field); UNSPECIFIED for other replies."""
        return ErrorCause.of(self.predicted_token) if self.kind is ReplyKind.ERROR else ErrorCause.UNSPECIFIED

    @property
    def incarnation(self) -> int:
        """A heartbeat's incarnation id: new each time a stage process starts (0: not given)."""
        return self.session_id if self.is_heartbeat else 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Reply):
            return NotImplemented
        return (
            attrs.astuple(self, recurse=False, filter=lambda a, _v: a.name != "tokens")
            == attrs.astuple(other, recurse=False, filter=lambda a, _v: a.name != "tokens")
            and np.array_equal(self.tokens, other.tokens)
        )

    __hash__ = None  # type: ignore[assignment]


def encode_reply(reply: Reply) -> list[Buffer]:
    """Frames of a reply: header, predicted token ids, error text, trace records."""
    fixed = _REPLY_HEADER.pack(
        REPLY_MAGIC,
        WIRE_VERSION,
        int(reply.kind),
        reply.request_id,
        reply.session_id,
        reply.stage_index,
        reply.decode_step,
        reply.predicted_token,
        int(reply.answered) if reply.answered is not None else 0,
        len(reply.trace),
        0,
    )[:_REPLY_CRC_OFFSET]
    trace = b"".join(record.to_bytes() for record in reply.trace)
    error = reply.error.encode()
    crc = crc_of(fixed, reply.tokens, error, trace)
    return [fixed + CRC.pack(crc), reply.tokens, error, trace]


def decode_reply(frames: Sequence[Buffer]) -> Reply:
    """Validate and parse a reply."""
    try:
        return _decode_reply(frames)
    except SkippyError:
        raise
    except (struct.error, ValueError, TypeError, OverflowError) as exc:
        raise WireError(f"malformed stage reply: {exc}") from None


def _decode_reply(frames: Sequence[Buffer]) -> Reply:
    if len(frames) != 4:
        raise WireError(f"stage reply has {len(frames)} frames; expected 4")
    views = [memoryview(f).cast("B") for f in frames]
    if views[0].nbytes != REPLY_HEADER_BYTES:
        raise WireError(
            f"stage reply header has {views[0].nbytes} bytes; expected {REPLY_HEADER_BYTES}"
        )
    (magic, version, kind_id, request_id, session_id, stage_index, decode_step, token,
     answered_id, trace_count, crc) = _REPLY_HEADER.unpack(views[0])
    if magic != REPLY_MAGIC:
        raise WireError(f"stage reply magic {magic!r} is wrong; expected {REPLY_MAGIC!r}")
    if version != WIRE_VERSION:
        raise WireError(f"stage reply wire version {version} is not supported; expected {WIRE_VERSION}")
    actual = crc_of(views[0][:_REPLY_CRC_OFFSET], views[1], views[2], views[3])
    if crc != actual:
        raise WireError(
            f"stage reply checksum {crc:#010x} does not match its contents ({actual:#010x})"
        )
    kind = ReplyKind.parse(kind_id)
    answered = MessageKind.parse(answered_id) if answered_id else None
    if trace_count > MAX_TRACE_RECORDS:
        raise LimitError(f"trace record count {trace_count} exceeds the limit of {MAX_TRACE_RECORDS}")
    if views[3].nbytes != trace_count * TRACE_BYTES:
        raise WireError(
            f"reply trace frame has {views[3].nbytes} bytes; expected {trace_count * TRACE_BYTES} "
            f"for {trace_count} records"
        )
    if views[1].nbytes % 4:
        raise WireError(f"reply token frame has {views[1].nbytes} bytes; expected a multiple of 4")
    if views[1].nbytes // 4 > MAX_PREDICTED_TOKENS:
        raise LimitError(
            f"reply has {views[1].nbytes // 4} predicted tokens; the limit is {MAX_PREDICTED_TOKENS}"
        )
    if views[2].nbytes > MAX_ERROR_TEXT_BYTES:
        raise LimitError(f"error text has {views[2].nbytes} bytes; the limit is {MAX_ERROR_TEXT_BYTES}")
    try:
        error = bytes(views[2]).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("reply error text is not valid UTF-8") from None
    trace = tuple(
        TraceRecord.from_bytes(views[3][i * TRACE_BYTES : (i + 1) * TRACE_BYTES])
        for i in range(trace_count)
    )
    return Reply(
        kind=kind,
        request_id=request_id,
        session_id=session_id,
        stage_index=stage_index,
        answered=answered,
        decode_step=decode_step,
        predicted_token=token,
        tokens=np.frombuffer(views[1], dtype="<i4"),
        error=error,
        trace=trace,
    )
