"""A hostile-message campaign against a live stage worker: it must refuse, not crash, hang or leak.

The tool is the driver of a pipeline: it binds the return endpoint itself, sends N hostile
messages straight into one stage's PULL socket (random bytes; valid messages mutated field by
field with their checksum recomputed so they reach the deeper checks; wrong frame counts, sizes,
senders, codecs, positions, sessions; NaN and Inf activations; control kinds with garbage), and
reads what comes back. Every `--check-every` messages a short greedy generation runs through the
whole pipeline from a fixed prompt; its tokens must equal the first one's. Meanwhile it watches
the workers: exits, silence, tracebacks in their logs, and the fuzzed stage's resident memory.

    python3 -m tools.fuzz_stage                       # 10,000 messages at stage 1 of a tiny 2-stage pipeline
    python3 -m tools.fuzz_stage --target-stage 0 --messages 2000 --seed 7 --json
    python3 -m tools.fuzz_stage --model gemma3-270m-q4_k_m
    python3 -m tools.fuzz_stage --topology topo.toml --stage stage-1 --pid 4242 --worker-log stage-1.log

Exit status: 0 when nothing went wrong, 1 on a crash, hang, traceback or check mismatch, 2 when
the campaign could not start, 130 when interrupted.

Outcomes (docs/PROTOCOL.md §5): *refused* is an Error reply from the fuzzed stage. Its cause is
read from the reply's text, because an Error reply carries no typed cause code (§2.4): the stage
and message prefix is removed and every value is replaced by N, which leaves the stable template
of the check that refused it. The stage's own counters of errors by exception class are reported
beside them. *accepted* is any other reply caused by the message (a token, an Ack, or an Error
from a later stage: the fuzzed stage forwarded it). *no reply* is silence, expected for a
non-final prefill chunk that the final stage ran.

To add a mutation kind, add one row to `MUTATIONS`: a name, a weight, a function that builds
the frames, and a claim about them that tests/tools/test_fuzz_stage.py checks in-process.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import struct
import sys
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import click
import numpy as np
import zmq

from skippy_zmq.config import StageConfig, TopologyConfig
from skippy_zmq.driver.transport import MAX_REPLY_BYTES
from skippy_zmq.errors import ConfigError, SkippyError, WireError
from skippy_zmq.stage.core import check_incoming
from skippy_zmq.telemetry import parse_event
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.wire.codecs import ActivationCodec
from skippy_zmq.wire.frames import ActivationFrame, FrameDesc, GGMLType, PartDesc
from skippy_zmq.wire.messages import (
    MAX_SIDEBAND_VALUES,
    MessageKind,
    StageMessage,
    StateHeader,
    decode_message,
    encode_activation,
    encode_message,
    peek_ids,
)
from skippy_zmq.wire.options import GenerationOptions
from skippy_zmq.wire.replies import Reply, ReplyKind, decode_reply
from skippy_zmq.wire.trace import TraceRecord
from tools._common import (
    EXIT_NOT_STARTED,
    finish,
    interrupt_on_sigterm,
    proc_status_kib,
    progress,
    run_directory,
    tiny_gemma3,
)

Frames = list[bytearray]
"""A message as the fuzzer builds it: one mutable buffer per ZeroMQ frame."""

OPTIONS_SAMPLING_OFFSET = 16
"""Where the sampling record's value starts in an options part: its 8-byte header, the record's 8 (§2.6)."""
HOSTILE_SESSION_POOL = tuple(0x5EED_0000 + k for k in range(4))
"""Session ids the valid-looking messages use, so that some reach open sessions (4 of 8 lanes)."""
CONTROL_BASE = 1 << 62
"""Request and session ids of the fuzzer's own messages (markers, cleanup Stops, checks)."""
MARKER_SESSION = CONTROL_BASE
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 8
BLOCK = 50
"""Hostile messages between two markers: a marker's answer proves the stage still serves."""
FINAL_DRAIN_S = 2.0
SEND_TIMEOUT_MS = 5_000
TRACEBACK = "Traceback (most recent call last)"

# Byte offsets (docs/PROTOCOL.md §2.2 header and sampling settings, §3 descriptor and parts).
HEADER_BYTES, CRC_OFFSET = 84, 80
OFF_KIND, OFF_POS, OFF_COUNT, OFF_REQUEST, OFF_SESSION = 6, 8, 12, 16, 24
OFF_PARTS, OFF_TRACES, OFF_POSITIONS, OFF_STATE = 32, 34, 36, 40
STATE_FIELDS = ("version", "seq_id", "phase", "flags", "driver_incarnation", "prompt_token_count",
                "decode_step", "current_token", "source_stage_index", "activation_codec")
DESC_PRODUCER, DESC_LAYERS, DESC_TOKENS, DESC_SEQS, DESC_PAYLOAD, DESC_PART0 = 4, 8, 16, 20, 24, 32


def state_offset(name: str) -> int:
    """Byte offset of a state field in frame 0."""
    return OFF_STATE + 4 * STATE_FIELDS.index(name)


# --- the fuzzed stage ---------------------------------------------------------------------------


@attrs.frozen
class Target:
    """What a valid message for the fuzzed stage looks like: its sender, upstream range, dimensions."""

    topology: TopologyConfig
    stage: StageConfig
    n_embd: int
    n_vocab: int
    big_frame_bytes: int = 4 << 20

    @classmethod
    def of(cls, topology: TopologyConfig, stage_key: str | int, n_embd: int, n_vocab: int,
           big_frame_bytes: int = 4 << 20) -> Target:
        """The target `stage_key` (id or index) of `topology`, for a model of these dimensions."""
        return cls(topology, topology.stage(stage_key), n_embd, n_vocab, big_frame_bytes)

    @property
    def index(self) -> int:
        """The fuzzed stage's index."""
        return self.stage.index

    @property
    def source(self) -> int:
        """The `source_stage_index` this stage accepts: its upstream's index, or -1 (the driver)."""
        upstream = self.topology.upstream(self.stage)
        return -1 if upstream is None else upstream.index

    @property
    def upstream_layers(self) -> tuple[int, int]:
        """The layer range an incoming activation must carry (stage 0 has none: its own range)."""
        upstream = self.topology.upstream(self.stage) or self.stage
        return upstream.layer_start, upstream.layer_end

    @property
    def codec(self) -> ActivationCodec:
        """The topology's activation codec."""
        return self.topology.activation_codec

    @property
    def frame_limit(self) -> int:
        """The stage's ZMQ_MAXMSGSIZE: libzmq drops a peer that sends a larger frame."""
        from skippy_zmq.stage.worker import max_frame_bytes

        return max_frame_bytes(self.stage.ctx_size, self.n_embd)


# --- valid messages, and the means to break them -------------------------------------------------


def _pick(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _hidden(rng: np.random.Generator, rows: int, n_embd: int) -> np.ndarray:
    return rng.standard_normal((rows, n_embd)).astype(np.float32)  # (T, n_embd)


def _sampling(rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        temperature=float(_pick(rng, (0.0, 0.7, 1.0))), top_k=int(rng.integers(0, 41)),
        top_p=float(_pick(rng, (1.0, 0.9, 0.5))), min_p=float(_pick(rng, (0.0, 0.05))),
        repeat_penalty=float(_pick(rng, (1.0, 1.1, 1.3))), penalty_last_n=int(_pick(rng, (-1, 0, 16, 64))),
        seed=int(rng.integers(0, 2**63)), ignore_eos=bool(rng.integers(2)),
    )


def _options(rng: np.random.Generator, target: Target, session: int, kind: MessageKind) -> GenerationOptions | None:
    """Generation options for ConfigureGeneration (sometimes with logprobs, penalties, a bias, an
    embedding or kept logits) and ForkSession (from another pooled session); None for the others."""
    if kind not in (MessageKind.CONFIGURE_GENERATION, MessageKind.FORK_SESSION):
        return None
    sampling = _sampling(rng)
    if rng.random() < 0.5:
        bias = tuple((int(t), float(_pick(rng, (-100.0, 5.0)))) for t in sorted(set(
            rng.integers(0, target.n_vocab, int(rng.integers(1, 4))).tolist())))
        sampling = attrs.evolve(sampling, presence_penalty=float(_pick(rng, (0.0, 0.5, -2.0))),
                                frequency_penalty=float(_pick(rng, (0.0, 1.0, 2.0))), logit_bias=bias)
    fork_from = None
    if kind is MessageKind.FORK_SESSION:
        fork_from = int(_pick(rng, [s for s in HOSTILE_SESSION_POOL if s != session]))
    return GenerationOptions(
        sampling, logprobs=None if rng.random() < 0.5 else int(rng.integers(0, 21)),
        embedding=None if rng.random() < 0.8 else _pick(rng, list(Pooling)), keep_logits=bool(rng.integers(2)),
        fork_from=fork_from,
    )


def valid_message(
    rng: np.random.Generator, target: Target, request_id: int, *, kind: MessageKind | None = None,
    activation: bool | None = None, codec: ActivationCodec | None = None, hidden: np.ndarray | None = None,
    tokens: Sequence[int] | None = None, session_id: int | None = None,
) -> StageMessage:
    """A well-formed message for the fuzzed stage, on a pooled session; the keywords pin parts of it.

    `activation` forces (or forbids) an activation frame on a compute kind; a stage-0 target then
    gets one from "stage 0" (its checks refuse it). Positions are drawn near the start, so some
    messages continue an open session and are run."""
    kind = kind or _pick(rng, list(MessageKind))
    session = session_id if session_id is not None else int(_pick(rng, HOSTILE_SESSION_POOL))
    source = target.source
    if not kind.carries_tokens:
        count = int(rng.integers(0, 9)) if kind in (MessageKind.TRIM_SESSION, MessageKind.FORK_SESSION) else 0
        options = _options(rng, target, session, kind)
        state = attrs.evolve(StateHeader.for_kind(kind, options=options is not None), source_stage_index=source)
        return StageMessage(kind=kind, pos_start=0, token_count=count, state=state, request_id=request_id,
                            session_id=session, options=options, trace=_trace(target))
    if tokens is None:
        count = _token_count(rng, kind)
        count = hidden.shape[0] if hidden is not None else count
        tokens = rng.integers(0, target.n_vocab, count).tolist()
    ids = np.asarray(tokens, np.int32)
    count = ids.size
    pos = 0 if not kind.decodes and rng.random() < 0.6 else int(rng.integers(0, 17))
    positions = np.arange(pos, pos + count, dtype=np.int32) if rng.random() < 0.5 else np.zeros(0, np.int32)
    encoded = None
    if activation if activation is not None else target.index > 0:
        source = max(source, 0)  # a frame's producer is a stage (>= 0), never the driver
        rows = hidden if hidden is not None else _hidden(rng, count, target.n_embd)
        start, end = target.upstream_layers
        frame = ActivationFrame.from_hidden(rows, producer_stage_index=source, layer_start=start, layer_end=end)
        encoded = encode_activation(codec or target.codec, frame)
    state = attrs.evolve(
        StateHeader.for_kind(kind, prompt_token_count=pos + count,
                             decode_step=1 if kind.decodes else -1,
                             current_token=int(ids[0]) if kind.decodes else -1),
        source_stage_index=source, activation_codec=int(encoded.codec) if encoded is not None else 0,
    )
    return StageMessage(kind=kind, pos_start=pos, token_count=count, state=state, request_id=request_id,
                        session_id=session, tokens=ids, positions=positions, activation=encoded, trace=_trace(target))


def _trace(target: Target) -> tuple[TraceRecord, ...]:
    # One record per stage the message would have passed; fixed times keep a run reproducible.
    at = 1_700_000_000_000_000
    return tuple(TraceRecord(stage_index=i, received_at_us=at, sent_at_us=at + 10) for i in range(target.index))


def to_frames(message: StageMessage) -> Frames:
    """The wire encoding of `message` (docs/PROTOCOL.md §2.3) as mutable copies."""
    return [bytearray(memoryview(buffer)) for buffer in encode_message(message)]


def reseal(frames: Frames) -> Frames:
    """Recompute the header checksum (docs/PROTOCOL.md §2.2) so a mutation passes it and meets the
    checks behind it; frames too broken to carry a checksum are left as they are."""
    if len(frames) < 4 or len(frames[0]) < HEADER_BYTES:
        return frames
    head = frames[0]
    (part_count,) = struct.unpack_from("<H", head, OFF_PARTS)
    descriptor = frames[4] if part_count and len(frames) > 4 else b""
    crc = 0
    for part in (head[:CRC_OFFSET], head[HEADER_BYTES:], frames[1], frames[2], frames[3], descriptor):
        crc = zlib.crc32(part, crc)
    struct.pack_into("<I", head, CRC_OFFSET, crc)
    return frames


def checksum_matches(frames: Sequence[bytes | bytearray]) -> bool:
    """Whether frame 0's checksum matches the frames it covers."""
    if len(frames) < 4 or len(frames[0]) < HEADER_BYTES:
        return False
    copy = [bytearray(f) for f in frames]
    return bytes(reseal(copy)[0]) == bytes(frames[0])


def _poke(frames: Frames, frame: int, fmt: str, offset: int, value: int | float) -> None:
    struct.pack_into(fmt, frames[frame], offset, value)


def _token_count(rng: np.random.Generator, kind: MessageKind) -> int:
    """A valid token count of a compute kind: one for a decode step, a token and 1..3 drafts for a verification."""
    if kind is MessageKind.DECODE_EMBD:
        return 1
    return int(rng.integers(2, 5)) if kind is MessageKind.VERIFY_EMBD else int(rng.integers(1, 5))


def _compute_kind(rng: np.random.Generator) -> MessageKind:
    kind: MessageKind = _pick(rng, (MessageKind.PREFILL_EMBD, MessageKind.PREFILL_FINAL_EMBD, MessageKind.DECODE_EMBD,
                                    MessageKind.VERIFY_EMBD))
    return kind


def _activation_frames(rng: np.random.Generator, target: Target, rid: int, **pins: Any) -> Frames:
    return to_frames(valid_message(rng, target, rid, kind=_compute_kind(rng), activation=True, **pins))


# --- the mutation kinds (one function each; the table is below) ---------------------------------

Maker = Callable[[np.random.Generator, Target, int], Frames]
Claim = Callable[[Sequence[bytes], Target], bool]


def make_valid(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """An unmutated message, so the campaign also sees what acceptance looks like."""
    return to_frames(valid_message(rng, target, rid))


def make_random_bytes(rng: np.random.Generator, _target: Target, _rid: int) -> Frames:
    """1..8 frames of random bytes (0..299 each)."""
    return [bytearray(rng.bytes(int(rng.integers(0, 300)))) for _ in range(int(rng.integers(1, 9)))]


_FIELD_FORMATS = {OFF_POS: "<i", OFF_COUNT: "<i", OFF_PARTS: "<H", OFF_TRACES: "<H", OFF_POSITIONS: "<I",
                  **{state_offset(name): "<i" for name in STATE_FIELDS}}


def make_random_fields(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """1..3 header or state fields set to random values of their width, checksum recomputed."""
    frames = to_frames(valid_message(rng, target, rid))
    for offset in rng.choice(sorted(_FIELD_FORMATS), size=int(rng.integers(1, 4)), replace=False):
        fmt = _FIELD_FORMATS[int(offset)]
        width = struct.calcsize(fmt)
        frames[0][int(offset) : int(offset) + width] = rng.bytes(width)
    return reseal(frames)


def _flip_bytes(rng: np.random.Generator, frames: Frames) -> Frames:
    candidates = [i for i, frame in enumerate(frames) if frame]
    for _ in range(int(rng.integers(1, 5))):
        frame = frames[int(_pick(rng, candidates))]
        at = int(rng.integers(len(frame)))
        frame[at] ^= int(rng.integers(1, 256))
    return frames


def make_flips_resealed(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """1..4 random bytes of any frame flipped, checksum recomputed (reaches the checks behind it)."""
    return reseal(_flip_bytes(rng, to_frames(valid_message(rng, target, rid))))


def make_flips_unsealed(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """1..4 bytes flipped in the checksummed frames (0..3), checksum left stale."""
    frames = to_frames(valid_message(rng, target, rid))
    return _flip_bytes(rng, frames[:4]) + frames[4:]


def make_truncated(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """One non-empty frame cut short, checksum recomputed."""
    frames = to_frames(valid_message(rng, target, rid))
    index = int(_pick(rng, [i for i, frame in enumerate(frames) if frame]))
    del frames[index][int(rng.integers(len(frames[index]))) :]
    return reseal(frames)


def make_missing_frames(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A message with 1..all-but-one of its frames removed."""
    frames = to_frames(valid_message(rng, target, rid))
    keep = sorted(rng.choice(len(frames), size=int(rng.integers(1, len(frames))), replace=False))
    return [frames[int(i)] for i in keep]


def make_extra_frames(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """1..16 random frames appended to a valid message."""
    frames = to_frames(valid_message(rng, target, rid))
    return frames + [bytearray(rng.bytes(int(rng.integers(0, 65)))) for _ in range(int(rng.integers(1, 17)))]


def make_many_frames(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A valid header followed by 1,000..3,999 tiny frames (libzmq bounds frame sizes, not counts)."""
    frames = to_frames(valid_message(rng, target, rid))
    return frames[:1] + [bytearray(rng.bytes(int(rng.integers(0, 5)))) for _ in range(int(rng.integers(1000, 4000)))]


def make_huge_counts(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A compute message declaring a huge part, trace, position or token count; checksum recomputed."""
    frames = to_frames(valid_message(rng, target, rid, kind=_compute_kind(rng)))
    offset, fmt, value = _pick(rng, (
        (OFF_PARTS, "<H", 17), (OFF_PARTS, "<H", 0xFFFF), (OFF_TRACES, "<H", 65), (OFF_TRACES, "<H", 0xFFFF),
        (OFF_POSITIONS, "<I", 2**32 - 1), (OFF_POSITIONS, "<I", MAX_SIDEBAND_VALUES + 1),
        (OFF_COUNT, "<i", 2**31 - 1), (OFF_COUNT, "<i", MAX_SIDEBAND_VALUES + 1), (OFF_COUNT, "<i", -1),
    ))
    _poke(frames, 0, fmt, offset, value)
    return reseal(frames)


def make_huge_dims(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """An activation descriptor declaring huge dims, token count, part count or payload size."""
    frames = _activation_frames(rng, target, rid)
    offset, fmt, value = _pick(rng, (
        (DESC_PART0 + 12, "<I", 2**32 - 1), (DESC_PART0 + 16, "<I", 2**31), (DESC_PART0 + 12, "<I", 2**27),
        (DESC_TOKENS, "<i", 2**31 - 1), (DESC_PAYLOAD, "<Q", 2**63), (DESC_PAYLOAD, "<Q", 2**29 + 4),
        (2, "<H", 16), (DESC_SEQS, "<i", 2**31 - 1),
    ))
    _poke(frames, 4, fmt, offset, value)
    return reseal(frames)


def make_payload_size(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """An activation payload 1..64 bytes longer or shorter than its descriptor says, or empty."""
    frames = _activation_frames(rng, target, rid)
    payload = frames[5]
    delta = int(rng.integers(1, 65))
    if rng.random() < 0.2:
        payload.clear()
    elif rng.random() < 0.5:
        payload.extend(rng.bytes(delta))
    else:
        del payload[max(0, len(payload) - delta) :]
    return reseal(frames)


def make_misaligned_sideband(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """The token or position sideband 1..3 bytes off a multiple of 4; checksum recomputed."""
    frames = to_frames(valid_message(rng, target, rid))
    frames[int(_pick(rng, (2, 3)))].extend(rng.bytes(int(rng.integers(1, 4))))
    return reseal(frames)


def make_big_frame(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A frame of `big_frame_bytes` (4 MiB by default): an oversized token sideband, an extra frame or a payload."""
    size = max(target.big_frame_bytes, 4 * (MAX_SIDEBAND_VALUES + 1))
    variant = int(rng.integers(3))
    frames = _activation_frames(rng, target, rid) if variant == 2 else to_frames(valid_message(rng, target, rid))
    if variant == 0:
        frames[2] = bytearray(size)  # one value past the sideband limit at the default size
    elif variant == 1:
        frames.append(bytearray(size))
    else:
        frames[5] = bytearray(size)
    return reseal(frames)


def make_wrong_source(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A `source_stage_index` other than the upstream's (the frame's producer agrees with it)."""
    frames = to_frames(valid_message(rng, target, rid))
    stages = len(target.topology.stages)
    candidates = [v for v in (-2, -1, *range(stages + 1), 2**31 - 1, -(2**31)) if v != target.source]
    value = int(_pick(rng, candidates))
    _poke(frames, 0, "<i", state_offset("source_stage_index"), value)
    if len(frames) > 4 and value >= 0:
        _poke(frames, 4, "<i", DESC_PRODUCER, value)
    return reseal(frames)


def make_wrong_codec(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """An activation under a codec the policy does not admit, an unknown codec id, or a mismatched state codec."""
    others = [c for c in ActivationCodec if c is not target.codec]
    variant = int(rng.integers(3))
    if variant == 0:
        return _activation_frames(rng, target, rid, codec=_pick(rng, others))
    frames = _activation_frames(rng, target, rid)
    value = int(_pick(rng, (0, 5, 255, -1))) if variant == 1 else int(_pick(rng, others))
    _poke(frames, 0, "<i", state_offset("activation_codec"), value)
    return reseal(frames)


def make_bad_positions(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A negative or huge `pos_start` (past the context), or a position sideband that is not pos_start.. in order."""
    variant = int(rng.integers(4))
    if variant == 0:
        frames = to_frames(valid_message(rng, target, rid, kind=_compute_kind(rng)))
        _poke(frames, 0, "<i", OFF_POS, int(_pick(rng, (-1, -(2**31), -7))))
        return reseal(frames)
    message = valid_message(rng, target, rid, kind=_compute_kind(rng))
    if variant == 1:
        pos = int(_pick(rng, (target.stage.ctx_size, 2**31 - 1 - message.token_count, 10**6)))
        return to_frames(attrs.evolve(message, pos_start=pos, positions=np.zeros(0, np.int32)))
    count = message.token_count
    if variant == 2:
        wrong = np.arange(message.pos_start, message.pos_start + count, dtype=np.int32)[::-1] + int(rng.integers(1, 9))
        return to_frames(attrs.evolve(message, positions=wrong))
    frames = to_frames(message)
    frames[3] = bytearray(rng.integers(-(2**31), 2**31, count + 1, dtype=np.int64).astype("<i4").tobytes())
    _poke(frames, 0, "<I", OFF_POSITIONS, count + 1)
    return reseal(frames)


def make_nonfinite(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """An activation holding NaN, +Inf, -Inf or 3e38 values (in one value or everywhere)."""
    kind = _compute_kind(rng)
    count = _token_count(rng, kind)
    hidden = _hidden(rng, count, target.n_embd)
    value = float(_pick(rng, (np.nan, np.inf, -np.inf, 3e38)))
    if rng.random() < 0.5:
        hidden[int(rng.integers(count)), int(rng.integers(target.n_embd))] = value
    else:
        hidden[:] = value
    return to_frames(valid_message(rng, target, rid, kind=kind, activation=True, hidden=hidden))


def make_foreign_session(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A valid message for a session never opened here: 0, 2**64-1 or a random id."""
    high = int(rng.integers(2**63, 2**64, dtype=np.uint64))
    session = int(_pick(rng, (0, 2**64 - 1, int(rng.integers(1, 2**62)), high)))
    return to_frames(valid_message(rng, target, rid, session_id=session))


def make_control_garbage(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A control kind with garbage: bad sampling settings, tokens, positions, an activation, a compute phase."""
    kind = _pick(rng, (MessageKind.CONFIGURE_GENERATION, MessageKind.TRIM_SESSION, MessageKind.STOP))
    frames = to_frames(valid_message(rng, target, rid, kind=MessageKind.CONFIGURE_GENERATION))
    _poke(frames, 0, "<H", OFF_KIND, int(kind))
    variant = int(rng.integers(5))
    if variant == 0:  # sampling record out of range: NaN, negative, reserved bytes, ignore_eos
        offset, fmt, value = _pick(rng, ((0, "<f", np.nan), (0, "<f", -1.0), (0, "<f", np.inf), (8, "<f", 0.0),
                                         (8, "<f", 2.0), (12, "<f", -1.0), (16, "<f", 0.0), (16, "<f", np.nan),
                                         (20, "<i", -5), (4, "<i", -3), (32, "<B", 7), (33, "<B", 1)))
        _poke(frames, 1, fmt, OPTIONS_SAMPLING_OFFSET + offset, value)
        if rng.random() < 0.3:  # or the options part's own framing: magic, version, count, tag, flags, length
            offset, fmt, value = _pick(rng, ((0, "<B", 0), (4, "<H", 2), (6, "<H", 40), (6, "<H", 0), (8, "<H", 99),
                                             (10, "<H", 6), (12, "<I", 1 << 20), (12, "<I", 35)))
            _poke(frames, 1, fmt, offset, value)
    elif variant == 1:  # sampling frame without the SAMPLING flag, or neither for ConfigureGeneration
        _poke(frames, 0, "<i", state_offset("flags"), 0)
        if rng.random() < 0.5:
            frames[1].clear()
            _poke(frames, 0, "<i", state_offset("flags"), 1 << 3)
    elif variant == 2:  # tokens (and a token count) on a kind that carries none
        frames[1].clear()
        _poke(frames, 0, "<i", state_offset("flags"), 0)
        count = int(rng.integers(1, 5))
        frames[2] = bytearray(np.arange(count, dtype="<i4").tobytes())
        frames[3] = bytearray(np.arange(count, dtype="<i4").tobytes()) if rng.random() < 0.5 else bytearray()
        _poke(frames, 0, "<i", OFF_COUNT, count if kind is not MessageKind.TRIM_SESSION else -count)
        _poke(frames, 0, "<I", OFF_POSITIONS, len(frames[3]) // 4)
    elif variant == 3:  # an activation frame attached
        activation = _activation_frames(rng, target, rid)
        frames += activation[4:]
        _poke(frames, 0, "<H", OFF_PARTS, len(activation) - 5)
        _poke(frames, 0, "<i", state_offset("activation_codec"), int(target.codec))
    else:  # a compute phase on a control kind
        _poke(frames, 0, "<i", state_offset("phase"), int(_pick(rng, (1, 2, 7))))
    return reseal(frames)


def make_bad_kind_state(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """An unknown kind id, wire version or state version, a phase or flags that disagree with the kind."""
    message = valid_message(rng, target, rid)
    frames = to_frames(message)
    flags = message.state.flags
    offset, fmt, value = _pick(rng, (
        (OFF_KIND, "<H", int(_pick(rng, (0, 5, 7, 13, 15, 20, 0xFFFF)))), (4, "<H", int(_pick(rng, (0, 2, 0xFFFF)))),
        (state_offset("version"), "<i", int(_pick(rng, (0, 2, -1)))),
        (state_offset("phase"), "<i", (message.kind.phase + 1) % 3),
        (state_offset("flags"), "<I", flags | int(_pick(rng, (1 << 1, 1 << 2, 1 << 31)))),
        (state_offset("flags"), "<I", flags ^ 1),
    ))
    _poke(frames, 0, fmt, offset, value)
    return reseal(frames)


def make_bad_token_ids(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A compute message whose token ids fall outside [0, n_vocab)."""
    kind = _compute_kind(rng)
    count = _token_count(rng, kind)
    ids = rng.integers(0, target.n_vocab, count)
    ids[int(rng.integers(count))] = int(_pick(rng, (-1, target.n_vocab, 2**31 - 1, -(2**31))))
    return to_frames(valid_message(rng, target, rid, kind=kind, tokens=ids.tolist()))


def make_trace_garbage(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """1..65 trace records of random bytes, or a trace count that disagrees with frame 0's size."""
    frames = to_frames(valid_message(rng, target, rid))
    count = int(rng.integers(1, 66))
    del frames[0][HEADER_BYTES:]
    frames[0].extend(rng.bytes(56 * count))
    declared = count if rng.random() < 0.7 else count + int(_pick(rng, (-1, 1)))
    _poke(frames, 0, "<H", OFF_TRACES, declared)
    return reseal(frames)


def make_activation_shape(rng: np.random.Generator, target: Target, rid: int) -> Frames:
    """A well-formed activation of the wrong layout: layers, rank, token axis, width, sequences or a required part."""
    message = valid_message(rng, target, rid, kind=_compute_kind(rng), activation=True)
    assert message.activation is not None
    desc, count = message.activation.desc, message.token_count
    primary = desc.parts[0]
    variant = int(rng.integers(5))
    parts, arrays = [primary], [_hidden(rng, count, target.n_embd)]
    layers, sequences = (desc.layer_start, desc.layer_end), 1
    if variant == 0:
        layers = _pick(rng, ((desc.layer_start + 1, desc.layer_end + 1), (0, desc.layer_end + 5), (0, 1)))
    elif variant == 1:  # rank 3, or the token axis first
        dims = (target.n_embd, count, 1) if rng.random() < 0.5 else (count, target.n_embd)
        parts = [PartDesc(0, GGMLType.F32, dims, token_axis=1 if len(dims) == 3 else 0)]
        arrays = [_hidden(rng, count, target.n_embd).reshape(tuple(reversed(dims)))]
    elif variant == 2:  # a different width
        width = target.n_embd + int(_pick(rng, (-8, 8, 1)))
        parts, arrays = [PartDesc(0, GGMLType.F32, (width, count), token_axis=1)], [_hidden(rng, count, width)]
    elif variant == 3:
        sequences = 2
    else:  # a second part the stage cannot use, not marked OPTIONAL
        parts.append(PartDesc(7, GGMLType.I32, (count,), token_axis=0))
        arrays.append(np.zeros(count, np.int32))
    frame = ActivationFrame(FrameDesc(desc.producer_stage_index, layers[0], layers[1], count, tuple(parts),
                                      sequence_count=sequences), tuple(arrays))
    return to_frames(attrs.evolve(message, activation=encode_activation(target.codec, frame)))


# --- claims: what a row's frames are, checked in-process by the tests ---------------------------


def decoded(frames: Sequence[bytes]) -> StageMessage | None:
    """The message the frames decode to, or None when the wire checks refuse them."""
    try:
        return decode_message(frames)
    except SkippyError:
        return None


def admitted(message: StageMessage, target: Target) -> bool:
    """Whether the stage's admission checks (docs/PROTOCOL.md §5, checks 2-10) let `message` in."""
    try:
        check_incoming(target.topology, target.stage, message)
    except SkippyError:
        return False
    return True


def refused_before_compute(frames: Sequence[bytes], target: Target) -> bool:
    """Whether decoding or admission refuses the frames (no layer would run)."""
    message = decoded(frames)
    return message is None or not admitted(message, target)


def _undecodable(frames: Sequence[bytes], _target: Target) -> bool:
    return decoded(frames) is None


def _nonfinite(frames: Sequence[bytes], _target: Target) -> bool:
    message = decoded(frames)
    if message is None or message.activation is None:
        return False
    hidden = message.activation.decode().hidden
    return bool(not np.isfinite(hidden).all() or np.abs(hidden).max() >= 1e38)


def _activation_misfit(frames: Sequence[bytes], target: Target) -> bool:
    message = decoded(frames)
    if message is None or message.activation is None:
        return False
    return not admitted(message, target) or message.activation.desc.parts[0].dims[0] != target.n_embd


def _control_kind(frames: Sequence[bytes]) -> bool:
    kind = peek_ids(frames)[2]
    return kind is not None and not kind.carries_tokens


def _tokens_outside_vocab(frames: Sequence[bytes], target: Target) -> bool:
    message = decoded(frames)
    return message is not None and bool(((message.tokens < 0) | (message.tokens >= target.n_vocab)).any())


def _positions_refused(frames: Sequence[bytes], target: Target) -> bool:
    message = decoded(frames)
    past_context = message is not None and message.pos_start >= target.stage.ctx_size
    return past_context or refused_before_compute(frames, target)


@attrs.frozen
class Mutation:
    """One kind of hostile message: its name, how often it is drawn, how it is built, what it claims."""

    name: str
    weight: float
    make: Maker
    claim: Claim

    @property
    def about(self) -> str:
        """What the kind sends (the first line of its maker's docstring)."""
        return (self.make.__doc__ or self.name).strip().splitlines()[0]


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("valid", 4, make_valid, lambda f, t: (m := decoded(f)) is not None and admitted(m, t)),
    Mutation("random_bytes", 6, make_random_bytes, _undecodable),
    Mutation("random_fields_resealed", 6, make_random_fields, lambda f, _t: checksum_matches(f)),
    Mutation("byte_flips_resealed", 8, make_flips_resealed, lambda f, _t: checksum_matches(f)),
    Mutation("byte_flips_unsealed", 3, make_flips_unsealed,
             lambda f, t: not checksum_matches(f) and _undecodable(f, t)),
    Mutation("truncated_frame", 3, make_truncated, _undecodable),
    Mutation("missing_frames", 3, make_missing_frames, _undecodable),
    Mutation("extra_frames", 3, make_extra_frames, _undecodable),
    Mutation("many_frames", 1, make_many_frames, lambda f, t: len(f) >= 1000 and _undecodable(f, t)),
    Mutation("huge_declared_counts", 4, make_huge_counts, _undecodable),
    Mutation("huge_declared_dims", 4, make_huge_dims, refused_before_compute),
    Mutation("payload_wrong_size", 4, make_payload_size, _undecodable),
    Mutation("sideband_misaligned", 2, make_misaligned_sideband, _undecodable),
    Mutation("big_frame", 0.3, make_big_frame, lambda f, t: max(map(len, f)) >= 4 << 20 and _undecodable(f, t)),
    Mutation("wrong_source_stage", 5, make_wrong_source, refused_before_compute),
    Mutation("wrong_codec", 4, make_wrong_codec, refused_before_compute),
    Mutation("bad_positions", 5, make_bad_positions, _positions_refused),
    Mutation("nonfinite_activation", 5, make_nonfinite, _nonfinite),
    Mutation("foreign_session", 4, make_foreign_session,
             lambda f, _t: (m := decoded(f)) is not None and m.session_id not in HOSTILE_SESSION_POOL),
    Mutation("control_garbage", 5, make_control_garbage, lambda f, t: _control_kind(f) and _undecodable(f, t)),
    Mutation("bad_kind_or_state", 4, make_bad_kind_state, _undecodable),
    Mutation("token_ids_outside_vocab", 3, make_bad_token_ids, _tokens_outside_vocab),
    Mutation("trace_garbage", 2, make_trace_garbage, lambda f, _t: len(f[0]) > HEADER_BYTES),
    Mutation("activation_wrong_layout", 3, make_activation_shape, _activation_misfit),
)
"""The campaign's table: one row per kind of hostile message."""


def schedule(rng: np.random.Generator, count: int, table: Sequence[Mutation] = MUTATIONS) -> Iterator[Mutation]:
    """`count` kinds to send: every row once first (so even a short run covers the table), then drawn by weight."""
    weights = np.array([row.weight for row in table], dtype=np.float64)
    for index in range(count):
        yield table[index] if index < len(table) else table[int(rng.choice(len(table), p=weights / weights.sum()))]


# --- outcomes ------------------------------------------------------------------------------------

REFUSED, ACCEPTED, NO_REPLY = "refused", "accepted", "no_reply"
_STAGE_PREFIX = re.compile(r'^stage -?\d+ "[^"]*" \(layers -?\d+\.\.-?\d+\): ')
_MESSAGE_PREFIX = re.compile(r"^(?:rejected message \(request \d+ session \d+\)|request \d+ session \d+ \([A-Z_]+\)): ")
_VALUE_PATTERNS = (
    (re.compile(r"""b?'(?:[^'\\]|\\.)*'|b?"(?:[^"\\]|\\.)*\""""), "'…'"),
    (re.compile(r"\[[^\]]*\]"), "[…]"),
    (re.compile(r"(?<!\w)-?(?:0x[0-9a-fA-F]+|\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|inf)(?!\w)"), "N"),
)
MAX_CAUSE_CHARS = 140


def error_cause(text: str) -> str:
    """The stable template of an Error reply's text: stage and message prefix removed, values as N.

    `stage 1 "stage-1" (layers 4..7): rejected message (request 9 session 3): stage message has 2
    frames; expected at least 4` becomes `stage message has N frames; expected at least N`.
    """
    cause = _MESSAGE_PREFIX.sub("", _STAGE_PREFIX.sub("", text.strip(), count=1), count=1)
    for pattern, replacement in _VALUE_PATTERNS:
        cause = pattern.sub(replacement, cause)
    return cause[:MAX_CAUSE_CHARS] or "(empty error text)"


@attrs.frozen
class Outcome:
    """What became of one hostile message: refused (with its cause), accepted (how) or no reply."""

    category: str
    detail: str

    @classmethod
    def of_reply(cls, reply: Reply, target_index: int) -> Outcome:
        """Classify the reply a hostile message caused (docs/PROTOCOL.md §2.4: kind and stage index)."""
        if reply.kind is not ReplyKind.ERROR:
            return cls(ACCEPTED, reply.kind.name)
        cause = error_cause(reply.error)
        if reply.stage_index > target_index:  # the fuzzed stage took it and passed it on
            return cls(ACCEPTED, f"forwarded, then refused by stage {reply.stage_index}: {cause}")
        if reply.stage_index < target_index:  # cannot happen: nothing was sent to that stage
            return cls(REFUSED, f"(stage {reply.stage_index}) {cause}")
        return cls(REFUSED, cause)

    @classmethod
    def silent(cls, kind: MessageKind | None) -> Outcome:
        """No reply at all; `kind` is what the header claimed."""
        return cls(NO_REPLY, kind.name if kind is not None else "unreadable kind")


    @classmethod
    def dropped(cls, frame_limit: int) -> Outcome:
        """No reply to a message with a frame over the PULL socket's ZMQ_MAXMSGSIZE: libzmq dropped the
        connection before the stage saw it (docs/PROTOCOL.md §2.5). Inferred from the size, not read."""
        return cls(REFUSED, f"(no reply) a frame over ZMQ_MAXMSGSIZE ({frame_limit} bytes): libzmq dropped the "
                            "connection")


@attrs.define
class _Sent:
    mutation: str
    kind: MessageKind | None
    largest_frame: int
    outcome: Outcome | None = None


class Ledger:
    """Hostile messages sent and their outcomes; replies are matched by the ids a stage echoes.

    A stage answers with the request and session id it could read from the header (0 and 0 when
    it could read none, docs/PROTOCOL.md §5), so messages are keyed by `peek_ids` of their frames
    and a key's messages are answered in the order they were sent."""

    def __init__(self, target_index: int, frame_limit: int | None = None) -> None:
        self.target_index = target_index
        self.frame_limit = frame_limit
        self.sent: list[_Sent] = []
        self.unmatched = 0
        self._pending: dict[tuple[int, int], deque[int]] = {}
        self._sessions: set[int] = set()

    def record(self, mutation: str, frames: Sequence[bytes]) -> None:
        """Note a message handed to ZeroMQ."""
        request_id, session_id, kind = peek_ids(frames)
        self.sent.append(_Sent(mutation, kind, max((len(frame) for frame in frames), default=0)))
        self._pending.setdefault((request_id, session_id), deque()).append(len(self.sent) - 1)
        self._sessions.add(session_id)

    def resolve(self, reply: Reply) -> bool:
        """Match a reply to the oldest unanswered message with its ids; False when none waits."""
        waiting = self._pending.get((reply.request_id, reply.session_id))
        if not waiting:
            self.unmatched += 1
            return False
        self.sent[waiting.popleft()].outcome = Outcome.of_reply(reply, self.target_index)
        return True

    def take_sessions(self) -> set[int]:
        """Session ids used since the last call (their Stops free whatever lanes they took)."""
        sessions, self._sessions = self._sessions, set()
        return sessions

    def outcomes(self) -> list[tuple[str, Outcome]]:
        """(mutation, outcome) of every message; unanswered ones are no-reply, or dropped by libzmq."""
        return [(s.mutation, s.outcome or self._unanswered(s)) for s in self.sent]

    def _unanswered(self, sent: _Sent) -> Outcome:
        if self.frame_limit is not None and sent.largest_frame > self.frame_limit:
            return Outcome.dropped(self.frame_limit)
        return Outcome.silent(sent.kind)

    def tally(self) -> dict[str, Any]:
        """Counts by category, by cause or detail, and by mutation."""
        by_category: dict[str, Counter[str]] = {REFUSED: Counter(), ACCEPTED: Counter(), NO_REPLY: Counter()}
        by_mutation: dict[str, Counter[str]] = {}
        for mutation, outcome in self.outcomes():
            by_category[outcome.category][outcome.detail] += 1
            by_mutation.setdefault(mutation, Counter())[outcome.category] += 1
        return {
            "sent": len(self.sent),
            **{category: sum(counts.values()) for category, counts in by_category.items()},
            "refused_by_cause": dict(by_category[REFUSED].most_common()),
            "accepted_by": dict(by_category[ACCEPTED].most_common()),
            "no_reply_by_kind": dict(by_category[NO_REPLY].most_common()),
            "by_mutation": {name: {"sent": sum(c.values()), **{k: c[k] for k in (REFUSED, ACCEPTED, NO_REPLY)}}
                            for name, c in sorted(by_mutation.items())},
            "internal_errors": sum(n for cause, n in by_category[REFUSED].items()
                                   if cause.startswith("internal error")),
            "unmatched_replies": self.unmatched,
        }


# --- watching the workers ------------------------------------------------------------------------


class LogWatch:
    """Reads the workers' stderr as it passes (a LocalPipeline log sink) or as it grows in a file:
    tracebacks, lines that are not JSON events, `fatal` events, the fuzzed stage's counters at exit."""

    def __init__(self, target_stage_id: str, copy_to: Path | None = None) -> None:
        self.target_stage_id = target_stage_id
        self.tracebacks = 0
        self.traceback_excerpt: list[str] = []
        self.non_json_lines = 0
        self.non_json_samples: list[str] = []
        self.fatal: list[str] = []
        self.exit_counts: dict[str, int] | None = None
        self._capture = 0
        self._lock = threading.Lock()
        self._copy = copy_to.open("a", encoding="utf-8") if copy_to is not None else None
        self._follow: tuple[Path, int] | None = None

    def write(self, text: str) -> int:
        """Take lines from a worker's relay thread (the LocalPipeline sink interface)."""
        with self._lock:
            if self._copy is not None:
                self._copy.write(text)
            for line in text.splitlines():
                self._read(line)
        return len(text)

    def flush(self) -> None:
        """Flush the copy on disk."""
        with self._lock:
            if self._copy is not None:
                self._copy.flush()

    def follow(self, path: Path) -> None:
        """Watch a worker's log file from its current end (a worker this tool did not start)."""
        self._follow = (path, path.stat().st_size)

    def poll(self) -> None:
        """Read what a followed file gained since the last poll."""
        if self._follow is None:
            return
        path, offset = self._follow
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._follow = (path, offset + len(complete))
        self.write(complete.decode("utf-8", "replace"))

    def close(self) -> None:
        """Close the copy on disk."""
        with self._lock:
            if self._copy is not None:
                self._copy.close()
                self._copy = None

    def _read(self, line: str) -> None:
        if self._capture:  # the first traceback, up to its exception line (the first unindented one)
            self.traceback_excerpt.append(line)
            self._capture = self._capture - 1 if line.startswith((" ", "\t")) else 0
        if line.startswith(TRACEBACK):
            self.tracebacks += 1
            if not self.traceback_excerpt:
                self.traceback_excerpt.append(line)
                self._capture = 40
        event = parse_event(line)
        if event is None:
            if line.strip():
                self.non_json_lines += 1
                if len(self.non_json_samples) < 3:
                    self.non_json_samples.append(line[:300])
        elif event.get("event") == "fatal":
            self.fatal.append(str(event.get("error")))
        elif event.get("event") == "stopped" and event.get("component") == self.target_stage_id:
            counts = event.get("counts")
            self.exit_counts = dict(counts) if isinstance(counts, dict) else None


@attrs.define
class Worker:
    """One worker process under watch: whether it exited (a crash), and its memory from /proc."""

    name: str
    pid: int
    process: Any = None  # skippy_zmq.launch.StageProcess when this tool started it

    def exited(self) -> str | None:
        """How the worker ended, or None while it runs."""
        if self.process is not None:
            return self.process.describe_exit() if self.process.exit_code() is not None else None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return f"{self.name} (pid {self.pid}) is gone"
        except PermissionError:
            pass  # alive, owned by someone else
        return None

    def memory_kib(self, field: str = "VmRSS") -> int | None:
        """A /proc/PID/status memory field (VmRSS, VmHWM, RssAnon) in KiB; None when unreadable."""
        return proc_status_kib(self.pid, field)


# --- the fuzzer's sockets ------------------------------------------------------------------------


class Link:
    """The driver's sockets: the return PULL (bound here), a PUSH to the fuzzed stage, one to stage 0.

    Replies are routed as they arrive: heartbeats note the sender's liveness, answers to the
    fuzzer's own messages wait in a mailbox, everything else goes to the ledger."""

    def __init__(self, topology: TopologyConfig, target: Target, ledger: Ledger) -> None:
        self.ledger = ledger
        self.last_beat: dict[int, float] = {}
        self.bad_replies = 0
        self._ids = itertools.count(CONTROL_BASE + 1)
        self._awaited: set[int] = set()
        self._answers: dict[int, Reply] = {}
        self._context: zmq.Context[Any] = zmq.Context()
        self.returns = self._context.socket(zmq.PULL)
        self.returns.setsockopt(zmq.LINGER, 0)
        self.returns.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
        self.to_target = self._push(target.stage.pull_connect)
        self.to_stage0 = self._push(topology.stages[0].pull_connect)
        try:
            self.returns.bind(topology.driver.return_bind)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"cannot bind the driver's return endpoint {topology.driver.return_bind!r} "
                              f"(is another driver running?): {exc}") from None

    def _push(self, endpoint: str) -> zmq.Socket[Any]:
        socket: zmq.Socket[Any] = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        socket.connect(endpoint)
        return socket

    def close(self) -> None:
        """Close every socket without lingering."""
        for socket in (self.returns, getattr(self, "to_target", None), getattr(self, "to_stage0", None)):
            if socket is not None and not socket.closed:
                socket.close(linger=0)
        self._context.term()

    def new_id(self) -> int:
        """A request id for one of the fuzzer's own messages; its answer will wait in the mailbox."""
        request_id = next(self._ids)
        self._awaited.add(request_id)
        return request_id

    def send(self, socket: zmq.Socket[Any], frames: Sequence[Any]) -> bool:
        """Send within SEND_TIMEOUT_MS; False when the stage would not take it."""
        try:
            socket.send_multipart(list(frames), copy=False)
        except zmq.Again:
            return False
        return True

    def pump(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for replies, then route every queued one."""
        if not self.returns.poll(max(0, round(timeout_s * 1000))):
            return
        while True:
            try:
                frames = self.returns.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = decode_reply_frames(frames)
            except WireError:
                self.bad_replies += 1  # a stage sent something its own driver cannot read
                continue
            if reply.is_heartbeat:
                self.last_beat[reply.stage_index] = time.monotonic()
            elif reply.request_id in self._awaited:
                self._awaited.discard(reply.request_id)
                self._answers[reply.request_id] = reply
            else:
                self.ledger.resolve(reply)

    def wait(self, request_ids: Sequence[int], timeout_s: float, alive: Callable[[], bool]) -> dict[int, Reply]:
        """The answers to `request_ids` that arrive within `timeout_s` (stops early when a worker dies)."""
        deadline = time.monotonic() + timeout_s
        wanted = set(request_ids)
        while not wanted <= self._answers.keys() and time.monotonic() < deadline and alive():
            self.pump(min(0.1, max(0.0, deadline - time.monotonic())))
        return {rid: self._answers.pop(rid) for rid in wanted if rid in self._answers}


def decode_reply_frames(frames: Sequence[Any]) -> Reply:
    """Decode a received reply (zmq.Frame objects or buffers)."""
    return decode_reply([getattr(frame, "buffer", frame) for frame in frames])


# --- check generations ---------------------------------------------------------------------------


@attrs.frozen
class CheckResult:
    """One greedy generation through the whole pipeline: its tokens, or why it failed."""

    tokens: tuple[int, ...]
    error: str | None = None
    timed_out: bool = False


def _control(kind: MessageKind, request_id: int, session_id: int, source: int = -1,
             sampling: SamplingParams | None = None) -> StageMessage:
    options = None if sampling is None else GenerationOptions(sampling)
    state = attrs.evolve(StateHeader.for_kind(kind, options=options is not None), source_stage_index=source)
    return StageMessage(kind=kind, pos_start=0, token_count=0, state=state, request_id=request_id,
                        session_id=session_id, options=options)


def _compute(kind: MessageKind, request_id: int, session_id: int, pos: int, tokens: Sequence[int],
             prompt_count: int, step: int) -> StageMessage:
    state = StateHeader.for_kind(kind, prompt_token_count=prompt_count, decode_step=step,
                                 current_token=tokens[-1] if step > 0 else -1)
    return StageMessage(kind=kind, pos_start=pos, token_count=len(tokens), state=state, request_id=request_id,
                        session_id=session_id, tokens=np.asarray(tokens, np.int32))


def check_generation(link: Link, prompt: Sequence[int], session_id: int, max_tokens: int, timeout_s: float,
                     alive: Callable[[], bool]) -> CheckResult:
    """ConfigureGeneration (greedy, ignore_eos), one prefill, `max_tokens` - 1 decode steps, Stop:
    each through stage 0 and answered within `timeout_s` (docs/PROTOCOL.md §6)."""
    tokens: list[int] = []

    def ask(message_of: Callable[[int], StageMessage]) -> Reply | CheckResult:
        request_id = link.new_id()
        message = message_of(request_id)
        if not link.send(link.to_stage0, encode_message(message)):
            return CheckResult(tuple(tokens), f"stage 0 did not take {message.kind.name} within "
                               f"{SEND_TIMEOUT_MS / 1000:g} s", timed_out=True)
        reply = link.wait([request_id], timeout_s, alive).get(request_id)
        if reply is None:
            return CheckResult(tuple(tokens), f"no answer to {message.kind.name} within {timeout_s:g} s",
                               timed_out=alive())
        if reply.kind is ReplyKind.ERROR:
            return CheckResult(tuple(tokens), f"{message.kind.name} failed: {reply.error}")
        return reply

    def step_message(step: int, request_id: int) -> StageMessage:
        if step == 0:
            return _compute(MessageKind.PREFILL_FINAL_EMBD, request_id, session_id, 0, prompt, len(prompt), -1)
        return _compute(MessageKind.DECODE_EMBD, request_id, session_id, len(prompt) + step - 1, tokens[-1:],
                        len(prompt), step)

    greedy = SamplingParams(ignore_eos=True)
    answer = ask(lambda rid: _control(MessageKind.CONFIGURE_GENERATION, rid, session_id, sampling=greedy))
    for step in range(max_tokens):
        if isinstance(answer, CheckResult):
            return answer
        answer = ask(functools.partial(step_message, step))
        if isinstance(answer, Reply):
            tokens.append(answer.predicted_token)
    if isinstance(answer, CheckResult):
        return answer
    stopped = ask(lambda rid: _control(MessageKind.STOP, rid, session_id))
    return stopped if isinstance(stopped, CheckResult) else CheckResult(tuple(tokens))


# --- the campaign --------------------------------------------------------------------------------


@attrs.frozen
class CampaignOptions:
    """How many messages, how often to check, which seed, how long a silence is a hang."""

    messages: int = 10_000
    check_every: int = 500
    seed: int = 0
    hang_timeout_s: float = 30.0
    check_tokens: int = CHECK_TOKENS


class Campaign:
    """Sends the hostile messages in blocks of BLOCK; after each block a marker Stop must be answered
    (the stage still serves), the sessions the block used are stopped (their lanes freed), and every
    `check_every` messages a check generation runs. A crash or hang ends the campaign."""

    def __init__(self, target: Target, link: Link, ledger: Ledger, workers: Sequence[Worker], logs: LogWatch,
                 prompt: Sequence[int], options: CampaignOptions, *, dump_dir: Path | None = None,
                 say: Callable[[str], None] = lambda _text: None) -> None:
        self.target, self.link, self.ledger, self.logs = target, link, ledger, logs
        self.workers = list(workers)
        self.prompt = list(prompt)
        self.options = options
        self.dump_dir = dump_dir
        self.say = say
        self.crashes: list[str] = []
        self.hangs: list[str] = []
        self.dumps: list[str] = []
        self.checks: list[CheckResult] = []
        self.send_timeouts = 0
        # RssAnon apart from VmRSS: mapped weight pages first touched count in RSS, but are no leak.
        self.rss_kib: dict[str, int | None] = dict.fromkeys(("before", "after", "peak", "anon_before", "anon_after"))
        self.interrupted = False
        self.wall_s = 0.0
        self._tracebacks_seen = 0
        self._check_sessions = itertools.count(CONTROL_BASE + (1 << 40))

    def alive(self) -> bool:
        """Whether every watched worker still runs."""
        return not any(worker.exited() for worker in self.workers)

    def _memory(self, field: str) -> int | None:
        worker = next((w for w in self.workers if w.name == self.target.stage.stage_id), None)
        return worker.memory_kib(field) if worker is not None else None

    def run(self) -> None:
        """The whole campaign: a reference check, the messages, a final drain and check."""
        started = time.monotonic()
        try:
            if self._check(0):
                self.rss_kib["before"] = self._memory("VmRSS")
                self.rss_kib["anon_before"] = self._memory("RssAnon")
                if self._fuzz():
                    self._finish()
        except KeyboardInterrupt:
            self.interrupted = True
        finally:
            self.wall_s = time.monotonic() - started
            self.rss_kib["after"] = self._memory("VmRSS")
            self.rss_kib["peak"] = self._memory("VmHWM")
            self.rss_kib["anon_after"] = self._memory("RssAnon")
            self.logs.poll()

    def _fuzz(self) -> bool:
        rng = np.random.default_rng(self.options.seed)
        total = self.options.messages
        block: list[tuple[int, str, list[bytes]]] = []
        for number, mutation in enumerate(schedule(rng, total), start=1):
            frames = [bytes(frame) for frame in mutation.make(rng, self.target, number)]
            if self.link.send(self.link.to_target, frames):
                self.ledger.record(mutation.name, frames)
            else:
                self.send_timeouts += 1
            block.append((number, mutation.name, frames))
            self.link.pump(0)
            if number % BLOCK and number != total:
                continue
            if not self._settle(number, block):
                return False
            block = []
            if number % self.options.check_every == 0 and not self._check(number):
                return False
        return True

    def _finish(self) -> None:
        deadline = time.monotonic() + FINAL_DRAIN_S
        while time.monotonic() < deadline:
            self.link.pump(0.1)
        if self.options.messages % self.options.check_every:
            self._check(self.options.messages)

    def _settle(self, number: int, block: list[tuple[int, str, list[bytes]]]) -> bool:
        """After a block: no worker dead, a marker answered, a recent heartbeat, the block's sessions stopped."""
        self.logs.poll()
        if self._crashed(number, block):
            return False
        timeout = self.options.hang_timeout_s
        request_id = self.link.new_id()
        marker = _control(MessageKind.STOP, request_id, MARKER_SESSION, source=self.target.source)
        answered = self.link.send(self.link.to_target, encode_message(marker)) and bool(
            self.link.wait([request_id], timeout, self.alive))
        if not answered:
            if not self._crashed(number, block):
                self._hang(f"{self.target.stage.label} did not answer a marker Stop within {timeout:g} s "
                           f"after message {number}", number, block)
            return False
        beat = self.link.last_beat.get(self.target.index)
        if beat is None or time.monotonic() - beat > timeout:
            self._hang(f"{self.target.stage.label}: no heartbeat for more than {timeout:g} s "
                       f"(after message {number})", number, block)
            return False
        if not self._stop_sessions(self.ledger.take_sessions() - {MARKER_SESSION}):
            self._hang(f"Stops for the sessions of messages up to {number} were not answered within "
                       f"{timeout:g} s", number, block)
            return False
        if self.logs.tracebacks > self._tracebacks_seen:
            self._tracebacks_seen = self.logs.tracebacks
            self._dump("traceback", number, block)
        return True

    def _stop_sessions(self, sessions: set[int] | Sequence[int]) -> bool:
        """Stop `sessions` on every stage (through stage 0); True when every Stop is answered."""
        request_ids = []
        for session_id in sorted(sessions):
            request_id = self.link.new_id()
            stop = _control(MessageKind.STOP, request_id, session_id)
            if not self.link.send(self.link.to_stage0, encode_message(stop)):
                return False
            request_ids.append(request_id)
        answers = self.link.wait(request_ids, self.options.hang_timeout_s, self.alive)
        return len(answers) == len(request_ids)

    def _check(self, number: int) -> bool:
        """A check generation (after freeing the pooled sessions' lanes); False on a hang or crash."""
        timeout = self.options.hang_timeout_s
        if not self._stop_sessions(HOSTILE_SESSION_POOL):
            if not self._crashed(number, []):
                self._hang(f"Stops of the pooled sessions were not answered within {timeout:g} s", number, [])
            return False
        result = check_generation(self.link, self.prompt, next(self._check_sessions), self.options.check_tokens,
                                  timeout, self.alive)
        self.checks.append(result)
        if self._crashed(number, []):
            return False
        if result.timed_out:
            self._hang(f"check generation after message {number}: {result.error}", number, [])
            return False
        tally = self.ledger.tally()
        same = "equal" if result.tokens == self.checks[0].tokens and result.error is None else "DIFFERENT"
        rss, anon = self._memory("VmRSS"), self._memory("RssAnon")
        self.say(f"{number:>6}/{self.options.messages} sent: refused {tally[REFUSED]}, accepted {tally[ACCEPTED]}, "
                 f"no reply {tally[NO_REPLY]}; check {len(self.checks)} {same}"
                 + (f"; RSS {rss / 1024:.1f} MiB (anonymous {(anon or 0) / 1024:.1f})" if rss is not None else ""))
        return True

    def _crashed(self, number: int, block: list[tuple[int, str, list[bytes]]]) -> bool:
        dead = [text for worker in self.workers if (text := worker.exited()) is not None]
        if not dead:
            return False
        self.crashes.extend(f"{text} (after message {number})" for text in dead)
        self._dump("crash", number, block)
        return True

    def _hang(self, text: str, number: int, block: list[tuple[int, str, list[bytes]]]) -> None:
        self.hangs.append(text)
        self._dump("hang", number, block)

    def _dump(self, reason: str, number: int, block: list[tuple[int, str, list[bytes]]]) -> None:
        """Write the last block's messages (hex frames) beside the logs, for a reproducer."""
        if self.dump_dir is None:
            return
        path = self.dump_dir / f"{reason}-after-{number}.json"
        messages = [{"number": n, "mutation": name,
                     "frames_hex": [f.hex() if len(f) <= 1 << 20 else {"bytes": len(f), "all_zero": not any(f)}
                                    for f in frames]}
                    for n, name, frames in block]
        path.write_text(json.dumps({"reason": reason, "seed": self.options.seed, "target_stage": self.target.index,
                                    "after_message": number, "messages": messages}) + "\n")
        self.dumps.append(str(path))


# --- the summary ---------------------------------------------------------------------------------

CAUSE_SOURCE = ("Error reply text, stage and message prefix removed, values replaced by N: an Error "
                "reply carries no typed cause code (docs/PROTOCOL.md §2.4)")


def build_report(campaign: Campaign, model: str) -> dict[str, Any]:
    """Everything the campaign measured, as one JSON-ready dict; `ok` is False on any finding."""
    tally = campaign.ledger.tally()
    checks = campaign.checks
    reference = checks[0].tokens if checks and checks[0].error is None else None
    equal = sum(1 for check in checks if reference is not None and check.error is None and check.tokens == reference)
    counts = campaign.logs.exit_counts or {}
    logs = campaign.logs
    report: dict[str, Any] = {
        "target_stage": campaign.target.index,
        "stage": campaign.target.stage.label,
        "model": model,
        "seed": campaign.options.seed,
        "messages_planned": campaign.options.messages,
        **tally,
        "cause_source": CAUSE_SOURCE,
        "errors_by_class": {key.removeprefix("errors."): value for key, value in sorted(counts.items())
                            if key.startswith("errors.")} if counts else None,
        "send_timeouts": campaign.send_timeouts,
        "bad_replies": campaign.link.bad_replies,
        "crashes": len(campaign.crashes),
        "crash_details": campaign.crashes,
        "hangs": len(campaign.hangs),
        "hang_details": campaign.hangs,
        "tracebacks": logs.tracebacks,
        "traceback_excerpt": logs.traceback_excerpt[:40],
        "fatal_events": logs.fatal,
        "non_json_log_lines": logs.non_json_lines,
        "non_json_samples": logs.non_json_samples,
        "rss_kib": dict(campaign.rss_kib),
        "checks": {"run": len(checks), "equal": equal, "tokens": list(reference or ()),
                   "failures": [check.error for check in checks if check.error]},
        "wall_s": round(campaign.wall_s, 1),
        "interrupted": campaign.interrupted,
        "dumps": campaign.dumps,
    }
    report["ok"] = bool(not campaign.crashes and not campaign.hangs and not logs.tracebacks and checks
                        and equal == len(checks))
    return report


def _mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f} MiB"


def render(report: dict[str, Any]) -> str:
    """The human-readable summary."""
    sent, wall = report["sent"], max(report["wall_s"], 1e-9)
    lines = [
        f"fuzz_stage: {report['stage']}, model {report['model']}, seed {report['seed']}",
        f"sent {sent} hostile messages in {report['wall_s']:.1f} s ({sent / wall:.0f}/s)"
        + (" (INTERRUPTED)" if report["interrupted"] else ""),
        f"  refused  {report[REFUSED]:>6}   by cause ({report['cause_source']}):",
        *(f"    {count:>6}  {cause}" for cause, count in report["refused_by_cause"].items()),
        f"  accepted {report[ACCEPTED]:>6}",
        *(f"    {count:>6}  {how}" for how, count in report["accepted_by"].items()),
        f"  no reply {report[NO_REPLY]:>6}   by the kind the header claimed:",
        *(f"    {count:>6}  {kind}" for kind, count in report["no_reply_by_kind"].items()),
        "  by mutation:                 sent  refused accepted no-reply",
        *(f"    {name:<26}{c['sent']:>6} {c[REFUSED]:>8} {c[ACCEPTED]:>8} {c[NO_REPLY]:>8}"
          for name, c in report["by_mutation"].items()),
    ]
    if report["errors_by_class"] is not None:
        classes = ", ".join(f"{name} {count}" for name, count in report["errors_by_class"].items())
        lines.append(f"  the stage's own error counters at exit, by exception class: {classes or 'none'}")
    checks, rss = report["checks"], report["rss_kib"]
    lines += [
        f"internal errors {report['internal_errors']}, unmatched replies {report['unmatched_replies']}, "
        f"undecodable replies {report['bad_replies']}, send timeouts {report['send_timeouts']}",
        f"crashes {report['crashes']}, hangs {report['hangs']}, tracebacks {report['tracebacks']}, "
        f"log lines that are not JSON {report['non_json_log_lines']}",
        *(f"  {detail}" for detail in report["crash_details"] + report["hang_details"]),
        *(f"  | {line}" for line in report["traceback_excerpt"][:20]),
        *(f"  not JSON: {line}" for line in report["non_json_samples"]),
        f"RSS of the fuzzed stage: before {_mib(rss['before'])}, after {_mib(rss['after'])}, "
        f"peak (VmHWM) {_mib(rss['peak'])}; anonymous (RssAnon) before {_mib(rss['anon_before'])}, "
        f"after {_mib(rss['anon_after'])}",
        f"check generations: {checks['run']} run, {checks['equal']} equal (tokens {checks['tokens']})",
        *(f"  check failed: {text}" for text in checks["failures"]),
        *(f"reproducer: {path}" for path in report["dumps"]),
        "result: " + ("OK" if report["ok"] else "FAILED"),
    ]
    return "\n".join(lines)


# --- command line --------------------------------------------------------------------------------


def _start_pipeline(model_path: Path, n_stages: int, directory: Path, logs: LogWatch,
                    say: Callable[[str], None]) -> Any:
    from skippy_zmq.launch.processes import LocalPipeline
    from skippy_zmq.launch.topology import write_local_topology
    from skippy_zmq.model.gguf_model import read_hparams

    n_layer = read_hparams(model_path).n_layer
    path = write_local_topology(str(model_path), n_layer, n_stages, codec="raw-f32-v1", policy="fixed",
                                head_layers=1.0, directory=directory, threads=1)
    pipeline = LocalPipeline(path, log_sink=logs, progress=say, log_json=True)  # type: ignore[arg-type]  # a sink with write/flush
    pipeline.start(ready_timeout_s=300)
    return pipeline


@attrs.frozen
class Setup:
    """A pipeline to fuzz: its topology, the fuzzed stage, the watched workers, the model file."""

    topology: TopologyConfig
    stage_key: str | int
    workers: tuple[Worker, ...]
    model_path: Path
    pipeline: Any = None  # a LocalPipeline this tool started (and must stop)


def _setup(*, topology_path: str | None, stage: str | None, pid: int | None, model: str | None, stages: int,
           target_stage: int, directory: Path, logs: LogWatch, worker_log: str | None,
           say: Callable[[str], None]) -> Setup:
    from skippy_zmq.model.catalog import resolve_model

    if topology_path is not None:
        topology = TopologyConfig.from_toml(topology_path)
        if topology.security.curve:
            raise ConfigError(f"{topology_path}: [security] curve = true; this tool speaks plain ZeroMQ, "
                              "so its messages would never reach the stage")
        key: str | int = int(stage) if stage is not None and stage.isdigit() else stage or target_stage
        name = topology.stage(key).stage_id
        if worker_log is not None:
            logs.follow(Path(worker_log))
        workers: tuple[Worker, ...] = (Worker(name, pid),) if pid is not None else ()
        return Setup(topology, key, workers, resolve_model(topology.model))
    if not 0 <= target_stage < stages:
        raise ConfigError(f"--target-stage {target_stage} must be in 0..{stages - 1}")
    # The tests' tiny Gemma 3: its sliding window of 8 is crossed by the check generation.
    model_path = resolve_model(model) if model is not None else tiny_gemma3(directory)
    pipeline = _start_pipeline(model_path, stages, directory, logs, say)
    workers = tuple(Worker(p.stage_id, p.pid, p) for p in pipeline.processes)
    return Setup(pipeline.topology, target_stage, workers, model_path, pipeline)


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--messages", "-n", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="Hostile messages to send.")
@click.option("--check-every", type=click.IntRange(min=1), default=500, show_default=True,
              help="Messages between check generations.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random choice.")
@click.option("--target-stage", type=click.IntRange(min=0), default=1, show_default=True,
              help="Index of the stage to fuzz (stage 1 receives activations).")
@click.option("--stages", type=click.IntRange(min=1), default=2, show_default=True,
              help="Stages of the pipeline this tool starts.")
@click.option("--model", default=None,
              help="GGUF path or alias for the pipeline this tool starts (default: a tiny random Gemma 3).")
@click.option("--topology", "topology_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Fuzz running workers of this topology instead (this tool binds the driver's return endpoint).")
@click.option("--stage", default=None, help="With --topology: the stage to fuzz (id or index).")
@click.option("--pid", type=int, default=None, help="With --topology: the fuzzed worker's pid (crash and RSS watch).")
@click.option("--worker-log", type=click.Path(dir_okay=False, exists=True), default=None,
              help="With --topology: the fuzzed worker's stderr log (traceback watch).")
@click.option("--hang-timeout", "hang_timeout_s", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a marker, Stop or check step may go unanswered before the stage counts as hung.")
@click.option("--big-frame-mib", type=click.FloatRange(min=4.0), default=4.0, show_default=True,
              help="Size of the big_frame mutation's frame.")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the workers' logs, topology and reproducers here (default: a temporary directory, "
                   "kept only when something went wrong).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
def main(messages: int, check_every: int, seed: int, target_stage: int, stages: int, model: str | None,
         topology_path: str | None, stage: str | None, pid: int | None, worker_log: str | None,
         hang_timeout_s: float, big_frame_mib: float, log_dir: str | None, as_json: bool, quiet: bool) -> None:
    """Run one campaign and print its summary."""
    interrupt_on_sigterm()  # as Ctrl-C: the workers are stopped, the summary printed
    say = progress(quiet)
    directory = run_directory(log_dir, "fuzz-stage-")
    logs = LogWatch("", copy_to=directory / "workers.log")
    options = CampaignOptions(messages=messages, check_every=check_every, seed=seed, hang_timeout_s=hang_timeout_s)
    setup: Setup | None = None
    link: Link | None = None
    try:
        setup = _setup(topology_path=topology_path, stage=stage, pid=pid, model=model, stages=stages,
                       target_stage=target_stage, directory=directory, logs=logs, worker_log=worker_log, say=say)
        from skippy_zmq.model.gguf_model import read_hparams
        from skippy_zmq.tokens.tokenizer import Tokenizer

        hparams = read_hparams(setup.model_path)
        target = Target.of(setup.topology, setup.stage_key, hparams.n_embd, hparams.n_vocab,
                           big_frame_bytes=round(big_frame_mib * (1 << 20)))
        logs.target_stage_id = target.stage.stage_id
        prompt = Tokenizer.from_gguf(setup.model_path).encode(CHECK_PROMPT)
        ledger = Ledger(target.index, target.frame_limit)
        link = Link(setup.topology, target, ledger)
        say(f"fuzzing {target.stage.label} with {messages} messages (seed {seed}); logs in {directory}")
        campaign = Campaign(target, link, ledger, setup.workers, logs, prompt, options, dump_dir=directory, say=say)
        campaign.run()
    except SkippyError as exc:
        click.echo(f"fuzz_stage: {exc}", err=True)
        sys.exit(EXIT_NOT_STARTED)
    finally:
        if link is not None:
            link.close()
        if setup is not None and setup.pipeline is not None:
            setup.pipeline.stop()  # holds Ctrl-C until every worker is stopped
        logs.close()
    report = build_report(campaign, str(setup.model_path))
    finish(report, render, as_json=as_json, directory=directory, keep=log_dir is not None,
           interrupted=campaign.interrupted, say=say, kept="the workers' logs and reproducers")


if __name__ == "__main__":
    main()
