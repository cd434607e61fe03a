"""Build the message a stage sends downstream: invariants, codec choice, trace record."""

from __future__ import annotations

import functools
import time

import attrs
import numpy as np

from skippy_zmq.config import StageConfig, TopologyConfig
from skippy_zmq.errors import StageError
from skippy_zmq.wire.codecs import ActivationCodec, CodecPolicy, select_lossless
from skippy_zmq.wire.frames import ActivationFrame, FrameDesc, GGMLType
from skippy_zmq.wire.messages import FLAG_PASS_CONTINUES, EncodedActivation, StageMessage, encode_activation
from skippy_zmq.wire.trace import TraceRecord, now_us


@attrs.frozen
class ForwardingConfig:
    """What the forwarding step needs to know about its stage and the topology's codec."""

    stage_index: int
    layer_start: int
    layer_end: int
    activation_codec: ActivationCodec = ActivationCodec.RAW_F32_V1
    codec_policy: CodecPolicy = CodecPolicy.FIXED

    def __attrs_post_init__(self) -> None:
        # Checked once here rather than for every forwarded message.
        self.codec_policy.check_compatible(self.activation_codec)

    @classmethod
    def from_topology(cls, topology: TopologyConfig, stage: StageConfig) -> ForwardingConfig:
        """The forwarding view of `stage` within `topology`."""
        return cls(
            stage_index=stage.index,
            layer_start=stage.layer_start,
            layer_end=stage.layer_end,
            activation_codec=topology.activation_codec,
            codec_policy=topology.codec_policy,
        )


@attrs.frozen
class StageTiming:
    """Timings a worker measured for one message before forwarding it (µs, wall-clock µs)."""

    received_at_us: int = 0
    queue_us: int = 0
    decode_us: int = 0
    compute_us: int = 0
    bytes_in: int = 0

    def record(self, stage_index: int) -> TraceRecord:
        """The trace record of a stage that answers the message itself (nothing encoded), sent now."""
        return TraceRecord(stage_index=stage_index, received_at_us=self.received_at_us, sent_at_us=now_us(),
                           queue_us=self.queue_us, decode_us=self.decode_us, compute_us=self.compute_us,
                           bytes_in=self.bytes_in)


@attrs.frozen
class ForwardedMessage:
    """The message to send downstream and how long encoding its activation took."""

    message: StageMessage
    encode_seconds: float


def forward_message(
    config: ForwardingConfig,
    incoming: StageMessage,
    output: ActivationFrame,
    timing: StageTiming | None = None,
) -> ForwardedMessage:
    """Turn `incoming` and this stage's `output` frame into the message for the next stage.

    Keeps kind, positions, ids, sampling and sidebands; writes this stage's index as the source;
    chooses the codec by policy (failing closed: a compact codec that cannot encode is an error,
    never a silent fall back to raw); appends this stage's trace record.
    """
    # Only the stage owning layer 0 may skip a cached prefix. A later stage emitting fewer
    # tokens would make the next stage attend over positions it never received: plausible
    # but wrong output, so refuse by name.
    if config.layer_start != 0 and output.desc.token_count != incoming.token_count:
        raise StageError(
            f"stage {config.stage_index} (layers {config.layer_start}..{config.layer_end}) "
            f"produced {output.desc.token_count} activation tokens for {incoming.token_count} "
            f"incoming tokens; non-first stages must execute the full range"
        )
    if output.desc.token_count > incoming.token_count:
        raise StageError(
            f"stage {config.stage_index} (layers {config.layer_start}..{config.layer_end}) "
            f"produced {output.desc.token_count} activation tokens for {incoming.token_count} "
            f"incoming tokens"
        )
    if output.desc.token_count < incoming.token_count:
        # Suffix execution on stage 0 (the prefix is already cached on every stage): the
        # message shrinks to the suffix, so the next stage's checks hold and it attends over
        # exactly what it receives.
        skipped = incoming.token_count - output.desc.token_count
        incoming = attrs.evolve(
            incoming,
            pos_start=incoming.pos_start + skipped,
            token_count=output.desc.token_count,
            tokens=incoming.tokens[skipped:],
            positions=incoming.positions[skipped:] if incoming.positions.size else incoming.positions,
        )
    desc = _stamped(output.desc, config.stage_index, config.layer_start, config.layer_end)
    frame = output if desc is output.desc else ActivationFrame(desc, output.arrays)
    started = time.perf_counter()
    activation = _encode_by_policy(config, frame)
    encode_seconds = time.perf_counter() - started
    state = attrs.evolve(
        incoming.state,
        source_stage_index=config.stage_index,
        activation_codec=int(activation.codec),
        flags=incoming.state.flags & ~FLAG_PASS_CONTINUES,  # a flag of one hop: the sender sets its own
    )
    record = _trace_record(config, timing, encode_seconds, activation.wire_nbytes)
    message = attrs.evolve(
        incoming,
        state=state,
        activation=activation,
        trace=(*incoming.trace, record),
    )
    return ForwardedMessage(message=message, encode_seconds=encode_seconds)


def forward_control(
    config: ForwardingConfig, incoming: StageMessage, timing: StageTiming | None = None
) -> StageMessage:
    """Forward an activation-less message (Stop, ConfigureGeneration, TrimSession) unchanged
    but for the source stage and the trace."""
    state = attrs.evolve(incoming.state, source_stage_index=config.stage_index, activation_codec=0,
                         flags=incoming.state.flags & ~FLAG_PASS_CONTINUES)
    record = _trace_record(config, timing, 0.0, 0)
    return attrs.evolve(incoming, state=state, activation=None, trace=(*incoming.trace, record))


@functools.lru_cache(maxsize=256)
def _stamped(desc: FrameDesc, stage_index: int, layer_start: int, layer_end: int) -> FrameDesc:
    """`desc` as produced by this stage (its index and layer range)."""
    if (desc.producer_stage_index, desc.layer_start, desc.layer_end) == (stage_index, layer_start, layer_end):
        return desc
    return attrs.evolve(desc, producer_stage_index=stage_index, layer_start=layer_start, layer_end=layer_end)


def _encode_by_policy(config: ForwardingConfig, frame: ActivationFrame) -> EncodedActivation:
    if config.codec_policy is CodecPolicy.FIXED:
        return encode_activation(config.activation_codec, frame)
    f32_indexes = [
        i for i, part in enumerate(frame.desc.parts) if part.ggml_type is GGMLType.F32
    ]
    codec, encoded = select_lossless([np.ascontiguousarray(frame.arrays[i]) for i in f32_indexes])
    payloads = [np.ascontiguousarray(array) for array in frame.arrays]
    # The encodings the selector produced are the ones sent: nothing is encoded twice.
    for index, buffer in zip(f32_indexes, encoded, strict=True):
        payloads[index] = buffer
    return EncodedActivation(frame.desc, codec, tuple(payloads))


def _trace_record(
    config: ForwardingConfig, timing: StageTiming | None, encode_seconds: float, bytes_out: int
) -> TraceRecord:
    timing = timing or StageTiming()
    return TraceRecord(
        stage_index=config.stage_index,
        received_at_us=timing.received_at_us,
        sent_at_us=now_us(),
        queue_us=timing.queue_us,
        decode_us=timing.decode_us,
        compute_us=timing.compute_us,
        encode_us=round(encode_seconds * 1e6),
        bytes_in=timing.bytes_in,
        bytes_out=bytes_out,
    )
