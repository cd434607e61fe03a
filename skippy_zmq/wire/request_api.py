"""The ZeroMQ request API's frames, shared by the gateway and `skippy_zmq.Client`: version, limits,
JSON encoding, typed errors by code, and the value classes of its answers (docs/PROTOCOL.md §8).
No sockets.
"""

from __future__ import annotations

import array
import base64
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import attrs

from skippy_zmq.errors import (
    GatewayBusy,
    GatewayCancelled,
    GatewayError,
    GatewayRequestError,
    GatewayTimeout,
    GatewayUnavailable,
    WireError,
)

PROTOCOL_VERSION = 1
"""The request API version this module speaks (`"v"` of every frame)."""
MAX_FRAME_BYTES = 1 << 20
"""Largest request frame the gateway reads; a larger one is answered with a 413 error frame."""
MAX_ID_CHARS = 128
"""Longest request id, in characters."""
MAX_WAITING_IDS = 256
"""Most request ids one ping names in `waiting` (the gateway refuses a longer list)."""
RESERVED_FIELDS = frozenset({"v", "type", "id"})
"""Frame fields the client sets itself; a request parameter may not name them."""
JsonObject: TypeAlias = dict[str, Any]
_ERRORS_BY_CODE: Mapping[int, type[GatewayError]] = {
    400: GatewayRequestError,
    404: GatewayRequestError,
    409: GatewayRequestError,
    413: GatewayRequestError,
    429: GatewayBusy,
    499: GatewayCancelled,
    503: GatewayUnavailable,
    504: GatewayTimeout,
}


def encode_frame(frame: Mapping[str, Any]) -> bytes:
    """One protocol frame as compact UTF-8 JSON. A lone surrogate (not Unicode text, so not UTF-8)
    goes out as its JSON escape, which the gateway refuses naming the field (docs/PROTOCOL.md
    §8.1), rather than as an encoding error in place of the frame."""
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def error_from_frame(frame: Mapping[str, Any]) -> GatewayError:
    """The typed exception of an `error` frame, chosen by its code (never by its text)."""
    code = frame.get("code")
    code = code if isinstance(code, int) and not isinstance(code, bool) else 500
    kind, param, request_id = frame.get("error"), frame.get("param"), frame.get("id")
    return _ERRORS_BY_CODE.get(code, GatewayError)(
        str(frame.get("message", "the gateway reported an error")),
        code=code,
        kind=kind if isinstance(kind, str) else "internal_error",
        param=param if isinstance(param, str) else None,
        request_id=request_id if isinstance(request_id, str) else None,
    )


@attrs.frozen
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens a kept session held (docs/PROTOCOL.md §6, Prompt cache)

    @classmethod
    def from_json(cls, usage: Mapping[str, Any]) -> Usage:
        """From a final frame's `usage` object."""
        prompt, completion = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details")
        cached = int(details.get("cached_tokens", 0)) if isinstance(details, Mapping) else 0
        return cls(prompt, completion, int(usage.get("total_tokens", prompt + completion)), cached)


def _non_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise WireError(f"request API frame: {attribute.name} {value} must be >= 0")


def _logprob(value: Any) -> float:
    """A logprob as a frame carries it: null is minus infinity (JSON has no infinities)."""
    return -math.inf if value is None else float(value)


@attrs.frozen
class TokenLogprob:
    """One generated token's log probability and its most likely alternatives, best first. Tokens
    are ids, not text: the client has no tokenizer (`Client.detokenize` turns ids into text)."""

    token: int = attrs.field(validator=_non_negative)
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> TokenLogprob:
        """From one entry of a frame's `logprobs` list: `{"token", "logprob", "top": [[id, logprob], ...]}`."""
        top = tuple((int(token), _logprob(logprob)) for token, logprob in item["top"])
        return cls(int(item["token"]), _logprob(item["logprob"]), top)


def _logprobs(value: Any) -> tuple[TokenLogprob, ...] | None:
    """A frame's `logprobs` list (None when the frame has none: the request did not ask)."""
    return None if value is None else tuple(TokenLogprob.from_json(item) for item in value)


@attrs.frozen
class ToolCallMade:
    """A tool call an answer made: its id, the tool's name, the arguments as JSON text."""

    id: str
    name: str
    arguments: str

    @classmethod
    def from_json(cls, call: Mapping[str, Any]) -> ToolCallMade:
        """From one entry of a final frame's `tool_calls` (OpenAI's shape)."""
        function = call["function"]
        return cls(str(call["id"]), str(function["name"]), str(function["arguments"]))


@attrs.frozen
class Choice:
    """One of a request's `n` choices: its text and tokens, why it stopped, its logprobs when asked,
    for a request with tools the calls it made, for a thinking model its thought, and then the text that
    was neither (`content`)."""

    index: int = attrs.field(validator=_non_negative)
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCallMade, ...] = ()
    content: str | None = None  # with tool calls or a thought: the text beside them; None: `text` is all content
    reasoning_content: str | None = None  # a thinking model's thought, read apart from `content`

    @classmethod
    def from_json(cls, choice: Mapping[str, Any]) -> Choice:
        """From one entry of a final frame's `choices` list (or the final frame itself, for choice 0)."""
        return cls(
            index=int(choice.get("index", 0)),
            text=str(choice["text"]),
            token_ids=tuple(int(token) for token in choice["token_ids"]),
            finish_reason=str(choice["finish_reason"]),
            logprobs=_logprobs(choice.get("logprobs")),
            tool_calls=tuple(ToolCallMade.from_json(call) for call in choice.get("tool_calls") or ()),
            content=None if choice.get("content") is None else str(choice["content"]),
            reasoning_content=None if choice.get("reasoning_content") is None else str(choice["reasoning_content"]),
        )


@attrs.frozen
class Completion:
    """A finished request: its (first choice's) whole text and tokens, why it stopped, its token
    counts, its logprobs when asked, and every choice (one unless the request asked for `n` > 1)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    model: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None
    choices: tuple[Choice, ...] = attrs.field()

    @choices.default
    def _one_choice(self) -> tuple[Choice, ...]:
        return (Choice(0, self.text, self.token_ids, self.finish_reason, self.logprobs),)

    @property
    def tool_calls(self) -> tuple[ToolCallMade, ...]:
        """The (first choice's) tool calls; none for a request without tools."""
        return self.choices[0].tool_calls

    @property
    def content(self) -> str | None:
        """The (first choice's) text beside its calls or thought; None when `text` is all content."""
        return self.choices[0].content

    @property
    def reasoning_content(self) -> str | None:
        """The (first choice's) thought; None when it had none."""
        return self.choices[0].reasoning_content

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any]) -> Completion:
        """From a `final` frame (its `choices` list when the request asked for `n` > 1)."""
        first = Choice.from_json(frame)
        choices = (first,) if frame.get("choices") is None else tuple(Choice.from_json(c) for c in frame["choices"])
        return cls(
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            usage=Usage.from_json(frame["usage"]),
            model=str(frame.get("model", "")),
            logprobs=choices[0].logprobs if frame.get("choices") is not None else first.logprobs,
            choices=choices,
        )

    def with_streamed_logprobs(self, streamed: Mapping[int, Sequence[TokenLogprob]]) -> Completion:
        """With the logprobs a streamed request's deltas carried, by choice (its final frame has none)."""
        if not streamed:
            return self
        choices = tuple(choice if choice.logprobs is not None
                        else attrs.evolve(choice, logprobs=tuple(streamed.get(choice.index, ())))
                        for choice in self.choices)
        return attrs.evolve(self, logprobs=choices[0].logprobs, choices=choices)


@attrs.frozen
class StreamDelta:
    """New output of a streamed request, of choice `choice`; the closing ones (one per choice)
    carry `finish_reason`, and the last of them the request's `usage`."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    choice: int = attrs.field(default=0, validator=_non_negative)
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when the request asked

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any]) -> StreamDelta:
        """From a `delta` frame (`choice` is 0 when the frame has none)."""
        return cls(str(frame["text"]), tuple(int(token) for token in frame["token_ids"]),
                   choice=int(frame.get("choice", 0)), logprobs=_logprobs(frame.get("logprobs")))

    @classmethod
    def closing(cls, completion: Completion, *, logprobs: bool = False) -> tuple[StreamDelta, ...]:
        """The closing deltas of a stream: no new text; each choice's finish reason, in choice order,
        and the request's usage on the last; `logprobs` (the request asked for them): () rather than None."""
        last = len(completion.choices) - 1
        return tuple(
            cls("", (), choice.finish_reason, completion.usage if index == last else None, choice.index,
                () if logprobs else None)
            for index, choice in enumerate(completion.choices)
        )


def tokens_from_frame(frame: Mapping[str, Any]) -> tuple[int, ...]:
    """The ids of a `tokens` frame (the answer to `tokenize`)."""
    return tuple(int(token) for token in frame["tokens"])


def content_from_frame(frame: Mapping[str, Any]) -> str:
    """The text of a `text` frame (the answer to `detokenize`)."""
    content = frame["content"]
    if not isinstance(content, str):
        raise TypeError(f"content must be a string, got {type(content).__name__}")
    return content


def _vector(value: Any) -> tuple[float, ...]:
    """One `embedding` entry's vector: a list of numbers, or base64 of little-endian float32 bytes."""
    if isinstance(value, str):
        values = array.array("f", base64.b64decode(value, validate=True))  # ValueError unless whole float32s
        if sys.byteorder == "big":
            values.byteswap()
        return tuple(values.tolist())
    if not isinstance(value, list) or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in value):
        raise TypeError(f"embedding must be a list of numbers or a base64 string, got {value!r:.80}")
    # a float32 written as its shortest decimal reads back as a float64 near it: round to the float32
    return tuple(array.array("f", value).tolist())


def _rows(_: object, attribute: attrs.Attribute[tuple[tuple[float, ...], ...]],
          value: tuple[tuple[float, ...], ...]) -> None:
    widths = {len(row) for row in value}
    if len(value) < 1 or len(widths) != 1 or 0 in widths:
        raise WireError(f"request API frame: {attribute.name} must hold at least one vector, every one of the same "
                        f"non-zero width; got {len(value)} of widths {sorted(widths)}")


@attrs.frozen
class Embeddings:
    """The answer to an embed: one vector per input, in input order (`usage.completion_tokens` is 0).

    Vectors are tuples of floats, each value the engine's float32 exactly however it travelled, so
    the value is immutable and comparable like the protocol's other answers, and the client needs
    no numpy (`import skippy_zmq` stays light); `numpy.asarray(e.vectors, dtype=numpy.float32)` is
    the (inputs, n_embd) array, without loss.
    """

    vectors: tuple[tuple[float, ...], ...] = attrs.field(validator=_rows)
    model: str
    usage: Usage

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any]) -> Embeddings:
        """From an `embedding` frame: its `data` entries hold every index 0..n-1 once (any order)."""
        data = frame["data"]
        if not isinstance(data, list):
            raise TypeError(f"data must be a list, got {data!r:.80}")
        by_index = {int(entry["index"]): entry["embedding"] for entry in data}
        if sorted(by_index) != list(range(len(data))):
            raise ValueError(f"data indexes {sorted(by_index)!r:.80} are not 0..{len(data) - 1}, each once")
        usage = frame["usage"]
        prompt = int(usage["prompt_tokens"])
        return cls(tuple(_vector(by_index[index]) for index in range(len(data))), str(frame.get("model", "")),
                   Usage(prompt, 0, int(usage.get("total_tokens", prompt))))


@attrs.frozen
class GatewayInfo:
    """What a gateway serves: its model, context, readiness and protocol limits."""

    model: str
    ctx_size: int | None  # None while the pipeline is still starting
    ready: bool
    versions: tuple[int, ...]
    max_frame_bytes: int
    client_silence_s: float

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any]) -> GatewayInfo:
        """From an `info` frame."""
        return cls(
            model=str(frame["model"]),
            ctx_size=None if frame["ctx_size"] is None else int(frame["ctx_size"]),
            ready=bool(frame["ready"]),
            versions=tuple(int(v) for v in frame["versions"]),
            max_frame_bytes=int(frame["max_frame_bytes"]),
            client_silence_s=float(frame["client_silence_s"]),
        )
