"""The forwarding step: one test per behaviour of docs/PROTOCOL.md §5 "Forwarding" (invariants, codec choice, trace)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from skippy_zmq.errors import CodecError, StageError
from skippy_zmq.stage.forwarding import ForwardingConfig, StageTiming, forward_control, forward_message
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.wire.codecs import ActivationCodec, CodecPolicy, encoded_nbytes
from skippy_zmq.wire.frames import PART_OPTIONAL, ActivationFrame, FrameDesc, GGMLType, PartDesc
from skippy_zmq.wire.messages import (
    FLAG_OPTIONS,
    MessageKind,
    StageMessage,
    StateHeader,
    decode_message,
    encode_message,
)
from skippy_zmq.wire.options import GenerationOptions

RAW, F16, BF16 = ActivationCodec.RAW_F32_V1, ActivationCodec.F16_RNE_V1, ActivationCodec.BF16_RNE_V1


def config(
    codec: ActivationCodec = RAW,
    policy: CodecPolicy = CodecPolicy.FIXED,
    *,
    first: bool = False,
) -> ForwardingConfig:
    # The stages these tests forward from: stage 1 owning layers 4..8, or stage 0 owning 0..4.
    if first:
        return ForwardingConfig(0, 0, 4, codec, policy)
    return ForwardingConfig(1, 4, 8, codec, policy)


def incoming(token_count: int = 1, source: int = 0) -> StageMessage:
    kind = MessageKind.DECODE_EMBD if token_count == 1 else MessageKind.PREFILL_EMBD
    state = StateHeader.for_kind(kind, decode_step=3, current_token=11)
    return StageMessage(
        kind=kind,
        pos_start=7,
        token_count=token_count,
        state=attrs.evolve(state, source_stage_index=source),
        request_id=42,
        session_id=99,
        tokens=list(range(11, 11 + token_count)),
    )


def frame(token_count: int, parts: list[tuple[GGMLType, int, np.ndarray]]) -> ActivationFrame:
    """Parts of (type, flags, values); each part is `[len(values)/token_count, token_count]`."""
    descs, arrays = [], []
    for identity, (ggml_type, flags, values) in enumerate(parts):
        width = values.size // token_count
        descs.append(PartDesc(identity=identity, ggml_type=ggml_type, dims=(width, token_count), token_axis=1, flags=flags))
        arrays.append(values.astype(ggml_type.dtype).reshape(token_count, width))
    desc = FrameDesc(producer_stage_index=1, layer_start=4, layer_end=8, token_count=token_count, parts=tuple(descs))
    return ActivationFrame(desc, tuple(arrays))


def f32_frame(token_count: int, values: list[float]) -> ActivationFrame:
    return frame(token_count, [(GGMLType.F32, 0, np.array(values, np.float32))])


def two_f32_part_frame(values: list[float]) -> ActivationFrame:
    half = len(values) // 2
    return frame(
        1,
        [
            (GGMLType.F32, 0, np.array(values[:half], np.float32)),
            (GGMLType.F32, PART_OPTIONAL, np.array(values[half:], np.float32)),
        ],
    )


def through_the_wire(message: StageMessage) -> StageMessage:
    return decode_message([bytes(memoryview(f)) for f in encode_message(message)])


def test_two_f32_parts_survive_f16() -> None:
    source = two_f32_part_frame([1.0, 2.0, 3.0, 4.0])
    forwarded = forward_message(config(F16), incoming(), source)
    assert forwarded.message.state.activation_codec == F16
    decoded = through_the_wire(forwarded.message).activation.decode()
    assert decoded.desc == forwarded.message.activation.desc
    assert [a.tobytes() for a in decoded.arrays] == [a.tobytes() for a in source.arrays]


def test_i32_sideband_survives_f16_byte_exact() -> None:
    top_k = np.array([7, 11, 13], np.int32)
    source = frame(1, [(GGMLType.F32, 0, np.array([1.0, 2.0], np.float32)), (GGMLType.I32, 0, top_k)])
    forwarded = forward_message(config(F16), incoming(), source)
    decoded = through_the_wire(forwarded.message).activation.decode()
    assert decoded.desc.parts == source.desc.parts
    assert decoded.arrays[1].tobytes() == top_k.tobytes()
    assert decoded.arrays[0].tobytes() == np.array([[1.0, 2.0]], np.float32).tobytes()


def test_auto_lossless_selects_bf16_when_both_halves_are_exact() -> None:
    source = f32_frame(1, [1.0, 2.0])
    forwarded = forward_message(config(RAW, CodecPolicy.AUTO_LOSSLESS_V1), incoming(), source)
    assert forwarded.message.state.activation_codec == BF16
    assert forwarded.message.activation.codec is BF16
    assert forwarded.message.activation.wire_nbytes == encoded_nbytes(BF16, (1, 2)) == 4


def test_auto_lossless_selects_f16_when_only_f16_is_exact() -> None:
    forwarded = forward_message(
        config(RAW, CodecPolicy.AUTO_LOSSLESS_V1), incoming(), f32_frame(1, [1.0009766, 2.0])
    )
    assert forwarded.message.state.activation_codec == F16
    decoded = through_the_wire(forwarded.message).activation.decode()
    assert decoded.arrays[0].tobytes() == np.array([[1.0009766, 2.0]], np.float32).tobytes()


def test_auto_lossless_uses_raw_for_mixed_primary_and_sideband_requirements() -> None:
    # The primary is f16-exact only, the sideband bf16-exact only: no half codec fits both.
    source = two_f32_part_frame([1.0009766, 2.0, 65536.0, 4.0])
    forwarded = forward_message(config(RAW, CodecPolicy.AUTO_LOSSLESS_V1), incoming(), source)
    assert forwarded.message.state.activation_codec == RAW
    assert forwarded.message.activation.wire_nbytes == 16


def test_auto_lossless_rejects_a_non_raw_fallback() -> None:
    with pytest.raises(CodecError, match="incompatible with configured codec f16-rne-v1"):
        forward_message(config(F16, CodecPolicy.AUTO_LOSSLESS_V1), incoming(), f32_frame(1, [1.0, 2.0]))


def test_first_stage_applies_auto_lossless_selection() -> None:
    forwarded = forward_message(
        config(RAW, CodecPolicy.AUTO_LOSSLESS_V1, first=True), incoming(source=-1), f32_frame(1, [1.0, 2.0])
    )
    assert forwarded.message.state.source_stage_index == 0
    assert forwarded.message.activation.desc.producer_stage_index == 0
    assert forwarded.message.state.activation_codec == BF16


def test_f16_overflow_fails_without_raw_fallback() -> None:
    with pytest.raises(CodecError, match="F16 activation value is out of range"):
        forward_message(config(F16), incoming(), f32_frame(1, [float(np.finfo(np.float32).max), 1.0]))


def test_short_frame_from_a_non_first_stage_fails_by_name() -> None:
    # The frame covers 1 of 4 incoming tokens, as a suffix-only execution would produce.
    with pytest.raises(StageError) as info:
        forward_message(config(), incoming(token_count=4), f32_frame(1, [1.0, 2.0, 3.0, 4.0]))
    assert str(info.value) == (
        "stage 1 (layers 4..8) produced 1 activation tokens for 4 incoming tokens; "
        "non-first stages must execute the full range"
    )


def test_first_stage_may_emit_a_short_frame() -> None:
    # Suffix execution after a 3-token prefix-cache hit: the message shrinks to the suffix,
    # so the next stage accepts it and attends over exactly what it receives.
    message = attrs.evolve(incoming(token_count=4, source=-1), positions=[7, 8, 9, 10])
    forwarded = forward_message(config(first=True), message, f32_frame(1, [1.0] * 16))
    out = through_the_wire(forwarded.message)
    assert (out.pos_start, out.token_count) == (10, 1)
    assert out.tokens.tolist() == [14] and out.positions.tolist() == [10]
    assert out.activation.desc.token_count == 1


def test_no_stage_may_emit_more_tokens_than_it_received() -> None:
    with pytest.raises(StageError, match="produced 2 activation tokens for 1 incoming tokens"):
        forward_message(config(first=True), incoming(token_count=1, source=-1), f32_frame(2, [1.0] * 4))


def test_pass_continues_is_a_flag_of_one_hop_and_never_forwarded() -> None:
    marked = incoming().with_pass_continues(True)
    assert not forward_message(config(), marked, f32_frame(1, [0.5, -0.25])).message.pass_continues
    stop = StageMessage(kind=MessageKind.STOP, pos_start=0, token_count=0, request_id=1, session_id=2,
                        state=StateHeader.for_kind(MessageKind.STOP)).with_pass_continues(True)
    assert not forward_control(config(), stop).pass_continues


def test_forwarded_message_keeps_fields_and_appends_trace() -> None:
    source = f32_frame(1, [0.5, -0.25])
    sampling = GenerationOptions(SamplingParams(temperature=0.5, top_k=3, seed=9), logprobs=2)
    message = attrs.evolve(
        incoming(), positions=[7], options=sampling,
        state=attrs.evolve(incoming().state, flags=FLAG_OPTIONS),
    )
    timing = StageTiming(received_at_us=1_000, queue_us=2, decode_us=3, compute_us=4, bytes_in=5)
    forwarded = forward_message(config(), message, source, timing)
    out = forwarded.message
    assert (out.kind, out.pos_start, out.token_count, out.request_id, out.session_id) == (
        message.kind, message.pos_start, message.token_count, message.request_id, message.session_id
    )
    assert np.array_equal(out.tokens, message.tokens)
    assert out.positions.tolist() == [7] and out.options == sampling
    assert out.state.decode_step == 3 and out.state.current_token == 11
    assert out.state.source_stage_index == 1
    assert out.activation.desc.layer_start == 4 and out.activation.desc.layer_end == 8
    (record,) = out.trace
    assert record.stage_index == 1 and record.received_at_us == 1_000
    assert (record.queue_us, record.decode_us, record.compute_us, record.bytes_in) == (2, 3, 4, 5)
    assert record.bytes_out == 8 and record.sent_at_us >= 1_000
    assert forwarded.encode_seconds >= 0
    # raw-f32-v1 is zero copy: the payload handed to ZeroMQ is the stage's own output array.
    assert np.shares_memory(np.asarray(out.activation.payloads[0]), source.arrays[0])


def test_control_messages_are_forwarded_with_the_stage_as_source() -> None:
    stop = StageMessage(
        kind=MessageKind.STOP, pos_start=0, token_count=0,
        state=StateHeader.for_kind(MessageKind.STOP), request_id=5, session_id=6,
    )
    out = forward_control(config(), stop)
    assert out.state.source_stage_index == 1 and out.activation is None
    assert len(out.trace) == 1 and out.trace[0].bytes_out == 0
    assert through_the_wire(out) == out
