"""Hypothesis strategies shared by the byte-format and request-parsing tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from skippy_zmq.tokens.constraint import Constraint, ConstraintKind
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.wire.codecs import ActivationCodec
from skippy_zmq.wire.frames import PART_OPTIONAL, ActivationFrame, FrameDesc, GGMLType, PartDesc
from skippy_zmq.wire.messages import MAX_DRAFT_TOKENS, MessageKind, StageMessage, StateHeader, encode_activation
from skippy_zmq.wire.options import GenerationOptions
from skippy_zmq.wire.replies import Reply, ReplyKind, StageLoad
from skippy_zmq.wire.trace import TraceRecord

U64 = st.integers(0, 2**64 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
U32 = st.integers(0, 2**32 - 1)
F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def part_descs(draw: st.DrawFn, identity: int, token_count: int, primary: bool = False) -> PartDesc:
    """A valid part descriptor covering `token_count` tokens (small dims to keep tests fast)."""
    ggml_type = GGMLType.F32 if primary else draw(st.sampled_from(list(GGMLType)))
    rank = 2 if primary else draw(st.integers(1, 4))
    token_axis = rank - 1 if primary else draw(st.integers(0, rank - 1))
    dims = [draw(st.integers(1, 5)) for _ in range(rank)]
    dims[token_axis] = token_count
    flags = 0 if primary else draw(st.sampled_from([0, PART_OPTIONAL]))
    return PartDesc(identity=identity, ggml_type=ggml_type, dims=tuple(dims), token_axis=token_axis, flags=flags)


def _values(draw: st.DrawFn, part: PartDesc, finite_range: float | None) -> np.ndarray:
    count = part.n_elements
    if part.ggml_type is GGMLType.F32:
        if finite_range is None:
            raw = draw(st.lists(U32, min_size=count, max_size=count))
            return np.array(raw, dtype="<u4").view("<f4").reshape(part.shape)
        floats = st.floats(-finite_range, finite_range, width=32)
        return np.array(draw(st.lists(floats, min_size=count, max_size=count)), dtype="<f4").reshape(part.shape)
    if part.ggml_type is GGMLType.I32:
        return np.array(draw(st.lists(I32, min_size=count, max_size=count)), dtype="<i4").reshape(part.shape)
    bits = draw(st.lists(st.integers(0, 0xFFFF), min_size=count, max_size=count))
    return np.array(bits, dtype="<u2").view(part.ggml_type.dtype).reshape(part.shape)


@st.composite
def activation_frames(
    draw: st.DrawFn,
    token_count: int | None = None,
    producer: int | None = None,
    finite_range: float | None = None,
    max_parts: int = 16,
) -> ActivationFrame:
    """A valid frame with 1..max_parts parts of mixed types; F32 values are any bit pattern
    unless `finite_range` bounds them."""
    tokens = token_count if token_count is not None else draw(st.integers(1, 4))
    n_parts = draw(st.integers(1, max_parts))
    identities = draw(st.lists(U32, min_size=n_parts, max_size=n_parts, unique=True))
    parts = [draw(part_descs(identities[0], tokens, primary=True))]
    parts += [draw(part_descs(identity, tokens)) for identity in identities[1:]]
    layer_start = draw(st.integers(0, 100))
    desc = FrameDesc(
        producer_stage_index=producer if producer is not None else draw(st.integers(0, 64)),
        layer_start=layer_start,
        layer_end=layer_start + draw(st.integers(1, 50)),
        token_count=tokens,
        parts=tuple(parts),
        sequence_count=draw(st.integers(1, 4)),
    )
    return ActivationFrame(desc, tuple(_values(draw, part, finite_range) for part in parts))


sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0, 4, width=32),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0.0625, 1, width=32),
    min_p=st.floats(0, 1, width=32),
    repeat_penalty=st.floats(0.5, 2, width=32),
    penalty_last_n=st.integers(0, 4096),
    seed=U64,
    ignore_eos=st.booleans(),
)

logit_biases = st.lists(st.tuples(st.integers(0, 262_143), st.floats(-100, 100, width=32)), max_size=8,
                        unique_by=lambda pair: pair[0]).map(lambda pairs: tuple(sorted(pairs)))

full_sampling_params = st.builds(
    lambda base, presence, frequency, bias: attrs.evolve(base, presence_penalty=presence,
                                                         frequency_penalty=frequency, logit_bias=bias),
    sampling_params, st.floats(-2, 2, width=32), st.floats(-2, 2, width=32), logit_biases,
)

constraints = st.one_of(
    st.just(Constraint.json_object()),
    st.builds(Constraint, st.sampled_from([k for k in ConstraintKind if k is not ConstraintKind.JSON_OBJECT]),
              st.text(min_size=1, max_size=300).filter(lambda t: bool(t.strip()))),
)

generation_options = st.builds(
    GenerationOptions,
    sampling=full_sampling_params,
    logprobs=st.none() | st.integers(0, 20),
    embedding=st.none() | st.sampled_from(list(Pooling)),
    keep_logits=st.booleans(),
    fork_from=st.none() | st.integers(1, 2**64 - 1),
    constraint=st.none() | constraints,
    progress=st.booleans(),
)

trace_records = st.builds(
    TraceRecord,
    stage_index=st.integers(0, 64),
    received_at_us=U64,
    sent_at_us=U64,
    queue_us=U32,
    decode_us=U32,
    compute_us=U32,
    encode_us=U32,
    bytes_in=U64,
    bytes_out=U64,
)


@st.composite
def stage_messages(draw: st.DrawFn, with_activation: bool | None = None) -> StageMessage:
    """Any valid stage message: every kind, full-range ids, empty or non-empty sidebands."""
    kind = draw(st.sampled_from(list(MessageKind)))
    options = draw(st.none() | generation_options)
    session_id = draw(U64)
    if kind is MessageKind.FORK_SESSION:  # names another session to copy from (§2.6)
        source = draw(st.integers(1, 2**64 - 1).filter(lambda s: s != session_id))
        options = attrs.evolve(options or GenerationOptions(), fork_from=source)
    if kind.carries_tokens:
        count = {MessageKind.DECODE_EMBD: 1, MessageKind.VERIFY_EMBD: draw(st.integers(2, MAX_DRAFT_TOKENS + 1))
                 }.get(kind) or draw(st.integers(1, 6))
        tokens = draw(st.lists(I32, min_size=count, max_size=count))
        positions = draw(st.sampled_from([[], list(range(count))]))
    else:
        count = draw(st.integers(0, 4096)) if kind in (MessageKind.TRIM_SESSION, MessageKind.FORK_SESSION) else 0
        tokens, positions = [], []
    state = StateHeader.for_kind(
        kind,
        seq_id=draw(st.integers(0, 1000)),
        prompt_token_count=draw(st.integers(0, 10_000)),
        decode_step=draw(st.integers(-1, 10_000)),
        current_token=draw(st.integers(-1, 262_143)),
        options=options is not None,
    )
    activation = None
    source = -1
    carry = kind.carries_tokens and (with_activation if with_activation is not None else draw(st.booleans()))
    if carry:
        source = draw(st.integers(0, 64))
        codec = draw(st.sampled_from(list(ActivationCodec)))
        bounded = None if codec is ActivationCodec.RAW_F32_V1 else 60_000.0
        frame = draw(activation_frames(token_count=count, producer=source, finite_range=bounded))
        activation = encode_activation(codec, frame)
    state = _evolve_state(state, source, int(activation.codec) if activation else 0)
    return StageMessage(
        kind=kind,
        pos_start=draw(st.integers(0, 2**31 - 1)),
        token_count=count,
        state=state,
        request_id=draw(U64),
        session_id=session_id,
        options=options,
        tokens=tokens,
        positions=positions,
        activation=activation,
        trace=draw(st.lists(trace_records, max_size=4)),
    ).with_pass_continues(draw(st.booleans()))


def _evolve_state(state: StateHeader, source: int, codec: int) -> StateHeader:
    return attrs.evolve(state, source_stage_index=source, activation_codec=codec)


@st.composite
def replies(draw: st.DrawFn) -> Reply:
    """Any valid reply."""
    kind = draw(st.sampled_from(list(ReplyKind)))
    error = draw(st.text(min_size=1, max_size=200)) if kind is ReplyKind.ERROR else ""
    tokens: list[Any] = draw(st.lists(I32, max_size=8)) if kind is ReplyKind.PREDICTED_TOKENS else []
    token = draw(st.integers(-1, 262_143))
    logprobs = None
    alternatives = st.lists(st.tuples(st.integers(0, 262_143), st.floats(-1e4, 0, width=32)), max_size=20)
    if kind is ReplyKind.PREDICTED_TOKEN and draw(st.booleans()):
        logprobs = TokenLogprobs(token, draw(st.floats(-1e4, 0, width=32)), tuple(draw(alternatives)))
    run = []  # a verification's answer: each token's logprobs (§2.4)
    if kind is ReplyKind.PREDICTED_TOKENS and draw(st.booleans()):
        run = [TokenLogprobs(t, draw(st.floats(-1e4, 0, width=32)), tuple(draw(alternatives))) for t in tokens]
    embedding = None
    if kind is ReplyKind.EMBEDDING:
        embedding = draw(hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(-1, 1, width=32)))
    heartbeat = kind is ReplyKind.ACK and draw(st.booleans())  # request 0, answering nothing: may carry a load
    load = draw(st.none() | st.builds(StageLoad, U64, st.integers(0, 2**32 - 1))) if heartbeat else None
    return Reply(
        kind=kind,
        request_id=0 if heartbeat else draw(U64),
        session_id=draw(U64),
        stage_index=draw(st.integers(-1, 64)),
        answered=None if heartbeat else draw(st.none() | st.sampled_from(list(MessageKind))),
        decode_step=draw(st.integers(-1, 10_000)),
        predicted_token=token,
        tokens=tokens,
        error=error,
        trace=draw(st.lists(trace_records, max_size=4)),
        logprobs=logprobs,
        token_logprobs=run,
        embedding=embedding,
        pass_continues=draw(st.booleans()),
        load=load,
    )


# --- hostile request JSON ----------------------------------------------------------------------


@attrs.frozen
class JsonLiteral:
    """JSON text written into a document as it is: here, integers Python cannot convert."""

    text: str


HUGE_INTEGERS = st.sampled_from([JsonLiteral("9" * 4301), JsonLiteral("-" + "1" * 5000), JsonLiteral("7" * 20_000)])
"""Integer literals beyond Python's 4,300-digit conversion limit."""
_PIECES = ["a", " ", "\u00e9", "\ud800", "\udfff", "\udc00", "\ud83d", "\ud83d\ude00", "<eos>", "\x00"]
# Python strings: a lone surrogate written to JSON by json.dumps becomes a \udXXX escape; a pair
# ("\ud83d\ude00") becomes two escapes that JSON reads back as one character (valid text).
HOSTILE_TEXT = st.text(max_size=6) | st.lists(st.sampled_from(_PIECES), max_size=5).map("".join)
"""Text with lone surrogates (as keys and values), surrogate pairs, and ordinary characters."""


def json_text(value: Any) -> str:
    """JSON text of `value`; strings escaped as json.dumps does (lone surrogates as escapes)."""
    if isinstance(value, JsonLiteral):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(key)}:{json_text(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(json_text(item) for item in value) + "]"
    return json.dumps(value)


def hostile_json(keys: Sequence[str], fixed: dict[str, st.SearchStrategy[Any]] | None = None, *,
                 extra: int = 5) -> st.SearchStrategy[bytes]:
    """A JSON document as bytes: mostly an object with `fixed` fields (if given) and keys drawn from
    `keys` or arbitrary (lone surrogates included), whose values are any JSON at any depth, with
    lone surrogates in strings and integer literals beyond Python's conversion limit; at most
    `extra` keys besides the fixed ones."""
    leaves = (st.none() | st.booleans() | st.integers() | st.integers(0, 8) | HUGE_INTEGERS
              | st.floats(allow_nan=False) | st.floats(0, 2) | HOSTILE_TEXT)
    values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.sampled_from(keys) | HOSTILE_TEXT, inner, max_size=3), max_leaves=10)
    names = st.sampled_from(keys) | HOSTILE_TEXT
    objects = st.builds(lambda head, tail: {**head, **tail}, st.fixed_dictionaries(fixed or {}),
                        st.dictionaries(names, values, max_size=extra))
    return (objects | values).map(lambda document: json_text(document).encode("utf-8"))
