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
from skippy_zmq.tokens.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from skippy_zmq.wire.messages import (
    CRC,
    EMPTY_I32,
    WIRE_VERSION,
    MessageKind,
    as_int32_array,
    check_int,
    crc_of,
    in_int32,
    in_uint64,
    tuple_of_traces,
)
from skippy_zmq.wire.options import fixed, pack_records, unpack_records
from skippy_zmq.wire.trace import MAX_TRACE_RECORDS, TRACE_BYTES, TraceRecord

if TYPE_CHECKING:
    from skippy_zmq.wire.codecs import Buffer


REPLY_MAGIC = b"SKZR"
MAX_ERROR_TEXT_BYTES = 64 * 1024
MAX_PREDICTED_TOKENS = 4096
EXTRAS_MAGIC = b"SKRX"
MAX_EMBEDDING_VALUES = 1 << 22
"""Longest embedding a reply carries (n_embd, or a prompt's positions times n_embd with pooling none; §2.5)."""
MAX_EXTRAS_BYTES = 8 + 8 + 4 + MAX_EMBEDDING_VALUES * 4 + 8 + 8 + MAX_TOP_LOGPROBS * 8
"""Largest extras frame (§2.5): an embedding of MAX_EMBEDDING_VALUES values, or logprobs."""
_U32_MAX = 2**32 - 1


class ReplyKind(enum.IntEnum):
    """Replies to the driver; ids are part of the wire format."""

    ACK = 1
    PREDICTED_TOKEN = 2
    PREDICTED_TOKENS = 3
    ERROR = 4
    EMBEDDING = 5

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


@attrs.frozen
class StageLoad:
    """What a stage's heartbeat says of its load (docs/PROTOCOL.md §2.4, extras tag 4): its process's resident
    memory (0: unknown) and the lanes its live sessions hold; and (tag 6) whether it computes batch-invariantly."""

    rss_bytes: int = attrs.field(validator=in_uint64("heartbeat rss_bytes"))
    sessions: int = attrs.field(validator=lambda _i, _a, value: check_int("heartbeat sessions", value, 0, _U32_MAX))
    invariant: bool = False  # a row's numbers do not depend on its pass (docs/ARCHITECTURE.md, "Batch-invariant mode")


_REPLY_HEADER = struct.Struct("<4sHHQQiiiHHI")
_REPLY_CRC_OFFSET = _REPLY_HEADER.size - CRC.size
REPLY_HEADER_BYTES = _REPLY_HEADER.size


def _logprobs_run(value: Sequence[TokenLogprobs]) -> tuple[TokenLogprobs, ...]:
    return tuple(value)


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
    logprobs: TokenLogprobs | None = None  # PredictedToken, when the session asked (§2.6)
    token_logprobs: tuple[TokenLogprobs, ...] = attrs.field(default=(), converter=_logprobs_run)  # PredictedTokens'
    embedding: npt.NDArray[np.float32] | None = None  # Embedding: the pooled vector (n_embd,)
    pass_continues: bool = False  # more replies of the same pass follow right behind this one (§2.4)
    load: StageLoad | None = None  # a heartbeat's: the stage's memory and lanes in use (§2.4)

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
        if self.logprobs is not None and self.kind is not ReplyKind.PREDICTED_TOKEN:
            raise WireError(f"logprobs travel on PREDICTED_TOKEN replies only, not on {self.kind.name}")
        if self.logprobs is not None and self.logprobs.token != self.predicted_token:
            raise WireError(f"logprobs are for token {self.logprobs.token}; the reply predicts {self.predicted_token}")
        if self.token_logprobs:
            if self.kind is not ReplyKind.PREDICTED_TOKENS:
                raise WireError(f"a run of logprobs travels on PREDICTED_TOKENS replies only, not on {self.kind.name}")
            named = [entry.token for entry in self.token_logprobs]
            if named != self.tokens.tolist():
                raise WireError(f"logprobs are for tokens {named}; the reply predicts {self.tokens.tolist()}")
        if (self.kind is ReplyKind.EMBEDDING) != (self.embedding is not None):
            raise WireError("an embedding must be present exactly on EMBEDDING replies")
        if self.embedding is not None and not (self.embedding.ndim == 1 and 0 < self.embedding.size
                                               <= MAX_EMBEDDING_VALUES and self.embedding.dtype == np.float32):
            raise LimitError(f"embedding must be float32 (n,) with 1 <= n <= {MAX_EMBEDDING_VALUES}, got "
                             f"{self.embedding.dtype} {self.embedding.shape}")
        if self.load is not None and not self.is_heartbeat:
            raise WireError(f"a stage's load travels on heartbeats only, not on {self.kind.name} for request "
                            f"{self.request_id}")

    @classmethod
    def heartbeat(cls, stage_index: int, sent_at_us: int, incarnation: int = 0, load: StageLoad | None = None) -> Reply:
        """The liveness beacon a worker sends its driver: an Ack for request 0 whose session_id
        field carries the worker process's incarnation id, and `load` its extras (docs/PROTOCOL.md §2.4)."""
        record = TraceRecord(stage_index=stage_index, received_at_us=sent_at_us, sent_at_us=sent_at_us)
        return cls(kind=ReplyKind.ACK, request_id=0, session_id=incarnation, stage_index=stage_index, trace=(record,),
                   load=load)

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
        arrays = ("tokens", "embedding")
        return (
            attrs.astuple(self, recurse=False, filter=lambda a, _v: a.name not in arrays)
            == attrs.astuple(other, recurse=False, filter=lambda a, _v: a.name not in arrays)
            and np.array_equal(self.tokens, other.tokens)
            and _same_array(self.embedding, other.embedding)
        )

    __hash__ = None  # type: ignore[assignment]


def _same_array(a: npt.NDArray[np.float32] | None, b: npt.NDArray[np.float32] | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.array_equal(a, b))


class ExtraTag(enum.IntEnum):
    """Record tags of a reply's extras frame (§2.4); the ids are wire format."""

    LOGPROBS = 1
    EMBEDDING = 2
    PASS_CONTINUES = 3
    STAGE_LOAD = 4
    TOKEN_LOGPROBS = 5
    BATCH_INVARIANT = 6


_LOGPROB_HEAD = struct.Struct("<fI")
_ALTERNATIVE = struct.Struct("<if")
_COUNT = struct.Struct("<I")
_LOAD = struct.Struct("<QI")


def _encode_extras(reply: Reply) -> bytes:
    records: list[tuple[int, int, bytes]] = []
    if reply.logprobs is not None:
        records.append((int(ExtraTag.LOGPROBS), 0, _logprobs_bytes(reply.logprobs)))
    if reply.embedding is not None:
        records.append((int(ExtraTag.EMBEDDING), 0, _COUNT.pack(reply.embedding.size)
                        + np.ascontiguousarray(reply.embedding, dtype="<f4").tobytes()))
    if reply.pass_continues:
        records.append((int(ExtraTag.PASS_CONTINUES), 0, b""))
    if reply.load is not None:
        records.append((int(ExtraTag.STAGE_LOAD), 0, _LOAD.pack(reply.load.rss_bytes, reply.load.sessions)))
        if reply.load.invariant:
            records.append((int(ExtraTag.BATCH_INVARIANT), 0, b""))
    if reply.token_logprobs:  # a PredictedTokens' run: each token's entry, in order
        records.append((int(ExtraTag.TOKEN_LOGPROBS), 0, b"".join(_logprobs_bytes(e) for e in reply.token_logprobs)))
    return pack_records(EXTRAS_MAGIC, records) if records else b""


def _logprobs_bytes(entry: TokenLogprobs) -> bytes:
    return _LOGPROB_HEAD.pack(entry.logprob, len(entry.top)) + b"".join(
        _ALTERNATIVE.pack(token, logprob) for token, logprob in entry.top)


def _logprobs_entry(value: memoryview, offset: int, token: int, what: str) -> tuple[TokenLogprobs, int]:
    """The logprobs entry of `token` at `offset` of a record's value, and the offset after it."""
    if value.nbytes - offset < _LOGPROB_HEAD.size:
        raise WireError(f"{what} has {value.nbytes - offset} bytes left for an entry; expected at least "
                        f"{_LOGPROB_HEAD.size}")
    logprob, count = _LOGPROB_HEAD.unpack_from(value, offset)
    end = offset + _LOGPROB_HEAD.size + count * _ALTERNATIVE.size
    if count > MAX_TOP_LOGPROBS or value.nbytes < end:
        raise WireError(f"{what} has {value.nbytes - offset} bytes for an entry of {count} alternatives; expected "
                        f"{_LOGPROB_HEAD.size} + 8 x count, count <= {MAX_TOP_LOGPROBS}")
    top = tuple(_ALTERNATIVE.unpack_from(value, offset + _LOGPROB_HEAD.size + i * _ALTERNATIVE.size)
                for i in range(count))
    return TokenLogprobs(token, logprob, top), end


@attrs.frozen
class _Extras:
    """What an extras frame held."""

    logprobs: TokenLogprobs | None = None
    embedding: npt.NDArray[np.float32] | None = None
    pass_continues: bool = False
    load: StageLoad | None = None
    run: tuple[TokenLogprobs, ...] = ()


def _decode_extras(data: memoryview, token: int, tokens: npt.NDArray[np.int32]) -> _Extras:
    """Logprobs (of `token`; a run's, of `tokens`), embedding, the pass mark and a heartbeat's load of an
    extras frame; records of tags this version does not know are skipped."""
    logprobs, embedding, pass_continues, load, invariant = None, None, False, None, False
    run: list[TokenLogprobs] = []
    for tag, _flags, value in unpack_records(data, EXTRAS_MAGIC, "reply extras frame", MAX_EXTRAS_BYTES):
        if tag == ExtraTag.LOGPROBS:
            logprobs, end = _logprobs_entry(value, 0, token, "reply logprobs record")
            if end != value.nbytes:
                raise WireError(f"reply logprobs record has {value.nbytes} bytes; its entry ends at byte {end}")
        elif tag == ExtraTag.TOKEN_LOGPROBS:
            offset = 0
            for each in tokens.tolist():
                entry, offset = _logprobs_entry(value, offset, each, "reply token-logprobs record")
                run.append(entry)
            if offset != value.nbytes:
                raise WireError(f"reply token-logprobs record has {value.nbytes} bytes; the entries of its "
                                f"{tokens.size} tokens end at byte {offset}")
        elif tag == ExtraTag.EMBEDDING:
            (count,) = fixed(_COUNT, value[:_COUNT.size], "reply embedding record count")
            if count > MAX_EMBEDDING_VALUES or value.nbytes != _COUNT.size + 4 * count:
                raise WireError(f"reply embedding record has {value.nbytes} bytes for {count} values; expected "
                                f"4 + 4 x count, count <= {MAX_EMBEDDING_VALUES}")
            embedding = np.frombuffer(value[_COUNT.size:], dtype="<f4")
        elif tag == ExtraTag.PASS_CONTINUES:
            if value.nbytes:
                raise WireError(f"reply pass-continues record has {value.nbytes} bytes; expected none")
            pass_continues = True
        elif tag == ExtraTag.STAGE_LOAD:
            load = fixed(_LOAD, value, "reply stage-load record")
        elif tag == ExtraTag.BATCH_INVARIANT:
            if value.nbytes:
                raise WireError(f"reply batch-invariant record has {value.nbytes} bytes; expected none")
            invariant = True
    if invariant and load is None:
        raise WireError("reply batch-invariant record without a stage-load record; it travels on heartbeats beside one")
    stage_load = None if load is None else StageLoad(load[0], load[1], invariant)
    return _Extras(logprobs, embedding, pass_continues, stage_load, tuple(run))


def encode_reply(reply: Reply) -> list[Buffer]:
    """Frames of a reply: header, predicted token ids, error text, trace records[, extras]."""
    header = _REPLY_HEADER.pack(
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
    extras = _encode_extras(reply)
    crc = crc_of(header, reply.tokens, error, trace, extras)
    frames: list[Buffer] = [header + CRC.pack(crc), reply.tokens, error, trace]
    return [*frames, extras] if extras else frames


def decode_reply(frames: Sequence[Buffer]) -> Reply:
    """Validate and parse a reply."""
    try:
        return _decode_reply(frames)
    except SkippyError:
        raise
    except (struct.error, ValueError, TypeError, OverflowError) as exc:
        raise WireError(f"malformed stage reply: {exc}") from None


def _decode_reply(frames: Sequence[Buffer]) -> Reply:
    if len(frames) not in (4, 5):
        raise WireError(f"stage reply has {len(frames)} frames; expected 4, or 5 with extras")
    views = [memoryview(f).cast("B") for f in frames]
    if views[0].nbytes != REPLY_HEADER_BYTES:
        raise WireError(f"stage reply header has {views[0].nbytes} bytes; expected {REPLY_HEADER_BYTES}")
    (magic, version, kind_id, request_id, session_id, stage_index, decode_step, token,
     answered_id, trace_count, crc) = _REPLY_HEADER.unpack(views[0])
    if magic != REPLY_MAGIC:
        raise WireError(f"stage reply magic {magic!r} is wrong; expected {REPLY_MAGIC!r}")
    if version != WIRE_VERSION:
        raise WireError(f"stage reply wire version {version} is not supported; expected {WIRE_VERSION}")
    actual = crc_of(views[0][:_REPLY_CRC_OFFSET], *views[1:])
    if crc != actual:
        raise WireError(f"stage reply checksum {crc:#010x} does not match its contents ({actual:#010x})")
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
    ids = np.frombuffer(views[1], dtype="<i4")
    extras = _decode_extras(views[4], token, ids) if len(views) == 5 else _Extras()
    return Reply(
        kind=kind,
        request_id=request_id,
        session_id=session_id,
        stage_index=stage_index,
        answered=answered,
        decode_step=decode_step,
        predicted_token=token,
        tokens=ids,
        error=error,
        trace=trace,
        logprobs=extras.logprobs,
        token_logprobs=extras.run,
        embedding=extras.embedding,
        pass_continues=extras.pass_continues, load=extras.load,
    )
