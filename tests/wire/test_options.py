"""The generation-options part and the tagged-record format (docs/PROTOCOL.md §2.6): round trips,
records this version does not know, and hostile bytes."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.errors import LimitError, SkippyError, WireError
from skippy_zmq.tokens.constraint import MAX_CONSTRAINT_BYTES, Constraint
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.tokens.sampling import MAX_LOGIT_BIAS, SamplingParams
from skippy_zmq.wire.options import (
    MAX_OPTIONS_BYTES,
    MAX_RECORDS,
    OPTIONS_MAGIC,
    RECORD_REQUIRED,
    GenerationOptions,
    OptionTag,
    decode_options,
    encode_options,
    pack_records,
    unpack_records,
)
from tests.strategies import generation_options

SAMPLING_RECORD = (1, RECORD_REQUIRED, encode_options(GenerationOptions())[16:])


@settings(max_examples=200, deadline=None)
@given(generation_options)
def test_options_round_trip(options: GenerationOptions) -> None:
    assert decode_options(encode_options(options)) == options


def test_defaults_send_the_sampling_record_alone() -> None:
    data = encode_options(GenerationOptions())
    assert [tag for tag, _, _ in unpack_records(data, OPTIONS_MAGIC, "part", MAX_OPTIONS_BYTES)] == [1]
    assert len(data) == 8 + 8 + 36


def test_every_setting_off_its_default_adds_exactly_its_record() -> None:
    options = GenerationOptions(SamplingParams(presence_penalty=0.5, logit_bias=((3, 1.0),)), logprobs=0,
                                embedding=Pooling.LAST, keep_logits=True, fork_from=7,
                                constraint=Constraint.regex("[a-z]+"), progress=True)
    records = unpack_records(encode_options(options), OPTIONS_MAGIC, "part", MAX_OPTIONS_BYTES)
    assert [tag for tag, _, _ in records] == [int(tag) for tag in OptionTag]
    # the progress record is not required: a stage that does not know it just acknowledges no chunks
    assert [flags & RECORD_REQUIRED for tag, flags, _ in records if tag == OptionTag.PROGRESS] == [0]
    assert decode_options(encode_options(options)) == options
    with pytest.raises(WireError, match="progress record has 1 bytes; expected 0"):
        decode_options(pack_records(OPTIONS_MAGIC, [SAMPLING_RECORD, (int(OptionTag.PROGRESS), 0, b"x")]))


def test_post_sampling_logprobs_travel_as_the_logprobs_record_flag() -> None:
    options = GenerationOptions(logprobs=3, post_sampling=True)
    records = unpack_records(encode_options(options), OPTIONS_MAGIC, "part", MAX_OPTIONS_BYTES)
    assert [bytes(value) for tag, _, value in records if tag == OptionTag.LOGPROBS] == [b"\x03\x01\x00\x00"]
    assert decode_options(encode_options(options)) == options
    assert not decode_options(encode_options(GenerationOptions(logprobs=3))).post_sampling
    with pytest.raises(WireError, match="post_sampling needs logprobs"):
        GenerationOptions(post_sampling=True)


def test_an_unknown_optional_record_is_skipped_and_an_unknown_required_one_refused() -> None:
    hint = (40, 0, b"later hint")
    assert decode_options(pack_records(OPTIONS_MAGIC, [SAMPLING_RECORD, hint])) == GenerationOptions()
    with pytest.raises(WireError, match="record tag 40 is required but unknown to this stage"):
        decode_options(pack_records(OPTIONS_MAGIC, [SAMPLING_RECORD, (40, RECORD_REQUIRED, b"x")]))


@pytest.mark.parametrize(("records", "match"), [
    ([], "no sampling record"),
    ([(2, 1, struct.pack("<ff", 0.5, 0.5))], "no sampling record"),
    ([SAMPLING_RECORD, SAMPLING_RECORD], "strictly ascending"),
    ([(2, 1, struct.pack("<ff", 0, 0)), SAMPLING_RECORD], "strictly ascending"),
    ([SAMPLING_RECORD, (2, 1, struct.pack("<ff", 3.0, 0))], "presence_penalty 3.0"),
    ([SAMPLING_RECORD, (2, 1, b"\0" * 4)], "penalties record has 4 bytes; expected 8"),
    ([SAMPLING_RECORD, (3, 1, struct.pack("<Iif", 1, 5, 101.0))], "logit_bias of token 5 is 101.0"),
    ([SAMPLING_RECORD, (3, 1, struct.pack("<Iifif", 2, 5, 1.0, 5, 1.0))], "out of order or repeated"),
    ([SAMPLING_RECORD, (3, 1, struct.pack("<Iif", 2, 5, 1.0))], "expected 20 for 2 entries"),
    ([SAMPLING_RECORD, (3, 1, struct.pack("<I", MAX_LOGIT_BIAS + 1))], "the limit is 1024"),
    ([SAMPLING_RECORD, (4, 1, struct.pack("<B3x", 21))], "logprobs 21 must be None or an integer in 0..20"),
    ([SAMPLING_RECORD, (4, 1, struct.pack("<BBxx", 2, 2))], "logprobs record flags 0x02: only bit 0"),
    ([SAMPLING_RECORD, (4, 1, struct.pack("<BBBx", 2, 1, 1))], "reserved bytes 2..3 must be zero"),
    ([SAMPLING_RECORD, (5, 1, struct.pack("<B3x", 9))], "unknown pooling id 9"),
    ([SAMPLING_RECORD, (6, 1, b"\1")], "keep-logits record has 1 bytes; expected 0"),
    ([SAMPLING_RECORD, (7, 1, struct.pack("<Q", 0))], "fork_from 0 must be None"),
    ([SAMPLING_RECORD, (1 << 15, 4, b"")], "unknown flag bits 0x4"),
    ([SAMPLING_RECORD, (8, 1, b"\3\0")], "constraint record has 2 bytes; expected at least 4"),
    ([SAMPLING_RECORD, (8, 1, b"\x09\0\0\0x")], r"constraint record kind 9 is unknown; expected one of 1 \(json_schema"),
    ([SAMPLING_RECORD, (8, 1, b"\3\0\1\0x")], "constraint record: reserved bytes 1..3 must be zero"),
    ([SAMPLING_RECORD, (8, 1, b"\3\0\0\0\xff")], r"constraint record text is not UTF-8 \(byte 0\)"),
    ([SAMPLING_RECORD, (8, 1, b"\2\0\0\0{}")], "constraint record: constraint: json_object takes no text"),
    ([SAMPLING_RECORD, (8, 1, b"\3\0\0\0")], "the regex is empty"),
    ([SAMPLING_RECORD, (8, 1, b"\3\0\0\0" + b"a" * (MAX_CONSTRAINT_BYTES + 1))],
     f"constraint record has {MAX_CONSTRAINT_BYTES + 1} bytes of text; the limit is {MAX_CONSTRAINT_BYTES}"),
])
def test_bad_records_are_named(records: list[tuple[int, int, bytes]], match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_options(pack_records(OPTIONS_MAGIC, records))


def test_framing_faults_are_named() -> None:
    good = encode_options(GenerationOptions())
    with pytest.raises(WireError, match="magic b'XKGO' is wrong"):
        decode_options(b"X" + good[1:])
    with pytest.raises(WireError, match="version 2 is not supported"):
        decode_options(good[:4] + struct.pack("<H", 2) + good[6:])
    with pytest.raises(LimitError, match="33 records; the limit is 32"):
        decode_options(good[:6] + struct.pack("<H", MAX_RECORDS + 1) + good[8:])
    with pytest.raises(WireError, match="4 bytes after its 1 records"):
        decode_options(good + b"\0" * 4)
    with pytest.raises(WireError, match="padding bytes must be zero"):
        decode_options(pack_records(OPTIONS_MAGIC, [SAMPLING_RECORD, (40, 0, b"x")])[:-1] + b"\1")
    with pytest.raises(LimitError, match=f"the limit is {MAX_OPTIONS_BYTES}"):
        decode_options(good + b"\0" * MAX_OPTIONS_BYTES)
    for cut in range(len(good)):
        with pytest.raises(WireError):
            decode_options(good[:cut])


@settings(max_examples=300, deadline=None)
@given(generation_options, st.data())
def test_any_byte_changed_decodes_to_valid_options_or_a_project_error(options: GenerationOptions,
                                                                      data: st.DataObject) -> None:
    frame = bytearray(encode_options(options))
    for _ in range(data.draw(st.integers(1, 3))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    try:
        decoded = decode_options(bytes(frame))
    except SkippyError:
        return
    assert decode_options(encode_options(decoded)) == decoded


def test_the_record_table_has_a_row_per_tag() -> None:
    from skippy_zmq.wire.options import OPTION_RECORDS

    assert set(OPTION_RECORDS) == set(OptionTag)


def test_the_largest_constraint_and_logit_bias_fit_one_part() -> None:
    bias = tuple((token, 1.0) for token in range(MAX_LOGIT_BIAS))
    options = GenerationOptions(SamplingParams(logit_bias=bias, presence_penalty=1.0), logprobs=20,
                                constraint=Constraint.lark("x" * MAX_CONSTRAINT_BYTES))
    assert decode_options(encode_options(options)) == options
