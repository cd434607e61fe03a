"""The generation-options part of a stage message and the record format it shares with reply
extras (docs/PROTOCOL.md §2.6). No sockets.

A part is a short header and a list of tagged records, one per setting a session departs from
the default in. A later setting is one more row in `OPTION_RECORDS` (a new tag), not a new
layout: a receiver skips records it does not know unless the sender marked them required, so
an optional hint can be sent to older stages and a setting that changes the output cannot be
silently dropped by one.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from skippy_zmq.errors import LimitError, SkippyError, WireError, check_rows
from skippy_zmq.tokens.constraint import MAX_CONSTRAINT_BYTES, Constraint, ConstraintKind
from skippy_zmq.tokens.logprobs import MAX_TOP_LOGPROBS
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.tokens.sampling import MAX_LOGIT_BIAS, SamplingParams

if TYPE_CHECKING:
    from skippy_zmq.wire.codecs import Buffer

OPTIONS_MAGIC = b"SKGO"
OPTIONS_VERSION = 1
MAX_OPTIONS_BYTES = 196_608
"""Largest options part (§2.5): room for the largest constraint and the largest logit bias together."""
MAX_RECORDS = 32
RECORD_REQUIRED = 1 << 0
"""Record flag: a receiver that does not know the tag refuses the message instead of skipping it."""

_PART_HEADER = struct.Struct("<4sHH")
_RECORD_HEADER = struct.Struct("<HHI")
_SAMPLING = struct.Struct("<fifffiQB3x")
_PENALTIES = struct.Struct("<ff")
_COUNT = struct.Struct("<I")
_BIAS_ENTRY = struct.Struct("<if")
_SMALL = struct.Struct("<B3x")
_LOGPROBS = struct.Struct("<BB2x")  # alternatives, flags
LOGPROBS_POST_SAMPLING = 0x01
"""Logprobs record flag: the values are of the sampler's final candidates (docs/PROTOCOL.md §2.6)."""
_SESSION = struct.Struct("<Q")
SAMPLING_BYTES = _SAMPLING.size


# --- records, shared with reply extras --------------------------------------------------------


def pack_records(magic: bytes, records: Sequence[tuple[int, int, bytes]]) -> bytes:
    """A part of tagged records `(tag, flags, value)`, in the order given (callers sort by tag)."""
    out = bytearray(_PART_HEADER.pack(magic, OPTIONS_VERSION, len(records)))
    for tag, flags, value in records:
        out += _RECORD_HEADER.pack(tag, flags, len(value)) + value + b"\0" * (-len(value) % 4)
    return bytes(out)


def unpack_records(data: Buffer, magic: bytes, what: str, limit: int) -> list[tuple[int, int, memoryview]]:
    """The `(tag, flags, value)` records of a part, checked: size limit, magic, version, record
    count, framing, zero padding, tags strictly ascending; WireError or LimitError naming `what`."""
    view = memoryview(data).cast("B")
    if view.nbytes > limit:
        raise LimitError(f"{what} has {view.nbytes} bytes; the limit is {limit}")
    if view.nbytes < _PART_HEADER.size:
        raise WireError(f"{what} has {view.nbytes} bytes; expected at least {_PART_HEADER.size}")
    got_magic, version, count = _PART_HEADER.unpack_from(view)
    if got_magic != magic:
        raise WireError(f"{what} magic {got_magic!r} is wrong; expected {magic!r}")
    if version != OPTIONS_VERSION:
        raise WireError(f"{what} version {version} is not supported; expected {OPTIONS_VERSION}")
    if count > MAX_RECORDS:
        raise LimitError(f"{what} has {count} records; the limit is {MAX_RECORDS}")
    records: list[tuple[int, int, memoryview]] = []
    offset = _PART_HEADER.size
    for index in range(count):
        if view.nbytes - offset < _RECORD_HEADER.size:
            raise WireError(f"{what} ends inside the header of record {index} of {count}")
        tag, flags, length = _RECORD_HEADER.unpack_from(view, offset)
        start = offset + _RECORD_HEADER.size
        end = start + length
        padded = end + (-length % 4)
        if padded > view.nbytes:
            raise WireError(f"{what} record {index} (tag {tag}) has {length} bytes; only "
                            f"{max(view.nbytes - start, 0)} remain")
        if any(view[end:padded]):
            raise WireError(f"{what} record {index} (tag {tag}): padding bytes must be zero")
        if flags & ~RECORD_REQUIRED:
            raise WireError(f"{what} record {index} (tag {tag}): unknown flag bits {flags & ~RECORD_REQUIRED:#x}")
        if records and tag <= records[-1][0]:
            raise WireError(f"{what} record tags must be strictly ascending; tag {tag} follows {records[-1][0]}")
        records.append((tag, flags, view[start:end]))
        offset = padded
    if offset != view.nbytes:
        raise WireError(f"{what} has {view.nbytes - offset} bytes after its {count} records")
    return records


def fixed(layout: struct.Struct, value: memoryview, what: str) -> tuple[Any, ...]:
    """`value` unpacked with `layout`; WireError naming `what` unless it has exactly its size."""
    if value.nbytes != layout.size:
        raise WireError(f"{what} has {value.nbytes} bytes; expected {layout.size}")
    return layout.unpack(value)


def reserved_zero(value: memoryview, start: int, what: str) -> None:
    """WireError unless `value`'s bytes from `start` on are zero (reserved)."""
    if any(value[start:]):
        raise WireError(f"{what}: reserved bytes {start}..{value.nbytes - 1} must be zero")


# --- the options ------------------------------------------------------------------------------


def _check_logprobs(_: object, __: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_TOP_LOGPROBS):
        raise WireError(f"options: logprobs {value!r} must be None or an integer in 0..{MAX_TOP_LOGPROBS}")


def _check_post_sampling(instance: GenerationOptions, _: attrs.Attribute[bool], value: bool) -> None:
    if value and instance.logprobs is None:
        raise WireError("options: post_sampling needs logprobs: it says which logprobs the replies carry")


def _check_fork_from(_: object, __: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and not (isinstance(value, int) and 0 < value < 2**64):
        raise WireError(f"options: fork_from {value!r} must be None or a session id in 1..2**64-1")


@attrs.frozen
class GenerationOptions:
    """What a session is to do (docs/PROTOCOL.md §2.6): its sampling, whether its replies carry
    logprobs, whether it is an embedding, whether the final stage keeps its prompt's last logits
    for forks, on ForkSession the session its positions are copied from, and the constraint its
    text must match."""

    sampling: SamplingParams = attrs.Factory(SamplingParams)
    logprobs: int | None = attrs.field(default=None, validator=_check_logprobs)  # alternatives; None: none
    post_sampling: bool = attrs.field(default=False, validator=_check_post_sampling)  # logprobs of the
    # sampler's final candidates, renormalised (docs/PROTOCOL.md §2.6), not of the raw logits
    embedding: Pooling | None = None
    keep_logits: bool = False
    fork_from: int | None = attrs.field(default=None, validator=_check_fork_from)
    constraint: Constraint | None = None
    progress: bool = False  # the final stage acknowledges each prompt chunk that is not the last (§6)


class OptionTag(enum.IntEnum):
    """Record tags of the options part; the ids are wire format."""

    SAMPLING = 1
    PENALTIES = 2
    LOGIT_BIAS = 3
    LOGPROBS = 4
    EMBEDDING = 5
    KEEP_LOGITS = 6
    FORK_FROM = 7
    CONSTRAINT = 8
    PROGRESS = 9


_Fields = dict[str, Any]


@attrs.frozen
class OptionRow:
    """One record of the options part: what it holds, its bytes when the options need it (None
    when they are at its default, so it is not sent), and what it sets when read."""

    emit: Callable[[GenerationOptions], bytes | None]
    read: Callable[[memoryview, _Fields], None]
    required: bool = True


def _emit_sampling(options: GenerationOptions) -> bytes:
    s = options.sampling
    return _SAMPLING.pack(s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty, s.penalty_last_n, s.seed,
                          1 if s.ignore_eos else 0)


def _read_sampling(value: memoryview, fields: _Fields) -> None:
    temp, top_k, top_p, min_p, penalty, last_n, seed, ignore_eos = fixed(_SAMPLING, value, "sampling record")
    if ignore_eos not in (0, 1):
        raise WireError(f"sampling record ignore_eos byte {ignore_eos} must be 0 or 1")
    reserved_zero(value, 33, "sampling record")
    fields["sampling"] = {"temperature": temp, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                          "repeat_penalty": penalty, "penalty_last_n": last_n, "seed": seed,
                          "ignore_eos": bool(ignore_eos)}


def _emit_penalties(options: GenerationOptions) -> bytes | None:
    s = options.sampling
    if not (s.presence_penalty or s.frequency_penalty):
        return None
    return _PENALTIES.pack(s.presence_penalty, s.frequency_penalty)


def _read_penalties(value: memoryview, fields: _Fields) -> None:
    presence, frequency = fixed(_PENALTIES, value, "penalties record")
    fields.setdefault("penalties", {}).update(presence_penalty=presence, frequency_penalty=frequency)


def _emit_bias(options: GenerationOptions) -> bytes | None:
    pairs = options.sampling.logit_bias
    if not pairs:
        return None
    return _COUNT.pack(len(pairs)) + b"".join(_BIAS_ENTRY.pack(token, bias) for token, bias in pairs)


def _read_bias(value: memoryview, fields: _Fields) -> None:
    if value.nbytes < _COUNT.size:
        raise WireError(f"logit bias record has {value.nbytes} bytes; expected at least {_COUNT.size}")
    (count,) = _COUNT.unpack_from(value)
    if count > MAX_LOGIT_BIAS:
        raise LimitError(f"logit bias record has {count} entries; the limit is {MAX_LOGIT_BIAS}")
    if value.nbytes != _COUNT.size + count * _BIAS_ENTRY.size:
        raise WireError(f"logit bias record has {value.nbytes} bytes; expected "
                        f"{_COUNT.size + count * _BIAS_ENTRY.size} for {count} entries")
    pairs = [_BIAS_ENTRY.unpack_from(value, _COUNT.size + i * _BIAS_ENTRY.size) for i in range(count)]
    fields.setdefault("penalties", {})["logit_bias"] = tuple(pairs)


def _emit_small(name: str) -> Callable[[GenerationOptions], bytes | None]:
    def emit(options: GenerationOptions) -> bytes | None:
        value = getattr(options, name)
        return None if value is None else _SMALL.pack(int(value))

    return emit


def _emit_logprobs(options: GenerationOptions) -> bytes | None:
    if options.logprobs is None:
        return None
    return _LOGPROBS.pack(options.logprobs, LOGPROBS_POST_SAMPLING if options.post_sampling else 0)


def _read_logprobs(value: memoryview, fields: _Fields) -> None:
    fields["logprobs"], flags = fixed(_LOGPROBS, value, "logprobs record")
    if flags & ~LOGPROBS_POST_SAMPLING:
        raise WireError(f"logprobs record flags {flags:#04x}: only bit 0 (post-sampling) is defined")
    fields["post_sampling"] = bool(flags & LOGPROBS_POST_SAMPLING)
    reserved_zero(value, 2, "logprobs record")


def _read_embedding(value: memoryview, fields: _Fields) -> None:
    (pooling,) = fixed(_SMALL, value, "embedding record")
    reserved_zero(value, 1, "embedding record")
    fields["embedding"] = Pooling.parse(pooling)


def _emit_keep(options: GenerationOptions) -> bytes | None:
    return b"" if options.keep_logits else None


def _read_keep(value: memoryview, fields: _Fields) -> None:
    if value.nbytes:
        raise WireError(f"keep-logits record has {value.nbytes} bytes; expected 0")
    fields["keep_logits"] = True


def _emit_progress(options: GenerationOptions) -> bytes | None:
    return b"" if options.progress else None


def _read_progress(value: memoryview, fields: _Fields) -> None:
    if value.nbytes:
        raise WireError(f"progress record has {value.nbytes} bytes; expected 0")
    fields["progress"] = True


def _emit_fork(options: GenerationOptions) -> bytes | None:
    return None if options.fork_from is None else _SESSION.pack(options.fork_from)


def _read_fork(value: memoryview, fields: _Fields) -> None:
    (fields["fork_from"],) = fixed(_SESSION, value, "fork-from record")


def _emit_constraint(options: GenerationOptions) -> bytes | None:
    constraint = options.constraint
    if constraint is None:
        return None
    return _SMALL.pack(int(constraint.kind)) + constraint.text.encode("utf-8")


def _read_constraint(value: memoryview, fields: _Fields) -> None:
    if value.nbytes < _SMALL.size:
        raise WireError(f"constraint record has {value.nbytes} bytes; expected at least {_SMALL.size}")
    (kind,) = _SMALL.unpack_from(value)
    reserved_zero(value[: _SMALL.size], 1, "constraint record")
    if kind not in _KINDS:
        raise WireError(f"constraint record kind {kind} is unknown; expected one of "
                        f"{', '.join(f'{int(k)} ({k.name.lower()})' for k in ConstraintKind)}")
    text = value[_SMALL.size:]
    if text.nbytes > MAX_CONSTRAINT_BYTES:
        raise LimitError(f"constraint record has {text.nbytes} bytes of text; the limit is {MAX_CONSTRAINT_BYTES}")
    try:
        decoded = bytes(text).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"constraint record text is not UTF-8 (byte {exc.start})") from None
    try:
        fields["constraint"] = Constraint(ConstraintKind(kind), decoded)
    except SkippyError as exc:
        raise WireError(f"constraint record: {exc}") from None


OPTION_RECORDS: Mapping[OptionTag, OptionRow] = {
    OptionTag.SAMPLING: OptionRow(_emit_sampling, _read_sampling),
    OptionTag.PENALTIES: OptionRow(_emit_penalties, _read_penalties),
    OptionTag.LOGIT_BIAS: OptionRow(_emit_bias, _read_bias),
    OptionTag.LOGPROBS: OptionRow(_emit_logprobs, _read_logprobs),
    OptionTag.EMBEDDING: OptionRow(_emit_small("embedding"), _read_embedding),
    OptionTag.KEEP_LOGITS: OptionRow(_emit_keep, _read_keep),
    OptionTag.FORK_FROM: OptionRow(_emit_fork, _read_fork),
    OptionTag.CONSTRAINT: OptionRow(_emit_constraint, _read_constraint),
    # not required: a stage that does not know it acknowledges no chunks, and the client gets no progress
    OptionTag.PROGRESS: OptionRow(_emit_progress, _read_progress, required=False),
}
"""One row per record tag (docs/PROTOCOL.md §2.6); a tag without its row fails at import."""
check_rows(OPTION_RECORDS, OptionTag, "skippy_zmq.wire.options.OPTION_RECORDS")


def encode_options(options: GenerationOptions) -> bytes:
    """The options part: the sampling record, then every other record off its default, by tag."""
    records = []
    for tag, row in OPTION_RECORDS.items():
        value = row.emit(options)
        if value is not None:
            records.append((int(tag), RECORD_REQUIRED if row.required else 0, value))
    return pack_records(OPTIONS_MAGIC, records)


def decode_options(data: Buffer) -> GenerationOptions:
    """Parse and validate an options part; WireError (or LimitError) naming what is wrong."""
    fields: _Fields = {}
    for tag, flags, value in unpack_records(data, OPTIONS_MAGIC, "options part", MAX_OPTIONS_BYTES):
        row = OPTION_RECORDS.get(OptionTag(tag)) if tag in _TAGS else None
        if row is None:
            if flags & RECORD_REQUIRED:
                raise WireError(f"options part record tag {tag} is required but unknown to this stage "
                                f"(known tags: {', '.join(str(int(t)) for t in OptionTag)})")
            continue  # an optional hint this version does not know
        row.read(value, fields)
    if "sampling" not in fields:
        raise WireError(f"options part has no sampling record (tag {int(OptionTag.SAMPLING)}); it is required")
    try:
        sampling = SamplingParams(**fields.pop("sampling"), **fields.pop("penalties", {}))
        return GenerationOptions(sampling=sampling, **fields)
    except (SkippyError, ValueError, TypeError) as exc:
        raise WireError(f"invalid generation options: {exc}") from None


_TAGS = frozenset(int(tag) for tag in OptionTag)
_KINDS = frozenset(int(kind) for kind in ConstraintKind)
