"""Stage messages and replies on the wire: golden bytes, round trips, and hostile input."""

from __future__ import annotations

import struct
import zlib

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.errors import LimitError, SkippyError, WireError
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.wire.codecs import ActivationCodec
from skippy_zmq.wire.frames import ActivationFrame, GGMLType, PartDesc
from skippy_zmq.wire.messages import (
    HEADER_BYTES,
    MAX_SIDEBAND_VALUES,
    PART_BYTES,
    MessageKind,
    StageMessage,
    StateHeader,
    crc_of,
    decode_message,
    driver_id_of,
    driver_word,
    encode_activation,
    encode_message,
)
from skippy_zmq.wire.options import SAMPLING_BYTES, GenerationOptions, pack_records
from skippy_zmq.wire.replies import (
    REPLY_HEADER_BYTES,
    ErrorCause,
    Reply,
    ReplyKind,
    StageLoad,
    decode_reply,
    encode_reply,
)
from skippy_zmq.wire.trace import TRACE_BYTES, TraceRecord
from tests.strategies import replies, stage_messages


def as_bytes(frames: list) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


def reseal(frames: list[bytes]) -> list[bytes]:
    """Recompute the header checksum so a test can reach the checks behind it."""
    head = bytearray(frames[0])
    parts = frames[1:4] + ([frames[4]] if len(frames) > 4 else [])
    crc = zlib.crc32(head[: HEADER_BYTES - 4])
    for chunk in [bytes(head[HEADER_BYTES:]), *parts]:
        crc = zlib.crc32(chunk, crc)
    head[HEADER_BYTES - 4 : HEADER_BYTES] = struct.pack("<I", crc)
    return [bytes(head), *frames[1:]]


def prefill_from_driver() -> StageMessage:
    return StageMessage(
        kind=MessageKind.PREFILL_FINAL_EMBD,
        pos_start=0,
        token_count=3,
        state=StateHeader.for_kind(MessageKind.PREFILL_FINAL_EMBD, prompt_token_count=3),
        request_id=1,
        session_id=0x0102030405060708,
        tokens=[2, 651, 6037],
    )


GOLDEN_SAMPLING = SamplingParams(temperature=0.5, top_k=40, top_p=0.75, min_p=0.0, repeat_penalty=1.0,
                                 penalty_last_n=64, seed=7, ignore_eos=False, presence_penalty=0.5,
                                 frequency_penalty=0.25, logit_bias=((11, -100.0),))


def configure_from_driver() -> StageMessage:
    options = GenerationOptions(GOLDEN_SAMPLING, logprobs=2, keep_logits=True)
    return StageMessage(
        kind=MessageKind.CONFIGURE_GENERATION, pos_start=0, token_count=0,
        state=StateHeader.for_kind(MessageKind.CONFIGURE_GENERATION, prompt_token_count=3, options=True),
        request_id=1, session_id=0x0102030405060708, options=options,
    )


def fork_from_driver() -> StageMessage:
    options = GenerationOptions(SamplingParams(temperature=0.5, seed=8), fork_from=0x0102030405060708)
    return StageMessage(
        kind=MessageKind.FORK_SESSION, pos_start=0, token_count=3,
        state=StateHeader.for_kind(MessageKind.FORK_SESSION, prompt_token_count=3, options=True),
        request_id=4, session_id=9, options=options,
    )


def decode_from_stage_0() -> StageMessage:
    hidden = np.array([[1.0, -2.0]], np.float32)
    frame = ActivationFrame.from_hidden(hidden, producer_stage_index=0, layer_start=0, layer_end=6)
    state = attrs.evolve(
        StateHeader.for_kind(MessageKind.DECODE_EMBD, prompt_token_count=3, decode_step=0, current_token=9),
        source_stage_index=0,
        activation_codec=1,
    )
    trace = TraceRecord(stage_index=0, received_at_us=10, sent_at_us=20, queue_us=1, decode_us=2,
                        compute_us=3, encode_us=4, bytes_in=0, bytes_out=8)
    return StageMessage(
        kind=MessageKind.DECODE_EMBD, pos_start=3, token_count=1, state=state, request_id=2,
        session_id=5, tokens=[9], activation=encode_activation(ActivationCodec.RAW_F32_V1, frame),
        trace=(trace,),
    )


def stop_message() -> StageMessage:
    return StageMessage(kind=MessageKind.STOP, pos_start=0, token_count=0,
                        state=StateHeader.for_kind(MessageKind.STOP), request_id=3, session_id=5)


# Golden bytes, laid out by hand from docs/PROTOCOL.md.
GOLDEN_PREFILL = [
    "534b5a4d" "0100" "0400" "00000000" "03000000" "0100000000000000" "0807060504030201"
    "0000" "0000" "00000000"
    # state: version 1, seq 0, phase 1, flags FINAL, driver 0, prompt 3, step -1, token -1, source -1, codec 0
    "01000000" "00000000" "01000000" "01000000" "00000000" "03000000" "ffffffff" "ffffffff" "ffffffff" "00000000"
    "CRC",
    "",
    "02000000" "8b020000" "95170000",
    "",
]
GOLDEN_CONFIGURE = [
    "534b5a4d" "0100" "0e00" "00000000" "00000000" "0100000000000000" "0807060504030201"
    "0000" "0000" "00000000"
    # state: version 1, seq 0, phase 0, flags OPTIONS, driver 0, prompt 3, step -1, token -1, source -1, codec 0
    "01000000" "00000000" "00000000" "08000000" "00000000" "03000000" "ffffffff" "ffffffff" "ffffffff" "00000000"
    "CRC",
    # options part: magic SKGO, version 1, 5 records (tags 1, 2, 3, 4, 6; each flagged REQUIRED)
    "534b474f" "0100" "0500"
    # 1 sampling, 36 bytes: temperature 0.5, top_k 40, top_p 0.75, min_p 0, repeat 1, last_n 64, seed 7, ignore_eos 0
    "0100" "0100" "24000000" "0000003f" "28000000" "0000403f" "00000000" "0000803f" "40000000" "0700000000000000"
    "00" "000000"
    # 2 penalties: presence 0.5, frequency 0.25
    "0200" "0100" "08000000" "0000003f" "0000803e"
    # 3 logit bias: 1 entry, token 11 -> -100
    "0300" "0100" "0c000000" "01000000" "0b000000" "0000c8c2"
    # 4 logprobs: 2 alternatives
    "0400" "0100" "04000000" "02000000"
    # 6 keep logits: no value
    "0600" "0100" "00000000",
    "",
    "",
]
GOLDEN_FORK = [
    "534b5a4d" "0100" "1400" "00000000" "03000000" "0400000000000000" "0900000000000000"
    "0000" "0000" "00000000"
    "01000000" "00000000" "00000000" "08000000" "00000000" "03000000" "ffffffff" "ffffffff" "ffffffff" "00000000"
    "CRC",
    "534b474f" "0100" "0200"
    "0100" "0100" "24000000" "0000003f" "00000000" "0000803f" "00000000" "0000803f" "40000000" "0800000000000000"
    "00" "000000"
    # 7 fork from session 0x0102030405060708
    "0700" "0100" "08000000" "0807060504030201",
    "",
    "",
]
GOLDEN_DECODE = [
    "534b5a4d" "0100" "0200" "03000000" "01000000" "0200000000000000" "0500000000000000"
    "0100" "0100" "00000000"
    "01000000" "00000000" "02000000" "00000000" "00000000" "03000000" "00000000" "09000000" "00000000" "01000000"
    "CRC"
    # trace record: stage 0, flags 0, received 10, sent 20, queue 1, decode 2, compute 3, encode 4, in 0, out 8
    "00000000" "00000000" "0a00000000000000" "1400000000000000" "01000000" "02000000" "03000000" "04000000"
    "0000000000000000" "0800000000000000",
    "",
    "09000000",
    "",
    # descriptor: version 2, 1 part, producer 0, layers 0..6, 1 token, 1 sequence, 8 payload bytes
    "0200" "0100" "00000000" "00000000" "06000000" "01000000" "01000000" "0800000000000000"
    # part: identity 0, F32, rank 2, token axis 1, flags 0, dims [2, 1, 0, 0]
    "00000000" "00000000" "02" "01" "0000" "02000000" "01000000" "00000000" "00000000",
    "0000803f" "000000c0",
]
GOLDEN_STOP = [
    "534b5a4d" "0100" "0300" "00000000" "00000000" "0300000000000000" "0500000000000000"
    "0000" "0000" "00000000"
    "01000000" "00000000" "00000000" "00000000" "00000000" "00000000" "ffffffff" "ffffffff" "ffffffff" "00000000"
    "CRC",
    "",
    "",
    "",
]


def golden(hex_frames: list[str]) -> list[bytes]:
    frames = [bytes.fromhex(f.replace("CRC", "00000000")) for f in hex_frames]
    return reseal(frames)


@pytest.mark.parametrize(
    ("build", "hex_frames"),
    [(prefill_from_driver, GOLDEN_PREFILL), (decode_from_stage_0, GOLDEN_DECODE), (stop_message, GOLDEN_STOP),
     (configure_from_driver, GOLDEN_CONFIGURE), (fork_from_driver, GOLDEN_FORK)],
    ids=["prefill", "decode", "stop", "configure", "fork"],
)
def test_golden_bytes(build, hex_frames: list[str]) -> None:
    expected = golden(hex_frames)
    message = build()
    assert as_bytes(encode_message(message)) == expected
    assert decode_message(expected) == message


def test_golden_crc_is_crc32_of_header_and_small_frames() -> None:
    frames = as_bytes(encode_message(stop_message()))
    assert struct.unpack_from("<I", frames[0], HEADER_BYTES - 4)[0] == zlib.crc32(frames[0][: HEADER_BYTES - 4])


def test_struct_sizes_match_protocol_doc() -> None:
    assert (HEADER_BYTES, SAMPLING_BYTES, PART_BYTES, TRACE_BYTES, REPLY_HEADER_BYTES) == (84, 36, 28, 56, 44)


GOLDEN_REPLY_LOGPROBS = [
    # header: SKZR, v1, PREDICTED_TOKEN, request 2, session 5, stage 3, step 1, token 7, answered DECODE_EMBD, 0 traces
    "534b5a52" "0100" "0200" "0200000000000000" "0500000000000000" "03000000" "01000000" "07000000" "0200" "0000"
    "CRC",
    "",
    "",
    "",
    # extras: SKRX, v1, 1 record; tag 1 logprobs (not required), 20 bytes: -0.5, 1 alternative: token 7 -> -0.5
    "534b5258" "0100" "0100" "0100" "0000" "10000000" "000000bf" "01000000" "07000000" "000000bf",
]
GOLDEN_HEARTBEAT_LOAD = [
    # header: SKZR, v1, ACK, request 0, incarnation 9, stage 1, step -1, token -1, answered nothing, 1 trace record
    "534b5a52" "0100" "0100" "0000000000000000" "0900000000000000" "01000000" "ffffffff" "ffffffff" "0000" "0100"
    "CRC",
    "",
    "",
    # trace: stage 1, flags 0, received = sent = 1000 µs, durations and bytes 0
    "01000000" "00000000" "e803000000000000" "e803000000000000" + "00" * 32,
    # extras: SKRX, v1, 1 record; tag 4 stage load, 12 bytes: rss 0x12345000 bytes, 3 sessions
    "534b5258" "0100" "0100" "0400" "0000" "0c000000" "0050341200000000" "03000000",
]
GOLDEN_REPLY_EMBEDDING = [
    "534b5a52" "0100" "0500" "0200000000000000" "0500000000000000" "03000000" "ffffffff" "ffffffff" "0400" "0000"
    "CRC",
    "",
    "",
    "",
    # extras: tag 2 embedding, 12 bytes: 2 values 0.6, 0.8
    "534b5258" "0100" "0100" "0200" "0000" "0c000000" "02000000" "9a99193f" "cdcc4c3f",
]


def _reply_golden(hex_frames: list[str]) -> list[bytes]:
    frames = [bytes.fromhex(f.replace("CRC", "")) for f in hex_frames]
    crc = zlib.crc32(frames[0])
    for frame in frames[1:]:
        crc = zlib.crc32(frame, crc)
    return [frames[0] + struct.pack("<I", crc), *frames[1:]]


@pytest.mark.parametrize(("reply", "hex_frames"), [
    (Reply(kind=ReplyKind.PREDICTED_TOKEN, request_id=2, session_id=5, stage_index=3, answered=MessageKind.DECODE_EMBD,
           decode_step=1, predicted_token=7, logprobs=TokenLogprobs(7, -0.5, ((7, -0.5),))), GOLDEN_REPLY_LOGPROBS),
    (Reply(kind=ReplyKind.EMBEDDING, request_id=2, session_id=5, stage_index=3,
           answered=MessageKind.PREFILL_FINAL_EMBD, embedding=np.array([0.6, 0.8], np.float32)),
     GOLDEN_REPLY_EMBEDDING),
    (Reply.heartbeat(1, 1000, 9, StageLoad(0x12345000, 3)), GOLDEN_HEARTBEAT_LOAD),
], ids=["logprobs", "embedding", "heartbeat-load"])
def test_golden_reply_extras(reply: Reply, hex_frames: list[str]) -> None:
    expected = _reply_golden(hex_frames)
    assert as_bytes(encode_reply(reply)) == expected
    assert decode_reply(expected) == reply


@settings(max_examples=150, deadline=None)
@given(stage_messages())
def test_message_round_trip(message: StageMessage) -> None:
    frames = encode_message(message)
    assert decode_message(frames) == message
    assert decode_message(as_bytes(frames)) == message


@settings(max_examples=100, deadline=None)
@given(replies())
def test_reply_round_trip(reply: Reply) -> None:
    assert decode_reply(as_bytes(encode_reply(reply))) == reply


def test_decoded_payloads_and_sidebands_are_views_not_copies() -> None:
    frames = [bytearray(f) for f in as_bytes(encode_message(decode_from_stage_0()))]
    message = decode_message(frames)
    assert np.shares_memory(message.tokens, np.frombuffer(frames[2], np.uint8))
    payload = np.asarray(message.activation.payloads[0])
    assert np.shares_memory(payload, np.frombuffer(frames[5], np.uint8))


def test_encoded_payload_frames_are_the_arrays_themselves() -> None:
    message = decode_from_stage_0()
    frames = encode_message(message)
    assert frames[5] is message.activation.payloads[0]
    assert frames[2] is message.tokens


def _all_variants() -> list[tuple[str, list[bytes]]]:
    variants = []
    for build in (prefill_from_driver, decode_from_stage_0, stop_message, configure_from_driver, fork_from_driver):
        variants.append((build.__name__, as_bytes(encode_message(build()))))
    return variants


def test_every_truncation_of_every_frame_is_rejected() -> None:
    count = 0
    for _name, frames in _all_variants():
        for index, frame in enumerate(frames):
            for length in range(len(frame)):
                broken = list(frames)
                broken[index] = frame[:length]
                with pytest.raises(WireError):
                    decode_message(broken)
                count += 1
    assert count > 400


def test_every_flipped_header_byte_is_rejected() -> None:
    for _name, frames in _all_variants():
        for flips in (0x01, 0x80, 0xFF):
            for offset in range(len(frames[0])):
                head = bytearray(frames[0])
                head[offset] ^= flips
                with pytest.raises(WireError):
                    decode_message([bytes(head), *frames[1:]])


@settings(max_examples=60, deadline=None)
@given(stage_messages(), st.data())
def test_flipped_bytes_in_small_frames_never_decode_silently(message: StageMessage, data: st.DataObject) -> None:
    frames = as_bytes(encode_message(message))
    small = [i for i in range(min(len(frames), 5)) if frames[i]]
    index = data.draw(st.sampled_from(small))
    offset = data.draw(st.integers(0, len(frames[index]) - 1))
    frame = bytearray(frames[index])
    frame[offset] ^= data.draw(st.integers(1, 255))
    with pytest.raises(WireError):
        decode_message([*frames[:index], bytes(frame), *frames[index + 1 :]])


def test_wrong_frame_counts() -> None:
    frames = as_bytes(encode_message(decode_from_stage_0()))
    for count in range(len(frames) + 3):
        if count == len(frames):
            continue
        candidate = (frames + [b""] * 3)[:count]
        with pytest.raises(WireError, match="frames"):
            decode_message(candidate)


def patched(frames: list[bytes], offset: int, fmt: str, value: int | bytes) -> list[bytes]:
    head = bytearray(frames[0])
    struct.pack_into(fmt, head, offset, value)
    return reseal([bytes(head), *frames[1:]])


def test_wrong_magic_version_kind_and_counts_are_named() -> None:
    frames = as_bytes(encode_message(decode_from_stage_0()))
    with pytest.raises(WireError, match="magic b'XKZM' is wrong"):
        decode_message(patched(frames, 0, "<4s", b"XKZM"))
    with pytest.raises(WireError, match="wire version 2 is not supported; expected 1"):
        decode_message(patched(frames, 4, "<H", 2))
    with pytest.raises(WireError, match=r"^unknown stage message kind 10$"):
        decode_message(patched(frames, 6, "<H", 10))
    with pytest.raises(LimitError, match="activation part count 17 exceeds the limit of 16"):
        decode_message(patched(frames, 32, "<H", 17))
    with pytest.raises(LimitError, match="trace record count 65 exceeds"):
        decode_message(patched(frames, 34, "<H", 65))
    with pytest.raises(WireError, match="position sideband has 0 values; the header says 3"):
        decode_message(patched(frames, 36, "<I", 3))
    with pytest.raises(WireError, match="state version 9"):
        decode_message(patched(frames, 40, "<i", 9))
    with pytest.raises(WireError, match="state phase 1 does not match DECODE_EMBD"):
        decode_message(patched(frames, 48, "<i", 1))
    with pytest.raises(WireError, match="FINAL_CHUNK is set on DECODE_EMBD"):
        decode_message(patched(frames, 52, "<i", 1))
    with pytest.raises(WireError, match="unknown state flag bits 0x4"):
        decode_message(patched(frames, 52, "<i", 4))
    with pytest.raises(WireError, match="unknown state flag bits 0x20"):
        decode_message(patched(frames, 52, "<i", 0x30))
    with pytest.raises(WireError, match="unknown activation codec id 9"):
        decode_message(patched(frames, 76, "<i", 9))
    with pytest.raises(WireError, match="activation frame producer does not match stage message"):
        decode_message(patched(frames, 72, "<i", 3))
    with pytest.raises(WireError, match="DECODE_EMBD token_count 2 must be 1"):
        decode_message(patched(frames, 12, "<i", 2))


def patched_descriptor(frames: list[bytes], offset: int, fmt: str, value: int) -> list[bytes]:
    desc = bytearray(frames[4])
    struct.pack_into(fmt, desc, offset, value)
    return reseal([*frames[:4], bytes(desc), *frames[5:]])


def test_bad_descriptors_are_named() -> None:
    frames = as_bytes(encode_message(decode_from_stage_0()))
    with pytest.raises(WireError, match="version 3 is not supported"):
        decode_message(patched_descriptor(frames, 0, "<H", 3))
    with pytest.raises(WireError, match="unsupported activation part ggml type 8"):
        decode_message(patched_descriptor(frames, 32 + 4, "<I", 8))
    with pytest.raises(WireError, match=r"rank 5 is outside 1\.\.4"):
        decode_message(patched_descriptor(frames, 32 + 8, "<B", 5))
    with pytest.raises(WireError, match="payload_bytes 9 does not match"):
        decode_message(patched_descriptor(frames, 24, "<Q", 9))
    with pytest.raises(WireError, match="payload has 8 bytes; expected 16"):
        decode_message(patched_descriptor(patched_descriptor(frames, 24, "<Q", 16), 32 + 12, "<I", 4))
    # An oversized part is refused from its descriptor: 2**27 x 2 floats is 1 GiB.
    big = patched_descriptor(frames, 32 + 12, "<I", 2**28)
    with pytest.raises(LimitError, match="exceeds the limit of 536870912 bytes"):
        decode_message(big)


def test_frame_token_count_must_match_the_message() -> None:
    frame = ActivationFrame.from_hidden(np.zeros((1, 2), np.float32), producer_stage_index=0,
                                        layer_start=0, layer_end=6)
    state = attrs.evolve(StateHeader.for_kind(MessageKind.PREFILL_EMBD), source_stage_index=0,
                         activation_codec=1)
    message = StageMessage(kind=MessageKind.PREFILL_EMBD, pos_start=0, token_count=2, state=state,
                           request_id=1, session_id=1, tokens=[1, 2],
                           activation=encode_activation(ActivationCodec.RAW_F32_V1, frame))
    with pytest.raises(WireError, match="activation frame token count does not match stage message"):
        decode_message(encode_message(message))


def test_sideband_limits() -> None:
    message = decode_from_stage_0()
    frames = as_bytes(encode_message(message))
    frames[3] = bytes(4 * (MAX_SIDEBAND_VALUES + 1))
    with pytest.raises(LimitError, match=f"position sideband has {MAX_SIDEBAND_VALUES + 1} values"):
        decode_message(frames)
    frames = as_bytes(encode_message(message))
    frames[2] = b"\x01\x02\x03"
    with pytest.raises(WireError, match="multiple of 4"):
        decode_message(frames)


def test_state_must_agree_with_kind_on_construction() -> None:
    with pytest.raises(WireError, match="OPTIONS flag"):
        attrs.evolve(configure_from_driver(), options=None)
    with pytest.raises(WireError, match="STOP must carry no tokens"):
        attrs.evolve(stop_message(), token_count=1, tokens=[5])
    with pytest.raises(WireError, match="token sideband has 2 values for token_count 3"):
        attrs.evolve(prefill_from_driver(), tokens=[1, 2])
    with pytest.raises(WireError, match="request_id -1"):
        attrs.evolve(stop_message(), request_id=-1)


def test_reply_hostile_input() -> None:
    reply = Reply(kind=ReplyKind.ERROR, request_id=1, session_id=2, stage_index=1,
                  answered=MessageKind.DECODE_EMBD, decode_step=4, error="stage 1: boom")
    frames = as_bytes(encode_reply(reply))
    assert decode_reply(frames) == reply
    for index, frame in enumerate(frames):
        for length in range(len(frame)):
            broken = list(frames)
            broken[index] = frame[:length]
            with pytest.raises(WireError):
                decode_reply(broken)
    for offset in range(len(frames[0])):
        head = bytearray(frames[0])
        head[offset] ^= 0x10
        with pytest.raises(WireError):
            decode_reply([bytes(head), *frames[1:]])
    with pytest.raises(WireError, match="expected 4, or 5 with extras"):
        decode_reply(frames[:3])
    with pytest.raises(WireError, match="error text must be present exactly on ERROR"):
        Reply(kind=ReplyKind.ACK, request_id=1, session_id=2, stage_index=1, decode_step=-1, error="x")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=120), min_size=0, max_size=8))
def test_random_garbage_only_ever_raises_project_errors(frames: list[bytes]) -> None:
    for decode in (decode_message, decode_reply):
        with pytest.raises(SkippyError):
            decode(frames)


@settings(max_examples=300, deadline=None)
@given(stage_messages(with_activation=True), st.data())
def test_mutated_fields_behind_a_valid_checksum_decode_or_fail_cleanly(
    message: StageMessage, data: st.DataObject
) -> None:
    # Past the checksum: every field of the header, state and descriptor takes hostile
    # values. The decoder must either return a message that re-encodes to the same bytes or
    # raise a project error, never anything else.
    frames = as_bytes(encode_message(message))
    index = data.draw(st.sampled_from([0, 4] if len(frames) > 4 else [0]))
    limit = HEADER_BYTES - 4 if index == 0 else len(frames[4])
    frame = bytearray(frames[index])
    for _ in range(data.draw(st.integers(1, 4))):
        offset = data.draw(st.integers(0, limit - 1))
        frame[offset] = data.draw(st.integers(0, 255))
    mutated = reseal([*frames[:index], bytes(frame), *frames[index + 1 :]])
    try:
        decoded = decode_message(mutated)
    except SkippyError:
        return
    assert as_bytes(encode_message(decoded)) == mutated


def test_kind_properties() -> None:
    assert MessageKind.PREFILL_EMBD.carries_tokens and not MessageKind.STOP.carries_tokens
    assert not MessageKind.PREFILL_EMBD.expects_reply and MessageKind.TRIM_SESSION.expects_reply
    assert MessageKind.parse(19) is MessageKind.TRIM_SESSION
    with pytest.raises(WireError, match="unknown stage reply kind 9"):
        ReplyKind.parse(9)


def test_non_f32_parts_travel_byte_exact_under_compact_codecs() -> None:
    hidden = np.array([[0.5, 0.25]], np.float32)
    f16_part = PartDesc(identity=1, ggml_type=GGMLType.F16, dims=(3, 1), token_axis=1)
    values = np.array([[np.inf, np.nan, -0.0]], np.float16)  # not finite: must pass untouched
    frame = ActivationFrame.from_hidden(hidden, producer_stage_index=0, layer_start=0, layer_end=1,
                                        sidebands=[(f16_part, values)])
    for codec in ActivationCodec:
        encoded = encode_activation(codec, frame)
        decoded = encoded.decode()
        assert decoded.arrays[1].tobytes() == values.tobytes()


def test_every_message_kind_has_its_row_and_a_missing_one_is_named() -> None:
    from skippy_zmq.errors import TableError, check_rows
    from skippy_zmq.wire.messages import KINDS

    check_rows(KINDS, MessageKind, "KINDS")  # the shipped table is whole
    partial = {kind: row for kind, row in KINDS.items() if kind is not MessageKind.TRIM_SESSION}
    with pytest.raises(TableError) as caught:
        check_rows(partial, MessageKind, "skippy_zmq.wire.messages.KINDS")
    assert str(caught.value) == (
        "skippy_zmq.wire.messages.KINDS: no row for TRIM_SESSION (19); every member needs exactly one row"
    )
    with pytest.raises(TableError, match="rows for 99, which are not members"):
        check_rows({**KINDS, 99: KINDS[MessageKind.STOP]}, MessageKind, "KINDS")


def test_a_kind_added_without_its_rows_fails_at_import_naming_it() -> None:
    # The wire module's source with one more kind in the enum and no row for it, run as a module.
    import types
    from pathlib import Path

    from skippy_zmq.errors import TableError
    from skippy_zmq.wire import messages

    source = Path(messages.__file__).read_text()
    grown = source.replace("    VERIFY_EMBD = 21\n", "    VERIFY_EMBD = 21\n    PROBE_SESSION = 22\n")
    assert grown != source
    probe = types.ModuleType("probe")
    with pytest.raises(TableError) as caught:
        exec(compile(grown, "probe", "exec"), probe.__dict__)
    assert str(caught.value) == ("skippy_zmq.wire.messages.KINDS: no row for PROBE_SESSION (22); every member needs "
                                 "exactly one row")


def test_the_driver_word_packs_id_and_incarnation_and_travels_in_the_state() -> None:
    word = driver_word(0x7FFF, 0xFFFF)
    assert word == 0x7FFF_FFFF and driver_id_of(word) == 0x7FFF
    for bad in ((0, 1), (1, 0), (0x8000, 1), (1, 0x10000)):
        with pytest.raises(WireError, match=r"driver (id|incarnation)"):
            driver_word(*bad)
    state = attrs.evolve(StateHeader.for_kind(MessageKind.STOP), driver_incarnation=driver_word(3, 4))
    message = StageMessage(kind=MessageKind.STOP, pos_start=0, token_count=0, state=state, request_id=1, session_id=2)
    frames = encode_message(message)
    assert struct.unpack_from("<i", frames[0], 56)[0] == 0x0003_0004  # state offset 56 (§2.2)
    assert decode_message(frames).state.driver_incarnation == 0x0003_0004


def test_pass_continues_is_bit_4_of_the_state_flags_and_travels_with_the_others() -> None:
    state = StateHeader.for_kind(MessageKind.PREFILL_FINAL_EMBD, prompt_token_count=2)
    message = StageMessage(kind=MessageKind.PREFILL_FINAL_EMBD, pos_start=0, token_count=2, state=state,
                           request_id=1, session_id=2, tokens=[5, 6])
    assert not message.pass_continues and message.with_pass_continues(False) is message
    marked = message.with_pass_continues(True)
    frames = encode_message(marked)
    assert struct.unpack_from("<i", frames[0], 52)[0] == 0x11  # FINAL_CHUNK | PASS_CONTINUES (§2.2)
    decoded = decode_message(frames)
    assert decoded.pass_continues and decoded.state.flags & 1
    cleared = decoded.with_pass_continues(False)
    assert not cleared.pass_continues and cleared.state.flags == message.state.flags


def test_a_reply_s_pass_mark_is_an_empty_extras_record_of_tag_3() -> None:
    reply = Reply(kind=ReplyKind.PREDICTED_TOKEN, request_id=1, session_id=2, stage_index=1,
                  answered=MessageKind.DECODE_EMBD, predicted_token=7, pass_continues=True)
    frames = encode_reply(reply)
    assert len(frames) == 5 and bytes(frames[4])[8:16] == struct.pack("<HHI", 3, 0, 0)  # tag, flags, length
    assert decode_reply(frames) == reply and decode_reply(frames).pass_continues
    assert len(encode_reply(attrs.evolve(reply, pass_continues=False))) == 4  # unmarked: no extras frame
    with_value = pack_records(b"SKRX", [(3, 0, b"\x01\0\0\0")])
    header = bytes(frames[0])[:40]
    crc = crc_of(header, frames[1], frames[2], frames[3], with_value)
    with pytest.raises(WireError, match="pass-continues record has 4 bytes; expected none"):
        decode_reply([header + struct.pack("<I", crc), frames[1], frames[2], frames[3], with_value])


def test_an_error_reply_names_its_cause_in_the_token_field() -> None:
    def error(code: int) -> Reply:
        return Reply(kind=ReplyKind.ERROR, request_id=1, session_id=2, stage_index=0, error="x", predicted_token=code)

    assert decode_reply(encode_reply(error(ErrorCause.LANE_LIMIT))).error_cause is ErrorCause.LANE_LIMIT
    assert error(2).error_cause is ErrorCause.DRIVER_REPLACED
    assert error(-1).error_cause is error(77).error_cause is ErrorCause.UNSPECIFIED  # an id this version lacks
    token = Reply(kind=ReplyKind.PREDICTED_TOKEN, request_id=1, session_id=2, stage_index=1, predicted_token=1)
    assert token.error_cause is ErrorCause.UNSPECIFIED  # on a token reply the field is the token


def test_a_stage_load_travels_on_heartbeats_only_and_a_driver_without_it_reads_none() -> None:
    beat = Reply.heartbeat(2, 5, 7, StageLoad(1 << 40, 16))
    assert decode_reply(encode_reply(beat)).load == StageLoad(1 << 40, 16)
    assert len(encode_reply(Reply.heartbeat(2, 5, 7))) == 4 and decode_reply(encode_reply(Reply.heartbeat(2, 5, 7))).load is None
    with pytest.raises(WireError, match="a stage's load travels on heartbeats only, not on ACK for request 3"):
        Reply(kind=ReplyKind.ACK, request_id=3, session_id=1, stage_index=0, answered=MessageKind.STOP,
              load=StageLoad(0, 0))
    with pytest.raises(WireError, match=r"heartbeat sessions 4294967296 is outside 0\.\.4294967295"):
        StageLoad(0, 2**32)
    frames = [bytes(f) for f in encode_reply(beat)]
    short = pack_records(b"SKRX", [(4, 0, b"\0" * 11)])
    crc = crc_of(frames[0][:40], frames[1], frames[2], frames[3], short)
    with pytest.raises(WireError, match="reply stage-load record has 11 bytes; expected 12"):
        decode_reply([frames[0][:40] + struct.pack("<I", crc), frames[1], frames[2], frames[3], short])
    # a tag this version does not know (a later stage's figure) is skipped: the beat still counts
    later = pack_records(b"SKRX", [(9, 0, b"new")])
    crc = crc_of(frames[0][:40], frames[1], frames[2], frames[3], later)
    unknown = decode_reply([frames[0][:40] + struct.pack("<I", crc), frames[1], frames[2], frames[3], later])
    assert unknown.is_heartbeat and unknown.load is None


def test_a_stage_says_on_its_heartbeat_whether_it_computes_batch_invariantly() -> None:
    beat = Reply.heartbeat(1, 5, 7, StageLoad(1 << 30, 2, invariant=True))
    frames = [bytes(f) for f in encode_reply(beat)]
    plain = [bytes(f) for f in encode_reply(Reply.heartbeat(1, 5, 7, StageLoad(1 << 30, 2)))]
    assert len(frames[4]) > len(plain[4])  # a record of its own (tag 6) beside the load's 12 bytes
    assert decode_reply(frames).load == StageLoad(1 << 30, 2, invariant=True)
    assert decode_reply(plain).load == StageLoad(1 << 30, 2)  # no record: not invariant

    def heartbeat_with(extras: bytes) -> Reply:
        crc = crc_of(frames[0][:40], frames[1], frames[2], frames[3], extras)
        return decode_reply([frames[0][:40] + struct.pack("<I", crc), frames[1], frames[2], frames[3], extras])

    with pytest.raises(WireError, match="reply batch-invariant record has 1 bytes; expected none"):
        heartbeat_with(pack_records(b"SKRX", [(4, 0, b"\0" * 12), (6, 0, b"\1")]))
    with pytest.raises(WireError, match="reply batch-invariant record without a stage-load record"):
        heartbeat_with(pack_records(b"SKRX", [(6, 0, b"")]))
